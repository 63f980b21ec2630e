"""The control plane's clocks: what it schedules and times runs on the monotonic clock, so a step
of the wall clock (chrony's makestep at boot, an operator's `date -s`) neither stops the rules
nor bends a window; and a rule's durations are met at the tick they were meant for, however
late or early in its slot each tick runs.

The wall clock is stepped where the modules involved read it (time.time, and `datetime` in
APScheduler and the control plane); the monotonic clock is the real one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import apscheduler.executors.base
import apscheduler.schedulers.base
import apscheduler.triggers.date
import apscheduler.triggers.interval
import pytest

from kvguard.daemon import control_plane
from kvguard.daemon.audit import AuditStore
from kvguard.daemon.config import load_config
from kvguard.daemon.control_plane import STORM_PREEMPTIONS, STORM_WINDOW_S, ControlPlane, Ticker
from kvguard.engine.events import EngineEvent, EventBus
from kvguard.rules.actions import StopSignal
from tests.test_reload import audit, plane, rules  # noqa: F401 - fixtures
from tests.test_rules import BATCH, EVICT, HEADER, Harness

STEP_S = -3600.0  # the wall clock steps back an hour
WAIT_S = 10.0  # a generous deadline for what takes a second; the bug took an hour


def until(pred: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class WallClock:
    """The wall clock as the scheduler and the control plane read it, steppable."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.offset = 0.0
        clock = self

        class Stepped(datetime):
            @classmethod
            def now(cls, tz=None):  # noqa: ANN001, ANN206
                return datetime.now(tz) + timedelta(seconds=clock.offset)

        for module in (
            apscheduler.schedulers.base,
            apscheduler.triggers.interval,
            apscheduler.triggers.date,
            apscheduler.executors.base,
            control_plane,
        ):
            monkeypatch.setattr(module, "datetime", Stepped)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + clock.offset)

    def step(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> WallClock:
    return WallClock(monkeypatch)


class Running:
    """A started control plane with the engine and NVML left out: an event bus, no snapshot
    (the rules' signal reads as unknown, and every tick is counted), a counted NVML poll."""

    def __init__(self, tmp_path: Path, interval: str) -> None:
        path = tmp_path / "rules.yaml"
        path.write_text(
            f"version: 1\ninterval: {interval}\nsignals: {{kv: {{local: kv_cache_usage_ratio}}}}\n"
            "rules:\n  - {name: halt, signal: kv, above: 0.99, action: halt_admission}\n"
        )
        self.rules = path
        config = tmp_path / "config.yaml"
        config.write_text(
            f"rules: {{path: {path}}}\nmonitoring: {{nvml_poll_interval: 200ms}}\n"
            f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
        )
        cfg = load_config(config)
        self.audit = AuditStore(cfg.audit.url)
        self.audit.start()
        self.polls = 0

        def used_ratio() -> float:
            self.polls += 1
            return 0.1

        engine = SimpleNamespace(events=EventBus(), latest_snapshot=None)
        svc = SimpleNamespace(
            cfg=cfg,
            engine=engine,
            audit=self.audit,
            nvml=SimpleNamespace(memory_used_ratio=used_ratio),
            rules_at_start=None,
            api_port=None,
        )
        self.plane = ControlPlane(svc)  # type: ignore[arg-type]
        self.plane.start()

    @property
    def evaluations(self) -> int:
        return self.plane.evaluator.stats.evaluations

    def close(self) -> None:
        self.plane.stop()
        self.audit.stop(timeout=5)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Callable[[str], Running]]:
    started: list[Running] = []

    def start(interval: str) -> Running:
        started.append(Running(tmp_path, interval))
        return started[-1]

    yield start
    for r in started:
        r.close()


def test_a_backward_wall_clock_step_does_not_stop_the_schedule(
    wall: WallClock, running: Callable[[str], Running]
) -> None:
    """Rule ticks and NVML polls go on at their pace when the wall clock steps back an hour
    just after the start (they were due by the wall clock: none ran for the hour)."""
    r = running("200ms")
    wall.step(STEP_S)
    evaluations, polls = r.evaluations, r.polls
    until(lambda: r.evaluations >= evaluations + 3, "3 rule ticks after the step")
    until(lambda: r.polls >= polls + 3, "3 NVML polls after the step")
    # an event's evaluation (a one-off job on the scheduler) runs too
    before = r.evaluations
    r.plane._soon("engine_oom")
    until(lambda: r.evaluations > before, "the event's evaluation")


def test_a_forward_wall_clock_step_does_not_burst_the_schedule(
    wall: WallClock, running: Callable[[str], Running]
) -> None:
    """A step forward of an hour is no hour of missed ticks to catch up on."""
    r = running("200ms")
    until(lambda: r.evaluations >= 1, "the first rule tick")
    wall.step(-STEP_S)
    t0, evaluations = time.monotonic(), r.evaluations
    until(lambda: r.evaluations >= evaluations + 3, "3 rule ticks after the step")
    ticks = r.evaluations - evaluations
    assert ticks <= (time.monotonic() - t0) / 0.2 + 2, f"{ticks} ticks: a burst"


def test_a_reloaded_interval_applies_at_once(running: Callable[[str], Running]) -> None:
    """Reloading a rule set of the longest interval (2m) to 200ms ticks within a second, not
    at the end of the 2 minutes; a reload that keeps the interval does not push the next tick
    back."""
    r = running("2m")
    r.rules.write_text(r.rules.read_text().replace("interval: 2m", "interval: 200ms"))
    assert r.plane.reload(r.rules, dry_run=False)["rules_reloaded"]
    until(lambda: r.evaluations >= 2, "2 rule ticks at the reloaded interval")
    stop = threading.Event()

    def reload_often() -> None:  # every 50 ms, the same interval: ticks must go on
        while not stop.wait(0.05):
            r.plane.reload(r.rules, dry_run=False)

    reloader = threading.Thread(target=reload_often, daemon=True)
    reloader.start()
    try:
        ticks = r.evaluations
        until(lambda: r.evaluations >= ticks + 3, "3 rule ticks while reloads keep the interval")
    finally:
        stop.set()
        reloader.join(WAIT_S)


def test_a_ticker_coalesces_the_ticks_it_overran() -> None:
    """A tick that overruns 3.5 intervals is followed by one tick at the next grid point, not by
    the 3 it missed back to back; the stop wakes the wait at once."""
    stop = StopSignal()
    offset = [0.0]

    def clock() -> float:  # the monotonic clock, and the overrun added at once
        return time.monotonic() + offset[0]

    calls: list[float] = []
    done = threading.Event()

    def tick() -> None:
        calls.append(clock())
        if len(calls) == 1:
            offset[0] += 3.5  # the first tick takes 3.5 intervals
        if len(calls) == 3:
            done.set()

    ticker = Ticker("test", tick, 1.0, stop, clock=clock)
    t0 = clock()
    ticker.start()
    try:
        assert done.wait(WAIT_S), f"ticks at {[round(c - t0, 3) for c in calls]}"
        first, second, third = (c - t0 for c in calls)
        # bounds that hold however late a loaded machine wakes the ticker: the first tick is
        # not early, the overrun's missed grid points (3, or more where the first tick came
        # late) are passed over, and the ticks after it keep an interval apart, no burst
        assert first >= 0.99, f"ticks at {first}, {second}, {third}"
        assert ticker.coalesced >= 3
        assert second >= first + 3.5, f"a burst after the overrun: {first}, {second}, {third}"
        assert third - second >= 0.5, f"a burst after the overrun: {first}, {second}, {third}"
    finally:
        stop.set()
        ticker.join(WAIT_S)
    assert ticker._thread is not None and not ticker._thread.is_alive()


def test_a_stop_ends_a_tickers_wait_at_once() -> None:
    stop = StopSignal()
    ticker = Ticker("test", lambda: None, 3600.0, stop)
    ticker.start()
    stop.set()
    ticker.join(WAIT_S)
    assert ticker._thread is not None and not ticker._thread.is_alive() and ticker.ticks == 0


# -- durations held across jittery ticks ----------------------------------------------------


def test_for_equal_to_two_intervals_acts_at_the_second_tick_after_pending() -> None:
    """Ticks at 0.003, 5.001, 9.999 (each a few ms off its slot): `for: 10s` acts at the third
    (it acted a tick late, at 15 s)."""
    h = Harness(HEADER + BATCH)
    assert h.at(0.003, 0.95) == [] and h.state("batch") == "pending"
    assert h.at(5.001, 0.95) == []
    assert h.at(9.999, 0.95) == [("batch", "reduce_batch", False)]


def test_a_condition_held_clearly_less_than_for_does_not_act() -> None:
    h = Harness(HEADER + BATCH)
    assert h.at(0, 0.95) == []
    assert h.at(5, 0.95) == []
    assert h.at(9.0, 0.95) == []  # an event's tick, a second short of `for`
    assert h.at(10, 0.95) == [("batch", "reduce_batch", False)]


def test_a_for_shorter_than_the_interval_still_takes_two_readings() -> None:
    h = Harness(HEADER + BATCH.replace("for: 10s", "for: 1s"))
    assert h.at(0, 0.95) == [] and h.state("batch") == "pending"
    assert h.at(0.4, 0.95) == []  # an event's tick: less than half of `for` later
    assert h.at(5, 0.95) == [("batch", "reduce_batch", False)]


def test_recover_for_equal_to_four_intervals_undoes_on_time() -> None:
    h = Harness(HEADER + BATCH.replace("for: 10s", "for: 0s"))
    assert h.at(0, 0.95) == [("batch", "reduce_batch", False)]
    assert h.at(5.003, 0.7) == [] and h.state("batch") == "recovering"
    assert all(h.at(t, 0.7) == [] for t in (10.001, 15.0, 20.002))
    assert h.at(25.001, 0.7) == [("batch", "restore_batch", True)]


def test_recover_for_held_clearly_less_does_not_undo() -> None:
    h = Harness(HEADER + BATCH.replace("for: 10s", "for: 0s"))
    h.at(0, 0.95)
    h.at(5, 0.7)
    assert h.at(24.0, 0.7) == [] and h.state("batch") == "recovering"
    assert h.at(25, 0.7) == [("batch", "restore_batch", True)]


def test_an_event_rules_recover_for_is_met_on_time() -> None:
    h = Harness(
        HEADER + "  - {name: oom, on: engine_oom, action: handle_oom, undo: recover_from_oom,"
        " recover_for: 20s}\n"
    )
    h.clock.t = 0.004
    assert [d.action for d in h.ev.handle_event("engine_oom")] == ["handle_oom"]
    assert all(h.at(t, 0.1) == [] for t in (5.0, 10.002, 15.001))
    assert h.at(19.0, 0.1) == []  # clearly short
    assert h.at(19.999, 0.1) == [("oom", "recover_from_oom", True)]


def test_a_cooldown_of_six_intervals_ends_on_time() -> None:
    h = Harness(HEADER + EVICT)
    assert h.at(0.004, 0.99) == [("evict", "evict_lowest_priority", False)]
    assert all(h.at(t, 0.99) == [] for t in (5.0, 10.003, 15.0, 20.001, 25.002, 29.0))
    assert h.at(29.998, 0.99) == [("evict", "evict_lowest_priority", False)]


def test_a_refused_undo_is_retried_when_its_cooldown_ends() -> None:
    refuse = {"restore_batch"}
    h = Harness(HEADER + BATCH.replace("for: 10s", "for: 0s"), refuse=refuse)
    h.at(0, 0.95)
    h.at(5, 0.7)
    assert h.at(25.003, 0.7) == [("batch", "restore_batch", True)]
    assert h.ev.decisions[-1].outcome == "refused"
    refuse.clear()
    assert h.at(54.0, 0.7) == []  # clearly within the cooldown
    assert h.at(55.001, 0.7) == [("batch", "restore_batch", True)]
    assert h.ev.decisions[-1].outcome == "applied"


# -- the preemption storm's window -----------------------------------------------------------


def test_preemption_storms_are_counted_on_the_monotonic_clock(
    plane: ControlPlane,  # noqa: F811 - the fixture
    audit: AuditStore,  # noqa: F811 - the fixture
) -> None:
    """Bursts of 40 preemptions a minute apart are a storm each, though the wall clock stepped
    back an hour between the first two; the window holds only the last 10 s of them."""
    wall0, mono0 = 1_780_000_000.0, 1_000.0
    for k, step in enumerate((0.0, STEP_S, STEP_S)):
        for i in range(40):
            mono = mono0 + 60 * k + i * 0.01
            plane._on_engine_event(
                EngineEvent("preempted", {}, time=wall0 + step + 60 * k + i * 0.01, monotonic=mono)
            )
        assert len(plane._preempt_times) == 40
    burst, spread = 40, 40 * 0.01
    assert burst >= STORM_PREEMPTIONS and spread < STORM_WINDOW_S  # each burst is a storm
    assert audit.flush(10)
    storms = audit.list_events(kind="preemption_storm")
    assert len(storms) == 3, storms
