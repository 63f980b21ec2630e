"""Live remedies at the edges of the pool: every request still finishes, with the tokens it
would have had.

Each case here once stranded a request on an idle engine or served wrong K/V: a sequence
evicted while holding most of the pool, one swapped out while holding all of it, a dtype switch
to a smaller pool under a request admitted against the larger one, a queued request whose
admission projection was made against a pool since shrunk, blocks of a sequence converted by a
dtype switch entering the prefix cache, an interrupted step keeping the blocks it took, a
fault while a step's tokens were taken losing the answers of the requests it had finished, a
token cap lifted after the pool shrank under the request it had let in (it grew past the
pool, preempted itself and blocked the queue for ever), and a pool share losing a block at
each FP8 round trip."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import pytest
import torch

from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.admission import AdmissionConfig
from kvguard.engine.control import ActionResult
from kvguard.engine.distributed.errors import PoolTorn
from kvguard.engine.kv_cache import KV_TORCH_DTYPES
from tests.test_engine import make_engine
from tests.test_kv_pool import apply
from tests.test_remedies import greedy

LONG = [3 + i % 300 for i in range(420)]  # 27 blocks of 16
SWAP = {"enable_cpu_offload": True, "min_gpu_blocks": 0}  # preempted sequences swap out


def finish(engine: LLMEngine, most: int = 2000) -> dict[str, list[int]]:
    """Step until every request is done (failing, not hanging, after `most` steps), auditing
    the blocks after each step."""
    done: dict[str, list[int]] = {}
    for _ in range(most):
        if not engine.has_unfinished():
            return done
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        engine.audit_blocks()
    sch = engine.scheduler
    queues = {q: [s.request_id for s in getattr(sch, q)] for q in ("running", "waiting", "swapped")}
    raise AssertionError(f"unfinished after {most} steps: {queues}")


def test_an_evicted_sequence_holding_most_of_the_pool_comes_back_when_alone() -> None:
    for offload in (False, True):
        engine = make_engine(
            kv_cache_bytes="256KiB", max_model_len=512, **(SWAP if offload else {})
        )
        assert engine.block_manager.num_blocks == 32
        big = engine.add_request(LONG, greedy(8))
        for _ in range(3):
            engine.step()
        res = apply(engine, engine.evict(1, "normal"))
        assert [rid for rid, _ in res.data["evicted"]] == [big]
        small = engine.add_request([5, 6, 7], greedy(4))
        done = finish(engine)  # 28 of 32 blocks: above readmit_usage, but nothing else runs
        assert len(done[big]) == 8 and len(done[small]) == 4, offload


def test_a_sequence_swapped_out_holding_the_whole_pool_swaps_back_in() -> None:
    engine = make_engine(
        kv_cache_bytes="128KiB", max_model_len=2048, cpu_cache_ratio=0.5, max_num_seqs=1, **SWAP
    )
    assert engine.block_manager.num_blocks == 16 and engine.max_total_len() == 256
    rid = engine.add_request(LONG[:230], greedy(25))  # grows to 255 tokens: all 16 blocks
    seq = engine._seqs[rid]
    while seq.num_computed_tokens < 241:
        engine.step()
    assert len(seq.block_table) == 16
    high = engine.add_request([7, 8, 9], greedy(3), priority="high")
    engine.step()
    assert engine.scheduler.swapped == [seq] and len(seq.host_block_table) == 16
    done = finish(engine)
    assert len(done[rid]) == 25 and len(done[high]) == 3


def test_a_dtype_switch_to_a_smaller_pool_waits_for_the_requests_admitted_against_the_larger() -> (
    None
):
    prompt = LONG[:200]
    want = make_engine(max_model_len=2048).generate([prompt], greedy(500))[0].token_ids
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=2048)
    assert apply(engine, engine.set_kv_cache_dtype("fp16")).ok
    assert engine.block_manager.num_blocks == 64
    rid = engine.add_request(prompt, greedy(500))  # 700 tokens: 44 blocks
    for _ in range(3):
        engine.step()
    res = apply(engine, engine.set_kv_cache_dtype("fp32"))  # 32 blocks: it could never finish
    assert not res.ok
    assert rid in res.detail and "44 blocks" in res.detail and "holds 32" in res.detail
    assert engine.kv_cache.dtype == "fp16"
    got = finish(engine)[rid]
    assert len(got) == 500
    assert got[:100] == want[:100]  # fp16 K/V: the same tokens for a good while
    assert apply(engine, engine.set_kv_cache_dtype("fp32")).ok  # and with it done, the way back


def test_a_request_queued_for_admission_starts_after_the_pool_shrinks_under_it() -> None:
    adm = AdmissionConfig(enable=True, estimate="worst_case", dynamic_max_tokens=True)
    engine = make_engine(kv_cache_bytes="512KiB", max_model_len=256, admission=adm)
    rids = [
        engine.add_request([3 + k + i % 200 for i in range(100)], greedy(150)) for k in range(4)
    ]
    queued = [r for r in rids if not engine.admission_policy.is_admitted(engine._seqs[r])]
    assert queued, "the test needs a request waiting for its commitment"
    assert apply(engine, engine.set_kv_pool_share(0.25)).ok  # its projection no longer fits
    done = finish(engine)
    assert sorted(done) == sorted(rids) and all(len(t) == 150 for t in done.values())


def test_blocks_filled_after_a_dtype_switch_never_serve_the_prefix_cache() -> None:
    prompt = [3 + (i * 37) % 290 for i in range(40)]
    cfg = {"kv_cache_bytes": "512KiB", "max_model_len": 256, "max_num_batched_tokens": 8}
    want = make_engine(**cfg).generate([prompt], greedy(40))[0].token_ids
    engine = make_engine(**cfg, enable_prefix_caching=True)
    assert apply(engine, engine.set_kv_cache_dtype("fp8_e4m3")).ok
    engine.add_request(prompt[:30], greedy(2))
    engine.step()  # its tokens 0-7 computed in fp8
    engine.set_kv_cache_dtype("fp32")
    engine.step()  # back in fp32: tokens 8-15 fill block 0 with converted K/V before them
    finish(engine)
    hits = engine.block_manager.hit_tokens
    rid = engine.add_request(prompt, greedy(40))
    assert finish(engine)[rid] == want
    assert engine.block_manager.hit_tokens == hits  # nothing of the converted request found
    again = engine.add_request(prompt, greedy(40))  # what the fp32 request filled is found
    assert finish(engine)[again] == want and engine.block_manager.hit_tokens > hits


def test_an_interrupted_step_gives_back_the_blocks_it_took() -> None:
    engine = make_engine(
        kv_cache_bytes="256KiB", max_model_len=512, max_num_batched_tokens=64, **SWAP
    )
    first = engine.add_request([3 + i % 200 for i in range(40)], greedy(20))
    engine.step()
    engine.step()
    second = engine.add_request([5 + i % 200 for i in range(100)], greedy(5))
    engine.mailbox.post(lambda: (engine.interrupt.set(), ("interrupt", True, {}))[1])
    assert engine.step() == []
    assert engine._counters["steps_interrupted"] == 1
    engine.audit_blocks()  # each holds the blocks of its computed tokens, no more
    res = apply(engine, engine.evict(2, "normal"))
    assert len(res.data["evicted"]) == 2
    done = finish(engine)
    assert len(done[first]) == 20 and len(done[second]) == 5
    assert engine.block_manager.num_used == 0 and engine.host_block_manager.num_used == 0


def test_an_ended_request_is_answered_though_the_step_that_would_answer_it_fails() -> None:
    """An abort's output waits for the next step; a step that raises before it runs (a bug in
    scheduling, say) hands it to the step after, so the client still gets its answer."""
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=512)
    rid = engine.add_request([3, 4, 5], greedy(50))
    engine.step()
    assert engine.abort(rid)
    schedule = engine.scheduler.schedule

    def broken() -> None:
        raise RuntimeError("a scheduling bug")

    engine.scheduler.schedule = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="scheduling bug"):
        engine.step()
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")]


def test_a_fault_taking_a_steps_tokens_ends_its_requests_and_keeps_the_finished_answers() -> None:
    """A step whose tokens cannot all be taken (a fault in the bookkeeping after the forward):
    the request that finished in it keeps its answer, the others end with an error, the blocks
    go back and the engine serves the next request."""
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=512)
    short = engine.add_request([3, 4, 5], greedy(1))
    long = engine.add_request([6, 7, 8], greedy(20))
    on_token = engine._on_token
    calls = []

    def faulty(seq, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(seq.request_id)
        if len(calls) == 2:
            raise RuntimeError("a bookkeeping bug")
        return on_token(seq, *args, **kwargs)

    engine._on_token = faulty  # type: ignore[method-assign]
    outs = {o.request_id: o for o in engine.step()}
    engine._on_token = on_token  # type: ignore[method-assign]
    assert calls == [short, long]
    assert outs[short].finish_reason == "length" and len(outs[short].token_ids) == 1
    assert outs[long].finish_reason == "error"
    engine.audit_blocks()
    assert engine.block_manager.num_used == 0 and not engine.has_unfinished()
    after = engine.add_request([6, 7, 8], greedy(4))
    assert len(finish(engine)[after]) == 4


@pytest.mark.parametrize("shrink", ["fp8-back-to-fp32", "smaller-kv_cache_bytes"])
def test_lifting_a_cap_after_the_pool_shrank_ends_the_request_at_the_pool(shrink: str) -> None:
    """A cap lets a smaller pool in (the request it caps fits it), and lifting the cap gives
    the request its own max_tokens back: within the pool now in force, as for a request
    admitted against it. It ends with `length` where the pool is full, with no preemption,
    and a request queued after it runs. It once kept the length limit of the larger pool:
    it filled the new one, preempted itself and waited at the head of the queue for ever,
    every request behind it waiting too."""
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=2048)  # fp32: 32 blocks
    fp8 = shrink == "fp8-back-to-fp32"
    if fp8:
        assert apply(engine, engine.set_kv_cache_dtype("fp8_e4m3")).ok  # 126 blocks
    rid = engine.add_request(LONG[: 420 if fp8 else 200], greedy(1500))
    seq = engine._seqs[rid]
    admitted = seq.max_total_len  # the larger pool's tokens (fp8: 2016, below max_model_len)
    for _ in range(3):
        engine.step()
    assert apply(engine, engine.set_max_new_tokens_cap(50)).ok  # 470 or 250 tokens
    if fp8:
        res = apply(engine, engine.set_kv_cache_dtype("fp32"))
    else:
        res = apply(engine, engine.reconfigure({("kv_cache_bytes",): 128 * 1024}))
    assert res.ok, res.detail  # the capped request fits it
    pool = engine.block_manager.num_blocks * engine.config.block_size
    assert pool == (512 if fp8 else 256) < admitted
    assert apply(engine, engine.set_max_new_tokens_cap(None)).ok
    assert seq.max_tokens == 1500 and seq.max_total_len == pool
    later = engine.add_request([5, 6, 7, 8], greedy(4))
    done = finish(engine)
    assert seq.finish_reason == "length" and not seq.truncated
    assert len(seq.prompt_token_ids) + len(done[rid]) == pool  # the pool's every token
    assert len(done[later]) == 4
    assert sum(engine.snapshot().preemptions.values()) == 0


@dataclass
class Outgrowing:
    """An engine whose next step applies an eviction of request `rid` and a switch back from
    FP8 that shrinks the pool under it to fewer tokens than it holds, and ends it
    (`Scheduler._outgrown`); `made`: the tokens it made."""

    engine: LLMEngine
    rid: str
    made: list[int]
    evict: Future
    switch: Future

    def check_applied(self, offload: bool) -> None:
        mode = "swap" if offload else "recompute"
        assert self.evict.result(0).data["evicted"] == [(self.rid, mode)]
        assert self.switch.result(0).ok and self.engine.block_manager.num_blocks == 32


def outgrowing(monkeypatch: pytest.MonkeyPatch, offload: bool) -> Outgrowing:
    """`Outgrowing`, the request recomputed or swapped out (`offload`), with the engine's own
    checks that keep a request within the pool taken out."""
    monkeypatch.setattr(LLMEngine, "_longest_need", lambda self: (0, None))
    monkeypatch.setattr(LLMEngine, "_bound_lengths", lambda self: None, raising=False)
    swap = {**SWAP, "cpu_cache_ratio": 0.6} if offload else {}  # a host pool that holds it
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=2048, **swap)
    assert apply(engine, engine.set_kv_cache_dtype("fp8_e4m3")).ok
    rid = engine.add_request(LONG, greedy(1500))
    seq = engine._seqs[rid]
    while seq.num_tokens <= 520:  # 33 blocks of 16: more than the fp32 pool's 32
        engine.step()
    evict, switch = engine.evict(1, "normal"), engine.set_kv_cache_dtype("fp32")
    return Outgrowing(engine, rid, list(seq.output_token_ids), evict, switch)


@pytest.mark.parametrize("offload", [False, True], ids=["recomputed", "swapped"])
def test_a_sequence_longer_than_the_whole_pool_ends_and_the_queue_behind_it_runs(
    monkeypatch: pytest.MonkeyPatch, offload: bool
) -> None:
    """The scheduler's safety net, should a length limit ever escape the pool again: with the
    engine's own checks taken out, a switch back from FP8 shrinks the pool under an evicted
    request that already holds more tokens than the new pool (recomputed or swapped out). It
    could never run again: it ends with `length` and the output it made, and the request
    queued behind it runs, instead of both waiting for ever."""
    out = outgrowing(monkeypatch, offload)
    engine, rid, made = out.engine, out.rid, out.made
    later = engine.add_request([5, 6, 7, 8], greedy(4))
    outs = {o.request_id: o for o in engine.step()}  # both applied, then the step
    out.check_applied(offload)
    assert outs[rid].finished and outs[rid].finish_reason == "length"
    assert outs[rid].token_ids == made
    assert len(finish(engine)[later]) == 4
    assert engine.block_manager.num_used == 0 and engine.host_block_manager.num_used == 0


def test_a_pool_share_keeps_its_blocks_through_fp8_round_trips() -> None:
    """The pool share a remedy asked for is what sizes the pool in each dtype; the one it came
    to (floored to whole blocks) is only reported. Kept as the blocks it came to, the share
    was floored again at every switch and the pool lost a block: 15 of 22 blocks came back
    as 14, half of the fp8 pool taken (157 of 315) as 39 fp32 blocks instead of 40."""
    engine = make_engine(kv_cache_bytes=str(22 * 8192), max_model_len=64)
    bm = engine.block_manager
    res = apply(engine, engine.set_kv_pool_share(15.5 / 22))
    assert res.data["blocks_after"] == 15 and res.data["share"] == round(15 / 22, 4)
    assert "(68% of configured)" in res.detail
    for _ in range(3):
        assert apply(engine, engine.set_kv_cache_dtype("fp8_e4m3")).ok
        assert bm.num_blocks == 60  # 15.5/22 of 86
        assert apply(engine, engine.set_kv_cache_dtype("fp32")).ok
        assert bm.num_blocks == 15
    engine = make_engine(kv_cache_bytes=str(80 * 8192), max_model_len=64)
    bm = engine.block_manager
    assert apply(engine, engine.set_kv_cache_dtype("fp8_e4m3")).ok
    res = apply(engine, engine.set_kv_pool_share(0.5))
    assert res.data["blocks_after"] == 157 and res.data["share"] == round(157 / 315, 4)
    for _ in range(3):
        assert apply(engine, engine.set_kv_cache_dtype("fp32")).ok
        assert bm.num_blocks == 40 == engine.pool_blocks("fp32")
        assert apply(engine, engine.set_kv_cache_dtype("fp8_e4m3")).ok
        assert bm.num_blocks == 157
    rid = engine.add_request([3 + i % 200 for i in range(30)], SamplingParams(max_tokens=8))
    assert len(finish(engine)[rid]) <= 8


def _failing_layers(
    monkeypatch: pytest.MonkeyPatch, fail: set[int], error: type[Exception] = torch.OutOfMemoryError
) -> list[int]:
    """Make the `fail`-th (0-based) layer buffers built from now on run out of memory (on a
    CPU torch says so with a RuntimeError from its allocator)."""
    from kvguard.engine import kv_cache

    real, calls = kv_cache.new_layer, []

    def new_layer(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(calls))
        if calls[-1] in fail:
            raise error("injected: DefaultCPUAllocator: can't allocate memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_cache, "new_layer", new_layer)
    return calls


def _refused(
    engine: LLMEngine,
    monkeypatch: pytest.MonkeyPatch,
    action: str,
    error: type[Exception] = torch.OutOfMemoryError,
) -> tuple[ActionResult, list[int]]:
    """A switch to fp16 or a resize to 0.75 of the pool whose second layer fails: refused."""
    calls = _failing_layers(monkeypatch, {1}, error)
    if action == "switch":
        fut = engine.set_kv_cache_dtype("fp16")
    else:
        fut = engine.set_kv_pool_share(0.75)
    res = apply(engine, fut)
    monkeypatch.undo()
    assert not res.ok, action
    return res, calls


def _pool_whole(engine: LLMEngine, dtype: str, blocks: int) -> None:
    pool = engine.kv_cache.device_pool
    assert engine.kv_cache.dtype == dtype and pool.num_blocks == blocks
    assert engine.block_manager.num_blocks == blocks
    for k, v, *_ in pool.layers:
        assert k.dtype == v.dtype == KV_TORCH_DTYPES[dtype] and k.shape[0] == v.shape[0] == blocks


def test_a_pool_conversion_out_of_memory_is_refused_and_the_pool_stays_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The FP8 switch and the pool resize are remedies, run under memory pressure: a layer
    that cannot be built undoes the layers already converted, the bookkeeping goes back, the
    action is refused naming why, and every request finishes (a resize, which copies bytes
    as they are, with the tokens it would have had). Failing to put it back too stops the
    engine (a torn pool), never serves from it."""
    prompts = [[3 + (7 * i + j) % 200 for j in range(40)] for i in range(4)]
    want = make_engine(num_gpu_blocks=32, max_model_len=256).generate(prompts, greedy(30))
    for action in ("switch", "resize"):
        engine = make_engine(num_gpu_blocks=32, max_model_len=256)
        rids = [engine.add_request(p, greedy(30)) for p in prompts]
        for _ in range(4):
            engine.step()
        res, calls = _refused(engine, monkeypatch, action)  # layer 0 converts, layer 1 fails
        assert "could not be built (out of memory" in res.detail and len(calls) == 3, action
        _pool_whole(engine, "fp32", 32)
        engine.audit_blocks()
        done = finish(engine)
        if action == "resize":
            assert [done[r] for r in rids] == [o.token_ids for o in want]
        else:  # layer 0's K/V went through fp16 and back
            assert all(len(done[r]) == 30 for r in rids)
    engine = make_engine(num_gpu_blocks=32, max_model_len=256)
    engine.add_request(prompts[0], greedy(30))
    engine.step()
    _failing_layers(monkeypatch, {1, 2})  # layer 1 fails, and so does putting layer 0 back
    engine.set_kv_cache_dtype("fp16")
    with pytest.raises(PoolTorn, match="half converted"):
        engine.step()


def test_a_refused_conversion_serves_no_cached_block_it_did_not_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finished request's blocks stay in the prefix cache, free. A refused dtype switch put
    back only the blocks in use (and through the new dtype): the cache forgets the rest, so
    the same prompt is computed again; a refused resize put back every cached block it moved,
    byte for byte, so they serve. Either way the same tokens, whatever error the allocator
    raised."""
    prompt = [3 + j % 200 for j in range(48)]
    want = make_engine(num_gpu_blocks=32, max_model_len=256).generate([prompt], greedy(8))
    for action, error in (("switch", torch.OutOfMemoryError), ("resize", RuntimeError)):
        engine = make_engine(num_gpu_blocks=32, max_model_len=256)
        assert engine.generate([prompt], greedy(8))[0].token_ids == want[0].token_ids
        res, _ = _refused(engine, monkeypatch, action, error)
        assert "could not be built" in res.detail, action
        again = engine.generate([prompt], greedy(8))[0]
        assert again.token_ids == want[0].token_ids, action
        assert again.num_cached_tokens == (0 if action == "switch" else 32), action
        engine.audit_blocks()
