"""api.max_connections and the API's connection metrics: a real `kvguard serve` of the tiny
model on loopback, real sockets and the real `openai` client. Past the cap a new connection's
first request is read: the operator's (/metrics, /health, /ready, /admin/..., /alertmanager) is
served, a few at once, the API's answered 503 and the connection closed, while those open are
served; with no descriptor left, the failed accepts are counted."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import re
import resource
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvguard.daemon import service
from kvguard.daemon.config import ApiConfig, DaemonConfig
from kvguard.daemon.logging_setup import PAST_MAX_CONNECTIONS, _Bounded
from kvguard.daemon.openai_api import SHUTTING_DOWN
from tests.test_drain import draining, reap, server_has_read, set_drain_timeout, slow_reader
from tests.test_server import TOKEN, Daemon, until
from tests.test_slow_clients import open_files_limit

CAP = 3
WAIT_S = 60.0  # generous bound on waiting for a condition, not a goal
GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: kvguard\r\n\r\n"
COMPLETION = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2}).encode()
POST_COMPLETION = (  # the last on its connection: the daemon closes it once answered
    b"POST /v1/completions HTTP/1.1\r\nHost: kvguard\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: "
    + str(len(COMPLETION)).encode()
    + b"\r\n\r\n"
    + COMPLETION
)
OPEN_FILES = (256, 256)  # soft, hard: the daemon holds well under it as it starts


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """Connections that send nothing stay open for the whole test (request_read_timeout)."""
    d = Daemon(
        tmp_path_factory.mktemp("cap"),
        debug_hooks=False,
        api=f"max_connections: {CAP}, request_read_timeout: 10m",
    )
    yield d
    assert d.stop() == 0


def metric(scrape: str, name: str) -> float:
    """The value of the sample `name` (no labels) in a /metrics text."""
    found = re.search(rf"^{name} (\S+)$", scrape, re.M)
    assert found, f"{name} not in the scrape"
    return float(found.group(1))


class Observer:
    """A kept-alive HTTP connection that reads /metrics: itself one of the connections served,
    the one the test asks on while the others are held."""

    def __init__(self, d: Daemon) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=WAIT_S)

    def scrape(self) -> str:
        """/metrics, asked again on a new connection where the daemon closed this one for
        idling past uvicorn's keep-alive (5 s: a slow step of the test's)."""
        try:
            return self._scrape()
        except (http.client.RemoteDisconnected, ConnectionError):
            self.conn.close()
            return self._scrape()

    def _scrape(self) -> str:
        self.conn.request("GET", "/metrics")
        r = self.conn.getresponse()
        assert r.status == 200, r.status
        return r.read().decode()

    def served_now(self) -> float:
        return metric(self.scrape(), "kvguard_http_connections")

    def wait_served(self, n: int, what: str) -> None:
        until(lambda: self.served_now() == n, WAIT_S, what)


def held(d: Daemon) -> socket.socket:
    """A connection that has sent nothing yet: served, and open until its client closes it."""
    return socket.create_connection(("127.0.0.1", d.port), timeout=WAIT_S)


def read_all(sock: socket.socket) -> bytes:
    """What the daemon sent until it closed the connection (a reset fails the test)."""
    got = bytearray()
    while part := sock.recv(1 << 16):
        got += part
    return bytes(got)


def head_and_body(raw: bytes) -> tuple[str, dict[str, str], bytes]:
    """An HTTP answer's status line, headers (lower-case names) and body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return status, headers, body


def test_past_max_connections_a_new_connection_gets_503_and_the_open_ones_are_served(
    daemon: Daemon,
) -> None:
    """The API took connections until the process ran out of file descriptors, and then
    answered no one. With api.max_connections, an API request on a connection past the cap is
    answered 503 (Retry-After, the API's JSON error naming the key) and the connection closed;
    those open are served as before, and once one closes a new one is."""
    observer = Observer(daemon)
    observer.wait_served(1, "the daemon's start-up checks to hang up: only the observer open")
    with contextlib.ExitStack() as stack:
        kept = [stack.enter_context(held(daemon)) for _ in range(CAP - 1)]
        observer.wait_served(CAP, f"{CAP} connections served")
        with held(daemon) as past:
            past.sendall(GET_MODELS)
            status, headers, body = head_and_body(read_all(past))  # then closed by the daemon
        assert status == "HTTP/1.1 503 Service Unavailable", status
        assert headers["retry-after"] == "5" and headers["connection"] == "close", headers
        assert headers["content-type"] == "application/json" and "x-request-id" in headers
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections", error
        assert error["type"] == "service_unavailable", error
        assert "api.max_connections" in error["message"] and f"serving {CAP} " in error["message"]
        with pytest.raises(openai.InternalServerError) as refused:  # what an SDK client sees
            daemon.client().models.list()
        assert refused.value.status_code == 503
        assert "api.max_connections" in refused.value.message, refused.value.message
        scrape = observer.scrape()  # at the cap: a request on a connection open is served
        assert metric(scrape, "kvguard_http_connections") == CAP
        assert metric(scrape, "kvguard_http_connections_max") == CAP
        assert metric(scrape, "kvguard_http_connections_refused_total") == 2

        kept[0].sendall(POST_COMPLETION)  # the API's too, on a connection open before
        status, _, body = head_and_body(read_all(kept[0]))
        assert status == "HTTP/1.1 200 OK" and b'"text_completion"' in body, (status, body)
        kept[1].close()
        observer.wait_served(1, "the daemon to see both connections closed")
        assert [m.id for m in daemon.client().models.list().data] == ["tiny"]
        assert metric(observer.scrape(), "kvguard_http_connections_refused_total") == 2
    log = Path(daemon.log.name).read_text()
    assert log.count("answered 503 to a connection from 127.0.0.1:") == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]


def operator_get(d: Daemon, path: str, method: str = "GET") -> tuple[str, dict[str, str]]:
    """`method path` on a new connection, the admin token sent: the status line and headers
    of the answer, read until the daemon closes the connection."""
    with held(d) as sock:
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: kvguard\r\n"
            f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        status, headers, body = head_and_body(read_all(sock))
    if status.endswith(" 503 Service Unavailable") and method == "GET":
        assert json.loads(body)["error"]["code"] == "too_many_connections", body
    return status, headers


def awaiting_alerts(d: Daemon) -> socket.socket:
    """A connection past the cap whose /alertmanager request is served and awaits its body:
    held among the operator's connections until its client closes it."""
    sock = held(d)
    sock.sendall(
        b"POST /alertmanager HTTP/1.1\r\nHost: kvguard\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
    )
    return sock


def test_at_the_cap_the_operators_requests_on_new_connections_are_served(
    daemon: Daemon,
) -> None:
    """Past the cap every new connection was answered 503 before its request was read: the
    scrapes (Prometheus's `up` fell, KvguardDown fired), /health, /ready, /admin and the
    `kvguard` command went unanswered just when the daemon was saturated. Now the first request
    is read: the operator's is served, OPERATOR_SPARE connections at once, each closed once
    answered; an API request still gets the 503."""
    observer = Observer(daemon)
    observer.wait_served(1, "only the observer open")
    refused_before = metric(observer.scrape(), "kvguard_http_connections_refused_total")
    with contextlib.ExitStack() as stack:
        for _ in range(CAP - 1):
            stack.enter_context(held(daemon))
        observer.wait_served(CAP, f"{CAP} connections served")
        for path in ("/metrics", "/health", "/ready", "/admin/state", "/metrics?name[]=up"):
            status, headers = operator_get(daemon, path)
            assert status == "HTTP/1.1 200 OK", (path, status)
            assert headers["connection"] == "close", (path, headers)
        assert operator_get(daemon, "/health", "HEAD")[0] == "HTTP/1.1 200 OK"
        assert daemon.admin("GET", "/admin/state").status_code == 200  # as `kvguard` asks
        assert operator_get(daemon, "/v1/models")[0] == "HTTP/1.1 503 Service Unavailable"
        status, headers = operator_get(daemon, "/v1/models", "HEAD")  # no body, as for a HEAD
        assert status == "HTTP/1.1 503 Service Unavailable" and headers["retry-after"] == "5"
        with pytest.raises(openai.InternalServerError):
            daemon.client().models.list()
        observer.wait_served(CAP, "the operator's connections closed once answered")

        for _ in range(service.OPERATOR_SPARE):  # the operator's allowance, taken whole
            stack.enter_context(awaiting_alerts(daemon))
        spare = CAP + service.OPERATOR_SPARE
        observer.wait_served(spare, f"{service.OPERATOR_SPARE} connections served past the cap")
        assert operator_get(daemon, "/health")[0] == "HTTP/1.1 503 Service Unavailable"
        scrape = observer.scrape()
        assert metric(scrape, "kvguard_http_connections_refused_total") == refused_before + 4
    observer.wait_served(1, "the daemon to see the connections closed")
    log = Path(daemon.log.name).read_text()
    assert "Traceback" not in log and "Logging error" not in log, log[-4000:]


def test_connections_past_the_cap_that_send_nothing_do_not_lock_the_operator_out(
    daemon: Daemon,
) -> None:
    """PAST_CAP_HELD connections past the cap that send nothing were held for the whole read
    timeout (10 minutes here), and meanwhile every new connection, the operator's scrapes
    too, was answered 503 at connect. Now one past the cap has PAST_CAP_HEAD_S to send its
    request: the silent ones are closed, and the operator's requests are served again."""
    observer = Observer(daemon)
    observer.wait_served(1, "only the observer open")
    with contextlib.ExitStack() as stack:
        for _ in range(CAP - 1):
            stack.enter_context(held(daemon))
        observer.wait_served(CAP, f"{CAP} connections served")
        silent = [stack.enter_context(held(daemon)) for _ in range(service.PAST_CAP_HELD)]
        for sock in silent:  # closed by the daemon, unanswered: they sent nothing
            assert read_all(sock) == b""
        status, _ = operator_get(daemon, "/metrics")
        assert status == "HTTP/1.1 200 OK", status


def test_a_request_past_the_cap_that_finds_room_by_then_is_served(daemon: Daemon) -> None:
    """A connection that came past the cap was judged by the cap as it stood at its connect:
    its request was refused even where a served connection had closed meanwhile, while a new
    connection was served. Now the cap is read as the request arrives."""
    observer = Observer(daemon)
    observer.wait_served(1, "only the observer open")
    with contextlib.ExitStack() as stack:
        kept = [stack.enter_context(held(daemon)) for _ in range(CAP - 1)]
        observer.wait_served(CAP, f"{CAP} connections served")
        with held(daemon) as late:  # past the cap: its request is awaited
            # accepted in order: once one connected after it is refused, it is past the cap
            assert operator_get(daemon, "/v1/models")[0] == "HTTP/1.1 503 Service Unavailable"
            kept[0].close()
            observer.wait_served(CAP - 1, "the daemon to see one served connection closed")
            late.sendall(POST_COMPLETION)
            status, _, body = head_and_body(read_all(late))
    assert status == "HTTP/1.1 200 OK" and b'"text_completion"' in body, (status, body)


def shutting_down_error(raw: bytes) -> dict[str, str]:
    """The error of an answer that must be the drain's refusal of new work: 503
    `shutting_down`, with Retry-After, the connection closed."""
    status, headers, body = head_and_body(raw)
    assert status == "HTTP/1.1 503 Service Unavailable", raw
    assert headers["retry-after"] == "5" and headers["connection"] == "close", headers
    assert headers["content-type"] == "application/json" and "x-request-id" in headers
    error = json.loads(body)["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable", error
    return error


def test_during_a_drain_connections_past_the_cap_are_answered_shutting_down(
    tmp_path: Path,
) -> None:
    """During a drain a new request is refused 503 `shutting_down`, but one on a connection
    past the cap was answered `too_many_connections`, sending its client to retry here in 5 s;
    and a connection past the cap still sending its request's head as the drain began was
    left to its read timer (a 408 PAST_CAP_HEAD_S after its connect), held outside the
    connections the drain closes. Now both get the drain's `shutting_down`: the one whose
    request line (an API path) has come as the drain begins at once, the next when its
    request comes; neither counts as refused for the cap. A HEAD's line come as the drain
    began made its 503 raise (h11 had not read the request, and wanted the body declared),
    which ended the drain's task there: the daemon never stopped. (The drain's start as the
    connections see it, an operator's request among them: the in-process test below.)"""
    d = Daemon(
        tmp_path, debug_hooks=False, api=f"max_connections: {CAP}, request_read_timeout: 10m"
    )
    try:
        with contextlib.ExitStack() as stack:
            unread, _ = slow_reader(d)  # the drain waits for its answer (20 s at most)
            stack.callback(unread.close)
            for _ in range(CAP - 1):
                stack.enter_context(held(d))
            until(lambda: api_refused(d), WAIT_S, f"{CAP} connections served")
            refused = metric(scrape_new(d), "kvguard_http_connections_refused_total")
            sending = stack.enter_context(held(d))  # past the cap, its head begun
            sending.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvguard\r\nContent-")
            until(lambda: server_has_read(d.port, sending), WAIT_S, "the head begun to be read")
            heading = stack.enter_context(held(d))  # past the cap, a HEAD's line come
            heading.sendall(b"HEAD /v1/models HTTP/1.1\r\nHost: kvguard\r\n")
            until(lambda: server_has_read(d.port, heading), WAIT_S, "the HEAD's line read")
            d.proc.send_signal(signal.SIGTERM)
            assert shutting_down_error(read_all(sending))["message"] == SHUTTING_DOWN
            status, headers, body = head_and_body(read_all(heading))
            assert status == "HTTP/1.1 503 Service Unavailable" and body == b"", (status, body)
            assert headers["retry-after"] == "5" and headers["connection"] == "close", headers
            assert draining(d)  # /ready past the cap: the operator's, served
            with held(d) as late:
                late.sendall(GET_MODELS)
                assert shutting_down_error(read_all(late))["message"] == SHUTTING_DOWN
            scrape = scrape_new(d)
            assert metric(scrape, "kvguard_http_connections_refused_total") == refused
            unread.close()  # the last answer the drain waits for: the stop goes on
            assert d.proc.wait(WAIT_S) == 0
    finally:
        reap(d)
    log = Path(d.log.name).read_text()
    assert "Traceback" not in log, log[-4000:]


@contextlib.contextmanager
def capped_server(cap: service.ConnectionCap) -> Iterator[tuple[int, Callable[[], None]]]:
    """The daemon's server (`_Server`, its protocol `timed_h11` with `cap`) on loopback, in
    this process, serving /metrics (the operator's) and /v1/models: its port, and what the
    SIGTERM's drain does to the connections (`ConnectionCap.drain_began`, on the server's
    loop, returned once done). The stop closes those still held past the cap."""

    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse(f"{request.url.path} served\n")

    app = Starlette(routes=[Route("/metrics", ok), Route("/v1/models", ok)])
    config = uvicorn.Config(
        app, http=service.timed_h11(600.0, 60.0, cap), log_config=None, lifespan="off", ws="none"
    )
    server = service._Server(config, lambda: None, cap)
    sock = service.bind_api("127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve([sock])))
    thread.start()

    async def began() -> None:
        cap.drain_began()

    try:
        until(lambda: server.started, WAIT_S, "the server listening")
        yield (
            sock.getsockname()[1],
            lambda: asyncio.run_coroutine_threadsafe(began(), loop).result(),
        )
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        loop.close()
        sock.close()
    assert not thread.is_alive()


def test_a_drain_leaves_a_request_past_the_cap_still_coming_to_be_judged_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the drain began, a connection past the cap that had begun its request was answered
    503 `shutting_down`, and one that had sent nothing was closed: but the operator's
    requests are served during the drain, past the cap too, and a scrape or a `kvguard
    status` in flight at SIGTERM lost its answer. A HEAD cut mid-word (`HEA`) got the 503's
    body, which a HEAD answer never has. Now only a request line already whole and naming an
    API path is refused at the drain's start; the others are judged as their head comes (the
    operator's served, the rest refused `shutting_down`, a HEAD without a body). The stop
    closes what is still held."""
    monkeypatch.setattr(service, "PAST_CAP_HEAD_S", 600.0)  # no read timer runs out here
    drain, refusals = threading.Event(), []
    cap = service.ConnectionCap(
        limit=1, draining=drain.is_set, on_refused=lambda: refusals.append(1)
    )
    sent = {
        "silent": b"",  # an operator's client that has not sent its request yet
        "operator": b"GET /metrics HTTP/1.1\r\nHost: kvguard\r\n",
        "operator line": b"GET /metr",
        "api": b"GET /v1/models HTTP/1.1\r\nHost: kvguard\r\n",
        "api head": b"HEAD /v1/models HTTP/1.1\r\n",
        "api line": b"POST /v1/compl",
        "head cut": b"HEA",
        "never": b"",  # sends nothing, ever
    }
    rest = {
        "silent": b"GET /metrics HTTP/1.1\r\nHost: kvguard\r\n\r\n",
        "operator": b"\r\n",
        "operator line": b"ics?x=1 HTTP/1.1\r\nHost: kvguard\r\n\r\n",
        "api line": b"etions HTTP/1.1\r\nHost: kvguard\r\nContent-Length: 2\r\n\r\n{}",
        "head cut": b"D /v1/models HTTP/1.1\r\nHost: kvguard\r\n\r\n",
    }
    with contextlib.ExitStack() as stack:
        with capped_server(cap) as (port, drain_began):
            served = stack.enter_context(socket.create_connection(("127.0.0.1", port), WAIT_S))
            until(lambda: server_has_read(port, served), WAIT_S, "the served connection accepted")
            past: dict[str, socket.socket] = {}
            for name, data in sent.items():
                past[name] = stack.enter_context(
                    socket.create_connection(("127.0.0.1", port), WAIT_S)
                )
                until(lambda: len(cap.held) == len(past), WAIT_S, f"{name!r} held past the cap")
                past[name].sendall(data)
                until(lambda: server_has_read(port, past[name]), WAIT_S, f"{name!r} read")  # noqa: B023
            drain.set()
            drain_began()
            # a request line naming an API path: refused at once, nothing more sent
            assert shutting_down_error(read_all(past["api"]))["message"] == SHUTTING_DOWN
            status, headers, body = head_and_body(read_all(past["api head"]))
            assert status == "HTTP/1.1 503 Service Unavailable" and body == b"", (status, body)
            assert headers["retry-after"] == "5" and int(headers["content-length"]) > 0, headers
            for name in ("silent", "operator", "operator line", "api line", "head cut"):
                past[name].setblocking(False)  # nothing answered, nor closed, before their head
                with pytest.raises(BlockingIOError):
                    past[name].recv(1)
                past[name].setblocking(True)
            for name, data in rest.items():
                past[name].sendall(data)
            for name in ("silent", "operator", "operator line"):  # the operator's: served
                status, headers, body = head_and_body(read_all(past[name]))
                assert (status, body) == ("HTTP/1.1 200 OK", b"/metrics served\n"), (name, status)
                assert headers["connection"] == "close", headers
            assert shutting_down_error(read_all(past["api line"]))["message"] == SHUTTING_DOWN
            status, headers, body = head_and_body(read_all(past["head cut"]))
            assert status == "HTTP/1.1 503 Service Unavailable" and body == b"", (status, body)
            assert headers["retry-after"] == "5", headers
            assert refusals == []  # the drain's refusals: none counted for the cap
            until(lambda: cap.spare_used == 0, WAIT_S, "the operator's connections closed")
        # the stop closed the one that never sent anything, held past the cap until then
        assert read_all(past["never"]) == b""


def limited_daemon(
    tmp_path_factory: pytest.TempPathFactory, name: str, api: str
) -> Iterator[Daemon]:
    """A daemon run under OPEN_FILES, connections that send nothing held for the whole test
    (request_read_timeout), with the `api` keys given; stopped at the end."""
    with open_files_limit(OPEN_FILES):
        d = Daemon(
            tmp_path_factory.mktemp(name),
            debug_hooks=False,
            api=f"{api}, request_read_timeout: 10m" if api else "request_read_timeout: 10m",
        )
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def starved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose cap the open files limit cannot reach: accept() runs out of
    descriptors first."""
    yield from limited_daemon(tmp_path_factory, "starved", "max_connections: 100000")


def test_accepts_that_fail_for_want_of_a_descriptor_are_counted(starved: Daemon) -> None:
    """With no file descriptor left, accept() fails and the waiting clients get no answer:
    the log said so once a minute, and no metric did. Now
    kvguard_http_accept_failures_total counts them, and the start warned that the cap is out
    of the limit's reach."""
    log_path = Path(starved.log.name)
    assert "api.max_connections is 100000, more than the open files limit 256" in (
        log_path.read_text()
    )
    with contextlib.ExitStack() as stack:
        for _ in range(OPEN_FILES[1] + 64):
            stack.enter_context(held(starved))
        until(
            lambda: (
                "the API cannot accept connections: Too many open files" in log_path.read_text()
            ),
            WAIT_S,
            "an accept() to fail for want of a descriptor",
        )
    scrape = httpx.get(starved.url + "/metrics", timeout=WAIT_S).text  # once some have closed
    assert metric(scrape, "kvguard_http_accept_failures_total") >= 1
    assert metric(scrape, "kvguard_http_connections_refused_total") == 0
    assert metric(scrape, "kvguard_http_connections_max") == 100000


def test_a_stop_while_accepts_fail_logs_no_traceback(tmp_path: Path) -> None:
    """After an accept() that fails for want of a descriptor, asyncio reads the listening
    socket again a second later (a timer per failed accept). A stop within that second closed
    the socket with the timers still due, and each then logged `ValueError: Invalid file
    descriptor: -1` with a traceback. Here the accepts fail up to the stop, and an answer its
    client does not read keeps the event loop running for the grace after it (the drain's
    end, uvicorn's wait for the answers being sent), so that every timer comes due."""
    with open_files_limit(OPEN_FILES):
        d = Daemon(
            tmp_path, debug_hooks=False, api="max_connections: 100000, request_read_timeout: 10m"
        )
    log_path = Path(d.log.name)
    try:
        set_drain_timeout(d, "1s")
        with contextlib.ExitStack() as stack:
            unread, _ = slow_reader(d)  # its answer begun, and never read
            stack.callback(unread.close)
            for _ in range(OPEN_FILES[1] + 64):
                stack.enter_context(held(d))
            until(
                lambda: "the API cannot accept connections" in log_path.read_text(),
                WAIT_S,
                "an accept() to fail for want of a descriptor",
            )
            d.proc.send_signal(signal.SIGTERM)  # the clients still waiting: accepts still fail
            assert d.proc.wait(WAIT_S) == 0
    finally:
        reap(d)
    log = log_path.read_text()
    assert "1 answers still not read by their clients" in log, log[-4000:]  # the loop ran on
    assert "Traceback" not in log and "Invalid file descriptor" not in log, log[-4000:]


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose cap is sized from a small open files limit (184 of 256 where it holds
    11 descriptors as it starts)."""
    yield from limited_daemon(tmp_path_factory, "crowded", "")


def refused_at_once(d: Daemon) -> socket.socket:
    """A connection past the cap that asks the API and neither reads its answer nor hangs up:
    returned once the daemon has answered it (a 503, then its end of the connection) or reset
    it, so that the next connect is decided on before it."""
    sock = held(d)
    got = bytearray()
    # closed at once, its request unread: the reset may come before the request is sent
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        sock.sendall(GET_MODELS)
        while part := sock.recv(1 << 16):
            got += part
    assert not got or got.startswith(b"HTTP/1.1 503 "), bytes(got)
    return sock


def api_refused(d: Daemon) -> bool:
    """Whether an API request on a new connection is refused for the cap (else it is served,
    and the connection closed)."""
    with held(d) as sock:
        sock.sendall(GET_MODELS.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        status, _, body = head_and_body(read_all(sock))
    return status == "HTTP/1.1 503 Service Unavailable" and b"too_many_connections" in body


def scrape_new(d: Daemon) -> str:
    """/metrics on a new connection (served past the cap too, as the operator's)."""
    r = httpx.get(d.url + "/metrics", timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.text


def health(d: Daemon) -> bool:
    """Whether /health on a new connection is served (while PAST_CAP_HELD connections past the
    cap are held, a new one is answered 503 and closed at once, or reset)."""
    try:
        return operator_get(d, "/health")[0] == "HTTP/1.1 200 OK"
    except ConnectionResetError:
        return False


def test_connections_past_the_cap_that_never_hang_up_do_not_take_every_descriptor(
    crowded: Daemon,
) -> None:
    """A connection refused past the cap kept its descriptor until its client hung up (1 s at
    most), outside the cap, and any number of them did: clients connecting faster than that
    and never hanging up ran the daemon out of descriptors again, as if there were no cap, the
    reserve for the audit database and the model files taken as well. Now PAST_CAP_HELD of
    them are held at once (fewer under a small limit), and the next are closed at once."""
    log_path = Path(crowded.log.name)
    limit = int(metric(scrape_new(crowded), "kvguard_http_connections_max"))
    past = 2 * OPEN_FILES[1]  # more than the open files limit, each decided before the next
    with contextlib.ExitStack() as stack:
        for _ in range(limit):  # the cap, held for the whole test: none served past it
            stack.enter_context(held(crowded))
        until(lambda: api_refused(crowded), WAIT_S, f"the {limit} connections served")
        for _ in range(past):
            stack.enter_context(refused_at_once(crowded))
        log = log_path.read_text()
        assert "the API cannot accept connections" not in log, log[-4000:]
        until(lambda: health(crowded), WAIT_S, "/health served once those held have closed")
        scrape = scrape_new(crowded)
    assert metric(scrape, "kvguard_http_connections_refused_total") >= past  # /health's too
    assert metric(scrape, "kvguard_http_accept_failures_total") == 0
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-4000:]


def test_an_unset_max_connections_leaves_descriptors_in_reserve(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Unset, the cap is what the open files limit leaves less a reserve: FD_RESERVE, or a
    quarter of the room where the limit is small; a cap set above what the limit leaves is
    kept, with a warning naming the fix. The connections past the cap (the operator's served,
    those held to read their request or after their 503) take a quarter each at most of what
    the limit leaves beyond the cap."""
    cap = service.connection_cap
    spare, most = service.OPERATOR_SPARE, service.PAST_CAP_HELD
    with caplog.at_level(logging.INFO, "kvguard.daemon"):
        assert cap(None, 111, 11) == service.ConnectionCap(75, 6, 6)  # a quarter of 100 kept
        assert cap(50, 111, 11) == service.ConnectionCap(50, 12, 12)
        assert cap(101, 111, 11) == service.ConnectionCap(101, 0, 0)
    room = 10 * service.FD_RESERVE
    assert cap(None, room + 40, 40) == service.ConnectionCap(room - service.FD_RESERVE, spare, most)
    assert cap(None, resource.RLIM_INFINITY, 40) == service.ConnectionCap(None, spare, most)
    assert cap(7, resource.RLIM_INFINITY, 40) == service.ConnectionCap(7, spare, most)
    assert "at most 75 (api.max_connections unset: the open files limit 111 less the 11" in (
        caplog.text
    )
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "api.max_connections is 101, more than the open files limit 111" in warning.message
    assert "raise LimitNOFILE=" in warning.message


def test_a_link_local_client_address_is_logged_as_it_is() -> None:
    """CPython writes an IPv6 link-local client as `fe80::1%eth0`: added to the refusal's
    line, its `%e` was read as a format directive, and logging printed its own error and a
    traceback instead of the line."""
    logger = logging.getLogger("kvguard.test.link_local")
    logger.propagate = False
    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    class Connection(H11Protocol):  # as the daemon's: the line names its client
        client = ("fe80::1%eth0", 8000)

        def refuse(self) -> None:
            logger.warning(PAST_MAX_CONNECTIONS, CAP)
            logger.warning("Invalid HTTP request received.")  # a line without arguments

    logger.addHandler(Keep())
    what = {PAST_MAX_CONNECTIONS: "refused", "Invalid HTTP request received.": "invalid"}
    logger.addFilter(_Bounded(logger, what))
    Connection.__new__(Connection).refuse()
    assert got == [
        f"{PAST_MAX_CONNECTIONS % CAP} from fe80::1%eth0:8000.",
        "Invalid HTTP request received from fe80::1%eth0:8000.",
    ]


def test_max_connections_changes_at_a_restart() -> None:
    """As the other keys the API's server is built with (request_read_timeout and the rest):
    a reload that changes it names it among the keys that wait for a restart."""
    old = DaemonConfig()
    new = DaemonConfig(api=ApiConfig(max_connections=CAP))
    assert old.api.max_connections is None
    assert service.engine_changes(old, new) == ([], ["api.max_connections"])


def test_a_connection_whose_drain_answer_raises_is_closed_and_the_others_still_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The drain answers the connections held past the cap one after another
    (`ConnectionCap.drain_began`): one whose answer raised (a HEAD's 503 once did, in h11)
    ended the drain task there, the daemon never stopped and the connections after it were
    never answered. Now that one is closed and logged, and every other one is answered."""

    class Held:
        def __init__(self, fails: bool) -> None:
            self.fails, self.answered, self.closed = fails, False, False
            self.transport = self

        def drain_began(self) -> None:
            if self.fails:
                raise RuntimeError("an answer that cannot be written")
            self.answered = True

        def close(self) -> None:
            self.closed = True

    conns = [Held(False), Held(True), Held(False)]
    cap = service.ConnectionCap(limit=1, held=set(conns))
    with caplog.at_level(logging.ERROR, logger="kvguard.daemon"):
        cap.drain_began()
    assert [c.answered for c in conns] == [True, False, True]
    assert [c.closed for c in conns] == [False, True, False]
    assert "could not be answered at the drain" in caplog.text
