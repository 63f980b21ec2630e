"""A rule's remedy across reloads, and the tick's one escalation. A remedy a reload took from
its rule stays in force until its undo applies (refused meanwhile while the live tokens do not
fit the full-precision pool): it is listed, counted in the level and exported (state
`retiring`), and holds its setting against the other rules' undos. A reload that only writes
a default out, or leaves one out, keeps the remedy in force. A one-off that changed nothing
(an eviction of no sequence) or a refused action leaves the tick's escalation to the next
ready rule. The undos a reload makes are audited with trigger `reload`, not an operator's
`manual`.

The evaluator runs on a fake clock against a real tiny engine (tests.test_remedy_holds.Live:
each action applied at a step boundary), its audit in a real SQLite file and its metrics
through the daemon's own collector."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from kvguard.daemon.audit import AuditStore
from kvguard.daemon.metrics import ControlPlaneCollector
from kvguard.engine import LLMEngine, SamplingParams
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import RuleSet, load_rules_text
from tests.test_remedy_holds import HEADER, Live


def rules(text: str) -> RuleSet:
    return load_rules_text(HEADER + text, "reloaded.yaml")


def scrape(ev: Evaluator) -> list[str]:
    """The control plane's metrics, as /metrics exports them."""
    plane = SimpleNamespace(
        evaluator=ev,
        promql=SimpleNamespace(failures=0, empty=0),
        alerts_received={},
        alerts_ignored={},
    )
    registry = CollectorRegistry()
    registry.register(ControlPlaneCollector(lambda: plane, lambda: None))
    return generate_latest(registry).decode().splitlines()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


# -- a retiring remedy is in force until its undo applies -----------------------------------

OTHER = "  - {name: other, signal: kv, above: 0.999, action: evict_lowest_priority}\n"
FP8 = (
    "  - {name: fp8, signal: kv, above: 0.9, action: enable_fp8_kv, recover_below: 0.5,"
    " recover_for: 10s, undo: disable_fp8_kv}\n"
)


def fill_past_full_precision(engine: LLMEngine) -> None:
    """More live KV blocks than a full-precision pool of the same bytes holds: switching the
    FP8 cache back is refused until they finish. Whole 2048-token steps of prompt: eight
    different 600-token prompts (the prefix cache would share one) are in after four steps."""
    for k in range(8):
        engine.add_request([3 + k + i % 200 for i in range(600)], greedy(64))
    for _ in range(4):
        engine.step()
    snap = engine.snapshot()
    assert snap.kv_cache_dtype == "fp8_e4m3" and snap.blocks_used > snap.blocks_total / 4


def test_a_retired_remedy_whose_undo_is_refused_is_shown_counted_and_holds_its_setting() -> None:
    """A reload removed the FP8 rung while the live tokens did not fit the fp32 pool: its
    undo was refused (retried each cooldown) and the cache stayed FP8. Before, nothing showed
    it: /admin/state listed no rule holding the KV dtype, kvguard_rule_state had no series
    for it and the level read 0 (DegradationProlonged could never fire, however long the
    load kept it), and another rule's undo of FP8 did not count it as a holder."""
    h = Live(OTHER + FP8, kv_cache_bytes="2MiB", prefill_while_decoding=2048, max_model_len=1024)
    assert h.at(0, kv=0.99) == [("fp8", "enable_fp8_kv", "applied")]
    fill_past_full_precision(h.engine)
    assert h.ev.replace_rules(rules(OTHER)) == []
    assert h.at(10) == [("fp8", "disable_fp8_kv", "refused")]
    assert h.knob("kv_cache_dtype") == "fp8_e4m3" and h.ev.incident is not None
    # in force: counted at its rung in the file it was applied under (the new file has one)
    assert h.ev.level() == 2
    shown = {(r["name"], r["state"]): r for r in h.ev.rule_states()}
    assert set(shown) == {("other", "inactive"), ("fp8", "retiring")}
    assert shown["fp8", "retiring"]["holds"] == ["kv_dtype"]
    assert shown["fp8", "retiring"]["why"] == "rule removed by a reload"
    metrics = scrape(h.ev)
    assert 'kvguard_rule_state{rule="fp8",state="retiring"} 1.0' in metrics
    assert 'kvguard_rule_state{rule="fp8",state="inactive"} 0.0' in metrics
    assert 'kvguard_rule_state{rule="other",state="retiring"} 0.0' in metrics
    assert "kvguard_degradation_level 2.0" in metrics

    # another FP8 rule comes and goes meanwhile: its undo leaves FP8 to the retiring remedy
    # (before: it tried to switch back itself, as if no other remedy held the KV dtype)
    fp8_b = FP8.replace("name: fp8,", "name: fp8-b,")
    assert h.ev.replace_rules(rules(OTHER + fp8_b)) == ["fp8-b"]
    assert h.at(15, kv=0.99) == [("fp8-b", "enable_fp8_kv", "applied")]  # on already
    assert h.at(20, kv=0.1) == []
    assert h.at(30) == [("fp8-b", "disable_fp8_kv", "held")]
    assert "nothing restored: kv_dtype (held by retiring fp8)" in h.detail()
    assert h.ev.level() == 2 and h.ev.incident is not None

    # the live tokens finish: the retired undo, retried after its cooldown, applies
    while h.engine.has_unfinished():
        h.engine.step()
    assert h.at(40) == [("fp8", "disable_fp8_kv", "applied")]
    assert h.knob("kv_cache_dtype") == "fp32"
    assert h.ev.level() == 0 and h.ev.incident is None and h.ev.retiring == []
    assert [r["state"] for r in h.ev.rule_states()] == ["inactive", "inactive"]
    metrics = scrape(h.ev)
    assert 'kvguard_rule_state{rule="fp8",state="retiring"} 1.0' not in metrics
    assert "kvguard_degradation_level 0.0" in metrics


# -- a reload that changes a remedy only in writing ------------------------------------------

HALT = (
    "  - {{name: halt, signal: kv, above: 0.9, for: 10s, action: halt_admission, {params}"
    " recover_below: 0.5, recover_for: 10s, undo: resume_admission}}\n"
)
BATCH = (
    "  - {{name: batch, signal: kv, above: 0.9, for: 10s, action: reduce_batch, {params}"
    " recover_below: 0.5, recover_for: 10s, undo: restore_batch}}\n"
)


def test_a_reload_that_writes_a_default_out_or_leaves_it_out_keeps_the_remedy() -> None:
    """`allow_priority: high` dropped (high is its default) and `min: 1` written out (its
    default): the same remedies. Before, the raw params were compared: each was taken for
    another remedy, undone at the next tick and applied again only after its `for`, so
    admission was open and the batch whole for 10 s under the same pressure. A real change
    still relaxes the old remedy first (documented): the new rule waits its `for`."""
    h = Live(
        HALT.format(params="params: {allow_priority: high},")
        + BATCH.format(params="params: {factor: 0.5},")
    )
    h.at(0, kv=0.95)
    assert h.at(10) == [("halt", "halt_admission", "applied")]
    assert h.at(15) == [("batch", "reduce_batch", "applied")]
    assert h.knob("admission_allow_priority") == "high" and h.knob("max_num_seqs") == 4
    same = HALT.format(params="") + BATCH.format(params="params: {factor: 0.5, min: 1},")
    assert h.ev.replace_rules(rules(same)) == []
    assert h.at(20) == [] and h.ev.retiring == []
    assert h.knob("admission_allow_priority") == "high" and h.knob("max_num_seqs") == 4
    assert [r["state"] for r in h.ev.rule_states()] == ["firing", "firing"]

    # a real change: the old halt is undone (by the reload), the new one acts after its `for`
    changed = HALT.format(params="params: {allow_priority: normal},") + BATCH.format(params="")
    assert h.ev.replace_rules(rules(changed)) == ["halt"]
    assert h.at(25) == [("halt", "resume_admission", "applied")]
    assert h.ev.decisions[-1].trigger == "reload"
    assert h.knob("admission_allow_priority") is None and h.knob("max_num_seqs") == 4
    assert h.at(30) == []
    assert h.at(35) == [("halt", "halt_admission", "applied")]
    assert h.knob("admission_allow_priority") == "normal"


# -- the tick's one escalation ---------------------------------------------------------------

EVICT = (
    "  - {name: evict-low, signal: kv, above: 0.95, cooldown: 5s, action: evict_lowest_priority,"
    " params: {count: 4, max_priority: low}}\n"
)
FP8_RUNG = (
    "  - {name: fp8-kv, signal: kv, above: 0.97, action: enable_fp8_kv, recover_below: 0.2,"
    " recover_for: 30s, undo: disable_fp8_kv}\n"
)
HALT_RUNG = (
    "  - {name: halt, signal: kv, above: 0.99, action: halt_admission, recover_below: 0.8,"
    " recover_for: 10s, undo: resume_admission}\n"
)


def test_an_eviction_that_evicts_nothing_leaves_the_tick_to_the_next_rung() -> None:
    """The eviction rung, ready every tick (its cooldown is the interval), took each tick's
    one escalation while it evicted 0 sequences: the FP8 and halt rungs never acted, even at
    KV 99.5%. An eviction that evicted something still takes the tick (its effect is waited
    for); one of nothing is still audited, each time it runs."""
    h = Live(EVICT + FP8_RUNG + HALT_RUNG)
    rid = h.engine.add_request(list(range(3, 40)), greedy(200), priority="low")
    h.engine.step()
    assert h.at(0, kv=0.995) == [("evict-low", "evict_lowest_priority", "applied")]
    assert h.detail() == "evicted 1 sequence of priority <= low"
    assert h.knob("kv_cache_dtype") == "fp32"
    assert h.engine.abort(rid)  # nothing left to evict
    evict = ("evict-low", "evict_lowest_priority", "applied")
    assert h.at(5) == [evict, ("fp8-kv", "enable_fp8_kv", "applied")]
    assert h.ev.decisions[-2].detail == "evicted 0 sequences of priority <= low"
    assert h.at(10) == [evict, ("halt", "halt_admission", "applied")]
    assert h.knob("kv_cache_dtype") == "fp8_e4m3" and h.knob("admission_allow_priority") == "high"
    assert h.ev.level() == 3
    assert h.at(15) == [evict]  # nothing else is ready


OFFLOAD = (
    "  - {name: offload, signal: kv, above: 0.95, action: enable_cpu_offload, recover_below: 0.5,"
    " recover_for: 10s, undo: disable_cpu_offload}\n"
)


def test_a_refused_action_leaves_the_tick_to_the_next_rung() -> None:
    """Offload refused (no host pool): nothing changed, nothing to wait for. Before, the
    refusal was the tick's one escalation, and each retry after the cooldown was again; the
    halt waited a tick every time."""
    h = Live(OFFLOAD + HALT_RUNG.replace("0.99", "0.95"))
    assert h.at(0, kv=0.99) == [
        ("offload", "enable_cpu_offload", "refused"),
        ("halt", "halt_admission", "applied"),
    ]
    assert "no host pool" in h.ev.decisions[-2].detail
    assert h.knob("admission_allow_priority") == "high" and h.knob("offload") is False


# -- the undos a reload makes are audited as the reload's ------------------------------------


def test_undos_a_reload_makes_are_audited_with_trigger_reload(tmp_path: Path) -> None:
    """A rule removed by a reload, and a dry-run switch: their remedies' undos were audited
    with trigger `manual`, the value of an operator's actions (the admin API's)."""
    store = AuditStore(f"sqlite:///{tmp_path / 'audit.db'}")
    store.start()
    halt = HALT.format(params="").replace(" for: 10s,", "")
    batch = BATCH.format(params="").replace(" for: 10s,", "")
    try:
        h = Live(halt + batch)
        h.ev.audit = store
        assert h.at(0, kv=0.95) == [("halt", "halt_admission", "applied")]
        assert h.at(5) == [("batch", "reduce_batch", "applied")]
        h.ev.replace_rules(rules(batch))  # the halt removed
        assert h.at(10) == [("halt", "resume_admission", "applied")]
        assert h.ev.set_dry_run(True)
        assert h.at(15) == [
            ("batch", "reduce_batch", "dry_run"),
            ("batch", "restore_batch", "applied"),
        ]
        assert h.knob("admission_allow_priority") is None and h.knob("max_num_seqs") == 8
    finally:
        assert store.stop(timeout=10)
    con = sqlite3.connect(tmp_path / "audit.db")
    try:
        rows = con.execute(
            "SELECT rule, action, trigger, outcome, is_undo, detail FROM actions ORDER BY id"
        ).fetchall()
    finally:
        con.close()
    assert [r[:5] for r in rows] == [
        ("halt", "halt_admission", "signal", "applied", 0),
        ("batch", "reduce_batch", "signal", "applied", 0),
        ("halt", "resume_admission", "reload", "applied", 1),
        ("batch", "reduce_batch", "signal", "dry_run", 0),
        ("batch", "restore_batch", "reload", "applied", 1),
    ], rows
    assert rows[2][5].startswith("rule removed by a reload: ")
    assert rows[4][5].startswith("dry run switched on: ")
