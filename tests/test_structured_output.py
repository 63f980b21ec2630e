"""Structured output: answers held to a JSON schema (the engine's `json_schema`, the API's
`response_format`), on the real model and through the real `openai` client."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel

from kvguard.daemon import tools
from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.admission_policy import AdmissionRejected
from kvguard.engine.model_runner import StepInput
from kvguard.engine.sampler import adjust_logits
from kvguard.engine.sequence import Status
from kvguard.engine.structured import compile_schema
from kvguard.kernels import cpu_lowbit
from kvguard.kernels.cpu_lowbit import StepRows
from tests.test_server import Daemon
from tests.test_tools import FUNCS

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = "Describe a person called Ada, aged 36, as JSON."


def chat(eng: LLMEngine, text: str) -> str:
    return eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def is_person(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age"}
        and isinstance(value["name"], str)
        and isinstance(value["age"], int)
        and not isinstance(value["age"], bool)
    )


def test_a_grammar_mask_is_minus_infinity_off_the_allowed_tokens() -> None:
    logits = torch.zeros(2, 6)
    allowed = torch.tensor([False, True, False, True, False, False])
    got = adjust_logits(logits, [SamplingParams(), SamplingParams()], None, [allowed, None])
    assert got[0].tolist() == [float("-inf"), 0.0, float("-inf"), 0.0] + [float("-inf")] * 2
    assert got[1].tolist() == [0.0] * 6  # a row without a grammar is left alone
    assert logits.eq(0).all()  # the caller's logits (log-probabilities') unchanged


def test_the_real_model_answers_the_schema_greedy_and_sampled(smollm_engine: LLMEngine) -> None:
    eng = smollm_engine
    prompt = chat(eng, ASK)
    free = eng.generate([prompt], [SamplingParams(max_tokens=48)])[0]
    assert not is_person(free.text)  # left alone it writes prose around its JSON
    asks = [SamplingParams(max_tokens=48, json_schema=PERSON)] + [
        SamplingParams(max_tokens=48, json_schema=PERSON, temperature=1.0, seed=s) for s in range(4)
    ]
    outs = eng.generate([prompt] * len(asks), asks)
    for o in outs:
        assert is_person(o.text), o.text
        assert o.finish_reason == "stop"  # closed by the grammar, not cut by max_tokens
        assert o.text == eng.tokenizer.decode(o.token_ids)
    # one line, json.dumps' separators: nothing for a model to loop on between tokens
    assert outs[0].text == json.dumps(json.loads(outs[0].text))


def test_a_constrained_request_leaves_its_batch_neighbours_alone(
    smollm_engine: LLMEngine,
) -> None:
    eng = smollm_engine
    other = chat(eng, "Name three colours.")
    solo = eng.generate([other], [SamplingParams(max_tokens=24, ignore_eos=True)])[0]
    both = eng.generate(
        [chat(eng, ASK), other],
        [
            SamplingParams(max_tokens=48, json_schema=PERSON),
            SamplingParams(max_tokens=24, ignore_eos=True),
        ],
    )
    assert is_person(both[0].text)
    assert both[1].token_ids == solo.token_ids


def test_json_object_mode_and_enums(smollm_engine: LLMEngine) -> None:
    eng = smollm_engine
    outs = eng.generate(
        [chat(eng, 'Reply with the JSON object {"ok": true}.'), chat(eng, "Is water wet?")],
        [
            SamplingParams(max_tokens=48, json_schema={"type": "object"}),
            # ignore_eos: the closed grammar ends it, not an end-of-sequence token
            SamplingParams(max_tokens=8, json_schema={"enum": ["yes", "no"]}, ignore_eos=True),
        ],
    )
    assert isinstance(json.loads(outs[0].text), dict) and outs[0].finish_reason == "stop"
    assert json.loads(outs[1].text) in ("yes", "no") and outs[1].finish_reason == "stop"
    assert not set(outs[1].token_ids) & eng.eos_ids


def test_a_preempted_request_keeps_its_place_in_the_grammar(smollm_engine: LLMEngine) -> None:
    """Recomputed after preemption, the request goes on from where its grammar was: the same
    tokens as without the interruption, still the schema's JSON."""
    eng = smollm_engine
    prompt = chat(eng, ASK)
    params = SamplingParams(max_tokens=48, json_schema=PERSON)
    whole = eng.generate([prompt], [params])[0]
    rid = eng.add_request(prompt, SamplingParams(max_tokens=48, json_schema=PERSON))
    seq = eng._seqs[rid]
    while len(seq.output_token_ids) < 5:
        eng.step()
    assert seq.status is Status.RUNNING and eng.scheduler.preempt(seq) == "recompute"
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert seq.num_preemptions == 1 and seq.output_token_ids == whole.token_ids
    assert is_person(seq.text)


def test_schemas_are_checked_when_the_request_is_added(smollm_engine: LLMEngine) -> None:
    eng = smollm_engine
    with pytest.raises(ValueError, match="json_schema="):
        SamplingParams(json_schema="{}")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"json_schema: .*nosuch"):
        eng.add_request("Hi", SamplingParams(json_schema={"type": "nosuch"}))
    # nested deeper than JSON text can be written by Python (the API's parser stops sooner)
    with pytest.raises(ValueError, match="json_schema: .*nested too deeply"):
        eng.add_request("Hi", SamplingParams(json_schema=nested(5000)))
    assert not eng.has_unfinished()  # nothing was queued
    # a request admission refuses is not counted as a structured request
    before = eng.grammars.requests
    eng.halt_admission(None)
    eng.step()  # the action runs on the engine's thread, at its next step
    with pytest.raises(AdmissionRejected):
        eng.add_request("Hi", SamplingParams(json_schema=PERSON))
    eng.resume_admission()
    eng.step()
    eng.add_request("Hi", SamplingParams(max_tokens=1, json_schema=PERSON))
    assert eng.grammars.requests == before + 1
    while eng.has_unfinished():
        eng.step()


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# A's value is B's, and B's is A's: a schema the grammar library compiles without a word,
# whose matcher then allows only the answer's end (an empty answer, with `stop`)
CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
TREE = {
    "type": "object",
    "properties": {"children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "additionalProperties": False,
}
# self-references that null ends, or any value not of the kind `required` (`minItems`) binds:
# a type list with null in it (how a linked list's `next`, a tree's `parent`, is often written
# instead of `anyOf`), or no type at all
NULLABLE_NEXT = {
    "type": ["object", "null"],
    "properties": {"next": {"$ref": "#"}},
    "required": ["next"],
}
NULLABLE_NODE = {
    "$defs": {
        "N": {
            "type": ["object", "null"],
            "required": ["v", "next"],
            "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/N"}},
        }
    },
    "type": "object",
    "properties": {"head": {"$ref": "#/$defs/N"}},
    "required": ["head"],
}
NULLABLE_ARRAY = {
    "$defs": {"T": {"type": ["array", "null"], "items": {"$ref": "#/$defs/T"}, "minItems": 1}},
    "type": "object",
    "properties": {"t": {"$ref": "#/$defs/T"}},
    "required": ["t"],
}
UNTYPED_NEXT = {
    "$defs": {"N": {"properties": {"next": {"$ref": "#/$defs/N"}}, "required": ["next"]}},
    "type": "object",
    "properties": {"n": {"$ref": "#/$defs/N"}},
    "required": ["n"],
}
LIST = {
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
            },
            "required": ["v", "next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/Node",
}


@pytest.mark.parametrize(
    ("schema", "cycle"),
    [
        (CYCLE, "#/$defs/A -> #/$defs/B -> #/$defs/A"),
        ({"allOf": [{"$ref": "#"}]}, "# -> #"),
        # an object that requires itself, an array that needs an item that is the array
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "# -> #"),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "# -> #"),
        ({"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2},
         "# -> #"),
        ({"$defs": {"P": {"type": "object", "properties": {"q": {"$ref": "#/$defs/Q"}},
                          "required": ["q"]},
                    "Q": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
                          "required": ["p"]}},
          "$ref": "#/$defs/P"}, "#/$defs/P -> #/$defs/Q -> #/$defs/P"),
        # a long cycle is named by its start
        ({"$defs": {f"D{i}": {"$ref": f"#/$defs/D{(i + 1) % 20}"} for i in range(20)},
          "$ref": "#/$defs/D0"}, "#/$defs/D0 -> #/$defs/D1 -> #/$defs/D2 -> (17 more) -> #/$defs/D0"),
        # where a value could be begun: an optional property, one alternative of two
        ({"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "$defs": CYCLE["$defs"]},
         "#/$defs/A -> #/$defs/B -> #/$defs/A"),
        ({"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/A"}], "$defs": CYCLE["$defs"]},
         "#/$defs/A -> #/$defs/B -> #/$defs/A"),
        # inside a resource of its own: its references resolve there
        ({"type": "object", "required": ["r"], "properties": {"r": {
            "$id": "urn:kvguard:r", "$ref": "#/$defs/A", "$defs": CYCLE["$defs"]}}},
         "#/$defs/A -> #/$defs/B -> #/$defs/A"),
        # a type list of one kind is that kind
        ({"type": ["object"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "# -> #"),
        ({"type": ["array"], "items": {"$ref": "#"}, "minItems": 1}, "# -> #"),
        # null ends the nullable node, not the object-only one it holds
        ({"$defs": {"O": {"type": "object", "properties": {"o": {"$ref": "#/$defs/O"}},
                          "required": ["o"]}},
          "type": ["object", "null"], "properties": {"o": {"$ref": "#/$defs/O"}}},
         "#/$defs/O -> #/$defs/O"),
    ],
)  # fmt: skip
def test_a_cycle_of_references_no_value_matches_is_refused(
    schema: dict[str, Any], cycle: str
) -> None:
    """Refused with the cycle named, before any matcher is built (the grammar library
    compiles each of these without a word)."""
    says = f"json_schema: .*\\$ref cycle {re.escape(cycle)} matches no JSON value"
    with pytest.raises(ValueError, match=says):
        compile_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        TREE,
        LIST,
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # {} ends it
        {"type": "integer", "$defs": CYCLE["$defs"]},  # a cycle nothing refers to
        {"type": "object", "properties": {"x": False}},  # x may not be there
        {"$ref": "#/$defs/A", "$defs": {"A": {"$anchor": "a", "$ref": "#b"},
                                        "B": {"$anchor": "b", "type": "null"}}},
        # `required` binds objects only, `minItems` arrays only: null, a string, ... end these
        NULLABLE_NEXT,
        NULLABLE_NODE,
        NULLABLE_ARRAY,
        UNTYPED_NEXT,
        {"items": {"$ref": "#"}, "minItems": 1},
        {"type": "string", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        # kinds a oneOf narrows to are not the node's type: its null branch ends it
        {"oneOf": [{"type": "object"}, {"type": "null"}], "properties": {"a": {"$ref": "#"}},
         "required": ["a"]},
    ],
)  # fmt: skip
def test_recursive_schemas_with_a_way_out_are_served(schema: dict[str, Any]) -> None:
    assert compile_schema(schema)


def test_nullable_self_references_take_the_values_that_end_them() -> None:
    """The grammar kvguard builds for each, walked token by token over the tiny model's
    tokenizer, takes a value that matches it and closes there."""
    eng = LLMEngine.from_config(
        EngineConfig(model="tiny", kv_cache_bytes="4MiB", num_threads=1), progress=False
    )
    for schema, value in (
        (NULLABLE_NEXT, {"next": None}),
        (NULLABLE_NODE, {"head": {"v": 1, "next": {"v": 2, "next": None}}}),
        (NULLABLE_ARRAY, {"t": [[None], None]}),
    ):
        grammar = eng.grammars.for_params(SamplingParams(json_schema=schema))
        ids = eng.tokenizer.encode(json.dumps(value), False)
        assert all(grammar.advance(t) for t in ids) and grammar.complete, (value, grammar.error)


def is_tree(value: Any) -> bool:
    children = value.get("children", []) if isinstance(value, dict) else None
    return (
        isinstance(children, list)
        and set(value) <= {"children"}
        and len(children) <= 2
        and all(is_tree(c) for c in children)
    )


def is_list(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"v", "next"}
        and type(value["v"]) is int
        and 0 <= value["v"] <= 9
        and (value["next"] is None or is_list(value["next"]))
    )


def test_the_api_serves_recursive_schemas(tiny_daemon: Daemon) -> None:
    """A tree, a linked list: answered 200 with JSON that matches, closed by the grammar."""
    c = tiny_daemon.client()
    for name, schema, valid in (("tree", TREE, is_tree), ("list", LIST, is_list)):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        for seed in range(3):
            r = c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=200,
                temperature=1.0, seed=seed, response_format=fmt,
            )  # fmt: skip
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop" and valid(json.loads(text)), text


def is_chain(value: Any) -> bool:
    """Whether `value` matches NULLABLE_NEXT: null, or an object whose `next` is one."""
    return value is None or (
        isinstance(value, dict) and "next" in value and is_chain(value["next"])
    )


def test_the_api_serves_a_nullable_self_reference(tiny_daemon: Daemon) -> None:
    """A type list with null in it ends the cycle: answered 200 with JSON that matches, not
    refused as a cycle no value matches."""
    fmt = {"type": "json_schema", "json_schema": {"name": "chain", "schema": NULLABLE_NEXT}}
    r = tiny_daemon.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=200,
        temperature=0, response_format=fmt,
    )  # fmt: skip
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and is_chain(json.loads(text)), text


class Answer(BaseModel):
    ok: bool
    n: int


def metric(d: Daemon, name: str) -> float:
    text = httpx.get(d.url + "/metrics", timeout=10).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).split()[1])


def test_the_api_serves_response_format(tiny_daemon: Daemon) -> None:
    c = tiny_daemon.client()
    requests0 = metric(tiny_daemon, "kvguard_structured_requests_total")
    seconds0 = metric(tiny_daemon, "kvguard_grammar_seconds_total")
    msgs: list[Any] = [{"role": "user", "content": "Hi"}]
    # the openai client's own structured-output call: a strict schema from a pydantic model
    parsed = c.chat.completions.parse(
        model="tiny", messages=msgs, max_tokens=64, temperature=0, response_format=Answer
    )
    choice = parsed.choices[0]
    assert isinstance(choice.message.parsed, Answer) and choice.finish_reason == "stop"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}}
    whole = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=64, temperature=0, response_format=fmt
    )
    assert isinstance(json.loads(whole.choices[0].message.content)["ok"], bool)
    chunks = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=64, temperature=0, response_format=fmt,
        stream=True,
    )  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    obj = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "yn", "schema": {"enum": ["yes", "no"]}}},
    )  # fmt: skip
    assert json.loads(obj.choices[0].message.content) in ("yes", "no")
    # completions take it too (a kvguard extension, as top_k is)
    done = c.completions.create(
        model="tiny", prompt="Hi", max_tokens=64, temperature=0,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    assert isinstance(json.loads(done.choices[0].text)["ok"], bool)
    assert done.choices[0].finish_reason == "stop"
    plain = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=4, temperature=0, response_format={"type": "text"}
    )
    assert plain.choices[0].message.content is not None
    # five answers held to a schema (not the text one), and the time their grammars took
    assert metric(tiny_daemon, "kvguard_structured_requests_total") - requests0 == 5
    assert metric(tiny_daemon, "kvguard_grammar_seconds_total") > seconds0


@pytest.mark.parametrize(
    ("fmt", "says"),
    [
        ({"type": "json_schema"}, "type json_schema needs json_schema"),
        ({"type": "json_object", "json_schema": {"name": "x"}}, "only with type json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}},
         "nosuch"),
        ({"type": "yaml"}, "json_object"),
        # nested past the grammar library's limit
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": nested(150)}},
         "recursion limit"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "enum": [f"v{i}" for i in range(200_000)]}}}, "too big"),
        ({"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}},
         "extra"),
        # definitions that only refer to one another: no JSON value is one (it compiles)
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": CYCLE}},
         "$ref cycle #/$defs/A -> #/$defs/B -> #/$defs/A matches no JSON value"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
         "$ref cycle # -> # matches no JSON value"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/A"}},
            "$defs": CYCLE["$defs"]}}}, "$ref cycle #/$defs/A -> #/$defs/B"),
        # unsatisfiable in other ways: refused by the grammar library, in its words
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}, "not"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "allOf": [{"type": "string"}, {"type": "integer"}]}}}, "incompatible types"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"x": {"anyOf": []}}, "required": ["x"]}}},
         "required property 'x' is unsatisfiable"),
    ],
)  # fmt: skip
def test_the_api_refuses_a_bad_response_format(
    tiny_daemon: Daemon, fmt: dict[str, Any], says: str
) -> None:
    c = tiny_daemon.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], response_format=fmt
        )
    err = e.value.body
    assert err["param"].startswith("response_format"), err
    assert says in err["message"], err
    # the connection and the server go on serving
    ok = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


# -- jump-forward -------------------------------------------------------------------------


def _steps_and_answer(eng: LLMEngine, params: SamplingParams) -> tuple[list[int], Any]:
    """Each step's computed-token count for one request on `eng`, and its final output."""
    rid = eng.add_request(chat(eng, ASK), params)
    counts, final = [], None
    while eng.has_unfinished():
        seq = eng._seqs.get(rid)
        before = seq.num_computed_tokens if seq is not None else 0
        for out in eng.step():
            final = out if out.finished else final
        seq = eng._seqs.get(rid)
        counts.append((seq.num_computed_tokens if seq is not None else -1) - before)
    return counts, final


def test_forced_tokens_are_appended_at_once_and_computed_as_one_chunk(
    smollm_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The person's keys and punctuation come without a draw each: the same greedy answer in
    fewer steps, the forced tokens computed in chunks after the drawn one."""
    eng = smollm_engine
    params = SamplingParams(max_tokens=64, json_schema=PERSON)
    jumped, answer = _steps_and_answer(eng, params)
    monkeypatch.setattr(eng.config, "grammar_jump_forward", False)
    drawn, plain = _steps_and_answer(eng, params)
    assert is_person(answer.text) and answer.text == plain.text
    assert answer.token_ids == plain.token_ids
    assert len(jumped) < len(drawn) - 3  # the steps a draw each would have taken
    assert any(n > 1 for n in jumped[1:])  # chunks of forced tokens after the prompt's
    assert all(n == 1 for n in drawn[1:-1])


def test_forced_tokens_keep_to_max_tokens_and_logprobs_requests_draw_each(
    smollm_engine: LLMEngine,
) -> None:
    eng = smollm_engine
    cut = eng.generate([chat(eng, ASK)], [SamplingParams(max_tokens=3, json_schema=PERSON)])[0]
    assert len(cut.token_ids) == 3 and cut.finish_reason == "length"
    asked = SamplingParams(max_tokens=64, json_schema=PERSON, logprobs=0)
    out = eng.generate([chat(eng, ASK)], [asked])[0]
    assert is_person(out.text) and len(out.final_logprobs) == len(out.token_ids)


def test_json_closed_on_the_last_token_max_tokens_allows_is_complete(
    smollm_engine: LLMEngine,
) -> None:
    """An answer whose JSON closes on its max_tokens-th token is complete (`stop`, which the
    openai client's `parse` needs), drawn or forced; one token fewer is `length`."""
    eng = smollm_engine
    for jump in (True, False):
        eng.config.grammar_jump_forward = jump
        try:
            full = eng.generate(
                [chat(eng, ASK)], [SamplingParams(max_tokens=64, json_schema=PERSON)]
            )
            n = len(full[0].token_ids)
            assert full[0].finish_reason == "stop" and is_person(full[0].text)
            exact, short = eng.generate(
                [chat(eng, ASK)] * 2,
                [SamplingParams(max_tokens=m, json_schema=PERSON) for m in (n, n - 1)],
            )
        finally:
            eng.config.grammar_jump_forward = True
        assert exact.token_ids == full[0].token_ids and exact.finish_reason == "stop", jump
        assert short.finish_reason == "length" and not is_person(short.text), jump


def test_forced_tokens_cut_by_max_tokens_leave_the_answer_length(smollm_engine: LLMEngine) -> None:
    """A const string is forced whole after the first drawn token, closing brace included: an
    answer max_tokens cuts inside it is `length` (it was `stop`, the grammar having taken every
    forced token, with the JSON open), and only the whole answer is `stop`."""
    eng = smollm_engine
    const = {"type": "object", "properties": {"a": {"const": "a long constant value"}}}
    schema = const | {"required": ["a"], "additionalProperties": False}
    full = eng.generate([chat(eng, ASK)], [SamplingParams(max_tokens=64, json_schema=schema)])
    assert full[0].finish_reason == "stop"
    assert json.loads(full[0].text) == {"a": "a long constant value"}
    n = len(full[0].token_ids)
    cuts = eng.generate(
        [chat(eng, ASK)] * (n - 1),
        [SamplingParams(max_tokens=m, json_schema=schema) for m in range(1, n)],
    )
    assert [(len(c.token_ids), c.finish_reason) for c in cuts] == [
        (m, "length") for m in range(1, n)
    ]


def test_a_forced_chunk_is_its_steps_decode_rows(
    smollm_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drawn token and the tokens its grammar forced after it are that sequence's decode
    rows, beside a prompt chunk as alone: first in the step, counted as decode rows for the
    CPU GEMMs' kernel (`StepRows`), each attending as a decode row of its own. As prompt rows
    they took the prompt kernel, on an AMX-BF16 CPU the bf16 tiles, whose weight conversion
    costs a whole model's for one row."""
    eng = smollm_engine
    inputs: list[StepInput] = []
    forward = eng.runner.forward
    monkeypatch.setattr(eng.runner, "forward", lambda inp: inputs.append(inp) or forward(inp))
    rid = eng.add_request(chat(eng, ASK), SamplingParams(max_tokens=64, json_schema=PERSON))
    seq = eng._seqs[rid]
    while not (seq.num_computed_tokens >= len(seq.prompt_token_ids) and seq.num_uncomputed > 1):
        eng.step()  # until forced tokens wait after the drawn one
    done, chunk = seq.num_computed_tokens, seq.num_uncomputed
    other = eng.add_request(chat(eng, "Name three colours."), SamplingParams(max_tokens=4))
    inputs.clear()
    eng.step()
    step = inputs[0]
    prompt = step.meta.query_lens[-1]  # the new prompt's chunk (past its cached blocks)
    # a prompt shorter than bf16_min_prompt() is a short prompt's rows (their own GEMM kind)
    short = prompt if eng._seqs[other].num_tokens < cpu_lowbit.bf16_min_prompt() else 0
    assert prompt > 1 and step.kinds == StepRows(chunk + prompt, chunk, 1, short)
    assert step.meta.query_lens == [1] * chunk + [prompt]
    assert step.meta.seq_lens[:chunk] == list(range(done + 1, done + chunk + 1))
    while eng.has_unfinished():
        eng.step()
    assert is_person(seq.text)


def test_jump_forward_keeps_the_packed_models_tokens(
    smollm_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the packed default model a greedy answer and seeded sampled ones are the same tokens
    with jump-forward on and off: a forced chunk's rows are decode rows, so its logits are
    one-token steps' to the bit. As prompt rows they were not (on an AMX-BF16 CPU the bf16
    tiles against the decode rows' int16 dots, prefill attention against decode attention:
    logits apart by up to 0.07), and 2 of these 6 seeds answered otherwise.

    Decode attention's shared-prefix read is off here: a sequence's own forced rows never
    take it (each attends as its one-token step would), but these seven requests share their
    prompt's blocks, and which of them decode together (with forced rows or without) decides
    the groups that read those blocks once, whose merged softmax moves this model's logits by
    up to 0.02, which can turn a draw at its edge."""
    eng = smollm_engine
    prompt = chat(eng, ASK)
    asks = [SamplingParams(max_tokens=64, json_schema=PERSON)] + [
        SamplingParams(max_tokens=64, json_schema=PERSON, temperature=0.9, seed=s) for s in range(6)
    ]
    was = cpu_lowbit.shared_prefix(False)
    try:
        runs = {}
        for jump in (True, False):
            monkeypatch.setattr(eng.config, "grammar_jump_forward", jump)
            runs[jump] = eng.generate([prompt] * len(asks), asks)
    finally:
        cpu_lowbit.shared_prefix(was)
    for i, (forced, drawn) in enumerate(zip(runs[True], runs[False], strict=True)):
        assert is_person(forced.text), (i, forced.text)
        assert forced.token_ids == drawn.token_ids, (i, forced.text, drawn.text)
    assert len({o.text for o in runs[True]}) > 2  # sampled: the seeds answer otherwise


BOUNDED = {  # a person of bounded values: the tiny model's sampled answers close
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "unit", "age"],
    "additionalProperties": False,
}


def test_a_seed_gives_the_same_tokens_forced_or_drawn() -> None:
    """A seeded sampled answer spends one draw a token whether its grammar's forced tokens are
    appended at once or drawn one a step (as for a request asking for log-probabilities, or
    with jump-forward off): the same tokens every way, for a schema and for a tool call (a
    forced token took no draw, so the tokens after it came from other draws)."""
    eng = LLMEngine.from_config(
        EngineConfig(model="tiny", kv_cache_bytes="16MiB", num_threads=1), progress=False
    )
    held = {"json_schema": BOUNDED, "grammar": tools.grammar(FUNCS, "required", False)}
    for field, value in held.items():
        texts = set()
        for seed in range(3):
            ask = {"max_tokens": 200, "temperature": 1.0, "seed": seed, field: value}
            runs = {}
            for way, jump, logprobs in (("forced", True, None), ("logprobs", True, 0),
                                        ("drawn", False, None)):  # fmt: skip
                eng.config.grammar_jump_forward = jump
                params = SamplingParams(logprobs=logprobs, **ask)
                runs[way] = eng.generate(["Person:"], [params])[0]
            forced = runs["forced"]
            assert forced.finish_reason == "stop", (field, seed)  # closed: drawn after forced
            for way, out in runs.items():
                assert out.token_ids == forced.token_ids, (field, seed, way)
            texts.add(forced.text)
        assert len(texts) == 3, field  # sampled: each seed its own answer


def test_a_schema_past_the_grammar_librarys_limits_is_a_400_naming_it(tiny_daemon: Daemon) -> None:
    """A schema that compiles but that the grammar library gives up on while the answer is
    written (an object of one of 2001 shapes: more alternatives than its parser holds in one
    row) is the request's fault: a 400 naming response_format, streamed or not, not a 500."""
    alternatives = [
        {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"],
         "additionalProperties": False}
        for i in range(2001)
    ]  # fmt: skip
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "many", "schema": {"anyOf": alternatives}},
    }
    c = tiny_daemon.client()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**body, response_format=fmt)
    assert e.value.body["param"] == "response_format" and "gave up" in e.value.message
    with pytest.raises(openai.APIError, match="response_format: .* gave up"):  # as an event
        list(c.chat.completions.create(**body, response_format=fmt, stream=True))
