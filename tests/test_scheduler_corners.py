"""Scheduler corners: preemption and readmission that once stalled or looped.

An evicted (held) sequence whose next chunk needs most of the pool, with an admitted request
queued behind it, left an idle engine with work it would never run, and one swapped out to
the host pool starved while a request a step started around it; a switch back from FP8
after a pool-share cut left a pool smaller than one max_model_len request; and a prompt
admitted beside lower-priority decodes preempted itself, and redid its prefill, every time a
later chunk needed blocks, since the decodes (scheduled first) were never victims; and a
prompt swapped out mid-prompt came back for a chunk whose blocks were not free, and swapped
itself straight back out, every step."""

from __future__ import annotations

import pytest

from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.events import EngineEvent
from kvguard.engine.sequence import Status
from tests.test_engine import make_engine
from tests.test_kv_pool import apply
from tests.test_live_corners import LONG, SWAP, finish
from tests.test_remedies import greedy


def alone(prompt: list[int], n: int, **cfg) -> list[int]:  # noqa: ANN003 - engine config
    """`prompt`'s greedy tokens on an engine serving nothing else."""
    return make_engine(**cfg).generate([prompt], greedy(n))[0].token_ids


def started(engine: LLMEngine, rid: str) -> bool:
    seq = engine._seqs[rid]
    return seq.first_scheduled_time is not None and seq.num_computed_tokens > 0


# -- 1: an evicted sequence never stalls an idle engine -------------------------------------
@pytest.mark.parametrize("priority", ["low", "normal"])
def test_an_evicted_sequence_with_a_request_queued_behind_it_lets_it_start_then_returns(
    priority: str,
) -> None:
    cfg = {"kv_cache_bytes": "256KiB", "max_model_len": 512}
    engine = make_engine(**cfg)
    assert engine.block_manager.num_blocks == 32
    big = engine.add_request(LONG, greedy(8), priority=priority)  # 27 of 32 blocks
    for _ in range(3):
        engine.step()
    small = engine.add_request([5, 6, 7], greedy(4), priority=priority)  # queued behind it
    res = apply(engine, engine.evict(1, priority))  # recomputed: nothing swaps here
    assert res.data["evicted"] == [(big, "recompute")]
    small_first = started(engine, small) and not started(engine, big)
    done = finish(engine, most=100)  # it stalled here: nothing ran, both waited for ever
    # the idle engine's next step started the request behind it, not the evicted one
    assert small_first
    assert done[big] == alone(LONG, 8, **cfg)
    assert done[small] == alone([5, 6, 7], 4, **cfg)


def test_sequences_preempted_by_a_pool_cut_do_not_stall_the_queue_behind_them() -> None:
    cfg = {"kv_cache_bytes": "256KiB", "max_model_len": 256}
    engine = make_engine(**cfg)
    a = engine.add_request(LONG[:200], greedy(40))  # 13 -> 15 blocks
    b = engine.add_request([9 + i % 250 for i in range(200)], greedy(40))
    for _ in range(4):
        engine.step()
    c = engine.add_request([5, 6, 7], greedy(4))
    res = apply(engine, engine.set_kv_pool_share(0.5))  # 16 blocks: one of them must go
    assert res.ok and engine.block_manager.num_blocks == 16
    assert [s.request_id for s in engine.scheduler.waiting if s.held] == [b]
    done = finish(engine, most=300)
    assert sorted(done) == sorted([a, b, c])
    assert [len(done[r]) for r in (a, b, c)] == [40, 40, 4]
    assert done[b] == alone([9 + i % 250 for i in range(200)], 40, **cfg)


def test_an_evicted_sequence_is_not_starved_by_a_stream_of_requests_behind_it() -> None:
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=512)
    big = engine.add_request(LONG, greedy(8), priority="low")
    for _ in range(3):
        engine.step()
    engine.add_request([5, 6, 7], greedy(4), priority="low")
    apply(engine, engine.evict(1, "low"))
    seq = engine._seqs[big]
    for i in range(60):  # a request arrives every step: the engine never idles again
        engine.add_request([5 + i % 50, 6, 7], greedy(4), priority="low")
        engine.step()
        engine.audit_blocks()
        if seq.is_finished:
            break
    assert seq.is_finished, f"the evicted request was still {seq.status} after 60 steps"


@pytest.mark.parametrize("remedy", ["evict", "pool-cut"])
def test_an_evicted_sequence_swapped_out_keeps_its_place_ahead_of_a_stream_of_requests(
    remedy: str,
) -> None:
    # Swapped out (not recomputed), it waited outside the queue: each step's new request
    # started around it, the engine never idled and its return (which must leave usage under
    # readmit_usage: 27 of 32 blocks, or 13 of a cut pool's 16, never does beside anything)
    # never came. Now requests queued after it wait while it is out, as they wait behind a
    # recomputed one: the work running when it was evicted finishes, those requests start
    # first on the idle engine, and it comes back next, before any newer request.
    cfg = {"kv_cache_bytes": "256KiB", **SWAP, "cpu_cache_ratio": 0.9}
    cfg["max_model_len"] = 512 if remedy == "evict" else 256
    engine = make_engine(**cfg)
    prompt = LONG if remedy == "evict" else LONG[:200]
    big = engine.add_request(prompt, greedy(8), priority="low")
    near = [11 + i % 200 for i in range(60)]  # 4 blocks: the cut pool holds it, not both
    other = engine.add_request(near, greedy(12), priority="normal")  # runs on
    for _ in range(3):
        engine.step()
    fut = engine.evict(1, "low") if remedy == "evict" else engine.set_kv_pool_share(0.5)
    res = apply(engine, fut)
    assert res.ok and (res.data.get("evicted") or res.data.get("preempted")) == [(big, "swap")]
    seq, sch = engine._seqs[big], engine.scheduler
    assert seq.status is Status.SWAPPED and seq.held
    stream: list[str] = []
    done: dict[str, list[int]] = {}
    queued: set[str] = set()  # the requests it let start first, on the idle engine
    for i in range(60):  # a low request arrives every step: the engine never idles
        stream.append(engine.add_request([5 + i % 50, 6, 7], greedy(4), priority="low"))
        held = seq.held
        for o in engine.step():
            if o.finished:
                assert o.request_id not in done  # never finished twice
                done[o.request_id] = o.token_ids
        engine.audit_blocks()
        began = {r for r in stream if r in done or started(engine, r)}
        if seq.held:  # the work that ran when it was evicted still runs: the queue waits
            assert not began, f"{sorted(began)} started around the evicted request"
        elif held:  # the engine idled: the requests queued behind it go first
            assert other in done and seq.status is Status.SWAPPED
            queued = set(stream)
        if seq.status is Status.SWAPPED:
            assert began <= queued, f"{sorted(began - queued)} started while it was out"
        if seq.is_finished:
            break
    assert seq.is_finished, f"the evicted request was still {seq.status} after {i + 1} steps"
    assert other in done and sch.num_preemptions == 1  # the eviction's, nothing else
    done.update(finish(engine, most=100))
    assert sorted(done) == sorted([big, other, *stream])  # nothing lost or duplicated
    assert done[big] == alone(prompt, 8, **cfg)
    assert all(len(done[r]) == 4 for r in stream)


# -- 2: the way back from FP8 keeps the pool's floor ----------------------------------------
def test_switching_back_from_fp8_after_a_pool_cut_keeps_one_max_model_len_request() -> None:
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=512)
    bm = engine.block_manager
    assert bm.num_blocks == 32  # one max_model_len request: the floor a cut keeps in fp32
    assert apply(engine, engine.set_kv_cache_dtype("fp8_e4m3")).ok
    assert bm.num_blocks > 100
    assert apply(engine, engine.set_kv_pool_share(0.25)).ok
    assert bm.num_blocks == 32  # a quarter of the fp8 pool, held at the floor
    res = apply(engine, engine.set_kv_cache_dtype("auto"))
    assert res.ok, res.detail
    assert bm.num_blocks == 32 and engine.max_total_len() == 512  # not a quarter of 32
    assert engine.pool_blocks("fp32") == 32
    prompt = list(range(3, 303))
    rid = engine.add_request(prompt, greedy(8))  # it was refused: "raise kv_cache_bytes"
    assert len(finish(engine)[rid]) == 8


# -- 3: a prompt beside lower-priority decodes preempts them, not itself ---------------------
# ids below the tokenizer's 259: prompt log-probabilities of the padding rows are refused
LOWS = [[3 + (j * 13 + i) % 250 for i in range(100)] for j in range(2)]
NORMAL = [7 + i % 250 for i in range(300)]  # 19 blocks: 32 hold it or the two lows, not all


@pytest.mark.parametrize(
    ("extra", "params"),
    [
        ({}, greedy(10)),  # no prefix cache: a readmitted prompt computes everything again
        ({"enable_prefix_caching": True}, SamplingParams(max_tokens=10, prompt_logprobs=1)),
        ({**SWAP}, greedy(10)),  # the decodes taken out of the step swap out
    ],
    ids=["uncached", "prompt-logprobs", "offload"],
)
def test_a_prompt_preempts_the_lower_priority_decodes_in_its_step_not_itself(
    extra: dict, params: SamplingParams
) -> None:
    cfg = {"kv_cache_bytes": "256KiB", "max_model_len": 512, "prefill_while_decoding": 128}
    if "enable_prefix_caching" not in extra:
        cfg["enable_prefix_caching"] = False
    cfg.update(extra)
    engine = make_engine(**cfg)
    lows = [engine.add_request(p, greedy(120), priority="low") for p in LOWS]
    low_seqs = {r: engine._seqs[r] for r in lows}
    for _ in range(3):
        engine.step()
    rid = engine.add_request(NORMAL, params, priority="normal")
    seq = engine._seqs[rid]
    preempted_lows = set()
    done: dict[str, list[int]] = {}
    for _ in range(400):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        engine.audit_blocks()
        preempted_lows |= {r for r, s in low_seqs.items() if s.num_preemptions}
        # it preempted itself every third step, redoing its prefill, while the lows ran on
        assert seq.num_preemptions == 0
    assert sorted(done) == sorted([rid, *lows])
    assert preempted_lows == {lows[1]} or preempted_lows == set(lows)  # the newest first
    assert engine.scheduler.preemptions["swap" if extra.get("enable_cpu_offload") else "recompute"]
    want = {"enable_prefix_caching": False, "kv_cache_bytes": "256KiB", "max_model_len": 512}
    assert done[rid] == alone(NORMAL, 10, **want)
    for r, p in zip(lows, LOWS, strict=True):
        assert done[r] == alone(p, 120, **want)


# -- 4: a sequence swapped back in mid-prompt runs what fits, never preempts itself ----------
def test_a_prompt_swapped_back_in_runs_the_chunk_that_fits_not_swapped_straight_out() -> None:
    # 32 blocks: a decoding request holds 17, a low prompt of 300 tokens (19 blocks) runs in
    # chunks of 64 beside it until a cut of max_num_seqs swaps it out mid-prompt. It came back
    # once the blocks for its next token were free, but the step gave it a whole chunk, the
    # chunk's blocks were not there, and it was its own victim: swapped in and straight back
    # out, every step until the decoding request ended (45 preemptions), with no progress.
    cfg = {"kv_cache_bytes": "256KiB", "max_model_len": 512, **SWAP, "cpu_cache_ratio": 0.5}
    cfg |= {"max_num_batched_tokens": 64, "enable_prefix_caching": False}
    engine = make_engine(**cfg)
    assert engine.block_manager.num_blocks == 32
    decoding = [3 + i % 200 for i in range(256)]
    prompt = [7 + (i * 5) % 240 for i in range(300)]
    a = engine.add_request(decoding, greedy(100), priority="normal")
    for _ in range(4):  # its prompt, in chunks of 64
        engine.step()
    low = engine.add_request(prompt, greedy(5), priority="low")
    engine.step()
    engine.step()
    seq = engine._seqs[low]
    apply(engine, engine.set_max_num_seqs(1))  # the low prompt is swapped out, mid-prompt
    assert seq.status is Status.SWAPPED and 0 < seq.num_computed_tokens < len(prompt)
    apply(engine, engine.set_max_num_seqs(2))
    moves: list[str] = []  # its swaps in a step

    def moved(ev: EngineEvent) -> None:
        if ev.kind in ("swapped_in", "swapped_out") and ev.data["request_id"] == low:
            moves.append(ev.kind)

    engine.events.subscribe(moved)
    done: dict[str, list[int]] = {}
    for _ in range(400):
        if not engine.has_unfinished():
            break
        moves.clear()
        before = seq.num_computed_tokens
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        engine.audit_blocks()
        assert not {"swapped_in", "swapped_out"} <= set(moves), "swapped in and back out"
        if "swapped_in" in moves:  # it came back to run: its tokens ran in this step
            assert seq.num_computed_tokens > before
    assert sorted(done) == sorted([a, low])
    assert seq.num_preemptions <= 3  # the cut's, and the real lack of room, not a step's each
    assert done[low] == alone(prompt, 5, **cfg)
    assert done[a] == alone(decoding, 100, **cfg)
