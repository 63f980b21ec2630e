"""What a rules file and a scenario are checked for before anything runs, and undo actions that
return the engine to its configured state (not to a fixed one)."""

from __future__ import annotations

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


def test_every_action_accepts_its_own_undo_and_the_shipped_rules_load() -> None:
    from kvguard.rules.actions import ACTIONS

    for name, spec in ACTIONS.items():
        params = ", params: {n: 1}" if name == "set_max_num_seqs" else ""
        rule = f"{{name: r, on: engine_oom, action: {name}{params}" + (
            f", undo: {spec.undo}}}" if spec.undo else "}"
        )
        assert load_rules_text(HEAD + f"  - {rule}\n", "r.yaml").rules[0].undo == spec.undo
    load_rules(default_rules_path())


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


def test_the_shipped_scenarios_pass() -> None:
    rules = load_rules(default_rules_path())
    paths = sorted((REPO / "rules" / "scenarios").glob("*.yaml"))
    assert paths
    for p in paths:
        out = run_scenario(rules, load_scenario(p, rules))
        assert out.ok, (p, out.failures)
