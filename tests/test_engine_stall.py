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
import re
import resource
import signal
import subprocess
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvguard.daemon import sdnotify
from kvguard.daemon import service as service_module
from kvguard.daemon.app import create_app
from kvguard.daemon.config import load_config
from kvguard.daemon.service import STALL_AFTER_S, Service
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
        # every request either answered or on its way into the engine: nothing else comes.
        # Bounded well inside the daemon's 30 s stall threshold, past which a late request
        # gets 503 engine_stalled: this says the requests were slow, not that 429s were wrong
        until(
            lambda: len(refused()) + in_flight() == 20,
            STALL_AFTER_S - 10,
            "all 20 answered or in flight, before the stall threshold",
        )
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
        # no second stall on a busy host's slow step: from before the loop beats again
        service.stall_after_s = 3600.0
        release.set()
        first = await asyncio.wait_for(held, 120)  # served: the loop beats again
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


# -- the stall WARNING against systemd's watchdog ----------------------------------------------


class WatchdogRun:
    """The real `Service._watchdog` on a fake clock that each of its waits moves on by the
    period it asks for, over an engine loop that beats until `stall_at`, then never again;
    `sdnotify` faked as systemd sees it: its pings' times, and the stall WARNING's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, interval: float | None, stall_at: float):
        self.now, self.stall_at = 0.0, stall_at
        self.end = stall_at + 3 * (interval or STALL_AFTER_S)
        self.pings: list[float] = []
        self.warnings: list[tuple[float, str]] = []
        monkeypatch.setattr(service_module, "time", types.SimpleNamespace(monotonic=self.clock))
        monkeypatch.setattr(sdnotify, "watchdog_interval", lambda: interval)
        monkeypatch.setattr(sdnotify, "watchdog", lambda: self.pings.append(self.now) or True)
        monkeypatch.setattr(sdnotify, "status", lambda *_: True)
        svc = Service.__new__(Service)  # no engine: the watchdog reads the loop's beat alone
        svc.loop = types.SimpleNamespace(last_beat=0.0, thread=threading.current_thread())
        svc._stop_watchdog = self  # type: ignore[assignment]  # `wait` and `is_set` below
        svc._watchdog_lock, svc._stall_logged_at = threading.Lock(), None
        svc.stall_after_s = STALL_AFTER_S
        svc._systemd_status = lambda: "ok"  # type: ignore[method-assign]
        self.svc = svc

    def clock(self) -> float:
        return self.now

    def wait(self, period: float) -> bool:
        self.now += period
        self.svc.loop.last_beat = min(self.now, self.stall_at)  # the loop beats until the stall
        return self.now > self.end

    def is_set(self) -> bool:
        return False

    def run(self, caplog: pytest.LogCaptureFixture) -> None:
        caplog.clear()
        handler = AtFakeTime(self)
        logger = logging.getLogger("kvguard.daemon")
        logger.addHandler(handler)
        try:
            with caplog.at_level(logging.INFO, logger="kvguard.daemon"):
                self.svc._watchdog()
        finally:
            logger.removeHandler(handler)
        self.warnings = [(t, m) for t, m in self.warnings if "has not beaten" in m]


class AtFakeTime(logging.Handler):
    """Each record's message, with the fake time it was logged at, into `run.warnings`."""

    def __init__(self, run: WatchdogRun) -> None:
        super().__init__()
        self.run = run

    def emit(self, record: logging.LogRecord) -> None:
        self.run.warnings.append((self.run.now, record.getMessage()))


@pytest.mark.parametrize("phase", [0.01, 1.0, 3.0, 5.0, 7.5, 9.99])
def test_the_stall_warning_comes_before_systemds_watchdog_aborts_the_daemon(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, phase: float
) -> None:
    """The shipped unit's WatchdogSec=30s equals the 30 s stall threshold: the pings stop at a
    beat age of 15 s, systemd aborts the daemon 30 s after the last one, and the WARNING that
    names where the engine thread is stuck came at the first 10 s tick past 30 s, for half the
    stalls at the very tick systemd's SIGABRT came: the journal then never named the step.
    It now comes once the pings stop, a tick (or more) ahead of the abort, whatever the stall's
    phase against the ticks; the 503s keep their own 30 s threshold."""
    run = WatchdogRun(monkeypatch, interval=30.0, stall_at=100.0 + phase)
    run.run(caplog)
    kill = max(run.pings) + 30.0  # no ping after it: systemd's SIGABRT
    assert len(run.warnings) == 1, run.warnings
    at, message = run.warnings[0]
    assert at <= kill - 10.0, (at - run.stall_at, kill - run.stall_at)
    assert f"systemd aborts the daemon in about {kill - at:.0f}s" in message, message
    assert "new requests answer 503 engine_stalled once it has not beaten for 30s" in message
    assert "(thread MainThread, in " in message  # where the (here: test's) engine thread is


def test_without_systemds_watchdog_the_stall_warning_keeps_the_stall_threshold(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run = WatchdogRun(monkeypatch, interval=None, stall_at=100.0)
    run.run(caplog)
    assert not run.pings and len(run.warnings) == 1, run.warnings
    at, message = run.warnings[0]
    assert STALL_AFTER_S <= at - run.stall_at <= STALL_AFTER_S + 2.0  # its 2 s ticks
    assert "not ready, new requests answer 503 engine_stalled until it beats again" in message
    assert "no systemd watchdog: nothing restarts a loop that stays stalled" in message


def test_systemds_watchdog_abort_writes_every_threads_stack_after_the_stall_warning(
    tmp_path: Path,
) -> None:
    """systemd's watchdog ends a stalled daemon with SIGABRT (WatchdogSignal's default), which
    killed `kvguard serve` without a word: when the stall WARNING had not got out first, the
    journal never said where the engine thread hung. `kvguard serve` now enables faulthandler:
    the abort writes every thread's stack to stderr, the engine thread's stuck step in it. Here
    the test is systemd, with a 4 s watchdog interval (the WARNING once the pings stop, at 2 s)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))  # the daemon inherits it: no core file
    try:
        d = Daemon(tmp_path, env={"WATCHDOG_USEC": "4000000"})
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    log = Path(d.log.name)
    try:
        assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
        until(lambda: "engine loop has not beaten" in log.read_text(), 60, "the stall WARNING")
        d.proc.send_signal(signal.SIGABRT)
        assert d.proc.wait(60) == -signal.SIGABRT
    finally:
        d.stop()
    text = log.read_text()
    assert "Fatal Python error: Aborted" in text, text[-2000:]
    dump = text.index("Fatal Python error: Aborted")
    # the engine thread's stack, stuck in the stall's hold (admin_api.py's debug hook)
    assert re.search(r'File ".*admin_api\.py", line \d+ in hold', text[dump:]), text[dump:]
    warning = text.index("engine loop has not beaten for")
    assert warning < dump
    assert "watchdog pings stopped: unless it beats again, systemd aborts the daemon" in text
