"""What a rules file and a scenario are checked for before anything runs, and undo actions that
return the engine to its configured state (not to a fixed one)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

from kvguard.engine import LLMEngine
from kvguard.engine.control import ActionResult
from kvguard.rules.actions import run_action
from kvguard.rules.scenario import load_scenario, run_scenario
from kvguard.rules.schema import RulesFileError, default_rules_path, load_rules, load_rules_text
from tests.test_engine import make_engine

REPO = Path(__file__).resolve().parents[1]


def settle(engine: LLMEngine, fut: Future) -> ActionResult:
    """Actions apply at a step boundary; an idle engine's step just drains the mailbox."""
    engine.step()
    return fut.result(0)


# -- undo actions go back to the configured state ---------------------------------------------


def test_disable_fp8_kv_keeps_a_configured_fp8_cache() -> None:
    """With serving.kv_cache_dtype: fp8_e4m3 the FP8 rule's undo used to switch to full
    precision and stay there, with a quarter of the configured pool's blocks."""
    engine = make_engine(kv_cache_bytes="8MiB", num_threads=1, kv_cache_dtype="fp8_e4m3")
    blocks = engine.block_manager.num_blocks
    assert settle(engine, run_action(engine, "enable_fp8_kv")).ok
    res = settle(engine, run_action(engine, "disable_fp8_kv"))
    assert res.ok, res.detail
    assert engine.kv_cache.dtype == "fp8_e4m3" and engine.block_manager.num_blocks == blocks
    assert "serving.kv_cache_dtype is fp8_e4m3" in res.detail and "stays FP8" in res.detail


def test_disable_fp8_kv_returns_a_full_precision_config_to_full_precision() -> None:
    engine = make_engine(kv_cache_bytes="8MiB", num_threads=1)
    full, blocks = engine.kv_cache.dtype, engine.block_manager.num_blocks
    assert full != "fp8_e4m3"
    assert settle(engine, run_action(engine, "enable_fp8_kv")).ok
    assert engine.kv_cache.dtype == "fp8_e4m3"
    res = settle(engine, run_action(engine, "disable_fp8_kv"))
    assert res.ok and engine.kv_cache.dtype == full, res.detail
    assert engine.block_manager.num_blocks == blocks


def test_disable_cpu_offload_keeps_a_configured_offload() -> None:
    """disable_cpu_offload is enable_cpu_offload's undo: on a daemon configured with
    offloading.enable_cpu_offload it returns to swapping, never to recompute only."""
    engine = make_engine(kv_cache_bytes="8MiB", num_threads=1, enable_cpu_offload=True)
    assert engine.host_block_manager.num_blocks > 0 and engine.scheduler.offload
    assert settle(engine, run_action(engine, "enable_cpu_offload")).ok
    res = settle(engine, run_action(engine, "disable_cpu_offload"))
    assert res.ok and engine.scheduler.offload, res.detail
    assert "enable_cpu_offload is true" in res.detail
    # an operator's switch off still comes back to the configured state
    settle(engine, engine.set_offload(False))
    assert not engine.scheduler.offload
    assert settle(engine, run_action(engine, "disable_cpu_offload")).ok
    assert engine.scheduler.offload


def test_disable_cpu_offload_without_configured_offload_is_recompute_only() -> None:
    engine = make_engine(kv_cache_bytes="8MiB", num_threads=1)
    res = settle(engine, run_action(engine, "disable_cpu_offload"))
    assert res.ok and not engine.scheduler.offload, res.detail


# -- a rule's undo must be its action's own ---------------------------------------------------

HEAD = "version: 1\nsignals:\n  kv: {local: kv_cache_usage_ratio}\nrules:\n"


@pytest.mark.parametrize(
    ("rule", "said"),
    [
        (
            "{name: evict, signal: kv, above: 0.95, action: evict_lowest_priority,"
            " recover_below: 0.5, undo: halt_admission}",
            "rule 'evict': undo 'halt_admission' does not undo 'evict_lowest_priority'"
            " (that action has no undo",
        ),
        (
            "{name: weird, signal: kv, above: 0.9, action: resume_admission,"
            " recover_below: 0.5, undo: enable_fp8_kv}",
            "rule 'weird': undo 'enable_fp8_kv' does not undo 'resume_admission'",
        ),
        (
            "{name: restore, signal: kv, above: 0.8, action: restore_batch, undo: reduce_batch}",
            "rule 'restore': undo 'reduce_batch' does not undo 'restore_batch'",
        ),
        (
            "{name: am, on: 'alert:X', action: recover_from_oom, undo: handle_oom}",
            "rule 'am': undo 'handle_oom' does not undo 'recover_from_oom'",
        ),
        (
            "{name: cap, signal: kv, above: 0.9, action: cap_max_new_tokens,"
            " undo: resume_admission}",
            "rule 'cap': undo 'resume_admission' does not undo 'cap_max_new_tokens'"
            " (its undo is uncap_max_new_tokens)",
        ),
    ],
)
def test_an_undo_that_is_not_the_actions_own_is_refused(rule: str, said: str) -> None:
    with pytest.raises(RulesFileError) as e:
        load_rules_text(HEAD + f"  - {rule}\n", "r.yaml")
    assert len(e.value.errors) == 1, e.value.errors
    assert e.value.errors[0].startswith("r.yaml:5: rules.0.undo: "), e.value.errors
    assert said in e.value.errors[0], e.value.errors


def test_every_undo_problem_is_listed_by_line() -> None:
    text = HEAD + (
        "  - {name: ok, signal: kv, above: 0.9, action: halt_admission, undo: resume_admission}\n"
        "  - {name: a, signal: kv, above: 0.95, action: evict_lowest_priority, undo: halt_admission}\n"
        "  - {name: b, signal: kv, above: 0.8, action: restore_batch, undo: reduce_batch}\n"
    )
    with pytest.raises(RulesFileError) as e:
        load_rules_text(text, "r.yaml")
    got = e.value.errors
    assert [m.split(": ")[0:2] for m in got] == [
        ["r.yaml:6", "rules.1.undo"],
        ["r.yaml:7", "rules.2.undo"],
    ], got


def test_bad_params_are_listed_beside_a_rules_other_errors(tmp_path: Path) -> None:
    """A rule's params were checked only once every other field of it was valid: a bad `for`
    (or a key its shape never reads) hid bad params until the first was fixed."""
    text = HEAD + (
        "  - {name: a, signal: kv, above: 0.9, for: 5x, action: reduce_batch, params: {factor: 2}}\n"
        "  - {name: b, signal: kv, below: 0.1, recover_for: 5s, action: set_max_num_seqs,\n"
        "     params: {n: 0}}\n"
        "  - name: c\n"
        "    signal: kv\n"
        "    above: high\n"
        "    action: reduce_batch\n"
        "    undo: restore_batch\n"
        "    undo_params: {factor: 0.5}\n"
        "  - {name: d, signal: kv, above: 0.9, action: reduce_batch, params: {factor: 3}}\n"
    )
    with pytest.raises(RulesFileError) as e:
        load_rules_text(text, "r.yaml")
    got = [m.split(": ", 2) for m in e.value.errors]
    assert [m[:2] for m in got] == [
        ["r.yaml:5", "rules.0.for"],
        ["r.yaml:5", "rules.0.params"],
        ["r.yaml:6", "rules.1.recover_for"],
        ["r.yaml:7", "rules.1.params"],
        ["r.yaml:10", "rules.2.above"],
        ["r.yaml:13", "rules.2.undo_params"],
        ["r.yaml:14", "rules.3.params"],  # once, not twice
    ], e.value.errors
    said = [m[2] for m in got]
    assert said[0].startswith("'5x' is not a duration"), said
    assert said[1] == (
        "action 'reduce_batch' params: factor: Input should be less than or equal to 1 (got 2)"
    )
    assert said[2].startswith("has no effect without undo"), said
    assert said[3] == (
        "action 'set_max_num_seqs' params: n: Input should be greater than or equal to 1 (got 0)"
    )
    assert said[4] == "Input should be a valid number (got 'high')", said
    assert said[5].startswith("action 'restore_batch' params: factor: unknown parameter"), said
    assert said[6].startswith("action 'reduce_batch' params: factor: Input should be less"), said
    path, res = _rules_check(tmp_path, text)
    assert res.returncode == 1 and f"{path}:5: rules.0.params: action" in res.stderr, res
    assert f"{path}:7: rules.1.params: action" in res.stderr, res


def test_every_action_accepts_its_own_undo_and_the_shipped_rules_load() -> None:
    from kvguard.rules.actions import ACTIONS

    for name, spec in ACTIONS.items():
        params = ", params: {n: 1}" if name == "set_max_num_seqs" else ""
        rule = f"{{name: r, on: engine_oom, action: {name}{params}" + (
            f", undo: {spec.undo}}}" if spec.undo else "}"
        )
        assert load_rules_text(HEAD + f"  - {rule}\n", "r.yaml").rules[0].undo == spec.undo
    load_rules(default_rules_path())


# -- a key a rule's shape never reads is refused ----------------------------------------------


@pytest.mark.parametrize(
    ("rule", "key", "said"),
    [
        (
            "{name: r, on: engine_oom, action: halt_admission, for: 30s}",
            "for",
            "has no effect on an event rule",
        ),
        (
            "{name: r, on: engine_oom, action: handle_oom, undo: recover_from_oom,"
            " recover_below: 0.5}",
            "recover_below",
            "has no effect on an event rule",
        ),
        (
            "{name: r, on: 'alert:GPUNearOOM', action: halt_admission, undo: resume_admission,"
            " recover_above: 0.5}",
            "recover_above",
            "has no effect on an event rule",
        ),
        (
            "{name: r, on: 'alert:GPUNearOOM', action: halt_admission, for: 10s}",
            "for",
            "has no effect on an event rule",
        ),
        (  # an alert rule's undo runs when its alert resolves, never after `recover_for`
            "{name: r, on: 'alert:GPUNearOOM', action: halt_admission, undo: resume_admission,"
            " recover_for: 60s}",
            "recover_for",
            "has no effect on an alert rule: its undo runs when the alert resolves",
        ),
        (
            "{name: r, on: engine_oom, action: handle_oom, recover_for: 60s}",
            "recover_for",
            "has no effect without undo (nothing is undone: add `undo: recover_from_oom`",
        ),
        (
            "{name: r, on: 'alert:X', action: halt_admission, undo_params: {}}",
            "undo_params",
            "has no effect without undo",
        ),
        (  # the likely mistake: a forgotten `undo:`, so the batch is never restored
            "{name: r, signal: kv, above: 0.9, action: reduce_batch, recover_below: 0.8}",
            "recover_below",
            "has no effect without undo (nothing is undone: add `undo: restore_batch`",
        ),
        (
            "{name: r, signal: kv, below: 0.1, action: halt_admission, recover_above: 0.2}",
            "recover_above",
            "has no effect without undo (nothing is undone: add `undo: resume_admission`",
        ),
        (
            "{name: r, signal: kv, above: 0.9, action: enable_fp8_kv, recover_for: 60s}",
            "recover_for",
            "has no effect without undo",
        ),
        (
            "{name: r, signal: kv, above: 0.9, action: reduce_batch, undo_params: {}}",
            "undo_params",
            "has no effect without undo",
        ),
        (  # an action without an undo: the key is all there is to drop
            "{name: r, signal: kv, above: 0.95, action: evict_lowest_priority, recover_for: 5s}",
            "recover_for",
            "has no effect without undo (leave `recover_for` out)",
        ),
    ],
)
def test_a_key_the_rules_shape_never_reads_is_refused(rule: str, key: str, said: str) -> None:
    """Accepted, these were read by nothing: `rules check` said OK while a rule lacking its
    `undo` left the engine cut down for good, or an event rule's `for` held nothing."""
    with pytest.raises(RulesFileError) as e:
        load_rules_text(HEAD + f"  - {rule}\n", "r.yaml")
    assert len(e.value.errors) == 1, e.value.errors
    assert e.value.errors[0].startswith(f"r.yaml:5: rules.0.{key}: {said}"), e.value.errors


def test_every_ignored_key_is_listed_by_line_and_the_cli_refuses_them(tmp_path: Path) -> None:
    text = HEAD + (
        "  - {name: ok, signal: kv, above: 0.9, action: halt_admission, undo: resume_admission,\n"
        "     recover_below: 0.8, recover_for: 10s}\n"
        "  - {name: ev, on: engine_oom, action: halt_admission, for: 30s, recover_below: 0.5}\n"
        "  - name: th\n"
        "    signal: kv\n"
        "    above: 10\n"
        "    action: reduce_batch\n"
        "    recover_below: 2\n"
        "    recover_for: 60s\n"
        "    undo_params: {}\n"
        "  - {name: broken, signal: kv, above: .nan, action: halt_admission, recover_for: 1s}\n"
    )
    with pytest.raises(RulesFileError) as e:
        load_rules_text(text, "r.yaml")
    got = [m.split(": ")[0:3] for m in e.value.errors]
    assert got == [
        ["r.yaml:7", "rules.1.for", "has no effect on an event rule (`on`)"],
        ["r.yaml:7", "rules.1.recover_below", "has no effect on an event rule (`on`)"],
        ["r.yaml:10", "rules.2.above", "10 is outside 0..1"],
        ["r.yaml:12", "rules.2.recover_below", "has no effect without undo (nothing is undone"],
        ["r.yaml:12", "rules.2.recover_below", "2 is outside 0..1"],
        ["r.yaml:13", "rules.2.recover_for", "has no effect without undo (nothing is undone"],
        ["r.yaml:14", "rules.2.undo_params", "has no effect without undo (nothing is undone"],
        ["r.yaml:15", "rules.3.above", "Input should be a finite number (got nan)"],
        ["r.yaml:15", "rules.3.recover_for", "has no effect without undo (nothing is undone"],
    ], e.value.errors
    path, res = _rules_check(tmp_path, text)
    assert res.returncode == 1 and f"{path}:7: rules.1.for: has no effect" in res.stderr, res


def test_the_rules_shown_in_the_readme_and_shipped_load() -> None:
    """Every shape keeps the keys it reads: the shipped ladder (threshold rules with undo,
    without, the OOM chain's `recover_for`, an alert rule) and the README's example, and
    neither leaves a remedy in force for good (the README's OOM chain had no undo: copied,
    one engine OOM kept the batch halved and the KV cache FP8 until a restart)."""
    warnings: list[str] = []
    rules = load_rules(default_rules_path(), warnings)
    assert {r.name for r in rules.rules} >= {"reduce-batch", "evict-low", "oom-chain"}
    readme = (REPO / "README.md").read_text()
    examples = [b for b in readme.split("```yaml\n")[1:] if "\nrules:\n" in b.split("```")[0]]
    assert examples
    for block in examples:
        rs = load_rules_text(block.split("```")[0], "README.md", warnings)
        assert any(r.action == "handle_oom" for r in rs.rules)
    assert warnings == []


def test_a_rule_without_its_actions_undo_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The OOM chain as the README once showed it: legal (a one-way rule may be meant), so
    `rules check` still exits 0, but says where, which rule, and the undo to add; the daemon's
    load (start and reload: `load_rules` without a list) logs the same line. A one-off action
    (an eviction) has no undo to forget."""
    text = (
        HEAD + "  - {name: evict, signal: kv, above: 0.95, action: evict_lowest_priority}\n"
        "  - {name: oom-chain, on: engine_oom, action: handle_oom}\n"
    )
    path, res = _rules_check(tmp_path, text)
    want = (
        f"{path}:6: warning: rules.1.action: rule 'oom-chain' runs handle_oom without an undo, "
        "so what it sets (batch limit, KV cache dtype, offload, admission halt) stays in force "
        "until an operator puts it back or the daemon restarts: add `undo: recover_from_oom`"
    )
    assert res.returncode == 0 and res.stderr.startswith(want), res
    assert len(res.stderr.splitlines()) == 1 and "OK (2 rules" in res.stdout, res
    assert "1 warning(s)" in res.stdout, res
    with caplog.at_level("WARNING", logger="kvguard.rules"):
        load_rules(path)
    assert [r.getMessage() for r in caplog.records] == [res.stderr.strip()]


# -- a scenario's events must be replayed ----------------------------------------------------


def test_a_scenario_refuses_events_it_would_not_replay(tmp_path: Path) -> None:
    """An event past `duration`, or of a kind no rule listens on (a misspelt alert name),
    changed nothing, so an expectation about it passed untested."""
    sc = tmp_path / "s.yaml"
    sc.write_text(
        "duration: 60s\n"
        "series:\n  kv_usage: [{at: 0s, value: 0.5}]\n"
        "events:\n"
        '  - {at: 30s, kind: "alert:GPUNearOom"}\n'
        "  - {at: 90s, kind: engine_oom}\n"
        "  - {at: 60s, kind: preemption_storm}\n"
        "  - {at: 60s, kind: engine_oom}\n"
        "expect: []\n"
    )
    with pytest.raises(RulesFileError) as e:
        load_scenario(sc, load_rules(default_rules_path()))
    got = e.value.errors
    assert len(got) == 3, got
    assert got[0].startswith(f"{sc}:5: events.0.kind: no rule listens on 'alert:GPUNearOom'")
    assert "alert:GPUNearOOM" in got[0]  # the kinds that are listened on
    assert got[1].startswith(f"{sc}:6: events.1.at: 90s is past the scenario's duration (60s)")
    assert got[2].startswith(f"{sc}:7: events.2.kind: no rule listens on 'preemption_storm'")


def test_an_event_after_the_last_tick_within_duration_is_replayed(tmp_path: Path) -> None:
    rules = load_rules(default_rules_path())
    sc = tmp_path / "s.yaml"
    sc.write_text(
        "duration: 62s\n"
        "series:\n  kv_usage: [{at: 0s, value: 0.5}]\n"
        "events:\n  - {at: 62s, kind: engine_oom}\n"
        "expect:\n  - {at: 62s, rule: oom-chain, action: handle_oom}\n"
    )
    out = run_scenario(rules, load_scenario(sc, rules))
    assert out.ok, out.failures


OOM_RULES = """version: 1
interval: 5s
cooldown: 30s
signals: {kv_usage: {local: kv_cache_usage_ratio}}
rules:
  - {name: halt, signal: kv_usage, above: 0.99, action: halt_admission, recover_below: 0.8,
     recover_for: 10s, undo: resume_admission}
  - {name: oom-chain, on: engine_oom, action: handle_oom, cooldown: 10s, undo: recover_from_oom,
     recover_for: 60s}
  - {name: am, on: "alert:GPUNearOOM", action: halt_admission, undo: resume_admission}
"""


def replay(tmp_path: Path, rules: str, scenario: str, details: list[str] | None = None) -> list:
    """What `kvguard rules test` replays of `scenario` against `rules`, checked as it checks:
    (time, rule, action, outcome) of each action; their details appended to `details`."""
    rs = load_rules_text(rules, "rules.yaml")
    sc = tmp_path / "scenario.yaml"
    sc.write_text(scenario)
    out = run_scenario(rs, load_scenario(sc, rs))
    if details is not None:
        details += [d.detail for d in out.decisions]
    return [(d.time, d.rule, d.action, d.outcome) for d in out.decisions]


def test_a_replay_evaluates_right_after_an_event_as_the_daemon_does(tmp_path: Path) -> None:
    """The daemon evaluates the rules at once after an event; a replay waited for the next
    tick, so `rules test` passed scenarios the daemon disagrees with (here: the halt at 10s,
    where the daemon halts at 7s). An evaluation follows each event at its time, and reads a
    step given after the last tick, so such a step is no longer refused."""
    # (duration, the step to 0.995, the OOM): between ticks, and one after the last tick
    for duration, full, oom in (("20s", "6s", 7.0), ("12s", "11s", 12.0)):
        got = replay(
            tmp_path,
            OOM_RULES,
            f"duration: {duration}\n"
            f"series:\n  kv_usage: [{{at: 0s, value: 0.5}}, {{at: {full}, value: 0.995}}]\n"
            f"events:\n  - {{at: {oom:g}s, kind: engine_oom}}\n",
        )
        assert got == [
            (oom, "oom-chain", "handle_oom", "applied"),
            (oom, "halt", "halt_admission", "applied"),
        ]


def test_a_replayed_oom_chain_halts_admission_only_above_98_percent(tmp_path: Path) -> None:
    """The engine's chain halts admission only if the cache is still above 98% after its other
    steps; a replay's simulated chain always said it had, so it held admission and an alert
    rule's undo was `held` where the daemon reopens. Simulated by the scenario's KV usage."""
    scenario = (
        "duration: 60s\n"
        "series:\n  kv_usage: [{{at: 0s, value: {kv}}}]\n"
        "events:\n"
        "  - {{at: 0s, kind: engine_oom}}\n"
        '  - {{at: 5s, kind: "alert:GPUNearOOM"}}\n'
        '  - {{at: 10s, kind: "alert:GPUNearOOM", resolved: true}}\n'
    )
    details: list[str] = []
    calm = replay(tmp_path, OOM_RULES, scenario.format(kv=0.5), details)
    assert calm[0] == (0.0, "oom-chain", "handle_oom", "applied")
    assert "admission not halted: KV cache at 50.0%" in details[0]
    assert (10.0, "am", "resume_admission", "applied") in calm, calm
    full = replay(tmp_path, OOM_RULES, scenario.format(kv=0.99))  # not above the halt's 0.99
    assert (10.0, "am", "resume_admission", "held") in full, full  # the chain holds admission


def test_a_replayed_oom_chain_undo_switches_back_from_fp8_only_under_its_margin(
    tmp_path: Path,
) -> None:
    """The chain's undo switches back from FP8 only under 0.20 of the FP8 pool, whole or split
    up by a batch rung in force (which holds the batch: the KV dtype is then restored by
    `disable_fp8_kv` with that margin). A replay applied it at any usage, so `rules test`
    passed scenarios in which the daemon refuses the undo and retries it after the cooldown."""
    batch = (
        "  - {name: batch, signal: kv_usage, above: 0.92, action: reduce_batch,"
        " recover_below: 0.8, recover_for: 60s, undo: restore_batch}\n"
    )
    scenario = (
        "duration: 90s\n"
        "series:\n  kv_usage: [{at: 0s, value: 0.95}, {at: 10s, value: 0.5},"
        " {at: 75s, value: 0.1}]\n"
        "events:\n  - {at: 5s, kind: engine_oom}\n"
    )
    undo = [
        (5.0, "oom-chain", "handle_oom", "applied"),
        (65.0, "oom-chain", "recover_from_oom", "refused"),  # 60s after the OOM, at 0.5
        (75.0, "oom-chain", "recover_from_oom", "applied"),  # after its 10s cooldown, at 0.1
    ]
    cut = (0.0, "batch", "reduce_batch", "applied")
    restored = (80.0, "batch", "restore_batch", "applied")
    for rules, split in ((OOM_RULES, False), (OOM_RULES + batch, True)):
        details: list[str] = []
        got = replay(tmp_path, rules, scenario, details)
        assert got == ([cut, *undo, restored] if split else undo), got
        refused = details[got.index(undo[1])]
        said = "refused: KV cache at 50.0%, and the switch back from FP8 waits for under 20%"
        assert said in refused, refused
        assert ("disable_fp8_kv: simulated; refused" in refused) == split, refused
        assert ("kept: batch (held by batch)" in refused) == split, refused


def test_a_scenario_refuses_series_steps_no_evaluation_reads(tmp_path: Path) -> None:
    """A step past `duration`, or after the last tick within it (the rules evaluate every 5s:
    at 10s, not 12s), fed nothing: `expect: []` passed with the cache at 99% untested."""
    rules = load_rules(default_rules_path())
    sc = tmp_path / "s.yaml"
    sc.write_text(
        "duration: 12s\n"
        "series:\n"
        "  kv_usage:\n"
        "    - {at: 0s, value: 0.5}\n"
        "    - {at: 10s, value: 0.5}\n"
        "    - {at: 11s, value: 0.99}\n"
        "  gpu_mem: [{at: 20s, value: 0.99}]\n"
        "expect: []\n"
    )
    with pytest.raises(RulesFileError) as e:
        load_scenario(sc, rules)
    assert e.value.errors == [
        f"{sc}:6: series.kv_usage.2.at: 11s is after the last evaluation (10s, every 5s up to"
        " the duration 12s): no evaluation would read it",
        f"{sc}:7: series.gpu_mem.0.at: 20s is past the scenario's duration (12s): it would"
        " never be replayed",
    ], e.value.errors
    with pytest.raises(RulesFileError) as e:  # past `duration`, whatever rules it runs against
        load_scenario(sc)
    assert [m.split(": ")[1] for m in e.value.errors] == ["series.gpu_mem.0.at"], e.value.errors
    res = rules_test(sc)
    assert res.returncode == 1 and "PASS" not in res.stdout, res
    assert f"{sc}:7: series.gpu_mem.0.at: 20s is past" in res.stderr, res


def test_a_scenario_of_more_evaluations_than_a_replay_runs_is_refused(tmp_path: Path) -> None:
    """`duration: 36500d` (the longest duration the grammar takes) replayed every 5s never
    finished; the longest a replay runs is MAX_TICKS evaluations of the rules' interval."""
    rules = load_rules(default_rules_path())
    assert rules.interval == 5.0
    sc = tmp_path / "s.yaml"
    sc.write_text("series:\n  kv_usage: [{at: 0s, value: 0.5}]\nduration: 36500d\n")
    with pytest.raises(RulesFileError) as e:
        load_scenario(sc, rules)
    from kvguard.rules.scenario import MAX_TICKS, Scenario

    longest = (MAX_TICKS - 1) * 5
    assert e.value.errors == [
        f"{sc}:3: duration: 36500d is 630720001 evaluations of the rules (every 5s): at most"
        f" {MAX_TICKS} ({longest}s at that interval)"
    ], e.value.errors
    sc.write_text(f"duration: {longest + 5}s\n")
    with pytest.raises(RulesFileError) as e:
        load_scenario(sc, rules)
    assert f"at most {MAX_TICKS}" in e.value.errors[0], e.value.errors
    sc.write_text(f"duration: {longest}s\n")
    assert load_scenario(sc, rules).duration == longest
    with pytest.raises(ValueError, match=f"at most {MAX_TICKS}"):  # a scenario built in code
        run_scenario(rules, Scenario(duration=36500 * 86400.0))
    sc.write_text("duration: 36500d\n")
    res = rules_test(sc)
    assert res.returncode == 1 and f"{sc}:1: duration: 36500d is " in res.stderr, res


def test_the_shipped_scenarios_pass() -> None:
    rules = load_rules(default_rules_path())
    paths = sorted((REPO / "rules" / "scenarios").glob("*.yaml"))
    assert paths
    for p in paths:
        out = run_scenario(rules, load_scenario(p, rules))
        assert out.ok, (p, out.failures)


def rules_test(scenario: Path) -> subprocess.CompletedProcess[str]:
    """`kvguard rules test` of `scenario` against the shipped rules."""
    argv = [str(Path(sys.executable).parent / "kvguard"), "rules", "test"]
    return subprocess.run(
        [*argv, str(default_rules_path()), str(scenario)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _rules_check(tmp_path: Path, text: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`kvguard rules check` on `text` written to a file: (the file, what the command did)."""
    path = tmp_path / "r.yaml"
    path.write_text(text)
    kvguard = Path(sys.executable).parent / "kvguard"
    res = subprocess.run(
        [str(kvguard), "rules", "check", str(path)], capture_output=True, text=True, timeout=60
    )
    return path, res


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "",
            "r.yaml:1: the rules file holds nothing, or only comments (for no rules, write `version: 1` and `rules: []`)",
        ),
        ("# every rule was here\n", "r.yaml:1: the rules file holds nothing, or only comments"),
        (
            HEAD + "  - {name: pct, signal: kv, above: 92, action: reduce_batch,\n"
            "     recover_below: 0.8, undo: restore_batch}\n",
            "r.yaml:5: rules.0.above: 92 is outside 0..1: signal 'kv' is kv_cache_usage_ratio, a "
            "ratio (not a percent: 0.92 for 92%)",
        ),
        (
            "version: 1\nsignals:\n  g: {local: gpu_memory_used_ratio}\nrules:\n"
            "  - {name: g, signal: g, above: 90, action: halt_admission,\n"
            "     recover_below: 0.5, undo: resume_admission}\n",
            "rules.0.above: 90 is outside 0..1: signal 'g' is gpu_memory_used_ratio",
        ),
        (
            "version: 1\nsignals:\n  q: {promql: ''}\nrules:\n"
            "  - {name: q, signal: q, above: 1, action: halt_admission}\n",
            "r.yaml:3: signals.q: promql is empty: expected a PromQL expression",
        ),
    ],
)
def test_a_rules_file_that_could_never_act_is_refused(tmp_path: Path, text: str, said: str) -> None:
    """An emptied file took every remedy away on a reload (OK: 0 rules), and a percent on a
    ratio signal (`above: 92`) or an empty PromQL gave a rule that never fires, all checked
    OK; the CLI's check now fails on each, as the daemon's start and reload do."""
    with pytest.raises(RulesFileError) as e:
        load_rules_text(text, "r.yaml")
    assert any(said in err for err in e.value.errors), e.value.errors
    f = tmp_path / "r.yaml"
    f.write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "kvguard.daemon", "rules", "check", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    load_rules_text("version: 1\nrules: []\n", "r.yaml")  # no rules, said so: fine


def test_a_percent_threshold_is_listed_beside_another_rules_schema_error(tmp_path: Path) -> None:
    """The percent check ran only once every field of the file was valid: an unknown action in
    one rule hid `above: 92` in another until the first was fixed, so `rules check` took two
    runs to list what one should."""
    text = HEAD + (
        "  - {name: c, signal: kv, above: 0.5, action: bogus_action}\n"
        "  - {name: a, signal: kv, above: 92, action: halt_admission, undo: resume_admission,\n"
        "     recover_below: 80}\n"
        "  - {name: p, signal: kv, above: 90, for: 5x, action: halt_admission}\n"
    )
    percent = (
        "92 is outside 0..1: signal 'kv' is kv_cache_usage_ratio, a ratio (not a percent: "
        "0.92 for 92%)"
    )
    with pytest.raises(RulesFileError) as e:
        load_rules_text(text, "r.yaml")
    got = [m.split(": ", 2) for m in e.value.errors]
    assert [m[:2] for m in got] == [
        ["r.yaml:5", "rules.0.action"],
        ["r.yaml:6", "rules.1.above"],
        ["r.yaml:7", "rules.1.recover_below"],  # every threshold, where the model says the first
        ["r.yaml:8", "rules.2.for"],
        ["r.yaml:8", "rules.2.above"],  # beside the rule's own broken `for`
    ], e.value.errors
    assert got[0][2].startswith("unknown action 'bogus_action'"), got
    assert got[1][2] == percent, got
    assert got[2][2].startswith("80 is outside 0..1"), got
    path, res = _rules_check(tmp_path, text)
    assert res.returncode == 1, res
    assert f"{path}:5: rules.0.action: unknown action 'bogus_action'" in res.stderr, res.stderr
    assert f"{path}:6: rules.1.above: {percent}" in res.stderr, res.stderr


def test_a_rule_name_or_signal_of_the_wrong_type_is_listed_not_a_traceback(
    tmp_path: Path,
) -> None:
    """The checks that list every error looked a list-valued name or signal up in a set:
    `rules check` stopped with a TypeError traceback instead of naming the line."""
    text = HEAD + (
        "  - {name: [a], signal: kv, above: 0.9, action: halt_admission}\n"
        "  - {name: b, signal: [kv], above: 0.9, action: halt_admission}\n"
    )
    with pytest.raises(RulesFileError) as e:
        load_rules_text(text, "r.yaml")
    assert e.value.errors == [
        "r.yaml:5: rules.0.name: Input should be a valid string (got ['a'])",
        "r.yaml:6: rules.1.signal: Input should be a valid string (got ['kv'])",
    ], e.value.errors
    path, res = _rules_check(tmp_path, text)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"{path}:5: rules.0.name: Input should be a valid string" in res.stderr, res.stderr


def test_an_interval_the_stall_alert_would_read_as_a_stall_is_refused(tmp_path: Path) -> None:
    """`interval: 10m` checked OK, and the shipped RuleEvaluationStalled alert, which reads 5
    minutes without an evaluation as a stalled evaluator, then went off on a healthy daemon
    (a ladder that looks every 10 minutes is blind to memory pressure anyway). The longest
    interval, 2m, gives a healthy daemon two evaluations in any 5 minutes."""
    text = HEAD.replace("version: 1\n", "version: 1\ninterval: 10m\n") + (
        "  - {name: oom, on: engine_oom, action: handle_oom}\n"
    )
    with pytest.raises(RulesFileError) as e:
        load_rules_text(text, "r.yaml")
    assert e.value.errors == [
        "r.yaml:2: interval: interval 600s is too long: at most 120s (the rules must see memory "
        "pressure within seconds, and the shipped RuleEvaluationStalled alert reads 5 minutes "
        "without an evaluation as a stalled daemon)"
    ], e.value.errors
    path, res = _rules_check(tmp_path, text)
    assert res.returncode == 1 and f"{path}:2: interval: interval 600s is too long" in res.stderr
    assert load_rules_text(text.replace("10m", "2m"), "r.yaml").interval == 120.0


OLD_BURST = """
duration: 60s
series:
  kv_usage:
    - {at: 0s, value: 0.50}
    - {at: 30s, value: 0.93}
  gpu_mem: []
expect:
  - {at: 40s, rule: reduce-batch, action: reduce_batch}
"""


def test_a_failed_replay_names_the_rules_its_series_do_not_feed(tmp_path: Path) -> None:
    """A scenario written when the default batch cut read `kv_usage` gives no `kv_demand`
    series: the cut never acts and the replay fails. Its failures name the rule and the signal
    the scenario does not feed, not only the expectations that moved; a replay that passes
    says nothing of the signals it leaves out (an unknown GPU is a scenario's own choice)."""
    rules = load_rules(default_rules_path())
    path = tmp_path / "old-burst.yaml"
    path.write_text(OLD_BURST)
    out = run_scenario(rules, load_scenario(path, rules))
    assert not out.ok
    notes = [f for f in out.failures if f.startswith("note: ")]
    assert any("rule reduce-batch reads signal kv_demand" in n for n in notes), out.failures
    assert not any("gpu_mem" in n for n in notes)  # a series given, if empty, is fed
    # the cut's own signal fed, as the usage was: the same expectations pass
    usage = OLD_BURST.split("series:\n")[1].split("  gpu_mem")[0]
    path.write_text(
        OLD_BURST.replace("  gpu_mem: []", usage.replace("kv_usage", "kv_demand") + "  gpu_mem: []")
    )
    assert run_scenario(rules, load_scenario(path, rules)).ok
