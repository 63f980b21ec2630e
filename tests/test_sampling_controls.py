"""Presence and frequency penalties and logit bias: the arithmetic on the logits, their effect
on what the real model draws, and the OpenAI API fields through the real `openai` client."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.random_model import byte_tokenizer
from kvguard.engine.sampler import adjust_logits
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
