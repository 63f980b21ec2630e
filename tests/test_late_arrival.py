"""A request arriving beside a busy batch starts within a step or two, counted in steps.

A burst over HTTP reaches the engine a few milliseconds apart: its first request has a step to
itself and decodes by the time the rest are queued. `prefill_while_decoding` then held the
thirty prompts behind that one decode to 128 tokens a step (two 64-token prompts), and a
request arriving a little later waited behind all of them: 15 steps, half a minute on 2 CPU
cores with the default model. The bound is per decode: one decode does not hold back thirty
prompts, thirty decodes still bound one prompt."""

from __future__ import annotations

from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.sampling_params import SamplingParams
from tests.test_engine import make_engine

PLEN = 64
BOUND = 128  # prefill_while_decoding, set (the CPU default, on any device)


def engine() -> LLMEngine:
    return make_engine(max_num_seqs=32, max_num_batched_tokens=2048, prefill_while_decoding=BOUND)


def prompt(k: int, n: int = PLEN) -> list[int]:
    """Distinct prompts (no shared prefix block: none waits on another's blocks)."""
    return [3 + (k * 37 + i * 11) % 250 for i in range(n)]


def params() -> SamplingParams:
    return SamplingParams(max_tokens=48, ignore_eos=True)


def steps_to_first_token(eng: LLMEngine, rid: str, most: int = 64) -> int:
    seq = eng._seqs[rid]
    for n in range(1, most + 1):
        eng.step()
        if seq.output_token_ids:
            return n
    raise AssertionError(f"{rid} had no token after {most} steps")


def test_a_burst_behind_one_decode_starts_together_and_a_late_request_soon_after() -> None:
    eng = engine()
    first = eng.add_request(prompt(0), params())
    eng.step()  # the burst's first request, alone: it decodes from now on
    assert eng._seqs[first].output_token_ids
    burst = [eng.add_request(prompt(k), params()) for k in range(1, 31)]
    eng.step()
    started = sum(eng._seqs[r].num_computed_tokens > 0 for r in burst)
    assert started == len(burst)  # was 2: the 128-token bound beside the one decode
    eng.step()
    late = eng.add_request(prompt(31), params())
    assert steps_to_first_token(eng, late) == 1  # was 14: behind the burst, two a step


def test_a_late_request_arriving_mid_burst_waits_a_step_or_two() -> None:
    eng = engine()
    eng.add_request(prompt(0), params())
    eng.step()
    for k in range(1, 31):
        eng.add_request(prompt(k), params())
    late = eng.add_request(prompt(31), params())  # queued behind the whole burst
    assert steps_to_first_token(eng, late) <= 2


def test_many_decodes_still_bound_one_long_prompt() -> None:
    eng = engine()
    for k in range(31):
        eng.add_request(prompt(k), params())
    eng.step()  # 31 prompts, nothing decoding: one step
    long = eng._seqs[eng.add_request(prompt(40, 600), params())]
    eng.step()
    assert long.num_computed_tokens == BOUND  # beside 31 decodes: one bound's worth
    eng.step()
    assert long.num_computed_tokens == 2 * BOUND
