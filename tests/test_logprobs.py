"""Log-probabilities of sampled tokens: the engine's against the model's own teacher-forced
log-softmax, aligned per request in a mixed batch, and served through the OpenAI API
(completions and chat, streamed and not) to the real `openai` client."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.engine_loop import OutputBuffer
from kvguard.engine.random_model import byte_tokenizer
from kvguard.engine.sequence import RequestOutput, TokenLogprob
from tests.test_server import Daemon

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,"]


# Returned log-probabilities and `score` are the exact head's (tests/test_logprob_exact.py), but
# a prefill and a decode step of the packed model round the activations that reach the head
# apart: the hidden states differ a little, and so do their log-probabilities.
TOL = 5e-3


def reference(eng: LLMEngine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The model's log-softmax at each output position, teacher-forced in one prefill."""
    logits = eng.score(prompt + output[:-1]).float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 :]


def test_each_sampled_token_gets_the_models_log_probability(smollm_engine: LLMEngine) -> None:
    """Greedy and sampled requests with and without log-probabilities in one batch: each that
    asked gets, per output token, that token's log-softmax and its k best alternatives, as the
    model computes them teacher-forced; the others get none."""
    eng = smollm_engine
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
    params = [
        SamplingParams(max_tokens=8, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=8, ignore_eos=True),  # asks for none, between two that do
        SamplingParams(max_tokens=8, logprobs=0, temperature=1.0, seed=7, ignore_eos=True),
    ]
    outs = eng.generate(prompts, params)
    assert outs[1].final_logprobs is None
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        if p.logprobs is None:
            continue
        lps = out.final_logprobs
        assert [lp.token_id for lp in lps] == out.token_ids
        ref = reference(eng, prompt, out.token_ids)
        for i, lp in enumerate(lps):
            assert abs(lp.logprob - ref[i, lp.token_id].item()) < TOL, (i, lp)
            assert len(lp.top) == p.logprobs
            if lp.top:
                ids, values = zip(*lp.top, strict=True)
                assert list(values) == sorted(values, reverse=True)
                torch.testing.assert_close(
                    torch.tensor(values), ref[i, list(ids)], atol=TOL, rtol=0
                )
                assert ids[0] == ref[i].argmax().item()
        if p.greedy:  # the drawn token is the most likely one
            assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in lps)
    # the sampled request's draws do not depend on whether it asked for log-probabilities
    again = eng.generate([prompts[2]], [dataclasses.replace(params[2], logprobs=None)])
    assert again[0].token_ids == outs[2].token_ids


def test_streamed_deltas_carry_their_tokens_log_probabilities(smollm_engine: LLMEngine) -> None:
    """Every output's `new_logprobs` matches its `new_token_ids`; joined they are the final
    list, and a consumer that falls behind gets them coalesced, none lost."""
    eng = smollm_engine
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=6, logprobs=1, ignore_eos=True))
    deltas: list[RequestOutput] = []
    while eng.has_unfinished():
        deltas += [o for o in eng.step() if o.request_id == rid]
    assert all(len(d.new_logprobs) == len(d.new_token_ids) for d in deltas)
    joined = [lp for d in deltas for lp in d.new_logprobs]
    assert joined == deltas[-1].final_logprobs and len(joined) == 6
    buffer = OutputBuffer()
    for d in deltas:
        buffer.add(d)
    merged = buffer.take()
    assert merged.new_logprobs == joined and merged.new_token_ids == deltas[-1].final_token_ids


def test_prompt_logprobs_are_the_models_across_prefill_chunks() -> None:
    """A request that asks for its prompt's log-probabilities gets one per prompt token after
    the first, equal to the teacher-forced log-softmax, however its prompt is chunked; a
    request beside it that did not ask draws exactly what it draws alone."""
    config = EngineConfig(
        model="smollm2-135m", kv_cache_bytes="64MiB", num_threads=2, max_num_batched_tokens=8
    )
    eng = LLMEngine.from_config(config, progress=False)  # prompts in chunks of at most 8
    text = "The capital of France is Paris, and the capital of Spain is Madrid."
    prompt = eng.tokenizer.encode(text)
    alone = eng.generate(["1, 2, 3,"], [SamplingParams(max_tokens=4)])[0]
    asked = SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=1)
    out, other = eng.generate([prompt, "1, 2, 3,"], [asked, SamplingParams(max_tokens=4)])
    assert other.token_ids == alone.token_ids and other.final_prompt_logprobs is None
    plps = out.final_prompt_logprobs
    assert [e.token_id for e in plps] == prompt[1:] and len(prompt) > 8
    ref = torch.log_softmax(eng.score(prompt).float(), -1)
    for i, e in enumerate(plps):
        assert abs(e.logprob - ref[i, prompt[i + 1]].item()) < 1e-4, i
        assert [t for t, _ in e.top] == ref[i].topk(2).indices.tolist()
    # and the generation itself is the one the request gets without asking
    plain = eng.generate([prompt], [SamplingParams(max_tokens=3)])[0]
    assert out.token_ids == plain.token_ids and len(out.final_logprobs) == 3
    # a step that fails (out of memory) sends the request back to recompute from its first
    # token: the positions it already holds are not collected twice
    rid = eng.add_request(prompt, asked)
    eng.step()
    eng.runner.inject_oom(1)
    final = [o for _ in range(200) if eng.has_unfinished() for o in eng.step() if o.finished]
    assert final[0].request_id == rid and final[0].num_preemptions == 1
    assert final[0].final_prompt_logprobs == plps and final[0].token_ids == out.token_ids


def test_logprobs_are_validated() -> None:
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(logprobs=20).logprobs == 20
    assert TokenLogprob(3, -0.5).top == ()


# -- the OpenAI API ------------------------------------------------------------------------------
def token_text(raw: bytes) -> str:
    """A token's text in logprobs: its bytes as UTF-8, or `bytes:\\xNN...` where they are
    part of a character."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_completion_logprobs_streamed_and_not(tiny_daemon: Daemon) -> None:
    c = tiny_daemon.client()
    ask = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    full = c.completions.create(**ask, extra_body={"ignore_eos": True})
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(v <= 0.0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)  # two tokens may print alike
    # greedy: the drawn token is the best alternative
    drawn = zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    assert all(top[t] == v for t, v, top in drawn)
    # offsets index the text: where the character a token's first byte begins or continues
    # starts (a token of part of a character reads `bytes:\xNN`, not as its text's length)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(o < len(full.choices[0].text) for o in lp.text_offset)
    chunks = list(c.completions.create(**ask, stream=True, extra_body={"ignore_eos": True}))
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    plain = c.completions.create(**{**ask, "logprobs": None}, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].text == full.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(tiny_daemon: Daemon) -> None:
    """What an evaluation harness asks (token ids, echo, logprobs, one new token): the prompt's
    tokens come back with their log-probabilities, the first with none; each equals the raw
    log-probability of the same token drawn after the same prefix (forced by a logit bias,
    which log-probabilities do not see)."""
    c = tiny_daemon.client()
    ids = byte_tokenizer().encode("abcab", add_special_tokens=False)
    scored = c.completions.create(
        model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[: len(ids)] == list("abcab")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the best alternative and, where it is not that, the prompt's own token (OpenAI's way)
    entries = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
    assert all(1 <= len(top) <= 2 and top[t] == v for t, v, top in entries)
    assert scored.choices[0].text.startswith("abcab")
    for i in range(1, len(ids)):
        forced = c.completions.create(
            model="tiny",
            prompt=ids[:i],
            max_tokens=1,
            temperature=0,
            logprobs=0,
            logit_bias={str(ids[i]): 100},
        )
        assert forced.choices[0].logprobs.tokens == [lp.tokens[i]]
        assert abs(forced.choices[0].logprobs.token_logprobs[0] - lp.token_logprobs[i]) < 1e-4


def test_chat_logprobs_streamed_and_not(tiny_daemon: Daemon) -> None:
    c = tiny_daemon.client()
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    full = c.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0.0 and entry.token == token_text(bytes(entry.bytes))
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    chunks = list(c.chat.completions.create(**ask, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]  # fmt: skip
    # the same tokens; the same log-probabilities but for the last bits: the second request
    # finds the prompt in the prefix cache and computes its tail in a shorter chunk, and an
    # AVX-512 sgemm rounds a row differently with the number of rows beside it
    assert [e.token for e in streamed] == [e.token for e in content]
    want = [e.logprob for e in content]
    assert [e.logprob for e in streamed] == pytest.approx(want, rel=1e-5, abs=1e-5)
    no_top = c.chat.completions.create(**{**ask, "top_logprobs": None})
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)


def test_the_readme_lists_logprobs_as_served() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    served = next(line for line in readme.splitlines() if line.startswith("| served |"))
    assert "`logprobs`" in served and "`top_logprobs`" in served
