"""A stalled engine loop, and what the daemon's health and admin surface say about it and about
a halt, a drain and a refused action.

A stalled engine thread (a hung step; here /admin/debug/stall, released by the test) used to
take in every request without limit and refuse none, though `/ready` said "engine loop
stalled" and the runbook says kvguard answers 503 then: admission runs on the engine thread,
and a stalled thread decides nothing. Now what a hard queue bound would refuse is refused at
once (429), and once the stall passes the readiness threshold every new request gets 503
`engine_stalled`; the requests already in flight keep waiting, and are served when it ends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvguard.daemon.app import create_app
from kvguard.daemon.config import load_config
from kvguard.daemon.service import Service
from tests.test_server import KVGUARD, Daemon, until

QUEUE = 4  # admission_control.max_queue, a hard limit (max_queue_wait 0s)
SEQS = 2  # serving.max_num_seqs: at most QUEUE + SEQS requests are taken in at once


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = Daemon(
        tmp_path_factory.mktemp("stall"),
        serving=f"{{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, max_num_seqs: {SEQS}}}",
        extra=f"admission_control: {{max_queue: {QUEUE}, max_queue_wait: 0s}}\n",
    )
    yield daemon
    assert daemon.stop() == 0


def complete(d: Daemon) -> tuple[int, str | None, str | None]:
    """One completion by the `openai` client: (status, error code, Retry-After)."""
    try:
        d.client().completions.create(model="tiny", prompt="hi", max_tokens=3)
    except openai.APIStatusError as e:
        code = e.body.get("code") if isinstance(e.body, dict) else None
        return e.status_code, code, e.response.headers.get("retry-after")
    return 200, None, None


def test_a_stalled_engine_takes_in_what_the_queue_holds_and_refuses_the_rest_at_once(
    d: Daemon,
) -> None:
    """20 requests into a stalled engine with room for 6 (max_num_seqs 2, max_queue 4): 14 are
    refused at once with admission's 429, as a healthy engine refuses them; the 6 wait, and are
    served once the stall ends. (All 20 used to wait, answered by nothing.)"""
    assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
    in_flight = lambda: d.admin("GET", "/admin/state").json()["in_flight"]  # noqa: E731
    pool = concurrent.futures.ThreadPoolExecutor(20)
    try:
        futures = [pool.submit(complete, d) for _ in range(20)]
        refused = lambda: [f.result() for f in futures if f.done()]  # noqa: E731
        # every request either answered or on its way into the engine: nothing else comes
        until(lambda: len(refused()) + in_flight() == 20, 60, "all 20 answered or in flight")
        assert in_flight() == QUEUE + SEQS
        assert len(refused()) == 20 - QUEUE - SEQS
        for status, code, retry_after in refused():
            assert (status, code) == (429, "admission_rejected") and retry_after, code
    finally:
        d.admin("POST", "/admin/debug/release")
    answers = [f.result(timeout=120) for f in futures]  # the 6 served once it ended
    pool.shutdown()
    assert answers.count((200, None, None)) == QUEUE + SEQS, answers


def test_status_and_ready_say_why_a_halt_for_every_priority_is_not_ready(d: Daemon) -> None:
    """A halt that admits no priority is not ready (/ready 503: a load balancer sends its
    traffic elsewhere), and `kvguard status` says why and how many requests are in flight; a
    partial halt stays ready (high is served) and says what is allowed."""
    halt = d.admin("POST", "/admin/actions/halt_admission", json={"allow_priority": None})
    assert halt.status_code == 200, halt.text
    try:
        r = httpx.get(d.url + "/ready", timeout=10)
        assert r.status_code == 503
        assert r.json()["reason"] == "admission halted for every priority"
        assert d.admin("GET", "/admin/state").json()["ready_reason"] == r.json()["reason"]
        token = Path(d.config).parent / "admin.token"
        argv = [KVGUARD, "status", "--url", d.url, "--token-file", str(token)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
        assert "ready=False (admission halted for every priority)" in out, out
        assert "in flight    0" in out.splitlines(), out
        partial = d.admin("POST", "/admin/actions/halt_admission", json={"allow_priority": "high"})
        assert partial.status_code == 200, partial.text
        r = httpx.get(d.url + "/ready", timeout=10)
        assert (r.status_code, r.json()["reason"]) == (200, "admission halted (allowed: high)")
    finally:
        assert d.admin("POST", "/admin/actions/resume_admission").status_code == 200
    assert httpx.get(d.url + "/ready", timeout=10).json() == {"ready": True, "reason": "ok"}


def test_a_wrong_admin_token_is_a_401_as_a_missing_one(d: Daemon) -> None:
    """RFC 6750: a credential that is wrong is sent again (401), not a permission lacked."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(d.url + "/admin/state", headers=headers, timeout=10)
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"


def test_an_action_the_engine_refuses_answers_409_with_its_reason(d: Daemon) -> None:
    """`curl -f .../enable_cpu_offload && echo applied` must not say applied of a refusal."""
    r = d.admin("POST", "/admin/actions/enable_cpu_offload")
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["ok"] is False and body["detail"].startswith("refused: no host pool"), body
    assert body["action"] == "enable_cpu_offload" and body["before"] == body["after"]


# -- in process: a short stall threshold, the stop begun by hand --------------------------------


@pytest.fixture
def service(tiny_dir: Path, tmp_path: Path) -> Iterator[Service]:
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        "serving: {model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}\n"  # in tiny_dir
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    yield svc
    svc.close()


def stall(service: Service) -> threading.Event:
    """Hold the engine thread until the returned event is set (as /admin/debug/stall does)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(300)

    service.loop.call(hold)
    until(held.is_set, 60, "the engine thread held")
    return release


def client(service: Service) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=create_app(service))
    http = httpx.AsyncClient(transport=transport, base_url="http://kvguard")
    return openai.AsyncOpenAI(
        base_url="http://kvguard/v1", api_key="unused", http_client=http, max_retries=0
    )


async def refusal(c: openai.AsyncOpenAI) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        await c.completions.create(model="tiny", prompt="hi", max_tokens=3)
    return e.value


def test_past_the_stall_threshold_new_requests_get_503_and_the_stall_is_logged(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """A request in flight when the loop stalls keeps waiting (the stall may end); once the
    loop has not beaten for the threshold, a new one gets 503 `engine_stalled` at once, the
    log has one WARNING naming where the engine thread is and `/admin/state` the reason; once
    it beats again, an INFO, and requests are served again."""
    service.stall_after_s = 3600.0  # not yet: the first request must be posted to the stall
    release = stall(service)

    async def run() -> tuple[Any, openai.APIStatusError, Any]:
        c = client(service)
        held = asyncio.ensure_future(c.completions.create(model="tiny", prompt="x", max_tokens=3))
        while service.loop.in_flight() < 1:
            assert not held.done(), held
            await asyncio.sleep(0.02)
        service.stall_after_s = 1.0  # the loop has not beaten since the stall began
        while service.stalled_s() is None:  # a second after its last beat: stalled
            await asyncio.sleep(0.02)
        refused = await refusal(c)
        while "engine loop has not beaten" not in caplog.text:  # the watchdog's next look
            await asyncio.sleep(0.05)
        state = service.state()
        release.set()
        first = await asyncio.wait_for(held, 120)  # served: the loop beats again
        service.stall_after_s = 3600.0  # no second stall on a busy host's slow step
        while "engine loop beats again" not in caplog.text:
            await asyncio.sleep(0.05)
        after = await c.completions.create(model="tiny", prompt="y", max_tokens=3)
        return first, refused, (state, after)

    with caplog.at_level(logging.INFO, logger="kvguard.daemon"):
        try:
            first, refused, (state, after) = asyncio.run(asyncio.wait_for(run(), 120))
        finally:
            release.set()
    assert refused.status_code == 503 and refused.body["code"] == "engine_stalled", refused.body
    assert refused.response.headers["retry-after"] == "5"
    assert (state["ready"], state["ready_reason"]) == (False, "engine loop stalled")
    assert first.usage.completion_tokens == 3 and after.usage.completion_tokens == 3
    stalled = [r for r in caplog.records if "engine loop has not beaten" in r.message]
    assert len(stalled) == 1 and stalled[0].levelno == logging.WARNING
    # where the engine thread is stuck: the test's hold, waiting, under the engine's mailbox
    assert "(thread kvguard-engine, in wait (threading.py" in stalled[0].message
    beats = [r for r in caplog.records if "engine loop beats again" in r.message]
    assert len(beats) == 1 and beats[0].levelno == logging.INFO


def test_a_request_during_the_stop_gets_503_shutting_down(service: Service) -> None:
    """A code a client can branch on, as every other 503 has (it was null)."""
    service.draining = True
    try:
        e = asyncio.run(refusal(client(service)))
    finally:
        service.draining = False
    assert e.status_code == 503 and e.body["code"] == "shutting_down", e.body
    assert e.body["type"] == "service_unavailable"
