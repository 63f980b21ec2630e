"""Rules on preemptions. The local signal `preemptions_total` is the engine's running total: a
rule firing above it with an undo fired on an idle daemon once the lifetime count passed its
threshold and capped every request until a restart, while `kvguard rules check` said OK.
`preemptions_1m` counts the preemptions of the last minute and falls back once they stop; a
rule that would wait for the total to fall is refused by the check, at the daemon's start and
at a reload, naming the rule, the signal and the fix. README lists every local signal as the
schema describes it, and the events a rule can be `on`.

The evaluator runs on a fake clock over the daemon's own SignalReader, which reads a real tiny
engine whose sequences are really preempted (evicted, to be computed again)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvguard.daemon.control_plane import STORM_PREEMPTIONS, STORM_WINDOW_S
from kvguard.engine import LLMEngine, SamplingParams
from kvguard.rules import schema, signals
from kvguard.rules.actions import run_action
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import LOCAL_SIGNALS, RulesFileError, load_rules_text
from kvguard.rules.signals import PromQL, SignalReader
from tests.test_engine import make_engine
from tests.test_remedy_holds import PausedPlane, settle
from tests.test_rules import Clock
from tests.test_server import KVGUARD, free_port

# the reporter's rule: cap answers while preemptions come, uncap once they have stopped
RULES = """version: 1
interval: 5s
cooldown: 30s
signals:
  pre: {{local: {local}}}
rules:
  - {{name: storm-cap, signal: pre, above: 2, action: cap_max_new_tokens, params: {{n: 64}},
     recover_below: 1, recover_for: 5s, undo: uncap_max_new_tokens}}
"""
NEVER_UNDONE = (
    "r.yaml:8: rules.0.undo: rule 'storm-cap' would never be undone: signal 'pre' is "
    "preemptions_total, a running total that never falls, so its recovery never comes and "
    "what cap_max_new_tokens sets would stay in force until a restart (for a rule that "
    "undoes, read `local: preemptions_1m`, the preemptions of the last 60 s, which falls once "
    "they stop; a one-way rule leaves out `undo` and its recovery keys)"
)


def preempt(engine: LLMEngine, n: int) -> None:
    """`n` running low-priority sequences really preempted, then every request run out."""
    for k in range(n):
        engine.add_request(
            [3 + k + i for i in range(20)],
            SamplingParams(max_tokens=8, ignore_eos=True),
            priority="low",
        )
    engine.step()
    assert len(settle(engine, engine.evict(n, "low")).data["evicted"]) == n
    while engine.has_unfinished():
        engine.step()


def test_a_rule_on_recent_preemptions_is_undone_once_they_stop() -> None:
    """Three preemptions fire the cap; with none after them, the signal falls back a minute
    after the evaluation that saw them, and the idle engine's cap is undone. The total still
    reads 3: a rule on it would hold the cap for good."""
    engine = make_engine()
    clock = Clock()
    reader = SignalReader(engine.snapshot, lambda: None, PromQL(None, 1.0, ""), clock)
    ev = Evaluator(
        load_rules_text(RULES.format(local="preemptions_1m"), "r.yaml"),
        reader,
        lambda action, params: settle(engine, run_action(engine, action, params, clamp=True)),
        clock=clock,
        wall_clock=clock,
    )

    def at(t: float) -> list[tuple[str, str, str]]:
        clock.t = t
        return [(d.rule, d.action, d.outcome) for d in ev.tick()]

    assert at(0) == []
    preempt(engine, 3)
    assert at(5) == [("storm-cap", "cap_max_new_tokens", "applied")]
    assert engine.knobs()["max_new_tokens_cap"] == 64
    for t in range(10, 65, 5):  # counted for 60 s from the reading that saw them
        assert at(t) == [] and ev.states["storm-cap"].shown == "firing", t
    assert at(65) == [] and ev.states["storm-cap"].shown == "recovering"
    assert at(70) == [("storm-cap", "uncap_max_new_tokens", "applied")]
    assert engine.knobs()["max_new_tokens_cap"] is None
    assert engine.snapshot().num_preemptions == 3


def test_recent_preemptions_start_from_the_first_reading_and_survive_a_count_that_restarts() -> (
    None
):
    """What came before the first reading is not known to be recent (0, not the lifetime
    count, on a rule a reload adds to a long-running daemon). A total that went back (a new
    engine's) counts all it has as new: it came after the last reading."""
    recent = signals.RecentRise(60.0)
    assert recent.rise(100.0, 18) == 0
    assert recent.rise(105.0, 20) == 2
    assert recent.rise(164.0, 20) == 2  # 59 s after the reading that saw the 2
    assert recent.rise(165.0, 20) == 0
    assert recent.rise(170.0, 4) == 4  # started over: 4 since the reading at 165
    assert recent.rise(229.0, 4) == 4 and recent.rise(230.0, 4) == 0


def test_a_rule_undone_on_the_preemption_total_is_refused_everywhere(tmp_path: Path) -> None:
    """The check, the daemon's start and a reload refuse the rule alike, by FILE:LINE; the
    reload keeps the running rules. A one-way rule may read the total (its missing undo is
    only warned about, as for any signal)."""
    bad = tmp_path / "r.yaml"
    bad.write_text(RULES.format(local="preemptions_total"))
    with pytest.raises(RulesFileError) as e:
        load_rules_text(bad.read_text(), "r.yaml")
    assert e.value.errors == [NEVER_UNDONE], e.value.errors
    want = NEVER_UNDONE.replace("r.yaml:", f"{bad}:", 1)

    check = subprocess.run(
        [KVGUARD, "rules", "check", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 1 and want in check.stderr.splitlines(), check

    config = tmp_path / "config.yaml"
    config.write_text(
        f"serving: {{model: tiny}}\napi: {{port: {free_port()}}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\nrules: {{path: {bad}}}\n"
    )
    start = subprocess.run(
        [KVGUARD, "serve", "--config", str(config)], capture_output=True, text=True, timeout=120
    )
    assert start.returncode != 0 and want in start.stderr, start

    good = tmp_path / "good.yaml"
    good.write_text(RULES.format(local="preemptions_1m"))
    paused = PausedPlane(tmp_path, good)
    try:
        assert paused.plane.reload(bad, dry_run=False) == {
            "rules_reloaded": False,
            "errors": [want],
        }
        assert paused.plane.ruleset.signals["pre"].local == "preemptions_1m"
    finally:
        paused.stop()

    one_way = (
        "version: 1\nsignals:\n  pre: {local: preemptions_total}\nrules:\n"
        "  - {name: cap, signal: pre, above: 2, action: cap_max_new_tokens, params: {n: 64}}\n"
    )
    warnings: list[str] = []
    assert load_rules_text(one_way, "r.yaml", warnings).rules[0].undo is None
    assert len(warnings) == 1 and "without an undo" in warnings[0], warnings


def test_the_readme_lists_every_local_signal_as_the_schema_says_and_every_event() -> None:
    """README never named most local signals (nor that `preemptions_total` never falls) or
    the `preemption_storm` event: an operator learnt them from an error, and the total's
    trap from an incident that never ended."""
    readme = Path(schema.__file__).resolve().parents[1] / "README.md"
    section = readme.read_text().split("\n## Degradation rules\n")[1].split("\n## ")[0]
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    for name, spec in LOCAL_SIGNALS.items():
        assert f"| `{name}`" in rows, name
        falls = "yes" if spec.can_fall else "no"
        row = f"| `{name}` | {spec.meaning} | {spec.unit} | {falls} |"
        assert row in section.splitlines(), row
    storm = f"| {STORM_PREEMPTIONS} preemptions within {STORM_WINDOW_S:g} s "
    assert f"| `preemption_storm` {storm}" in section
    for event in ("`engine_oom`", "`alert:NAME`"):
        assert f"| {event} | " in section, event
