"""Clients that stop reading their answers: a finished answer its client has not read holds no
API key slot, and a client that reads nothing for `api.response_write_timeout` has its
connection closed (its request, if still running, aborted as a hang-up is).

The daemon serves in process, in the main thread (its signal handlers are the daemon's own),
on a listening socket with a small send buffer, which the connections it accepts inherit: a
client with a small receive buffer that never reads then stalls the daemon's writes after a
few hundred KiB of answer (the transport's 64 KiB high-water mark and the two sockets'
buffers), not after the megabytes loopback's autotuned buffers would take. A real SIGTERM
ends each serve."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from kvguard.daemon.cli import main
from kvguard.daemon.config import ConfigFileError, load_config
from kvguard.daemon.logging_setup import NOT_READ
from kvguard.daemon.service import Service, bind_api, timed_h11
from tests.test_grammar_prepare import loaded
from tests.test_server import until
from tests.test_slow_clients import read_raw

SMALL_BUFFER = 4096  # bytes asked for each socket's buffer (Linux doubles it)
# 4 choices of 64 tokens with their 20 most likely alternatives each: about 400 KB of SSE,
# several times what the buffers hold, so the daemon's writes stall well before the end
N = 4
STALLING = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 64,
    "n": N,
    "logprobs": True,
    "top_logprobs": 20,
    "stream": True,
    "ignore_eos": True,
}
TCP_CLOSED = (7, 8)  # tcpi_state: TCP_CLOSE (reset), TCP_CLOSE_WAIT (the peer's FIN)
# For tests whose client stalls on purpose while the engine works (up to `engine_done`'s
# bound): the 60 s default could cut it on a slow host
NEVER_CUT = "response_write_timeout: 10m"


def serve_while(svc: Service, drive: Callable[[str], None]) -> None:
    """Serve `svc` until `drive(url)`, on a helper thread once the API listens, has returned;
    then a SIGTERM stops it (exit 0 expected), unless `drive` began the stop (`begin_stop`).
    `drive`'s failure is the test's."""
    sock = bind_api("127.0.0.1", 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)  # accepted ones inherit
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    failed: list[BaseException] = []

    def run() -> None:
        try:
            until(lambda: svc._listening_now, 60, "the API listening")
            drive(url)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            failed.append(e)
        finally:  # always: serve() must end (a second SIGTERM would end the process)
            if not svc.draining:
                os.kill(os.getpid(), signal.SIGTERM)

    helper = threading.Thread(target=run, name="test-slow-readers", daemon=True)
    helper.start()
    try:
        code = asyncio.run(svc.serve(sock))
    finally:
        sock.close()
        helper.join(60)
    if failed:
        raise failed[0]
    assert code == 0


def begin_stop(svc: Service) -> None:
    """The daemon's own stop, as systemd asks for it: a SIGTERM, its drain begun on return."""
    os.kill(os.getpid(), signal.SIGTERM)
    until(lambda: svc.draining, 60, "the drain to begin")


@contextlib.contextmanager
def unread(url: str, body: dict[str, Any], key: str | None = None) -> Iterator[socket.socket]:
    """POST /v1/chat/completions from a client with a small receive buffer that reads nothing
    of its answer until the caller does; closed at the end."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    host, port = url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with sock:
        sock.sendall(head.encode() + data)
        yield sock


def finished(url: str, reason: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    pattern = (
        rf'^kvguard_requests_finished_total\{{finish_reason="{reason}",priority="normal"\}} (\S+)$'
    )
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


def engine_done(svc: Service, url: str, before: float) -> None:
    """Wait until the engine has finished the unread stream's N choices (their final outputs
    delivered: the loop holds them no more) while its answer is still being sent, the only
    one (the /metrics requests asked meanwhile ended)."""
    until(
        lambda: (
            finished(url, "length") >= before + N
            and not svc.loop.in_flight()
            and svc._answering() == 1
        ),
        120,
        "the engine done with the unread stream, its answer still being sent",
    )


def read_to_the_end(sock: socket.socket) -> bytes:
    """What the client had left unread, read now, up to its chunked stream's last chunk."""
    sock.settimeout(60)
    got, ended = read_raw(sock, lambda got: got.endswith(b"\r\n0\r\n\r\n"))
    assert ended is None, f"the connection {ended} after {len(got)} bytes: {got[-200:]!r}"
    return got


def tcp_state(sock: socket.socket) -> int:
    """The socket's TCP state as the kernel has it (read without reading any data)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def test_a_finished_stream_its_client_has_not_read_holds_no_key_slot(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A streamed answer stayed counted against its key's max_requests until its client had
    read all of it: a client that read slowly, or not at all, locked its key out (429 "4
    sequences queued or running") while the engine had finished and nothing ran. Counted as a
    non-streamed one is, it holds no slot once its choices' final outputs are in, and the
    stalled client still gets the whole answer when it reads."""
    keys = tmp_path / "api_keys.yaml"
    assert main(["keys", "--file", str(keys), "add", "slow", "--max-requests", str(N)]) == 0
    key = capsys.readouterr().out.strip()
    # the write timeout must not cut the stalled client however long the engine takes here
    svc = loaded(tmp_path, api=f"drain_timeout: 5s, api_keys_file: {keys}, {NEVER_CUT}")

    def drive(url: str) -> None:
        before = finished(url, "length")
        with unread(url, STALLING, key) as stalled:
            engine_done(svc, url, before)
            c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
            one = c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert one.choices[0].finish_reason in ("length", "stop")
            answer = read_to_the_end(stalled)
        assert b"data: [DONE]" in answer
        # the client did stall the daemon: the answer is well over what the buffers hold
        assert len(answer) > 256 * 1024, len(answer)

    serve_while(svc, drive)


def test_the_drain_counts_the_answers_still_being_sent_as_it_begins(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A drain held by an answer its client had not read began with "draining 0 in-flight
    requests", then waited for it: nothing said why the stop took up to drain_timeout and the
    grace after it. The line counts those answers too; the client that reads then gets its
    answer whole and the drain ends."""
    caplog.set_level(logging.INFO, logger="kvguard.daemon")
    svc = loaded(tmp_path, api=f"drain_timeout: 30s, {NEVER_CUT}")

    def drive(url: str) -> None:
        before = finished(url, "length")
        with unread(url, STALLING) as stalled:
            engine_done(svc, url, before)
            begin_stop(svc)
            answer = read_to_the_end(stalled)
        assert b"data: [DONE]" in answer

    serve_while(svc, drive)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvguard.daemon"]
    begun = [m for m in lines if m.startswith("draining ")]
    assert begun == ["draining 0 in-flight requests and 1 answers being sent (up to 30s)"]


def test_a_client_that_reads_none_of_its_answer_is_cut_off_after_the_write_timeout(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing timed a client that stopped reading: its connection, its unsent answer (many
    MB of it in memory) and its request's task stayed until the client hung up, or the daemon
    stopped. Now, once the daemon has been unable to send for api.response_write_timeout, the
    connection is aborted, the app sees the client gone, and the line that says so names the
    timeout (once a minute at most, then counted)."""
    caplog.set_level(logging.WARNING, logger="kvguard.daemon")
    svc = loaded(tmp_path, api="drain_timeout: 5s, response_write_timeout: 1s")

    def drive(url: str) -> None:
        with unread(url, STALLING) as stalled:
            until(lambda: tcp_state(stalled) in TCP_CLOSED, 120, "the stalled client cut off")
        until(
            lambda: not svc.loop.in_flight() and not svc._answering(),
            60,
            "the request and its answer ended",
        )

    serve_while(svc, drive)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvguard.daemon"]
    assert any(m.startswith(NOT_READ % 1) for m in lines), lines


def test_response_write_timeout_is_a_duration_of_a_second_or_more(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("api:\n  port: 8000\n")
    assert load_config(path).api.response_write_timeout == 60.0
    path.write_text("api:\n  response_write_timeout: 2m\n")
    assert load_config(path).api.response_write_timeout == 120.0
    path.write_text("api:\n  response_write_timeout: 20ms\n")
    with pytest.raises(ConfigFileError) as e:
        load_config(path)
    problem = "0.02s is too short (expected at least 1s)"
    assert f"{path}:2: api.response_write_timeout: {problem}" in str(e.value)


# -- the write timeout on a bare app: a large answer written at once ----------------------------

BIG = 8 << 20  # one non-streamed answer of 8 MiB, written to the transport in one go
WRITE_TIMEOUT = 2.0
READ = 32 << 10  # the steady reader takes at most this much every READ_EVERY_S
READ_EVERY_S = 0.01  # so reading BIG takes at least 2.56 s, past WRITE_TIMEOUT whatever the host


@contextlib.contextmanager
def big_answer_server() -> Iterator[int]:
    """uvicorn with the daemon's protocol (`timed_h11`, writes timed at WRITE_TIMEOUT) serving
    BIG bytes at once on loopback, from a socket with a small send buffer (the connections
    inherit it): what the client has not read waits in the transport's buffer. Its port."""

    async def big(request: Any) -> Response:
        return Response(b"x" * BIG, media_type="application/octet-stream")

    config = uvicorn.Config(
        Starlette(routes=[Route("/", big)]),
        http=timed_h11(20.0, WRITE_TIMEOUT),
        log_config=None,
        lifespan="off",
        ws="none",
    )
    server = uvicorn.Server(config)
    sock = bind_api("127.0.0.1", 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve([sock])), daemon=True)
    thread.start()
    try:
        until(lambda: server.started, 60, "the server listening")
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def ask_big(port: int) -> socket.socket:
    """GET the big answer on a new connection whose receive buffer (64 KiB) holds little of it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(60)
    return sock


def read_steadily(sock: socket.socket) -> bytes:
    """Read the big answer at READ every READ_EVERY_S at most, never pausing longer (but for
    the host's own delays), up to its end or the connection's (the old code's cut: what was
    read says when)."""
    got, _ = read_raw(
        sock,
        lambda got: len(got) >= BIG and len(got) >= got.index(b"\r\n\r\n") + 4 + BIG,
        READ,
        lambda: time.sleep(READ_EVERY_S),  # the client's pace, not a wait for something
    )
    return got


def test_a_client_reading_a_large_answer_steadily_is_not_cut_off_but_one_that_stops_is() -> None:
    """The write timer ran from the moment the daemon could not send until its buffer had
    drained: an answer written at once (a non-streamed one, logprobs JSON of MBs) drains only
    at its end, so a client reading it steadily, never pausing, was reset once reading it all
    took longer than api.response_write_timeout, with a line saying it read none of it. Now
    only a client that takes nothing of its answer for a whole timeout is cut off. (The
    line is the other test's: the daemon's log filter may count this one, not show it.)"""
    with big_answer_server() as port:
        with ask_big(port) as steady:
            got = read_steadily(steady)
        body = len(got) - got.index(b"\r\n\r\n") - 4
        assert body == BIG, f"the connection ended after {body} of the answer's {BIG} bytes"
        with ask_big(port) as stopped:
            assert stopped.recv(READ)  # the answer began, then the client reads no more
            until(lambda: tcp_state(stopped) in TCP_CLOSED, 60, "the stopped client cut off")
