"""How rank 0 waits for a pipeline stage's gloo transfer (`parallel_state.wait_watched`): the
wait runs in the process's one waiter thread, not a thread per transfer, while the caller
calls its watch; a failed wait is raised in the caller, and a watch that raises ends the
caller's wait without leaving the next transfer queued behind the abandoned one.

The transfer is a stand-in for gloo's work handle (`wait(timeout)`) whose wait ends when the
test says, so each case is ordered by events, not by timing. The real gloo path (a dead or
silent stage named while rank 0 waits) is tests/test_pipeline_parallel.py's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest

from kvguard.engine.distributed.parallel_state import TRANSFER_WAIT, wait_watched

GIVE_UP_CALLS = 20  # watch calls after which a transfer queued behind a stuck one is let go


class HeldTransfer:
    """A posted transfer whose `wait` blocks until `release` is set (its data arrived, or its
    connection closed: then it raises `error`), noting the thread it ran in."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.release = threading.Event()
        self.entered = threading.Event()
        self.waited_in: threading.Thread | None = None
        self.timeouts: list[timedelta] = []

    def wait(self, timeout: timedelta) -> bool:
        self.timeouts.append(timeout)
        self.waited_in = threading.current_thread()
        self.entered.set()
        self.release.wait()
        if self.error is not None:
            raise self.error
        return True


class StageDead(Exception):
    """What the driver's watch raises once a stage is dead or silent."""


def releasing(work: HeldTransfer, calls: list[int] | None = None) -> Callable[[], None]:
    """A watch that lets `work` arrive when it is first called: the wait can end only after
    the watch ran while it waited."""

    def watch() -> None:
        if calls is not None:
            calls.append(1)
        work.release.set()

    return watch


def test_transfers_share_one_waiter_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five transfers (five pipeline steps) start at most one thread between them (none where
    the process's waiter runs already), all wait in that one thread, not the caller's, with
    the transfer timeout, and the watch runs while each waits."""
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    transfers = [HeldTransfer() for _ in range(5)]
    for work in transfers:
        calls: list[int] = []
        wait_watched(work, releasing(work, calls))
        assert calls, "the wait ended without the watch being called"
    assert len(started) <= 1, started
    waiters = {work.waited_in for work in transfers}
    assert len(waiters) == 1 and threading.current_thread() not in waiters
    assert all(work.timeouts == [TRANSFER_WAIT] for work in transfers)


def test_a_failed_wait_is_raised_in_the_caller() -> None:
    """gloo's error (a peer's connection closed) reaches the caller, and the waiter goes on
    serving the next transfer."""
    failed = HeldTransfer(RuntimeError("Connection closed by peer [127.0.0.1]:29500"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_watched(failed, releasing(failed))
    after = HeldTransfer()
    wait_watched(after, releasing(after))
    assert after.waited_in is failed.waited_in


def test_a_watch_that_raises_ends_the_wait_and_frees_the_next_transfer() -> None:
    """The watch names a dead stage while the transfer is still waiting: that is raised in the
    caller at once. The abandoned wait goes on (a gloo wait cannot be cut short) until the
    group's teardown closes its connection, and its thread then ends; the next transfer
    waits in a fresh thread meanwhile, not queued behind it."""
    stuck = HeldTransfer()

    def dead() -> None:
        stuck.entered.wait()  # the waiter is inside the transfer's wait
        raise StageDead("rank 1 failed")

    with pytest.raises(StageDead, match="rank 1 failed"):
        wait_watched(stuck, dead)
    assert not stuck.release.is_set()

    following = HeldTransfer()
    calls: list[int] = []

    def watch() -> None:  # lets `stuck` go too if `following` is still queued behind it
        releasing(following, calls)()
        if len(calls) >= GIVE_UP_CALLS:
            stuck.release.set()

    wait_watched(following, watch)
    assert following.waited_in is not stuck.waited_in, "queued behind the abandoned wait"

    stuck.release.set()  # the group torn down: the abandoned wait ends
    assert stuck.waited_in is not None
    stuck.waited_in.join(timeout=60)
    assert not stuck.waited_in.is_alive()
