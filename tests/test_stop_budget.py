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
    """Both sockets set SO_REUSEADDR: while neither listened, the second bind succeeded, and
    only the listen() once the model was loaded failed, minutes later."""
    first = bind_api("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(ApiBindError, match=f"cannot bind the API to 127.0.0.1:{port}: "):
            bind_api("127.0.0.1", port)
    finally:
        first.close()


def test_a_daemon_started_on_a_port_another_is_loading_on_fails_its_start_at_once(
    tmp_path: Path,
) -> None:
    """Two starts that overlap (systemd restarting during a slow load, an operator's manual run
    beside the service): the first is held right after its bind (its admin token file is a
    FIFO, first read then), and the second exits 1 at once naming the address, having loaded
    nothing. It used to bind the same port, load its model and serve, the first one dying of
    EADDRINUSE after its own load. A client that connects meanwhile is held, not refused, and
    answered once the first daemon serves."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    port = free_port()
    fifo = first / "admin.token"
    os.mkfifo(fifo)
    proc, log = serve(first, write_config(first, port, fifo))
    other = None
    client = None
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
        assert f"cannot bind the API to 127.0.0.1:{port}" in said and "nothing loaded" in said
        assert not (second / "audit.db").exists(), said

        client = socket.create_connection(("127.0.0.1", port), timeout=90)  # held, not refused
        client.sendall(b"GET /health HTTP/1.1\r\nHost: kvguard\r\nConnection: close\r\n\r\n")
        with fifo.open("w") as token:  # the first daemon goes on: it loads, then serves
            token.write(TOKEN + "\n")
        answer = b""
        while chunk := client.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 "), (answer, log.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if client is not None:
            client.close()
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
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvguard.daemon.service import warn_stop_budget

    caplog.set_level(logging.WARNING, logger="kvguard.daemon")
    warn_stop_budget(DaemonConfig.model_validate({"api": {"drain_timeout": 30}}))
    assert caplog.records == []  # the default fits the unit
    warn_stop_budget(DaemonConfig.model_validate({"api": {"drain_timeout": 45}}))
    [record] = caplog.records
    assert record.getMessage().startswith(
        "api.drain_timeout is 45s: a stop may take 75s, more than the 60s TimeoutStopSec= of "
        "kvguard's systemd unit. systemd is asked for that time as the stop begins "
        "(EXTEND_TIMEOUT_USEC); another supervisor must give the daemon 75s after its SIGTERM, "
        "or set api.drain_timeout to 30s or less"
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
    assert "api.drain_timeout is 45s: a stop may take 75s" in said, said


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
