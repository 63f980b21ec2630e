"""The engine's control surface: what rules (and operators) may change while it serves.

Every action is posted to a mailbox from any thread and applied by the engine thread at a step
boundary, so it never races a forward pass. Each answers a Future of `ActionResult` with the
knobs before and after. Actions are idempotent (applying one twice changes nothing the second
time), reversible, and lose no request: evicted or cut sequences are swapped or recomputed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

# What an action's result names the requests it touched by, in its data: those it took off the
# device, [[request id, "swap" or "recompute"], ...] (a batch cut's, a pool shrink's, an
# eviction's), and the count of live requests a cap gave another length limit. A change even
# where no knob moved.
REQUESTS_MOVED = ("preempted", "evicted")
REQUESTS_ADJUSTED = "adjusted"


@dataclass(slots=True, frozen=True)
class ActionResult:
    action: str
    before: dict[str, Any]
    after: dict[str, Any]
    detail: str = ""
    ok: bool = True  # False: refused, with the reason in `detail`
    data: dict[str, Any] = field(default_factory=dict)
    # The engine changed what its knobs do not show: what a remedy holds (a batch cut lifted
    # at the limit in force, which a reload raising the configured limit would have kept; the
    # pool share the next dtype switch sizes its pool by). Said by the engine, which alone
    # sees it: `before` and `after` are the knobs an operator reads.
    changed_beyond_knobs: bool = False

    def changed_nothing(self) -> bool:
        """Whether an action that applied left the engine as it found it: the same knobs and
        records of what remedies hold after it, and no request preempted, evicted or given another length
        limit (FP8 on an FP8 pool, a halt as strict as the one in force, a batch limit or cap
        equal to the one in force, an undo with nothing to undo, an eviction that found
        nothing to evict). The one test of it: an operator's such action is audited and
        counted `held` and answers `changed` false, and a rule's one-off gives the tick's
        escalation back (no effect to wait for). A result with no knobs (one that tells
        nothing: a replay's simulated one) counts as a change."""
        if not self.ok or not self.before or self.changed_beyond_knobs:
            return False
        touched = any(self.data.get(key) for key in (*REQUESTS_MOVED, REQUESTS_ADJUSTED))
        return self.before == self.after and not touched


class Mailbox:
    """Commands from other threads, run by the engine thread in arrival order.

    A caller that stops waiting for a command may withdraw it (`Future.cancel`, or `withdraw`
    for several posted together): one withdrawn before the engine took it never runs; one the
    engine has started cannot be withdrawn, and its result is the truth. `drain` skips the
    withdrawn. The lock makes the engine's taking of a command and a withdrawal of several
    exclusive, so that a group is withdrawn whole or not at all."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self.notify: Callable[[], None] = lambda: None  # the engine loop wakes on a post
        # reentrant: a withdrawn Future's done callbacks run under it, and one may post
        self._lock = threading.RLock()

    def post(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._q.put((fn, fut))
        self.notify()
        return fut

    def pending(self) -> bool:
        return not self._q.empty()

    def withdraw(self, futures: Collection[Future]) -> bool:
        """Withdraw commands posted to this mailbox, all or none: True when none had been
        taken by the engine (each is cancelled and will never run), False when one has (or has
        finished; nothing is withdrawn: the caller waits for their results)."""
        with self._lock:
            if any(f.running() or (f.done() and not f.cancelled()) for f in futures):
                return False
            for f in futures:
                f.cancel()
            return True

    def _take(self, fut: Future) -> bool:
        """The engine takes a command: False when it was withdrawn (it must not run)."""
        with self._lock:
            return fut.set_running_or_notify_cancel()

    def refuse_pending(self, error: BaseException | Callable[[], BaseException]) -> int:
        """Fail every waiting call with `error` (or a fresh one from it, each) without running
        it (the engine can no longer act); returns how many callers were told."""
        n = 0
        while True:
            try:
                _fn, fut = self._q.get_nowait()
            except queue.Empty:
                return n
            if self._take(fut):  # False: its caller withdrew it
                fut.set_exception(error if isinstance(error, BaseException) else error())
                n += 1

    def drain(self) -> int:
        n = 0
        while True:
            try:
                fn, fut = self._q.get_nowait()
            except queue.Empty:
                return n
            n += 1
            if not self._take(fut):  # withdrawn by its caller: never run
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller gets it through the Future
                fut.set_exception(e)
