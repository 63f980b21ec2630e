"""Returned log-probabilities on the packed default model come from exact logits.

The packed lm_head ranks the vocabulary with int8 activations and recomputes only each row's
best logits exactly; a log-softmax over those logits carries the other ~49k logits' error in
its normaliser (up to 0.036 in a log-probability). Here every log-probability a request gets
back (its tokens' with their alternatives, its prompt's with `prompt_logprobs`) is checked
against the fp64 log-softmax of the model's own final hidden states (captured at the lm_head)
times the weights it holds, and the tokens against the same request without
log-probabilities: the exact logits give the values returned, never the draws."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.layers.quantized_linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedLMHead,
)
from kvguard.engine.sequence import TokenLogprob
from kvguard.kernels import cpu_lowbit
from tests.test_quantized import random_spec

README = Path(__file__).resolve().parents[1] / "README.md"
# fp32 dots of 576 terms and an fp32 log-softmax against fp64: 2e-5 measured here; the int8
# head's normaliser was off by 4e-4 at the median position, 0.036 at worst
TOL = 3e-4


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The default model packed as served; no prefix cache, so every run computes its prompt
    (a cached block is another computation's, which the comparisons below must not mix in)."""
    cfg = EngineConfig(
        model="smollm2-135m",
        kv_cache_bytes="64MiB",
        num_threads=2,
        enable_prefix_caching=False,
    )
    eng = LLMEngine.from_config(cfg, progress=False)
    head = eng.model.lm_head
    assert isinstance(head, QuantizedLMHead) and head.exact is not None  # refined: int8 ranked
    return eng


@pytest.fixture(scope="module")
def weights(engine: LLMEngine) -> torch.Tensor:
    """The tied vocabulary matrix as the model holds it (the embedding's exact rows), fp64."""
    ids = torch.arange(engine.model_config.vocab_size)
    return engine.model.embed_tokens(ids).double()


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[Any, torch.Tensor]:
    """The request's output, and the hidden states the lm_head was given for it, in order
    (one request alone: its rows are each step's rows)."""
    seen: list[torch.Tensor] = []
    hook = engine.model.lm_head.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].detach().double().clone())
    )
    try:
        out = engine.generate([prompt], params)[0]
    finally:
        hook.remove()
    return out, torch.cat(seen)


def _worst(entries: list[TokenLogprob], reference: torch.Tensor, k: int) -> float:
    """The largest distance of an entry's log-probabilities (its token's and its top's) from
    the reference row's, or of its top's least from the reference's `k`-th likeliest below
    it (a top that missed a likelier token)."""
    worst = 0.0
    assert len(entries) == len(reference)
    for e, ref in zip(entries, reference, strict=True):
        assert len(e.top) == k
        got = [(e.token_id, e.logprob), *e.top]
        kth = ref.topk(k).values[-1].item()
        worst = max(
            worst, kth - min(v for _, v in e.top), *(abs(v - ref[t].item()) for t, v in got)
        )
    return worst


def _log_softmax(hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(hidden @ weights.T, dim=-1)


def test_greedy_logprobs_on_a_long_text_are_the_exact_heads(
    engine: LLMEngine, weights: torch.Tensor
) -> None:
    """The README's first 1000 tokens, 32 greedy tokens with 5 alternatives: at its 19th
    token the int8 head's normaliser was off by 0.036. The tokens are the ones the request
    gets without log-probabilities."""
    prompt = engine.tokenizer.encode(README.read_text())[:1000]
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=5)
    out, hidden = _run(engine, prompt, params)
    assert len(hidden) == 32  # the prompt's last row, then one a decode step
    worst = _worst(out.final_logprobs, _log_softmax(hidden, weights), 5)
    print(f"\ngreedy, 1000-token text: max |logprob - exact| {worst:.2e}")
    assert worst < TOL
    assert all(e.top[0][0] == e.token_id for e in out.final_logprobs)
    plain = engine.generate([prompt], dataclasses.replace(params, logprobs=None))[0]
    assert plain.token_ids == out.token_ids and plain.final_logprobs is None


def test_seeded_sampled_logprobs_are_the_exact_heads_and_draws_unchanged(
    engine: LLMEngine, weights: torch.Tensor
) -> None:
    """Temperature 1 with a seed: the draws come from the head's logits, asked for
    log-probabilities or not, so the same seed gives the same tokens both ways; the values
    returned are the exact log-softmax (of the raw logits: no temperature)."""
    tok = engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}])
    for prompt in (tok.encode(chat), tok.encode("The quick brown fox")):
        params = SamplingParams(
            max_tokens=24, temperature=1.0, seed=11, ignore_eos=True, logprobs=5
        )
        out, hidden = _run(engine, prompt, params)
        worst = _worst(out.final_logprobs, _log_softmax(hidden, weights), 5)
        print(f"\nseeded, {len(prompt)}-token prompt: max |logprob - exact| {worst:.2e}")
        assert worst < TOL
        plain = engine.generate([prompt], dataclasses.replace(params, logprobs=None))[0]
        assert plain.token_ids == out.token_ids and len(out.token_ids) == 24


def test_prompt_logprobs_and_scores_are_the_exact_heads(
    engine: LLMEngine, weights: torch.Tensor
) -> None:
    """What an evaluation harness asks to score a text (its prompt's log-probabilities, one
    token generated): every prompt position exact, and `score` gives the same logits."""
    prompt = engine.tokenizer.encode(README.read_text())[:160]
    params = SamplingParams(max_tokens=1, prompt_logprobs=5, logprobs=5)
    out, hidden = _run(engine, prompt, params)
    assert len(hidden) == len(prompt)  # every prompt row: row i predicts token i + 1
    ref = _log_softmax(hidden, weights)
    plps = out.final_prompt_logprobs
    assert [e.token_id for e in plps] == prompt[1:]
    worst = _worst(plps, ref[:-1], 5)
    worst = max(worst, _worst(out.final_logprobs, ref[-1:], 5))
    print(f"\nprompt log-probabilities, {len(prompt)} tokens: max |logprob - exact| {worst:.2e}")
    assert worst < TOL
    scored = torch.log_softmax(engine.score(prompt).double(), dim=-1)
    assert (scored - ref).abs().max().item() < TOL


@pytest.mark.parametrize(
    ("bits", "kernel"),
    [(8, "w8a8v"), (8, "w8a8"), (8, "int8pack"), (4, "w4a8"), (4, "int4pack")],
)
def test_every_refined_head_layout_gives_exact_logits(bits: int, kernel: str) -> None:
    """A tied head of each kernel that refines its rows (int8 activations, a requantised
    per-row int8 copy, bf16 activations) gives every logit as the fp64 product with the
    weight it holds (to fp32 summation's bound), over a vocabulary that ends inside a tile;
    each row's bits the same alone (its vocabulary split over the threads) as beside others
    (a token's log-probabilities do not depend on the step's other rows)."""
    if kernel in ("w8a8v", "w8a8", "w4a8"):
        assert cpu_lowbit.available(), "the C low-bit kernels did not build (gcc: see .ci/run)"
    vocab = 2053
    spec = random_spec(vocab, 256, 64 if bits == 8 else 32, bits, seed=5)
    spec.scales = spec.scales.half().float()  # as the kernels and the table hold them
    spec.zeros = torch.full_like(spec.zeros, 128.0 if bits == 8 else 8.0)  # no rounded mins
    emb = QuantizedEmbedding(spec, torch.float32)
    head = QuantizedLMHead(
        QuantizedLinear(spec, approximate=True, kernel=kernel), vocab, exact=emb.table
    )
    assert head.approximate and head.linear.kernel == kernel
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    want = x.double() @ spec.dequantize().double().T
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = head.exact_logits(x)
        alone = [head.exact_logits(x[r : r + 1]) for r in range(len(x))]
    finally:
        torch.set_num_threads(threads)
    assert got.shape == (len(x), vocab) and got.dtype == torch.float32
    assert all(torch.equal(a[0], g) for a, g in zip(alone, got, strict=True))
    scale = x.double().abs() @ spec.dequantize().double().abs().T
    assert ((got.double() - want).abs() / scale).max().item() < 256 * 2**-24
    # the forward's logits are not all exact: what this path is for
    rough = (head(x).double() - want).abs().max().item()
    assert rough > 10 * (got.double() - want).abs().max().item()


def test_the_torch_fallbacks_exact_head_dequantises_its_rows_once() -> None:
    """Without the C kernels (no compiler: the torch fallback) the exact rows were dequantised
    again at every call, the whole vocabulary for each decode step of a request with logprobs
    (0.4 s a step on the default model); on the CPU they are kept from the first call, the
    logits unchanged."""
    vocab = 300
    spec = random_spec(vocab, 128, 64, 8, seed=7)
    spec.scales = spec.scales.half().float()  # as the table holds them
    spec.zeros = torch.full_like(spec.zeros, 128.0)
    emb = QuantizedEmbedding(spec, torch.float32)
    head = QuantizedLMHead(
        QuantizedLinear(spec, approximate=True, kernel="int8pack"), vocab, exact=emb.table
    )
    calls: list[int] = []
    head.exact.register_forward_hook(lambda _m, args, _out: calls.append(len(args[0])))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    first = head.exact_logits(x)
    assert sum(calls) == vocab
    again = head.exact_logits(x)
    assert sum(calls) == vocab, "the rows were dequantised again"
    assert torch.equal(first, again)
    assert torch.allclose(first.double(), x.double() @ spec.dequantize().double().T, atol=1e-4)
