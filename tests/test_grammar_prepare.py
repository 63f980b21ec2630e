"""A grammar's matcher is built once, off the engine thread, and each request (each choice of
`n`) gets an independent copy; a grammar that matches no text is refused where it is built;
and tool parameters holding anchors (`#foo`) or resources of their own (`$id`) are served as
`response_format` serves them. On the tiny model, in process."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvguard.daemon import openai_api, tools
from kvguard.engine import EngineConfig, LLMEngine, SamplingParams, structured
from kvguard.engine.structured import compile_grammar

BOUNDED = {  # every value bounded: a random-weight model's answer closes within its tokens
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue", "cyan"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "word": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    },
    "required": ["colour", "n", "word"],
    "additionalProperties": False,
}


def bounded(tag: str) -> dict[str, Any]:
    """BOUNDED under a title of its own: a grammar no other test has built a matcher for."""
    return {"title": tag, **BOUNDED}


def is_bounded(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"colour", "n", "word"}
        and value["colour"] in ("red", "green", "blue", "cyan")
        and type(value["n"]) is int
        and 0 <= value["n"] <= 999
        and isinstance(value["word"], str)
        and 1 <= len(value["word"]) <= 6
        and value["word"].isalpha()
        and value["word"].islower()
    )


class Counted:
    """llguidance with its matcher's constructor counted (the threads that ran it) and, like
    a 5000-field schema's, slow; `broken` makes every matcher one in error."""

    def __init__(self, real: Any, delay: float, broken: bool = False) -> None:
        self.LLTokenizer = real.LLTokenizer
        self.builds: list[int] = []
        outer = self

        class LLMatcher:
            grammar_from_json_schema = staticmethod(real.LLMatcher.grammar_from_json_schema)
            grammar_from_lark = staticmethod(real.LLMatcher.grammar_from_lark)
            validate_grammar = staticmethod(real.LLMatcher.validate_grammar)

            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                outer.builds.append(threading.get_ident())
                time.sleep(delay)
                if broken:
                    return SimpleNamespace(is_error=lambda: True, get_error=lambda: "too big")
                return real.LLMatcher(*args, **kwargs)

        self.LLMatcher = LLMatcher


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    eng = LLMEngine.from_config(
        EngineConfig(model="tiny", kv_cache_bytes="8MiB", num_threads=1), progress=False
    )
    eng.grammars.view()  # built before any test counts matchers
    return eng


@pytest.fixture()
def counted(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(delay: float = 0.0, broken: bool = False) -> Counted:
        stub = Counted(structured._llguidance(), delay, broken)
        monkeypatch.setattr(structured, "_llguidance", lambda: stub)
        return stub

    return install


def run(eng: LLMEngine, rids: list[str]) -> dict[str, Any]:
    final: dict[str, Any] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return {r: final[r] for r in rids}


def test_a_prepared_schema_builds_no_matcher_when_its_choices_are_added(
    engine: LLMEngine, counted: Any
) -> None:
    """The daemon's `_grammar_ready` (run off the engine thread) builds the one matcher a
    request's choices copy: adding all 8 choices, as the engine thread does, builds none and
    takes less than one build; each choice answers the schema on its own."""
    stub = counted(delay=0.2)
    params = SamplingParams(max_tokens=96, temperature=1.0, json_schema=bounded("n8"))
    openai_api._grammar_ready(SimpleNamespace(engine=engine), params)
    built = len(stub.builds)
    choices = [dataclasses.replace(params, seed=seed) for seed in range(8)]
    t0 = time.perf_counter()
    rids = [engine.add_request("Describe a thing as JSON.", p) for p in choices]
    took = time.perf_counter() - t0
    assert took < 0.2, f"adding 8 prepared choices took {took:.3f} s"  # under one build
    assert len(stub.builds) == built  # no matcher built while the choices were added
    assert built == 1 and stub.builds[0] == threading.get_ident()  # the caller's thread
    outs = run(engine, rids)
    for out in outs.values():
        assert out.finish_reason == "stop", out.text
        assert is_bounded(out.text), out.text
    assert len({o.text for o in outs.values()}) > 1  # each its own draws, not one shared state
    assert len(stub.builds) == built


def test_an_unprepared_grammar_is_built_once_for_all_its_requests(
    engine: LLMEngine, counted: Any
) -> None:
    """A library caller that never prepares: the first request builds the matcher, the rest
    copy it; a matcher the library cannot serve is refused naming its field, here and (a 400
    naming `response_format` or `tools`) in the daemon before the engine sees it."""
    stub = counted()
    params = SamplingParams(max_tokens=96, json_schema=bounded("library"))
    rids = [engine.add_request("Describe a thing as JSON.", params) for _ in range(4)]
    assert len(stub.builds) == 1
    assert all(is_bounded(o.text) for o in run(engine, rids).values())

    counted(broken=True)
    bad = SamplingParams(json_schema=bounded("broken"))
    with pytest.raises(ValueError, match="json_schema: not one kvguard can serve: too big"):
        engine.grammars.for_params(bad)
    with pytest.raises(openai_api.ApiError) as refused:
        openai_api._grammar_ready(SimpleNamespace(engine=engine), bad)
    assert refused.value.status == 400 and refused.value.param == "response_format"
    assert "too big" in str(refused.value)
    lark = tools.grammar([tools.Function("f", None, bounded("broken tools"))], "required", False)
    with pytest.raises(openai_api.ApiError) as refused:
        openai_api._grammar_ready(SimpleNamespace(engine=engine), SamplingParams(grammar=lark))
    assert refused.value.status == 400 and refused.value.param == "tools"


def test_kept_matchers_are_bounded_least_recently_used_dropped(
    engine: LLMEngine, counted: Any
) -> None:
    stub = counted()
    kept = structured.MATCHER_TEMPLATES
    asks = [SamplingParams(json_schema=bounded(f"lru {i}")) for i in range(kept + 1)]
    for p in asks:
        engine.grammars.prepare(p)
    assert len(stub.builds) == len(asks)
    engine.grammars.prepare(asks[-1])
    engine.grammars.prepare(asks[1])
    assert len(stub.builds) == len(asks)  # kept
    engine.grammars.prepare(asks[0])
    assert len(stub.builds) == len(asks) + 1  # the least recently used, dropped


def test_a_grammar_that_matches_no_text_is_refused_where_its_matcher_is_built(
    engine: LLMEngine,
) -> None:
    """Rules that only name one another compile without an error, and a fresh matcher of
    them allows only the answer's end: refused when prepared and when added (nothing queued),
    not answered empty with `stop`. One way out is enough to serve it."""
    empty = SamplingParams(max_tokens=4, grammar="start: a\na: b\nb: a")
    with pytest.raises(ValueError, match="grammar: .*matches no text"):
        engine.grammars.prepare(empty)
    with pytest.raises(ValueError, match="grammar: .*matches no text"):
        engine.add_request("Hi", empty)
    assert not engine.has_unfinished()
    way_out = dataclasses.replace(empty, grammar='start: "x" | a\na: b\nb: a')
    (out,) = engine.generate(["Hi"], [way_out])
    assert (out.text, out.finish_reason) == ("x", "stop")


def test_copies_of_a_matcher_do_not_share_their_place(engine: LLMEngine) -> None:
    """One request walking its grammar leaves another's, and the kept matcher, at the start."""
    params = SamplingParams(json_schema=bounded("copies"))
    engine.grammars.prepare(params)
    first, second = engine.grammars.for_params(params), engine.grammars.for_params(params)
    start = second.allowed()
    assert start is not None
    text = json.dumps({"colour": "blue", "n": 42, "word": "abc"})
    ids = engine.tokenizer.encode(text, False)
    assert all(first.advance(t) for t in ids) and first.complete
    after = first.allowed()
    assert after is None or not torch.equal(after, start)
    assert torch.equal(second.allowed(), start)  # the other copy has not moved
    assert all(second.advance(t) for t in ids) and second.complete
    third = engine.grammars.for_params(params)
    assert torch.equal(third.allowed(), start)  # nor has the matcher the copies come from
    assert not third.advance(engine.tokenizer.encode("[", False)[0])  # its own error only
    assert torch.equal(engine.grammars.for_params(params).allowed(), start)


ANCHORED = {
    "type": "object",
    "$defs": {"A": {"$anchor": "foo", "type": "integer", "minimum": 0, "maximum": 99}},
    "properties": {"x": {"$ref": "#foo"}},
    "required": ["x"],
    "additionalProperties": False,
}
IDENTIFIED = {
    "type": "object",
    "$id": "https://example.com/params",
    "properties": {"a": {"$ref": "#/$defs/A"}},
    "$defs": {"A": {"type": "boolean"}},
    "required": ["a"],
    "additionalProperties": False,
}
NESTED_ID = {  # the outer reference is the parameters', the inner one its resource's
    "type": "object",
    "properties": {
        "n": {
            "$id": "https://example.com/n",
            "type": "object",
            "$defs": {"B": {"enum": ["x", "y"]}},
            "properties": {"b": {"$ref": "#/$defs/B"}},
            "required": ["b"],
            "additionalProperties": False,
        },
        "m": {"$ref": "#/$defs/M"},
    },
    "$defs": {"M": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n", "m"],
    "additionalProperties": False,
}


def _anchored(args: dict[str, Any]) -> bool:
    return set(args) == {"x"} and type(args["x"]) is int and 0 <= args["x"] <= 99


def _identified(args: dict[str, Any]) -> bool:
    return set(args) == {"a"} and type(args["a"]) is bool


def _nested(args: dict[str, Any]) -> bool:
    return (
        set(args) == {"n", "m"}
        and args["n"] in ({"b": "x"}, {"b": "y"})
        and type(args["m"]) is int
        and 0 <= args["m"] <= 9
    )


@pytest.mark.parametrize(
    ("params", "valid", "wrong"),
    [
        (ANCHORED, _anchored, '{"x": "7"}'),
        (IDENTIFIED, _identified, '{"a": 1}'),
        (NESTED_ID, _nested, '{"n": {"b": "z"}, "m": 1}'),
    ],
    ids=["anchor", "id", "nested id"],
)
def test_tool_parameters_with_anchors_and_their_own_ids_are_served(
    engine: LLMEngine, params: dict[str, Any], valid: Any, wrong: str
) -> None:
    """Parameters `response_format` would take compile as a tool's too, and the calls drawn
    under them parse and hold the types their references name."""
    lark = tools.grammar([tools.Function("f", None, params)], "required", False)
    compile_grammar(lark)
    head = '<tool_call>{"name": "f", "arguments": '
    tok = engine.tokenizer

    def accepts(args: str) -> bool:
        g = engine.grammars.for_params(SamplingParams(grammar=lark))
        return all(g.advance(t) for t in tok.encode(f"{head}{args}}}</tool_call>", False))

    assert not accepts(wrong)  # the reference holds the value to its own schema
    asks = [SamplingParams(max_tokens=128, temperature=1.0, seed=s, grammar=lark) for s in range(4)]
    for out in engine.generate(["Call f."] * len(asks), asks):
        assert out.finish_reason == "stop", out.text
        calls = tools.parse(out.text)
        assert calls is not None and len(calls) == 1, out.text
        assert calls[0].name == "f" and valid(json.loads(calls[0].arguments)), out.text
