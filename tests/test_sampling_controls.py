"""Presence and frequency penalties and logit bias: the arithmetic on the logits, their effect
on what the real model draws, and the OpenAI API fields through the real `openai` client."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.random_model import byte_tokenizer
from kvguard.engine.sampler import adjust_logits
from tests.test_engine import make_engine
from tests.test_server import Daemon


def test_penalties_and_bias_are_openais_arithmetic() -> None:
    logits = torch.zeros(3, 10)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={3: 1.5}),
        SamplingParams(),  # asks nothing: its row is left alone
        SamplingParams(presence_penalty=-1.0),  # a negative penalty favours what was said
    ]
    got = adjust_logits(logits, params, [[5, 5, 7], [5], [2, 2]])
    want = torch.zeros(3, 10)
    want[0, 5], want[0, 7], want[0, 3] = -1.25, -0.75, 1.5
    want[2, 2] = 1.0
    assert torch.equal(got, want)
    assert torch.equal(logits, torch.zeros(3, 10))  # the caller's logits (logprobs') unchanged
    assert adjust_logits(logits, [SamplingParams()] * 3, None) is logits


def test_logit_bias_steers_greedy_and_sampled_draws(smollm_engine: LLMEngine) -> None:
    eng = smollm_engine
    prompt = "The capital of France is"
    plain = eng.generate([prompt], [SamplingParams(max_tokens=4, ignore_eos=True)])[0]
    forced = eng.tokenizer.encode(" banana")[0]
    steer = [
        SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={forced: 100.0}),
        SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={forced: 100.0},
                       temperature=1.0, seed=3),
        SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={plain.token_ids[0]: -100.0}),
    ]  # fmt: skip
    outs = eng.generate([prompt] * 3, steer)
    assert outs[0].token_ids == [forced] * 4 and outs[1].token_ids == [forced] * 4
    assert outs[2].token_ids[0] != plain.token_ids[0]
    with pytest.raises(ValueError, match=r"logit_bias token ids \[49152\]"):
        eng.add_request(prompt, SamplingParams(logit_bias={49152: 1.0}))


def test_a_bias_on_a_padding_row_of_the_model_is_refused() -> None:
    """The tiny model has 320 embedding rows and its tokenizer 259 tokens: a bias on an id
    between them was taken, and +100 made the engine generate ids that have no text."""
    engine = make_engine()
    tokens, rows = engine.tokenizer.vocab_size, engine.model_config.vocab_size
    assert tokens < rows
    with pytest.raises(
        ValueError,
        match=rf"^logit_bias token ids \[{tokens}, {rows - 1}\] name no token: the tokenizer "
        rf"has {tokens} \(ids \[0, {tokens}\)\), the ids from {tokens} to {rows - 1} are",
    ):
        engine.add_request("hi", SamplingParams(logit_bias={rows - 1: 100.0, tokens: 5.0}))
    assert not engine.has_unfinished()
    last = engine.generate(["hi"], SamplingParams(max_tokens=2, logit_bias={tokens - 1: 100.0}))
    assert last[0].token_ids == [tokens - 1] * 2


def test_a_bias_or_a_ban_picks_by_the_models_exact_logits(smollm_engine: LLMEngine) -> None:
    """The packed lm_head makes exact only each row's 16 best by its own int8 ranking; a bias
    lifting tokens ranked below them, or a ban of the best, had left a greedy pick to the int8
    logits (14 of 99 near-tied pairs biased +100 took the token the model ranks lower). Now
    the candidates after the bias are recomputed too: the pick is the exact argmax of the
    biased logits, as `model_quantization: none` gives it."""
    eng = smollm_engine
    prompts = ["The capital of France is", "hi", "Give me a number", "What is 2+2?", "Once"]
    wrong = []
    checked = 0
    for text in prompts:
        ids = eng.tokenizer.encode(text)
        exact = eng.score(ids)[-1]
        order = exact.argsort(descending=True).tolist()
        # near-tied pairs below the 16 best, both lifted by +100: the higher one must win
        pairs = [(a, b) for a, b in zip(order[16:60], order[17:61], strict=True)
                 if exact[a] - exact[b] < 0.05][:12]  # fmt: skip
        # the best 16 (and 17, 18) banned: the next one must win
        bans = [order[:n] for n in (16, 17, 18)]
        params = [SamplingParams(max_tokens=1, logit_bias={a: 100.0, b: 100.0}) for a, b in pairs]
        params += [
            SamplingParams(max_tokens=1, logit_bias=dict.fromkeys(ban, -100.0)) for ban in bans
        ]
        want = [a for a, _ in pairs] + [order[len(ban)] for ban in bans]
        outs = eng.generate([ids] * len(params), params)
        for out, w, p in zip(outs, want, params, strict=True):
            checked += 1
            if out.token_ids[0] != w:
                wrong.append((text, w, out.token_ids[0], sorted(p.logit_bias)[:3]))
    assert checked > 40
    assert not wrong, wrong


def test_frequency_penalty_breaks_a_repetition_and_ignores_the_prompt(
    smollm_engine: LLMEngine,
) -> None:
    eng = smollm_engine
    prompt = "1, 1, 1, 1, 1, 1,"
    outs = eng.generate(
        [prompt] * 3,
        [
            SamplingParams(max_tokens=20, ignore_eos=True),
            SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=2.0),
            SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=2.0),
        ],
    )
    repeats = [max(Counter(o.token_ids).values()) for o in outs]
    assert repeats[1] < repeats[0], repeats  # a flat 2 (presence) does not outweigh " 1,"
    # the prompt's own tokens are not penalised: nothing is output yet at the first draw
    assert outs[1].token_ids[0] == outs[2].token_ids[0] == outs[0].token_ids[0]


def test_sampling_controls_are_validated() -> None:
    for bad in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"frequency_penalty": True},
        {"logit_bias": {1: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {"1": 1.0}},
        {"temperature": float("inf")},  # logits / inf: masked tokens' -inf / inf is NaN
        {"seed": 2**64},  # torch's generator takes 64 bits
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_stop_token_ids_and_the_stop_flags_are_validated() -> None:
    """stop_token_ids is read on every output token: a wrong type (5, None, ["a"]) used to
    pass and end the request inside its step with a TypeError, a negative id never to match.
    An id past the vocabulary is refused by add_request, as logit_bias's are; ignore_eos and
    include_stop_str_in_output are bools."""
    for bad in (5, None, "7", ["a"], [-1], [True], [1.0]):
        with pytest.raises(
            ValueError, match=r"^stop_token_ids=.*: expected a list of token ids \(integers >= 0"
        ):
            SamplingParams(stop_token_ids=bad)
    for name in ("ignore_eos", "include_stop_str_in_output"):
        with pytest.raises(ValueError, match=f"^{name}=1: expected a bool"):
            SamplingParams(**{name: 1})
    engine = make_engine()
    vocab = engine.model_config.vocab_size
    with pytest.raises(
        ValueError, match=rf"^stop_token_ids token ids \[{vocab}\] are outside the vocabulary"
    ):
        engine.add_request("hi", SamplingParams(stop_token_ids=[1, vocab]))
    changed = SamplingParams(max_tokens=3)
    changed.stop_token_ids = None  # set after it was built: add_request validates again
    with pytest.raises(ValueError, match="^stop_token_ids=None"):
        engine.add_request("hi", changed)
    assert not engine.has_unfinished()
    free = engine.generate(["hi"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    tok = free.token_ids[2]
    cut = engine.generate(["hi"], SamplingParams(max_tokens=6, stop_token_ids=(tok,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]
    # what a library caller hands over as it is: a set of ids (the engine's eos_ids), numpy
    # ids and numpy floats, all taken as before the checks (the ids as a plain list)
    import numpy as np

    for ids in ({tok}, [np.int64(tok)]):
        params = SamplingParams(max_tokens=6, stop_token_ids=ids)
        assert params.stop_token_ids == [tok]
        assert engine.generate(["hi"], params)[0].token_ids == cut.token_ids
    SamplingParams(temperature=np.float32(0.7), top_p=np.float32(0.9))


def test_the_api_serves_penalties_and_logit_bias(tiny_daemon: Daemon) -> None:
    c = tiny_daemon.client()
    ask = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0}
    plain = c.completions.create(**ask, extra_body={"ignore_eos": True})
    token = str(byte_tokenizer().encode("q", add_special_tokens=False)[0])  # the tiny model's
    forced = c.completions.create(**ask, logit_bias={token: 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "q" * 6
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        logit_bias={token: 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == "q" * 6
    penalised = c.completions.create(
        **ask, frequency_penalty=2, presence_penalty=2, extra_body={"ignore_eos": True}
    )
    text = penalised.choices[0].text
    assert penalised.usage.completion_tokens == 6
    assert max(Counter(text).values()) <= max(Counter(plain.choices[0].text).values())
    # one entry a token: "0113" is the same token as "113" (the last had silently won, a ban
    # undone); top_k -1 is vLLM's clients' "no top-k", as 0 is
    import openai

    with pytest.raises(openai.BadRequestError, match=r"keys '113' and '0113' are the same token"):
        c.completions.create(**ask, logit_bias={"113": -100, "0113": 0})
    unfiltered = c.completions.create(**ask, extra_body={"top_k": -1, "ignore_eos": True})
    assert unfiltered.choices[0].text == plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match="top_k"):
        c.completions.create(**ask, extra_body={"top_k": -2})


def test_stop_strings_are_bounded() -> None:
    """At most 64 stop strings of at most 1024 characters each (every token of every choice
    is checked against each of them on the engine thread); add_request validates again."""
    SamplingParams(stop=["x" * 1024] * 64)  # the limits themselves
    with pytest.raises(ValueError, match=r"^stop=<65 strings>: expected at most 64 stop strings"):
        SamplingParams(stop=["x"] * 65)
    with pytest.raises(
        ValueError,
        match=r"^stop=<element 1 of 1025 characters>: expected stop strings of at most 1024 "
        "characters",
    ):
        SamplingParams(stop=["ok", "x" * 1025])
    with pytest.raises(ValueError, match=r"^stop=<element 0 of 1025 characters>"):
        SamplingParams(stop="x" * 1025)
    changed = SamplingParams()
    changed.stop = ["x"] * 100_000
    with pytest.raises(ValueError, match=r"^stop=<100000 strings>"):
        changed.validate()


def _bias_the_old_way(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's logit bias as an index_add_ of all its entries, built for the row."""
    out = logits.clone()
    for row, p in zip(out, params, strict=True):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias))
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype))
    return out


def test_logit_bias_tensors_are_built_once_per_params(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's logit bias becomes tensors once, shared by its choices' rows and reused at
    every step, for each dtype the logits come in: building them from the dict for every row
    at every step took 392 ms a step for 32 choices with a whole-vocabulary bias. Zero biases,
    a bias over most of the vocabulary (added as a whole row) and a few biases (an index_add_)
    give what adding every entry gives."""
    vocab = 512
    whole = SamplingParams(logit_bias={t: (t % 9 - 4) * 12.5 for t in range(vocab)})
    few = SamplingParams(logit_bias={3: 1.5, 100: -100.0, 511: 100.0, 7: 0.0})
    zeros = SamplingParams(logit_bias={t: 0.0 for t in range(0, vocab, 2)})
    params = [whole, few, whole, SamplingParams(), zeros, few]
    logits = torch.linspace(-30.0, 30.0, len(params) * vocab).reshape(len(params), vocab)
    logits[0, 5] = float("-inf")
    want = {dt: _bias_the_old_way(logits.to(dt), params) for dt in (torch.float32, torch.float64)}
    built = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: built.append(1) or real(*a, **k))
    for dt in (torch.float32, torch.float64):
        first = adjust_logits(logits.to(dt), params, None)
        made = len(built)
        again = adjust_logits(logits.to(dt), params, None)
        assert len(built) == made  # nothing built the second time
        assert torch.equal(first, want[dt]) and torch.equal(again, want[dt])
    # two params with biases (the zeros make none): at most an id and a value tensor each,
    # per dtype
    assert len(built) <= 2 * 2 * 2, len(built)
    # a new bias, or params validated again (as add_request does), are built afresh
    few.logit_bias = {3: -1.0}
    got = adjust_logits(logits, [few], None)
    assert got[0, 3] == logits[0, 3] - 1.0 and torch.equal(got[0, 4:], logits[0, 4:])
    few.logit_bias[3] = -2.0
    few.validate()
    assert adjust_logits(logits, [few], None)[0, 3] == logits[0, 3] - 2.0


# -- running output counts -----------------------------------------------------------------
def _penalised_the_old_way(
    logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]
) -> torch.Tensor:
    """The penalties as every step used to work them out: a tensor of the row's whole output
    (drafts included) and its `unique`."""
    out = logits.clone()
    for row, p, seen in zip(out, params, outputs, strict=True):
        if seen and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(seen, device=row.device).unique(return_counts=True)
            cut = counts.to(row.dtype) * p.frequency_penalty + p.presence_penalty
            row.index_add_(0, ids, -cut)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bits: -0.0 and 0.0 differ, as do NaNs of another payload."""
    return t.view(
        {torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype, torch.int16)
    )


def test_running_counts_give_the_old_penalties_bit_for_bit() -> None:
    """A fixed run of steps over sequences whose outputs grow by one token, or by several
    (accepted drafts), with rows sampled after drafts (some output already, some repeated,
    some new): each step's logits are the old computation's, bit for bit, in fp32, fp64 and
    bf16 (written through tensor operations, as on a GPU, where the others go through numpy),
    -0.0, infinities and NaN left as they were."""
    from kvguard.engine.sampler import OutputCounts

    vocab = 300
    params = [
        SamplingParams(frequency_penalty=0.1, presence_penalty=0.7),
        SamplingParams(frequency_penalty=-1.3),
        SamplingParams(presence_penalty=2.0),
        SamplingParams(frequency_penalty=1.7, presence_penalty=-0.35),
    ]
    outputs: list[list[int]] = [[] for _ in params]
    counts = [OutputCounts(o) for o in outputs]
    for step in range(300):
        for i, out in enumerate(outputs):
            for k in range(4 if step % 7 == 3 else 1):  # every 7th step, 3 drafts accepted
                out.append((step * step * 7 + i * 31 + k * 13) % (vocab // (i + 1)))
        drafts = [outputs[0][-1], (step * 5) % vocab, (step * 5) % vocab, 299]
        rows, seen, want_params = [], [], []
        for i, p in enumerate(params):
            for j in range(len(drafts) + 1 if i % 2 == 0 else 1):
                rows.append(counts[i].ahead(drafts[:j]) if j else counts[i])
                seen.append(outputs[i] + drafts[:j])
                want_params.append(p)
        logits = torch.linspace(-40.0, 40.0, len(rows) * vocab).reshape(len(rows), vocab)
        logits[:, 0], logits[:, 1], logits[:, 2] = -0.0, float("-inf"), float("nan")
        logits[:, 3] = 0.0
        every = (torch.float32, torch.float64, torch.bfloat16)
        for dt in every if step % 10 == 0 else (torch.float32,):
            got = adjust_logits(logits.to(dt), want_params, rows)
            want = _penalised_the_old_way(logits.to(dt), want_params, seen)
            assert torch.equal(_bits(got), _bits(want)), (step, dt)
    assert all(c.folded == len(o) for c, o in zip(counts, outputs, strict=True))
    # other terms, and an output list that is not a growing one, are worked out afresh
    params[0].frequency_penalty = 0.9
    del outputs[1][-40:]
    logits = torch.linspace(-3.0, 3.0, len(params) * vocab).reshape(len(params), vocab)
    got = adjust_logits(logits, params, counts)
    assert torch.equal(_bits(got), _bits(_penalised_the_old_way(logits, params, outputs)))
    # plain lists are counted on the spot
    got = adjust_logits(logits, params, outputs)
    assert torch.equal(_bits(got), _bits(_penalised_the_old_way(logits, params, outputs)))


def test_a_penalised_steps_work_does_not_grow_with_its_output(
    tiny_dir: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two choices of one request (one params object) with presence and frequency penalties,
    run to 600 tokens by the engine: no step builds a tensor of a sequence's output or runs
    `unique` over it. Each step built a tensor of every penalised row's whole output and its
    `unique` (13-20 ms a step for 32 rows at 2000 tokens, growing with the output); the counts
    now kept on each sequence take only the new tokens."""
    from kvguard.engine import sampler
    from tests.test_engine import make_engine

    engine = make_engine(max_num_seqs=4)
    params = SamplingParams(
        max_tokens=600, ignore_eos=True, frequency_penalty=0.4, presence_penalty=0.2
    )
    rids = [engine.add_request([5, 6, 7, 8], params) for _ in range(2)]
    built: list[int] = []  # elements of the tensors built from lists while logits are adjusted
    uniques: list[int] = []
    adjusting = [False]
    real_tensor, real_adjust = torch.tensor, sampler.adjust_logits

    def tensor(*a: object, **k: object) -> torch.Tensor:
        t = real_tensor(*a, **k)
        if adjusting[0]:
            built.append(t.numel())
        return t

    def unique(self: torch.Tensor, *a: object, **k: object) -> object:
        uniques.append(self.numel())
        return real_unique(self, *a, **k)

    def adjust(*a: object, **k: object) -> torch.Tensor:
        adjusting[0] = True
        try:
            return real_adjust(*a, **k)
        finally:
            adjusting[0] = False

    real_unique = torch.Tensor.unique
    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "unique", unique)
    monkeypatch.setattr(sampler, "adjust_logits", adjust)
    per_step: list[tuple[int, int]] = []  # (output length, elements built) each step
    while engine.has_unfinished():
        before = len(built)
        engine.step()
        seqs = [engine._seqs[r] for r in rids if r in engine._seqs]
        if seqs:
            per_step.append((len(seqs[0].output_token_ids), sum(built[before:])))
    assert max(n for n, _ in per_step) >= 599, per_step[-1]
    late = [b for n, b in per_step if n >= 300]
    assert len(late) > 250 and max(late) <= 16, max(late)
    assert uniques == []
