"""kvguard's Prometheus side at its edges: PromQL signals whose answer holds no number, a
Prometheus that trickles its answer, counters that must survive a reload, Alertmanager alerts
for another daemon, and outcome series that must exist before their first increment.

PromQL reads go over real HTTP on loopback to a small stand-in for Prometheus' query API whose
answer each test sets; the control plane is the real one (APScheduler, a SQLite audit store)
with the engine left out, as in tests/test_reload.py.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.daemon.audit import AuditStore
from kvguard.daemon.config import load_config
from kvguard.daemon.control_plane import ControlPlane
from kvguard.daemon.metrics import ControlPlaneCollector, SnapshotCollector
from kvguard.rules.signals import PromQL

# Prometheus' /api/v1/query answers, by the name a test gives them
ANSWERS: dict[str, dict[str, Any]] = {
    "number": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "0.93"]}]},
    "two": {
        "resultType": "vector",
        "result": [
            {"metric": {"a": "1"}, "value": [1, "0.2"]},
            {"metric": {}, "value": [1, "0.7"]},
        ],
    },
    "scalar": {"resultType": "scalar", "result": [1, "0.5"]},
    "inf": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "+Inf"]}]},
    "empty": {"resultType": "vector", "result": []},
    "nan": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "NaN"]}]},
    "scalar_nan": {"resultType": "scalar", "result": [1, "NaN"]},
    "string": {"resultType": "string", "result": [1, "hello"]},
    "matrix": {"resultType": "matrix", "result": [{"metric": {}, "values": [[1, "0.9"]]}]},
}


class FakePrometheus:
    """/api/v1/query on loopback answering `self.answer` (a key of ANSWERS), or trickling a
    number's answer a byte every `trickle_s` (until `stop`), or an HTTP error status ("500",
    "503"; "400" with Prometheus' bad_data body; "403" with the request line, as a proxy that
    names what it refused). `by_query` answers some queries otherwise. Any path but
    `prefix + "/api/v1/query"` is 404, as under Prometheus' --web.route-prefix."""

    def __init__(self) -> None:
        self.answer = "number"
        self.by_query: dict[str, str] = {}  # query -> its answer, in place of `answer`
        self.prefix = ""
        self.trickle_s = 0.0
        self.queries: list[str] = []
        self.stopping = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                fake.queries.append(self.path)
                if urlsplit(self.path).path != fake.prefix + "/api/v1/query":
                    self.send_error(404)
                    return
                query = parse_qs(urlsplit(self.path).query).get("query", [""])[0]
                answer = fake.by_query.get(query, fake.answer)
                if answer == "403":
                    body = f"refused: GET {self.path}".encode()
                    self.send_response(403)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if answer == "400":
                    body = json.dumps({"status": "error", "errorType": "bad_data"}).encode()
                    self.send_response(400)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if answer in ("500", "503"):
                    self.send_response(int(answer))
                    self.end_headers()
                    return
                body = json.dumps({"status": "success", "data": ANSWERS[answer]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not fake.trickle_s:
                    self.wfile.write(body)
                    return
                for byte in body:  # each read gets a byte well inside the socket timeout
                    if fake.stopping.wait(fake.trickle_s):
                        return
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prom() -> Iterator[FakePrometheus]:
    p = FakePrometheus()
    yield p
    p.stop()


# -- answers with no number ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "value"),
    [("number", 0.93), ("two", 0.7), ("scalar", 0.5), ("inf", float("inf"))],
)
def test_numbers_are_read(prom: FakePrometheus, answer: str, value: float) -> None:
    prom.answer = answer
    q = PromQL(prom.url, 2.0, "me:1")
    assert q.query('max(x{instance="$instance"})') == value
    assert (q.failures, q.empty) == (0, 0)
    assert "me%3A1" in prom.queries[-1]


@pytest.mark.parametrize("answer", ["empty", "nan", "scalar_nan", "string", "matrix"])
def test_an_answer_with_no_number_is_unknown_and_counted(
    prom: FakePrometheus, answer: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, these left the rule unknown with nothing counted, and a `string` answer raised
    out of the query (outside its try) into the rule tick."""
    prom.answer = answer
    q = PromQL(prom.url, 2.0, "me:1")
    with caplog.at_level(logging.INFO, logger="kvguard.rules.signals"):
        assert q.query("x") is None
        assert q.query("x") is None
        assert (q.failures, q.empty) == (0, 2)
        prom.answer = "number"
        assert q.query("x") == 0.93
    assert q.empty == 2
    # logged once while it lasts, and once when it answers again
    assert sum("answered no number" in m for m in caplog.messages) == 1
    assert sum("answers a number again" in m for m in caplog.messages) == 1


def test_failures_are_counted_apart_from_empty_answers(prom: FakePrometheus) -> None:
    prom.answer = "500"
    q = PromQL(prom.url, 2.0, "me:1")
    assert q.query("x") is None
    assert (q.failures, q.empty) == (1, 0)
    none = PromQL(None, 2.0, "me:1")
    assert none.query("x") is None and none.failures == 1


def test_a_refused_query_is_logged_once_beside_a_good_one(
    prom: FakePrometheus, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, one flag for the whole client: a query Prometheus refuses (a typo: 400) beside
    one it answers logged "failing" and "answers again" on every tick. A query's own failure
    is logged once for that query; Prometheus out of reach, once for the client."""
    prom.by_query = {"sum(rate(x[5m])": "400"}
    q = PromQL(prom.url, 2.0, "me:1")
    with caplog.at_level(logging.INFO, logger="kvguard.rules.signals"):
        for _ in range(3):  # three rule ticks
            assert q.query("x") == 0.93
            assert q.query("sum(rate(x[5m])") is None
        prom.by_query = {}  # fixed
        assert q.query("sum(rate(x[5m])") == 0.93
        prom.answer = "503"  # Prometheus itself unavailable: every query, one outage
        for _ in range(2):
            assert q.query("x") is None and q.query("y") is None
        prom.answer = "number"
        assert q.query("x") == 0.93 and q.query("y") == 0.93
    assert q.failures == 3 + 4
    said = caplog.messages
    assert sum("'sum(rate(x[5m])' failing (PrometheusApiClientException" in m for m in said) == 1
    assert sum("'sum(rate(x[5m])' answers again" in m for m in said) == 1
    assert sum(m.startswith("Prometheus query failing") for m in said) == 1
    assert sum(m.startswith("Prometheus at") and "answers again" in m for m in said) == 1
    assert len(said) == 4, said


def test_no_connection_is_logged_once_for_every_query(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = PromQL(f"http://127.0.0.1:{port}", 2.0, "me:1")
    with caplog.at_level(logging.INFO, logger="kvguard.rules.signals"):
        for _ in range(2):
            assert q.query("x") is None and q.query("y") is None
    assert q.failures == 4
    assert len(caplog.messages) == 1 and "ConnectionError" in caplog.messages[0]


# -- a URL with a path and a token -------------------------------------------------------------
@pytest.mark.parametrize("path", ["/prom", "/prom/"])
def test_a_url_with_a_path_and_a_token_queries_the_api_under_that_path(
    prom: FakePrometheus, path: str
) -> None:
    """A Prometheus behind a proxy that wants `?token=`. Before, the client put the API path
    after the whole URL, query string and all: every query asked for
    `/prom?token=T/api/v1/query&query=...` (404 under the prefix), and each was logged as a
    failing PromQL expression."""
    prom.prefix = "/prom"
    q = PromQL(f"{prom.url}{path}?token=QSECRET&org=a%2Fb&org=c", 2.0, "me:1")
    assert q.query('up{instance="$instance"}') == 0.93 and q.failures == 0
    sent = urlsplit(prom.queries[-1])
    assert sent.path == "/prom/api/v1/query"
    assert parse_qs(sent.query) == {
        "query": ['up{instance="me:1"}'],
        "token": ["QSECRET"],
        "org": ["a/b", "c"],
    }


def test_a_failing_prometheus_logs_no_secret_of_its_url(
    prom: FakePrometheus, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, `Prometheus query failing (ConnectionError: ... Max retries exceeded with url:
    /prom?token=QSECRET/api/v1/query&query=up ...)`: the token in clear in the journal. Now
    every line that names the URL hides the password and the token, as written or encoded:
    the failure lines, urllib3's own request lines at DEBUG, and a proxy's answer that echoes
    the request it refused."""
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = PromQL(f"http://promuser:PROMPW@127.0.0.1:{port}/prom?token=QSE%2FCRET", 1.0, "i")
    prom.prefix = "/prom"
    refusing = PromQL(f"{prom.url}/prom?token=QSE%2FCRET&client_secret=QS2", 1.0, "i")
    with caplog.at_level(logging.DEBUG):
        answers = [down.query("up"), refusing.query("up")]  # the 2nd: a request line at DEBUG
        prom.answer = "403"
        answers.append(refusing.query("up"))
    said = caplog.text
    for secret in ("PROMPW", "QSE", "QS2"):
        assert secret not in said, (secret, said)
    assert answers == [None, 0.93, None]
    assert "Prometheus query failing (ConnectionError" in said
    assert "/prom/api/v1/query?query=up&token=***" in said  # where it went, less the token
    masked = "/prom/api/v1/query?query=up&token=***&client_secret=***"
    assert f'"GET {masked} HTTP/1.1" 200' in said  # urllib3's request line
    assert (
        "PromQL query 'up' failing (PrometheusApiClientException: HTTP Status Code 403 "
        f"(b'refused: GET {masked}'))" in said
    )


# -- a deadline for the whole query ------------------------------------------------------------
def test_a_trickling_answer_is_cut_at_the_timeout(prom: FakePrometheus) -> None:
    """Each byte arrives well inside the socket timeout, the answer in ~40 s: the query gives
    up at its 1 s timeout (before, it waited out the whole answer). While that request still
    runs, another query fails at once rather than starting a second one."""
    prom.trickle_s = 0.4
    q = PromQL(prom.url, 1.0, "me:1")
    t0 = time.monotonic()
    value = q.query("x")
    took = time.monotonic() - t0
    assert 0.9 <= took < 2.5, took
    assert value is None and q.failures == 1
    t0 = time.monotonic()
    assert q.query("x") is None
    assert time.monotonic() - t0 < 0.5
    assert q.failures == 2 and len(prom.queries) == 1


def test_a_query_runs_again_once_the_late_one_ends(prom: FakePrometheus) -> None:
    prom.trickle_s = 0.02  # the answer takes ~2 s in all: past the timeout, then done
    q = PromQL(prom.url, 0.5, "me:1")
    assert q.query("x") is None and q.failures == 1
    late = q._late
    assert late is not None and late.wait(30), "the late request never ended"
    prom.trickle_s = 0.0
    assert q.query("x") == 0.93 and q.failures == 1


# -- the control plane: reloads and other daemons' alerts ---------------------------------------
RULES = (
    "version: 1\ninterval: 5s\nsignals: {fleet: {promql: 'max(x{instance=\"$instance\"})'}}\n"
    "rules:\n  - {name: fleet-halt, signal: fleet, above: 0.9, action: halt_admission}\n"
)


@pytest.fixture
def audit(tmp_path: Path) -> Iterator[AuditStore]:
    store = AuditStore(f"sqlite:///{tmp_path / 'audit.db'}")
    store.start()
    yield store
    store.stop(timeout=5)


def config(tmp_path: Path, prometheus: str) -> Any:
    (tmp_path / "rules.yaml").write_text(RULES)
    path = tmp_path / "config.yaml"
    path.write_text(f"rules: {{path: {tmp_path / 'rules.yaml'}}}\nprometheus: {prometheus}\n")
    return load_config(path)


@pytest.fixture
def plane(tmp_path: Path, audit: AuditStore, prom: FakePrometheus) -> Iterator[ControlPlane]:
    """A control plane whose rule job is scheduled (paused: no tick reaches for an engine)."""
    cfg = config(tmp_path, f"{{url: '{prom.url}', timeout: 2s, instance: 'me:8000'}}")
    service = SimpleNamespace(cfg=cfg, engine=None, audit=audit, rules_at_start=None, api_port=8000)
    cp = ControlPlane(service)  # type: ignore[arg-type]
    cp.scheduler.start(paused=True)
    yield cp
    cp.stop()


def scrape(cp: ControlPlane) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(ControlPlaneCollector(lambda: cp, lambda: None))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }


def test_a_reload_that_changes_prometheus_keeps_the_counts(
    tmp_path: Path, plane: ControlPlane, prom: FakePrometheus
) -> None:
    """Before, the new client started at 0: kvguard_prometheus_query_failures_total fell back,
    which Prometheus reads as a counter reset (the failures before it lost to increase())."""

    def read() -> None:
        plane.reader("fleet", plane.ruleset.signals["fleet"])

    prom.answer = "500"
    read()
    read()
    assert scrape(plane)[("kvguard_prometheus_query_failures_total", ())] == 2
    plane.service.cfg = config(tmp_path, f"{{url: '{prom.url}', timeout: 3s, instance: 'me:8000'}}")
    res = plane.reload(tmp_path / "rules.yaml", dry_run=False)
    assert res["prometheus_changed"] == {"prometheus.timeout": 3.0}
    assert plane.promql.timeout_s == 3.0 and plane.reader.promql is plane.promql
    assert scrape(plane)[("kvguard_prometheus_query_failures_total", ())] == 2
    read()
    assert scrape(plane)[("kvguard_prometheus_query_failures_total", ())] == 3
    # and the empty answers' counter likewise
    prom.answer = "empty"
    read()
    plane.service.cfg = config(tmp_path, f"{{url: '{prom.url}', timeout: 4s, instance: 'me:8000'}}")
    assert plane.reload(tmp_path / "rules.yaml", dry_run=False)["prometheus_changed"]
    got = scrape(plane)
    assert got[("kvguard_prometheus_query_empty_total", ())] == 1
    assert got[("kvguard_prometheus_query_failures_total", ())] == 3


def test_alerts_for_another_instance_are_counted_and_logged_once_per_name(
    plane: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, an alert whose instance label was not this daemon's was dropped with no log line
    and no metric: a prometheus.instance that did not match the scrape target's label (the
    address Prometheus scrapes, say 127.0.0.1:8000) looked like Alertmanager never called."""

    def alert(name: str, instance: str, fingerprint: str) -> dict[str, Any]:
        labels = {"alertname": name, "instance": instance}
        return {"status": "firing", "labels": labels, "fingerprint": fingerprint}

    alerts = [
        alert("GPUNearOOM", "127.0.0.1:8000", "a"),
        alert("GPUNearOOM", "127.0.0.1:8000", "b"),
        alert("KVCacheCritical", "other:8000", "c"),
    ]
    with caplog.at_level(logging.WARNING, logger="kvguard.control"):
        got = plane.alertmanager({"version": "4", "alerts": alerts})
        assert got == {"accepted": 0, "duplicates": 0, "other_instance": 3}
        plane.alertmanager({"version": "4", "alerts": [alert("GPUNearOOM", "x:1", "d")]})
    lines = [m for m in caplog.messages if "names instance" in m]
    assert len(lines) == 2, lines
    assert "GPUNearOOM names instance '127.0.0.1:8000', and this daemon is 'me:8000'" in lines[0]
    assert "KVCacheCritical names instance 'other:8000'" in lines[1]
    got = scrape(plane)
    assert got[("kvguard_alerts_ignored_total", (("alertname", "GPUNearOOM"),))] == 3
    assert got[("kvguard_alerts_ignored_total", (("alertname", "KVCacheCritical"),))] == 1
    assert not any(name == "kvguard_alerts_received_total" for name, _ in got)


# -- series that exist from 0 ----------------------------------------------------------------------
def test_every_finish_reason_kvguard_gives_starts_at_zero() -> None:
    """finish_reason "error" (the engine failed, or a request's grammar did) is what an alert
    or a dashboard watches: its series must exist at 0 before the first one, or the first error
    is no increase() at all."""
    fam = SnapshotCollector(lambda: None, lambda: True)._finished(SimpleNamespace(finished={}))  # type: ignore[arg-type]
    got = {(s.labels["finish_reason"], s.labels["priority"]): s.value for s in fam.samples}
    for reason in ("stop", "length", "abort", "error"):
        for priority in ("high", "normal", "low"):
            assert got[(reason, priority)] == 0, (reason, priority)


def test_every_alert_a_rule_acts_on_starts_at_zero(tmp_path: Path, plane: ControlPlane) -> None:
    """Before, an alert's series were made by its first webhook, born at 1: increase() never
    counted that first alert, so its dashboard panel missed it. Each alert an `alert:NAME`
    rule names is exported at 0, firing and resolved (and not taken, for another daemon), from
    the moment the rule is loaded; what is taken counts on from there."""
    path = tmp_path / "alert-rules.yaml"
    path.write_text(
        RULES + '  - {name: am-halt, on: "alert:GPUNearOOM", action: halt_admission,'
        " undo: resume_admission}\n"
    )
    assert plane.reload(path, dry_run=False)["rules_reloaded"]
    got = scrape(plane)
    received = "kvguard_alerts_received_total"
    for status in ("firing", "resolved"):
        assert got[(received, (("alertname", "GPUNearOOM"), ("status", status)))] == 0, status
    assert got[("kvguard_alerts_ignored_total", (("alertname", "GPUNearOOM"),))] == 0
    labels = {"alertname": "GPUNearOOM", "instance": "me:8000"}
    alert = {"status": "firing", "labels": labels, "fingerprint": "a"}
    assert plane.alertmanager({"version": "4", "alerts": [alert]})["accepted"] == 1
    got = scrape(plane)
    assert got[(received, (("alertname", "GPUNearOOM"), ("status", "firing")))] == 1
    assert got[(received, (("alertname", "GPUNearOOM"), ("status", "resolved")))] == 0
