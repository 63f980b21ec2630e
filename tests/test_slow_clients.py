"""Clients that never finish their request, as a hostile or broken one sends it: a real
`kvguard serve` of the tiny model on loopback, with a low limit on open files (systemd's soft
default is 1024) and a short `api.request_read_timeout`."""

from __future__ import annotations

import contextlib
import functools
import json
import resource
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvguard.daemon.config import ConfigFileError, load_config
from kvguard.daemon.service import MAX_HEADER_BYTES
from tests.test_server import Daemon

READ_TIMEOUT_S = 1.0
OPEN_FILES = (128, 256)  # soft, hard: the daemon raises the soft one to the hard one
CLOSE_BOUND_S = 30.0  # generous: the close is expected READ_TIMEOUT_S after the last byte
HALF_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: kvguard\r\nContent-Type: appl"


@contextlib.contextmanager
def open_files_limit(limit: tuple[int, int]) -> Iterator[None]:
    """Daemons started meanwhile run with `limit` on open files (RLIMIT_NOFILE)."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, limit)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "Popen", functools.partial(subprocess.Popen, preexec_fn=limited))
        yield


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with open_files_limit(OPEN_FILES):
        d = Daemon(
            tmp_path_factory.mktemp("slow"),
            debug_hooks=False,
            # no cap short of the descriptors: these tests are of what runs out of them
            api=f"request_read_timeout: {READ_TIMEOUT_S}s, max_connections: 100000",
        )
    yield d
    assert d.stop() == 0


def connect(d: Daemon, sent: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", d.port), timeout=CLOSE_BOUND_S)
    sock.sendall(sent)
    return sock


def read_raw(
    sock: socket.socket,
    done: Callable[[bytearray], bool] = lambda got: False,
    size: int = 1 << 16,
    after_read: Callable[[], None] = lambda: None,
    on_timeout: Callable[[], None] | None = None,
) -> tuple[bytes, str | None]:
    """What a raw client read of its connection, `size` bytes at most a read, until `done`
    says it has enough or the server ends the connection, and how it ended: "closed",
    "reset", or None (still open). `after_read` runs after each read (the client's pace);
    `on_timeout`, where given, when a read times out (the socket's timeout), and reading
    goes on; without it the timeout is raised."""
    got = bytearray()
    while not done(got):
        try:
            part = sock.recv(size)
        except TimeoutError:
            if on_timeout is None:
                raise
            on_timeout()
            continue
        except ConnectionResetError:
            return bytes(got), "reset"
        if not part:
            return bytes(got), "closed"
        got += part
        after_read()
    return bytes(got), None


def until_closed(sock: socket.socket, trickle: bytes = b"") -> tuple[bytes, float]:
    """What the daemon sent before it closed `sock`, and how long that took; each `trickle`
    byte is sent 0.2 s apart meanwhile (a client that keeps its request coming, too slowly).
    A connection still open after CLOSE_BOUND_S, or reset, fails the test."""
    t0 = time.monotonic()
    sock.settimeout(0.2 if trickle else CLOSE_BOUND_S)

    def send_trickle() -> None:
        with contextlib.suppress(OSError):
            sock.sendall(trickle)

    got, ended = read_raw(
        sock, lambda _: time.monotonic() - t0 >= CLOSE_BOUND_S, on_timeout=send_trickle
    )
    if ended != "closed":
        pytest.fail(f"the daemon had not closed the connection after {CLOSE_BOUND_S:g}s: {got!r}")
    return got, time.monotonic() - t0


@pytest.mark.parametrize(
    ("sent", "trickle", "answer"),
    [
        (b"", b"", b""),  # connected, and sent nothing
        (HALF_HEADERS, b"", b"HTTP/1.1 408 "),
        (HALF_HEADERS, b"x", b"HTTP/1.1 408 "),  # the headers' deadline is not moved by bytes
        (HALF_HEADERS + b"ication/json\r\nContent-Length: 100\r\n\r\n{", b"", b""),  # half a body
    ],
    ids=["nothing", "half-the-headers", "headers-trickling", "half-the-body"],
)
def test_a_request_that_never_arrives_whole_is_closed(
    daemon: Daemon, sent: bytes, trickle: bytes, answer: bytes
) -> None:
    """Each of these connections stayed open for ever: a thousand of them took every file
    descriptor the daemon had. Now it closes them once `api.request_read_timeout` has passed
    (from the connect for the headers, from the last byte for a body), with a 408 where the
    headers had begun."""
    with connect(daemon, sent) as sock:
        got, _ = until_closed(sock, trickle)
    assert got.startswith(answer), got
    if answer:
        assert b"no whole request within 1s" in got, got


def test_the_daemon_raises_its_soft_open_files_limit_to_the_hard_one(daemon: Daemon) -> None:
    """systemd's soft default (1024) is kept low for programs that call select(): each
    connection holds a descriptor, and the daemon waits on epoll."""
    limits = Path(f"/proc/{daemon.proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    assert line.split()[3:5] == [str(OPEN_FILES[1])] * 2, line


def test_more_stalled_connections_than_descriptors_do_not_shut_out_other_clients(
    daemon: Daemon,
) -> None:
    """More connections that never finish their headers than the daemon has descriptors: it
    could not accept another, /health, the API and /admin answered no one, and asyncio logged
    each failed accept with a traceback, ~10,000 records a second. Now they are reaped after
    `api.request_read_timeout` and the others are served; the failed accepts are one log line,
    with no traceback."""
    stalled = [connect(daemon, HALF_HEADERS) for _ in range(OPEN_FILES[1] + 64)]
    try:
        health = httpx.get(daemon.url + "/health", timeout=CLOSE_BOUND_S)
        assert health.status_code == 200, health.text
        r = daemon.client().completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert r.choices[0].text is not None
    finally:
        for sock in stalled:
            sock.close()
    log = Path(daemon.log.name).read_text()
    assert log.count("the API cannot accept connections: Too many open files") == 1, log
    assert "out of system resource" not in log and "Traceback" not in log, log[-4000:]


def test_headers_too_large_answer_431_not_a_reset(daemon: Daemon) -> None:
    """A client whose headers pass the 16 KiB limit (a large cookie or token) was reset
    before it could read an answer; it gets 431 naming the limit."""
    headers = {f"x-large-{i}": "a" * 8192 for i in range(100)}
    r = httpx.get(daemon.url + "/health", headers=headers, timeout=CLOSE_BOUND_S)
    assert r.status_code == 431, r.text
    assert "at most 16 KiB" in r.text


def request(size: int, method: str = "GET", path: str = "/health", body: bytes = b"") -> bytes:
    """A request whose line and headers take `size` bytes (their blank line included), padded
    with an X-Pad header, and `body` after them."""
    head = f"{method} {path} HTTP/1.1\r\nHost: kvguard\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    pad = size - len(head) - len("X-Pad: \r\n\r\n")
    return f"{head}X-Pad: {'a' * pad}\r\n\r\n".encode() + body


def answers(got: bytes) -> list[tuple[int, bytes]]:
    """The answers whole in `got`, in order: each one's status and body (by Content-Length)."""
    whole = []
    while (end := got.find(b"\r\n\r\n")) >= 0:
        head = got[:end].decode("latin-1").lower()
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        if len(got) < end + 4 + length:
            break
        whole.append((int(head.split()[1]), got[end + 4 : end + 4 + length]))
        got = got[end + 4 + length :]
    return whole


def answered(sock: socket.socket, sent: bytes, count: int) -> list[tuple[int, bytes]]:
    """Send `sent` in one write, then read `count` answers (or what came before the close)."""
    sock.sendall(sent)
    got, _ = read_raw(sock, lambda got: len(answers(got)) >= count)
    return answers(got)


@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 1, 17 * 1024, 100 * 1024])
@pytest.mark.parametrize("before", ["none", "answered", "pipelined"])
def test_headers_too_large_in_one_read_answer_431(daemon: Daemon, size: int, before: str) -> None:
    """h11 held a request's line and headers to the limit only while they were incomplete:
    sent in one write, they were read whole (asyncio reads 256 KiB at a time) and served at any
    size, and only a slow client met README's 16 KiB. Now they get 431 naming the limit,
    however they arrive: as a connection's first request, as the next one on a connection
    kept alive after its answer, or pipelined behind a request in the same write."""
    small = request(200)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=CLOSE_BOUND_S) as sock:
        if before == "answered":
            assert [status for status, _ in answered(sock, small, 1)] == [200]
        sent = (small if before == "pipelined" else b"") + request(size)
        got = answered(sock, sent, 2 if before == "pipelined" else 1)
        assert [status for status, _ in got] == [200] * (before == "pipelined") + [431], got
        assert b"the request line and headers may take at most 16 KiB" in got[-1][1], got
        assert sock.recv(1) == b""  # and the connection is closed


def test_a_short_malformed_head_with_much_behind_it_answers_400_not_431(daemon: Daemon) -> None:
    """A head h11 cannot parse, short, with more than 16 KiB behind it in the same write: the
    431 was chosen by the length of all that was buffered, not of the head, and named a limit
    the request was within."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=CLOSE_BOUND_S) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n" + b"x" * (20 * 1024))
        got, ended = read_raw(sock)
    assert got.startswith(b"HTTP/1.1 400 ") and ended in ("closed", "reset"), (ended, got)


@pytest.mark.parametrize("size", [15 * 1024, MAX_HEADER_BYTES])
def test_headers_within_the_limit_are_served_whatever_follows_them(
    daemon: Daemon, size: int
) -> None:
    """What is held to the limit is the line and headers, not what arrives with them: a body
    that takes the request past 16 KiB in the same write is served, and so is a request kept
    alive after it."""
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 1}).encode()
    completion = request(size, "POST", "/v1/completions", body + b" " * 4096)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=CLOSE_BOUND_S) as sock:
        first = answered(sock, completion, 1)
        second = answered(sock, request(size), 1)
    assert [status for status, _ in first + second] == [200, 200], first + second
    assert json.loads(first[0][1])["object"] == "text_completion"


def test_request_read_timeout_is_a_duration_of_a_second_or_more(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("api:\n  port: 8000\n")
    assert load_config(path).api.request_read_timeout == 20.0
    path.write_text("api:\n  request_read_timeout: 1m\n")
    assert load_config(path).api.request_read_timeout == 60.0
    for value, problem in [
        ("20ms", "0.02s is too short (expected at least 1s)"),
        ("20 sec", "'20 sec' is not a duration"),
        ("-5", "-5 is negative"),
    ]:
        path.write_text(f"api:\n  request_read_timeout: {value}\n")
        with pytest.raises(ConfigFileError) as e:
            load_config(path)
        assert f"{path}:2: api.request_read_timeout: {problem}" in str(e.value)
