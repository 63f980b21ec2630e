"""Tool calling: calls held to the `<tool_call>` form and each function's argument schema by a
grammar, answered as OpenAI's `tool_calls` (streamed and not), the conversation rendered back,
and bad tool requests refused naming their field; through the real `openai` client."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from kvguard.daemon import tools
from kvguard.daemon.openai_schemas import ChatCompletionRequest
from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.structured import compile_grammar
from tests.test_api_keys import metric
from tests.test_server import Daemon

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FUNCS = [tools.Function(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a Daemon
    """The tiny model with room for a system message describing two tools (700 tokens)."""
    d = Daemon(
        tmp_path_factory.mktemp("tools"),
        debug_hooks=False,
        serving="{model: tiny, kv_cache_bytes: 32MiB, max_model_len: 2048}",
    )
    yield d
    assert d.stop() == 0


def _valid(name: str, arguments: str) -> None:
    """The call names an offered function and its arguments match that function's schema."""
    args = json.loads(arguments)
    assert name in ("get_weather", "get_time")
    assert set(args) == ({"city", "unit"} if name == "get_weather" else {"city"})
    assert isinstance(args["city"], str) and len(args["city"]) <= 20
    assert name == "get_time" or args["unit"] in ("celsius", "fahrenheit")


def _chat(d: Daemon, **kw: Any) -> Any:
    kw = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 200, **kw}
    return d.client().chat.completions.create(**kw)


# -- the form, without a model ------------------------------------------------------------


def test_parse_takes_whole_calls_only() -> None:
    one = '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>'
    calls = tools.parse(one)
    assert calls is not None and [(c.name, c.arguments) for c in calls] == [
        ("get_time", '{"city": "Oslo"}')
    ]
    two = tools.parse(one + "\n" + one.replace("Oslo", "Rome"))
    assert two is not None and [json.loads(c.arguments)["city"] for c in two] == ["Oslo", "Rome"]
    assert len({c.id for c in two}) == 2 and all(c.id.startswith("call_") for c in two)
    assert tools.parse("The weather is fine.") is None
    assert tools.parse(one[:-3]) is None  # cut short by max_tokens: not a call
    assert tools.parse(one + " and more text") is None
    assert tools.could_be_call("<tool") and tools.could_be_call(one[:20])
    assert not tools.could_be_call("<b>") and not tools.could_be_call("Sure")


def _stream(text: str) -> tuple[str, list[dict[str, Any]], tools.CallStream]:
    """`text` fed to a CallStream a character at a time: the content and deltas it gave."""
    stream, content, deltas = tools.CallStream(), "", []
    for ch in text:
        shown, new = stream.feed(ch)
        content += shown
        deltas += new
    return content + stream.flush(), deltas, stream


def test_calls_stream_as_they_are_written() -> None:
    """Each call's id and name once its head is complete, then its arguments piece by piece
    (a `</tool_call>` inside an argument's string is the argument's text); text streams as
    content once it cannot be calls; a cut answer is content, or the calls begun."""
    odd = '{"q": "a}</tool_call> \\"b\\" {["}'
    text = (
        '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>\n'
        f'<tool_call>{{"name": "search", "arguments": {odd}}}</tool_call>'
    )
    content, deltas, stream = _stream(text)
    assert content == ""
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in heads] == [(0, "get_time"), (1, "search")]
    args = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in (0, 1)]
    assert args == ['{"city": "Oslo"}', odd] and json.loads(odd)["q"].startswith("a}</tool_call>")
    assert len([d for d in deltas if d["index"] == 0]) > 3  # piece by piece, not whole
    calls = stream.finish()
    assert calls is not None and [(c.name, c.arguments) for c in calls] == [
        ("get_time", '{"city": "Oslo"}'),
        ("search", odd),
    ]
    assert [c.id for c in calls] == [d["id"] for d in heads]
    assert tools.parse(text) is not None and len(tools.parse(text) or []) == 2
    content, deltas, stream = _stream("It is <b>sunny</b>.")
    assert content == "It is <b>sunny</b>." and deltas == [] and stream.finish() is None
    content, deltas, stream = _stream('<tool_call>{"name": "get_t')  # cut in the head
    assert content == '<tool_call>{"name": "get_t' and deltas == [] and stream.finish() is None
    content, deltas, stream = _stream('<tool_call>{"name": "f", "arguments": {"a": ')  # cut
    assert content == "" and deltas and stream.finish() is None


def test_a_feed_gives_one_delta_a_call() -> None:
    """Text that completes a call's head and begins its arguments in one feed (several tokens
    in one engine output) gives one entry for that call, its head with those arguments, as an
    OpenAI chunk has at most one entry a call; a later call in the same feed has its own."""
    one = '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>'
    two = one.replace("get_time", "get_weather").replace("Oslo", "Rome")
    a, b = one.index("city") + 2, two.index("Rome") + 1  # into each call's arguments
    stream = tools.CallStream()
    shown, deltas = stream.feed(one[:a])  # the head and '{"ci'
    assert shown == "" and len(deltas) == 1, deltas
    (head,) = deltas
    assert (head["index"], head["function"]) == (0, {"name": "get_time", "arguments": '{"ci'})
    assert head["type"] == "function" and head["id"].startswith("call_")
    shown, deltas = stream.feed(one[a:] + "\n" + two[:b])  # the first's end, the second's head
    assert [d["index"] for d in deltas] == [0, 1], deltas
    assert deltas[0] == {"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}
    assert deltas[1]["function"] == {"name": "get_weather", "arguments": '{"city": "R'}
    shown, deltas = stream.feed(two[b:])
    assert deltas == [{"index": 1, "function": {"arguments": 'ome"}'}}]
    calls = stream.finish()
    assert calls is not None and [(c.name, c.arguments) for c in calls] == [
        ("get_time", '{"city": "Oslo"}'),
        ("get_weather", '{"city": "Rome"}'),
    ]


def test_the_grammars_hold_answers_to_the_form() -> None:
    """Which texts each tool_choice's grammar accepts, walked token by token by llguidance
    over the tiny model's tokenizer."""
    import llguidance

    engine = LLMEngine.from_config(
        EngineConfig(model="tiny", kv_cache_bytes="4MiB", num_threads=1), progress=False
    )
    tok, view = engine.tokenizer, engine.grammars.view()

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(view, compile_grammar(grammar), log_level=0)
        return all(m.consume_token(t) for t in tok.encode(text, False)) and m.is_accepting()

    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>'  # noqa: E501
    extra_arg = good.replace('"celsius"}', '"celsius", "wind": 3}')
    bad_enum = good.replace("celsius", "kelvin")
    other = '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>'
    auto = tools.grammar(FUNCS, "auto", True)
    assert (
        accepts(auto, good) and accepts(auto, "It is sunny.") and accepts(auto, good + "\n" + other)
    )
    assert not accepts(auto, extra_arg) and not accepts(auto, bad_enum)
    assert not accepts(auto, good.replace("get_weather", "get_wether"))
    assert not accepts(auto, good.replace('{"name": ', '{"name":'))  # one layout
    # a text answer may begin with "<" (markup, "<3", a tag named like the call's start), so
    # long as it is not a call's opening
    for text in ("<b>Oslo</b> is sunny.", "<3", "<tool> is a word", "<tool_call", "<"):
        assert accepts(auto, text), text
    assert not accepts(auto, "<tool_call>It is sunny.")
    assert not accepts(auto, good.replace("</tool_call>", "</tool_call> and text"))
    required = tools.grammar(FUNCS, "required", True)
    assert accepts(required, good) and not accepts(required, "It is sunny.")
    single = tools.grammar(FUNCS, "required", False)
    assert accepts(single, good) and not accepts(single, good + "\n" + other)
    named = tools.grammar(FUNCS, tools.Named("get_time"), True)
    assert accepts(named, other) and not accepts(named, good)
    as_json = tools.grammar(FUNCS, "auto", True, {"type": "object"})
    assert accepts(as_json, '{"a": 1}') and not accepts(as_json, "It is sunny.")


def _call_acceptor() -> Callable[[str, str, str], bool]:
    """`accepts(grammar, name, args)`: whether `grammar` takes a call of `name` with the
    arguments `args` (JSON text), walked token by token by llguidance over the tiny model's
    tokenizer."""
    import llguidance

    engine = LLMEngine.from_config(
        EngineConfig(model="tiny", kv_cache_bytes="4MiB", num_threads=1), progress=False
    )
    tok, view = engine.tokenizer, engine.grammars.view()

    def accepts(grammar: str, name: str, args: str) -> bool:
        text = f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
        m = llguidance.LLMatcher(view, compile_grammar(grammar), log_level=0)
        return all(m.consume_token(t) for t in tok.encode(text, False)) and m.is_accepting()

    return accepts


def test_calls_are_held_to_named_functions_nested_and_recursive_parameters_and_objects() -> None:
    """A function named like a mode (`auto`, `required`) named in tool_choice is called, not
    read as the mode; parameters referring to their own definitions (pydantic's nested
    models, `#` for recursion) are resolved against the parameters, not the call around them;
    parameters naming no type still take an object; and parameters that cannot be an object
    are refused."""
    accepts = _call_acceptor()

    class Address(BaseModel):
        city: str

    class Ship(BaseModel):
        name: str
        to: Address

    ship = openai.pydantic_function_tool(Ship)["function"]["parameters"]
    assert ship["properties"]["to"] == {"$ref": "#/$defs/Address"}
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "child": {"$ref": "#"}},
            "required": ["v"], "additionalProperties": False}  # fmt: skip
    fns = [
        tools.Function("auto", None, None),
        tools.Function("required", None, None),
        tools.Function("ship", None, ship),
        tools.Function("tree", None, tree),
        tools.Function("anything", None, {}),
    ]
    for mode in ("auto", "required"):
        named = tools.grammar(fns, tools.Named(mode), True)
        other = "required" if mode == "auto" else "auto"
        assert accepts(named, mode, "{}") and not accepts(named, other, "{}")
        assert "Answer by calling " + mode in tools.system_text(fns, tools.Named(mode), True)
    g = tools.grammar(fns, "required", True)
    assert accepts(g, "ship", '{"name": "Argo", "to": {"city": "Oslo"}}')
    assert not accepts(g, "ship", '{"name": "Argo", "to": {"town": "Oslo"}}')
    assert accepts(g, "tree", '{"v": 0, "child": {"v": 1, "child": {"v": 2}}}')
    assert not accepts(g, "tree", '{"v": 0, "child": {"name": "tree", "arguments": {"v": 1}}}')
    assert accepts(g, "anything", '{"a": [1]}') and not accepts(g, "anything", "[1]")
    with pytest.raises(ValueError, match="unsatisfiable"):
        compile_grammar(
            tools.grammar([tools.Function("pick", None, {"enum": ["red"]})], "required", True)
        )


def test_each_call_is_held_to_its_own_function_s_anchors_and_ids() -> None:
    """Two functions whose parameters use the same `$anchor` (or the same `$id`) for
    different schemas: each call's arguments are held to its own function's, not to the
    other's (one JSON document holding every call would let the last definition win)."""
    accepts = _call_acceptor()

    def params(v: dict[str, Any], how: str) -> dict[str, Any]:
        args: dict[str, Any] = {"type": "object", "required": ["v"], "additionalProperties": False}
        if how == "$anchor":
            return {**args, "properties": {"v": {"$ref": "#x"}},
                    "$defs": {"X": {"$anchor": "x", **v}}}  # fmt: skip
        return {**args, "$id": "urn:kvguard:args", "properties": {"v": {"$ref": "#/$defs/A"}},
                "$defs": {"A": v}}  # fmt: skip

    for how in ("$anchor", "$id"):
        fns = [
            tools.Function("f", None, params({"type": "integer"}, how)),
            tools.Function("g", None, params({"type": "string"}, how)),
        ]
        for mode in ("required", "auto"):
            g = tools.grammar(fns, mode, True)
            assert accepts(g, "f", '{"v": 1}') and not accepts(g, "f", '{"v": "s"}'), (how, mode)
            assert accepts(g, "g", '{"v": "s"}') and not accepts(g, "g", '{"v": 1}'), (how, mode)


def test_the_real_model_calls_the_right_function_with_the_right_argument(
    smollm_engine: LLMEngine,
) -> None:
    """The default model, never taught this form, told about two functions and held to a
    call: greedy, it picks the function the question asks for and the city it names."""
    fns = [
        tools.Function(name, what, {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"], "additionalProperties": False})
        for name, what in (("get_weather", "The current weather in a city"),
                           ("get_time", "The local time in a city"))
    ]  # fmt: skip
    tok = smollm_engine.tokenizer
    for question, name, city in (
        ("What is the weather in Paris?", "get_weather", "Paris"),
        ("What time is it in Tokyo?", "get_time", "Tokyo"),
    ):
        msgs = tools.with_tools([{"role": "user", "content": question}], fns, "required", False)
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
        params = SamplingParams(max_tokens=60, grammar=tools.grammar(fns, "required", False))
        out = smollm_engine.generate([prompt], [params])[0]
        assert out.finish_reason == "stop"  # the grammar closed the call
        (call,) = tools.parse(out.text) or []
        assert (call.name, json.loads(call.arguments)) == (name, {"city": city})


# -- through the API ----------------------------------------------------------------------


def test_required_and_named_choices_answer_with_valid_calls(daemon: Daemon) -> None:
    """One call per answer (arguments of bounded length): every sampled answer is a call
    that validates; several calls, cut by max_tokens, are text, as OpenAI's are."""
    for seed in range(4):
        r = _chat(
            daemon, tool_choice="required", temperature=1.0, seed=seed, parallel_tool_calls=False
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call.function.name, call.function.arguments)
    cut = _chat(daemon, tool_choice="required", temperature=0, max_tokens=30)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content.startswith("<tool_call>")
    named = {"type": "function", "function": {"name": "get_time"}}
    r = _chat(daemon, tool_choice=named, temperature=0, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    _valid(call.function.name, call.function.arguments)


# parameters whose definitions only refer to one another: no arguments are a value of them
CYCLIC = {
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/A"}},
    "required": ["x"],
    "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
}
# parameters holding themselves, each level optional: a tree of any depth
TREE = {
    "type": "object",
    "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "child": {"$ref": "#"}},
    "required": ["v"],
    "additionalProperties": False,
}


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _is_tree(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) in ({"v"}, {"v", "child"})
        and type(value["v"]) is int
        and 0 <= value["v"] <= 9
        and ("child" not in value or _is_tree(value["child"]))
    )


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_parameters_no_arguments_match_are_a_400_naming_tools(daemon: Daemon, mode: str) -> None:
    """A cycle of references in a tool's parameters (it compiles) is refused before anything
    is queued, not answered with a call cut off at its arguments and `stop`."""
    fns = [WEATHER, _tool("f", CYCLIC)]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(daemon, tools=fns, tool_choice=mode)
    assert e.value.body["param"] == "tools", e.value.body
    assert "$defs/A -> " in e.value.message and "matches no JSON value" in e.value.message


def test_an_empty_tools_array_is_a_400_naming_tools_as_openai_answers(daemon: Daemon) -> None:
    """`tools: []` was served as no tools, where OpenAI answers 400 (an array too short): a
    client that works against kvguard so would be refused by OpenAI."""
    for choice in ("none", "auto"):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(daemon, tools=[], tool_choice=choice)
        assert e.value.body["param"] == "tools", e.value.body
        assert "an empty array offers no tool" in e.value.message


def test_recursive_parameters_are_served(daemon: Daemon) -> None:
    """Parameters that hold themselves where a value may end are called with arguments that
    parse and match them."""
    r = _chat(
        daemon, tools=[_tool("tree", TREE)], tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=0,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message.content
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "tree" and _is_tree(json.loads(call.function.arguments))


def test_a_streamed_call_is_the_answer_s_call(daemon: Daemon) -> None:
    """Streamed, the calls are the whole answer's; a chunk holds at most one entry a call (its
    head carries the first of its arguments where they came with it), as OpenAI's do, so a
    client reading one entry a chunk misses none of the arguments."""
    kw: dict[str, Any] = {"tool_choice": "required", "temperature": 0, "parallel_tool_calls": False}
    whole = _chat(daemon, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls: dict[int, dict[str, str]] = {}
    ends, content, first_entries = [], "", ""
    for chunk in _chat(daemon, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            indexes = [tc.index for tc in c.delta.tool_calls or ()]
            assert len(set(indexes)) == len(indexes), c.delta.tool_calls
            if c.delta.tool_calls:
                first_entries += c.delta.tool_calls[0].function.arguments or ""
            for tc in c.delta.tool_calls or ():
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                ends.append(c.finish_reason)
    assert ends == [whole.finish_reason]
    if whole.finish_reason == "tool_calls":
        got = [calls[i] for i in sorted(calls)]
        want = [
            {"name": t.function.name, "arguments": t.function.arguments}
            for t in whole.message.tool_calls
        ]  # noqa: E501
        assert got == want and content == ""
        assert first_entries == want[0]["arguments"]  # one call: one entry a chunk
    else:
        assert calls == {} and content == whole.message.content


def test_auto_answers_text_or_calls(daemon: Daemon) -> None:
    """The same request answers in text, or calls when its first token is pushed to `<` and
    its text must be JSON (a text answer may begin with `<` too: it only may not be a call's
    opening)."""
    lt = httpx.post(
        daemon.url + "/tokenize",
        json={"model": "tiny", "prompt": "<", "add_special_tokens": False},
    ).json()["tokens"]
    assert len(lt) == 1
    text = _chat(daemon, temperature=0, logit_bias={str(lt[0]): -100}, max_tokens=16)
    assert text.choices[0].message.tool_calls is None
    assert text.choices[0].message.content and text.choices[0].finish_reason != "tool_calls"
    called = _chat(
        daemon,
        temperature=0,
        logit_bias={str(lt[0]): 100},
        parallel_tool_calls=False,
        response_format={"type": "json_object"},
    )
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid(call.function.name, call.function.arguments)
    # pushed to `<` without a JSON text, it may answer in text that begins with `<`
    tag = _chat(daemon, temperature=0, logit_bias={str(lt[0]): 100}, max_tokens=8)
    assert tag.choices[0].message.tool_calls is None and tag.choices[0].finish_reason == "length"
    assert tag.choices[0].message.content.startswith("<")
    # the streamed text answer is the whole one, and holds nothing back at its end
    chunks = _chat(daemon, temperature=0, logit_bias={str(lt[0]): -100}, max_tokens=16, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text.choices[0].message.content


class GetTime(BaseModel):
    city: str = Field(max_length=20)
    zone: Literal["utc", "local"]


def test_the_openai_client_parses_its_strict_tools(daemon: Daemon) -> None:
    """`pydantic_function_tool` sends a strict schema; `parse` returns the arguments as the
    model, for every choice of an n=2 request."""
    c = daemon.client()
    r = c.chat.completions.parse(
        model="tiny",
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetTime)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=240,  # 20 characters of any script, a few tokens each, and the call's frame
        n=2,
        seed=5,
        temperature=0.7,
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert isinstance(call.function.parsed_arguments, GetTime)


def test_a_conversation_with_calls_and_results_is_rendered_back(daemon: Daemon) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'},
    }
    msgs = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "14:02"},
    ]
    r = httpx.post(daemon.url + "/tokenize", json={"model": "tiny", "messages": msgs}).json()
    text = httpx.post(
        daemon.url + "/detokenize", json={"model": "tiny", "tokens": r["tokens"]}
    ).json()["prompt"]
    assert '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tool_response>\n14:02\n</tool_response>" in text
    answer = _chat(daemon, messages=msgs, max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _time_call(call_id: str, city: str) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    return {"id": call_id, "type": "function",
            "function": {"name": "get_time", "arguments": arguments}}  # fmt: skip


TWO_CALLS = [*ASK, {"role": "assistant", "content": None,
                    "tool_calls": [_time_call("call_1", "Oslo"), _time_call("call_2", "Rome")]}]  # fmt: skip


def _result(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _prompt_text(d: Daemon, messages: list[dict[str, Any]]) -> str:
    ids = httpx.post(d.url + "/tokenize", json={"model": "tiny", "messages": messages}).json()
    body = {"model": "tiny", "tokens": ids["tokens"]}
    return httpx.post(d.url + "/detokenize", json=body).json()["prompt"]


def test_results_sent_out_of_order_reach_the_model_in_their_calls_order(daemon: Daemon) -> None:
    """A result's `<tool_response>` names no call, so the model reads results by their
    places: answered as they finished (Rome's first), Rome's result sat in Oslo's place and
    was read as Oslo's. They are rendered in the calls' order, whatever order they came in."""
    in_order = _prompt_text(
        daemon, [*TWO_CALLS, _result("call_1", "Oslo 14:02"), _result("call_2", "Rome 15:02")]
    )
    swapped = [*TWO_CALLS, _result("call_2", "Rome 15:02"), _result("call_1", "Oslo 14:02")]
    assert _prompt_text(daemon, swapped) == in_order
    assert in_order.index("Oslo 14:02") < in_order.index("Rome 15:02")
    answer = _chat(daemon, messages=swapped, max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_result_moved_to_its_call_s_place_is_named_where_it_was_sent() -> None:
    """The results are rendered in their calls' order, and a refusal of a result's text
    (`api.special_tokens_in_messages: refuse`) names the message as the request sent it,
    not the place it is rendered in."""
    swapped = [*TWO_CALLS, _result("call_2", "Rome"), _result("call_1", "Oslo")]
    body = ChatCompletionRequest.model_validate({"model": "tiny", "messages": swapped})
    assert [m.tool_call_id for m in body.messages[2:]] == ["call_1", "call_2"]
    fields = {}
    for i, m in enumerate(body.messages):
        pieces = m.template_pieces(f"messages[{i}]")["content"]
        fields.update({p.text: p.field for p in pieces if p.field is not None})
    assert fields["Oslo"] == "messages[3].content" and fields["Rome"] == "messages[2].content"


@pytest.mark.parametrize(
    ("messages", "param", "says"),
    [
        (  # an id no call of the assistant message before it has
            [*TWO_CALLS, _result("call_1", "a"), _result("call_9", "b")],
            "messages[3].tool_call_id",
            "'call_9' is not the id of a call in messages[1].tool_calls",
        ),
        (  # one call answered twice
            [*TWO_CALLS, _result("call_1", "a"), _result("call_2", "b"), _result("call_1", "c")],
            "messages[4].tool_call_id",
            "'call_1' is answered already by messages[2]",
        ),
        (  # a call left without its result
            [*TWO_CALLS, _result("call_2", "b"), {"role": "user", "content": "And?"}],
            "messages[1].tool_calls",
            "The following tool_call_ids did not have response messages: call_1",
        ),
        (  # no result at all: the conversation ends on the calls
            TWO_CALLS,
            "messages[1].tool_calls",
            "did not have response messages: call_1, call_2",
        ),
        (  # a result after no calls
            [*ASK, _result("call_1", "a")],
            "messages[1].tool_call_id",
            "'call_1' answers no call",
        ),
        (  # two calls of one message with one id: a result could not say which it answers
            [*ASK, {"role": "assistant", "tool_calls": [CALL, CALL]}, _result("c", "a")],
            "messages[1].tool_calls[1].id",
            "'c' is also the id of tool_calls[0]",
        ),
    ],
    ids=["unknown-id", "answered-twice", "missing", "none", "no-calls", "same-id"],
)
def test_results_that_answer_no_call_or_leave_one_unanswered_are_refused(
    daemon: Daemon, messages: list[dict[str, Any]], param: str, says: str
) -> None:
    """As OpenAI: each call of an assistant message is answered by one of the tool messages
    right after it. A result answering no call, or none for a call, was served as if the
    conversation made sense; it is a 400 naming the field, on chat and on /tokenize."""
    with pytest.raises(openai.BadRequestError) as refused:
        daemon.client().chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert refused.value.body["param"] == param, refused.value.body
    assert says in refused.value.body["message"], refused.value.body
    assert refused.value.body["message"].startswith(param + ": "), refused.value.body
    counted = httpx.post(daemon.url + "/tokenize", json={"model": "tiny", "messages": messages})
    assert counted.status_code == 400 and counted.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),  # noqa: E501
        ({"tools": [TIME, TIME]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools",
        ),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "14:02"}]}, "messages"),
    ],
)
def test_bad_tool_requests_are_refused_naming_the_field(
    daemon: Daemon, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        daemon.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body},
    )
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or "")


def test_tool_requests_count_as_structured_requests_as_the_help_says(daemon: Daemon) -> None:
    """kvguard_structured_requests_total counts each choice of a chat request with tools in
    play (its answer held to the call form) as well as response_format's, and says so."""
    before = metric(daemon, "kvguard_structured_requests_total")
    r = _chat(daemon, tool_choice="required", parallel_tool_calls=False, n=2, seed=0)
    assert [c.finish_reason for c in r.choices] == ["tool_calls", "tool_calls"]
    _chat(daemon, tool_choice="none", max_tokens=2)  # no tools in play: nothing held
    assert metric(daemon, "kvguard_structured_requests_total") - before == 2
    text = httpx.get(daemon.url + "/metrics", timeout=10).text
    (help_,) = [ln for ln in text.splitlines() if ln.startswith("# HELP kvguard_structured_req")]
    assert "response_format" in help_ and "tools" in help_, help_


def test_tokenize_counts_messages_with_their_tools_as_chat_serves_them(daemon: Daemon) -> None:
    """/tokenize with messages and tools gives the ids the chat request is served with: its
    tools described in a system message (what usage.prompt_tokens counts), for each choice."""

    def tokenize(**body: Any) -> httpx.Response:
        return httpx.post(daemon.url + "/tokenize", json={"model": "tiny", **body}, timeout=30)

    plain = tokenize(messages=ASK).json()["count"]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("auto", "required", named):
        ask = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
        r = tokenize(**ask)
        assert r.status_code == 200, r.text
        served = _chat(daemon, **{**ask, "max_tokens": 1})
        assert r.json()["count"] == served.usage.prompt_tokens > plain, choice
    assert tokenize(messages=ASK, tools=TOOLS, tool_choice="none").json()["count"] == plain
    assert tokenize(messages=ASK, tools=None, parallel_tool_calls=None).json()["count"] == plain
    refused = tokenize(messages=ASK, tool_choice="required")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    refused = tokenize(prompt="Hi", tools=TOOLS)
    assert refused.status_code == 400 and "tools go with messages" in refused.text
