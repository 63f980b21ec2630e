"""The control plane end to end: a real Prometheus scrapes a live `kvguard serve`, a PromQL rule
acts on the engine under load and undoes when the load is gone, all of it in the audit log."""

from __future__ import annotations

import itertools
import json
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server import TOKEN, Daemon, free_port

PROM_RULES = """version: 1
interval: 1s
cooldown: 2s
signals:
  fleet_kv: {{promql: 'max(kvguard_kv_cache_usage_ratio{{tier="device",instance="$instance"}})'}}
rules:
  - {{name: busy, signal: fleet_kv, above: {above}, action: reduce_batch, params: {{factor: 0.5}},
     recover_below: 0.05, recover_for: 2s, undo: restore_batch}}
"""


def wait_for(pred, timeout: float, what: str, step: float = 0.2):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    pytest.fail(f"timed out waiting for {what}")


class Prometheus:
    def __init__(self, tmp: Path, target_port: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "prometheus.yml"
        cfg.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n  - job_name: kvguard\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
        )
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self._ready, 30, "prometheus ready")

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def rows(db: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


class SteadyLoad:
    """`n` clients, each sending a new request as soon as its last one ends, until stopped:
    the pressure lasts as long as the test needs it, however slow or fast the machine is."""

    def __init__(self, d: Daemon, n: int, tokens: int) -> None:
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(d, tokens)) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _client(self, d: Daemon, tokens: int) -> None:
        # each request its own prompt: the prefix cache would share one prompt's blocks
        body = {"model": "tiny", "max_tokens": tokens, "ignore_eos": True}
        for k in itertools.count():
            if self.done.is_set():
                break
            body["prompt"] = f"{threading.get_ident()} {k} " + "load " * 20
            httpx.post(d.url + "/v1/completions", timeout=300, json=body)

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(300)


def prom_value(prom: Prometheus, expr: str) -> float | None:
    """The value of a one-series PromQL expression now, or None while it has no sample."""
    r = httpx.get(prom.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    result = r["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_promql_rule_acts_under_load_and_undoes_after(tmp_path: Path) -> None:
    port = free_port()
    rules = tmp_path / "rules.yaml"
    rules.write_text(PROM_RULES.format(above=0.3))
    prom_port_holder = tmp_path / "unused"
    prom = Prometheus(tmp_path, port)
    try:
        d = Daemon(
            tmp_path,
            port=port,
            extra=(
                f"rules: {{path: {rules}}}\n"
                f"prometheus: {{url: '{prom.url}', timeout: 2s, instance: '127.0.0.1:{port}'}}\n"
            ),
        )
        usage = f'max(kvguard_kv_cache_usage_ratio{{tier="device",instance="127.0.0.1:{port}"}})'
        try:
            # Wait for what makes the action due, never for a guessed time: load that lasts until
            # Prometheus holds a sample above the threshold and the rule has acted on it.
            steady = SteadyLoad(d, 16, 300)
            try:
                wait_for(
                    lambda: (prom_value(prom, usage) or 0.0) > 0.3,
                    300,
                    "a scraped KV usage sample above the rule's threshold",
                )
                wait_for(
                    lambda: d.admin("GET", "/admin/state").json()["knobs"]["max_num_seqs"] == 16,
                    120,
                    "reduce_batch applied by the PromQL rule",
                )
            finally:
                steady.stop()
            wait_for(
                lambda: d.admin("GET", "/admin/state").json()["knobs"]["max_num_seqs"] == 32,
                120,
                "restore_batch after the load",
            )
            wait_for(
                lambda: d.admin("GET", "/admin/state").json()["incident"] is None,
                60,
                "incident closed",
            )
            metrics = httpx.get(d.url + "/metrics").text
            assert (
                'kvguard_actions_total{action="reduce_batch",outcome="applied",rule="busy"}'
                in metrics
            )
            # Prometheus goes away: the signal becomes unknown, failures are counted, nothing acts
            prom.stop()
            wait_for(
                lambda: _metric(d, "kvguard_prometheus_query_failures_total") > 0,
                30,
                "query failures",
            )
            state = d.admin("GET", "/admin/state").json()
            assert state["rules"][0]["state"] == "unknown"
        finally:
            assert d.stop() == 0
        db = tmp_path / "audit.db"
        acts = rows(
            db,
            "SELECT rule, action, outcome, is_undo, state_before, state_after, incident, trigger "
            "FROM actions ORDER BY id",
        )
        assert [(a[0], a[1], a[2], bool(a[3])) for a in acts] == [
            ("busy", "reduce_batch", "applied", False),
            ("busy", "restore_batch", "applied", True),
        ]
        before, after = json.loads(acts[0][4]), json.loads(acts[0][5])
        assert before["max_num_seqs"] == 32 and after["max_num_seqs"] == 16
        assert acts[0][6] and acts[0][6] == acts[1][6] and acts[0][7] == "signal"
        inc = rows(db, "SELECT id, closed_at, actions_count FROM incidents")
        assert (
            len(inc) == 1 and inc[0][0] == acts[0][6] and inc[0][1] is not None and inc[0][2] == 2
        )
        kinds = [r[0] for r in rows(db, "SELECT kind FROM events ORDER BY id")]
        assert kinds[0] == "daemon_start" and kinds[-1] == "daemon_stop"
    finally:
        if prom.proc.poll() is None:
            prom.stop()
        del prom_port_holder


def test_a_reload_points_promql_signals_at_the_new_prometheus(tmp_path: Path) -> None:
    """The `prometheus` section is live: a reload that sets its URL gives PromQL signals a
    client for it (they were unknown without one) and says so in its changes."""
    port = free_port()
    rules = tmp_path / "rules.yaml"
    rules.write_text(PROM_RULES.format(above=0.9))
    d = Daemon(tmp_path, port=port, extra=f"rules: {{path: {rules}}}\n")
    prom = Prometheus(tmp_path, port)
    try:
        wait_for(
            lambda: d.admin("GET", "/admin/state").json()["rules"][0]["state"] == "unknown",
            30,
            "the PromQL rule unknown without a Prometheus",
        )
        with d.config.open("a") as f:
            f.write(f"prometheus: {{url: '{prom.url}', instance: '127.0.0.1:{port}'}}\n")
        r = d.admin("POST", "/admin/reload")
        assert r.status_code == 200 and r.json()["changes"]["prometheus.url"] == prom.url, r.text
        wait_for(
            lambda: d.admin("GET", "/admin/state").json()["rules"][0]["state"] == "inactive",
            120,
            "the PromQL rule reading the new Prometheus",
        )
    finally:
        prom.stop()
        assert d.stop() == 0


def _metric(d: Daemon, name: str) -> float:
    for line in httpx.get(d.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_sighup_with_broken_rules_keeps_the_old_ones(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "version: 1\nsignals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n"
        "  - {name: first, signal: kv, above: 0.99, action: halt_admission}\n"
    )
    d = Daemon(tmp_path, extra=f"rules: {{path: {rules}}}\n")
    try:
        names = lambda: [r["name"] for r in d.admin("GET", "/admin/state").json()["rules"]]  # noqa: E731
        assert names() == ["first"]
        rules.write_text("version: 1\nrules:\n  - {name: broken, signal: nope, action: explode}\n")
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert names() == ["first"] and d.proc.poll() is None
        rules.write_text(
            "version: 1\nsignals: {kv: {local: kv_cache_usage_ratio}}\nrules:\n"
            "  - {name: second, signal: kv, above: 0.99, action: halt_admission}\n"
        )
        res = d.admin("POST", "/admin/reload").json()
        assert res["reloaded"] is True and names() == ["second"]
        assert res["rules_changed"] == ["-first", "+second"]
    finally:
        assert d.stop() == 0
    assert "rules -first +second" in (tmp_path / "daemon.log").read_text()
    events = rows(tmp_path / "audit.db", "SELECT kind, detail FROM events ORDER BY id")
    assert any(k == "config_error" and "rules reload refused" in det for k, det in events)
    assert any(k == "reload" for k, _ in events)


def test_alertmanager_webhook_dedupes_and_resolves(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    alert = {
        "status": "firing",
        "labels": {"alertname": "GPUNearOOM", "severity": "critical"},
        "startsAt": "2026-11-30T10:00:00Z",
        "fingerprint": "abc123",
    }
    body = {"version": "4", "status": "firing", "receiver": "kvguard", "alerts": [alert]}
    try:
        assert httpx.post(d.url + "/alertmanager", json=body).status_code == 401
        first = d.admin("POST", "/alertmanager", json=body).json()
        again = d.admin("POST", "/alertmanager", json=body).json()
        assert first == {"accepted": 1, "duplicates": 0, "other_instance": 0}
        assert again == {"accepted": 0, "duplicates": 1, "other_instance": 0}
        labels = {**alert["labels"], "instance": "elsewhere:1"}
        other = {**body, "alerts": [{**alert, "fingerprint": "zz", "labels": labels}]}
        assert d.admin("POST", "/alertmanager", json=other).json()["other_instance"] == 1
        wait_for(
            lambda: d.admin("GET", "/admin/state").json()["admission"]["halted"],
            20,
            "halt from the alert",
        )
        resolved = {**body, "status": "resolved", "alerts": [{**alert, "status": "resolved"}]}
        assert d.admin("POST", "/alertmanager", json=resolved).json()["accepted"] == 1
        wait_for(
            lambda: not d.admin("GET", "/admin/state").json()["admission"]["halted"],
            20,
            "resume on resolve",
        )
        bad = d.admin("POST", "/alertmanager", json={"version": "3", "alerts": []})
        assert bad.status_code == 400 and "version" in bad.json()["error"]["message"]
    finally:
        assert d.stop() == 0
    db = tmp_path / "audit.db"
    kinds = [r[0] for r in rows(db, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("alert_received") == 1 and kinds.count("alert_resolved") == 1
    acts = rows(db, "SELECT rule, action, trigger, is_undo FROM actions ORDER BY id")
    assert acts == [
        ("am-gpu-near-oom", "halt_admission", "alert", 0),
        ("am-gpu-near-oom", "resume_admission", "alert", 1),
    ]


STALL_S = 20.0  # how long the engine thread sleeps: far longer than any read below may take
READ_BOUND_S = 1.0  # a read that blocks on the action waits the whole stall, not this long


def _state_within_bound(d: Daemon) -> dict:
    """GET /admin/state, failing (not hanging) if it does not answer while the engine stalls."""
    try:
        r = httpx.get(
            d.url + "/admin/state",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=READ_BOUND_S,
        )
    except httpx.TimeoutException:
        pytest.fail("/admin/state blocked while a rule's action waited on the stalled engine")
    return r.raise_for_status().json()


def _in_flight(state: dict, rule: str) -> str | None:
    return next(r for r in state["rules"] if r["name"] == rule).get("in_flight")


def test_metrics_and_state_answer_while_an_action_waits_on_a_stalled_engine(
    tmp_path: Path,
) -> None:
    d = Daemon(tmp_path)
    alert = {
        "status": "firing",
        "labels": {"alertname": "GPUNearOOM"},
        "startsAt": "2026-12-01T10:00:00Z",
        "fingerprint": "stall1",
    }
    try:
        stall = d.admin("POST", "/admin/debug/stall", json={"seconds": STALL_S})
        assert stall.json() == {"stalled_s": STALL_S}
        # the alert rule posts halt_admission behind the stall and waits for the engine
        body = {"version": "4", "status": "firing", "alerts": [alert]}
        assert d.admin("POST", "/alertmanager", json=body).json()["accepted"] == 1
        wait_for(
            lambda: _in_flight(_state_within_bound(d), "am-gpu-near-oom") == "halt_admission",
            STALL_S,
            "halt_admission awaited on the stalled engine",
        )
        metrics = httpx.get(d.url + "/metrics", timeout=READ_BOUND_S)
        assert metrics.status_code == 200 and "kvguard_rule_state{" in metrics.text
        state = _state_within_bound(d)
        # both answered while the action was still awaited, not after the stall ended
        assert _in_flight(state, "am-gpu-near-oom") == "halt_admission"
        assert not state["admission"]["halted"]
        # once the engine steps again the action lands, recorded once
        wait_for(
            lambda: _state_within_bound(d)["admission"]["halted"],
            STALL_S + 60,
            "halt_admission applied after the stall",
        )
        assert _in_flight(_state_within_bound(d), "am-gpu-near-oom") is None
    finally:
        assert d.stop() == 0
    acts = rows(tmp_path / "audit.db", "SELECT rule, action, outcome, trigger FROM actions")
    assert acts == [("am-gpu-near-oom", "halt_admission", "applied", "alert")]
    log = (tmp_path / "daemon.log").read_text()
    assert "rule tick skipped: awaiting am-gpu-near-oom: halt_admission" in log
