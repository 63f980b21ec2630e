"""`n`: several choices of one prompt in one request, through the real `openai` client.

Each choice is an engine request of its own (admitted, queued, preempted and aborted like
one); a seeded request's choice i draws with seed + i, so it is the request with that seed;
the prompt's full blocks are computed once (the others take them from the prefix cache);
a refusal of any choice refuses the request and ends the others; a client that hangs up
ends every choice."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.test_disconnect import count, finished, idle, send, state
from tests.test_server import Daemon, until

PROMPT = "the quick brown fox jumps over the lazy dog " * 6


def _hit_tokens(d: Daemon) -> float:
    text = httpx.get(d.url + "/metrics").text
    m = re.search(r"^kvguard_prefix_cache_hit_tokens_total (\S+)$", text, re.M)
    assert m, "kvguard_prefix_cache_hit_tokens_total not exported"
    return float(m.group(1))


def test_chat_choices_are_the_seeded_requests_they_stand_for(tiny_daemon: Daemon) -> None:
    client = tiny_daemon.client()
    msgs = [{"role": "user", "content": "Name three colours."}]
    kw: dict[str, Any] = {"model": "tiny", "messages": msgs, "max_tokens": 12, "temperature": 1.0}
    got = client.chat.completions.create(n=3, seed=41, **kw)
    assert [c.index for c in got.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(seed=41 + i, **kw) for i in range(3)]
    assert [c.message.content for c in got.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in got.choices}) > 1  # not one sample three times
    assert got.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert got.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert [c.finish_reason for c in got.choices] == [a.choices[0].finish_reason for a in alone]
    top = 2**63 - 1  # the largest seed a request may send: its choices go past int64, served
    high = [c.message.content for c in client.chat.completions.create(n=3, seed=top, **kw).choices]
    assert high[0] == client.chat.completions.create(seed=top, **kw).choices[0].message.content
    assert high == [
        c.message.content for c in client.chat.completions.create(n=3, seed=top, **kw).choices
    ]


def test_streamed_choices_match_the_answer_and_each_ends_once(tiny_daemon: Daemon) -> None:
    client = tiny_daemon.client()
    kw: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0.9,
        "seed": 7,
        "n": 4,
        "logprobs": 1,
    }
    whole = client.completions.create(**kw)
    texts, ends, offsets = ["", "", "", ""], [[], [], [], []], [[], [], [], []]
    usage = None
    for chunk in client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                ends[c.index].append(c.finish_reason)
            if c.logprobs is not None:
                offsets[c.index] += c.logprobs.text_offset
    assert texts == [c.text for c in whole.choices]
    assert ends == [[c.finish_reason] for c in whole.choices]
    # each choice's text offsets count from its own start, as in the whole answer
    assert offsets == [c.logprobs.text_offset for c in whole.choices]
    assert all(o[0] == 0 for o in offsets)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 40


def test_the_choices_compute_their_prompt_once(tiny_daemon: Daemon) -> None:
    """The full blocks of the prompt are computed for the first choice; the other three find
    them in the prefix cache (whether they arrived in the same step or not)."""
    client = tiny_daemon.client()
    prompt = "choices share a prompt " * 9 + "once"
    before = _hit_tokens(tiny_daemon)
    got = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, n=4, temperature=0.8, seed=3
    )
    full = (got.usage.prompt_tokens - 1) // 16 * 16
    assert full >= 32
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # the first choice computed it
    assert _hit_tokens(tiny_daemon) - before == 3 * full


@pytest.mark.parametrize("n", [0, 33, -1, 2.5, "2"])
def test_a_choice_count_out_of_range_is_refused_naming_n(tiny_daemon: Daemon, n: object) -> None:
    r = httpx.post(
        tiny_daemon.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "n": n}
    )
    assert r.status_code == 400
    assert "n" in r.json()["error"]["param"]


@pytest.fixture(scope="module")
def queue_daemon(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a Daemon
    """A pool of 64 blocks, admission by worst case, a queue of at most one: while a request
    of 480 tokens holds its KV, a request's first choice could wait in the queue and the next
    could not (max_queue a hard limit)."""
    d = Daemon(
        tmp_path_factory.mktemp("choices"),
        extra="admission_control: {enable: true, estimate: worst_case, max_queue: 1, "
        "max_queue_wait: 0s}\n",
        serving="{model: tiny, kv_cache_bytes: 512KiB, max_model_len: 512}",
    )
    yield d
    assert d.stop() == 0


def test_a_refused_choice_refuses_the_request_and_takes_in_none_of_it(
    queue_daemon: Daemon,
) -> None:
    """The holder's worst case leaves no room for a choice of 400 tokens: the first choice
    would wait, the second finds the queue full, which refuses the request whole: none of its
    choices is taken in, so none is aborted (the first used to be queued, then ended as an
    `abort`, and the 429 said "queue full (1 waiting)" of that choice). The holder runs on to
    its own end. The engine is stalled while the holder and the three choices are posted, so
    it takes them in one drain, in order: the holder's KV is committed when the choices are
    decided however fast the machine (an idle one finished a running holder's 480 tokens
    before the choices came, and admitted the first)."""
    d = queue_daemon
    aborts, lengths = finished(d, "abort"), finished(d, "length")
    client = d.client()
    with ThreadPoolExecutor(2) as pool:
        assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
        try:
            holder = pool.submit(
                client.completions.create,
                model="tiny",
                prompt="hold",
                max_tokens=480,
                extra_body={"ignore_eos": True},
            )
            until(lambda: state(d)["in_flight"] == 1, 30, "the holder posted")
            three = pool.submit(
                client.completions.create, model="tiny", prompt="three", max_tokens=400, n=3
            )
            until(lambda: state(d)["in_flight"] == 4, 30, "its three choices posted")
        finally:
            d.admin("POST", "/admin/debug/release")
        with pytest.raises(openai.APIStatusError) as e:
            three.result(60)
        assert e.value.status_code == 429
        # the queue held nothing ahead of it: its own size is what did not fit
        assert e.value.message.endswith(
            "queue full (0 waiting ahead of this request): its 3 sequences (choices or prompts) "
            "do not all fit in the queue beside them (max_queue 1); retry later, or ask for fewer"
        ), e.value.message
        until(lambda: count(state(d), "waiting") == 0, 10, "nothing of it queued")
        held = holder.result(120)
    # the holder was left alone: its whole answer
    assert held.choices[0].finish_reason == "length" and held.usage.completion_tokens == 480
    # the metrics are rebuilt from the engine's snapshot at most every second
    until(lambda: finished(d, "length") - lengths == 1, 10, "the holder's end counted")
    assert finished(d, "abort") == aborts  # nothing of the refused request was taken in
    until(lambda: idle(state(d)), 30, "every block freed")


def test_a_client_that_hangs_up_ends_every_choice(tiny_daemon: Daemon) -> None:
    d = tiny_daemon
    for stream in (False, True):
        sock = send(d, {"prompt": "leave", "max_tokens": 480, "n": 3, "stream": stream})
        try:
            until(lambda: count(state(d), "running") == 3, 60, "three choices generating")
        finally:
            sock.close()
        until(lambda: idle(state(d)), 5, "every choice aborted")


# -- several prompts in one completions request -------------------------------------------


def test_several_prompts_answer_in_order_with_n_choices_each(tiny_daemon: Daemon) -> None:
    """Choice i answers prompt i // n with choice i % n's seed, echoes its own prompt, and the
    usage counts each prompt once; streamed, the same texts."""
    client = tiny_daemon.client()
    prompts = ["alpha beta gamma", "one two three four five"]
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    got = client.completions.create(prompt=prompts, n=2, echo=True, **kw)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    alone = [
        client.completions.create(prompt=p, **{**kw, "seed": 11 + j})
        for p in prompts
        for j in range(2)
    ]
    want = [prompts[i // 2] + a.choices[0].text for i, a in enumerate(alone)]
    assert [c.text for c in got.choices] == want
    assert got.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    assert got.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts = ["", "", "", ""]
    for chunk in client.completions.create(prompt=prompts, n=2, echo=True, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want


def test_token_id_prompts_and_their_limits(tiny_daemon: Daemon) -> None:
    client = tiny_daemon.client()
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0)
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0)
             for p in ids]  # fmt: skip
    assert [c.text for c in got.choices] == [a.choices[0].text for a in alone]
    assert got.usage.prompt_tokens == 7
    url = tiny_daemon.url + "/v1/completions"
    for body, param, why in (
        ({"prompt": ["x"] * 9, "n": 32}, "prompt", "at most 256 sequences"),
        ({"prompt": [[1, 2], 3]}, "prompt", "element"),
        ({"prompt": [[1, 2], []]}, "prompt[1]", "empty"),  # which prompt of the list
    ):
        r = httpx.post(url, json={"model": "tiny", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert why in r.json()["error"]["message"], r.text
