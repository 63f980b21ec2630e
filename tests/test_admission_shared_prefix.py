"""Admission counts a prompt prefix that the prefix cache shares once: the `n` choices of one
request (identical prompts) share the prompt's full blocks, the first computing them and the
others taking them from the cache, so a group's prefix is committed once, for as long as any of
its admitted requests lives. With the cache off every request counts its whole prompt."""

from __future__ import annotations

import pytest

from kvguard.engine.admission import NORMAL, AdmissionConfig
from kvguard.engine.config import EngineConfig
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.sampling_params import SamplingParams
from tests.test_remedies import run_all

PROMPT = [65 + (i * 7) % 50 for i in range(400)]  # 25 blocks of 16; 24 shareable
LONG = [3 + (i * 11) % 60 for i in range(470)]  # another prompt, 30 blocks


def make_engine(estimate: str, caching: bool = True) -> LLMEngine:
    """A 64-block pool (57 outside the high-priority reserve), as the daemon's 512KiB one."""
    # overcommit 1: predicted admission plans to the budget itself (calm steps would loosen it)
    adm = AdmissionConfig(estimate=estimate, reserved_headroom_bytes=0, max_overcommit=1.0)
    cfg = EngineConfig(
        model="tiny",
        kv_cache_bytes="512KiB",
        max_model_len=512,
        num_threads=2,
        enable_prefix_caching=caching,
        admission=adm,
    )
    engine = LLMEngine.from_config(cfg, progress=False)
    assert engine.block_manager.num_blocks == 64 and engine.config.block_size == 16
    return engine


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def admitted(engine: LLMEngine, rids: list[str]) -> int:
    return sum(engine.admission_policy.is_admitted(engine._seqs[r]) for r in rids)


def assert_released(engine: LLMEngine) -> None:
    assert engine.admission.committed_blocks == 0
    assert engine.admission_policy._groups == {}
    assert engine.admission_policy._tickets == {}


@pytest.mark.parametrize("estimate", ["predicted", "worst_case"])
def test_the_choices_of_one_prompt_are_admitted_together(estimate: str) -> None:
    """n=4 of a 400-token prompt with max_tokens 32: 24 shared blocks and about 3 of each choice
    fit the 57 blocks at once; counting the prompt per choice admitted 2."""
    engine = make_engine(estimate)
    rids = [engine.add_request(PROMPT, params(32)) for _ in range(4)]
    assert admitted(engine, rids) == 4
    assert engine.admission.decisions == {"admit": 4, "queue": 0, "reject": 0}
    # one prompt's peak and each other choice's own tokens once: 400 + 32 tokens (27 blocks)
    # and 16 + 32 (3); worst case with the margin on the answer, 400 + 37 (28) and 16 + 37 (4)
    whole, own = {"predicted": (27, 3), "worst_case": (28, 4)}[estimate]
    assert engine.admission.committed_blocks == whole + 3 * own
    done = run_all(engine)
    assert sorted(done) == sorted(rids)
    assert all(o.num_output_tokens == 32 and o.finish_reason == "length" for o in done.values())
    assert engine.scheduler.num_preemptions == 0  # the plan was right: they did fit together
    assert_released(engine)


@pytest.mark.parametrize("estimate", ["predicted", "worst_case"])
def test_the_prefix_stays_counted_after_the_member_that_brought_it_ends(estimate: str) -> None:
    """The first request of a group (the one that committed the prefix) ends early: the prefix
    is still held by the survivor, so it stays counted, and a request that would fit only if it
    were forgotten waits until the survivor ends."""
    engine = make_engine(estimate)
    first = engine.add_request(PROMPT, params(2))
    second = engine.add_request(PROMPT, params(32))
    assert admitted(engine, [first, second]) == 2
    whole_first = engine.admission.projected_blocks(400, 2)
    assert engine.admission.committed_blocks < whole_first + engine.admission.projected_blocks(
        400, 32
    )
    done = {}
    while first not in done:
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.audit_blocks()
    assert second not in done and engine.admission_policy.is_admitted(engine._seqs[second])
    assert len(engine.admission_policy._groups) == 1  # the survivor keeps the group
    seq = engine._seqs[second]
    if estimate == "predicted":
        # the survivor's load is its whole length again, prefix included
        assert [h for h, _ in engine.admission_policy._live_loads()] == [seq.num_tokens]
    else:
        assert engine.admission.committed_blocks >= 24 + 4
    # 30 blocks of prompt + 2 of output beside the survivor's 27: past 57 only if the prefix
    # the survivor holds is counted
    third = engine.add_request(LONG, params(32))
    assert not engine.admission_policy.is_admitted(engine._seqs[third])
    done.update(run_all(engine))
    assert sorted(done) == sorted([first, second, third])
    assert done[third].num_output_tokens == 32
    assert_released(engine)


@pytest.mark.parametrize("estimate", ["predicted", "worst_case"])
def test_with_the_cache_off_each_request_counts_its_whole_prompt(estimate: str) -> None:
    engine = make_engine(estimate, caching=False)
    rids = [engine.add_request(PROMPT, params(48)) for _ in range(4)]
    # 400 + 48 tokens: 28 blocks, 2 fit 57; worst case 400 + 48 x 1.15: 29 blocks, 1 fits
    whole, want = {"predicted": (28, 2), "worst_case": (29, 1)}[estimate]
    assert engine.admission.projected_blocks(400, 48) == whole
    assert admitted(engine, rids) == want
    assert engine.admission.committed_blocks == want * whole
    assert engine.admission_policy._groups == {}
    done = run_all(engine)
    assert sorted(done) == sorted(rids)
    assert_released(engine)


def test_a_request_for_its_prompt_logprobs_shares_nothing() -> None:
    """It computes its whole prompt itself (no cached blocks), so it counts it whole."""
    engine = make_engine("worst_case")
    a = engine.add_request(PROMPT, params(48))  # 29 blocks (as above): 2 whole pass 57
    b = engine.add_request(
        PROMPT, SamplingParams(max_tokens=48, ignore_eos=True, prompt_logprobs=1)
    )
    assert admitted(engine, [a, b]) == 1
    done = run_all(engine)
    assert sorted(done) == sorted([a, b])
    assert_released(engine)


def start_decoding(engine: LLMEngine, max_tokens: int) -> str:
    """A request of PROMPT, run until it decodes: its prompt's full blocks are computed."""
    rid = engine.add_request(PROMPT, params(max_tokens))
    while engine._seqs[rid].num_computed_tokens <= len(PROMPT):
        engine.step()
    return rid


def switch_to_fp8_and_back(engine: LLMEngine) -> None:
    """FP8 KV on and off again (a pressure remedy and its undo): every live sequence that has
    computed K/V is converted, and the prefix cache gives none of its blocks again."""
    for dtype in ("fp8_e4m3", "auto"):
        done = engine.set_kv_cache_dtype(dtype)
        engine.step()
        assert done.result(1).ok
    assert engine.block_manager.num_blocks == 64


@pytest.mark.parametrize("estimate", ["predicted", "worst_case"])
def test_a_prompt_converted_by_a_dtype_switch_is_not_shared_with_new_requests(
    estimate: str,
) -> None:
    """The first request's blocks are unfindable after the switch, so the identical requests
    that come next compute the prompt again: the first of them commits it whole and waits for
    room (counting only its own tokens admitted all three at once: 63 of 64 blocks used, past
    the 57 of the budget, and a preemption)."""
    engine = make_engine(estimate)
    first = start_decoding(engine, 100)
    switch_to_fp8_and_back(engine)
    rids = [engine.add_request(PROMPT, params(48)) for _ in range(3)]
    peak = 0

    def track(engine: LLMEngine) -> None:
        nonlocal peak
        peak = max(peak, engine.block_manager.num_used)

    done = run_all(engine, track)
    assert sorted(done) == sorted([first, *rids])
    assert all(done[r].num_output_tokens == 48 for r in rids)
    assert engine.scheduler.num_preemptions == 0
    assert peak <= engine.admission.limit_blocks(64, NORMAL)
    assert_released(engine)


def test_a_member_yet_to_start_commits_the_prefix_it_will_compute_again() -> None:
    """A group member admitted but not started when the pool is converted finds no block of
    the member that is decoding, and computes the prompt again: its commitment grows by the
    prefix, and what the requests hold stays within what admission committed. Every
    commitment is given back once."""
    engine = make_engine("worst_case")
    first = start_decoding(engine, 100)
    second = engine.add_request(PROMPT, params(48))
    assert admitted(engine, [second]) == 1 and engine._seqs[second].num_computed_tokens == 0
    before = engine.admission.committed_blocks
    switch_to_fp8_and_back(engine)
    shared = engine.admission.projected_blocks(400, 48) - engine.admission.projected_blocks(16, 48)
    assert engine.admission.committed_blocks == before + shared

    def within_commitments(engine: LLMEngine) -> None:
        assert engine.block_manager.num_used <= engine.admission.committed_blocks

    within_commitments(engine)
    done = run_all(engine, within_commitments)
    assert sorted(done) == sorted([first, second])
    assert engine.scheduler.num_preemptions == 0
    assert_released(engine)
