"""The openai client's own helpers against kvguard, as an agent uses them: the message that
`chat.completions.parse()` and the stream helper hand back, sent back as the next turn's
history as it is; the error a route kvguard does not serve answers; and the request id every
answer carries (`with_raw_response`, an error's)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_server import Daemon
from tests.test_tools import ASK, daemon  # noqa: F401 - daemon: the tiny model, 2048 tokens


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=20)


TOOLS = [openai.pydantic_function_tool(GetWeather)]
# one call, forced: 20 characters of any script (a few byte tokens each) and the call's frame
FIRST_TURN = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
              "max_tokens": 240, "temperature": 0}  # fmt: skip


def _client(d: Daemon, sent: list[dict[str, Any]]) -> openai.OpenAI:
    """The real client, each request body it sends kept in `sent`."""

    def keep(request: httpx.Request) -> None:
        sent.append(json.loads(request.read() or b"null"))

    http = httpx.Client(event_hooks={"request": [keep]}, timeout=60)
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, http_client=http)


def _second_turn(c: openai.OpenAI, message: Any) -> Any:
    """The function-calling guide's loop: the assistant message appended as the client gave
    it, a result for each of its calls, the next request."""
    results = [{"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}
               for call in message.tool_calls]  # fmt: skip
    history = [*ASK, message, *results]
    return c.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )


def test_a_parsed_message_is_taken_back_as_the_next_turn_s_history(daemon: Daemon) -> None:  # noqa: F811
    """`parse()` hands back a message with `parsed` and each call's
    `function.parsed_arguments`, which the client writes out again when the message is sent
    back: each was refused as an unknown field, so every agent built on `parse()` failed on
    its second turn."""
    sent: list[dict[str, Any]] = []
    c = _client(daemon, sent)
    first = c.chat.completions.parse(model="tiny", messages=ASK, **FIRST_TURN)
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)
    answer = _second_turn(c, message)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    replayed = sent[-1]["messages"][1]
    assert "parsed" in replayed and "parsed_arguments" in replayed["tool_calls"][0]["function"]


def test_a_streamed_message_is_taken_back_as_the_next_turn_s_history(daemon: Daemon) -> None:  # noqa: F811
    """The stream helper's `get_final_completion()` message carries each call's `index` (as
    code that builds calls from stream deltas keeps it) besides `parsed` and
    `parsed_arguments`: its second turn was refused for all three."""
    sent: list[dict[str, Any]] = []
    c = _client(daemon, sent)
    with c.chat.completions.stream(model="tiny", messages=ASK, **FIRST_TURN) as stream:
        stream.until_done()
        final = stream.get_final_completion()
    message = final.choices[0].message
    (call,) = message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)
    answer = _second_turn(c, message)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    replayed = sent[-1]["messages"][1]["tool_calls"][0]
    assert replayed["index"] == 0 and "parsed_arguments" in replayed["function"]


def test_client_added_fields_are_taken_on_assistant_messages_only(daemon: Daemon) -> None:  # noqa: F811
    """Only what the client adds is accepted, where it adds it: any other unknown field is
    still refused, and `parsed` on another role's message too."""
    call = {"id": "c1", "type": "function", "index": 0,
            "function": {"name": "GetWeather", "arguments": '{"city": "Oslo"}',
                         "parsed_arguments": {"city": "Oslo"}, "parsed": None}}  # fmt: skip
    calling = {"role": "assistant", "content": None, "tool_calls": [call], "parsed": None}
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    c = daemon.client()
    for messages, param in (
        ([*ASK, calling, result], "messages[1].tool_calls[0].function.parsed"),
        ([{"role": "user", "content": "hi", "parsed": {"a": 1}}], "messages[0]"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert refused.value.body["param"] == param, refused.value.body


def test_a_route_kvguard_does_not_serve_is_named_with_what_it_serves(daemon: Daemon) -> None:  # noqa: F811
    """The Responses API, embeddings, ...: a 404 said only `Not Found`, and a served path
    asked with the wrong method `Method Not Allowed`. As OpenAI words it, the answer names the
    request (`Invalid URL (POST /v1/responses)`), and says what kvguard serves instead."""
    c = daemon.client()
    with pytest.raises(openai.NotFoundError) as missing:
        c.responses.create(model="tiny", input="hi")
    message = missing.value.body["message"]
    assert message.startswith("Invalid URL (POST /v1/responses): kvguard serves "), message
    assert "POST /v1/chat/completions" in message and "GET /v1/models" in message, message
    with pytest.raises(openai.NotFoundError) as missing:
        c.embeddings.create(model="tiny", input="hi")
    assert "(POST /v1/embeddings)" in missing.value.body["message"]
    wrong = httpx.get(daemon.url + "/v1/chat/completions", timeout=30)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST", wrong.headers
    error = wrong.json()["error"]
    assert error["message"].startswith("Invalid method for URL (GET /v1/chat/completions)")
    assert "takes POST" in error["message"] and error["type"] == "invalid_request_error"


def test_every_answer_carries_a_request_id(daemon: Daemon) -> None:  # noqa: F811
    """The client's `request_id` (the `x-request-id` header) was None everywhere, so a client
    whose request failed had no id to quote. A whole completion's is its id, and a stream's
    the id its chunks carry (it was a fresh `req-...` that no log line names); an error before
    a completion is named, any other answer's a fresh one of its own."""
    c = daemon.client()
    raw = c.chat.completions.with_raw_response.create(model="tiny", messages=ASK, max_tokens=2)
    assert raw.request_id == raw.parse().id and raw.request_id.startswith("chatcmpl-")
    raw = c.completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=2)
    assert raw.request_id == raw.parse().id and raw.request_id.startswith("cmpl-")
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model="tiny", messages=ASK, max_tokens=0)
    failed = refused.value.request_id
    assert failed is not None and failed.startswith("req-")
    with c.chat.completions.with_streaming_response.create(
        model="tiny", messages=ASK, max_tokens=2, stream=True
    ) as streamed:
        chunks = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert chunks and streamed.request_id.startswith("chatcmpl-"), streamed.request_id
    assert {json.loads(c[len("data: ") :])["id"] for c in chunks} == {streamed.request_id}
    ids = {httpx.get(daemon.url + path, timeout=30).headers["x-request-id"]
           for path in ("/health", "/v1/models", "/v1/nope", "/health")}  # fmt: skip
    assert len(ids) == 4, ids
