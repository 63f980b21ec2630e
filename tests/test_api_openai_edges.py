"""Corners of the OpenAI API where kvguard's answer parted from OpenAI's, through the real
`openai` client: nullable sampling fields, a prompt over the context, special tokens in
log-probabilities (the text leaves them out: no width, no bytes), the end-of-turn token a chat
answer ends with, and the sampled token among a completion's alternatives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvguard.engine.random_model import byte_tokenizer
from tests.test_logprob_bytes import token_bytes
from tests.test_server import Daemon
from tests.test_tools import daemon  # noqa: F401 - fixture: the tiny model, max_model_len 2048

SMOLLM = "smollm2-135m"
# the tiny model's special tokens (engine/tiny_model.py): <|endoftext|>, <|im_start|>, <|im_end|>
IM_START, IM_END = 1, 2
FORCE_IM_START = {str(IM_START): 100}


@pytest.fixture(scope="module")
def smollm_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        debug_hooks=False,
        serving=f"{{model: {SMOLLM}, kv_cache_bytes: 64MiB, max_model_len: 512}}",
    )
    yield d
    assert d.stop() == 0


def streamed_completion(c: openai.OpenAI, **ask: Any) -> tuple[str, list[str], list[int]]:
    """A streamed completion's text, tokens and offsets, its chunks joined."""
    text, tokens, offsets = "", [], []
    for chunk in c.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
    return text, tokens, offsets


def streamed_chat(c: openai.OpenAI, **ask: Any) -> tuple[str, list[Any]]:
    """A streamed chat answer's content and log-probability entries, its chunks joined."""
    content, entries = "", []
    for chunk in c.chat.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                entries += choice.logprobs.content
    return content, entries


# -- null is the field left out -------------------------------------------------------------
@pytest.mark.parametrize("field", ["temperature", "top_p", "stream"])
def test_nullable_sampling_fields_sent_as_null_are_left_out(
    tiny_daemon: Daemon, field: str
) -> None:
    """OpenAI declares temperature, top_p and stream nullable, and the openai client sends null
    for a setting passed through unset: each endpoint answers as if the field were left out
    (a seeded draw at temperature 1 and top_p 1, not streamed)."""
    c = tiny_daemon.client()
    same = {"max_tokens": 6, "seed": 7, "extra_body": {"ignore_eos": True}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}], **same}
    left_out = c.chat.completions.create(**chat)
    nulled = c.chat.completions.create(**chat, **{field: None})
    assert nulled.object == "chat.completion"
    assert nulled.choices[0].message.content == left_out.choices[0].message.content
    completion = {"model": "tiny", "prompt": "Once upon", **same}
    left_out = c.completions.create(**completion)
    nulled = c.completions.create(**completion, **{field: None})
    assert nulled.object == "text_completion"
    assert nulled.choices[0].text == left_out.choices[0].text


def test_null_sampling_fields_in_a_raw_body(tiny_daemon: Daemon) -> None:
    """The JSON nulls themselves, all three at once: a JSON answer, not an SSE stream."""
    nulls = {"temperature": None, "top_p": None, "stream": None, "max_tokens": 2}
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "hi", **nulls}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                  **nulls}),
    ):  # fmt: skip
        r = httpx.post(tiny_daemon.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["usage"]["completion_tokens"] <= 2
    # a value of the wrong type is still refused, naming the field
    r = httpx.post(
        tiny_daemon.url + "/v1/completions",
        json={"model": "tiny", "prompt": "hi", "temperature": "1"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


# -- top_p 0 --------------------------------------------------------------------------------
def test_top_p_0_keeps_the_most_likely_token(tiny_daemon: Daemon) -> None:
    """OpenAI takes top_p in [0, 1]; 0 keeps the single most likely token: temperature 0's
    answer, seeded or not, on both endpoints (sampled, the tiny model's answers differ)."""
    c = tiny_daemon.client()
    same = {"model": "tiny", "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    chat = {**same, "messages": [{"role": "user", "content": "Hi!"}]}
    completion = {**same, "prompt": "Once upon"}

    def chat_text(**kw: Any) -> str:
        return c.chat.completions.create(**chat, **kw).choices[0].message.content

    def completion_text(**kw: Any) -> str:
        return c.completions.create(**completion, **kw).choices[0].text

    for text in (chat_text, completion_text):
        greedy = text(temperature=0)
        assert text(temperature=1.0, top_p=1.0, seed=1) != greedy
        for seed in (None, 1, 2):
            assert text(temperature=1.0, top_p=0, seed=seed) == greedy
            assert text(temperature=2.0, top_p=0.0, seed=seed) == greedy
    r = httpx.post(  # a JSON integer 0 too
        tiny_daemon.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Once upon", "max_tokens": 12, "ignore_eos": True,
              "temperature": 1.0, "top_p": 0},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == completion_text(temperature=0)
    for bad in (-0.01, 1.01):  # outside [0, 1]: still a 400 naming the field
        with pytest.raises(openai.BadRequestError) as refused:
            completion_text(top_p=bad)
        assert refused.value.body["param"] == "top_p"


# -- chat's default max_tokens ----------------------------------------------------------------
def test_a_chat_without_max_tokens_ends_at_the_default_and_says_so(daemon: Daemon) -> None:  # noqa: F811
    """A chat request that sets neither max_tokens nor max_completion_tokens answers at most
    512 tokens (OpenAI's would run to the context: 2048 here), `length` where that cut it,
    and says the default was in force: `kvguard.max_tokens_default`, streamed or not; null
    where the request set a limit, and on completions (whose default is OpenAI's 16)."""
    url = daemon.url
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}], "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=ask, timeout=120).json()
    assert r["usage"]["completion_tokens"] == 512
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["kvguard"]["max_tokens_default"] == 512
    q = str(byte_tokenizer().encode("q", add_special_tokens=False)[0])
    short = {**ask, "logit_bias": {q: 100}, "stop": "q", "stream": True}  # ends at once
    with httpx.stream("POST", url + "/v1/chat/completions", json=short, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    end = chunks[-1]
    assert end["choices"][0]["finish_reason"] == "stop"
    assert end["kvguard"]["max_tokens_default"] == 512
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        r = httpx.post(url + "/v1/chat/completions", json={**ask, **limit}, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 3
        assert r["kvguard"]["max_tokens_default"] is None, limit
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi"}, timeout=60)
    assert r.json()["kvguard"]["max_tokens_default"] is None


# -- a prompt over the context --------------------------------------------------------------
@pytest.mark.parametrize("size", [600, 6000], ids=["counted", "more-than"])
def test_prompt_over_the_context_names_its_field_and_code(tiny_daemon: Daemon, size: int) -> None:
    """A prompt too long for max_model_len (512; the tiny model's tokens are bytes) answers
    400 with OpenAI's code `context_length_exceeded`, naming `messages` on chat (it has no
    `prompt` field) and `prompt` on completions; counted whole or refused once a prefix is
    over the limit."""
    c = tiny_daemon.client()
    with pytest.raises(openai.BadRequestError) as chat:
        c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * size}], max_tokens=2
        )
    assert chat.value.body["param"] == "messages", chat.value.body
    assert chat.value.body["code"] == "context_length_exceeded"
    assert "max_model_len=512" in chat.value.body["message"]
    with pytest.raises(openai.BadRequestError) as completion:
        c.completions.create(model="tiny", prompt="word " * size, max_tokens=2)
    assert completion.value.body["param"] == "prompt", completion.value.body
    assert completion.value.body["code"] == "context_length_exceeded"
    # another refusal of the prompt is no context length
    with pytest.raises(openai.BadRequestError) as empty:
        c.completions.create(model="tiny", prompt="", max_tokens=2)
    assert empty.value.body["param"] == "prompt" and empty.value.body["code"] is None


def test_a_text_prompt_over_the_context_is_refused_with_its_count(tiny_daemon: Daemon) -> None:
    """A text a few tokens over the context is tokenized whole: its refusal names its count
    (the count /tokenize gives) beside max_model_len, as OpenAI's does, and the most it may
    have, not "more than 512 tokens": a client trimming it learns by how much."""
    c = tiny_daemon.client()
    chat = [{"role": "user", "content": "a" * 520}]
    for create, ask in (
        (c.completions.create, {"prompt": "a" * 515}),
        (c.chat.completions.create, {"messages": chat}),
    ):
        r = httpx.post(tiny_daemon.url + "/tokenize", json={"model": "tiny", **ask}, timeout=60)
        count = r.json()["count"]
        assert 512 < count < 600, r.json()
        with pytest.raises(openai.BadRequestError) as e:
            create(model="tiny", max_tokens=2, **ask)
        assert e.value.body["message"] == (
            f"prompt of {count} tokens leaves no room to generate within max_model_len=512: "
            "shorten it to at most 511 tokens"
        ), e.value.body


@pytest.mark.parametrize(
    ("prompt", "n", "name"),
    [
        (["a" * 10, "a" * 600], 1, "prompt[1]"),
        (["a" * 10, "b" * 10, "a" * 600], 2, "prompt[2]"),
        ([[5] * 10, [5] * 600], 1, "prompt[1]"),
        (["a" * 600], 1, "prompt[0]"),
    ],
    ids=["texts", "texts-n2", "token-ids", "one-in-a-list"],
)
def test_a_prompt_over_the_context_in_a_list_is_named_by_its_index(
    tiny_daemon: Daemon, prompt: list, n: int, name: str
) -> None:
    """In a list of prompts the one too long for the context is named as the client wrote it,
    `prompt[i]`, in `param` and in the message: a client batching many prompts learns which
    one to shorten (choices, `n` per prompt, do not shift the index)."""
    with pytest.raises(openai.BadRequestError) as e:
        tiny_daemon.client().completions.create(model="tiny", prompt=prompt, n=n, max_tokens=2)
    body = e.value.body
    assert (body["param"], body["code"]) == (name, "context_length_exceeded"), body
    assert body["message"].startswith(f"{name} of 600 tokens leaves no room"), body


# -- special tokens: the text leaves them out ------------------------------------------------
def test_a_generated_special_token_takes_no_room_in_a_completions_text(
    tiny_daemon: Daemon,
) -> None:
    """Generated special tokens (forced by a logit bias) are listed but their text is not in
    the answer: they take no room, so the offsets after them still index the text. An echoed
    prompt's special token is in the text as sent, and keeps its width."""
    c = tiny_daemon.client()
    ask = {"model": "tiny", "max_tokens": 2, "temperature": 0, "logprobs": 0,
           "logit_bias": FORCE_IM_START}  # fmt: skip
    echoed = c.completions.create(**ask, prompt="<|im_start|>ab", echo=True)
    text, lp = echoed.choices[0].text, echoed.choices[0].logprobs
    assert text == "<|im_start|>ab"
    assert lp.tokens == ["<|im_start|>", "a", "b", "<|im_start|>", "<|im_start|>"]
    assert lp.text_offset == [0, 12, 13, 14, 14]
    full = c.completions.create(**ask, prompt="ab")
    assert full.choices[0].text == "" and full.choices[0].logprobs.text_offset == [0, 0]
    text, tokens, offsets = streamed_completion(c, **ask, prompt="ab")
    assert (text, tokens, offsets) == ("", ["<|im_start|>"] * 2, [0, 0])


def test_a_generated_special_token_takes_no_room_before_text(smollm_daemon: Daemon) -> None:
    """smollm2 continues a chat-formatted prompt with `<|im_start|>assistant`: the words after
    the special token start at 0, streamed and not (they were put 12 characters, the special
    token's bytes, past the end of the text)."""
    c = smollm_daemon.client()
    ask = {"model": SMOLLM, "prompt": "<|im_start|>user\nHi<|im_end|>\n", "max_tokens": 3,
           "temperature": 0, "logprobs": 1}  # fmt: skip
    full = c.completions.create(**ask).choices[0]
    assert full.text == "assistant"
    assert full.logprobs.tokens == ["<|im_start|>", "ass", "istant"]
    assert full.logprobs.text_offset == [0, 0, 3]
    for token, offset in zip(full.logprobs.tokens[1:], full.logprobs.text_offset[1:], strict=True):
        assert full.text[offset:].startswith(token)
    assert streamed_completion(c, **ask) == (
        full.text,
        full.logprobs.tokens,
        full.logprobs.text_offset,
    )


def test_a_chat_entrys_bytes_are_none_for_a_special_token(tiny_daemon: Daemon) -> None:
    """A chat answer of special tokens has no content: their entries are listed, by their
    text, with no bytes, so that the entries' bytes still add up to the content; so is an
    alternative that is a special token."""
    c = tiny_daemon.client()
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 3,
           "temperature": 0, "logprobs": True, "top_logprobs": 3,
           "logit_bias": FORCE_IM_START}  # fmt: skip
    full = c.chat.completions.create(**ask)
    content, entries = full.choices[0].message.content, full.choices[0].logprobs.content
    assert content == "" and full.choices[0].finish_reason == "length"
    assert [(e.token, e.bytes) for e in entries] == [("<|im_start|>", [])] * 3
    for e in entries:
        for alt in e.top_logprobs:
            special = alt.token.startswith("<|") and alt.token.endswith("|>")
            assert alt.bytes == ([] if special else list(token_bytes(alt.token))), alt
    content, streamed = streamed_chat(c, **ask)
    assert content == "" and [(e.token, e.bytes) for e in streamed] == [("<|im_start|>", [])] * 3


# -- the end-of-turn token that ends a chat answer ---------------------------------------------
def test_chat_logprobs_leave_out_the_end_of_turn_token(tiny_daemon: Daemon) -> None:
    """OpenAI lists no entry for the token that ended the answer (its content has no text of
    it): an answer that is only its end-of-turn token has none, streamed or not. A
    completion lists it (offset 0: no room), and with ignore_eos it ends nothing and stays."""
    c = tiny_daemon.client()
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4,
           "temperature": 0, "logprobs": True, "logit_bias": {str(IM_END): 100}}  # fmt: skip
    full = c.chat.completions.create(**ask)
    assert full.choices[0].finish_reason == "stop" and full.usage.completion_tokens == 1
    assert full.choices[0].message.content == "" and full.choices[0].logprobs.content == []
    assert streamed_chat(c, **ask) == ("", [])
    kept = c.chat.completions.create(**{**ask, "max_tokens": 2}, extra_body={"ignore_eos": True})
    assert [(e.token, e.bytes) for e in kept.choices[0].logprobs.content] == [
        ("<|im_end|>", [])
    ] * 2
    completion = c.completions.create(
        model="tiny", prompt="Hi!", max_tokens=4, temperature=0, logprobs=0,
        logit_bias={str(IM_END): 100},
    )  # fmt: skip
    lp = completion.choices[0].logprobs
    assert completion.choices[0].finish_reason == "stop"
    assert (lp.tokens, lp.text_offset) == (["<|im_end|>"], [0])


def test_chat_logprobs_match_the_content_of_an_answer_that_ends_its_turn(
    smollm_daemon: Daemon,
) -> None:
    """A greedy smollm2 answer that ends with its end-of-turn token: one entry per token of
    the content, whose bytes are the content's, streamed and not; usage still counts the
    end-of-turn token, as it was generated."""
    c = smollm_daemon.client()
    question = {"role": "user", "content": "What is 2+2? Answer with one number."}
    ask = {"model": SMOLLM, "messages": [question], "max_tokens": 40, "temperature": 0,
           "logprobs": True, "top_logprobs": 1}  # fmt: skip
    full = c.chat.completions.create(**ask)
    content, entries = full.choices[0].message.content, full.choices[0].logprobs.content
    assert full.choices[0].finish_reason == "stop" and content == "The answer is 4."
    assert len(entries) == full.usage.completion_tokens - 1
    assert all(e.token != "<|im_end|>" for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries) == content.encode()
    streamed, streamed_entries = streamed_chat(c, **ask)
    assert streamed == content
    assert [(e.token, e.bytes) for e in streamed_entries] == [(e.token, e.bytes) for e in entries]


# -- a completion's alternatives hold the sampled token -----------------------------------------
def test_completion_top_logprobs_hold_the_sampled_token(tiny_daemon: Daemon) -> None:
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements". A token forced by a logit bias (which log-probabilities do not
    see) is not among the likeliest, and is listed beside them with its own log-probability;
    the prompt's tokens of an echo too, but for the first (which has none). Chat's
    `top_logprobs` are exactly the likeliest, as OpenAI's are."""
    c = tiny_daemon.client()
    q = byte_tokenizer().encode("q", add_special_tokens=False)[0]
    ask = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0,
           "logit_bias": {str(q): 100}}  # fmt: skip
    for logprobs in (0, 1, 3):
        lp = c.completions.create(**ask, logprobs=logprobs).choices[0].logprobs
        assert lp.tokens == ["q"] * 3
        for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top["q"] == value and logprobs <= len(top) <= logprobs + 1, top
            assert list(top.values()) == sorted(top.values(), reverse=True)
        assert any(len(top) == logprobs + 1 for top in lp.top_logprobs)  # q was not the likeliest
        chunks = list(c.completions.create(**ask, logprobs=logprobs, stream=True))
        streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for t in ch.choices[0].logprobs.top_logprobs]  # fmt: skip
        assert streamed == lp.top_logprobs
    echoed = c.completions.create(**ask, logprobs=1, echo=True).choices[0].logprobs
    assert echoed.tokens == [*"Hello", "q", "q", "q"] and echoed.top_logprobs[0] is None
    for token, value, top in zip(
        echoed.tokens[1:], echoed.token_logprobs[1:], echoed.top_logprobs[1:], strict=True
    ):
        assert top[token] == value and 1 <= len(top) <= 2, (token, top)
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, logit_bias={str(q): 100},
    )  # fmt: skip
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == ["q"] * 3
    assert all(len(e.top_logprobs) == 2 for e in entries)


# -- values that ask for nothing, values OpenAI refuses ------------------------------------------
HI = [{"role": "user", "content": "Hi!"}]


def test_reasoning_effort_none_and_verbosity_medium_ask_for_nothing(tiny_daemon: Daemon) -> None:
    """`reasoning_effort: "none"` asks for no reasoning and `verbosity: "medium"` is OpenAI's
    default: both are what the model does, so both are served (they were refused as "not
    served"); a value that asks for more is still refused, naming the field."""
    c = tiny_daemon.client()
    ask = {"model": "tiny", "messages": HI, "max_tokens": 2}
    for field, quiet, more in (("reasoning_effort", "none", "low"), ("verbosity", "medium", "low")):
        out = c.chat.completions.create(**ask, **{field: quiet})
        assert out.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**ask, **{field: more})
        assert e.value.body["param"] == field and f'"{quiet}"' in e.value.body["message"]


def test_a_service_tier_outside_openai_s_is_refused(tiny_daemon: Daemon) -> None:
    """OpenAI's tiers are accepted (kvguard has one: they change nothing); another value is
    a 400 naming `service_tier`, as OpenAI answers it, on both endpoints."""
    c = tiny_daemon.client()
    chat = {"model": "tiny", "messages": HI, "max_tokens": 2}
    completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    for tier in ("auto", "default", "flex", "scale", "priority"):
        assert c.chat.completions.create(**chat, service_tier=tier).choices
        assert c.completions.create(**completion, extra_body={"service_tier": tier}).choices
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**chat, service_tier="bogus")
    assert e.value.body["param"] == "service_tier" and "flex" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(**completion, extra_body={"service_tier": "bogus"})
    assert e.value.body["param"] == "service_tier"


def test_parallel_tool_calls_without_tools_is_refused(tiny_daemon: Daemon) -> None:
    """OpenAI answers `parallel_tool_calls` without `tools` 400 ("only allowed when tools are
    specified"): kvguard did serve it, as if it asked something. /tokenize counts messages as
    chat serves them, and refuses it alike."""
    c = tiny_daemon.client()
    for parallel in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model="tiny", messages=HI, max_tokens=2, parallel_tool_calls=parallel
            )
        assert e.value.body["param"] == "parallel_tool_calls", e.value.body
        assert "tools" in e.value.body["message"]
    r = httpx.post(
        tiny_daemon.url + "/tokenize",
        json={"model": "tiny", "messages": HI, "parallel_tool_calls": False},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls", r.text


# -- an empty prompt of a list is named by its index --------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "n", "name"),
    [(["a", ""], 1, "prompt[1]"), ([[1, 2], []], 1, "prompt[1]"), (["a", "b", ""], 2, "prompt[2]"),
     (["", "a"], 1, "prompt[0]")],
    ids=["texts", "token-ids", "texts-n2", "first"],
)  # fmt: skip
def test_an_empty_prompt_in_a_list_is_named_by_its_index(
    tiny_daemon: Daemon, prompt: list, n: int, name: str
) -> None:
    """An empty prompt in a batch of up to 256 was refused naming `prompt`, which does not say
    which: it is named `prompt[i]`, in `param` and in the message, as a prompt too long is."""
    with pytest.raises(openai.BadRequestError) as e:
        tiny_daemon.client().completions.create(model="tiny", prompt=prompt, n=n, max_tokens=2)
    body = e.value.body
    assert body["param"] == name and body["message"].startswith(f"{name} is empty"), body


# -- usage: null on every chunk before the usage chunk ------------------------------------------
@pytest.mark.parametrize("n", [1, 2])
def test_include_usage_puts_a_null_usage_on_every_chunk_before_the_last(
    tiny_daemon: Daemon, n: int
) -> None:
    """OpenAI's reference: with `stream_options.include_usage`, "all other chunks will also
    include a usage field, but with a null value". A client reading `chunk["usage"]` off the
    raw JSON got a KeyError on each. Without the option no chunk has the key. Chat and
    completions, read as the openai client streams them."""
    c = tiny_daemon.client()
    same = {"model": "tiny", "max_tokens": 4, "n": n, "stream": True}
    for create, ask in (
        (c.chat.completions.with_streaming_response.create, {**same, "messages": HI}),
        (c.completions.with_streaming_response.create, {**same, "prompt": "Hi"}),
    ):
        for include in (True, False):
            with create(**ask, stream_options={"include_usage": include}) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: {")]
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
            assert len(chunks) >= 2 * n + include, chunks  # each choice's first and last
            if not include:
                assert not any("usage" in chunk for chunk in chunks), chunks
                continue
            *answer, last = chunks
            assert all("usage" in chunk and chunk["usage"] is None for chunk in answer), answer
            assert last["choices"] == [] and last["usage"]["completion_tokens"] >= n, last
