"""API keys (daemon/api_keys.py): who may call the OpenAI endpoints, at which priority.

Through a real daemon, the real `openai` client and real HTTP: no key or a wrong key is a 401
naming the problem; a key may not ask for a priority above its `max_priority` (403), and a
request that names none runs at the key's default; health, readiness and metrics stay open;
the admin API keeps its own token; SIGHUP applies a new keys file and refuses a broken one,
keeping the keys in force. The `kvguard keys` commands make, list, revoke and hash keys."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvguard.daemon import openai_api
from kvguard.daemon.api_keys import KeysFileError, digest, load_keys, read_entries
from kvguard.daemon.cli import main
from kvguard.daemon.openai_schemas import CompletionRequest
from tests.test_disconnect import count, finished, idle, send, state
from tests.test_grammar_prepare import TOKEN, HeldPrepare, loaded, schema_chat, serving
from tests.test_server import KVGUARD, Daemon, serve_refused, until

KINDS = ("prompt", "completion")
REFUSALS = "kvguard_api_key_refusals_total"
# what `kvguard keys add` says a name must look like when it refuses its NAME
NAME_FORM = "a name is 1 to 64 letters, digits, '.', '_' or '-', the first a letter or digit"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def add(path: Path, name: str, *flags: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["keys", "--file", str(path), "add", name, *flags]) == 0
    return capsys.readouterr().out.strip()


def metric(d: Daemon, name: str, **labels: str) -> float:
    value = series(d, name, **labels)
    return 0.0 if value is None else value


def series(d: Daemon, name: str, **labels: str) -> float | None:
    """The sample's value; None where /metrics has no such series."""
    text = httpx.get(d.url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = rf"^{re.escape(name)}{re.escape('{' + want + '}') if want else ''} (\S+)$"
    m = re.search(pat, text, re.M)
    return float(m.group(1)) if m else None


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - (Daemon, keys by name)
    tmp = tmp_path_factory.mktemp("keys")
    path = tmp / "api_keys.yaml"
    keys = {}
    for name, flags in (
        ("web", ["--max-priority", "high"]),
        ("batch", ["--max-priority", "low"]),
        ("mid", []),
        ("capped", ["--max-requests", "2"]),
        ("idle", []),  # never used: its series must be there all the same
    ):
        proc = subprocess.run(
            [KVGUARD, "keys", "--file", str(path), "add", name, *flags],
            capture_output=True,
            text=True,
            check=True,
        )
        keys[name] = proc.stdout.strip()
        assert "reload the daemon" in proc.stderr
    d = Daemon(tmp, api=f"api_keys_file: {path}", debug_hooks=False)
    yield d, keys, path
    assert d.stop() == 0


def client(d: Daemon, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_every_key_and_refusal_reason_is_exported_from_0(keyed) -> None:  # noqa: ANN001
    """Before, a key's series (and a refusal reason's) were made by its first use, born at 1
    and at its first request's tokens: Prometheus' increase() and rate() never count a series'
    first sample, so each key's first request was missing from charge-back queries."""
    d, _, _ = keyed
    assert series(d, "kvguard_api_key_requests_total", key="idle") == 0
    for kind in KINDS:
        assert series(d, "kvguard_api_key_tokens_total", key="idle", kind=kind) == 0, kind
    for reason in ("missing", "unknown", "priority", "max_requests"):
        assert series(d, "kvguard_api_auth_failures_total", reason=reason) is not None, reason
    for reason in ("priority", "max_requests"):  # and which key was refused, from 0 too
        assert series(d, REFUSALS, key="idle", reason=reason) == 0, reason


def test_no_key_or_a_wrong_key_is_refused_with_401(keyed) -> None:  # noqa: ANN001
    d, keys, _ = keyed
    before = metric(d, "kvguard_api_auth_failures_total", reason="missing")
    r = httpx.post(d.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    assert metric(d, "kvguard_api_auth_failures_total", reason="missing") == before + 1
    with pytest.raises(openai.AuthenticationError) as e:
        client(d, "kvg-not-a-key").chat.completions.create(**CHAT)
    assert e.value.status_code == 401 and "incorrect API key" in e.value.message
    assert metric(d, "kvguard_api_auth_failures_total", reason="unknown") >= 1
    # every OpenAI endpoint, before its body is even looked at
    for method, path, body in (
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/tiny", None),
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "x"}),
        ("POST", "/v1/completions", {"not": "a request"}),
        ("POST", "/tokenize", {"model": "tiny", "prompt": "x"}),
        ("POST", "/detokenize", {"model": "tiny", "tokens": [1]}),
    ):
        assert httpx.request(method, d.url + path, json=body).status_code == 401, path
    # not even read: a body that is not JSON gets the same 401 (one over the size limit gets
    # 413 from its Content-Length alone)
    before = metric(d, "kvguard_api_auth_failures_total", reason="missing")
    junk = {"Content-Type": "application/json"}
    r = httpx.post(d.url + "/v1/completions", content=b"{bad", headers=junk)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert metric(d, "kvguard_api_auth_failures_total", reason="missing") == before + 1
    assert metric(d, "kvguard_http_requests_total", route="/v1/completions", status="401") >= 1
    r = httpx.post(d.url + "/v1/completions", content=b"x" * (17 << 20), headers=junk)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    auth = {"Authorization": "Basic " + keys["web"]}  # the right secret, the wrong scheme
    assert httpx.post(d.url + "/v1/chat/completions", json=CHAT, headers=auth).status_code == 401


def test_health_ready_metrics_stay_open_and_admin_keeps_its_token(keyed) -> None:  # noqa: ANN001
    d, keys, _ = keyed
    token = Path(d.log.name).parent / "admin.token"
    status = subprocess.run(
        [KVGUARD, "status", "--url", d.url, "--token-file", str(token)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert re.search(r"^api keys     \d+ from .*api_keys\.yaml$", status, re.M), status
    assert re.search(r"^host memory  \d+\.\d% used$", status, re.M), status
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(d.url + path).status_code == 200, path
    assert d.admin("GET", "/admin/state").status_code == 200
    api_key = {"Authorization": f"Bearer {keys['web']}"}
    # an API key is no admin token: 401, as any wrong bearer token
    assert httpx.get(d.url + "/admin/state", headers=api_key).status_code == 401


def test_a_key_is_held_to_its_max_priority_and_runs_at_its_default(keyed) -> None:  # noqa: ANN001
    d, keys, _ = keyed
    served = {
        p: metric(d, "kvguard_request_duration_seconds_count", priority=p)
        for p in ("high", "normal", "low")
    }
    web = client(d, keys["web"])
    assert web.models.list().data[0].id == "tiny"
    web.chat.completions.create(**CHAT, extra_body={"priority": "high"})  # allowed
    web.chat.completions.create(**CHAT)  # no priority: normal
    batch = client(d, keys["batch"])
    with pytest.raises(openai.PermissionDeniedError) as e:
        batch.chat.completions.create(**CHAT, extra_headers={"X-Priority": "normal"})
    assert e.value.status_code == 403
    assert "API key 'batch' may ask for low priority at most" in e.value.message
    assert e.value.body["code"] == "priority_not_allowed" and e.value.body["param"] == "priority"
    batch.completions.create(model="tiny", prompt="x", max_tokens=2)  # no priority: low
    mid = client(d, keys["mid"])
    with pytest.raises(openai.PermissionDeniedError):
        mid.chat.completions.create(**CHAT, extra_body={"priority": "high"})
    mid.chat.completions.create(**CHAT, extra_body={"priority": "low"})
    after = {p: metric(d, "kvguard_request_duration_seconds_count", priority=p) for p in served}
    assert {p: after[p] - served[p] for p in served} == {"high": 1, "normal": 1, "low": 2}
    # served, for charge-back: batch's 403 is a refusal (by key too), not a request served
    assert metric(d, "kvguard_api_key_requests_total", key="batch") == 1
    assert metric(d, "kvguard_api_auth_failures_total", reason="priority") == 2
    assert metric(d, REFUSALS, key="batch", reason="priority") == 1
    assert metric(d, REFUSALS, key="mid", reason="priority") == 1


def test_a_key_is_held_to_its_max_requests_and_others_are_not(keyed) -> None:  # noqa: ANN001
    d, keys, _ = keyed
    capped = client(d, keys["capped"])
    served = metric(d, "kvguard_api_key_requests_total", key="capped")
    # 3 choices: past the limit of 2 at once however long it waits, so not a 429 to retry
    with pytest.raises(openai.BadRequestError) as e:
        capped.completions.create(model="tiny", prompt="x", max_tokens=2, n=3)
    assert "asks for 3 sequences and API key 'capped' may have 2 at once" in e.value.message
    assert e.value.body["code"] == "key_request_limit" and e.value.body["param"] == "n"
    assert "Retry-After" not in e.value.response.headers
    with pytest.raises(openai.BadRequestError) as e:  # three prompts: the same, named so
        capped.completions.create(model="tiny", prompt=["x", "y", "z"], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    held = [send(d, {"prompt": "hold", "max_tokens": 400, "stream": True}, keys["capped"])]
    held.append(send(d, {"prompt": "hold", "max_tokens": 400}, keys["capped"]))
    try:
        until(lambda: count(state(d), "running") == 2, 60, "two requests of the key running")
        with pytest.raises(openai.RateLimitError) as e:
            capped.chat.completions.create(**CHAT)
        assert "has 2 sequences (choices) queued or running and may have 2 at once" in (
            e.value.message
        )
        assert e.value.body["code"] == "key_request_limit"
        client(d, keys["mid"]).chat.completions.create(**CHAT)  # another key is not held back
        # the two held were served; the two 400s and the 429 were not, and are by key instead
        assert metric(d, "kvguard_api_key_requests_total", key="capped") - served == 2
        assert metric(d, REFUSALS, key="capped", reason="max_requests") == 3
        assert metric(d, REFUSALS, key="mid", reason="max_requests") == 0
    finally:
        for sock in held:
            sock.close()
    until(lambda: idle(state(d)), 30, "the held requests aborted")
    until(lambda: _answers(capped), 30, "the key served again")
    assert metric(d, "kvguard_api_auth_failures_total", reason="max_requests") >= 3
    # one request of n=2 holds both slots: the 429 counts sequences, not requests
    held = [send(d, {"prompt": "hold", "max_tokens": 400, "stream": True, "n": 2}, keys["capped"])]
    try:
        until(lambda: count(state(d), "running") == 2, 60, "the n=2 request's choices running")
        with pytest.raises(openai.RateLimitError) as e:
            capped.chat.completions.create(**CHAT)
        assert (
            "API key 'capped' has 2 sequences (choices) queued or running and may have 2 at "
            "once (max_requests); this one asks for 1"
        ) in e.value.message
    finally:
        held[0].close()
    until(lambda: idle(state(d)), 30, "the held request aborted")


def _answers(c: openai.OpenAI) -> bool:
    """Whether a request with this client is served now (its key's slots are free)."""
    try:
        c.chat.completions.create(**CHAT)
    except openai.RateLimitError:
        return False
    return True


def test_a_client_gone_before_a_stalled_engine_took_its_request_frees_its_key_slot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client that hung up while its request waited for the engine thread (a long step, here
    the debug stall) kept its key's max_requests slot until the engine took the request and
    aborted it: its tenant was refused 429 meanwhile, for no one. Now the request is withdrawn
    (never started) and the slot comes back at once, while the engine is still stalled."""
    path = tmp_path / "api_keys.yaml"
    key = add(path, "one", "--max-requests", "1", capsys=capsys)
    d = Daemon(tmp_path, api=f"api_keys_file: {path}")
    pool = ThreadPoolExecutor(1)
    try:
        one = client(d, key)
        aborted = finished(d, "abort")
        assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
        sock = send(d, {"prompt": "hold", "max_tokens": 4}, key)
        until(lambda: state(d)["in_flight"] == 1, 30, "the request posted to the stalled engine")
        with pytest.raises(openai.RateLimitError):  # it holds the key's one slot
            one.chat.completions.create(**CHAT)
        sock.close()
        until(lambda: state(d)["in_flight"] == 0, 30, "the request withdrawn, engine stalled")
        probe = pool.submit(one.chat.completions.create, **CHAT)  # the slot is free: not a 429
        until(lambda: probe.done() or state(d)["in_flight"] == 1, 30, "the next request posted")
        assert d.admin("POST", "/admin/debug/release").json() == {"released": 1}  # still held
        assert probe.result().choices[0].message.content is not None
        until(lambda: idle(state(d)), 30, "the engine idle")
        assert metric(d, "kvguard_api_key_requests_total", key="one") == 1  # the probe only
        assert finished(d, "abort") == aborted  # the withdrawn request never reached the engine
    finally:
        pool.shutdown(cancel_futures=True)
        assert d.stop() == 0


def test_while_admission_is_halted_requests_past_a_keys_limit_get_the_halts_503(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Six requests of a key that may have two at once, while admission is halted for normal
    and the engine is stalled (the debug hook): two wait for the engine to decide, and fill
    the key's slots. The four others used to get 429 key_request_limit ("has 2 sequences
    queued or running") with Retry-After 1, counted as the key's refusals, though the halt
    refuses all six and nothing of the key's was queued or running: the tenant was blamed
    and told to come back five times sooner than the halt asks. Now all six get the halt's
    503 and Retry-After, and no refusal is counted against the key."""
    path = tmp_path / "api_keys.yaml"
    key = add(path, "two", "--max-requests", "2", capsys=capsys)
    d = Daemon(tmp_path, api=f"api_keys_file: {path}")
    pool = ThreadPoolExecutor(6)
    try:
        two = client(d, key)
        halt = d.admin("POST", "/admin/actions/halt_admission", json={"allow_priority": "high"})
        assert halt.status_code == 200, halt.text
        assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
        try:
            asked = [
                pool.submit(two.completions.create, model="tiny", prompt=f"r{i}", max_tokens=2)
                for i in range(6)
            ]
            until(
                lambda: state(d)["in_flight"] == 2 and sum(f.done() for f in asked) == 4,
                30,
                "two requests posted to the stalled engine, four answered",
            )
        finally:
            d.admin("POST", "/admin/debug/release")
        refused = []
        for f in asked:
            with pytest.raises(openai.APIStatusError) as e:
                f.result(60)
            refused.append(e.value)
        assert [e.status_code for e in refused] == [503] * 6, [e.message for e in refused]
        for e in refused:
            assert "admission is halted: only high requests" in e.message, e.message
            assert e.response.headers["retry-after"] == "5"
        assert metric(d, REFUSALS, key="two", reason="max_requests") == 0
        assert metric(d, "kvguard_api_auth_failures_total", reason="max_requests") == 0
    finally:
        pool.shutdown(cancel_futures=True)
        assert d.stop() == 0


def test_a_keys_schema_requests_past_its_limit_are_refused_before_any_is_compiled(
    tiny_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key's max_requests was checked only after the request's grammar was compiled: a key
    that may have 2 at once sending 6 slow schemas had all 6 compiled (14-18 s of CPU each)
    before any was refused. Now the key is checked first, and a request whose grammar is being
    compiled counts against it: with the first request's compile held, the second is a 429 at
    once and never compiled. The slot comes back however the compile ends (served, refused)."""
    path = tmp_path / "api_keys.yaml"
    key = add(path, "one", "--max-requests", "1", capsys=capsys)
    svc = loaded(tmp_path, api=f"api_keys_file: {path}")
    held = HeldPrepare(monkeypatch)
    pool = ThreadPoolExecutor(2)
    try:
        with serving(svc) as url:
            one = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
            first = pool.submit(one.chat.completions.create, **schema_chat("key first"))
            until(lambda: held.entered or first.done(), 60, "the first request compiling")
            second = pool.submit(one.chat.completions.create, **schema_chat("key second"))
            until(lambda: second.done() or len(held.entered) > 1, 60, "the second answered")
            assert len(held.entered) == 1  # the second was not compiled
            with pytest.raises(openai.RateLimitError) as e:
                second.result()
            assert (
                "API key 'one' has 1 sequence (choice) queued or running and may have 1 at "
                "once (max_requests); this one asks for 1"
            ) in e.value.message
            assert e.value.body["code"] == "key_request_limit"
            assert not first.done()
            held.release.set()
            assert first.result(60).choices[0].finish_reason in ("stop", "length")
            refused = schema_chat("key refused")  # under tools: refused on its own, named
            refused["response_format"]["json_schema"]["schema"] = {"enum": []}
            refused["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            with pytest.raises(openai.BadRequestError) as e:
                one.chat.completions.create(**refused)
            assert e.value.body["param"] == "response_format", e.value.message
            assert "anyOf is empty" in e.value.message
            assert one.chat.completions.create(**schema_chat("key again")).choices
    finally:
        held.release.set()
        pool.shutdown(cancel_futures=True)
        svc.close()


def let_in_together(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Requests held once their body is parsed until `count` have arrived, then let go in one
    event-loop step: sent at once from threads, they reach the server some milliseconds apart,
    and whether one is checked while another awaits would be a matter of luck."""
    parse = openai_api._parse_body
    arrived: list[Any] = []  # their requests
    gate: list[asyncio.Event] = []  # made on the server's event loop

    async def held(*args: Any) -> None:
        await parse(*args)
        if not gate:
            gate.append(asyncio.Event())
        arrived.append(args[1])
        if len(arrived) == count:
            gate[0].set()
        await gate[0].wait()

    monkeypatch.setattr(openai_api, "_parse_body", held)


def _asked(one: openai.OpenAI, kind: str, i: int) -> object:
    """Request `i` of a key's flood: a completion with log-probabilities (the tokenizer view
    awaited before it is posted) or a chat answer held to a schema of its own (its compile)."""
    if kind == "logprobs":
        return one.completions.create(model="tiny", prompt=f"p{i}", max_tokens=2, logprobs=1)
    return one.chat.completions.create(**schema_chat(f"flood {i}"))


@pytest.mark.parametrize("kind", ["logprobs", "schema"])
def test_concurrent_requests_of_a_key_are_held_to_its_max_requests(
    kind: str,
    tiny_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key's max_requests was checked before the request awaited its grammar's compile (or
    the tokenizer view its log-probabilities need), and the request counted only once posted
    to the engine: every request of the key checked meanwhile passed (6 of 6 served for a key
    that may have 1 at once). Now its slots are taken in the step that checks them: with the
    engine stalled (the debug hook), so that none finishes, 6 requests let in together give 1
    posted to the engine and 5 429s."""
    path = tmp_path / "api_keys.yaml"
    key = add(path, "one", "--max-requests", "1", capsys=capsys)
    svc = loaded(tmp_path, api=f"api_keys_file: {path}, debug_hooks: true")
    pool = ThreadPoolExecutor(6)
    let_in_together(monkeypatch, 6)
    try:
        with serving(svc) as url:
            admin = {"Authorization": f"Bearer {TOKEN}"}
            stall = httpx.post(url + "/admin/debug/stall", json={"seconds": 60}, headers=admin)
            assert stall.status_code == 200, stall.text
            one = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
            try:
                asked = [pool.submit(_asked, one, kind, i) for i in range(6)]
                until(
                    lambda: svc.loop.in_flight() + sum(f.done() for f in asked) == 6,
                    60,
                    "each request posted to the stalled engine or answered",
                )
            finally:
                httpx.post(url + "/admin/debug/release", headers=admin)
            refused = []
            for f in asked:
                try:
                    f.result(60)
                except openai.RateLimitError as e:
                    refused.append(e)
            assert len(refused) == 5, f"{6 - len(refused)} of 6 served, max_requests 1"
            for e in refused:
                assert e.body["code"] == "key_request_limit", e.message
                assert "API key 'one' has 1 sequence (choice) queued or running" in e.message
    finally:
        pool.shutdown(cancel_futures=True)
        svc.close()


def test_a_refusal_naming_no_prompt_of_a_list_names_the_field() -> None:
    """A prompt's refusal of a list of prompts names the one refused (`prompt[1]`: the engine
    says which, `request_index`); one the engine raised without saying which was named
    `prompt[0]`, blaming a prompt that may be fine: it names the field, `prompt`."""
    body = CompletionRequest(model="tiny", prompt=["fine", "refused"])
    which = ValueError("prompt is empty")
    which.request_index = 2  # type: ignore[attr-defined] - the third choice: n=2, prompt 1
    assert openai_api._refused_prompt(body, which, 2, True) == "prompt[1]"
    unnamed = ValueError("prompt is not one kvguard can serve")
    assert openai_api._refused_prompt(body, unnamed, 2, True) == "prompt"


def test_each_key_is_charged_the_tokens_its_requests_were_served(keyed) -> None:  # noqa: ANN001
    d, keys, _ = keyed

    def charged() -> tuple[float, float]:
        return tuple(
            metric(d, "kvguard_api_key_tokens_total", key="mid", kind=k)
            for k in ("prompt", "completion")
        )

    mid = client(d, keys["mid"])
    before = charged()
    r = mid.completions.create(model="tiny", prompt=["one two", "three"], max_tokens=3, n=2)
    chunks = mid.chat.completions.create(
        **{**CHAT, "max_tokens": 4}, stream=True, stream_options={"include_usage": True}
    )
    streamed = [c.usage for c in chunks if c.usage is not None][0]
    after = charged()
    want = (
        r.usage.prompt_tokens + streamed.prompt_tokens,
        r.usage.completion_tokens + streamed.completion_tokens,
    )
    assert (after[0] - before[0], after[1] - before[1]) == want
    assert want[1] == 2 * 2 * 3 + 4  # 2 prompts x 2 choices x 3 tokens, then 4


def test_a_key_is_charged_what_was_generated_for_a_client_that_hung_up(keyed) -> None:  # noqa: ANN001
    d, keys, _ = keyed
    mid = client(d, keys["mid"])
    prompt = mid.chat.completions.create(**{**CHAT, "max_tokens": 1}).usage.prompt_tokens
    before = [metric(d, "kvguard_api_key_tokens_total", key="mid", kind=k) for k in KINDS]
    chunks = mid.chat.completions.create(
        **{**CHAT, "max_tokens": 400}, stream=True, extra_body={"ignore_eos": True}
    )
    got = 0
    for c in chunks:
        got += bool(c.choices and c.choices[0].delta.content)
        if got == 5:
            break
    chunks.close()  # the client hangs up: the request is aborted with what it had generated

    def charged() -> list[float]:  # as the aborted request's last output comes
        return [metric(d, "kvguard_api_key_tokens_total", key="mid", kind=k) for k in KINDS]

    until(lambda: charged()[1] > before[1], 30, "the abandoned request charged")
    after = charged()  # the prompt is charged before the completion
    assert after[0] - before[0] == prompt
    assert after[1] - before[1] >= 5  # what it had generated (all 400 if it ended first)


def test_sighup_applies_a_new_keys_file_and_refuses_a_broken_one(keyed, capsys) -> None:  # noqa: ANN001
    d, keys, path = keyed
    good, n = path.read_text(), len(read_entries(path)[0])
    fresh = add(path, "fresh", capsys=capsys)
    assert fresh.startswith("kvg-") and len(fresh) > 40
    with pytest.raises(openai.AuthenticationError):  # not in force before the reload
        client(d, fresh).chat.completions.create(**CHAT)
    r = d.admin("POST", "/admin/reload").json()
    assert r["reloaded"] and "api.api_keys_file" in r["changes"]
    # the new key's series from 0, before its first request (which increase() then counts)
    assert series(d, "kvguard_api_key_requests_total", key="fresh") == 0
    assert series(d, "kvguard_api_key_tokens_total", key="fresh", kind="prompt") == 0
    client(d, fresh).chat.completions.create(**CHAT)
    assert series(d, "kvguard_api_key_requests_total", key="fresh") == 1
    path.write_text(good + "  - name: broken\n    sha256: nothex\n")
    d.proc.send_signal(signal.SIGHUP)
    log = Path(d.log.name)
    until(lambda: f"keys[{n}].sha256" in log.read_text(), 20, "the refused reload logged")
    assert "reload refused, keeping the running config" in log.read_text()
    client(d, fresh).chat.completions.create(**CHAT)  # the keys in force stay
    client(d, keys["web"]).chat.completions.create(**CHAT)
    path.write_text(good)  # `fresh` revoked
    assert d.admin("POST", "/admin/reload").json()["reloaded"]
    with pytest.raises(openai.AuthenticationError):
        client(d, fresh).chat.completions.create(**CHAT)


def test_a_missing_or_broken_keys_file_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    cfg = tmp_path / "config.yaml"
    for body, said in (
        (None, f"{cfg}:2: api.api_keys_file: cannot read {path}: No such file or directory"),
        ("keys:\n  - name: a\n    sha256: abc\n", ":3: keys[0].sha256"),
    ):
        if body is not None:
            path.write_text(body)
        cfg.write_text(f"serving: {{model: tiny}}\napi: {{port: 0, api_keys_file: {path}}}\n")
        proc = serve_refused(cfg)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr


def test_keys_file_problems_are_named_by_line(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    ok = digest("a")
    path.write_text(
        "keys:\n"
        "  - name: a\n"
        f"    sha256: {ok}\n"
        "    max_priority: top\n"
        "    colour: red\n"
        f"  - {{name: a, sha256: {digest('b')}, max_priority: low, default_priority: high}}\n"
    )
    with pytest.raises(KeysFileError) as e:
        load_keys(path)
    assert e.value.errors == [
        f"{path}:4: keys[0].max_priority: not allowed (expected high, normal or low)",
        f"{path}:5: keys[0]: unknown key (expected one of: name, sha256, max_priority, "
        "default_priority, max_requests)",
        f"{path}:6: keys[1]: default_priority high is above max_priority low",
    ]
    path.write_text(f"keys:\n  - {{name: a, sha256: {ok}}}\n  - {{name: a, sha256: {ok}}}\n")
    with pytest.raises(KeysFileError) as e:
        load_keys(path)
    assert e.value.errors == [
        f"{path}:3: name given twice (first in keys[0])",
        f"{path}:3: sha256 given twice (first in keys[0])",
    ]
    path.write_text("- just a list\n")
    with pytest.raises(KeysFileError, match="expected a mapping with a `keys` list"):
        load_keys(path)


def test_a_key_given_as_a_name_is_refused_and_never_published(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key's name is published (the `key` label on the open /metrics, `kvguard keys list`):
    a key pasted into `name:`, or given to `kvguard keys add` as its name, loaded and was shown
    to anyone. Refused by line and field as a key in any other field is, never quoted; a long
    name a person writes still loads. `kvguard keys add` refusing its NAME so prefixed the
    error with the file, nothing in which was wrong, and spoke of the digests the file holds:
    it names its NAME argument and what a name must look like."""
    key = add(tmp_path / "made.yaml", "web", capsys=capsys)  # a key as `keys add` prints it
    other = "sk-SECRETfromAnotherServer0123456789"  # one made elsewhere (`keys hash`)
    path = tmp_path / "k.yaml"
    hint = (
        "looks like an API key, and a key's name is shown to anyone (the `key` label on "
        "/metrics, `kvguard keys list`): name the key for its client instead (web-frontend); "
        "a raw API key? The file holds SHA-256 digests, never keys"
    )
    for name in (key, other):
        path.write_text(f"keys:\n  - name: web\n    sha256: {digest('a')}\n")
        path.write_text(path.read_text() + f"  - name: {name}\n    sha256: {digest(name)}\n")
        with pytest.raises(KeysFileError) as e:
            load_keys(path)
        [error] = e.value.errors
        assert error.startswith(f"{path}:4: keys[1].name: {hint}"), error
        assert name not in error
        assert main(["keys", "--file", str(path), "list"]) == 2
        err = capsys.readouterr().err
        assert f"{path}:4: keys[1].name: {hint}" in err and name not in err, err
    fresh = tmp_path / "new.yaml"
    assert main(["keys", "--file", str(fresh), "add", key]) == 2
    err = capsys.readouterr().err
    assert f"error: the NAME argument: {hint.split('; a raw')[0]}; {NAME_FORM}\n" in err, err
    assert key not in err and str(fresh) not in err and "raw API key" not in err, err
    assert not fresh.exists()
    long_name = "nightly-batch-eu-west-1-reporting"
    assert add(fresh, long_name, capsys=capsys).startswith("kvg-")
    assert [e.name for e in read_entries(fresh)[0]] == [long_name]


def test_a_name_refused_for_its_length_or_characters_is_not_called_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A long name, or one with a `/`, is refused for that alone: asking "a raw API key?"
    would send its writer to `kvguard keys add NAME`, the command that refused it."""
    path = tmp_path / "k.yaml"
    for name, problem in (
        (
            "nightly-batch-reporting-pipeline-europe-west-1-production-cluster",
            "string should have at most 64",
        ),
        ("team-a/nightly-batch-prod", "not allowed; a name is"),
    ):
        assert main(["keys", "--file", str(path), "add", name]) == 2
        err = capsys.readouterr().err
        assert f"error: the NAME argument: {problem}" in err and NAME_FORM in err, err
        assert str(path) not in err and "raw API key" not in err, err
        path.write_text(f"keys:\n  - name: {name}\n    sha256: {digest('a')}\n")
        with pytest.raises(KeysFileError) as e:
            load_keys(path)
        [error] = e.value.errors
        assert error.startswith(f"{path}:2: keys[0].name: ") and "raw API key" not in error
        path.unlink()


def test_keys_file_values_are_not_coerced(tmp_path: Path) -> None:
    """Strict, as the config file's sections: `max_requests: true` is not a limit of 1, nor
    "5" or 5.0 one of 5, and a number is no name; each is named by line, for the daemon and
    for `kvguard keys list` alike."""
    path = tmp_path / "k.yaml"
    ok = digest("a")
    for value, said in (
        ("true", "a boolean True"),
        ('"5"', "a string"),
        ("5.0", "a number 5.0"),
    ):
        path.write_text(f"keys:\n  - name: a\n    sha256: {ok}\n    max_requests: {value}\n")
        want = f"{path}:4: keys[0].max_requests: {said} (expected an integer)"
        with pytest.raises(KeysFileError) as e:
            load_keys(path)
        assert e.value.errors == [want]
        proc = subprocess.run(
            [KVGUARD, "keys", "--file", str(path), "list"], capture_output=True, text=True
        )
        assert proc.returncode == 2 and proc.stderr == f"kvguard: error: {want}\n", proc.stderr
    path.write_text(f"keys:\n  - {{name: 7, sha256: {ok}}}\n")
    with pytest.raises(KeysFileError) as e:
        load_keys(path)
    assert e.value.errors == [f"{path}:2: keys[0].name: a number 7 (expected a string)"]
    path.write_text(f"keys:\n  - {{name: a, sha256: {ok}, max_requests: 5}}\n")
    assert load_keys(path).by_digest[ok].max_requests == 5


def test_keys_commands_add_list_remove_and_hash(tmp_path: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    path = tmp_path / "sub" / "k.yaml"
    path.parent.mkdir()
    a = add(path, "a", "--max-priority", "high", capsys=capsys)
    b = add(path, "b", "--max-priority", "low", capsys=capsys)
    assert a != b and oct(path.stat().st_mode & 0o777) == "0o644"
    assert path.read_text().count("sha256:") == 2 and a not in path.read_text()
    keys = load_keys(path)
    assert keys.find(a).max_priority == "high" and keys.find(a).default_priority == "normal"
    assert keys.find(b).default_priority == "low" and keys.find("kvg-other") is None
    assert main(["keys", "--file", str(path), "list", "--json"]) == 0
    assert '"name": "b"' in capsys.readouterr().out
    assert main(["keys", "list", "--file", str(path), "--json"]) == 0  # after the action too
    assert '"name": "b"' in capsys.readouterr().out
    assert main(["keys", "--file", str(path), "add", "a"]) == 2  # names are unique
    assert "already there" in capsys.readouterr().err
    assert main(["keys", "--file", str(path), "add", "c", "--default-priority", "high"]) == 2
    assert "--default-priority high is above --max-priority normal" in capsys.readouterr().err
    assert main(["keys", "--file", str(path), "remove", "a"]) == 0
    assert [e.name for e in read_entries(path)[0]] == ["b"]
    assert main(["keys", "--file", str(path), "remove", "b"]) == 0
    assert read_entries(path)[0] == [] and len(load_keys(path)) == 0
    assert main(["keys", "--file", str(path), "remove", "b"]) == 2
    assert add(path, "again", capsys=capsys).startswith("kvg-")  # an emptied file takes more
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("secret\n"))
    assert main(["keys", "hash"]) == 0
    assert capsys.readouterr().out.strip() == digest("secret")


def test_keys_list_and_remove_refuse_a_missing_file_and_add_creates_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in --file is an error naming the path (the daemon refuses to start on it), not
    "no keys" with status 0; `add` is the one that creates the file."""
    typo = tmp_path / "typo.yaml"
    for argv in (["list"], ["list", "--json"], ["remove", "a"]):
        assert main(["keys", *argv, "--file", str(typo)]) == 2
        err = capsys.readouterr().err
        assert f"API keys file {typo} not found" in err, err
    assert main(["keys", "list", "--file", str(tmp_path)]) == 2
    assert f"API keys file {tmp_path} is not a regular file" in capsys.readouterr().err
    assert not typo.exists()
    add(typo, "a", capsys=capsys)
    assert main(["keys", "list", "--file", str(typo)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("a ")


def test_keys_edits_keep_every_layout_loadable_and_exact(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Names YAML would read as numbers, null or booleans stay strings; a file in a layout the
    line edit does not know (flow style, entries at column 0, other indents) is rewritten whole
    with exactly the entries it should hold, and says so; a removal never leaves a key behind
    or takes another with it."""
    path = tmp_path / "k.yaml"
    names = ["123", "null", "true", "1.5", "0x1F", "1_000", "web"]
    keys = {n: add(path, n, capsys=capsys) for n in names}
    loaded = load_keys(path)
    assert [e.name for e in read_entries(path)[0]] == names
    assert all(loaded.find(k).name == n for n, k in keys.items())
    assert main(["keys", "--file", str(path), "remove", "null"]) == 0
    assert "rewritten" not in capsys.readouterr().err  # its own layout: edited in place
    assert [e.name for e in read_entries(path)[0]] == [n for n in names if n != "null"]
    d, e = digest("x"), digest("y")
    layouts = {
        "flow": f"# ours\nkeys: [{{name: a, sha256: {d}}}, {{name: b, sha256: {e}}}]\n",
        "column0": f"keys:\n- name: a\n  sha256: {d}\n- name: b\n  sha256: {e}\n",
        "indent4": f"keys:\n    - name: a\n      sha256: {d}\n    - name: b\n      sha256: {e}\n",
    }
    for layout, text in layouts.items():
        for gone, left in (("a", "b"), ("b", "a")):
            path.write_text(text)
            assert main(["keys", "--file", str(path), "remove", gone]) == 0, layout
            err = capsys.readouterr().err
            assert [x.name for x in read_entries(path)[0]] == [left], (layout, gone)
            assert layout != "flow" or "rewritten whole" in err, (layout, err)
            assert ("comments are gone" in err) == (layout == "flow"), (layout, err)
        path.write_text(text)
        new = add(path, "c", capsys=capsys)
        assert [x.name for x in read_entries(path)[0]] == ["a", "b", "c"], layout
        assert load_keys(path).find(new).name == "c"
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


def test_keys_add_makes_the_missing_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's `kvguard keys add` runs on a fresh host before /etc/kvguard exists: the
    directories are made (the file 0644 as ever); a directory that cannot be made is one line
    naming it, not the hidden temporary file."""
    path = tmp_path / "etc" / "kvguard" / "api_keys.yaml"
    key = add(path, "web-frontend", "--max-priority", "high", capsys=capsys)
    assert load_keys(path).find(key).max_priority == "high"
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory\n")
    for bad, parent in (
        (blocker / "k.yaml", blocker),
        (blocker / "sub" / "k.yaml", blocker / "sub"),
    ):
        assert main(["keys", "--file", str(bad), "add", "eve"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"kvguard: error: cannot create {bad}: cannot make its directory {parent}: "
        )
        assert len(err.splitlines()) == 1 and ".tmp" not in err, err
    # a refused add (a bad name) makes nothing
    assert main(["keys", "--file", str(tmp_path / "new" / "k.yaml"), "add", "bad name"]) == 2
    capsys.readouterr()
    assert not (tmp_path / "new").exists()


def test_keys_add_makes_directories_the_service_can_read_whatever_the_umask(
    tmp_path: Path,
) -> None:
    """`sudo` keeps an operator's umask of 077: the directories `keys add` makes are 0755 all
    the same (a 0700 /etc/kvguard would hide the keys file and config.yaml from the service's
    dynamic user), the file 0644; a directory that was there keeps the mode it had."""
    kept = tmp_path / "kept"
    kept.mkdir()
    kept.chmod(0o700)
    path = kept / "etc" / "kvguard" / "api_keys.yaml"
    proc = subprocess.run(
        [KVGUARD, "keys", "--file", str(path), "add", "web"],
        capture_output=True,
        text=True,
        timeout=60,
        umask=0o077,
    )
    assert proc.returncode == 0, proc.stderr
    made = [kept / "etc", kept / "etc" / "kvguard"]
    lock = path.with_name(".api_keys.yaml.lock")  # `keys add`/`remove` take turns on it
    modes = {p: oct(p.stat().st_mode & 0o777) for p in (kept, *made, path, lock)}
    assert modes == {
        kept: "0o700",
        made[0]: "0o755",
        made[1]: "0o755",
        path: "0o644",
        lock: "0o644",
    }
