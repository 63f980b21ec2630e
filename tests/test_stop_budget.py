"""The edges of a daemon's life as systemd sees them: a second daemon on a port another one is
loading on fails its start at once, a stop asks systemd for the time it may take, and the
process's own exit after the stop does not walk the startup heap again."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvguard.daemon.config import ApiConfig, DaemonConfig
from kvguard.daemon.service import ApiBindError, bind_api
from tests.test_server import KVGUARD, TEST_DAEMON_ENV, TOKEN, free_port, until

REPO = Path(__file__).resolve().parents[1]
# `kvguard serve` as its console script runs it, saying at the interpreter's exit (the last
# atexit handler: registered first) how much of the heap is still frozen out of the collector
SERVE_SAYING_THE_FROZEN_HEAP_AT_EXIT = """\
import atexit, gc, sys
atexit.register(lambda: print(f"test: frozen at exit: {gc.get_freeze_count()}", flush=True))
from kvguard.daemon.cli import main
sys.exit(main(["serve", "--config", sys.argv[1]]))
"""


def write_config(tmp: Path, port: int, token_file: Path, drain: str = "20s") -> Path:
    """A tiny-model daemon's config, its audit database and state in `tmp`."""
    config = tmp / "config.yaml"
    config.write_text(
        "serving: {model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}\n"
        f"api: {{host: 127.0.0.1, port: {port}, admin_token_file: {token_file},"
        f" drain_timeout: {drain}}}\n"
        f"audit: {{url: 'sqlite:///{tmp / 'audit.db'}'}}\n"
    )
    return config


def serve(
    tmp: Path, config: Path, env: dict[str, str] | None = None, argv: list[str] | None = None
) -> tuple[subprocess.Popen, Path]:
    """Start `kvguard serve --config` (or `argv` + the config), its log in `tmp`."""
    log_path = tmp / "daemon.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*(argv or [KVGUARD, "serve", "--config"]), str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **TEST_DAEMON_ENV, "STATE_DIRECTORY": str(tmp), **(env or {})},
        )
    return proc, log_path


def ended(proc: subprocess.Popen) -> None:
    """A test's cleanup: the daemon killed if it still runs."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(60)


@dataclass
class Notifications:
    """What a daemon told systemd: `address` for its $NOTIFY_SOCKET, the datagrams in `got`."""

    address: str
    got: list[str] = field(default_factory=list)


@pytest.fixture
def notify_socket() -> Iterator[Notifications]:
    """An sd_notify receiver standing in for systemd, on an abstract address (no path to
    outgrow a socket's 108 bytes), read on a thread: a full queue would block the sender."""
    name = f"kvguard-test-notify-{os.getpid()}-{secrets.token_hex(4)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(0.2)
    told = Notifications("@" + name)
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                told.got.append(sock.recv(4096).decode())
            except TimeoutError:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield told
    finally:
        done.set()
        reader.join(5)
        sock.close()


# -- the API's port ---------------------------------------------------------------------------
def test_a_second_bind_of_the_api_port_fails_at_once() -> None:
    """Both sockets set SO_REUSEADDR, and neither listens before its model is loaded: the
    kernel lets both bind, and only the listen() once the model was loaded would have failed,
    minutes later. The port's claim fails the second bind, naming the first kvguard."""
    first = bind_api("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(
            ApiBindError,
            match=f"cannot bind the API to 127.0.0.1:{port}: another kvguard on this host has "
            f"its API on 127.0.0.1:{port} ",
        ):
            bind_api("127.0.0.1", port)
    finally:
        first.close()
    assert first.claim.fileno() == -1  # the claim goes with its socket: the port is free again


# `::` with IPv4 too (IPV6_V6ONLY off), 127.0.0.2 another address of loopback; no specific IPv6
# address: a host with IPv6 turned off has none
ADDRESSES = ["0.0.0.0", "127.0.0.1", "127.0.0.2", "::"]


def kernel_refuses_both_listening(a: str, b: str) -> bool:
    """Whether the kernel lets TCP sockets on addresses `a` and `b` of one port both listen
    (both with SO_REUSEADDR, as the API's): the conflicts the claim must find before either
    listens."""
    first, second = (socket.socket(socket.AF_INET6 if ":" in h else socket.AF_INET) for h in (a, b))
    with first, second:
        for s in (first, second):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        first.bind((a, 0))
        try:
            second.bind((b, first.getsockname()[1]))
            first.listen()
            second.listen()
        except OSError:
            return True
        return False


@pytest.mark.parametrize("first_host", ADDRESSES)
@pytest.mark.parametrize("second_host", ADDRESSES)
def test_the_claim_finds_the_addresses_the_kernel_would_refuse(
    first_host: str, second_host: str
) -> None:
    """A wildcard covers the specific addresses on its port (0.0.0.0 the IPv4 ones, :: all),
    two specific addresses share it: a second kvguard's bind fails exactly where its listen()
    would, once its model was loaded."""
    first = bind_api(first_host, 0)
    try:
        port = first.getsockname()[1]
        if kernel_refuses_both_listening(first_host, second_host):
            with pytest.raises(ApiBindError, match="another kvguard on this host has its API"):
                bind_api(second_host, port)
        else:
            bind_api(second_host, port).close()
    finally:
        first.close()


def test_a_daemon_started_on_a_port_another_is_loading_on_fails_its_start_at_once(
    tmp_path: Path,
) -> None:
    """Two starts that overlap (systemd restarting during a slow load, an operator's manual run
    beside the service): the first is held right after its bind (its admin token file is a
    FIFO, first read then), and the second exits 1 at once naming the address, having loaded
    nothing. A client that connects meanwhile is refused, at once, as `kvguard status` says:
    the socket is bound and does not listen until the daemon serves. A listening one held the
    connections unanswered through the load, passed TCP health checks and let `kvguard status`
    time out after 10 s."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    port = free_port()
    fifo = first / "admin.token"
    os.mkfifo(fifo)
    proc, log = serve(first, write_config(first, port, fifo))
    other = None
    try:
        bound = f"API bound to 127.0.0.1:{port}"
        until(lambda: proc.poll() is not None or bound in log.read_text(), 90, "the first bind")
        assert proc.poll() is None, log.read_text()
        (second / "admin.token").write_text(TOKEN + "\n")
        other, other_log = serve(second, write_config(second, port, second / "admin.token"))
        until(
            lambda: other.poll() is not None or "ready:" in other_log.read_text(),
            90,
            "the second daemon to exit or serve",
        )
        said = other_log.read_text()
        assert other.poll() == 1, f"the second daemon serves on the first one's port:\n{said}"
        assert (
            f"cannot bind the API to 127.0.0.1:{port}: another kvguard on this host has its API "
            f"on 127.0.0.1:{port}" in said
        ), said
        assert "nothing loaded" in said and not (second / "audit.db").exists(), said

        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=90).close()
        status = subprocess.run(
            [KVGUARD, "status", "--url", f"http://127.0.0.1:{port}"]
            + ["--token-file", str(second / "admin.token")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode != 0, status.stdout
        assert f"cannot reach kvguard at http://127.0.0.1:{port}: " in status.stderr
        assert "Connection refused" in status.stderr, status.stderr

        with fifo.open("w") as token:  # the first daemon goes on: it loads, then serves
            token.write(TOKEN + "\n")

        def health() -> int | None:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
            except httpx.ConnectError:  # refused: still loading
                return None

        until(lambda: health() is not None, 90, "the first daemon to serve")
        assert health() == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if other is not None:
            ended(other)
        ended(proc)


# -- the stop's time --------------------------------------------------------------------------
def test_the_units_stop_timeout_is_the_one_said_and_holds_the_default_stop() -> None:
    """The warning names the shipped unit's TimeoutStopSec: it must be the unit's value, and
    the default drain's whole stop must fit it."""
    from kvguard.daemon.service import (
        STOP_AFTER_DRAIN_S,
        STOP_EXIT_MARGIN_S,
        UNIT_TIMEOUT_STOP_S,
        stop_budget_s,
    )

    unit = (REPO / "daemon" / "systemd" / "kvguard.service").read_text()
    line = next(x for x in unit.splitlines() if x.startswith("TimeoutStopSec="))
    assert float(line.removeprefix("TimeoutStopSec=").removesuffix("s")) == UNIT_TIMEOUT_STOP_S
    default = ApiConfig().drain_timeout
    assert stop_budget_s(default) == default + STOP_AFTER_DRAIN_S + STOP_EXIT_MARGIN_S
    assert stop_budget_s(default) <= UNIT_TIMEOUT_STOP_S


def test_a_drain_timeout_whose_stop_outlasts_the_unit_is_named(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without $NOTIFY_SOCKET the stop asks no supervisor for its time: a warning."""
    from kvguard.daemon.service import log_stop_budget

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    caplog.set_level(logging.INFO, logger="kvguard.daemon")
    log_stop_budget(DaemonConfig.model_validate({"api": {"drain_timeout": 30}}))
    assert caplog.records == []  # the default fits the unit
    log_stop_budget(DaemonConfig.model_validate({"api": {"drain_timeout": 45}}))
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "api.drain_timeout is 45s: a stop may take 75s, more than the 60s TimeoutStopSec= of "
        "kvguard's systemd unit, and with no NOTIFY_SOCKET (not a Type=notify systemd unit) "
        "the stop asks no supervisor for that time: give the daemon 75s after its SIGTERM, "
        "or set api.drain_timeout to 30s or less"
    )


def test_under_systemd_a_long_drain_is_said_at_info_not_warned_of(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under systemd the stop asks for its time (EXTEND_TIMEOUT_USEC): nothing to act on, so
    no warning at every start and reload, only a line saying what the stop will ask for."""
    from kvguard.daemon.service import log_stop_budget

    monkeypatch.setenv("NOTIFY_SOCKET", "@kvguard-test-never-sent-to")  # read, not sent to
    caplog.set_level(logging.INFO, logger="kvguard.daemon")
    log_stop_budget(DaemonConfig.model_validate({"api": {"drain_timeout": 45}}))
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "api.drain_timeout is 45s: a stop may take 75s, more than the 60s TimeoutStopSec= of "
        "kvguard's systemd unit; the stop asks systemd for 75s as it begins "
        "(EXTEND_TIMEOUT_USEC)"
    )


def test_the_stop_asks_systemd_for_the_time_it_may_take(
    tmp_path: Path, notify_socket: Notifications
) -> None:
    """After STOPPING=1 comes EXTEND_TIMEOUT_USEC for the whole stop of the drain_timeout in
    force (here raised by a reload to 45s: 45 + 20 + 10 s), so that a unit's TimeoutStopSec
    (45s in older copies of kvguard's unit) does not SIGKILL a stop keeping to its bound. It
    used to send STOPPING=1 alone; the reload that raised drain_timeout said nothing either."""
    token = tmp_path / "admin.token"
    token.write_text(TOKEN + "\n")
    config = write_config(tmp_path, free_port(), token)
    proc, log = serve(tmp_path, config, {"NOTIFY_SOCKET": notify_socket.address})
    told = notify_socket.got
    readies = lambda: sum(m.startswith("READY=1") for m in told)  # noqa: E731
    try:
        until(lambda: proc.poll() is not None or readies() == 1, 90, "READY=1")
        assert proc.poll() is None, log.read_text()
        assert "a stop may take" not in log.read_text()  # 20 + 20 + 10 s fits the unit's 60 s
        config.write_text(config.read_text().replace("drain_timeout: 20s", "drain_timeout: 45s"))
        proc.send_signal(signal.SIGHUP)
        until(lambda: readies() == 2, 60, "READY=1 after the reload")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        ended(proc)
    said = log.read_text()
    assert "reloaded" in said and "'api.drain_timeout': 45.0" in said, said
    stopping = told.index("STOPPING=1")
    assert told[stopping + 1 : stopping + 2] == ["EXTEND_TIMEOUT_USEC=75000000"], told
    line = " INFO kvguard.daemon: api.drain_timeout is 45s: a stop may take 75s"
    assert line in said, said  # systemd is asked: no warning


def test_the_process_exits_with_the_startup_heap_still_frozen(tmp_path: Path) -> None:
    """`kvguard serve` ends right after its stop: the heap frozen at start is not handed back
    to the collector (close() did, and the interpreter's final collections then walked all of
    it: 0.8 s of CPU with smollm2, 2-3 s of wall time on a busy host, past every bound the
    stop keeps). The stop's own work is done as before: its audit row is written."""
    token = tmp_path / "admin.token"
    token.write_text(TOKEN + "\n")
    port = free_port()
    config = write_config(tmp_path, port, token)
    argv = [sys.executable, "-c", SERVE_SAYING_THE_FROZEN_HEAP_AT_EXIT]
    proc, log = serve(tmp_path, config, argv=argv)

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(ready, 90, "the daemon to serve")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        ended(proc)
    said = log.read_text()
    [frozen] = [int(x.split(": ")[-1]) for x in said.splitlines() if "test: frozen at exit" in x]
    assert frozen > 10_000, said  # the startup heap: torch, the model, FastAPI, ...
    with sqlite3.connect(tmp_path / "audit.db") as db:
        kinds = [k for (k,) in db.execute("SELECT kind FROM events ORDER BY id")]
    assert kinds[-1] == "daemon_stop", kinds
