"""Decisions a user or operator sees that no test held in place: a change to any of them (a
sampled mutant of the code) left every test green. Each is checked here the way a user meets it.

- The OOM chain (an `engine_oom` rule on a real tiny engine whose cache stays over 98%, the
  evaluator on a fake clock as in `tests/test_remedy_holds`): its halt never loosens a halt for
  all; it holds admission at `high`, so another rule's undo goes back to that; and its undo
  (`recover_from_oom`) reopens admission.
- Admission's KV budget is the pool less `reserved_headroom_mb`, worked out here from the
  configured bytes (not from the controller's own `budget_blocks`).
- An operator's batch limit at the configured value lifts the cut: a reload that raises
  `serving.max_num_seqs` then applies in full (`kvguard serve`, admin API, reload).
- With offload switched back off, a preemption recomputes even though a host pool exists.
- `above:` / `below:` and their recovery thresholds are strict: a value exactly at one neither
  triggers nor recovers (README: "KV usage over 0.92 for 10s halves the batch").
- `kvguard audit timeline`: an event and the action it caused at the same time, event first.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kvguard.daemon.audit import AuditStore
from kvguard.daemon.cli import main as kvguard_main
from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.admission import AdmissionConfig
from kvguard.engine.admission_policy import AdmissionRejected
from kvguard.engine.control import ActionResult
from kvguard.rules.actions import OOM_HALT_ABOVE, run_action
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import load_rules_text
from tests.test_engine import make_engine
from tests.test_remedy_holds import Live, alert_rule, settle
from tests.test_server import Daemon

# -- the OOM chain ---------------------------------------------------------------------------

OOM = (
    "  - {name: oom, on: engine_oom, action: handle_oom, recover_for: 60s,"
    " undo: recover_from_oom}\n"
)
ALL = alert_rule("all", "halt_admission", "allow_priority: null", "resume_admission")
# 126 blocks of 16 tokens, already FP8: the chain's FP8 step has nothing to switch, its batch
# cut leaves the one running request and its eviction finds no `low` one, so the cache is still
# over 98% when its last step decides whether to halt
FULL = {"kv_cache_bytes": "256KiB", "max_model_len": 2016, "kv_cache_dtype": "fp8_e4m3"}


def fill(engine: LLMEngine) -> str:
    """One `normal` request whose prompt takes 125 of the 126 blocks."""
    prompt = [i % 300 + 1 for i in range(1989)]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=27, ignore_eos=True))
    engine.step()
    assert engine.latest_snapshot.kv_cache_usage_ratio > OOM_HALT_ABOVE
    return rid


def refused_for_halt(engine: LLMEngine, priority: str) -> bool:
    """Whether a request of `priority` is refused because admission is halted (a 503)."""
    try:
        rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), priority=priority)
    except AdmissionRejected as e:
        return e.decision.kind == "halted"
    engine.abort(rid)
    return False


def test_the_oom_chains_undo_reopens_the_admission_it_halted() -> None:
    """README: the chain's undo "puts back FP8, offload and admission". Nothing checked the
    admission part on a chain that had halted: without it, `normal` requests got 503 for good
    once an OOM left the cache full (the undo recorded `applied`, no rule held the halt)."""
    h = Live(OOM, **FULL)
    rid = fill(h.engine)
    assert [(d.rule, d.action, d.outcome) for d in h.ev.handle_event("engine_oom")] == [
        ("oom", "handle_oom", "applied")
    ]
    assert h.knob("admission_allow_priority") == "high"
    assert refused_for_halt(h.engine, "normal") and not refused_for_halt(h.engine, "high")
    h.engine.abort(rid)
    assert h.at(30, kv=0.1) == []  # quiet for less than its recover_for
    assert h.at(70) == [("oom", "recover_from_oom", "applied")]
    assert h.knob("admission_allow_priority") is None
    assert not refused_for_halt(h.engine, "normal") and not refused_for_halt(h.engine, "low")
    assert h.ev.incident is None


def test_the_oom_chains_halt_keeps_a_halt_for_all_in_force() -> None:
    """README: "the OOM chain's halt never loosens a halt for all either". A rule halted for
    all; an OOM with the cache still full must not let `high` requests in again."""
    h = Live(ALL + OOM, **FULL)
    fill(h.engine)
    assert h.fire(0, "all") == [("all", "halt_admission", "applied")]
    h.t = 5
    assert [(d.rule, d.action, d.outcome) for d in h.ev.handle_event("engine_oom")] == [
        ("oom", "handle_oom", "applied")
    ]
    assert h.knob("admission_allow_priority") == "none"
    assert refused_for_halt(h.engine, "high")


def test_another_rules_undo_leaves_admission_at_the_oom_chains_high() -> None:
    """The chain halted for all but `high`, then a rule halted for all and its alert resolved:
    admission goes back to what the chain, still in force, asks for (`high`), not halted for
    all until the chain's own undo 60s later, nor open."""
    h = Live(OOM + ALL, **FULL)
    fill(h.engine)
    assert [(d.rule, d.action, d.outcome) for d in h.ev.handle_event("engine_oom")] == [
        ("oom", "handle_oom", "applied")
    ]
    assert h.knob("admission_allow_priority") == "high"
    assert h.fire(10, "all") == [("all", "halt_admission", "applied")]
    assert h.knob("admission_allow_priority") == "none"
    assert h.fire(20, "all", resolved=True) == [("all", "resume_admission", "applied")]
    assert h.knob("admission_allow_priority") == "high"
    assert "what oom still holds" in h.detail()
    assert refused_for_halt(h.engine, "normal") and not refused_for_halt(h.engine, "high")


# -- admission's KV budget -------------------------------------------------------------------


def test_admission_budget_is_the_pool_less_the_reserved_headroom() -> None:
    """DESIGN: a request's peak is projected against budget - headroom. A 1 MiB pool with
    half of it reserved leaves 64 of its 128 blocks to commit: a request whose prompt and
    max_tokens take 64 blocks is admitted whole, one that takes 65 can never fit."""
    pool, headroom = 1024 * 1024, 512 * 1024
    engine = make_engine(
        kv_cache_bytes=pool,
        num_threads=1,
        max_model_len=2048,
        admission=AdmissionConfig(
            reserved_headroom_bytes=headroom,
            estimate="worst_case",  # max_tokens projected in full ...
            safety_factor=1.0,  # ... with no margin on it
            dynamic_max_tokens=False,  # refused, not shortened
            high_priority_reserve=0.0,
        ),
    )
    blocks, block_size = engine.block_manager.num_blocks, engine.config.block_size
    assert (blocks, block_size) == (128, 16)
    budget = blocks * (pool - headroom) // pool  # worked out here, not by the controller
    assert budget == 64
    prompt = [7] * 100
    most = budget * block_size - len(prompt)  # 924 tokens: the prompt's 100 fill 64 blocks
    rid = engine.add_request(prompt, SamplingParams(max_tokens=most, ignore_eos=True))
    seq = next(s for s in engine.scheduler.live() if s.request_id == rid)
    admitted = engine.admission_policy.decision(seq)
    assert (admitted.decision, admitted.max_tokens, seq.max_tokens) == ("admit", most, most)
    engine.abort(rid)
    with pytest.raises(AdmissionRejected) as err:
        engine.add_request(prompt, SamplingParams(max_tokens=most + 1, ignore_eos=True))
    assert err.value.decision.kind == "never_fits"
    assert f"budget of {budget} blocks (the most that fits: max_tokens={most})" in str(err.value)


# -- an operator's batch limit and a reload --------------------------------------------------


def test_an_operators_batch_limit_at_the_configured_value_lets_a_reload_raise_it(
    tmp_path: Path,
) -> None:
    """An operator cuts the batch, then sets it back to the configured 8: that lifts the cut
    (set_max_num_seqs: "the configured value itself lifts the cut"), so a reload raising
    serving.max_num_seqs to 16 puts 16 in force, as the reload says it does."""
    serving = "{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, max_num_seqs: 8}"
    d = Daemon(tmp_path, serving=serving)

    def act(n: int) -> None:
        r = d.admin("POST", "/admin/actions/set_max_num_seqs", json={"n": n})
        assert r.status_code == 200, r.text

    def in_force() -> int:
        return d.admin("GET", "/admin/state").json()["knobs"]["max_num_seqs"]

    try:
        act(4)
        assert in_force() == 4
        act(8)
        assert in_force() == 8
        d.config.write_text(d.config.read_text().replace("max_num_seqs: 8}", "max_num_seqs: 16}"))
        res = d.admin("POST", "/admin/reload").json()
        assert res["reloaded"] and res["changes"] == {"serving.max_num_seqs": 16}, res
        assert in_force() == 16
    finally:
        assert d.stop() == 0


# -- offload switched off ------------------------------------------------------------------


def test_with_offload_switched_back_off_a_preemption_recomputes() -> None:
    """offloading.enable_cpu_offload with a device pool under min_gpu_blocks: a host pool is
    sized but the engine starts recomputing. enable_cpu_offload swaps on preemption;
    disable_cpu_offload puts it back off, and the next preemption must recompute, not swap
    into the host pool that is still there (/admin/state says offload is off)."""
    engine = make_engine(
        kv_cache_bytes="256KiB",
        num_threads=1,
        max_num_seqs=8,
        max_model_len=512,
        enable_cpu_offload=True,
        min_gpu_blocks=512,
    )
    assert engine.host_block_manager.num_blocks > 0 and not engine.scheduler.offload

    def load() -> dict[str, int]:
        """Four requests that outgrow the 32-block pool while they decode, run until two
        preemptions; what they were, then the requests aborted."""
        before = dict(engine.latest_snapshot.preemptions)
        rids = [
            engine.add_request([5 + i] * 100, SamplingParams(max_tokens=300, ignore_eos=True))
            for i in range(4)
        ]
        for _ in range(2000):
            engine.step()
            now = engine.latest_snapshot.preemptions
            if sum(now.values()) - sum(before.values()) >= 2:
                break
        for rid in rids:
            engine.abort(rid)
        engine.step()
        return {mode: now[mode] - before.get(mode, 0) for mode in now}

    assert settle(engine, run_action(engine, "enable_cpu_offload")).ok
    assert engine.knobs()["offload"] is True
    assert load() == {"swap": 2, "recompute": 0}  # the host pool takes them
    assert settle(engine, run_action(engine, "disable_cpu_offload")).ok
    assert engine.knobs()["offload"] is False
    assert load() == {"swap": 0, "recompute": 2}
    assert not engine.scheduler.swapped


# -- threshold boundaries --------------------------------------------------------------------

BOUNDS = """version: 1
interval: 5s
cooldown: 30s
signals:
  kv: {local: kv_cache_usage_ratio}
  free: {promql: 'kv_free_ratio'}
rules:
"""


def ticks(rule: str, readings: list[tuple[float, float]]) -> list[tuple[float, str]]:
    """An evaluator on a fake clock with `rule` alone, ticked every 5s from 0 while the
    signal reads each (value, until) in turn: the actions it took, with their times."""
    t = [0.0]
    value = [0.0]
    ev = Evaluator(
        load_rules_text(BOUNDS + rule, "bounds.yaml"),
        lambda _name, _sig: value[0],
        lambda action, _params: ActionResult(action, {}, {}, "ok", True),
        clock=lambda: t[0],
        wall_clock=lambda: t[0],
    )
    acted = []
    for v, until_t in readings:
        value[0] = v
        while t[0] <= until_t:
            acted += [(d.time, d.action) for d in ev.tick()]
            t[0] += 5
    return acted


def test_a_value_exactly_at_a_threshold_neither_triggers_nor_recovers() -> None:
    """`above`, `below`, `recover_below` and `recover_above` are strict (README: "KV demand over
    0.92 for 10s halves the batch"; docs/runbooks.md: "under 0.80 for 60s" restores it). KV
    usage is a ratio of blocks, so exact values such as 23/25 = 0.92 happen: held there, the
    rung never acts; held at 0.80 once it has, it never recovers; a rule with no recovery
    threshold recovers there."""
    assert 23 / 25 == 0.92 and 20 / 25 == 0.80
    ladder = (
        "  - {name: r, signal: kv, above: 0.92, for: 10s, action: reduce_batch,"
        " recover_below: 0.80, recover_for: 60s, undo: restore_batch}\n"
    )
    assert ticks(ladder, [(23 / 25, 100)]) == []
    assert ticks(ladder, [(0.93, 10), (20 / 25, 200)]) == [(10.0, "reduce_batch")]
    assert ticks(ladder, [(0.93, 10), (20 / 25, 50), (0.79, 200)]) == [
        (10.0, "reduce_batch"),
        (115.0, "restore_batch"),  # 0.79 first read at 55, 60s before
    ]
    # no recovery threshold: recovered once no longer over `above`, exactly at it included
    bare = (
        "  - {name: r, signal: kv, above: 0.92, action: reduce_batch, recover_for: 10s,"
        " undo: restore_batch}\n"
    )
    assert ticks(bare, [(0.95, 0), (23 / 25, 100)]) == [
        (0.0, "reduce_batch"),
        (15.0, "restore_batch"),
    ]
    # `below` and `recover_above`
    low = (
        "  - {name: r, signal: free, below: 0.05, for: 10s, action: halt_admission,"
        " recover_above: 0.2, recover_for: 30s, undo: resume_admission}\n"
    )
    assert ticks(low, [(0.05, 100)]) == []
    assert ticks(low, [(0.04, 10), (0.2, 200)]) == [(10.0, "halt_admission")]
    assert ticks(low, [(0.04, 10), (0.2, 50), (0.21, 200)]) == [
        (10.0, "halt_admission"),
        (85.0, "resume_admission"),
    ]


# -- the audit timeline ----------------------------------------------------------------------


def test_the_timeline_shows_an_event_before_the_action_it_caused_at_the_same_time(
    tmp_path: Path,
) -> None:
    """`kvguard audit timeline`: the engine_oom event and the handle_oom it caused carry the
    same time (the action written first, so its id would not put it second): event first."""
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    store = AuditStore(url)
    store.start()
    try:
        at = datetime(2026, 12, 1, 10, 0, 0, 123456, tzinfo=UTC)
        inc = store.open_incident(1, "oom", time=at)
        store.record_action(
            action="handle_oom",
            outcome="applied",
            rule="oom",
            trigger="event",
            incident=inc,
            time=at,
        )
        store.record_event("engine_oom", "OOM in a step", incident=inc, time=at)
        assert store.flush(30)
        out = io.StringIO()
        with redirect_stdout(out):
            rc = kvguard_main(["audit", "timeline", inc, "--db", url, "--json"])
        assert rc == 0
        shown: list[dict[str, Any]] = json.loads(out.getvalue())["timeline"]
        assert [(r["type"], r.get("kind") or r["action"]) for r in shown] == [
            ("event", "engine_oom"),
            ("action", "handle_oom"),
        ]
    finally:
        store.stop(timeout=5)
