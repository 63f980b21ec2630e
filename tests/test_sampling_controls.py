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
