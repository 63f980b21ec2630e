"""The engine's control surface: what rules (and operators) may change while it serves.

Every action is posted to a mailbox from any thread and applied by the engine thread at a step
boundary, so it never races a forward pass. Each answers a Future of `ActionResult` with the
knobs before and after. Actions are idempotent (applying one twice changes nothing the second
time), reversible, and lose no request: evicted or cut sequences are swapped or recomputed.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class ActionResult:
    action: str
    before: dict[str, Any]
    after: dict[str, Any]
    detail: str = ""
    ok: bool = True  # False: refused, with the reason in `detail`
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.before != self.after


class Mailbox:
    """Commands from other threads, run by the engine thread in arrival order."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self.notify: Callable[[], None] = lambda: None  # the engine loop wakes on a post

    def post(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._q.put((fn, fut))
        self.notify()
        return fut

    def pending(self) -> bool:
        return not self._q.empty()

    def refuse_pending(self, error: BaseException) -> int:
        """Fail every waiting call with `error` without running it (the engine can no longer
        act); returns how many callers were told."""
        n = 0
        while True:
            try:
                _fn, fut = self._q.get_nowait()
            except queue.Empty:
                return n
            if fut.set_running_or_notify_cancel():  # False: its caller cancelled it
                fut.set_exception(error)
                n += 1

    def drain(self) -> int:
        n = 0
        while True:
            try:
                fn, fut = self._q.get_nowait()
            except queue.Empty:
                return n
            n += 1
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller gets it through the Future
                fut.set_exception(e)
