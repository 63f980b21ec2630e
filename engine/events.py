"""Engine events (preempted, swapped_out/in, engine_oom, engine_oom_repeated,
engine_step_failed, admission_halted/resumed, kv_dtype_switched, kv_pool_resized, knob_changed,
step_budget_restored): kept in a bounded ring and handed to subscribers.

Subscribers run on the engine thread, so they must only enqueue (the daemon's audit writer and
rule evaluator do exactly that); a subscriber that raises is logged and kept away from the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvguard.engine.events")
_monotonic = time.monotonic


@dataclass(slots=True, frozen=True)
class EngineEvent:
    """`time`: when it happened on the wall clock (the audit's timestamps); `monotonic`: the
    same instant on the monotonic clock, for any arithmetic between events (a window, a
    rate), which a step of the wall clock (NTP, `date -s`) must not bend."""

    kind: str
    data: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    monotonic: float = field(default_factory=_monotonic)  # (the field `time` hides the module)


class EventBus:
    def __init__(self, capacity: int = 4096) -> None:
        self._ring: deque[EngineEvent] = deque(maxlen=capacity)
        self._subscribers: list[Callable[[EngineEvent], None]] = []
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def subscribe(self, fn: Callable[[EngineEvent], None]) -> None:
        with self._lock:
            self._subscribers.append(fn)

    def emit(self, kind: str, **data: Any) -> None:
        event = EngineEvent(kind, data)
        with self._lock:
            self._ring.append(event)
            self.counts[kind] = self.counts.get(kind, 0) + 1
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(event)
            except Exception:  # noqa: BLE001 - a broken subscriber must not stop the engine
                log.exception("event subscriber failed on %s", kind)

    def recent(self, kind: str | None = None) -> list[EngineEvent]:
        with self._lock:
            return [e for e in self._ring if kind is None or e.kind == kind]
