"""The logits of a padded embedding's rows past the tokenizer are -inf.

A model's embedding may have more rows than its tokenizer has tokens (Qwen2: 151936 rows for
151665 tokens; the tiny model: 320 for 259, its padding rows zero). The rows past the
tokenizer name no token: no text can be written for one. The sampler could draw them: with
every real token banned by `logit_bias: -100`, the tiny model answered 4 tokens of empty text
(ids 259, logit 0 against the banned tokens' -100). The head computes every row (the whole
matrix's width is the fast one for the GEMM) and the columns from `runner.vocab` on (the
tokenizer's) are set to -inf where the logits are produced, so no path can draw them and a
log-softmax's normaliser holds none; prompt ids in the padding range are still read (the
embedding keeps every row).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import torch

from kvguard.engine.config import EngineConfig
from kvguard.engine.distributed.parallel_state import TPGroup
from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.layers.quantized_linear import QuantizedLinear, QuantizedLMHead, RowTable
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.model_runner import token_vocab
from kvguard.engine.sampling_params import SamplingParams
from kvguard.kernels import cpu_lowbit
from tests.test_server import Daemon

TOKENS, ROWS = 259, 320  # the tiny model's tokenizer and embedding
PROMPT = "The quick brown fox"
BAN = {t: -100.0 for t in range(TOKENS)}  # every token of the tokenizer, uniformly
# each way the sampler draws: the argmax, the batched inverse CDF, a seeded draw, the C top-p
# draw, the torch top-k path, penalties (adjust_logits), and a grammar's mask
PATHS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},
    "seeded": {"temperature": 1.0, "seed": 7},
    "top_p": {"temperature": 1.0, "top_p": 0.9, "seed": 7},
    "top_k": {"temperature": 0.8, "top_k": 5, "seed": 7},
    "penalties": {"temperature": 1.0, "seed": 7, "frequency_penalty": 1.0},
    "json": {"temperature": 0.0, "json_schema": {"type": "object"}},
}
# the paths whose tokens do not depend on the global generator: the same with a uniform ban
REPEATABLE = ("greedy", "seeded", "top_p", "top_k", "penalties", "json")


def tiny_engine(**knobs: object) -> LLMEngine:
    config = EngineConfig(model="tiny", kv_cache_bytes="8MiB", max_model_len=256, **knobs)
    return LLMEngine.from_config(config, progress=False)


@pytest.fixture(scope="module")
def tiny() -> Iterator[LLMEngine]:
    eng = tiny_engine()
    yield eng
    eng.shutdown()


def hf_logits(tiny_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' logits `[len, 320]` of the tiny model at every position of `ids`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_the_logits_are_the_tokenizers_columns(tiny: LLMEngine, tiny_dir: Path) -> None:
    """`score` gives the tokens' columns `[n, 259]`, contiguous, transformers' first 259; the
    embedding keeps its 320 rows (a prompt's padding ids are read as before)."""
    assert token_vocab(tiny_dir, tiny.model_config) == TOKENS == tiny.tokenizer.vocab_size
    assert (tiny.runner.vocab, tiny.model_config.vocab_size) == (TOKENS, ROWS)
    assert tiny.model.embed_tokens.weight.shape[0] == ROWS
    ids = tiny.tokenizer.encode(PROMPT) + [300, 5]
    got = tiny.score(ids)
    assert got.shape == (len(ids), TOKENS) and got.is_contiguous()
    torch.testing.assert_close(got, hf_logits(tiny_dir, ids)[:, :TOKENS], atol=1e-4, rtol=0)


def test_the_head_computes_every_row_and_the_padding_is_minus_inf(tiny: LLMEngine) -> None:
    """`compute_logits` (what a step samples from, on every path: eager, CUDA graphs, the
    ranks): `[n, 320]`, contiguous, every row's product with the hidden state but the padding
    rows', which are -inf."""
    hidden = torch.randn(
        3, tiny.model_config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    got = tiny.model.compute_logits(hidden)
    assert got.shape == (3, ROWS) and got.is_contiguous()
    assert bool((got[:, TOKENS:] == float("-inf")).all())
    want = hidden @ tiny.model.lm_head.weight[:TOKENS].T
    torch.testing.assert_close(got[:, :TOKENS], want, atol=1e-4, rtol=1e-4)


def test_no_sampling_path_draws_a_padding_row(tiny: LLMEngine) -> None:
    """With every token banned, each path draws among the tokens (it drew the padding rows,
    whose logit 0 beat the bans' -100). A uniform ban moves no choice: the greedy and seeded
    paths give the tokens they give unbanned, and every path tokens with text."""
    for name, fields in PATHS.items():
        banned, free = (
            tiny.generate(
                [PROMPT], [SamplingParams(max_tokens=6, ignore_eos=True, **fields, **bias)]
            )[0]
            for bias in ({"logit_bias": BAN}, {})
        )
        assert max(banned.token_ids) < TOKENS, (name, banned.token_ids)
        assert all(tiny.tokenizer.decode([t]) for t in banned.token_ids), name
        if name in REPEATABLE:
            assert banned.token_ids == free.token_ids, name


def test_a_tensor_parallel_head_draws_no_padding_row(tiny: LLMEngine) -> None:
    """tp=2 (gloo): the vocabulary split over two ranks, rank 0 keeps the tokens' columns of
    the gathered logits, as one rank computes them."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0, logit_bias=BAN)
    ids = tiny.tokenizer.encode(PROMPT)
    eng = tiny_engine(tensor_parallel=2, tensor_parallel_timeout_s=60.0)
    try:
        got = eng.generate([PROMPT], params)[0].token_ids
        assert got == tiny.generate([PROMPT], params)[0].token_ids and max(got) < TOKENS
        assert eng.score(ids).shape == (len(ids), TOKENS)
        torch.testing.assert_close(eng.score(ids), tiny.score(ids), atol=1e-4, rtol=0)
    finally:
        eng.shutdown()


def test_a_pipelines_last_stage_draws_no_padding_row(tiny: LLMEngine) -> None:
    """pp=2: the last stage sends rank 0 rows of the config's 320 columns (what the driver
    receives), the padding's at -inf from its `compute_logits`; rank 0 samples among the
    tokens and scores their 259."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0, logit_bias=BAN)
    ids = tiny.tokenizer.encode(PROMPT)
    eng = tiny_engine(pipeline_parallel=2, tensor_parallel_timeout_s=60.0)
    try:
        got = eng.generate([PROMPT], params)[0].token_ids
        assert got == tiny.generate([PROMPT], params)[0].token_ids and max(got) < TOKENS
        torch.testing.assert_close(eng.score(ids), tiny.score(ids), atol=1e-4, rtol=0)
    finally:
        eng.shutdown()


def test_log_probabilities_are_the_log_softmax_over_the_tokens(
    tiny: LLMEngine, tiny_dir: Path
) -> None:
    """A token's log-probability (and its prompt's) is the log-softmax of the raw logits over
    the tokenizer's tokens (README): transformers' first 259 columns, normalised over them;
    the alternatives listed are tokens."""
    prompt = tiny.tokenizer.encode(PROMPT)
    params = SamplingParams(
        max_tokens=5, ignore_eos=True, temperature=0, logprobs=4, prompt_logprobs=2
    )
    out = tiny.generate([prompt], params)[0]
    ref = torch.log_softmax(hf_logits(tiny_dir, prompt + out.token_ids)[:, :TOKENS], dim=-1)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.final_logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(4).indices.tolist()
    for i, lp in enumerate(out.final_prompt_logprobs):
        assert lp.token_id == prompt[i + 1]
        assert lp.logprob == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-4)
        assert all(t < TOKENS for t, _ in lp.top)


def test_a_prompts_padding_id_is_read_but_has_no_log_probability(tiny: LLMEngine) -> None:
    """Prompt ids in the padding range are served as ever (the embedding has their rows);
    their log-probabilities cannot be given (the head computes no logit for them), so a
    request asking for its prompt's is refused, naming the ids and what to do."""
    prompt = [5, 300, 6, 319, 7]
    out = tiny.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and max(out.token_ids) < TOKENS
    with pytest.raises(
        ValueError,
        match=r"^prompt_logprobs: prompt token ids \[300, 319\] name no token \(the ids from "
        r"259 to 319 are the model's padding rows",
    ):
        tiny.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert not tiny.has_unfinished()
    first = tiny.generate([[300, 5, 6]], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert [lp.token_id for lp in first.final_prompt_logprobs] == [5, 6]  # the first has none


def padding_draft_prompt(engine: LLMEngine, params: SamplingParams) -> list[int]:
    """A prompt after whose last token and first generated token the prompt held the same
    pair before, followed by padding ids: prompt lookup drafts them at the first decode step.
    Built by adding each first token found until one comes again (deterministic: greedy)."""
    seen: list[int] = []
    for _ in range(16):
        prompt = [10] + [x for t in seen for x in (11, t, 300, 301, 302, 12)] + [11]
        first = engine.generate([prompt], [replace(params, max_tokens=1)])[0].token_ids[0]
        if first in seen:
            return prompt
        seen.append(first)
    raise AssertionError(f"no prompt found: first tokens {seen}")


def test_a_draft_of_padding_ids_under_penalties_is_rejected(tiny: LLMEngine) -> None:
    """Prompt lookup drafts a prompt's padding ids (they follow an earlier occurrence of the
    last tokens); a penalised row counts the drafts before it, a padding id's column too,
    which stays -inf, and the draft is rejected like any other that no row chose. The tokens
    are those of the same request without drafts."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0, frequency_penalty=1.0)
    prompt = padding_draft_prompt(tiny, params)
    drafted = tiny_engine(speculative_tokens=4, speculative_ngram=2, speculative_row_cost=0.0)
    try:
        got = drafted.generate([prompt], params)[0].token_ids
        assert drafted.snapshot().speculative["drafted"] > 0
    finally:
        drafted.shutdown()
    assert got == tiny.generate([prompt], params)[0].token_ids and max(got) < TOKENS


def _spec(rows: int, cols: int, bits: int, group: int, seed: int) -> QuantSpec:
    gen = torch.Generator().manual_seed(seed)
    top = 2**bits
    return QuantSpec(
        q=torch.randint(0, top, (rows, cols), generator=gen, dtype=torch.uint8),
        scales=torch.rand(rows, cols // group, generator=gen) * 0.05 + 0.01,
        zeros=torch.rand(rows, cols // group, generator=gen) + top / 2 - 0.5,
        group_size=group,
        bits=bits,
    )


def _cpu_kernels() -> list[tuple[int, int, str]]:
    """(bits, group, kernel) of every CPU kernel this machine serves."""
    out = [(4, 32, "int4pack"), (8, 32, "int4x2"), (8, 128, "int8pack"), (4, 32, "dense")]
    if cpu_lowbit.available():
        out += [(4, 32, "w4a8"), (8, 32, "w8a8"), (8, 32, "w8a8v")]
    return out


@pytest.mark.parametrize(("bits", "group", "kernel"), _cpu_kernels())
def test_a_quantized_heads_padding_is_minus_inf(bits: int, group: int, kernel: str) -> None:
    """A packed head over 80 rows of which 61 are tokens, from each kernel: `[n, 80]`,
    contiguous, the kernel's own outputs but the padding's, which are -inf."""
    layer = QuantizedLinear(_spec(80, 128, bits, group, 1), approximate=kernel == "w8a8v",
                            kernel=kernel)  # fmt: skip
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    got = QuantizedLMHead(layer, 80, tokens=61)(x)
    assert got.shape == (3, 80) and got.is_contiguous(), kernel
    assert bool((got[:, 61:] == float("-inf")).all()), kernel
    torch.testing.assert_close(got[:, :61], layer(x)[:, :61], atol=1e-5, rtol=1e-5)


def refined_head(spec: QuantSpec, tokens: int) -> QuantizedLMHead:
    """A tied 8-bit head (int8 logits, its best recomputed exactly) of `tokens` tokens."""
    table = RowTable(spec, torch.float32, torch.device("cpu"))
    linear = QuantizedLinear(spec, approximate=True)
    return QuantizedLMHead(linear, spec.q.shape[0], exact=table, tokens=tokens)


def test_a_refined_quantized_heads_padding_is_minus_inf() -> None:
    """A tied 8-bit head over 61 tokens of 80 rows: `[n, 80]` logits whose padding is -inf
    and whose best is the exact best among the tokens, and exact logits the unpadded head's
    first 61 columns, the padding's -inf."""
    spec = _spec(80, 128, 8, 32, 3)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    padded, whole = refined_head(spec, 61), refined_head(spec, 80)
    logits, exact, got = padded(x), whole.exact_logits(x), padded.exact_logits(x)
    assert logits.shape == got.shape == (4, 80) and logits.is_contiguous()
    assert bool((logits[:, 61:] == float("-inf")).all() and (got[:, 61:] == float("-inf")).all())
    torch.testing.assert_close(got[:, :61], exact[:, :61], atol=1e-5, rtol=0)
    assert logits.argmax(-1).tolist() == exact[:, :61].argmax(-1).tolist()


def test_a_refine_among_few_tokens_leaves_the_padding_minus_inf() -> None:
    """A row whose grammar allows fewer tokens than the head refines (16) ties the rest of
    its candidates at -inf, and a top-k may take padding columns among them
    (`QuantizedLMHead.best` of the masked row): the refine recomputes them, and they are -inf
    again after it (else a log-probability's normaliser would hold them), the allowed tokens
    exact."""
    spec = _spec(80, 128, 8, 32, 7)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(8))
    head = refined_head(spec, 61)
    logits = head(x)
    top = torch.tensor([[0, 1, 2, *range(61, 74)]] * 2)  # three tokens allowed, then padding
    got = head.refine_at(x, logits, top)
    assert bool((got[:, 61:] == float("-inf")).all())
    torch.testing.assert_close(got[:, :3], head.exact_logits(x)[:, :3], atol=1e-5, rtol=0)


def test_a_request_banning_every_token_gets_the_models_tokens(tiny_daemon: Daemon) -> None:
    """The hunter's request over HTTP, through the openai client: -100 on every token id of
    the tiny tokenizer, greedy and seeded. It got 4 tokens of empty text (the padding rows);
    a uniform ban moves no choice, so the answer is the unbanned one, its tokens with text
    and the same log-probabilities (the model's, before any bias)."""
    client = tiny_daemon.client()
    ban = {str(t): -100 for t in range(TOKENS)}
    for fields in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        banned, free = (
            client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=4, logprobs=1,
                extra_body={"ignore_eos": True}, **fields, **bias,
            ).choices[0]
            for bias in ({"logit_bias": ban}, {})
        )  # fmt: skip
        assert banned.logprobs is not None and free.logprobs is not None
        assert all(banned.logprobs.tokens), banned.logprobs.tokens
        assert banned.text == free.text and banned.logprobs.tokens == free.logprobs.tokens
        # (the second request's prompt comes from the prefix cache: the last bits may differ)
        assert banned.logprobs.token_logprobs == pytest.approx(
            free.logprobs.token_logprobs, abs=1e-5
        )
    # a prompt's padding id is read; its log-probability, which the head does not compute, is
    # refused by name
    answer = client.completions.create(model="tiny", prompt=[5, 300, 6], max_tokens=2)
    assert answer.usage is not None and answer.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError, match=r"prompt token ids \[300\] name no token"):
        client.completions.create(
            model="tiny", prompt=[5, 300, 6], max_tokens=1, echo=True, logprobs=1
        )


class _OwnRowsGroup(TPGroup):
    """Rank 1 of 2 whose gather hands back its own share: what the head gives the collective
    (the gather itself is torch.distributed's, run for real by the tp=2 tests above)."""

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        return x


def test_a_split_refined_heads_padding_takes_no_refined_slot() -> None:
    """tp=2 over 80 rows, 61 tokens: rank 1 holds rows 40-79, of which 21 are tokens. Its
    share goes to the gather with its padding rows at -inf, so that none of them is among
    the best its refine recomputes."""
    spec = _spec(40, 128, 8, 32, 5)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(6))
    table = RowTable(spec, torch.float32, torch.device("cpu"))
    linear = QuantizedLinear(spec, approximate=True)
    head = QuantizedLMHead(linear, 80, _OwnRowsGroup(rank=1, size=2), exact=table, tokens=61)
    share = head(x)
    assert share.shape == (2, 40)
    assert bool((share[:, 21:] == float("-inf")).all()) and bool(share[:, :21].isfinite().all())
    assert head.best(share).max().item() < 21
