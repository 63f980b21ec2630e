"""Live remedies: swap, FP8 switch, eviction, batch cuts, caps, admission halt, OOM safety."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.admission import AdmissionConfig
from kvguard.engine.control import ActionResult
from kvguard.engine.engine_loop import EngineLoop
from kvguard.engine.llm_engine import AdmissionRejected
from kvguard.engine.sequence import RequestOutput
from kvguard.rules.actions import OOM_UNDO_FP8_BELOW, parse_params, run_action
from tests.test_engine import PROMPTS, make_engine


def run_all(
    engine: LLMEngine, check: Callable[[LLMEngine], None] | None = None
) -> dict[str, RequestOutput]:
    """Step until every request has finished, the block accounting audited after each step
    (and `check`, where given): the final output of each, by request id."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.audit_blocks()
        if check is not None:
            check(engine)
    return done


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def calm() -> LLMEngine:
    return make_engine()


def swap_matches_undisturbed(model: str, calm_engine: LLMEngine, blocks: int, n: int) -> None:
    ids = [calm_engine.tokenizer.encode(p) for p in PROMPTS]
    want = [o.token_ids for o in calm_engine.generate(ids, greedy(n))]
    squeezed = make_engine(
        model, num_gpu_blocks=blocks, enable_cpu_offload=True, cpu_cache_ratio=0.5
    )
    outs = squeezed.generate(ids, greedy(n))
    snap = squeezed.snapshot()
    assert snap.preemptions["swap"] > 0, snap.preemptions
    assert [o.token_ids for o in outs] == want
    squeezed.audit_blocks()
    assert snap.host.blocks_used == 0 and squeezed.snapshot().blocks_used == 0


def test_swap_out_in_gives_identical_outputs_tiny(calm: LLMEngine) -> None:
    swap_matches_undisturbed("tiny", calm, 12, 48)


@pytest.mark.slow
def test_swap_out_in_gives_identical_outputs_smollm2() -> None:
    calm_engine = make_engine("smollm2-135m", kv_cache_bytes="64MiB")
    swap_matches_undisturbed("smollm2-135m", calm_engine, 10, 24)


def test_live_fp8_switch_mid_generation(calm: LLMEngine) -> None:
    engine = make_engine(kv_cache_bytes="4MiB")
    rids = [engine.add_request(p, greedy(40)) for p in PROMPTS]
    for _ in range(5):
        engine.step()
    before = engine.snapshot()
    used_before = before.blocks_used
    assert used_before > 0 and before.num_running == len(PROMPTS)
    fut = engine.set_kv_cache_dtype("fp8_e4m3")
    engine.step()
    res = fut.result(0)
    assert res.ok and res.after["kv_cache_dtype"] == "fp8_e4m3", res.detail
    engine.audit_blocks()
    after = engine.snapshot()
    assert after.blocks_total >= 0.97 * before.blocks_total * (4 / 1)
    # the switch never holds more than one new layer plus one layer's live blocks extra
    layers = engine.model_config.num_layers
    bound = engine.kv_cache.budget_bytes / layers + res.data["live_bytes"] / layers
    assert 0 < res.data["peak_extra_bytes"] <= bound, res.data
    assert res.data["peak_extra_bytes"] < engine.kv_cache.budget_bytes  # never a second full cache
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == set(rids)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in done.values())
    # and back again once the live tokens fit a full-precision pool
    back = engine.set_kv_cache_dtype("fp32")
    engine.step()
    assert back.result(0).ok and engine.snapshot().kv_cache_dtype == "fp32"
    assert engine.snapshot().blocks_total == before.blocks_total
    engine.audit_blocks()


def test_switch_back_refused_while_live_tokens_do_not_fit() -> None:
    # whole 2048-token steps of prompt beside the decodes: the pool fills in four steps
    engine = make_engine(
        kv_cache_bytes="2MiB", kv_cache_dtype="fp8_e4m3", prefill_while_decoding=2048
    )
    fp8_blocks = engine.snapshot().blocks_total
    # eight different prompts: the prefix cache would hold one prompt's blocks once
    rids = [engine.add_request([3 + k + i % 200 for i in range(600)], greedy(64)) for k in range(8)]
    for _ in range(4):
        engine.step()
    used = engine.snapshot().blocks_used
    assert used > fp8_blocks / 4, "test needs more live blocks than an fp32 pool holds"
    fut = engine.set_kv_cache_dtype("fp32")
    engine.step()
    res = fut.result(0)
    assert not res.ok and "refused" in res.detail and res.after == res.before
    assert engine.snapshot().kv_cache_dtype == "fp8_e4m3"
    run_all(engine)
    assert all(not engine.has_request(r) for r in rids)


def test_set_max_num_seqs_preempts_excess_and_restores(calm: LLMEngine) -> None:
    engine = make_engine()
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, greedy(30), priority=["high", "normal", "low"][i % 3])
    engine.step()
    assert engine.snapshot().num_running == 8
    fut = engine.set_max_num_seqs(3)
    engine.step()
    res = fut.result(0)
    assert res.before["max_num_seqs"] == 32 and res.after["max_num_seqs"] == 3
    assert len(res.data["preempted"]) == 5
    snap = engine.snapshot()
    assert snap.num_running == 3 and snap.queues["running"]["high"] == 3
    again = engine.set_max_num_seqs(3)
    engine.step()
    assert again.result(0).changed_nothing()  # idempotent
    engine.set_max_num_seqs(32)
    run_all(engine)


def test_an_action_publishes_what_it_changed_before_its_result() -> None:
    """The daemon evaluates the rules as soon as an event's action returns, reading the
    engine's latest snapshot. That was published only after the step whose start applied the
    action: a rule reading it then saw the engine as it was before (after the OOM chain, the
    cache still full), and acted on that."""
    engine = make_engine()
    for p in PROMPTS:
        engine.add_request(p, greedy(30))
    engine.step()
    assert engine.latest_snapshot.num_running == 8
    seen = {}

    def when_done(name: str, fut) -> None:  # noqa: ANN001 - runs as the Future resolves
        fut.add_done_callback(lambda _f: seen.setdefault(name, engine.latest_snapshot))

    when_done("cut", engine.set_max_num_seqs(3))
    when_done("halt", engine.halt_admission("high"))
    engine.step()
    assert seen["cut"].max_num_seqs == 3 and seen["cut"].num_running == 3
    assert seen["cut"].num_waiting == 5 and seen["cut"].admission["halted"] is False
    assert seen["halt"].admission["allow_priority"] == "high"
    engine.set_max_num_seqs(None)
    engine.resume_admission()
    run_all(engine)


def test_evict_lowest_priority_holds_until_pressure_eases() -> None:
    engine = make_engine(enable_cpu_offload=True)
    prios = ["high", "low", "normal", "low", "high", "low", "normal", "normal"]
    rids = {
        engine.add_request(p, greedy(20), priority=pr): pr
        for p, pr in zip(PROMPTS, prios, strict=True)
    }
    engine.step()
    fut = engine.evict(2, "low")
    engine.step()
    res = fut.result(0)
    evicted = [rid for rid, _mode in res.data["evicted"]]
    assert len(evicted) == 2 and all(rids[r] == "low" for r in evicted)
    # newest low-priority first
    lows = [r for r, pr in rids.items() if pr == "low"]
    assert evicted == sorted(lows, key=lambda r: int(r.split("-")[1]), reverse=True)[:2]
    engine.evict(10, "normal")
    engine.step()
    run_all(engine)
    assert engine.snapshot().num_preemptions >= 2


# an FP8 pool under offloading.min_gpu_blocks: a host pool exists, but the engine starts with
# offload off (swapping not worth it on so small a device pool), recomputing for cost
SMALL_FP8 = {
    "kv_cache_bytes": "4MiB",
    "kv_cache_dtype": "fp8_e4m3",
    "enable_cpu_offload": True,
    "min_gpu_blocks": 1 << 20,
}


def low_greedy_answers(engine: LLMEngine, evict_at: int | None = None) -> list[list[int]]:
    """Greedy answers to PROMPTS, all `low`; with `evict_at`, every one evicted before that
    step (after the prompts, mid-answer)."""
    rids = [engine.add_request(p, greedy(40), priority="low") for p in PROMPTS]
    done: dict[str, list[int]] = {}
    for step in range(1000):
        if not engine.has_unfinished():
            break
        if step == evict_at:
            engine.evict(len(PROMPTS), "low")
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        engine.audit_blocks()
    return [done[r] for r in rids]


def test_an_evicted_greedy_request_on_an_fp8_pool_keeps_its_answer() -> None:
    """An FP8 pool's recompute changes a greedy answer: its one prefill quantises each block
    once, where the decode steps that wrote the block requantised it as its scale grew. So
    there a preempted sequence swaps wherever the host pool has room, also where offload is
    off for cost alone (offloading.min_gpu_blocks). It recomputed, and 7 of these 8 answers
    changed."""
    want = low_greedy_answers(make_engine(**SMALL_FP8))
    engine = make_engine(**SMALL_FP8)
    assert not engine.knobs()["offload"]  # the engine recomputes an fp32 pool's evictions
    got = low_greedy_answers(engine, evict_at=3)
    assert got == want
    snap = engine.snapshot()
    assert snap.preemptions == {"swap": len(PROMPTS), "recompute": 0}
    assert snap.host.blocks_used == 0


@pytest.mark.parametrize("case", ["fp32 pool", "offload turned off"])
def test_other_pools_preempt_as_before(case: str) -> None:
    """Only an FP8 pool's choice of cost gives way: an unquantised pool under min_gpu_blocks
    still recomputes (a greedy answer keeps itself there), and on an engine that started
    swapping, offload turned off stays off."""
    if case == "fp32 pool":
        engine = make_engine(**{**SMALL_FP8, "kv_cache_dtype": "auto"})
    else:
        engine = make_engine(**{**SMALL_FP8, "min_gpu_blocks": 0})
        assert engine.knobs()["offload"]  # it started swapping
        off = engine.set_offload(False)
        engine.step()  # an idle engine's step applies it
        assert off.result(0).ok and not engine.knobs()["offload"]
    for p in PROMPTS:
        engine.add_request(p, greedy(8), priority="low")
    engine.step()
    fut = engine.evict(len(PROMPTS), "low")
    engine.step()
    assert {mode for _rid, mode in fut.result(0).data["evicted"]} == {"recompute"}
    run_all(engine)


def rule_action(engine: LLMEngine, name: str) -> ActionResult:
    """Run `name` as a rule runs it, at the next step boundary."""
    fut = run_action(engine, name, clamp=True)
    engine.step()
    return fut.result(0)


def test_the_oom_chains_undo_keeps_fp8_while_the_live_kv_would_fill_the_pool() -> None:
    """The OOM chain's undo switches the KV cache back from FP8 only under the margin the
    fp8-kv rung's undo has (0.20 of the FP8 pool). It switched back whenever the live K/V
    fit: here they filled the fp32 pool to the last block, with requests waiting, so the
    next steps preempted and the fp8-kv rung (above 0.97) switched FP8 straight back on.
    Refused, the undo is retried after its cooldown, and applies once usage is lower."""
    engine = make_engine(kv_cache_bytes="1MiB", enable_cpu_offload=False, max_model_len=256)
    fp32_blocks = engine.snapshot().blocks_total
    rids = [
        engine.add_request([3 + i] + [7 + (i * 13 + k) % 200 for k in range(99)], greedy(150))
        for i in range(16)
    ]
    for _ in range(3):
        engine.step()
    engine.inject_oom()
    engine.step()
    assert rule_action(engine, "handle_oom").ok
    fp8_blocks = engine.snapshot().blocks_total
    while engine.snapshot().blocks_used < fp32_blocks - 4:  # the load grows into FP8's blocks
        engine.step()
    used = engine.snapshot().blocks_used
    # they fit the fp32 pool (a switch back is possible), but above the margin
    assert OOM_UNDO_FP8_BELOW * fp8_blocks < used <= fp32_blocks
    res = rule_action(engine, "recover_from_oom")
    snap = engine.snapshot()
    assert not res.ok and "retry when usage is lower" in res.detail, res.detail
    assert "set_kv_cache_dtype" not in res.data["applied"]
    assert (snap.kv_cache_dtype, snap.blocks_total) == ("fp8_e4m3", fp8_blocks)
    for rid in rids:  # the load goes: a calm engine's undo applies
        engine.abort(rid)
    again = rule_action(engine, "recover_from_oom")
    snap = engine.snapshot()
    assert again.ok, again.detail
    assert (snap.kv_cache_dtype, snap.blocks_total) == ("fp32", fp32_blocks)
    engine.audit_blocks()


def test_max_new_tokens_cap_truncates_and_says_so() -> None:
    engine = make_engine()
    a = engine.add_request(PROMPTS[0], greedy(50))
    engine.step()
    engine.set_max_new_tokens_cap(5)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[a].finish_reason == "length" and outs[a].truncated and len(outs[a].token_ids) == 5
    b = engine.add_request(PROMPTS[1], greedy(50))
    run_all(engine)
    engine.set_max_new_tokens_cap(None)
    engine.step()
    c = engine.generate([PROMPTS[2]], greedy(12))[0]
    assert len(c.token_ids) == 12 and not c.truncated
    assert b not in outs


def test_a_cap_ending_a_request_inside_a_character_ends_its_text_as_max_tokens_does() -> None:
    """The live cap ends a request where max_tokens would have: its text is its tokens'
    decoding, the bytes of a character it never finished as U+FFFD (the cap dropped them)."""
    engine = make_engine()
    tok = engine.tokenizer
    lead = next(i for i in range(engine.model_config.vocab_size) if tok.decode([i]) == "\ufffd")
    params = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={lead: 100.0})
    rid = engine.add_request(tok.encode("hello there"), params)
    engine.step()  # the prompt and a first token: a character's first byte
    outs = {}
    engine.set_max_new_tokens_cap(1)
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    out = outs[rid]
    assert out.token_ids == [lead] and out.finish_reason == "length" and out.truncated
    assert out.text == tok.decode(out.token_ids) == "\ufffd"


def test_lifting_a_cap_gives_a_request_admitted_under_it_its_own_max_tokens_back() -> None:
    """With admission on, a request that arrived under a cap of 5 was decided on the capped
    max_tokens, and the uncap kept that decision's 5 as its limit: it ended at 5 of the 40 it
    asked for while the one admitted before the cap got its 40. Admission decides (and
    reserves) on the request's own max_tokens and the cap applies on top of that, so lifting
    it gives both their 40, and their reservations all come back."""
    engine = make_engine(admission=AdmissionConfig())
    before = engine.add_request(PROMPTS[0], greedy(40))
    engine.step()
    cap = engine.set_max_new_tokens_cap(5)
    engine.step()
    assert cap.result(0).ok and engine.knobs()["max_new_tokens_cap"] == 5
    during = engine.add_request(PROMPTS[1], greedy(40))
    seq = engine._seqs[during]
    assert seq.max_tokens == 5 and engine.admission_policy.decision(seq).max_tokens == 40
    uncap = engine.set_max_new_tokens_cap(None)
    outs = {o.request_id: o for o in engine.step() if o.finished}
    assert uncap.result(0).data["adjusted"] == 2
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.audit_blocks()
    for rid in (before, during):
        assert len(outs[rid].token_ids) == 40 and not outs[rid].truncated, rid
    assert engine.admission.committed_blocks == 0


def test_an_output_a_cap_cut_short_teaches_the_length_estimator_nothing() -> None:
    """A request admitted on its own max_tokens of 40 that a cap of 5 ended says nothing of
    how long it would have run: were it learnt as 5 of 40, predicted admission would plan
    the next such requests an eighth of their length. One that ends by itself is learnt."""
    engine = make_engine(admission=AdmissionConfig())
    learnt = engine.admission.estimator.error
    cap = engine.set_max_new_tokens_cap(5)
    engine.step()
    assert cap.result(0).ok
    (out,) = engine.generate([PROMPTS[0]], greedy(40))
    assert len(out.token_ids) == 5 and out.truncated
    assert learnt()["samples"] == 0
    uncap = engine.set_max_new_tokens_cap(None)
    (out,) = engine.generate([PROMPTS[1]], greedy(12))
    assert uncap.result(0).ok and len(out.token_ids) == 12 and not out.truncated
    assert learnt()["samples"] == 1


def test_halt_and_resume_admission() -> None:
    engine = make_engine(admission=AdmissionConfig())
    decisions = engine.admission.decisions
    engine.halt_admission("high")
    engine.step()
    with pytest.raises(AdmissionRejected, match="halted") as err:
        engine.add_request(PROMPTS[0], greedy(4), priority="normal")
    assert err.value.decision.kind == "halted"
    # counted as refused (kvguard_admission_decisions_total, the reject-ratio recording rule):
    # a halt's refusals went uncounted, so the reject rate read 0 exactly while it refused
    assert decisions == {"admit": 0, "queue": 0, "reject": 1}
    assert "only high requests are admitted (this one is normal)" in err.value.decision.reason
    rid = engine.add_request(PROMPTS[0], greedy(4), priority="high")
    engine.resume_admission()
    engine.step()
    engine.add_request(PROMPTS[1], greedy(4), priority="low")
    run_all(engine)
    assert not engine.has_request(rid)
    kinds = [e.kind for e in engine.events.recent()]
    assert "admission_halted" in kinds and "admission_resumed" in kinds


def test_a_halt_for_every_priority_is_none_in_the_library_as_in_a_rule() -> None:
    """`halt_admission("none")`: "none" is how the engine's knob, the action's detail and
    `kvguard status` show a halt for every priority, and a rule or the admin API takes it as
    null; the library raised ValueError for it. Now it is that halt (the same value as None),
    and a value that is neither a priority nor none raises naming the parameter."""
    engine = make_engine(admission=AdmissionConfig())

    def applied(engine: LLMEngine, fut: Future) -> ActionResult:
        engine.step()  # the mailbox is drained at the next step boundary
        return fut.result(0)

    res = applied(engine, engine.halt_admission("none"))
    assert res.ok and res.detail == "admission halted (allowed: none)"
    assert engine.knobs()["admission_allow_priority"] == "none"
    assert parse_params("halt_admission", {"allow_priority": "none"}).allow_priority is None
    halted = [e for e in engine.events.recent() if e.kind == "admission_halted"]
    assert [e.data["allow_priority"] for e in halted] == [None]
    with pytest.raises(AdmissionRejected, match="halted"):
        engine.add_request(PROMPTS[0], greedy(4), priority="high")
    res = applied(engine, engine.halt_admission(None))
    assert res.detail == "admission already halted (allowed: none)"  # the same halt
    with pytest.raises(ValueError, match="allow_priority='nobody': expected one of high"):
        engine.halt_admission("nobody")
    assert applied(engine, engine.resume_admission()).ok
    rid = engine.add_request(PROMPTS[0], greedy(4), priority="low")
    assert run_all(engine)[rid].finish_reason == "length"


def test_every_action_under_concurrent_load_loses_nothing() -> None:
    engine = make_engine(kv_cache_bytes="3MiB", enable_cpu_offload=True)
    loop = EngineLoop(engine).start()
    rng = random.Random(7)
    try:
        streams = [
            loop.submit(
                PROMPTS[i % 8] * rng.randint(1, 3),
                greedy(rng.randint(20, 60)),
                rng.choice(["high", "normal", "low"]),
            )
            for i in range(20)
        ]
        actions = [
            lambda: engine.set_max_num_seqs(4),
            lambda: engine.evict(4, "normal"),
            lambda: engine.set_kv_cache_dtype("fp8_e4m3"),
            lambda: engine.set_offload(False),
            lambda: engine.set_max_new_tokens_cap(15),
            lambda: engine.halt_admission("high"),
            lambda: engine.set_offload(True),
            lambda: engine.resume_admission(),
            lambda: engine.set_max_new_tokens_cap(None),
            lambda: engine.set_max_num_seqs(32),
            lambda: engine.set_kv_cache_dtype("fp32"),
        ]
        results = []
        for act in actions:
            results.append(act().result(30))
            halted = results[-1].after["admission_allow_priority"] is not None
            try:
                streams.append(loop.submit(PROMPTS[0], greedy(10), "normal"))
                assert not halted
            except AdmissionRejected as e:
                assert halted and e.decision.kind == "halted" and "halted" in str(e)
        finals = [s.result(120) for s in streams]
        assert all(f.finish_reason in ("length", "stop") for f in finals), [
            f.finish_reason for f in finals
        ]
        assert len({f.request_id for f in finals}) == len(streams)
        assert all(r.ok for r in results if r.action != "set_kv_cache_dtype"), [
            r.detail for r in results
        ]
        loop.call(engine.audit_blocks).result(10)
        snap = loop.snapshot()
        assert snap.num_running == snap.num_waiting == snap.num_swapped == 0
    finally:
        loop.stop()


def test_injected_oom_requeues_halves_budget_and_recovers() -> None:
    engine = make_engine(oom_quiet_period_s=0.3, max_num_batched_tokens=512)
    rids = [engine.add_request(p, greedy(12)) for p in PROMPTS]
    engine.step()
    engine.inject_oom()
    engine.step()
    snap = engine.snapshot()
    assert snap.max_num_batched_tokens == 256
    assert snap.counters["oom"] == 1 and snap.preemptions["recompute"] >= 1
    oom = engine.events.recent("engine_oom")
    assert len(oom) == 1 and oom[0].data["max_num_batched_tokens_after"] == 256
    engine.audit_blocks()
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == set(rids) and all(len(o.token_ids) == 12 for o in done.values())
    time.sleep(0.35)
    engine.step()
    assert engine.snapshot().max_num_batched_tokens == 512


def test_admission_queues_then_serves_everything() -> None:
    # planned to the budget exactly (no overcommit): commitments never pass it
    cfg = AdmissionConfig(
        safety_factor=1.2, max_queue=64, dynamic_max_tokens=False, max_overcommit=1.0
    )
    engine = make_engine(num_gpu_blocks=40, admission=cfg)
    decisions = []
    for _i in range(12):
        engine.add_request([3 + (j % 100) for j in range(60)], greedy(40), priority="normal")
        decisions.append(engine.events.recent("admission")[-1].data["decision"])
    assert "admit" in decisions and "queue" in decisions
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.admission.committed_blocks)
        assert engine.admission.committed_blocks <= engine.admission.budget_blocks(40)
    assert engine.admission.committed_blocks == 0 and peak > 0


def test_admission_rejects_what_can_never_fit_at_once() -> None:
    engine = make_engine(num_gpu_blocks=10, admission=AdmissionConfig())
    with pytest.raises(AdmissionRejected, match="never fit") as err:
        engine.add_request([5] * 150, greedy(4))
    assert err.value.decision.kind == "never_fits"


def test_engine_loop_streams_and_control_from_other_threads() -> None:
    engine = make_engine()
    loop = EngineLoop(engine).start()
    try:
        s = loop.submit(PROMPTS[0], greedy(10))
        outs = list(s)  # deltas; a reader that falls behind gets several tokens in one
        assert s.final is not None and s.final.finished and outs[-1].finished
        assert [t for o in outs for t in o.new_token_ids] == s.final.token_ids
        assert "".join(o.new_text for o in outs) == s.final.text and len(s.final.token_ids) == 10
        res = engine.set_max_num_seqs(5).result(5)
        assert res.after["max_num_seqs"] == 5
        with pytest.raises(ValueError, match="max_tokens"):
            loop.submit(PROMPTS[0], SamplingParams(max_tokens=0))
        assert loop.alive and time.monotonic() - loop.last_beat < 1.0
    finally:
        loop.stop()


def test_committed_requests_are_not_blocked_by_a_queued_one_ahead() -> None:
    """A high-priority request waiting for its commitment sorts ahead of normal ones that
    already hold theirs; those must still run (else nothing ever frees the commitment).
    No high-priority reserve here: the two normal requests must commit the whole budget.
    Worst-case admission: predicted admission never makes high priority wait on lower work."""
    cfg = AdmissionConfig(
        safety_factor=1.0,
        max_queue=8,
        dynamic_max_tokens=False,
        high_priority_reserve=0.0,
        estimate="worst_case",
    )
    engine = make_engine(num_gpu_blocks=10, admission=cfg)
    # three different prompts: identical ones would share their prefix's commitment
    a, b, c = (
        engine.add_request([i + j for j in range(60)], greedy(20), priority=p)
        for i, p in ((3, "normal"), (4, "normal"), (5, "high"))
    )
    decisions = [e.data["decision"] for e in engine.events.recent("admission")]
    assert decisions == ["admit", "admit", "queue"]
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.audit_blocks()
    assert not engine.has_unfinished(), engine.snapshot().queues
    assert not any(engine.has_request(r) for r in (a, b, c))
    assert engine.admission.committed_blocks == 0
