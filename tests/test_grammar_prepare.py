"""A grammar's matcher is built once, off the engine thread, and each request (each choice of
`n`) gets an independent copy; a grammar that matches no text is refused where it is built;
a refused one is refused again without compiling or building anything; grammars are prepared
on workers of their own, so that compiles in flight hold neither a reload nor /tokenize, and a
compile not yet started when its client hangs up or the service closes never runs; and tool
parameters holding anchors (`#foo`) or resources of their own (`$id`) are served as
`response_format` serves them. On the tiny model, in process (the daemon's API served on
loopback in a thread of its own, where `Grammars.prepare` is held)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn

from kvguard.daemon import openai_api, tools
from kvguard.daemon.app import create_app
from kvguard.daemon.config import load_config
from kvguard.daemon.service import Service, bind_api
from kvguard.engine import EngineConfig, LLMEngine, SamplingParams, structured
from kvguard.engine.structured import Grammars, compile_grammar
from tests.test_server import until

TOKEN = "grammar-admin-token"
# asyncio's default executor as the finding's 2-CPU host had it (min(32, CPUs + 4)): the threads
# a reload, /tokenize and large bodies run on
DEFAULT_EXECUTOR = 6

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
    a 5000-field schema's, slow; `broken` makes every matcher one in error. Its compiles are
    counted too (`compiles`: "schema" or "lark" each)."""

    def __init__(self, real: Any, delay: float, broken: bool = False) -> None:
        self.LLTokenizer = real.LLTokenizer
        self.builds: list[int] = []
        self.compiles: list[str] = []
        outer = self

        class LLMatcher:
            validate_grammar = staticmethod(real.LLMatcher.validate_grammar)

            @staticmethod
            def grammar_from_json_schema(*args: Any, **kwargs: Any) -> str:
                outer.compiles.append("schema")
                return real.LLMatcher.grammar_from_json_schema(*args, **kwargs)

            @staticmethod
            def grammar_from_lark(*args: Any, **kwargs: Any) -> str:
                outer.compiles.append("lark")
                return real.LLMatcher.grammar_from_lark(*args, **kwargs)

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


def refusal(engine: LLMEngine, params: SamplingParams) -> tuple[int, str | None, str]:
    """The daemon's refusal of `params` (`_grammar_ready`, as on a compile worker)."""
    with pytest.raises(openai_api.ApiError) as refused:
        openai_api._grammar_ready(SimpleNamespace(engine=engine), params)
    return refused.value.status, refused.value.param, str(refused.value)


def test_a_refused_grammar_is_refused_again_without_compiling_or_building_it(
    engine: LLMEngine, counted: Any
) -> None:
    """A schema the grammar library refuses was compiled again in full each time it was sent
    (a refusal raised, and only successes were cached): one whose matcher runs out of fuel
    after seconds of CPU cost those seconds on every send. Now its refusal is remembered: the
    same 400 again, nothing compiled or built. So for a schema refused as it compiles, one
    whose matcher the library cannot build, and a tools grammar."""
    stub = counted()
    empty = SamplingParams(json_schema={"title": "refused twice", "enum": []})
    first = refusal(engine, empty)
    assert first[:2] == (400, "response_format") and "anyOf is empty" in first[2], first
    assert stub.compiles == ["schema"]
    assert refusal(engine, empty) == first
    assert stub.compiles == ["schema"]  # not compiled again

    lark = tools.grammar([tools.Function("f", None, {"enum": []})], "required", False)
    first = refusal(engine, SamplingParams(grammar=lark))
    assert first[:2] == (400, "tools"), first
    assert refusal(engine, SamplingParams(grammar=lark)) == first
    assert stub.compiles == ["schema", "lark"]

    stub = counted(broken=True)
    unbuilt = SamplingParams(json_schema=bounded("no matcher twice"))
    first = refusal(engine, unbuilt)
    assert first == (400, "response_format", "response_format: not one kvguard can serve: too big")
    assert refusal(engine, unbuilt) == first
    with pytest.raises(ValueError, match="json_schema: not one kvguard can serve: too big"):
        engine.grammars.for_params(unbuilt)  # the engine's own copy of it, refused so too
    assert stub.compiles == ["schema"] and len(stub.builds) == 1  # built once


def test_refusals_kept_are_bounded_by_count_and_bytes() -> None:
    """A client sending refused schemas without end takes a bounded memory: the least recently
    used refusal is dropped past the count or the bytes (kept as digests and reasons)."""
    built: list[str] = []

    def refuse(text: str) -> str:
        built.append(text)
        raise ValueError(f"no: {text}")

    def ask(refusals: structured.Refusals, text: str) -> None:
        with pytest.raises(ValueError, match=f"^no: {text}$"):
            refusals.call(text, refuse)

    kept = structured.Refusals(kept=2, size=1 << 20)
    for text in ("a", "b", "a", "c", "a", "b"):  # c pushes out b, the least recently asked
        ask(kept, text)
    assert built == ["a", "b", "c", "b"]
    small = structured.Refusals(kept=100, size=2 * (32 + len("no: x")))  # two reasons' bytes
    for text in ("x", "y", "z", "x", "z"):
        ask(small, text)
    assert built[4:] == ["x", "y", "z", "x"]
    huge = "h" * 100
    for _ in range(2):  # past the bytes alone: not kept
        ask(small, huge)
    assert built[8:] == [huge, huge]
    assert kept.call("served", str.upper) == "SERVED"  # what builds is returned, not kept


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


def loaded(tmp: Path, api: str = "") -> Service:
    """The daemon's service on the tiny model (the `tiny_dir` fixture fetches it), loaded in
    process; `api`: more keys of its `api` section."""
    (tmp / "admin.token").write_text(TOKEN + "\n")
    cfg_file = tmp / "config.yaml"
    cfg_file.write_text(
        "serving: {model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}\n"
        f"api: {{admin_token_file: {tmp / 'admin.token'}{', ' + api if api else ''}}}\n"
        f"audit: {{url: 'sqlite:///{tmp / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    return svc


@contextlib.contextmanager
def serving(svc: Service) -> Iterator[str]:
    """`svc`'s API on loopback (its URL), served by uvicorn on an event loop of its own, in a
    thread, with asyncio's default executor at DEFAULT_EXECUTOR threads."""
    sock = bind_api("127.0.0.1", 0)
    config = uvicorn.Config(
        create_app(svc), log_config=None, log_level=None, lifespan="off", ws="none"
    )
    server = uvicorn.Server(config)

    def run() -> None:
        with asyncio.Runner() as runner:
            runner.get_loop().set_default_executor(ThreadPoolExecutor(DEFAULT_EXECUTOR))
            runner.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=run, name="test-api", daemon=True)
    thread.start()
    try:
        until(lambda: server.started, 60, "the API listening")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


class HeldPrepare:
    """`Grammars.prepare` held until `release` is set: a slow schema's compile in flight (the
    threads that ran it: `threads`). The requests that reached `_serve`'s grammar step are
    counted (`arrived`: they asked for their priority, on the event loop, in the same step as
    their grammar was handed to a thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.entered: list[SamplingParams] = []
        self.threads: list[threading.Thread] = []
        self.arrived: list[str] = []
        prepare, priority = Grammars.prepare, openai_api._priority

        def held(grammars: Grammars, params: SamplingParams) -> None:
            self.threads.append(threading.current_thread())
            self.entered.append(params)
            self.release.wait(120)
            prepare(grammars, params)

        def counted(*args: Any) -> str:
            self.arrived.append(priority(*args))
            return self.arrived[-1]

        monkeypatch.setattr(Grammars, "prepare", held)
        monkeypatch.setattr(openai_api, "_priority", counted)


def schema_chat(tag: str) -> dict[str, Any]:
    """A chat request held to a schema of its own (`tag`), for the `openai` client."""
    schema = {"name": "thing", "schema": bounded(tag)}
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Describe a thing as JSON."}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": schema},
    }


def hanging_up(url: str, body: dict[str, Any]) -> socket.socket:
    """POST /v1/chat/completions on a raw socket, its answer left unread: the caller hangs up
    by closing it, as a client that gave up does."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def answered(svc: Service, status: int) -> float:
    """The chat requests answered with `status` (kvguard_http_requests)."""
    labels = {"route": "/v1/chat/completions", "status": str(status)}
    return svc.metrics.registry.get_sample_value("kvguard_http_requests_total", labels) or 0.0


def test_a_client_gone_while_its_schema_waits_for_a_worker_is_not_compiled(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that hung up while its schema waited for a compile worker (one on a 2-CPU
    host) still had it compiled, in front of every other client's schemas: N slow schemas
    posted and their sockets closed queued N compiles of seconds each. Now the request ends
    (499) as its client hangs up, and its compile, not started, never runs."""
    svc = loaded(tmp_path)
    held = HeldPrepare(monkeypatch)
    workers = openai_api.grammar_workers()
    pool = ThreadPoolExecutor(workers)
    try:
        with serving(svc) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
            busy = [
                pool.submit(client.chat.completions.create, **schema_chat(f"busy {i}"))
                for i in range(workers)
            ]
            until(lambda: len(held.entered) == workers, 60, "every compile worker busy")
            sock = hanging_up(url, schema_chat("gone"))
            # it asked for its priority in the step that queued its compile (`HeldPrepare`)
            until(lambda: len(held.arrived) == workers + 1, 60, "the last one queued")
            sock.close()
            until(lambda: answered(svc, 499) == 1, 30, "the request of the client gone ended")
            held.release.set()
            for f in busy:
                assert f.result(120).choices[0].finish_reason in ("stop", "length")
            assert len(held.entered) == workers  # the gone client's schema was not compiled
    finally:
        held.release.set()
        pool.shutdown(cancel_futures=True)
        svc.close()


def test_the_compile_workers_end_with_the_service(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile workers outlived the service that made them (one pool per app, never shut
    down): the interpreter's exit waited for them. Now the service's close shuts them down:
    with every worker held in a compile and one more waiting, the one waiting never runs
    (503), and the workers end once the compiles they hold are done (503: the service closed
    meanwhile)."""
    svc = loaded(tmp_path)
    held = HeldPrepare(monkeypatch)
    workers = openai_api.grammar_workers()
    pool = ThreadPoolExecutor(workers + 1)
    try:
        with serving(svc) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
            asked = [
                pool.submit(client.chat.completions.create, **schema_chat(f"closing {i}"))
                for i in range(workers + 1)
            ]
            until(
                lambda: len(held.entered) == workers and len(held.arrived) == workers + 1,
                60,
                "every worker compiling, one more queued",
            )
            svc.close()
            held.release.set()
            for f in asked:
                with pytest.raises(openai.APIStatusError) as e:
                    f.result(120)
                assert e.value.status_code == 503, e.value.message
            until(lambda: not any(t.is_alive() for t in held.threads), 30, "the workers ended")
            assert len(held.entered) == workers  # the one queued never compiled
    finally:
        held.release.set()
        pool.shutdown(cancel_futures=True)
        svc.close()


def test_grammars_compiling_hold_neither_a_reload_nor_tokenize(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grammar preparation ran on asyncio's default executor, which also runs POST
    /admin/reload, /tokenize, large bodies' parsing and SIGHUP's reload: one client's slow
    schemas in flight (8 here, its threads 6) held the operator's reload (8.6 s measured) and
    every /tokenize until they were done. Now grammars are prepared on workers of their own,
    `grammar_workers()` of them at once: while 8 are held in their compile, a reload and a
    /tokenize are answered, and no more than that many compiles run."""
    svc = loaded(tmp_path)
    held = HeldPrepare(monkeypatch)
    compiling = DEFAULT_EXECUTOR + 2  # past the default executor's threads
    pool = ThreadPoolExecutor(compiling)
    try:
        with serving(svc) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
            asked = [
                pool.submit(client.chat.completions.create, **schema_chat(f"held {i}"))
                for i in range(compiling)
            ]
            # each handed its grammar to a thread as it arrived: a reload asked now comes after
            # all of them (an executor takes its work in order)
            until(
                lambda: (
                    any(f.done() for f in asked)
                    or (len(held.arrived) == compiling and len(held.entered) > 0)
                ),
                60,
                f"{compiling} requests at their grammar, one compiling",
            )
            assert [f.exception() for f in asked if f.done()] == []
            admin = {"Authorization": f"Bearer {TOKEN}"}
            reload = httpx.post(url + "/admin/reload", headers=admin, timeout=30)
            assert reload.status_code == 200, reload.text
            tokenize = httpx.post(
                url + "/tokenize", json={"model": "tiny", "prompt": "hello"}, timeout=30
            )
            assert tokenize.status_code == 200 and tokenize.json()["count"] > 0, tokenize.text
            assert not any(f.done() for f in asked)  # all still held in (or waiting for) a compile
            at_once = min(compiling, openai_api.grammar_workers())
            until(lambda: len(held.entered) >= at_once, 60, f"{at_once} compiling")
            assert len(held.entered) == at_once  # the rest wait for a worker
            held.release.set()
            for f in asked:
                assert f.result(120).choices[0].finish_reason in ("stop", "length")
            assert len(held.entered) == compiling
    finally:
        held.release.set()
        pool.shutdown(cancel_futures=True)
        svc.close()


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


JSON_OBJECT = {  # a chat answer whose matcher is built once and kept
    "model": "tiny",
    "messages": [{"role": "user", "content": "A thing as JSON."}],
    "max_tokens": 4,
    "response_format": {"type": "json_object"},
}


def test_a_request_whose_matcher_is_kept_does_not_wait_behind_compiles(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiles wait their turn for a worker in arrival order: a json_object answer, whose
    matcher is built once and kept, waited behind another client's slow schemas (12.8 s
    measured) for no compile at all. Now a request whose matcher is kept skips the workers:
    with every worker held in a compile and more waiting, it is answered."""
    svc = loaded(tmp_path)
    pool = ThreadPoolExecutor(openai_api.grammar_workers() + 2)
    try:
        with serving(svc) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
            client.chat.completions.create(**JSON_OBJECT)  # its matcher built and kept
            held = HeldPrepare(monkeypatch)
            asked = [
                pool.submit(client.chat.completions.create, **schema_chat(f"slow {i}"))
                for i in range(openai_api.grammar_workers() + 1)
            ]
            workers = openai_api.grammar_workers()
            until(lambda: len(held.entered) >= workers, 60, f"{workers} compiling")
            answer = pool.submit(client.chat.completions.create, **JSON_OBJECT).result(60)
            assert answer.choices[0].finish_reason in ("stop", "length")
            assert not any(f.done() for f in asked)  # the slow ones still held
            held.release.set()
            for f in asked:
                assert f.result(120).choices[0].finish_reason in ("stop", "length")
    finally:
        pool.shutdown(cancel_futures=True)
        svc.close()


def test_a_kept_matcher_is_found_without_a_thread_of_the_default_executor(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a request's matcher is kept (`Grammars.prepared`: a dict lookup and the schema's
    json.dumps) was asked on asyncio's default executor, the threads the compile workers keep
    free for reloads, /tokenize and large bodies: every schema request waited for one. Now it
    is asked on the event loop (for a body under LARGE_BODY_BYTES): with every thread of the
    default executor held (log-probability requests, in their tokenizer view), a json_object
    request is answered."""
    svc = loaded(tmp_path)
    release = threading.Event()
    holding: list[threading.Thread] = []
    view = Grammars.view

    def held_view(grammars: Grammars) -> Any:
        holding.append(threading.current_thread())
        release.wait(120)
        return view(grammars)

    pool = ThreadPoolExecutor(DEFAULT_EXECUTOR + 1)
    try:
        with serving(svc) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
            client.chat.completions.create(**JSON_OBJECT)  # its matcher built and kept
            monkeypatch.setattr(Grammars, "view", held_view)
            busy = [
                pool.submit(
                    client.completions.create, model="tiny", prompt="x", max_tokens=2, logprobs=1
                )
                for _ in range(DEFAULT_EXECUTOR)
            ]
            until(lambda: len(holding) == DEFAULT_EXECUTOR, 60, "the default executor held")
            answer = pool.submit(client.chat.completions.create, **JSON_OBJECT).result(30)
            assert answer.choices[0].finish_reason in ("stop", "length")
            assert not any(f.done() for f in busy)  # still held
            release.set()
            for f in busy:
                assert f.result(60).choices[0].logprobs is not None
    finally:
        release.set()
        pool.shutdown(cancel_futures=True)
        svc.close()
