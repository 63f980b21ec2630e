"""The log an operator reads: what a client can make the daemon write (bounded, escaped, no
secrets), and the journal's priorities under systemd.

The HTTP side runs a real `kvguard serve` of the `tiny` model on loopback, sent raw bytes over
sockets; the rest drives the real logging set-up, evaluator and control plane in process.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from kvguard.daemon.control_plane import MAX_ALERT_NAME_CHARS, AlertPayloadError, ControlPlane
from kvguard.daemon.logging_setup import _Bounded, configure_logging
from kvguard.engine.control import ActionResult
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import load_rules_text
from kvguard.rules.signals import PromQL, url_shown
from tests.test_promql_edges import FakePrometheus, audit, config, plane, prom, scrape  # noqa: F401
from tests.test_server import Daemon, free_port, until

# bytes that are not HTTP: the start of a TLS ClientHello, as a client set to https:// sends
NOT_HTTP = b"\x16\x03\x01\x00\xc4\x01\r\n\r\n"
BAD_CONNECTIONS = 200
# headers that are HTTP, then a body that is not: `ZZZ` is no chunk size
BAD_CHUNK = "GET {} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\n"
BAD_BODIES = 20


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("logging")
    url = f"http://ops:OldPassw0rd@127.0.0.1:{free_port()}"  # nobody listens there
    d = Daemon(tmp, extra=f"prometheus: {{url: '{url}'}}\n")
    d.tmp = tmp  # type: ignore[attr-defined]
    yield d
    if d.proc.poll() is None:
        assert d.stop() == 0


def _send_raw(port: int, data: bytes) -> bytes:
    """One connection: `data` sent, everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def test_invalid_http_requests_are_logged_once_then_counted(served: Daemon) -> None:
    """Before, each connection that sent bytes that are not HTTP logged `Invalid HTTP request
    received.` (about 5,000 lines a second from one client, with no address). Now the first is
    logged with its client's address and the rest counted."""
    for _ in range(BAD_CONNECTIONS):
        assert _send_raw(served.port, NOT_HTTP).startswith(b"HTTP/1.1 400 ")
    # the daemon still serves, and its lines are written before each answer goes out
    assert httpx.get(served.url + "/ready", timeout=30).status_code == 200
    log = (served.tmp / "daemon.log").read_text()  # type: ignore[attr-defined]
    invalid = [line for line in log.splitlines() if "Invalid HTTP request" in line]
    assert len(invalid) == 1, invalid
    assert "Invalid HTTP request received from 127.0.0.1:" in invalid[0]
    uvicorn_lines = [line for line in log.splitlines() if "uvicorn" in line]
    assert len(uvicorn_lines) <= 2, uvicorn_lines  # the first, and a count if 60 s went by


def test_a_body_that_is_not_http_is_counted_with_no_traceback(served: Daemon) -> None:
    """Before, each request with a malformed chunked body logged, besides the bounded
    `Invalid HTTP request` line, `Exception in ASGI application` at ERROR with an 87-line
    traceback (h11 refusing the app's answer: uvicorn had answered 400 already): about 6 KB
    per request, from any client, on any route, without an API key."""
    log_file = served.tmp / "daemon.log"  # type: ignore[attr-defined]
    before = len(log_file.read_text().splitlines())
    for path in ("/health", "/v1/models", "/nowhere"):
        for _ in range(BAD_BODIES):
            answer = _send_raw(served.port, BAD_CHUNK.format(path).encode())
            assert answer.startswith(b"HTTP/1.1 400 "), answer
    # the daemon still serves; uvicorn logs the refusal before it closes the connection
    assert httpx.get(served.url + "/ready", timeout=30).status_code == 200
    new = log_file.read_text().splitlines()[before:]
    assert not [line for line in new if "Traceback" in line or "ASGI" in line], new[:20]
    # the module's first invalid request, and a count if 60 s went by
    assert len([line for line in new if "uvicorn" in line]) <= 2, new
    assert len(new) <= 5, new


def test_a_websocket_upgrade_is_plain_http_with_no_line(served: Daemon) -> None:
    """Before, each request with `Upgrade: websocket` logged two warnings, one telling the
    operator to pip install a websocket library kvguard has no use for."""
    upgrade = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version": "13",
    }
    for _ in range(20):
        r = httpx.get(served.url + "/health", headers=upgrade, timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "alive"}
    log = (served.tmp / "daemon.log").read_text()  # type: ignore[attr-defined]
    assert "pip install" not in log and "Unsupported upgrade" not in log


def test_a_reload_never_shows_the_prometheus_password(served: Daemon) -> None:
    """Before, a reload that changed prometheus.url put the new URL, password and all, in the
    log, in the /admin/reload answer and in the audit `reload` event."""
    text = served.config.read_text()
    assert "OldPassw0rd" in text
    served.config.write_text(text.replace("OldPassw0rd", "Hunter2NewPw"))
    r = served.admin("POST", "/admin/reload")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["reloaded"] is True
    assert body["changes"]["prometheus.url"].startswith("http://ops:***@127.0.0.1:")
    assert served.stop() == 0
    log = (served.tmp / "daemon.log").read_text()  # type: ignore[attr-defined]
    assert "reloaded " in log and "ops:***@127.0.0.1:" in log
    with sqlite3.connect(served.tmp / "audit.db") as con:  # type: ignore[attr-defined]
        events = con.execute("SELECT data FROM events WHERE kind = 'reload'").fetchall()
    assert len(events) == 1
    assert "ops:***@" in events[0][0]
    for place in (r.text, log, events[0][0]):
        assert "Hunter2NewPw" not in place and "OldPassw0rd" not in place


def test_bounded_lines_are_counted_and_the_count_is_logged() -> None:
    """The lines after the first within the interval come back as one count, even when the
    burst has ended (a timer writes it)."""
    logger = logging.getLogger("kvguard.test.bounded")
    logger.propagate = False
    got: list[str] = []
    counted = threading.Event()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())
            if "more invalid HTTP requests" in record.getMessage():
                counted.set()

    logger.addHandler(Keep())
    what = {"Invalid HTTP request received.": "invalid HTTP requests"}
    logger.addFilter(_Bounded(logger, what, interval_s=0.2))
    for _ in range(50):
        logger.warning("Invalid HTTP request received.")
    logger.warning("another line")  # other lines pass
    assert counted.wait(30), got
    assert got == [
        "Invalid HTTP request received.",  # no uvicorn connection here: no address
        "another line",
        "49 more invalid HTTP requests in the last 0.2s (not logged one by one)",
    ]


JOURNAL_SCRIPT = """
import logging
from kvguard.daemon.logging_setup import configure_logging
configure_logging("DEBUG")
log = logging.getLogger("kvguard.test")
log.debug("d")
log.info("i")
log.warning("w")
log.error("first\\nsecond")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("boom")
log.critical("c")
"""


def _run_logging(tmp_path: Path, journal: bool | str) -> list[str]:
    err = tmp_path / "stderr.log"
    err.write_text("")
    st = os.stat(err)
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    if journal is True:
        env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    elif journal:
        env["JOURNAL_STREAM"] = journal
    with open(err, "w") as f:
        subprocess.run(
            [sys.executable, "-c", JOURNAL_SCRIPT], stderr=f, env=env, check=True, timeout=60
        )
    return err.read_text().splitlines()


def test_under_journald_each_line_carries_its_priority(tmp_path: Path) -> None:
    """Before, journald stored every line at `info` (`journalctl -p warning` showed nothing)
    and a traceback's lines after the first had no level at all."""
    lines = _run_logging(tmp_path, journal=True)
    assert all(line[:1] == "<" and line[2:3] == ">" for line in lines), lines
    assert [line[:3] for line in lines if " kvguard.test: " in line] == [
        "<7>",
        "<6>",
        "<4>",
        "<3>",
        "<3>",
        "<2>",
    ]
    assert "<3>second" in lines  # the message's second line
    tb = lines.index(next(line for line in lines if line.endswith("kvguard.test: boom")))
    assert lines[tb + 1] == "<3>Traceback (most recent call last):"
    assert any(line.startswith("<3>ZeroDivisionError") for line in lines[tb + 2 :])
    # stderr not the journal's stream (a redirect, another inode): lines as they were
    for other in (False, "1:2"):
        plain = _run_logging(tmp_path, journal=other)
        assert len(plain) == len(lines) and not any(line.startswith("<") for line in plain)
        assert plain[0].split(" ", 2)[2] == "DEBUG kvguard.test: d"


def test_the_prometheus_password_is_masked() -> None:
    assert url_shown("http://promuser:PromS3cretPw@127.0.0.1:9090") == (
        "http://promuser:***@127.0.0.1:9090"
    )
    assert (
        url_shown("https://u:p@ss@h/prom?token=abc&x=1#f") == "https://u:***@h/prom?token=***&x=1#f"
    )
    assert url_shown("http://prometheus:9090/") == "http://prometheus:9090/"
    assert url_shown(None) is None


def test_prometheus_answering_again_does_not_log_its_password(
    prom: FakePrometheus,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: `Prometheus at http://promuser:PromS3cretPw@... answers again`."""
    url = prom.url.replace("http://", "http://promuser:PromS3cretPw@")
    q = PromQL(url, 2.0, "me:1")
    with caplog.at_level(logging.INFO, logger="kvguard.rules.signals"):
        prom.answer = "503"
        assert q.query("up") is None
        prom.answer = "number"
        assert q.query("up") == 0.93
    assert "promuser:***@127.0.0.1:" in caplog.text and "answers again" in caplog.text
    assert "PromS3cretPw" not in caplog.text


def test_a_reloaded_prometheus_url_is_reported_masked(
    tmp_path: Path,
    plane: ControlPlane,  # noqa: F811
) -> None:
    plane.service.cfg = config(
        tmp_path, "{url: 'http://ops:Hunter2Pw@127.0.0.1:9', timeout: 2s, instance: 'me:8000'}"
    )
    res = plane.reload(tmp_path / "rules.yaml", dry_run=False)
    assert res["prometheus_changed"] == {"prometheus.url": "http://ops:***@127.0.0.1:9"}
    assert plane.promql.url == "http://ops:Hunter2Pw@127.0.0.1:9"  # the client still uses it


def _alert(name: str, instance: str, fingerprint: str) -> dict[str, Any]:
    labels = {"alertname": name, "instance": instance}
    return {"status": "firing", "labels": labels, "fingerprint": fingerprint}


def test_alert_names_cannot_forge_log_lines_or_grow_without_bound(
    plane: ControlPlane,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, an alert name with a newline wrote a second, forged log line, and a 9 KB name
    went into the log twice and into /metrics as a label."""
    forged = "X\n2026-12-06 07:00:00,000 CRITICAL kvguard.daemon: forged line"
    long_instance = "i" * 5000
    with caplog.at_level(logging.WARNING, logger="kvguard.control"):
        got = plane.alertmanager({"version": "4", "alerts": [_alert(forged, long_instance, "a")]})
    assert got["other_instance"] == 1
    lines = [r.getMessage() for r in caplog.records if "names instance" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert repr(forged) in lines[0]
    assert "(5000 characters)" in lines[0] and len(lines[0]) < 1000
    too_long = "N" * (MAX_ALERT_NAME_CHARS + 1)
    with pytest.raises(AlertPayloadError, match="at most 256") as e:
        plane.alertmanager({"version": "4", "alerts": [_alert(too_long, "other:1", "b")]})
    assert e.value.param == "alerts[0].labels.alertname" and e.value.status == 400
    names = {dict(labels).get("alertname") for _, labels in scrape(plane)}
    assert too_long not in names and forged in names
    ok = "N" * MAX_ALERT_NAME_CHARS
    assert plane.alertmanager({"version": "4", "alerts": [_alert(ok, "other:1", "c")]})


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_skipped_rule_ticks_are_logged_once_a_minute_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, each tick that met a running evaluation logged `rule tick skipped` at INFO: 69
    identical lines in 3 s under a burst of alerts."""
    rules = load_rules_text(
        "version: 1\ninterval: 5s\nsignals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n"
        "  - {name: evict, signal: kv, above: 0.95, action: evict_lowest_priority}\n",
        "test.yaml",
    )
    clock = _Clock()

    def execute(action: str, params: dict[str, Any]) -> ActionResult:
        return ActionResult(action, {}, {}, "ok", True)

    ev = Evaluator(rules, lambda n, s: 0.0, execute, clock=clock, wall_clock=clock)
    with caplog.at_level(logging.INFO, logger="kvguard.rules"):
        assert ev._turn.acquire(blocking=False)  # an evaluation under way
        try:
            for _ in range(69):
                assert ev.try_tick() is None
            clock.t = 61.0
            assert ev.try_tick() is None
        finally:
            ev._turn.release()
    assert ev.stats.skipped == 70
    lines = [r.getMessage() for r in caplog.records if "rule tick skipped" in r.getMessage()]
    assert lines == [
        "rule tick skipped: another evaluation is running",
        "rule tick skipped: another evaluation is running (68 more since the last such line)",
    ]


async def _app_with_bugs(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/bug raises before answering; /bad-header answers with a header h11 cannot write (a
    newline in its value): both are bugs in the app, on connections whose requests were HTTP."""
    if scope["path"] == "/bug":
        raise RuntimeError("a bug in the app")
    headers = [(b"x-forged", b"a\nb")] if scope["path"] == "/bad-header" else []
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


def _get(path: str) -> bytes:
    """A request that is HTTP, on a connection the server closes after answering."""
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


def test_an_exception_in_the_app_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """The records dropped for the bodies that are not HTTP are only those of h11 refusing an
    answer to a request uvicorn had refused: an exception in the app still logs its traceback,
    h11's own LocalProtocolError among them when the app wrote an answer h11 cannot send."""
    root = logging.getLogger()
    saved = root.level
    port = free_port()
    config = uvicorn.Config(
        _app_with_bugs,
        host="127.0.0.1",
        port=port,
        log_config=None,
        log_level=None,
        ws="none",
        access_log=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    try:
        configure_logging("INFO")
        thread.start()
        until(lambda: server.started, 30, "the test server")
        assert _send_raw(port, _get("/ok")).startswith(b"HTTP/1.1 200 ")
        for _ in range(BAD_BODIES):
            assert _send_raw(port, BAD_CHUNK.format("/ok").encode()).startswith(b"HTTP/1.1 400 ")
        assert _send_raw(port, _get("/bug")).startswith(b"HTTP/1.1 500 ")
        assert _send_raw(port, _get("/bad-header")) == b""  # closed: no answer could go out
    finally:
        server.should_exit = True
        thread.join(30)
        root.setLevel(saved)
    failed = [r for r in caplog.records if r.name == "uvicorn.error" and r.exc_info]
    assert [type(r.exc_info[1]).__name__ for r in failed if r.exc_info] == [
        "RuntimeError",
        "LocalProtocolError",
    ], [r.exc_text for r in failed]
    assert all(r.getMessage().startswith("Exception in ASGI application") for r in failed)
    assert "a bug in the app" in caplog.text and "Illegal header value" in caplog.text
    invalid = [r for r in caplog.records if r.getMessage().startswith("Invalid HTTP request")]
    assert len(invalid) <= 1  # the first of the process's, unless an earlier test had one
