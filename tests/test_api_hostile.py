"""The HTTP API against a hostile client, on a real `kvguard serve` over loopback (issue 13).

No input reaches a 5xx: a body that cannot be served answers 4xx with an OpenAI-style error
naming the field, and the client's keep-alive connection stays usable (a 500 that escapes the
app makes uvicorn drop the connection, so the client's next request is reset). OpenAI fields
kvguard does not serve are refused, not ignored; the Alertmanager receiver is bounded and costs
one audit row and one evaluation per alert name; APScheduler's routine lines stay out of the
log. A property test sends arbitrary JSON (unpaired surrogates, huge integers, NaN, nesting,
wrong types) to every route, with and without the token.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.test_server import TOKEN, Daemon, free_port, until

AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON_CT = {"Content-Type": "application/json"}
HUGE = 2**70  # the probe's seed: past int64, where torch's generator overflows
CAP = 4  # max new tokens while this module runs: fuzzed max_tokens stay cheap


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(tmp_path_factory.mktemp("hostile"))
    d.tmp = Path(d.config).parent  # type: ignore[attr-defined]
    assert d.admin("POST", "/admin/actions/cap_max_new_tokens", json={"n": CAP}).status_code == 200
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(daemon: Daemon):
    """One keep-alive connection for a whole test: a reset shows up on the next request."""
    with httpx.Client(base_url=daemon.url, timeout=30) as c:
        yield c


def raw(
    c: httpx.Client, method: str, path: str, body: str | bytes | None, **headers: str
) -> httpx.Response:
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return c.request(method, path, content=data, headers={**JSON_CT, **headers})


def dumps(value: Any) -> str:
    """JSON as a hostile client may write it: NaN, Infinity and lone \\ud800 escapes included
    (Python's json reads and writes them; httpx's own encoder refuses)."""
    return json.dumps(value, allow_nan=True)


def local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def assert_still_connected(c: httpx.Client, before: httpx.Response) -> None:
    """The next request on the same client works, over the same connection unless the server
    said it would close it."""
    after = c.get("/health")
    assert after.status_code == 200
    if before.headers.get("connection", "").lower() != "close":
        assert local_port(after) == local_port(before), "the connection was not kept alive"


def openai_error(r: httpx.Response, status: int | tuple[int, ...], param: str | None) -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param, err
    assert err["message"], err
    return err


def completion(**fields: Any) -> str:
    return dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields})


def chat(messages: Any = None, **fields: Any) -> str:
    msgs = [{"role": "user", "content": "hi"}] if messages is None else messages
    return dumps({"model": "tiny", "messages": msgs, "max_tokens": 2, **fields})


# -- unpaired surrogates, huge integers, non-numbers: 400 naming the field ----------------------
S = "\ud800"
BAD_FIELDS = [
    ("/v1/completions", completion(prompt=S), "prompt"),
    ("/v1/completions", completion(prompt=["a", "b" + S]), "prompt"),
    ("/v1/completions", completion(model=S), "model"),
    ("/v1/completions", completion(stop=[S]), "stop"),
    ("/v1/completions", completion(user=S), "user"),
    ("/v1/completions", completion(**{S: 1}), None),
    ("/v1/chat/completions", chat([{"role": "user", "content": S}]), "messages[0].content"),
    (
        "/v1/chat/completions",
        chat([{"role": "user", "content": [{"type": "text", "text": S}]}]),
        "messages[0].content",
    ),
    ("/v1/chat/completions", chat([{"role": S, "content": "x"}]), "messages[0].role"),
    (
        "/v1/chat/completions",
        chat([{"role": "user", "content": "x", "name": S}]),
        "messages[0].name",
    ),
    ("/v1/chat/completions", chat(stop=S), "stop"),
    ("/v1/completions", completion(seed=HUGE), "seed"),
    ("/v1/completions", completion(seed=-(2**63) - 1), "seed"),
    ("/v1/completions", completion(max_tokens=HUGE), "max_tokens"),
    ("/v1/completions", completion(top_k=HUGE), "top_k"),
    ("/v1/completions", completion(n=HUGE), "n"),
    ("/v1/completions", completion(prompt=[1, HUGE]), "prompt"),
    ("/v1/chat/completions", chat(max_completion_tokens=HUGE), "max_completion_tokens"),
    ("/v1/completions", completion(temperature=float("nan")), "temperature"),
    ("/v1/completions", completion(top_p=float("inf")), "top_p"),
    ("/v1/completions", completion(max_tokens="5"), "max_tokens"),
    ("/v1/completions", completion(max_tokens=5.0), "max_tokens"),
    ("/v1/completions", completion(stream="yes"), "stream"),
    ("/v1/completions", completion(stop=[""]), "stop"),
    (
        "/v1/chat/completions",
        chat([{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        "messages[0].content",
    ),
]


@pytest.mark.parametrize(
    ("path", "stop", "message"),
    [
        (
            "/v1/completions",
            [f"Q{i:07d}Q" for i in range(100_000)],
            "100000 stop strings: at most 64",
        ),
        ("/v1/chat/completions", ["x"] * 65, "65 stop strings: at most 64 are allowed"),
        (
            "/v1/completions",
            ["ok", "x" * 1025],
            "element 1 has 1025 characters: a stop string may have at most 1024",
        ),
        ("/v1/chat/completions", "x" * 5000, "element 0 has 5000 characters"),
    ],
)
def test_too_many_or_too_long_stop_strings_are_a_400_giving_the_limit(
    client: httpx.Client, path: str, stop: str | list[str], message: str
) -> None:
    """Every output token of every choice is checked against each stop string on the engine
    thread: 100,000 of them (n=4) stalled a stream beside it for 5.4 s between two chunks.
    At most 64 stop strings of at most 1024 characters each; the limits themselves pass."""
    make = completion if path == "/v1/completions" else chat
    r = raw(client, "POST", path, make(stop=stop, n=4))
    assert message in openai_error(r, 400, "stop")["message"]
    assert_still_connected(client, r)
    r = raw(client, "POST", path, make(stop=["\u0001" + "x" * 1023] * 64, n=4))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("path", "body", "param"), BAD_FIELDS)
def test_bad_field_answers_400_naming_it_and_keeps_the_connection(
    client: httpx.Client, path: str, body: str, param: str | None
) -> None:
    r = raw(client, "POST", path, body)
    openai_error(r, 400, param)
    assert_still_connected(client, r)


def test_json_decode_error_names_line_and_column(client: httpx.Client) -> None:
    doc = '{"model": "tiny", "prompt": "x" "max_tokens": 2}'
    try:
        json.loads(doc)
    except json.JSONDecodeError as e:
        col = e.colno
    r = raw(client, "POST", "/v1/completions", doc)
    err = openai_error(r, 400, None)
    assert err["message"] == f"invalid JSON at line 1, column {col}: Expecting ',' delimiter"
    multi = '{\n  "model": "tiny",\n  "prompt": "x"\n  "max_tokens": 2\n}'
    err = openai_error(raw(client, "POST", "/v1/completions", multi), 400, None)
    assert err["message"] == "invalid JSON at line 4, column 3: Expecting ',' delimiter"
    assert_still_connected(client, r)


@pytest.mark.parametrize(
    ("body", "content_type", "status", "needle"),
    [
        ("", "application/json", 400, "missing"),
        ("[]", "application/json", 400, "JSON object"),
        ('"x"', "application/json", 400, "JSON object"),
        ("[" * 100_000 + "]" * 100_000, "application/json", 400, "nested too deeply"),
        (b'{"model": "\xff"}', "application/json", 400, "UTF-8"),
        ('{"model": "tiny", "prompt": "x"}', "text/plain", 415, "application/json"),
        ('{"model": "tiny", "prompt": 1' + "0" * 5000 + "}", "application/json", 400, "digits"),
    ],
)
def test_malformed_bodies_answer_4xx(
    client: httpx.Client, body: str | bytes, content_type: str, status: int, needle: str
) -> None:
    r = raw(client, "POST", "/v1/completions", body, **{"Content-Type": content_type})
    err = openai_error(r, status, None)
    assert needle in err["message"]
    assert_still_connected(client, r)


# -- OpenAI fields: served, or refused when they ask for something (or for too much) -----------
REFUSED = [
    # log-probabilities are served, within OpenAI's bounds and not for the prompt
    ("/v1/completions", completion(logprobs=6), "logprobs"),
    ("/v1/completions", completion(logprobs=-1), "logprobs"),
    ("/v1/completions", completion(logprobs=True), "logprobs"),
    ("/v1/completions", completion(logprobs=1, echo=True, stream=True), "logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=1), "logprobs"),
    ("/v1/completions", completion(n=0), "n"),
    ("/v1/completions", completion(best_of=3), "best_of"),
    ("/v1/completions", completion(suffix="}"), "suffix"),
    # penalties and logit bias are served, within OpenAI's bounds
    ("/v1/completions", completion(presence_penalty=2.5), "presence_penalty"),
    ("/v1/completions", completion(frequency_penalty=-3), "frequency_penalty"),
    ("/v1/completions", completion(frequency_penalty="1"), "frequency_penalty"),
    ("/v1/completions", completion(logit_bias={"7": 101}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"seven": 1}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"-7": 1}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"99999999": 1}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias=[7]), "logit_bias"),
    ("/v1/completions", completion(max_token=5), "max_token"),
    (
        "/v1/completions",
        completion(stream_options={"include_usage": True, "x": 1}),
        "stream_options",
    ),
    # stream options without a stream: OpenAI refuses them too ("only allowed when stream")
    ("/v1/completions", completion(stream_options={"include_usage": True}), "stream_options"),
    (
        "/v1/chat/completions",
        chat(stream=False, stream_options={"include_usage": True}),
        "stream_options",
    ),
    ("/v1/chat/completions", chat(stream=None, stream_options={}), "stream_options"),
    ("/v1/chat/completions", chat(n=33), "n"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema"}), "response_format"),
    (
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2),
        "tools",
    ),
    ("/v1/chat/completions", chat(tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", chat(modalities=["text", "audio"]), "modalities"),
    ("/v1/chat/completions", chat(echo=True), "echo"),
    (
        "/v1/chat/completions",
        chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        chat([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]),
        "messages[0].tool_calls[0].type",
    ),
    ("/v1/chat/completions", chat([{"role": "user", "content": None}]), "messages[0]"),
    ("/v1/chat/completions", chat([{"role": "assistant"}]), "messages[0]"),
]


def test_oversized_bodies_and_prompts_are_refused_without_reading_them_whole(
    client: httpx.Client,
) -> None:
    """A body over api.max_request_bytes answers 413 naming the limit; a text prompt of
    megabytes (under it) is refused as too long after tokenizing a bounded prefix of it, and
    /tokenize bounds its count the same way: none of them holds the engine thread for the
    seconds a whole tokenization of megabytes takes."""
    r = raw(client, "POST", "/v1/completions", b"x" * (17 << 20))
    err = openai_error(r, 413, None)
    assert f"{16 << 20} bytes" in err["message"]
    huge = "hello world " * 1_000_000  # 12 MB, two million tokens
    r = raw(client, "POST", "/v1/completions", completion(prompt=huge))
    err = openai_error(r, 400, "prompt")
    assert re.search(r"prompt of more than \d+ tokens", err["message"]), err
    r = raw(client, "POST", "/tokenize", dumps({"model": "tiny", "prompt": huge}))
    err = openai_error(r, 400, "prompt")
    assert "tokens (8x max_model_len=" in err["message"], err
    r = raw(client, "POST", "/tokenize", dumps({"model": "tiny", "prompt": "hi " * 100}))
    assert r.status_code == 200 and r.json()["count"] >= 100
    assert_still_connected(client, r)


def test_a_chunked_body_over_the_limit_is_refused_as_one_with_a_length(
    client: httpx.Client,
) -> None:
    """A body sent in chunks (no Content-Length) that runs past api.max_request_bytes answers
    kvguard's 413, as one whose Content-Length says so does, not Starlette's bare "Content
    Too Large" with no code."""

    def chunks() -> Iterator[bytes]:
        for _ in range(17):
            yield b"x" * (1 << 20)

    r = client.post("/v1/completions", content=chunks(), headers=JSON_CT)
    assert "content-length" not in r.request.headers
    err = openai_error(r, 413, None)
    assert err["code"] == "body_too_large", err
    assert f"{16 << 20} bytes" in err["message"], err
    assert_still_connected(client, r)


HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("path", "body", "param", "code", "message"),
    [
        (  # more entries than the tiny model's tokenizer has tokens (259; the model 320 rows)
            "/v1/completions",
            completion(logit_bias={str(i): 1 for i in range(260)}),
            "logit_bias",
            None,
            "logit_bias has 260 entries: at most 259, one per token id of the vocabulary",
        ),
        (  # each message renders to a token at least: 512 of them fill max_model_len
            "/v1/chat/completions",
            chat([HI] * 512),
            "messages",
            "context_length_exceeded",
            "512 messages are a prompt of at least 512 tokens",
        ),
        (
            "/tokenize",
            dumps({"model": "tiny", "messages": [HI] * 4097}),
            "messages",
            None,
            "more than 4096 tokens (8x max_model_len=512)",
        ),
        (
            "/v1/completions",
            completion(prompt=["hi"] * 257),
            "prompt",
            None,
            "257 prompts x n=1 choices: at most 256 sequences per request",
        ),
        (
            "/v1/completions",
            completion(prompt=[5] * 512),
            "prompt",
            "context_length_exceeded",
            "prompt of 512 tokens leaves no room to generate within max_model_len=512",
        ),
        (
            "/v1/completions",
            completion(prompt=[[5], [5] * 600]),
            "prompt[1]",
            "context_length_exceeded",
            "prompt[1] of 600 tokens",
        ),
    ],
)
def test_too_many_elements_are_refused_by_their_count(
    client: httpx.Client, path: str, body: str, param: str, code: str | None, message: str
) -> None:
    """What no request can be served with is refused by counting, before each element is
    checked: a logit_bias with more entries than the vocabulary, more messages than a prompt
    may have tokens, more prompts than a request's sequences, a token-id prompt too long."""
    err = openai_error(raw(client, "POST", path, body), 400, param)
    assert err["code"] == code and message in err["message"], err
    if param == "logit_bias":  # a bias on every token of the vocabulary is served
        every = completion(logit_bias={str(i): 0 for i in range(259)})
        assert raw(client, "POST", path, every).status_code == 200


def test_a_seeded_requests_choices_are_not_validated_again_on_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Choice i of a seeded request draws with seed + i: its parameters are a copy, which the
    engine validates when it takes the choice in. Made with dataclasses.replace they were
    validated on the event loop too, every logit_bias entry each time (0.7 s for 32 choices
    biasing every token of a 49k vocabulary)."""
    from kvguard.daemon.openai_api import _choice_params
    from kvguard.engine.sampling_params import SamplingParams

    params = SamplingParams(seed=7, logit_bias={t: 1.0 for t in range(1000)})
    checked: list[SamplingParams] = []

    def validate(self: SamplingParams) -> None:
        checked.append(self)

    monkeypatch.setattr(SamplingParams, "validate", validate)
    choices = [_choice_params(params, i) for i in range(32)]
    assert [c.seed for c in choices] == list(range(7, 39)) and params.seed == 7
    assert all(c.logit_bias is params.logit_bias for c in choices) and not checked


def test_a_large_body_is_answered_as_a_small_one(client: httpx.Client) -> None:
    """A body over LARGE_BODY_BYTES is parsed and checked off the event loop, with the same
    answers: served, invalid JSON named by line and column, a bad field named."""
    from kvguard.daemon.openai_api import LARGE_BODY_BYTES

    user = "u" * LARGE_BODY_BYTES  # a free-form string: metadata is bounded (16 pairs)
    body = completion(user=user)
    assert len(body) > LARGE_BODY_BYTES
    r = raw(client, "POST", "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    r = raw(client, "POST", "/v1/chat/completions", chat(user=user, stream=True))
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    broken = body.replace('"prompt": "hi", ', '"prompt": "hi" ')
    try:
        json.loads(broken)
    except json.JSONDecodeError as e:
        where = f"line 1, column {e.colno}: Expecting ',' delimiter"
    err = openai_error(raw(client, "POST", "/v1/completions", broken), 400, None)
    assert err["message"] == f"invalid JSON at {where}", err
    bad = completion(user=user, logit_bias={"5": "x"})
    err = openai_error(raw(client, "POST", "/v1/completions", bad), 400, "logit_bias.5")
    assert "valid number" in err["message"], err
    assert_still_connected(client, r)


@pytest.mark.parametrize(
    ("path", "metadata", "message"),
    [
        ("/v1/completions", {f"k{i}": "v" for i in range(17)}, "17 pairs: at most 16"),
        ("/v1/chat/completions", {"k" * 65: "v"}, "a key has 65 characters: a key may have "
         "at most 64"),
        ("/v1/completions", {"k": "v" * 513}, "a value has 513 characters: a value may have "
         "at most 512"),
        ("/v1/chat/completions", {"k": 7}, "expected string keys and values"),
        ("/v1/completions", {"k": "v" + S}, "unpaired UTF-16 surrogate"),
        # a million pairs (13 MiB), counted before any is checked (made in the test)
        ("/v1/completions", None, "1000000 pairs: at most 16"),
    ],
)  # fmt: skip
def test_metadata_is_bounded_as_openai_bounds_it(
    client: httpx.Client, path: str, metadata: dict[str, Any] | None, message: str
) -> None:
    """metadata is accepted and not used: at most 16 pairs, keys of at most 64 characters,
    string values of at most 512 (OpenAI's limits), a 400 naming it otherwise. Any number of
    pairs was accepted, each checked (500k pairs, 8 MB: 0.75 s of parsing for nothing). The
    limits themselves pass, on both endpoints."""
    make = completion if path == "/v1/completions" else chat
    if metadata is None:
        metadata = {f"{i}": "" for i in range(1_000_000)}
    err = openai_error(raw(client, "POST", path, make(metadata=metadata)), 400, "metadata")
    assert message in err["message"], err
    full = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    for path, make in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        r = raw(client, "POST", path, make(metadata=full))
        assert r.status_code == 200, r.text
    assert_still_connected(client, r)


def test_detokenize_takes_as_many_ids_as_tokenize_gives(client: httpx.Client) -> None:
    """/detokenize took any number of ids (5M, 3 s of decoding to answer); now at most 8x
    max_model_len (512 here), as many as /tokenize counts, a 400 naming `tokens` beyond,
    refused by counting them."""
    for n in (4097, 5_000_000):
        r = raw(client, "POST", "/detokenize", dumps({"model": "tiny", "tokens": [5] * n}))
        message = openai_error(r, 400, "tokens")["message"]
        assert f"{n} token ids: /detokenize takes at most 4096 (8x max_model_len=512" in message
    r = raw(client, "POST", "/detokenize", dumps({"model": "tiny", "tokens": [5] * 4096}))
    assert r.status_code == 200 and r.json()["prompt"], r.text
    assert_still_connected(client, r)


def test_n32_choices_biasing_every_token_are_served(client: httpx.Client) -> None:
    """A seeded request of 32 choices with a logit_bias on every token of the tokenizer (its
    choices share the checked, read-only bias): every choice is the one token biased up."""
    ids = client.post("/tokenize", json={"model": "tiny", "prompt": "a",
                                         "add_special_tokens": False}).json()["tokens"]  # fmt: skip
    bias = {str(t): -100 for t in range(259)} | {str(ids[0]): 100}
    body = completion(n=32, seed=5, temperature=1.0, ignore_eos=True, logit_bias=bias)
    r = raw(client, "POST", "/v1/completions", body)
    assert r.status_code == 200, r.text
    want = client.post("/detokenize", json={"model": "tiny", "tokens": [ids[0]] * 2}).json()
    assert [c["text"] for c in r.json()["choices"]] == [want["prompt"]] * 32, r.text


def test_a_body_of_megabytes_does_not_stall_the_daemon(daemon: Daemon) -> None:
    """Parsing and checking a request body ran on the event loop: a body of 450k chat messages
    (15 MiB) held /health, and every stream being served, for 4 s and more before its 400
    (two of them: twice that). Now the messages are counted before they are checked (a
    prompt has at most max_model_len tokens, each message one at least), and a large body
    is parsed off the event loop, one at a time: /health answers meanwhile within a tenth of
    a second here, well inside the 2 s bound (the JSON decoder, which holds the interpreter
    while it runs, takes a few tenths of a second for such a body on a busy machine)."""
    body = chat([HI] * 450_000).encode()
    assert 15 << 20 < len(body) < 16 << 20  # under api.max_request_bytes
    waits: list[float] = []
    posting = threading.Event()
    answers: list[httpx.Response] = []

    def health() -> None:
        with httpx.Client(base_url=daemon.url, timeout=120) as c:
            while posting.is_set():
                t = time.monotonic()
                c.get("/health").raise_for_status()
                waits.append(time.monotonic() - t)

    def post() -> None:
        with httpx.Client(base_url=daemon.url, timeout=120) as c:
            answers.append(c.post("/v1/chat/completions", content=body, headers=JSON_CT))

    posting.set()
    poller = threading.Thread(target=health)
    poller.start()
    posts = [threading.Thread(target=post) for _ in range(2)]
    for t in posts:
        t.start()
    for t in posts:
        t.join(120)
    posting.clear()
    poller.join(120)
    for r in answers:
        err = openai_error(r, 400, "messages")
        assert err["code"] == "context_length_exceeded", err
    assert len(answers) == 2 and waits, (answers, waits)
    assert max(waits) < 2.0, max(waits)


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
def test_unserved_openai_fields_are_refused_naming_them(
    client: httpx.Client, path: str, body: str, param: str
) -> None:
    err = openai_error(raw(client, "POST", path, body), 400, param)
    assert param.split("[")[0] in err["message"]
    # every placeholder of the message filled in (a format spec like {key!r} is left as is)
    assert not re.search(r"\{\w+(![rsa])?(:[^}]*)?\}", err["message"]), err["message"]


def test_unserved_fields_at_their_do_nothing_value_are_accepted(client: httpx.Client) -> None:
    quiet = {"logprobs": None, "n": 1, "best_of": 1, "suffix": None, "presence_penalty": 0}
    quiet |= {"frequency_penalty": 0.0, "logit_bias": {}, "user": "u", "echo": False}
    r = raw(client, "POST", "/v1/completions", completion(**quiet))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    quiet_chat = {"logprobs": False, "top_logprobs": 0, "tool_choice": "none"}
    quiet_chat |= {"response_format": {"type": "text"}, "functions": []}
    msgs = [
        {"role": "system", "content": "be brief", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None},
        {"role": "user", "content": "again"},
    ]
    r = raw(client, "POST", "/v1/chat/completions", chat(msgs, **quiet_chat))
    assert r.status_code == 200, r.text


def test_echo_puts_the_prompt_before_the_completion(client: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "Echo me", "max_tokens": 3, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["text"] == "Echo me" + plain
    with client.stream("POST", "/v1/completions", json={**body, "echo": True, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Echo me" + plain
    ids = client.post("/v1/completions", json={**body, "prompt": [69, 99, 104, 111]}).json()
    by_ids = client.post(
        "/v1/completions", json={**body, "prompt": [69, 99, 104, 111], "echo": True}
    ).json()
    text = by_ids["choices"][0]["text"]
    assert text.endswith(ids["choices"][0]["text"]) and len(text) > len(ids["choices"][0]["text"])


def test_denormal_temperature_and_top_p_are_served(client: httpx.Client) -> None:
    """1e-320 is a valid JSON number: dividing fp32 logits by it gave inf, NaN probabilities,
    and an engine step that failed again on every retry, stalling every request."""
    for fields in ({"temperature": 1e-320}, {"temperature": 1.0, "top_p": 1e-320, "seed": 1}):
        r = raw(client, "POST", "/v1/completions", completion(**fields))
        assert r.status_code == 200, r.text
    assert (
        client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}
        ).status_code
        == 200
    )


def test_the_body_priority_takes_any_case_as_the_header_does(client: httpx.Client) -> None:
    """`X-Priority: LOW` was served as low while a body's `"priority": "High"` was a 400."""
    for path, body in (
        ("/v1/completions", completion(priority="High")),
        ("/v1/chat/completions", chat(priority="HIGH")),
    ):
        r = raw(client, "POST", path, body)
        assert r.status_code == 200, r.text
        assert r.json()["kvguard"]["priority"] == "high"
    r = raw(client, "POST", "/v1/completions", completion(priority="Low"))
    assert r.status_code == 200 and r.json()["kvguard"]["priority"] == "low", r.text
    openai_error(
        raw(client, "POST", "/v1/completions", completion(priority="urgent")), 400, "priority"
    )


# -- a KV pool of 11 blocks: a prompt's length against its priority's share ---------------------
@pytest.fixture(scope="module")
def small_pool(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with 88 KiB of KV: 11 blocks of 16 tokens (176 tokens), 9 blocks (144
    tokens) outside the 10% high-priority reserve."""
    d = Daemon(
        tmp_path_factory.mktemp("small_pool"),
        serving="{model: tiny, kv_cache_bytes: 88KiB, max_model_len: 512}",
    )
    with httpx.Client(base_url=d.url, timeout=60) as c:
        r = c.post("/tokenize", json={"model": "tiny", "prompt": "x"})
        assert r.json()["max_model_len"] == 176, r.text
        yield c
    assert d.stop() == 0


def test_a_prompt_past_its_prioritys_share_is_too_long_for_the_context(
    small_pool: httpx.Client,
) -> None:
    """A normal 150-token prompt fits the pool (a high one is served) but not the share outside
    the high-priority reserve: 400 context_length_exceeded naming `prompt` (`messages` on chat),
    as a longer prompt is, saying high priority would hold it, not a bare admission_rejected."""
    c = small_pool
    ids = [3 + i for i in range(150)]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 4}
    err = openai_error(c.post("/v1/completions", json=body), 400, "prompt")
    assert err["code"] == "context_length_exceeded", err
    assert "9 blocks that normal priority may use" in err["message"], err
    assert "high priority may use 11 blocks, which hold it" in err["message"], err
    r = c.post("/v1/completions", json={**body, "priority": "high"})
    assert r.status_code == 200, r.text

    # chat: a message that renders to a prompt of 150 tokens (past 9 blocks, within 10)
    def rendered(content: str) -> int:
        msgs = [{"role": "user", "content": content}]
        return c.post("/tokenize", json={"model": "tiny", "messages": msgs}).json()["count"]

    msgs = [{"role": "user", "content": "a" * (150 - rendered(""))}]
    count = rendered(msgs[0]["content"])
    assert 144 < count < 160, count
    r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 4})
    err = openai_error(r, 400, "messages")
    assert err["code"] == "context_length_exceeded", err


def test_a_max_tokens_past_the_kv_names_its_field_with_shortening_off(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """With admission_control.dynamic_max_tokens off, an answer that can never fit the KV its
    priority may use is refused, not shortened: 400 admission_rejected naming the field that
    asked for it (`max_tokens`, or chat's `max_completion_tokens`), not a bare null param."""
    d = Daemon(
        tmp_path_factory.mktemp("no_shortening"),
        serving="{model: tiny, kv_cache_bytes: 88KiB, max_model_len: 512}",
        extra="admission_control: {dynamic_max_tokens: false}\n",
    )
    try:
        with httpx.Client(base_url=d.url, timeout=60) as c:
            body = {"model": "tiny", "prompt": [3 + i for i in range(64)], "max_tokens": 100}
            err = openai_error(c.post("/v1/completions", json=body), 400, "max_tokens")
            assert err["code"] == "admission_rejected" and "max_tokens=" in err["message"], err
            msgs = [{"role": "user", "content": "hello"}]
            for field in ("max_tokens", "max_completion_tokens"):
                chat = {"model": "tiny", "messages": msgs, field: 150}
                err = openai_error(c.post("/v1/chat/completions", json=chat), 400, field)
                assert err["code"] == "admission_rejected", err
            ok = c.post("/v1/completions", json={**body, "max_tokens": 8})
            assert ok.status_code == 200, ok.text
    finally:
        assert d.stop() == 0


def test_a_request_that_fits_an_idle_pool_is_served_whole(small_pool: httpx.Client) -> None:
    """High priority, 150 prompt tokens and max_tokens 16 on the idle 176-token pool: 16 tokens,
    not truncated (the safety factor on the prompt too cut the answer to 3)."""
    body = {"model": "tiny", "prompt": [3 + i for i in range(150)], "max_tokens": 16}
    r = small_pool.post("/v1/completions", json={**body, "ignore_eos": True, "priority": "high"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 16 and out["kvguard"]["truncated"] is False, out


def test_sampler_never_draws_from_nan() -> None:
    from kvguard.engine.sampler import sample
    from kvguard.engine.sampling_params import SamplingParams

    logits = torch.tensor([[3.0, 1.0, -2.0, 0.5]])
    for p in (SamplingParams(temperature=1e-320), SamplingParams(temperature=1.0, top_p=1e-320)):
        gen = torch.Generator().manual_seed(0)
        assert sample(logits, [p], [gen]) == [0]


# -- Alertmanager --------------------------------------------------------------------------------
def alert(name: str, i: int, status: str = "firing", **labels: str) -> dict[str, Any]:
    return {
        "status": status,
        "labels": {"alertname": name, **labels},
        "startsAt": "2026-12-01T10:00:00Z",
        "fingerprint": f"{name}-{i}",
    }


def am(client: httpx.Client, alerts: Any, **payload: Any) -> httpx.Response:
    body = {"version": "4", "status": "firing", "alerts": alerts, **payload}
    return raw(client, "POST", "/alertmanager", dumps(body), **AUTH)


@pytest.mark.parametrize(
    ("alerts", "param"),
    [
        ([{"labels": ["a"]}], "alerts[0].labels"),
        ([alert("A", 0), {"labels": "GPUNearOOM"}], "alerts[1].labels"),
        ([{"labels": {"alertname": {"x": 1}}}], "alerts[0].labels.alertname"),
        ([{"labels": {"alertname": S}}], "alerts[0].labels.alertname"),
        ([{"labels": {"alertname": "A", S: "x"}}], "alerts[0].labels"),
        ([{"labels": {}}], "alerts[0].labels.alertname"),
        ([{**alert("A", 0), "status": "gone"}], "alerts[0].status"),
        ([{**alert("A", 0), "fingerprint": 7}], "alerts[0].fingerprint"),
        ([7], "alerts[0]"),
        ({"a": 1}, "alerts"),
    ],
)
def test_alertmanager_refuses_malformed_alerts_naming_them(
    client: httpx.Client, alerts: Any, param: str
) -> None:
    r = am(client, alerts)
    openai_error(r, 400, param)
    assert_still_connected(client, r)


def test_alertmanager_bounds_alerts_per_request(client: httpx.Client, daemon: Daemon) -> None:
    many = [alert("Flood", i) for i in range(5000)]
    r = am(client, many)
    err = openai_error(r, 413, "alerts")
    assert "100" in err["message"] and "max_alerts" in err["message"]
    r = am(client, many[:101])
    openai_error(r, 413, "alerts")
    big = [alert("Big", 0, note="x" * (1 << 20))]
    r = am(client, big)
    err = openai_error(r, 413, None)
    assert "1048576 bytes" in err["message"]
    assert_still_connected(client, r)


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return con.execute(sql).fetchall()


def evaluations(c: httpx.Client) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("kvguard_rule_evaluations_total "):
            return float(line.split()[1])
    raise AssertionError("no kvguard_rule_evaluations_total")


def test_alertmanager_costs_one_row_and_one_evaluation_per_name(
    client: httpx.Client, daemon: Daemon
) -> None:
    """100 unique alerts of 3 names: 3 audit rows with their counts, not 100; one evaluation
    for the request, not 100."""
    before = evaluations(client)
    alerts = [alert(f"Burst{i % 3}", i) for i in range(99)] + [alert("Burst0", 99, "resolved")]
    r = am(client, alerts)
    assert r.json() == {"accepted": 100, "duplicates": 0, "other_instance": 0}
    db = daemon.tmp / "audit.db"  # type: ignore[attr-defined]
    query = "SELECT kind, detail, data FROM events WHERE detail LIKE 'Burst%' ORDER BY id"
    until(lambda: len(rows(db, query)) >= 4, 30, "the burst's audit rows")
    time.sleep(1.0)  # would-be extra rows land within the audit writer's next flush
    got = rows(db, query)
    assert len(got) == 4, got
    counts = {(k, d.split(" ")[0]): json.loads(data)["count"] for k, d, data in got}
    assert counts == {
        ("alert_received", "Burst0"): 33,
        ("alert_received", "Burst1"): 33,
        ("alert_received", "Burst2"): 33,
        ("alert_resolved", "Burst0"): 1,
    }
    until(lambda: evaluations(client) > before, 30, "the burst's evaluation")
    time.sleep(0.5)
    # the request's one job, and perhaps the 5 s rule tick: never one per alert
    assert evaluations(client) - before <= 3
    again = am(client, alerts)
    assert again.json() == {"accepted": 0, "duplicates": 100, "other_instance": 0}


def test_apscheduler_routine_lines_stay_out_of_the_log(
    client: httpx.Client, daemon: Daemon
) -> None:
    """An alert schedules a job: APScheduler logs adding, running and removing it at INFO,
    as it does for the rule tick every 5 s, which buried kvguard's own lines."""
    before = evaluations(client)
    assert am(client, [alert("LogQuiet", 0)]).json()["accepted"] == 1
    until(lambda: evaluations(client) > before, 30, "the alert's evaluation")
    log = (daemon.tmp / "daemon.log").read_text()  # type: ignore[attr-defined]
    assert "kvguard.control: rules:" in log  # the daemon's own INFO lines are there
    assert "INFO apscheduler" not in log


def test_apscheduler_is_quiet_unless_debugging() -> None:
    import logging

    from kvguard.daemon.logging_setup import configure_logging

    root, aps = logging.getLogger(), logging.getLogger("apscheduler")
    saved = root.level, aps.level
    try:
        assert configure_logging("INFO") == logging.INFO
        assert aps.getEffectiveLevel() == logging.WARNING
        assert configure_logging("DEBUG") == logging.DEBUG
        assert aps.getEffectiveLevel() == logging.DEBUG
    finally:
        root.setLevel(saved[0])
        aps.setLevel(saved[1])


def test_alembics_routine_lines_are_dropped_unless_debugging() -> None:
    """alembic names the audit database's dialect at INFO at every start (two lines); those
    are dropped, its lines saying the schema changed are not, and at DEBUG nothing is."""
    import logging

    from kvguard.daemon.logging_setup import configure_logging

    root, mig = logging.getLogger(), logging.getLogger("alembic.runtime.migration")

    def passes(msg: str) -> bool:
        return bool(mig.filter(mig.makeRecord(mig.name, logging.INFO, "x", 1, msg, ("a",), None)))

    saved = root.level
    try:
        configure_logging("INFO")
        assert not passes("Context impl %s.") and not passes("Will assume %s DDL.")
        assert passes("Running upgrade %s")
        configure_logging("DEBUG")
        assert passes("Context impl %s.")
    finally:
        root.setLevel(saved)


@pytest.mark.parametrize(
    ("value", "level"),
    [
        ("DEBUG", 10),
        ("debug", 10),
        (" Warning ", 30),
        ("warn", 30),
        ("10", 10),
        ("40", 40),
        ("", 20),
    ],
)
def test_the_log_level_takes_a_name_in_any_case_or_a_number(
    value: str, level: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvguard.engine.log_level import log_level

    monkeypatch.setenv("KVGUARD_LOG_LEVEL", value)
    assert log_level() == level


def test_a_log_level_no_one_knows_is_info_and_said() -> None:
    """`KVGUARD_LOG_LEVEL=DEBGU` (or `verbose`) logged at INFO and nothing said why DEBUG
    lines never came: the process says so on stderr (the journal) before its log starts."""
    import os
    import subprocess
    import sys

    script = (
        "from kvguard.daemon.logging_setup import configure_logging\nprint(configure_logging())"
    )
    for value in ("DEBGU", "verbose", "-5"):
        res = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "KVGUARD_LOG_LEVEL": value},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0 and res.stdout.strip() == "20", res
        assert f"KVGUARD_LOG_LEVEL={value!r} is not a level name" in res.stderr, res
        assert "logging at INFO" in res.stderr, res


# -- the net under it all: an unexpected exception is a JSON 500 and the connection lives --------
def test_unexpected_exception_is_a_logged_json_500_on_a_live_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvguard.daemon.app import create_app

    class Counter:
        def labels(self, *_: str) -> Counter:
            return self

        def inc(self) -> None:
            pass

    service = SimpleNamespace(
        cfg=SimpleNamespace(api=SimpleNamespace(debug_hooks=False, max_request_bytes=1 << 20)),
        metrics=SimpleNamespace(http=Counter()),
        draining=False,  # the answers the drain waits for are counted till it begins
    )
    app = create_app(service)  # type: ignore[arg-type]

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug, not an input")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started, 10, "the test server")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            r = c.get("/boom")
            assert r.status_code == 500
            assert r.json()["error"]["type"] == "server_error"
            assert_still_connected(c, r)
    finally:
        server.should_exit = True
        thread.join(10)
    assert any("a bug, not an input" in (r.exc_text or "") for r in caplog.records)


# -- property: arbitrary JSON on every route ------------------------------------------------------
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
PLAIN_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
# st.text never holds a lone surrogate; JSON's "\ud800" escape does, and Python decodes it
BROKEN_TEXT = st.tuples(st.text(max_size=4), SURROGATE, st.text(max_size=4)).map("".join)
TEXT = st.one_of(PLAIN_TEXT, BROKEN_TEXT, st.just(""))
HUGE_INTS = st.sampled_from(
    [2**31, 2**63 - 1, 2**63, 2**64, HUGE, -(2**63) - 1, -(2**70), 10**30, 10**300]
)
INTS = st.one_of(st.integers(-1000, 1000), HUGE_INTS)
ODD_FLOATS = st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), 1e-320, 5e-324, 1e308, -0.0, 1e-30]
)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), ODD_FLOATS)
SCALAR = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON = st.recursive(
    SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=10,
)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", "bot"]) | TEXT
PART = st.fixed_dictionaries({"type": st.just("text") | TEXT, "text": TEXT | JSON})
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": st.one_of(TEXT, TEXT, JSON, st.lists(PART | JSON, max_size=2)),
        "name": TEXT | JSON,
        "tool_calls": JSON,
    },
)
COMPLETION_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
    "stream_options", "stop", "seed", "user", "ignore_eos", "priority", "echo", "logprobs",
    "best_of", "suffix", "presence_penalty", "frequency_penalty", "logit_bias",
]  # fmt: skip
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "echo", "best_of", "suffix")]
CHAT_FIELDS += ["messages", "max_completion_tokens", "top_logprobs", "tools", "response_format"]
PLAUSIBLE = st.one_of(  # values of the right type, often in range: they reach the engine
    st.integers(0, 8),
    st.floats(0, 2),
    st.booleans(),
    PLAIN_TEXT,
    st.lists(st.integers(0, 330), min_size=1, max_size=6),
    st.lists(PLAIN_TEXT, max_size=3),
    st.lists(MESSAGE, min_size=1, max_size=3),
    st.sampled_from(["tiny", "high", "low", {"include_usage": True}, [], {}, None]),
)
HOSTILE = st.one_of(  # each kind of value the probe found a crash with, then anything
    BROKEN_TEXT,
    st.lists(BROKEN_TEXT, min_size=1, max_size=2),
    HUGE_INTS,
    st.lists(HUGE_INTS, min_size=1, max_size=2),
    ODD_FLOATS,
    JSON,
)
VALUES = st.one_of(HOSTILE, PLAUSIBLE)


def near_valid(base: dict[str, Any], fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """A body that is valid but for a few fields: the hostile values reach the engine."""
    return st.builds(
        lambda extra, drop: {**{k: v for k, v in base.items() if k not in drop}, **extra},
        st.dictionaries(st.sampled_from(fields) | TEXT, VALUES, min_size=1, max_size=3),
        st.sets(st.sampled_from(sorted(base)), max_size=1),
    )


COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LABELS = st.one_of(
    st.dictionaries(st.sampled_from(["alertname", "instance"]) | TEXT, TEXT, max_size=3),
    st.dictionaries(TEXT, JSON, min_size=1, max_size=3),
    st.lists(JSON, min_size=1, max_size=2),
    JSON,
)
ALERT = st.fixed_dictionaries(
    {"labels": LABELS},
    optional={
        "status": st.sampled_from(["firing", "resolved"]) | JSON,
        "fingerprint": TEXT | JSON,
        "startsAt": TEXT | JSON,
    },
)
ALERTS = st.fixed_dictionaries(
    {"version": st.just("4") | JSON, "alerts": st.lists(ALERT | JSON, max_size=4) | JSON}
)
RAW = st.one_of(
    st.binary(max_size=32),
    st.sampled_from(
        [b"", b"{", b'{"model": "tiny",}', b"NaN", b"[" * 5000, b'{"a": 1' + b"0" * 5000 + b"}"]
    ),
    st.integers(1, 3000).map(lambda n: ("[" * n + "]" * n).encode()),
    st.integers(1, 3000).map(lambda n: ('{"a":' * n + "1" + "}" * n).encode()),
)
ACTIONS = st.sampled_from(
    ["reduce_batch", "restore_batch", "set_max_num_seqs", "evict_lowest_priority",
     "enable_fp8_kv", "disable_fp8_kv", "cap_max_new_tokens", "halt_admission",
     "resume_admission", "handle_oom", "nope", "%00", "%ED%A0%80", "a%2Fb", "."]
)  # fmt: skip
TOKENS = st.sampled_from(  # mostly the right one, so that admin bodies get read
    [f"Bearer {TOKEN}"] * 4 + ["", "Bearer wrong", "Basic eA==", "Bearer"]
)
TYPES = st.sampled_from(  # mostly JSON, so that bodies get parsed
    ["application/json"] * 6 + ["", "text/plain", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", "application/vnd.kvguard+json", "application/json; charset=utf-16"]
)  # fmt: skip


def body_for(path: str) -> st.SearchStrategy[str | bytes]:
    """Mostly bodies close to valid ones, then any JSON value, then bytes that are not JSON."""
    if path == "/v1/completions":
        near = near_valid(COMPLETION, COMPLETION_FIELDS)
    elif path == "/v1/chat/completions":
        near = near_valid(CHAT, CHAT_FIELDS)
    elif path == "/alertmanager":
        near = ALERTS
    else:
        near = JSON
    return st.one_of(near.map(dumps), near.map(dumps), near.map(dumps), JSON.map(dumps), RAW)


ROUTES = [
    ("POST", "/v1/completions", 80),
    ("POST", "/v1/chat/completions", 80),
    ("GET", "/v1/models", 10),
    ("GET", "/health", 10),
    ("GET", "/ready", 10),
    ("GET", "/metrics", 10),
    ("POST", "/alertmanager", 40),
    ("GET", "/admin/state", 10),
    ("GET", "/admin/actions", 10),
    ("POST", "/admin/actions/{action}", 40),
    ("POST", "/admin/reload", 10),
    ("POST", "/admin/debug/stall", 15),
    ("POST", "/admin/debug/release", 5),
    ("POST", "/admin/debug/inject_oom", 15),
    ("POST", "/admin/debug/fail_rank", 15),
    ("DELETE", "/v1/completions", 5),
    ("POST", "/v1/nothing/here", 5),
]
CHANGES_STATE = ("/admin/actions/", "/admin/reload")
# The probe's findings (issue 13), always tried first: random search need not meet them.
PROBE_FINDINGS = {
    "/v1/completions": [completion(prompt=S), completion(seed=HUGE), completion(top_p=1e-320)],
    "/v1/chat/completions": [chat([{"role": "user", "content": S}]), chat(temperature=1e-320)],
    "/alertmanager": [dumps({"alerts": [{"labels": ["GPUNearOOM"]}]})],
    "/admin/actions/{action}": [dumps({"n": S}), dumps({"n": HUGE}), dumps({"n": float("nan")})],
}


def example_bodies(path: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """@example for each of the probe's findings on `path`, sent with the token."""

    def add(test: Callable[..., None]) -> Callable[..., None]:
        for body in PROBE_FINDINGS.get(path, []):
            test = example(
                body=body,
                token=f"Bearer {TOKEN}",
                content_type="application/json",
                action="cap_max_new_tokens",
            )(test)
        return test

    return add


def restore(c: httpx.Client) -> None:
    """Undo what a fuzzed admin call applied, so that later examples meet the same daemon: an
    admission halt would make every later completion a (legitimate) 503."""
    for action, params in (
        ("resume_admission", None),
        ("restore_batch", None),
        ("disable_fp8_kv", None),
        ("cap_max_new_tokens", {"n": CAP}),
    ):
        c.post(f"/admin/actions/{action}", json=params, headers=AUTH)


@pytest.mark.parametrize(
    ("method", "path", "examples"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES]
)
def test_no_input_reaches_a_server_error(
    client: httpx.Client, method: str, path: str, examples: int
) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        body=body_for(path),
        token=TOKENS,
        content_type=TYPES,
        action=ACTIONS,
    )
    @example_bodies(path)
    def check(body: str | bytes, token: str, content_type: str, action: str) -> None:
        target = path.replace("{action}", action)
        if "/debug/" in target and token.endswith(TOKEN):
            # Valid hook bodies stall the engine, fake an OOM or end the daemon (fail_rank):
            # the hooks' refusals are in tests/test_admin_bounds.py. Here they are reached
            # without a usable token.
            token = "Bearer wrong"
        headers = {"Authorization": token} if token else {}
        if content_type:
            headers["Content-Type"] = content_type
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        r = client.request(method, target, content=data, headers=headers)
        assert r.status_code < 500, (
            f"{method} {target} {data[:200]!r} -> {r.status_code}: {r.text[:300]}"
        )
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
        assert_still_connected(client, r)
        if r.is_success and token.endswith(TOKEN) and target.startswith(CHANGES_STATE):
            restore(client)

    check()
