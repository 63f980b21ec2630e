"""The rule evaluator on a fake clock, rule-file validation, and `kvguard rules` from the shell."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvguard.engine.control import ActionResult
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import RulesFileError, default_rules_path, load_rules, load_rules_text

KVGUARD = str(Path(sys.executable).parent / "kvguard")
REPO = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Harness:
    """An evaluator over one settable signal value with a recording executor."""

    def __init__(self, text: str, dry_run: bool = False, refuse: set[str] = frozenset()) -> None:
        self.rules = load_rules_text(text, "test.yaml")
        self.clock = Clock()
        self.value: float | None = 0.0
        self.calls: list[str] = []
        self.refuse = refuse

        def execute(action: str, params: dict) -> ActionResult:
            self.calls.append(action)
            return ActionResult(action, {}, {"x": len(self.calls)}, "ok", action not in self.refuse)

        self.ev = Evaluator(
            self.rules,
            lambda n, s: self.value,
            execute,
            clock=self.clock,
            wall_clock=self.clock,
            dry_run=dry_run,
        )

    def at(self, t: float, value: float | None) -> list[tuple[str, str, bool]]:
        self.clock.t, self.value = t, value
        return [(d.rule, d.action, d.undo) for d in self.ev.tick()]

    def state(self, rule: str) -> str:
        return self.ev.states[rule].shown


HEADER = "version: 1\ninterval: 5s\ncooldown: 30s\nsignals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n"
BATCH = (
    "  - {name: batch, signal: kv, above: 0.9, for: 10s, action: reduce_batch, recover_below: 0.8,"
    " recover_for: 20s, undo: restore_batch}\n"
)
EVICT = "  - {name: evict, signal: kv, above: 0.95, action: evict_lowest_priority}\n"
FP8 = (
    "  - {name: fp8, signal: kv, above: 0.97, action: enable_fp8_kv, recover_below: 0.5,"
    " undo: disable_fp8_kv}\n"
)


def test_for_must_hold_before_acting() -> None:
    h = Harness(HEADER + BATCH)
    assert h.at(0, 0.95) == [] and h.state("batch") == "pending"
    assert h.at(5, 0.85) == [] and h.state("batch") == "inactive"  # dipped: the clock restarts
    assert h.at(10, 0.95) == []
    assert h.at(15, 0.95) == []
    assert h.at(20, 0.95) == [("batch", "reduce_batch", False)] and h.state("batch") == "firing"


def test_hysteresis_needs_the_lower_threshold_held() -> None:
    h = Harness(HEADER + BATCH)
    h.at(0, 0.95)
    h.at(10, 0.95)
    assert h.at(15, 0.85) == [] and h.state("batch") == "firing"  # under 0.9 but not under 0.8
    assert h.at(20, 0.75) == [] and h.state("batch") == "recovering"
    assert h.at(30, 0.82) == [] and h.state("batch") == "firing"  # back up: recovery restarts
    h.at(35, 0.7)
    assert h.at(50, 0.7) == []
    assert h.at(55, 0.7) == [("batch", "restore_batch", True)] and h.state("batch") == "inactive"


def test_cooldown_spaces_repeated_actions() -> None:
    h = Harness(HEADER + EVICT)
    assert h.at(0, 0.99) == [("evict", "evict_lowest_priority", False)]
    assert all(h.at(t, 0.99) == [] for t in (5, 10, 25))
    assert h.at(30, 0.99) == [("evict", "evict_lowest_priority", False)]


def test_one_escalation_per_tick_cheapest_first() -> None:
    h = Harness(HEADER + BATCH.replace("for: 10s", "for: 0s") + EVICT + FP8)
    assert h.at(0, 0.99) == [("batch", "reduce_batch", False)]
    assert h.at(5, 0.99) == [("evict", "evict_lowest_priority", False)]
    assert h.at(10, 0.99) == [("fp8", "enable_fp8_kv", False)]
    assert h.ev.level() == 3


def test_undo_in_reverse_order_of_application() -> None:
    h = Harness(HEADER + BATCH.replace("for: 10s", "for: 0s") + FP8)
    h.at(0, 0.99)
    h.at(5, 0.99)
    assert h.ev.applied == ["batch", "fp8"]
    # both recover below 0.5, batch first in time, but fp8 (applied last) must be undone first
    assert h.at(10, 0.4) == [("fp8", "disable_fp8_kv", True)]  # fp8 recover_for 0
    assert h.at(15, 0.4) == []
    assert h.at(30, 0.4) == [("batch", "restore_batch", True)]
    assert h.ev.incident is None


def test_undo_runs_down_the_ladder_whatever_order_a_spike_applied_it_in() -> None:
    """On a sudden spike the halt (0.99, no `for`) acts before the batch cut (`for: 10s`):
    undone in order of application, the halt waited for the cut's recovery (the shipped
    rules: a minute of 503s on an idle server, where the halt's own is 10 s). The rung last in
    the file is undone first, as it is when the ladder is climbed rung by rung."""
    halt = (
        "  - {name: halt, signal: kv, above: 0.99, action: halt_admission,"
        " params: {allow_priority: high}, recover_below: 0.8, recover_for: 10s,"
        " undo: resume_admission}\n"
    )
    h = Harness(HEADER + BATCH + halt)
    assert h.at(0, 0.995) == [("halt", "halt_admission", False)]
    assert h.at(10, 0.995) == [("batch", "reduce_batch", False)]
    assert h.ev.applied == ["halt", "batch"]
    h.at(15, 0.5)  # both recovering from here: halt for 10s, batch for 20s
    assert h.at(20, 0.5) == []
    assert h.at(25, 0.5) == [("halt", "resume_admission", True)]  # not at 35, after the batch
    assert h.at(30, 0.5) == []
    assert h.at(35, 0.5) == [("batch", "restore_batch", True)]
    # climbed rung by rung, the highest rung (applied last) is undone first, and a lower rung
    # that recovered before it waits for it
    slow_halt = halt.replace("recover_for: 10s", "recover_for: 30s")
    h = Harness(HEADER + BATCH.replace("for: 10s", "for: 0s") + slow_halt)
    assert h.at(0, 0.95) == [("batch", "reduce_batch", False)]
    assert h.at(5, 0.995) == [("halt", "halt_admission", False)]
    h.at(10, 0.5)  # both recovering from here: batch for 20s, halt for 30s
    assert h.at(30, 0.5) == [] and h.state("batch") == "recovering"  # ready, below the halt
    assert h.at(40, 0.5) == [("halt", "resume_admission", True)]
    assert h.at(45, 0.5) == [("batch", "restore_batch", True)]


def test_unknown_signal_never_acts_and_unseen_time_does_not_count() -> None:
    """Time the signal could not be read does not count towards `for` (as a Prometheus
    alert's pending state ends when its expression returns nothing): two readings over the
    threshold with a gap between are not a condition held for 10s. Nor towards
    `recover_for`."""
    h = Harness(HEADER + BATCH)
    h.at(0, 0.95)
    assert h.at(5, None) == [] and h.state("batch") == "unknown"
    assert h.at(15, None) == [] and h.calls == []
    assert h.at(20, 0.95) == [] and h.state("batch") == "pending"  # pending from 20 again
    assert h.at(25, 0.95) == []
    assert h.at(30, 0.95) == [("batch", "reduce_batch", False)]
    h.at(35, 0.5)  # recovering (recover_for 20s)
    assert h.at(45, None) == [] and h.state("batch") == "unknown"
    assert h.at(55, 0.5) == [] and h.state("batch") == "recovering"  # from 55 again
    assert h.at(70, 0.5) == []
    assert h.at(75, 0.5) == [("batch", "restore_batch", True)]


def test_a_rule_without_an_undo_is_calm_while_its_signal_is_unknown() -> None:
    """An eviction rule acted, then its signal could not be read (Prometheus down): it stayed
    `firing`, so the degradation level stayed up and the incident open for as long as the
    signal was gone, though nothing it did is in force. It goes inactive (shown unknown), and
    acts again only once its condition holds again."""
    h = Harness(HEADER + EVICT)
    assert h.at(0, 0.99) == [("evict", "evict_lowest_priority", False)]
    assert h.ev.level() == 1 and h.ev.incident is not None
    assert h.at(5, None) == [] and h.state("evict") == "unknown"
    assert h.ev.states["evict"].state == "inactive"
    assert h.ev.level() == 0 and h.ev.incident is None
    assert h.at(3600, None) == [] and h.ev.incident is None
    assert h.at(3605, 0.99) == [("evict", "evict_lowest_priority", False)]


def test_dry_run_records_and_changes_nothing() -> None:
    h = Harness(HEADER + BATCH.replace("for: 10s", "for: 0s"), dry_run=True)
    assert h.at(0, 0.95) == [("batch", "reduce_batch", False)]
    assert h.calls == [] and h.ev.decisions[-1].outcome == "dry_run"
    h.at(5, 0.5)
    assert h.at(25, 0.5) == [("batch", "restore_batch", True)] and h.calls == []


def test_refused_action_is_recorded_and_retried_after_cooldown() -> None:
    h = Harness(HEADER + FP8.replace("0.97", "0.9"), refuse={"enable_fp8_kv"})
    assert h.at(0, 0.95) == [("fp8", "enable_fp8_kv", False)]
    assert h.ev.decisions[-1].outcome == "refused" and h.state("fp8") == "pending"
    assert h.at(10, 0.95) == []
    assert h.at(30, 0.95) == [("fp8", "enable_fp8_kv", False)]


def test_refused_undo_is_retried_after_cooldown_not_every_tick() -> None:
    refuse = {"disable_fp8_kv"}
    h = Harness(HEADER + FP8, refuse=refuse)
    assert h.at(0, 0.99) == [("fp8", "enable_fp8_kv", False)]
    assert h.at(5, 0.4) == [("fp8", "disable_fp8_kv", True)]
    assert h.ev.decisions[-1].outcome == "refused" and h.ev.applied == ["fp8"]
    assert h.at(10, 0.4) == [] and h.at(30, 0.4) == []  # within the 30 s cooldown: no retry
    assert h.at(35, 0.4) == [("fp8", "disable_fp8_kv", True)]
    refuse.clear()
    assert h.at(40, 0.4) == []
    assert h.at(65, 0.4) == [("fp8", "disable_fp8_kv", True)]
    assert h.ev.decisions[-1].outcome == "applied" and h.ev.applied == []
    assert h.state("fp8") == "inactive" and h.calls.count("disable_fp8_kv") == 3


def test_event_rules_and_alert_resolution() -> None:
    h = Harness(
        HEADER + "  - {name: oom, on: engine_oom, action: handle_oom, cooldown: 10s}\n"
        "  - {name: am, on: 'alert:GPUNearOOM', action: halt_admission, undo: resume_admission}\n"
    )
    assert [d.action for d in h.ev.handle_event("engine_oom")] == ["handle_oom"]
    assert h.ev.handle_event("engine_oom") == []  # cooldown
    h.clock.t = 10
    assert [d.action for d in h.ev.handle_event("engine_oom")] == ["handle_oom"]
    assert [d.action for d in h.ev.handle_event("alert:GPUNearOOM")] == ["halt_admission"]
    assert [(d.action, d.undo) for d in h.ev.handle_event("alert:GPUNearOOM", resolved=True)] == [
        ("resume_admission", True)
    ]
    assert h.ev.handle_event("alert:Other") == []


def test_incident_opens_on_first_action_and_closes_when_calm() -> None:
    h = Harness(HEADER + BATCH.replace("for: 10s", "for: 0s"))
    h.at(0, 0.95)
    first = h.ev.incident
    assert first is not None
    h.at(5, 0.5)
    h.at(25, 0.5)
    assert h.ev.incident is None and h.ev.incident_actions == 2


BAD_FILES = [
    ("interval: soon\n", "test.yaml:1: interval: 'soon' is not a duration"),
    ("version: 2\n", "test.yaml:1: version: version 2 is not supported"),
    ("colour: red\n", "test.yaml:1: colour: unknown key"),
    ("signals: {kv: {local: nope}}\n", "test.yaml:1: signals.kv: unknown local signal 'nope'"),
    (
        "signals: {kv: {local: kv_cache_usage_ratio, promql: up}}\n",
        "exactly one of `local` or `promql`",
    ),
    (
        "signals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n  - {name: a, signal: kv, above: 1, action: boom}\n",
        "test.yaml:3: rules.0.action: unknown action 'boom'",
    ),
    (
        "signals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n  - {name: a, signal: zz, above: 1, action: restore_batch}\n",
        "test.yaml:3: rules.0.signal: unknown signal 'zz'",
    ),
    (
        "signals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n  - {name: a, signal: kv, above: 1, action: restore_batch}\n"
        "  - {name: a, signal: kv, above: 1, action: restore_batch}\n",
        "test.yaml:4: rules.1.name: duplicate rule name 'a'",
    ),
    (
        "signals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n  - {name: a, signal: kv, above: 1, for: 3 parsecs,"
        " action: restore_batch}\n",
        "test.yaml:3: rules.0.for: '3 parsecs' is not a duration",
    ),
    (
        "signals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n  - {name: a, signal: kv, above: 1, action: reduce_batch,"
        " params: {factor: 2}}\n",
        "test.yaml:3: rules.0.params: action 'reduce_batch' params: factor",
    ),
    (
        "signals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n  - {name: a, signal: kv, above: 0.9, recover_below: 0.95,"
        " action: reduce_batch, undo: restore_batch}\n",
        "recover_below=0.95 must not exceed above=0.9",
    ),
    (
        "rules:\n  - {name: a, on: lunch, action: restore_batch}\n",
        "test.yaml:2: rules.0.on: on='lunch'",
    ),
    ("rules: [\n", "test.yaml:2: YAML syntax error"),
    ("- just\n- a list\n", "test.yaml:1: the rules file must be a mapping"),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES)
def test_bad_rule_files_name_line_field_and_problem(text: str, message: str) -> None:
    with pytest.raises(RulesFileError) as err:
        load_rules_text(text, "test.yaml")
    assert any(message in e for e in err.value.errors), err.value.errors


def test_every_error_is_listed_at_once() -> None:
    text = (
        "interval: soon\nsignals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n"
        "  - {name: a, signal: zz, above: 1, action: boom}\n  - {name: a, signal: kv, abov: 1, action: halt_admission}\n"
    )
    with pytest.raises(RulesFileError) as err:
        load_rules_text(text, "t.yaml")
    assert len(err.value.errors) >= 5


def test_default_rules_ship_the_ladder() -> None:
    rs = load_rules(default_rules_path())
    kv = rs.ladder_of("kv_usage")  # the device KV pool: the batch cut reads its demand
    ladder = [
        (r.signal, r.above, r.action) for r in rs.rules if r.signal and rs.ladder_of(r.signal) == kv
    ]
    assert ladder == [
        ("kv_demand", 0.92, "reduce_batch"),
        ("kv_usage", 0.95, "evict_lowest_priority"),
        ("kv_usage", 0.97, "enable_fp8_kv"),
        ("kv_usage", 0.99, "halt_admission"),
    ]
    assert any(r.on == "engine_oom" and r.action == "handle_oom" for r in rs.rules)


def test_rules_cli_check_and_test() -> None:
    ok = subprocess.run([KVGUARD, "rules", "check"], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK" in ok.stdout
    scen = sorted(str(p) for p in (REPO / "rules" / "scenarios").glob("*.yaml"))
    res = subprocess.run(
        [KVGUARD, "rules", "test", str(default_rules_path()), *scen], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("PASS") == len(scen) >= 2


def rules_test(*scenarios: Path) -> subprocess.CompletedProcess[str]:
    """`kvguard rules test` of the default rules against `scenarios`."""
    argv = [KVGUARD, "rules", "test", str(default_rules_path()), *map(str, scenarios)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_rules_cli_fails_on_a_wrong_expectation(tmp_path: Path) -> None:
    sc = tmp_path / "wrong.yaml"
    sc.write_text(
        "duration: 60s\nseries:\n  kv_usage: [{at: 0s, value: 0.99}]\n"
        "expect:\n  - {at: 5s, rule: evict-low, action: evict_lowest_priority}\n"
    )
    res = rules_test(sc)
    assert res.returncode == 1 and "FAIL" in res.stdout and "expected" in res.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [{name: x}]\n")
    chk = subprocess.run([KVGUARD, "rules", "check", str(bad)], capture_output=True, text=True)
    assert chk.returncode == 1 and f"{bad}:1: rules.0" in chk.stderr


def test_rules_are_typed_strictly_and_every_problem_is_listed() -> None:
    """`above: true` or `"0.9"` is a typo, not a threshold of 1.0 or 0.9; an interval too short
    to mean anything (and a busy loop for the evaluator) is refused beside every other error;
    an event rule names its alert."""
    text = (
        "interval: 0\n"
        "signals:\n  kv: {local: kv_cache_usage_ratio}\n"
        "rules:\n"
        "  - {name: a, signal: kv, above: true, action: halt_admission}\n"
        "  - {name: b, signal: kv, above: '0.9', action: halt_admission}\n"
        "  - {name: c, signal: kv, above: 0.9, action: reduce_batch, params: {factor: 2}}\n"
        "  - {name: d, on: 'alert:', action: halt_admission}\n"
    )
    with pytest.raises(RulesFileError) as e:
        load_rules_text(text, "r.yaml")
    got = e.value.errors
    assert "r.yaml:1: interval: interval 0s is too short: at least 50ms" in got
    assert "r.yaml:5: rules.0.above: Input should be a valid number (got True)" in got
    assert "r.yaml:6: rules.1.above: Input should be a valid number (got '0.9')" in got
    assert any(m.startswith("r.yaml:7: rules.2.params:") for m in got), got
    assert any(m.startswith("r.yaml:8: rules.3.on:") and "alert:<AlertName>" in m for m in got)
    assert len(got) == 5, got
    assert load_rules_text("interval: 50ms\n", "r.yaml").interval == 0.05


def test_a_rules_undo_must_undo_its_action() -> None:
    """`undo: reduce_batch` on reduce_batch would halve the batch again on recovery."""
    head = "signals:\n  kv: {local: kv_cache_usage_ratio}\nrules:\n"
    for rule, said in (
        (
            "{name: a, signal: kv, above: 0.9, action: reduce_batch, undo: reduce_batch}",
            "its undo is restore_batch",
        ),
        (
            "{name: a, signal: kv, above: 0.9, action: enable_fp8_kv, undo: restore_batch}",
            "its undo is disable_fp8_kv",
        ),
        (
            "{name: a, on: engine_oom, action: evict_lowest_priority, undo: evict_lowest_priority}",
            "does not undo",
        ),
    ):
        with pytest.raises(RulesFileError) as e:
            load_rules_text(head + f"  - {rule}\n", "r.yaml")
        assert (
            e.value.errors[0].startswith("r.yaml:4: rules.0.undo: ") and said in e.value.errors[0]
        )
    ok = "{name: a, on: engine_oom, action: handle_oom, undo: recover_from_oom}"
    assert load_rules_text(head + f"  - {ok}\n", "r.yaml").rules[0].undo == "recover_from_oom"


def test_a_scenario_names_only_signals_and_events_that_exist(tmp_path: Path) -> None:
    """A misspelt series or event would feed nothing and the scenario would pass untested:
    each is refused by line, with every other problem, before anything runs."""
    sc = tmp_path / "typo.yaml"
    sc.write_text(
        "duration: 60s\n"
        "series:\n  kv_usag: [{at: 0s, value: 0.99}]\n"
        "events:\n  - {at: 5s, kind: engine_oomm}\n  - {at: 6s, kind: engine_oom, resolved: 'yes'}\n"
        "expect: []\n"
    )
    res = rules_test(sc)
    assert res.returncode == 1 and "PASS" not in res.stdout, res.stdout
    assert f"{sc}:5: events.0.kind: 'engine_oomm': expected engine_oom" in res.stderr
    assert f"{sc}:6: events.1.resolved: Input should be a valid boolean (got 'yes')" in res.stderr
    assert f"{sc}:3: series.kv_usag: names no signal" in res.stderr
    sc.write_text("duration: 60s\nseries:\n  kv_usag: [{at: 0s, value: 0.99}]\n")
    res = rules_test(sc)
    assert res.returncode == 1
    assert (
        f"{sc}:3: series.kv_usag: names no signal of the rules file (defined: kv_usage"
        in res.stderr
    )


class StalledEngine:
    """An executor that holds each action until the test releases it, as a stalled engine
    holds a posted action until its next step boundary."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[str] = []

    def __call__(self, action: str, params: dict) -> ActionResult:
        self.calls.append(action)
        self.entered.set()
        if not self.release.wait(120):
            raise TimeoutError("the test never released the action")
        return ActionResult(action, {}, {}, "ok", True)


def returns_within(fn: Callable[[], Any], bound: float = 10.0) -> Any:  # noqa: ANN401
    """Call `fn` on a helper thread; fail (instead of hanging) if it does not return. The bound
    only matters when `fn` blocks: an action in flight would hold it for the whole stall."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(bound)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} blocked while an action was in flight")
    return out[0]


def test_readers_and_a_second_tick_never_wait_on_an_action_in_flight() -> None:
    rules = load_rules_text(
        HEADER
        + BATCH.replace("for: 10s", "for: 0s")
        + "  - {name: am, on: 'alert:GPUNearOOM', action: halt_admission, undo: resume_admission}\n",
        "test.yaml",
    )
    clock, engine = Clock(), StalledEngine()
    ev = Evaluator(rules, lambda n, s: 0.95, engine, clock=clock, wall_clock=clock)
    first: list = []
    ticker = threading.Thread(target=lambda: first.extend(ev.tick()), daemon=True)
    ticker.start()
    alert = threading.Thread(target=lambda: ev.handle_event("alert:GPUNearOOM"), daemon=True)
    try:
        assert engine.entered.wait(60), "the rule never fired"
        # the rule states, the level and the incident answer while the action is awaited
        states = returns_within(ev.rule_states)
        assert states[0]["state"] == "pending" and states[0]["in_flight"] == "reduce_batch"
        assert returns_within(ev.level) == 0
        # a concurrent tick (the scheduler's, while an event's tick acts) neither waits nor
        # fires the rule a second time: it is skipped, and counted
        assert returns_within(ev.try_tick) is None and returns_within(ev.tick) == []
        assert ev.stats.skipped == 2 and engine.calls == ["reduce_batch"]
        alert.start()  # an event is never dropped: it waits for the tick under way
    finally:
        engine.release.set()
        ticker.join(60)
        if alert.ident is not None:  # started
            alert.join(60)
    assert not ticker.is_alive() and not alert.is_alive()
    assert [(d.rule, d.action, d.outcome) for d in first] == [("batch", "reduce_batch", "applied")]
    assert engine.calls == ["reduce_batch", "halt_admission"]
    assert ev.states["batch"].state == "firing" and ev.applied == ["batch"]
    assert all(r["in_flight"] is None for r in ev.rule_states())
    clock.t = 5  # firing now, with an undo: it does not act again while still over the line
    assert ev.tick() == [] and engine.calls == ["reduce_batch", "halt_admission"]


def test_validating_rules_does_not_load_the_engine() -> None:
    """`kvguard rules check` (and the config loader) must not import torch: validating a YAML
    file took 3 s and 250 MB when the schema pulled in the engine."""
    script = (
        "import sys\n"
        "import kvguard.rules.schema, kvguard.rules.evaluator, kvguard.daemon.config\n"
        "from kvguard.daemon.cli import main\n"
        "assert main(['rules', 'check']) == 0\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "torch imported: False", out.stdout


def test_rules_check_flags_out_of_bounds_action_params(tmp_path: Path) -> None:
    """Issue 13: a rules file could ask a remedy to raise max_num_seqs to 10^9. What can be
    judged without the daemon's config (types, inf/nan, booleans, static ceilings) is refused
    by `kvguard rules check`, one line per parameter, naming it."""
    rules = tmp_path / "huge.yaml"
    rules.write_text(
        "signals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n"
        "  - {name: a, signal: kv, above: 0.90, action: reduce_batch, params: {min: 1e9}}\n"
        "  - {name: b, signal: kv, above: 0.91, action: reduce_batch, params: {min: 1000000000}}\n"
        "  - {name: c, signal: kv, above: 0.92, action: set_max_num_seqs, params: {n: 1.0e+30}}\n"
        "  - {name: d, signal: kv, above: 0.93, action: cap_max_new_tokens, params: {n: .inf}}\n"
        "  - {name: e, signal: kv, above: 0.94, action: evict_lowest_priority,"
        " params: {count: true}}\n"
        "  - {name: f, signal: kv, above: 0.95, action: reduce_batch, params: {factor: .nan}}\n"
    )
    chk = subprocess.run([KVGUARD, "rules", "check", str(rules)], capture_output=True, text=True)
    assert chk.returncode == 1, chk.stdout + chk.stderr
    for line, field in [(3, "min"), (4, "min"), (5, "n"), (6, "n"), (7, "count"), (8, "factor")]:
        want = f"{rules}:{line}: rules.{line - 3}.params: action"
        assert any(ln.startswith(want) and f" {field}: " in ln for ln in chk.stderr.splitlines()), (
            line,
            chk.stderr,
        )
    assert "6 error(s)" in chk.stderr


def test_a_tick_returns_its_decisions_once_the_kept_list_is_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The evaluator keeps its latest decisions only; what a tick or an event returns is what
    it decided, not what the (no longer growing) list gained: once full, every call had
    returned nothing."""
    from kvguard.rules import evaluator

    monkeypatch.setattr(evaluator, "KEPT_DECISIONS", 3)
    h = Harness(
        HEADER
        + "  - {name: evict, signal: kv, above: 0.9, action: evict_lowest_priority, cooldown: 0s}\n"
    )
    got = [h.at(5.0 * i, 0.95) for i in range(1, 7)]
    assert got == [[("evict", "evict_lowest_priority", False)]] * 6
    assert len(h.ev.decisions) == 3 and h.ev.decided == 6


def test_the_stops_incident_close_reads_as_a_sentence(caplog: pytest.LogCaptureFixture) -> None:
    """The line read `incident local-0 closed the daemon stops`, where every other close
    reads as one (`closed after 2 actions`)."""
    h = Harness(HEADER + EVICT)
    assert h.at(0, 0.97) == [("evict", "evict_lowest_priority", False)]
    caplog.set_level("INFO", logger="kvguard.rules")
    h.ev.close_at_stop()
    assert h.ev.incident is None
    assert "incident local-0 closed as the daemon stops" in caplog.messages, caplog.messages


def test_an_incident_keeps_its_peak_its_actions_events_and_undo_thresholds_and_ends_at_stop(
    tmp_path: Path,
) -> None:
    """Two rungs acting in one tick: the incident's peak is the level reached (the acting rung
    counted); an event an action causes while it runs is the incident's; an undo records the
    threshold that let it run (the recovery one); the daemon's stop closes the incident."""
    from kvguard.daemon.audit import AuditStore

    store = AuditStore(f"sqlite:///{tmp_path / 'audit.db'}")
    store.start()
    try:
        h = Harness(
            HEADER + "  - {name: batch, signal: kv, above: 0.9, action: reduce_batch,\n"
            "     recover_below: 0.5, undo: restore_batch}\n"
            "  - {name: fp8, signal: kv, above: 0.95, action: enable_fp8_kv,\n"
            "     recover_below: 0.2, undo: disable_fp8_kv}\n"
        )
        execute = h.ev.execute

        def with_event(action: str, params: dict) -> ActionResult:  # as the engine's would be
            store.record_event("kv_dtype_switched", incident=h.ev.incident)
            return execute(action, params)

        h.ev.execute = with_event
        h.ev.audit = store
        assert h.at(0, 0.97) == [("batch", "reduce_batch", False)]
        inc = h.ev.incident
        assert h.at(5, 0.97) == [("fp8", "enable_fp8_kv", False)]
        assert h.at(10, 0.1) == [("fp8", "disable_fp8_kv", True)]
        assert h.at(15, 0.1) == [("batch", "restore_batch", True)]
        assert h.ev.incident is None
        assert h.at(100, 0.97) == [("batch", "reduce_batch", False)]  # open at the stop
        second = h.ev.incident
        h.ev.close_at_stop()
        assert h.ev.incident is None and store.flush(10)
        assert store.get_incident(inc)["peak_level"] == 2
        assert store.get_incident(second)["closed_at"] is not None
        events = store.list_events(limit=None)
        assert [e["incident"] for e in events] == [inc, inc, inc, inc, second]
        undo = {a["action"]: a["threshold"] for a in store.list_actions(limit=None)}
        assert undo["disable_fp8_kv"] == 0.2 and undo["restore_batch"] == 0.5
        assert undo["enable_fp8_kv"] == 0.95
    finally:
        store.stop(timeout=5)
