"""Remedies that share an engine setting, on a real engine: the strictest value the rules in
force ask for is the one in force. A rule's action never loosens what another remedy in force
holds (it is recorded `held`), and an undo that leaves other holders puts the setting at the
strictest value they ask for, not at its configured value nor at the leaving rule's. Also: an
alert rule a reload starts afresh acts again while its alert fires; the offload undo returns
to the state the engine started in; an operator's actions are counted with the rules'.

The evaluator runs on a fake clock against a real tiny engine (each action applied at a step
boundary, as the daemon's engine loop applies it); the reload and the counting of manual
actions are checked on a live `kvguard serve` and on the real control plane in process."""

from __future__ import annotations

import re
import sqlite3
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvguard.daemon.audit import AuditStore
from kvguard.daemon.config import load_config
from kvguard.daemon.control_plane import ControlPlane
from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.control import ActionResult
from kvguard.rules.actions import OOM_UNDO_FP8_BELOW, run_action, settings_set
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import load_rules_text
from tests.test_engine import make_engine
from tests.test_server import Daemon, until

HEADER = """version: 1
interval: 5s
cooldown: 30s
signals:
  kv: {local: kv_cache_usage_ratio}
rules:
"""
# a 128-block pool, batch limit 8: shares and limits below are of these
ENGINE = {"kv_cache_bytes": "1MiB", "num_threads": 1, "max_num_seqs": 8, "max_model_len": 512}


def alert_rule(name: str, action: str, params: str, undo: str) -> str:
    return (
        f"  - {{name: {name}, on: 'alert:{name}', action: {action}, params: {{{params}}},"
        f" undo: {undo}}}\n"
    )


def settle(engine: LLMEngine, fut: Future) -> ActionResult:
    """Actions apply at a step boundary; an idle engine's step just drains the mailbox."""
    engine.step()
    return fut.result(0)


class Live:
    """An evaluator on a fake clock whose actions run on a real engine."""

    def __init__(self, rules: str, **engine: Any) -> None:
        self.engine = make_engine(**{**ENGINE, **engine})
        self.t = 0.0
        self.values: dict[str, float | None] = {"kv": 0.5}
        self.ev = Evaluator(
            load_rules_text(HEADER + rules, "test.yaml"),
            lambda name, _sig: self.values.get(name),
            lambda action, params: settle(
                self.engine, run_action(self.engine, action, params, clamp=True)
            ),
            clock=lambda: self.t,
            wall_clock=lambda: self.t,
        )

    def knob(self, name: str) -> Any:
        return self.engine.knobs()[name]

    def fire(self, t: float, name: str, resolved: bool = False) -> list[tuple[str, str, str]]:
        self.t = t
        got = self.ev.handle_event(f"alert:{name}", resolved=resolved)
        return [(d.rule, d.action, d.outcome) for d in got]

    def at(self, t: float, **values: float | None) -> list[tuple[str, str, str]]:
        self.t = t
        self.values.update(values)
        return [(d.rule, d.action, d.outcome) for d in self.ev.tick()]

    def detail(self) -> str:
        return self.ev.decisions[-1].detail


STRICT = alert_rule("strict", "halt_admission", "allow_priority: high", "resume_admission")
LOOSE = alert_rule("loose", "halt_admission", "allow_priority: normal", "resume_admission")


def test_a_looser_halt_never_loosens_a_stricter_one_in_force() -> None:
    """A halt for all but `high` is in force; another rule halts for all but `normal`. Before,
    admission loosened to `normal`, and the second rule's undo (`held`) left it there with
    only the strict rule in force: requests it refuses were served."""
    h = Live(STRICT + LOOSE)
    assert h.fire(0, "strict") == [("strict", "halt_admission", "applied")]
    assert h.fire(10, "loose") == [("loose", "halt_admission", "held")]
    assert h.knob("admission_allow_priority") == "high"
    assert "admission stays at high (held by strict; this rule asks for normal)" in h.detail()
    assert h.fire(20, "loose", resolved=True) == [("loose", "resume_admission", "held")]
    assert h.knob("admission_allow_priority") == "high"
    assert h.fire(30, "strict", resolved=True) == [("strict", "resume_admission", "applied")]
    assert h.knob("admission_allow_priority") is None and h.ev.incident is None


def test_the_strict_halt_leaving_first_puts_admission_at_what_the_other_asks() -> None:
    """The loose halt is in force when the strict one comes and goes: admission goes back to
    `normal` (the loose rule's, still in force), not open and not left at `high`."""
    h = Live(STRICT + LOOSE)
    h.fire(0, "loose")
    assert h.fire(10, "strict") == [("strict", "halt_admission", "applied")]
    assert h.knob("admission_allow_priority") == "high"
    assert h.fire(20, "strict", resolved=True) == [("strict", "resume_admission", "applied")]
    assert h.knob("admission_allow_priority") == "normal"
    assert "what loose still holds" in h.detail()
    assert h.fire(30, "loose", resolved=True) == [("loose", "resume_admission", "applied")]
    assert h.knob("admission_allow_priority") is None


def test_a_larger_pool_share_never_grows_the_pool_a_smaller_one_holds() -> None:
    half = alert_rule("half", "shrink_kv_pool", "share: 0.5", "restore_kv_pool")
    most = alert_rule("most", "shrink_kv_pool", "share: 0.75", "restore_kv_pool")
    h = Live(half + most)
    h.fire(0, "half")
    assert h.knob("kv_pool_blocks") == 64
    assert h.fire(10, "most") == [("most", "shrink_kv_pool", "held")]  # before: grew to 96
    assert h.knob("kv_pool_blocks") == 64
    assert h.fire(20, "most", resolved=True) == [("most", "restore_kv_pool", "held")]
    assert h.knob("kv_pool_blocks") == 64
    assert h.fire(25, "half", resolved=True) == [("half", "restore_kv_pool", "applied")]
    assert h.knob("kv_pool_blocks") == 128
    # the other way round: the half leaving puts the pool at three quarters, not full
    h.fire(30, "most")
    assert h.knob("kv_pool_blocks") == 96
    h.fire(40, "half")
    assert h.knob("kv_pool_blocks") == 64
    assert h.fire(50, "half", resolved=True) == [("half", "restore_kv_pool", "applied")]
    assert h.knob("kv_pool_blocks") == 96  # before: `held`, the pool stayed at half
    h.fire(60, "most", resolved=True)
    assert h.knob("kv_pool_blocks") == 128


BATCH = (
    "  - {name: batch, signal: kv, above: 0.92, action: reduce_batch, recover_below: 0.8,"
    " recover_for: 10s, undo: restore_batch}\n"
)


def test_the_batch_limit_is_the_smallest_any_rule_in_force_asks_for() -> None:
    """The relative rung halves the batch (8 -> 4, the value it holds); a rule setting 6
    would raise it and is held; one setting 2 applies, and its undo goes back to the rung's
    4 (before: it stayed at 2), never to the configured 8 while the rung is in force."""
    two = alert_rule("two", "set_max_num_seqs", "n: 2", "restore_batch")
    six = alert_rule("six", "set_max_num_seqs", "n: 6", "restore_batch")
    h = Live(BATCH + two + six)
    assert h.at(0, kv=0.95) == [("batch", "reduce_batch", "applied")]
    assert h.knob("max_num_seqs") == 4
    assert h.fire(1, "six") == [("six", "set_max_num_seqs", "held")]
    assert h.knob("max_num_seqs") == 4
    assert h.fire(2, "two") == [("two", "set_max_num_seqs", "applied")]
    assert h.knob("max_num_seqs") == 2
    assert h.fire(3, "two", resolved=True) == [("two", "restore_batch", "applied")]
    assert h.knob("max_num_seqs") == 4
    assert h.fire(4, "six", resolved=True) == [("six", "restore_batch", "held")]
    assert h.knob("max_num_seqs") == 4
    h.at(5, kv=0.5)
    assert h.at(15) == [("batch", "restore_batch", "applied")]
    assert h.knob("max_num_seqs") == 8


def test_a_reload_never_lifts_a_batch_cut_its_rule_still_holds() -> None:
    """The rung cut the batch 8 -> 4. A reload set the configured limit to 4, and another
    back to 8: before, the first made the limit in force equal to the configured one, and
    the second took that for 'no cut' and raised the batch to 8 while the rule still fired
    and held 4. The cut holds until its undo, which goes to the configured value of then."""
    h = Live(BATCH)
    e = h.engine
    assert h.at(0, kv=0.95) == [("batch", "reduce_batch", "applied")]
    for configured, in_force in ((4, 4), (8, 4), (2, 2), (6, 4)):
        res = settle(e, e.reconfigure({("max_num_seqs",): configured}))
        assert res.ok and h.knob("max_num_seqs") == in_force, (configured, res.detail)
    assert h.at(10, kv=0.95) == [] and h.knob("max_num_seqs") == 4
    h.at(20, kv=0.5)
    assert h.at(30) == [("batch", "restore_batch", "applied")]
    assert h.knob("max_num_seqs") == 6


def test_a_cut_at_the_configured_limit_of_the_moment_holds_across_a_reload() -> None:
    """A reload set the configured limit to 4; then a rule setting 4 fired, or another rule's
    undo put the batch back to the 4 the rung still asks for. The engine took a value equal to
    the configured limit for 'no cut': a reload back to 8 raised the batch to 8 while the rule
    still fired and held 4. Only the undo of the last rule holding the batch lifts the cut (a
    reload raises the batch after it); an operator's value at the configured limit lifts it."""
    four = alert_rule("four", "set_max_num_seqs", "n: 4", "restore_batch")
    two = alert_rule("two", "set_max_num_seqs", "n: 2", "restore_batch")
    h = Live(BATCH + four + two)
    e = h.engine
    settle(e, e.reconfigure({("max_num_seqs",): 4}))
    assert h.fire(0, "four") == [("four", "set_max_num_seqs", "applied")]
    settle(e, e.reconfigure({("max_num_seqs",): 8}))
    assert h.knob("max_num_seqs") == 4  # before: 8
    assert h.fire(10, "four", resolved=True) == [("four", "restore_batch", "applied")]
    assert h.knob("max_num_seqs") == 8
    # the rung holds 4 (8 halved); a reload to 4; `two` comes and goes back to the rung's 4
    assert h.at(20, kv=0.95) == [("batch", "reduce_batch", "applied")]
    settle(e, e.reconfigure({("max_num_seqs",): 4}))
    assert h.fire(21, "two") == [("two", "set_max_num_seqs", "applied")]
    assert h.fire(22, "two", resolved=True) == [("two", "restore_batch", "applied")]
    assert h.knob("max_num_seqs") == 4 and "what batch still holds" in h.detail()
    settle(e, e.reconfigure({("max_num_seqs",): 8}))
    assert h.knob("max_num_seqs") == 4  # before: 8, the rung still firing
    h.at(30, kv=0.5)
    assert h.at(40) == [("batch", "restore_batch", "applied")]
    assert h.knob("max_num_seqs") == 8
    settle(e, e.reconfigure({("max_num_seqs",): 6}))
    assert h.knob("max_num_seqs") == 6
    # an operator's batch limit at the configured value puts it back there: a reload raises it
    assert settle(e, run_action(e, "set_max_num_seqs", {"n": 6})).ok
    settle(e, e.reconfigure({("max_num_seqs",): 8}))
    assert h.knob("max_num_seqs") == 8


def test_another_rules_undo_restores_the_n_a_rule_asked_not_the_limit_it_was_held_to() -> None:
    """A reload lowered the configured limit to 3 when a rule setting 6 fired: held to 3, and
    6 once a reload raised the limit to 8. Another rule set 2 and left: before, its undo put
    the batch at 3, the value in force when the first fired, not the 6 that rule asks for."""
    six = alert_rule("six", "set_max_num_seqs", "n: 6", "restore_batch")
    two = alert_rule("two", "set_max_num_seqs", "n: 2", "restore_batch")
    h = Live(six + two)
    e = h.engine
    settle(e, e.reconfigure({("max_num_seqs",): 3}))
    assert h.fire(0, "six") == [("six", "set_max_num_seqs", "applied")]
    assert h.knob("max_num_seqs") == 3 and h.ev.states["six"].asked == {"batch": 6}
    settle(e, e.reconfigure({("max_num_seqs",): 8}))
    assert h.knob("max_num_seqs") == 6
    assert h.fire(1, "two") == [("two", "set_max_num_seqs", "applied")]
    assert h.knob("max_num_seqs") == 2
    assert h.fire(2, "two", resolved=True) == [("two", "restore_batch", "applied")]
    assert h.knob("max_num_seqs") == 6, h.detail()  # before: 3
    assert h.fire(3, "six", resolved=True) == [("six", "restore_batch", "applied")]
    assert h.knob("max_num_seqs") == 8


def test_a_higher_token_cap_is_held_and_takes_over_when_the_lower_leaves() -> None:
    low = alert_rule("low", "cap_max_new_tokens", "n: 16", "uncap_max_new_tokens")
    high = alert_rule("high", "cap_max_new_tokens", "n: 200", "uncap_max_new_tokens")
    h = Live(low + high)
    h.fire(0, "low")
    assert h.fire(10, "high") == [("high", "cap_max_new_tokens", "held")]
    assert h.knob("max_new_tokens_cap") == 16  # before: 200
    assert h.fire(20, "low", resolved=True) == [("low", "uncap_max_new_tokens", "applied")]
    assert h.knob("max_new_tokens_cap") == 200  # the high cap is still in force
    assert h.fire(30, "high", resolved=True) == [("high", "uncap_max_new_tokens", "applied")]
    assert h.knob("max_new_tokens_cap") is None


def test_a_rule_whose_action_reopens_admission_leaves_a_held_halt_alone() -> None:
    reopen = "  - {name: reopen, on: 'alert:reopen', action: resume_admission}\n"
    h = Live(STRICT + reopen)
    h.fire(0, "strict")
    assert h.fire(10, "reopen") == [("reopen", "resume_admission", "held")]
    assert h.knob("admission_allow_priority") == "high"
    assert "nothing restored: admission (held by strict)" in h.detail()


def test_the_oom_chains_halt_never_loosens_a_halt_for_all() -> None:
    """The chain halts for all but `high` when the cache is nearly full: a halt for all in
    force stays one (before, the chain let `high` requests in again)."""
    engine = make_engine(**ENGINE)
    settle(engine, engine.halt_admission(None))
    res = settle(engine, engine.halt_admission("high", tighten_only=True))
    assert res.ok and engine.knobs()["admission_allow_priority"] == "none"
    assert "already halted (allowed: none): kept" in res.detail
    settle(engine, engine.resume_admission())
    settle(engine, engine.halt_admission("high", tighten_only=True))
    assert engine.knobs()["admission_allow_priority"] == "high"


def test_the_oom_chain_halts_admission_only_if_the_cache_is_still_full_after_its_steps() -> None:
    """The chain's last step halts admission if the cache is *still* above 98%: after it halved
    the batch, evicted and switched to FP8. It was decided on the snapshot taken when the chain
    was posted, before any step, so a chain that freed most of the cache halted admission all
    the same, and held it until its undo 60s later."""
    engine = make_engine(**{**ENGINE, "kv_cache_bytes": "2MiB", "max_num_seqs": 64})
    for _ in range(64):
        engine.add_request(list(range(1, 200)), SamplingParams(max_tokens=300, ignore_eos=True))
    for _ in range(50):
        engine.step()
        if engine.latest_snapshot.kv_cache_usage_ratio > 0.98:
            break
    assert engine.latest_snapshot.kv_cache_usage_ratio > 0.98
    # a halt `only_above` a share is decided by the engine when it applies it
    res = settle(engine, engine.halt_admission("high", only_above=0.5))
    assert res.ok and engine.knobs()["admission_allow_priority"] == "high", res.detail
    settle(engine, engine.resume_admission())
    assert engine.latest_snapshot.kv_cache_usage_ratio > 0.98  # when the chain is posted
    res = settle(engine, run_action(engine, "handle_oom"))
    assert res.ok and res.data["steps"][-1] == "halt_admission", res.detail
    assert res.data["applied"] == ["reduce_max_num_seqs", "evict", "set_kv_cache_dtype"]
    assert "halt_admission: not needed: KV cache at" in res.detail
    assert engine.knobs()["admission_allow_priority"] is None
    assert settings_set("handle_oom", res) == {"batch", "kv_dtype"}  # admission not held


def oom_cut(res: ActionResult) -> str:
    return res.detail.split("reduce_max_num_seqs: ")[1].split(";")[0]


@pytest.mark.parametrize(("times", "steps", "more"), [(1, 0, 0), (1, 1, 0), (2, 0, 0), (1, 1, 8)])
def test_the_oom_chains_batch_cut_halves_the_batch_that_failed(
    times: int, steps: int, more: int
) -> None:
    """The chain's batch cut is of the sequences running when the step ran out of memory:
    that step put them all back to recompute, and the chain applied a few steps later, when
    the scheduler had taken back none or some of them. It counted only those taken back,
    so 8 running sequences left a batch of 1 to 4, at random. `times` 2: the retried step
    failed as well (its sequences were put back again). `more`: requests that came after
    the OOM, some admitted before the chain applied, are not of the batch that failed."""
    # no prefix cache: the sequences put back compute their prompts again, a few a step
    cfg = {**ENGINE, "kv_cache_bytes": "4MiB", "max_num_seqs": 16, "enable_prefix_caching": False}
    engine = make_engine(**cfg, max_num_batched_tokens=256)  # halved by the OOM: 128 a step
    for i in range(8):
        engine.add_request([5 + i] * 30, SamplingParams(max_tokens=200, ignore_eos=True))
    while len(engine.scheduler.running) < 8 or any(
        s.num_computed_tokens < 32 for s in engine.scheduler.running
    ):
        engine.step()
    engine.inject_oom(times)
    for _ in range(times):  # the steps that fail
        engine.step()
    for i in range(more):
        engine.add_request([50 + i] * 3, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(steps):  # those that take back (or admit the new ones)
        engine.step()
    assert engine.snapshot().counters["oom"] == times
    taken_back = len(engine.scheduler.running)
    assert taken_back == 0 if not steps else taken_back > 0, taken_back
    for _ in range(60 if more else 0):  # until more run than the 8 that failed
        if len(engine.scheduler.running) > 8:
            break
        engine.step()
    assert not more or len(engine.scheduler.running) > 8
    res = settle(engine, run_action(engine, "handle_oom"))
    assert oom_cut(res) == "max_num_seqs 16 -> 4", res.detail
    assert engine.knobs()["max_num_seqs"] == 4
    # a later OOM's cut is of the 4 that step ran
    while len(engine.scheduler.running) < 4:
        engine.step()
    engine.inject_oom(1)
    engine.step()
    assert not engine.scheduler.running and len(engine.scheduler.waiting) == 8 + more
    res = settle(engine, run_action(engine, "handle_oom"))
    assert oom_cut(res) == "max_num_seqs 4 -> 2", res.detail


def test_the_offload_undo_returns_to_the_state_the_engine_started_in() -> None:
    """offloading.enable_cpu_offload with a device pool under min_gpu_blocks starts with
    offload off (recompute): disable_cpu_offload and recover_from_oom turned it on."""
    engine = make_engine(**ENGINE, enable_cpu_offload=True, cpu_cache_ratio=0.5, min_gpu_blocks=512)
    assert engine.host_block_manager.num_blocks > 0 and not engine.scheduler.offload
    res = settle(engine, run_action(engine, "disable_cpu_offload"))
    assert res.ok and not engine.scheduler.offload, res.detail
    assert "min_gpu_blocks=512" in res.detail
    assert settle(engine, run_action(engine, "enable_cpu_offload")).ok and engine.scheduler.offload
    assert settle(engine, run_action(engine, "recover_from_oom")).ok
    assert not engine.scheduler.offload and engine.configured_offload is False


# the default rules' OOM chain (rules/default.yaml)
OOM_CHAIN = (
    "  - {name: oom-chain, on: engine_oom, action: handle_oom, cooldown: 10s,"
    " undo: recover_from_oom, recover_for: 60s}\n"
)


def test_the_oom_chains_split_undo_keeps_fp8_while_the_kv_would_fill_the_pool() -> None:
    """The chain's undo switches the KV cache back from FP8 only under OOM_UNDO_FP8_BELOW of
    the FP8 pool. With the batch rung in force (it holds the batch size) the evaluator splits
    that undo, restoring each setting no other remedy holds by that setting's own action: the
    KV dtype's, `disable_fp8_kv`, has no margin, so the switch back was applied with the live
    K/V filling the fp32 pool to the last block and requests waiting, the high load the
    margin is for. Refused, the undo is retried after the chain's cooldown, as its own is."""
    h = Live(BATCH + OOM_CHAIN, max_num_seqs=32, max_model_len=256, enable_cpu_offload=False)
    engine = h.engine
    fp32_blocks = engine.snapshot().blocks_total
    rids = [
        engine.add_request(
            [3 + i] + [7 + (i * 13 + k) % 200 for k in range(99)],
            SamplingParams(max_tokens=150, ignore_eos=True),
        )
        for i in range(16)
    ]
    for _ in range(3):
        engine.step()
    assert h.at(0, kv=0.95) == [("batch", "reduce_batch", "applied")]
    assert h.knob("max_num_seqs") == 16
    engine.inject_oom()
    engine.step()
    h.t = 5.0
    chain = [(d.rule, d.action, d.outcome) for d in h.ev.handle_event("engine_oom")]
    assert chain == [("oom-chain", "handle_oom", "applied")]
    assert h.knob("max_num_seqs") == 8 and engine.snapshot().kv_cache_dtype == "fp8_e4m3"
    fp8_blocks = engine.snapshot().blocks_total
    while engine.snapshot().blocks_used < fp32_blocks - 4:  # the load grows into FP8's blocks
        engine.step()
    # they fit the fp32 pool (a switch back is possible), but above the margin
    assert OOM_UNDO_FP8_BELOW * fp8_blocks < engine.snapshot().blocks_used <= fp32_blocks
    usage = engine.snapshot().kv_cache_usage_ratio  # of the FP8 pool: under 0.8
    got = h.at(65, kv=usage)
    assert got == [("oom-chain", "recover_from_oom", "refused")], h.detail()
    assert "retry when usage is lower" in h.detail(), h.detail()
    assert "set_max_num_seqs: " in h.detail() and "what batch still holds" in h.detail()
    snap = engine.snapshot()
    assert (snap.kv_cache_dtype, snap.blocks_total) == ("fp8_e4m3", fp8_blocks)
    for rid in rids:  # the load goes: the undo applies once the cooldown has passed
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert h.at(70, kv=0.0) == []
    assert h.at(75) == [("oom-chain", "recover_from_oom", "applied")]
    snap = engine.snapshot()
    assert (snap.kv_cache_dtype, snap.blocks_total) == ("fp32", fp32_blocks)
    assert h.knob("max_num_seqs") == 16  # the batch rung still holds its cut
    engine.audit_blocks()


def test_disable_fp8_kv_waits_for_a_margin_only_where_it_is_given_one() -> None:
    """The margin the OOM chain's split undo passes (`only_below`) is not disable_fp8_kv's
    own: an operator's switch back, or a custom FP8 rule's undo, still applies whenever the
    live K/V fit the configured pool, as before."""
    engine = make_engine(**{**ENGINE, "max_model_len": 256})
    fp32_blocks = engine.snapshot().blocks_total
    for i in range(8):
        engine.add_request([3 + i] * 100, SamplingParams(max_tokens=150, ignore_eos=True))
    assert settle(engine, run_action(engine, "enable_fp8_kv")).ok
    while engine.snapshot().blocks_used < fp32_blocks - 8:
        engine.step()
    margin = {"only_below": OOM_UNDO_FP8_BELOW}
    res = settle(engine, run_action(engine, "disable_fp8_kv", margin))
    assert not res.ok and "retry when usage is lower" in res.detail, res.detail
    assert engine.snapshot().kv_cache_dtype == "fp8_e4m3"
    res = settle(engine, run_action(engine, "disable_fp8_kv"))
    assert res.ok and engine.snapshot().kv_cache_dtype == "fp32", res.detail
    engine.audit_blocks()


# -- a reload while the alert fires ------------------------------------------------------------

ALERT_RULES = """version: 1
interval: 1s
cooldown: 1s
rules:
  - {{name: hot, on: "alert:Hot", action: halt_admission, params: {{allow_priority: {allow}}},
     undo: resume_admission}}
"""


def alert(status: str, fingerprint: str = "fp-hot") -> dict[str, Any]:
    a = {
        "status": status,
        "labels": {"alertname": "Hot"},
        "startsAt": "2026-12-01T10:00:00Z",
        "fingerprint": fingerprint,
    }
    return {"version": "4", "status": status, "alerts": [a]}


def test_a_reload_that_changes_a_firing_alerts_rule_acts_again(tmp_path: Path) -> None:
    """Hot fires and halts for all but `high`; a reload makes the rule halt for all. Before,
    the changed rule started afresh, its old halt was undone (admission open) and it never
    acted: Alertmanager does not send a firing alert again (its repeats are taken once)."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(ALERT_RULES.format(allow="high"))
    d = Daemon(tmp_path, extra=f"rules: {{path: {rules}}}\n")

    def allowed() -> str | None:
        return d.admin("GET", "/admin/state").json()["knobs"]["admission_allow_priority"]

    try:
        assert d.admin("POST", "/alertmanager", json=alert("firing")).json()["accepted"] == 1
        until(lambda: allowed() == "high", 30, "the alert's halt")
        rules.write_text(ALERT_RULES.format(allow="null"))
        assert d.admin("POST", "/admin/reload").json()["rules_changed"] == ["~hot"]
        until(lambda: allowed() == "none", 30, "the changed rule acting on its firing alert")
        assert d.admin("POST", "/alertmanager", json=alert("resolved")).json()["accepted"] == 1
        until(lambda: allowed() is None, 30, "admission open once the alert resolves")
    finally:
        assert d.stop() == 0
    con = sqlite3.connect(tmp_path / "audit.db")
    try:
        acts = con.execute(
            "SELECT action, outcome, is_undo, detail FROM actions WHERE rule = 'hot' ORDER BY id"
        ).fetchall()
    finally:
        con.close()
    again = [a for a in acts if a[0] == "halt_admission" and "after a reload" in a[3]]
    assert len(again) == 1 and again[0][1] == "applied", acts
    assert "allowed: none" in again[0][3]


class PausedPlane:
    """A control plane with no engine, on the rules file `rules`: the evaluations it queues
    wait until `run_jobs` runs them, and its actions are recorded in `calls`."""

    def __init__(self, tmp_path: Path, rules: Path) -> None:
        config = tmp_path / "config.yaml"
        config.write_text(f"rules: {{path: {rules}}}\n")
        self.audit = AuditStore(f"sqlite:///{tmp_path / 'audit.db'}")
        self.audit.start()
        cfg = load_config(config)
        service = SimpleNamespace(
            cfg=cfg, engine=None, audit=self.audit, rules_at_start=None, api_port=None
        )
        self.plane = ControlPlane(service)  # type: ignore[arg-type]
        self.plane.scheduler.start(paused=True)
        self.calls: list[tuple[str, dict]] = []

        def execute(action: str, params: dict) -> ActionResult:
            self.calls.append((action, params))
            return ActionResult(action, {}, {}, "ok", True)

        self.plane.evaluator.execute = execute

    def run_jobs(self) -> int:
        jobs = self.plane.scheduler.get_jobs()
        for job in jobs:
            job.func()
            job.remove()
        return len(jobs)

    def stop(self) -> None:
        self.plane.stop()
        self.audit.stop(timeout=5)


def test_only_alerts_still_firing_act_again_after_a_reload(tmp_path: Path) -> None:
    """The control plane knows which alerts fire now (each fingerprint, from firing until
    resolved): a reload queues an evaluation for the rules it starts afresh whose alert
    fires (a changed rule, or every rule at a dry-run switch), and for none other."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(ALERT_RULES.format(allow="high"))
    paused = PausedPlane(tmp_path, rules)
    plane, calls, run_jobs = paused.plane, paused.calls, paused.run_jobs
    try:
        plane.alertmanager(alert("firing"))
        plane.alertmanager(alert("firing", "fp-hot-2"))  # a second alert of the name
        run_jobs()
        assert calls == [("halt_admission", {"allow_priority": "high"})]
        # the group again: one of its alerts resolved, the other still fires
        group = alert("firing")
        group["alerts"] += alert("resolved", "fp-hot-2")["alerts"]
        plane.alertmanager(group)
        run_jobs()
        assert calls == [("halt_admission", {"allow_priority": "high"})]  # no undo
        calls.clear()
        rules.write_text(ALERT_RULES.format(allow="normal"))
        assert plane.reload(rules, dry_run=False)["rules_reloaded"]
        assert run_jobs() == 1  # before: none, and the changed rule never acted
        assert plane.firing == {"Hot": {"fp-hot"}}
        # the new rule's halt, then the old one's undo, which leaves admission at what the
        # new rule set (not open: it is still in force); it changes nothing, so it is `held`
        # (it was `applied`, setting admission to `normal` a second time)
        assert calls == [("halt_admission", {"allow_priority": "normal"})]
        acted = plane.evaluator.decisions[-2:]
        assert [(d.action, d.outcome) for d in acted] == [
            ("halt_admission", "applied"),
            ("resume_admission", "held"),
        ]
        assert acted[0].detail.startswith("its alert still fires after a reload")
        assert "nothing restored: admission (held by hot)" in acted[1].detail
        # a dry-run switch starts every rule afresh: the alert rule acts again, simulated
        calls.clear()
        assert plane.reload(rules, dry_run=True)["rules_reloaded"]
        assert run_jobs() == 1
        shown = [(d.rule, d.action, d.outcome) for d in plane.evaluator.decisions[-2:]]
        assert ("hot", "halt_admission", "dry_run") in shown
        assert calls == [("resume_admission", {})]  # the real remedy undone for real
        # resolved: a reload that changes the rule again acts on nothing
        plane.alertmanager(alert("resolved"))
        run_jobs()
        assert plane.firing == {}
        rules.write_text(ALERT_RULES.format(allow="low"))
        assert plane.reload(rules, dry_run=False)["rules_reloaded"]
        assert run_jobs() == 0
    finally:
        paused.stop()


def test_an_alert_resolving_while_another_of_its_name_fires_keeps_the_remedy(
    tmp_path: Path,
) -> None:
    """Alertmanager sends alerts of one name apart where its route groups by a label that
    tells them apart (GPU 0's Hot and GPU 1's): GPU 0's resolving lifted the halt while GPU
    1's still fired, as only the alerts of that request were looked at. The remedy goes once
    every alert of its name has resolved; another alert of the name meanwhile is taken once
    (the rule, in force, does not act again)."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(ALERT_RULES.format(allow="high"))
    p = PausedPlane(tmp_path, rules)
    halt, resume = ("halt_admission", {"allow_priority": "high"}), ("resume_admission", {})
    try:
        for gpu in ("gpu0", "gpu1"):
            assert p.plane.alertmanager(alert("firing", gpu))["accepted"] == 1
            assert p.run_jobs() == 1
        assert p.calls == [halt]
        assert p.plane.alertmanager(alert("resolved", "gpu0"))["accepted"] == 1
        assert p.run_jobs() == 0  # GPU 1's still fires: nothing to evaluate
        assert p.calls == [halt] and p.plane.firing == {"Hot": {"gpu1"}}
        assert p.plane.alertmanager(alert("resolved", "gpu1"))["accepted"] == 1
        assert p.run_jobs() == 1
        assert p.calls == [halt, resume] and p.plane.evaluator.incident is None
    finally:
        p.stop()


# -- an operator's actions are counted -------------------------------------------------------


def test_manual_actions_are_counted_in_kvguard_actions_total(tmp_path: Path) -> None:
    """docs/runbooks.md: every action is counted in kvguard_actions_total (RemedyFailed
    watches it). An operator's were only audited; they count under rule `manual`, their
    failures exported from 0 so that the first is an increase."""
    d = Daemon(tmp_path)

    def count(action: str, outcome: str) -> float | None:
        text = httpx.get(d.url + "/metrics", timeout=10).text
        m = re.search(
            rf'^kvguard_actions_total{{action="{action}",outcome="{outcome}",rule="manual"}}'
            r" (\S+)$",
            text,
            re.M,
        )
        return None if m is None else float(m.group(1))

    try:
        assert count("halt_admission", "failed") == 0.0
        assert d.admin("POST", "/admin/actions/halt_admission").status_code == 200
        until(lambda: count("halt_admission", "applied") == 1.0, 30, "the manual halt counted")
        assert d.admin("POST", "/admin/actions/resume_admission").status_code == 200
        until(lambda: count("resume_admission", "applied") == 1.0, 30, "the resume counted")
    finally:
        assert d.stop() == 0
