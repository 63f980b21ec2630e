"""Speculative decoding by prompt lookup: drafts come from the request's own earlier text, are
verified in one step, and change nothing a request gets: a greedy request gets the same tokens
and log-probabilities (to rounding), a sampled one tokens from the same distribution; drafts never
take a block from anyone, and their rejected K/V never reach the prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.model_runner import ModelRunner
from kvguard.engine.sequence import Sequence
from kvguard.engine.speculative import (
    Lookup,
    StepCost,
    accepted_prefix,
    draft_threshold,
    ngram_sizes,
)
from tests.test_engine import make_engine
from tests.test_kv_pool import apply
from tests.test_remedies import run_all
from tests.test_server import Daemon
from tests.test_structured_output import metric

TEXT = (
    "A paged KV cache keeps each request's keys and values in fixed-size blocks, so memory is "
    "taken as a request grows and given back the moment it ends. The scheduler admits requests "
    "while blocks are free, and preempts the newest, lowest-priority request when they run out."
)


class Tokens:
    """What a lookup reads of a request: its length and slices of its tokens."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        return self.ids[start:end]


# -- the lookup ---------------------------------------------------------------------------


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_ngram() -> None:
    seq = Tokens([1, 2, 3, 4, 5, 9, 1, 2, 3])
    lookup = Lookup(ngram_sizes(3))
    assert lookup.propose(seq, 4) == [4, 5, 9, 1]
    seq.ids += [4, 7, 1, 2, 3]  # indexed as it grows: the latest occurrence wins
    assert lookup.propose(seq, 4) == [4, 7, 1, 2]
    assert lookup.propose(seq, 2) == [4, 7]  # never past what the caller allows
    seq.ids += [8]  # "2 3 8" and "3 8" never occurred before: no draft
    assert lookup.propose(seq, 10) == []
    seq.ids += [5]  # "8 5" neither, and a single token is no anchor
    assert lookup.propose(seq, 10) == []
    seq.ids += [9]  # "5 9" did: what followed it, up to the end of the text
    assert lookup.propose(seq, 4) == [1, 2, 3, 4]
    assert len(lookup.propose(seq, 20)) == 11  # what followed, up to the end of the text


def test_a_shorter_ngram_serves_when_the_longest_has_no_match() -> None:
    lookup = Lookup(ngram_sizes(4))
    assert lookup.sizes == (4, 3, 2)
    seq = Tokens([7, 8, 20, 21, 1, 2, 8, 20])  # "2 8 20" never occurred, "8 20" did
    assert lookup.propose(seq, 3) == [21, 1, 2]


def test_the_draft_length_is_what_the_acceptance_estimate_pays_for() -> None:
    lookup = Lookup(ngram_sizes(3))
    assert lookup.acceptance == pytest.approx(0.7)  # the prior
    assert lookup.length(0.25, 8) == 3  # 0.7 ** 3 = 0.34 >= 0.25 > 0.7 ** 4
    assert lookup.length(0.0, 5) == 5  # rows cost nothing: as far as allowed
    assert lookup.length(0.25, 2) == 2  # never past what the caller allows
    for _ in range(4):
        lookup.record(4, 4)  # every draft accepted
    assert lookup.acceptance > 0.9 and lookup.length(0.25, 16) >= 13
    for _ in range(12):
        lookup.record(3, 0)  # every first draft rejected
    assert lookup.acceptance < 0.25 and lookup.length(0.25, 16) == 0
    assert (lookup.proposed, lookup.accepted) == (52, 16)
    steps = 0
    while lookup.length(0.25, 16) == 0:  # not drafting, the estimate drifts to the prior
        steps += 1
    assert 2 < steps < 100 and lookup.acceptance <= 0.7


def test_a_row_is_judged_by_what_the_steps_measured() -> None:
    cost = StepCost(prior=0.3)
    assert cost.ratio() == 0.3  # nothing measured yet
    for _ in range(50):
        cost.observe(4, 0.0059)  # every step the same size: the slope is unknown
    assert cost.ratio() == 0.3
    for rows in [1, 2, 4, 8, 12] * 20:  # base 2.5 ms, 0.85 ms a row
        cost.observe(rows, 0.0025 + 0.00085 * rows)
    assert cost.ratio() == pytest.approx(0.34, rel=0.02)
    assert draft_threshold(cost.ratio(), 1) == pytest.approx(0.254, abs=0.005)
    assert draft_threshold(cost.ratio(), 16) == pytest.approx(0.845, abs=0.005)
    flat = StepCost(prior=0.3)
    for rows in [1, 8] * 20:  # rows that cost nothing (a GPU's memory-bound step)
        flat.observe(rows, 0.004)
    assert flat.ratio() == 0.0 and draft_threshold(flat.ratio(), 64) == 0.0
    assert draft_threshold(1.0, 3) == pytest.approx(0.75)  # a configured row cost


def test_a_verify_step_keeps_the_chosen_drafts_and_the_first_token_that_differs() -> None:
    assert accepted_prefix([4, 5, 6], [4, 5, 7, 1]) == [4, 5, 7]
    assert accepted_prefix([4, 5], [4, 5, 6]) == [4, 5, 6]  # all kept: one more after them
    assert accepted_prefix([4], [3, 9]) == [3]
    assert accepted_prefix([], [3]) == [3]


# -- the engine ---------------------------------------------------------------------------


def _engine(spec: int, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", "64MiB")
    kw.setdefault("speculative_row_cost", 0.0)  # drafts decided by matches alone, not timings
    config = EngineConfig(
        model="smollm2-135m", num_threads=2, speculative_tokens=spec, speculative_max_batch=8, **kw
    )
    return LLMEngine.from_config(config, progress=False)


@pytest.fixture(scope="module")
def plain() -> LLMEngine:
    return _engine(0)


@pytest.fixture(scope="module")
def spec() -> LLMEngine:
    return _engine(4)


def _prompts(engine: LLMEngine) -> list[str]:
    tok = engine.tokenizer
    asks = ["Repeat this text exactly:", "Fix any typos in this text:", "What is this text about?"]
    return [
        tok.apply_chat_template([{"role": "user", "content": f"{ask}\n\n{TEXT}"}]) for ask in asks
    ]


def _outputs(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> list:
    rids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    done = run_all(engine)  # the block audit after every step
    return [done[r] for r in rids]


def test_greedy_requests_get_the_same_tokens_and_logprobs_with_drafts(
    plain: LLMEngine, spec: LLMEngine
) -> None:
    prompts = _prompts(plain)
    params = [
        SamplingParams(max_tokens=80, stop=["blocks"]),  # a stop string inside a draft
        SamplingParams(max_tokens=37),  # a limit that falls inside a draft
        SamplingParams(max_tokens=80, logprobs=2),
    ]
    before = spec.snapshot().speculative
    want = _outputs(plain, prompts, params)
    got = _outputs(spec, prompts, params)
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        if w.final_logprobs is None:
            continue
        # Decode rows either way, but not summed in the same order: a verify step's draft rows
        # share their sequence's blocks, read once for all of them, and split differently over
        # the threads. The candidates' logits are exact (the 8-bit lm_head recomputes its best
        # in fp32), so the gaps between a token's candidates agree (7e-4 seen); the log-sum-exp
        # over the whole vocabulary takes the other logits from int8 activations, and a float
        # rounding in the hidden state can move a quantisation step there: a logprob's shift
        # common to all its candidates reaches 8e-3 at a few positions (median 1e-4).
        for a, b in zip(g.final_logprobs, w.final_logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1.5e-2
            # the runners-up by rank (verify rows run in a wider GEMM, whose AVX-512 rounding
            # can swap two candidates tied within 1e-3: same values)
            assert len(a.top) == len(b.top) and a.top[0][0] == b.top[0][0]
            for (_, la), (_, lb) in zip(a.top, b.top, strict=True):
                assert abs(la - lb) < 1.5e-2
                assert abs((la - a.top[0][1]) - (lb - b.top[0][1])) < 5e-3
    assert got[1].finish_reason == "length" and len(got[1].token_ids) == 37
    assert got[0].finish_reason == "stop" and got[0].text.endswith("fixed-size ")
    after = spec.snapshot().speculative
    drafted = after["drafted"] - before["drafted"]
    accepted = after["accepted"] - before["accepted"]
    assert accepted > 40 and drafted >= accepted, (drafted, accepted)
    steps = plain.snapshot().step
    assert spec.snapshot().step < steps  # fewer steps for the same tokens (both ran warm)
    snap = spec.snapshot()
    assert snap.blocks_free == snap.blocks_total


def test_a_seed_gives_the_same_tokens_with_drafts_on_or_off(
    plain: LLMEngine, spec: LLMEngine
) -> None:
    """A seeded request draws one number a token either way: the rows past a rejected draft
    give theirs back, so its tokens do not depend on whether, or how long, drafts ran."""
    prompts = _prompts(plain)
    params = [
        SamplingParams(max_tokens=60, temperature=0.7, seed=7 + i, top_p=0.95 if i else 1.0)
        for i in range(len(prompts))
    ]
    before = spec.snapshot().speculative
    want = _outputs(plain, prompts, params)
    got = _outputs(spec, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    after = spec.snapshot().speculative
    accepted = after["accepted"] - before["accepted"]
    rejected = after["drafted"] - before["drafted"] - accepted
    assert accepted > 10 and rejected > 0, (accepted, rejected)


def test_drafts_never_take_a_block_another_request_needs() -> None:
    """A pool so small that requests preempt each other: drafts shrink to the room their
    sequence's last block has rather than take a free block, every step's accounting holds,
    and every request gets the tokens it gets without drafts."""
    small = {"num_gpu_blocks": 24, "max_num_batched_tokens": 256, "kv_cache_bytes": "64MiB"}
    ref, eng = _engine(0, **small), _engine(8, **small)
    prompts = _prompts(ref) * 2
    params = [SamplingParams(max_tokens=60, ignore_eos=True)] * len(prompts)
    want = _outputs(ref, prompts, params)
    got = _outputs(eng, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert eng.snapshot().num_preemptions > 0 and eng.snapshot().speculative["accepted"] > 0


def test_no_drafts_for_a_grammar_or_past_the_batch_limit(spec: LLMEngine) -> None:
    prompt = _prompts(spec)[0]
    before = spec.snapshot().speculative["drafted"]
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    _outputs(spec, [prompt], [SamplingParams(max_tokens=40, json_schema=schema)])
    assert spec.snapshot().speculative["drafted"] == before
    many = [prompt] * 9  # more than speculative_max_batch (8) decode together
    _outputs(spec, many, [SamplingParams(max_tokens=6, ignore_eos=True)] * len(many))
    assert spec.snapshot().speculative["drafted"] == before


def test_no_draft_where_its_row_costs_more_than_it_may_bring(spec: LLMEngine) -> None:
    """A row cost so high that no estimate pays for a draft: none is tried and the tokens are
    the same. With the cost learnt, the engine measures its decode steps."""
    prompt = _prompts(spec)[0]
    params = SamplingParams(max_tokens=40)
    want = _outputs(spec, [prompt], [params])[0].token_ids
    assert apply(spec, spec.reconfigure({("speculative_row_cost",): 100.0})).ok
    try:
        before = spec.snapshot().speculative["drafted"]
        assert _outputs(spec, [prompt], [params])[0].token_ids == want
        assert spec.snapshot().speculative["drafted"] == before
        assert spec.snapshot().speculative["row_cost"] == 100.0  # what drafts are judged by
    finally:
        assert apply(spec, spec.reconfigure({("speculative_row_cost",): 0.0})).ok
    assert spec.scheduler.step_cost.weight > 8  # decode-only steps were timed


def test_a_reload_turns_drafts_on_and_off_live(plain: LLMEngine) -> None:
    prompt = _prompts(plain)[0]
    params = SamplingParams(max_tokens=40)
    want = _outputs(plain, [prompt], [params])[0].token_ids
    res = apply(plain, plain.reconfigure({("speculative_tokens",): 4}))  # at a step boundary
    assert res.ok, res.detail
    try:
        got = _outputs(plain, [prompt], [params])[0].token_ids
        assert got == want and plain.snapshot().speculative["accepted"] > 0
    finally:
        assert apply(plain, plain.reconfigure({("speculative_tokens",): 0})).ok
    drafted = plain.snapshot().speculative["drafted"]
    _outputs(plain, [prompt], [params])
    assert plain.snapshot().speculative["drafted"] == drafted


def test_drafts_after_the_token_that_finished_a_request_are_not_counted_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop inside a verify step's accepted drafts ends the request there: the drafts after
    it never became its tokens, so neither kvguard_spec_accepted_tokens_total nor the
    request's acceptance estimate counts them (both took every accepted draft: 58 for 56
    that became tokens in a run with a stop string)."""
    prompt = [3 + (i * 37) % 290 for i in range(24)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    answer = make_engine().generate([prompt], [params])[0].token_ids

    def propose(self: Lookup, seq: Sequence, most: int) -> list[int]:
        done = len(seq.output_token_ids)  # the answer's next tokens: every draft is accepted
        return answer[done : done + most]

    monkeypatch.setattr(Lookup, "propose", propose)
    # the prompt's step gives token 0, the first verify step drafts 1-4 and gives 1-5: stop
    # at a token of its drafts that has not come before, with drafts after it
    k = next(i for i in range(1, 4) if answer[i] not in answer[:i])
    engine = make_engine(speculative_tokens=4, speculative_row_cost=0.0)
    stop = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[answer[k]])
    rid = engine.add_request(prompt, stop)
    seq = engine._seqs[rid]
    out = run_all(engine)[rid]
    assert out.token_ids == answer[: k + 1] and out.finish_reason == "stop"
    spec = engine.snapshot().speculative
    assert (spec["drafted"], spec["accepted"]) == (4, k)  # drafts 1..k became tokens
    assert (seq.lookup.proposed, seq.lookup.accepted) == (4, k)


# -- an FP8 pool ----------------------------------------------------------------------------

SHARED = [3 + (i * 37) % 290 for i in range(40)]
FP8_PROMPTS = [[5] * 17, [7] * 16, [9] * 15, list(range(3, 36)), SHARED + [5] * 20,
               SHARED + [11, 12, 13] * 9]  # fmt: skip


def _tiny(**kw: object) -> LLMEngine:
    return make_engine(max_model_len=256, speculative_row_cost=0.0, **kw)


def test_an_fp8_pool_drafts_nothing_and_greedy_tokens_are_those_without_drafts() -> None:
    """An FP8 block's scale only grows, requantising its bytes: the K/V a verify step writes
    for drafts it then rejects would leave the sequence's last block coarser than plain decode
    leaves it, and greedy answers would depend on drafts (4 of these 6 parted within 120
    tokens). On an FP8 pool no step drafts."""
    params = [SamplingParams(max_tokens=120, ignore_eos=True)] * len(FP8_PROMPTS)
    want = _tiny(kv_cache_dtype="fp8_e4m3").generate(FP8_PROMPTS, params)
    engine = _tiny(kv_cache_dtype="fp8_e4m3", speculative_tokens=4)
    got = _outputs(engine, FP8_PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.snapshot().speculative["drafted"] == 0


def test_a_live_switch_to_fp8_stops_drafts_and_the_switch_back_resumes_them() -> None:
    engine = _tiny(speculative_tokens=4)
    rid = engine.add_request(FP8_PROMPTS[4], SamplingParams(max_tokens=200, ignore_eos=True))
    seq = engine._seqs[rid]

    def drafted() -> int:
        return engine.snapshot().speculative["drafted"]

    def decode_to(n: int) -> None:
        while len(seq.output_token_ids) < n:
            engine.step()
            engine.audit_blocks()

    decode_to(40)
    assert drafted() > 0  # the fp32 pool drafts
    assert apply(engine, engine.set_kv_cache_dtype("fp8_e4m3")).ok
    before = drafted()
    decode_to(120)
    assert drafted() == before  # 80 tokens on the FP8 pool, not one drafted
    assert apply(engine, engine.set_kv_cache_dtype("auto")).ok
    assert engine.kv_cache.dtype == "fp32"
    assert rid in run_all(engine)
    assert drafted() > before  # back in the compute dtype: drafts again


def test_sampled_tokens_follow_the_models_distribution() -> None:
    """Sampling with a draft keeps the draft with its probability and otherwise draws from the
    distribution without it, so each position's token is distributed as without drafts. Checked
    on fixed logits (the model's are not the point here): 4000 seeded draws of a step with two
    drafts against the exact probabilities."""
    p0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p1 = torch.tensor([0.1, 0.6, 0.2, 0.1])
    p2 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    logits = torch.stack([p0, p1, p2]).log()
    runner = ModelRunner.__new__(ModelRunner)  # only its sampling: a forward is replaced
    runner.logits = lambda seqs, num_tokens: logits  # noqa: ARG005
    counts = torch.zeros(4, 4)
    second = torch.zeros(4)
    n = 4000
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        seq = Sequence("r", [9, 9], SamplingParams(temperature=1.0, seed=1), 1, 0, 100)
        seq.output_token_ids, seq.num_computed_tokens = [7], 2
        seq.generator = gen
        seq.draft = [0, 1]  # drafts: token 0, then token 1
        [emitted] = runner.execute([seq], [3])
        counts[0, emitted[0]] += 1
        if emitted[0] == 0:  # the first draft kept: the second token is row 1's draw
            second[emitted[1]] += 1
            assert len(emitted) == 2 or emitted[1] == 1
    assert torch.allclose(counts[0] / n, p0, atol=0.03)
    assert torch.allclose(second / second.sum(), p1, atol=0.04)


def test_the_daemon_drafts_over_http_and_counts_them(tmp_path: Path, plain: LLMEngine) -> None:
    """`kvguard serve` with drafts on: a greedy chat answer, streamed and not, is the answer
    the engine gives without drafts, and /metrics counts the drafts and the kept ones."""
    d = Daemon(
        tmp_path,
        debug_hooks=False,
        serving="{model: smollm2-135m, kv_cache_bytes: 64MiB, max_model_len: 1024, "
        "speculative_tokens: 4, speculative_row_cost: 0}",
    )
    try:
        c = d.client()
        msgs = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]
        whole = c.chat.completions.create(
            model="smollm2-135m", messages=msgs, max_tokens=48, temperature=0
        )
        chunks = c.chat.completions.create(
            model="smollm2-135m", messages=msgs, max_tokens=48, temperature=0, stream=True
        )
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert streamed == whole.choices[0].message.content
        prompt = plain.tokenizer.apply_chat_template(msgs, True)
        want = _outputs(plain, [prompt], [SamplingParams(max_tokens=48)])[0].text
        assert whole.choices[0].message.content == want
        drafted = metric(d, "kvguard_spec_draft_tokens_total")
        accepted = metric(d, "kvguard_spec_accepted_tokens_total")
        assert drafted >= accepted > 20, (drafted, accepted)
        assert metric(d, "kvguard_spec_row_cost_ratio") == 0.0  # the configured one
    finally:
        assert d.stop() == 0


def test_penalised_requests_get_the_old_penalties_with_drafts_and_preemption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Penalised requests sharing one params object (as a request's choices do) on a pool so
    small that they preempt each other, with drafts accepted several at a time: every step's
    adjusted logits are, bit for bit, what the old counting gave (a tensor of the whole output,
    with the row's drafts, and its `unique`, every step), and so are the tokens. The engine
    keeps running counts on each sequence instead."""
    from kvguard.engine import sampler
    from tests.test_sampling_controls import _penalised_the_old_way

    small = {"num_gpu_blocks": 24, "max_num_batched_tokens": 256, "kv_cache_bytes": "64MiB"}
    params = SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=0.3,
                            presence_penalty=0.1)  # fmt: skip
    real = sampler.adjust_logits

    def the_old_way(
        logits: torch.Tensor, ps: list, outputs: list, allowed: list | None = None
    ) -> torch.Tensor:
        assert allowed is None or not any(a is not None for a in allowed)
        lists = []
        for o in outputs:  # what the runner gave it before: the output, plus the drafts
            if isinstance(o, sampler.Ahead):
                lists.append(list(o.counts.tokens) + o.drafts)
            else:
                lists.append(list(o.tokens))
        return _penalised_the_old_way(logits, ps, lists)

    def run(adjust: object) -> tuple[LLMEngine, list[list[int]], list[bytes]]:
        eng = _engine(8, **small)
        seen: list[bytes] = []

        def recorded(*a: object, **k: object) -> torch.Tensor:
            out = adjust(*a, **k)  # type: ignore[operator]
            seen.append(out.numpy().tobytes())
            return out

        monkeypatch.setattr(sampler, "adjust_logits", recorded)
        prompts = _prompts(eng) * 2
        outs = _outputs(eng, prompts, [params] * len(prompts))
        return eng, [o.token_ids for o in outs], seen

    _, want_tokens, want = run(the_old_way)
    eng, tokens, got = run(real)
    assert tokens == want_tokens
    assert len(got) == len(want) and all(g == w for g, w in zip(got, want, strict=True))
    snap = eng.snapshot()
    assert snap.num_preemptions > 0 and snap.speculative["accepted"] > 0
