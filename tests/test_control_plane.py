"""The control plane end to end: a real Prometheus scrapes a live `kvguard serve`, a PromQL rule
acts on the engine under load and undoes when the load is gone, all of it in the audit log.
Also: an action (a rule's or an operator's) that a stalled engine does not take in time is
withdrawn and never applies, and one the engine is stuck inside is recorded when it lands."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvguard.daemon import admin_api
from kvguard.daemon.app import create_app
from kvguard.daemon.config import load_config
from kvguard.daemon.control_plane import ControlPlane
from kvguard.daemon.service import Service
from kvguard.engine import LLMEngine
from kvguard.engine.control import ActionResult
from kvguard.engine.engine_loop import EngineLoop
from kvguard.engine.events import EngineEvent
from kvguard.engine.structured import Grammars
from kvguard.rules.actions import ActionWithdrawn, StopSignal, await_action, run_action
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import load_rules_text
from tests.test_engine import make_engine
from tests.test_remedy_holds import HEADER
from tests.test_server import TOKEN, Daemon, free_port, until

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


# -- an action the engine does not take, or takes and does not finish, in time -----------------
# In process, with the waits shrunk: the daemon waits 120 s (a rule) or 60 s (an operator) for
# the engine to take an action at a step boundary, and as long again for one it took.

HALT_RULE = HEADER + (
    "  - {name: halt, signal: kv, above: 0.99, action: halt_admission,"
    " params: {allow_priority: high}, recover_below: 0.8, recover_for: 10s,"
    " undo: resume_admission}\n"
)
WAIT_S = 0.2  # the waits, shrunk


class HaltRule:
    """The `halt` rule on a fake clock, acting through the control plane's executor (waiting
    `timeout_s`) on a real engine stepped by its loop."""

    def __init__(self, loop: EngineLoop, timeout_s: float) -> None:
        self.t = 0.0
        self.values = {"kv": 0.995}
        plane = SimpleNamespace(service=SimpleNamespace(engine=loop.engine))
        plane.action_timeout_s = timeout_s
        plane.stopping = StopSignal()  # the daemon's stop: never set here
        self.plane = plane  # a test gives the engine time again once it steps
        self.ev = Evaluator(
            load_rules_text(HALT_RULE, "rules.yaml"),
            lambda name, _signal: self.values[name],
            ControlPlane._execute.__get__(plane),
            clock=lambda: self.t,
            wall_clock=lambda: self.t,
        )

    def at(self, t: float, kv: float) -> list[tuple[str, str, str]]:
        self.t, self.values["kv"] = t, kv
        return [(d.action, d.outcome, d.detail) for d in self.ev.tick()]

    def state(self) -> dict[str, Any]:
        return self.ev.rule_states()[0]


def allowed(engine: LLMEngine) -> str | None:
    return engine.knobs()["admission_allow_priority"]  # type: ignore[return-value]


def test_a_rule_action_the_engine_never_took_is_withdrawn_and_never_applies() -> None:
    """Before, the executor gave up after 120 s (`failed`, detail `TimeoutError: `) and left
    the command in the mailbox: the halt applied once the engine came back, with no rule in
    force to undo it, so admission stayed halted for good."""
    engine = make_engine(kv_cache_bytes="1MiB", num_threads=1)
    loop = EngineLoop(engine)
    loop.paused.set()  # the engine thread is held from the start (a hung step)
    loop.start()
    rule = HaltRule(loop, timeout_s=WAIT_S)
    try:
        [(action, outcome, detail)] = rule.at(0.0, kv=0.995)
        assert (action, outcome) == ("halt_admission", "failed")
        assert "withdrawn before it ran" in detail and "nothing changed" in detail, detail
        loop.paused.clear()
        loop.call(lambda: None).result(60)  # posted after it: the engine has passed it by
        assert allowed(engine) is None  # never applied
        assert rule.ev.applied == [] and rule.state()["in_flight"] is None
        # the rule acts again after its cooldown, on an engine that steps (given time to take
        # it: a loaded machine may take longer than the shrunk wait)
        rule.plane.action_timeout_s = 60
        assert [a[:2] for a in rule.at(31.0, kv=0.995)] == [("halt_admission", "applied")]
        assert allowed(engine) == "high" and rule.ev.applied == ["halt"]
    finally:
        loop.stop()


def test_a_rule_action_the_engine_is_still_inside_is_recorded_when_it_finishes() -> None:
    """The engine took the halt and is stuck in it (here a slow engine-thread subscriber):
    the evaluation stops waiting without recording an outcome it does not know, the rule stays
    in flight, and when the halt lands it is recorded `applied`, its rule in force, and undone
    on recovery like any other."""
    engine = make_engine(kv_cache_bytes="1MiB", num_threads=1)
    inside, release = threading.Event(), threading.Event()

    def slow(event: EngineEvent) -> None:  # runs on the engine thread, inside the action
        if event.kind == "admission_halted":
            inside.set()
            release.wait(120)

    engine.events.subscribe(slow)
    loop = EngineLoop(engine).start()
    rule = HaltRule(loop, timeout_s=WAIT_S)

    def execute(action: str, params: dict[str, Any]) -> ActionResult:
        """The control plane's executor, its wait started once the engine is inside the
        action (so that a slow machine cannot make it a withdrawal instead)."""
        fut = run_action(engine, action, params, clamp=True)
        if action != "halt_admission":  # the undo, on an engine that steps: time to take it
            return await_action(fut, action, 60)
        until(inside.is_set, 60, "the engine inside the halt")
        return await_action(fut, action, WAIT_S)

    rule.ev.execute = execute
    try:
        assert rule.at(0.0, kv=0.995) == []  # nothing recorded: the outcome is not known yet
        assert rule.state()["in_flight"] == "halt_admission"
        assert rule.ev.incident is not None and rule.at(1.0, kv=0.995) == []  # still in flight
        release.set()
        until(lambda: rule.ev.decisions, 60, "the halt recorded once it finished")
        [d] = rule.ev.decisions
        assert (d.action, d.outcome) == ("halt_admission", "applied")
        assert "finished after the evaluation had stopped waiting" in d.detail
        assert rule.state()["state"] == "firing" and rule.state()["in_flight"] is None
        assert rule.ev.applied == ["halt"] and allowed(engine) == "high"
        rule.at(40.0, kv=0.1)  # recovering
        assert [a[:2] for a in rule.at(60.0, kv=0.1)] == [("resume_admission", "applied")]
        assert allowed(engine) is None and rule.ev.applied == [] and rule.ev.incident is None
    finally:
        release.set()
        loop.stop()


@pytest.fixture
def service(tiny_dir: Path, tmp_path: Path) -> Iterator[Service]:
    """The daemon in process (its admin API through ASGI), with an admin token."""
    (tmp_path / "admin.token").write_text(TOKEN + "\n")
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"serving: {{model: {tiny_dir}, kv_cache_bytes: 8MiB, max_model_len: 512}}\n"
        f"api: {{admin_token_file: {tmp_path / 'admin.token'}}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    yield svc
    svc.close()


def admin_post(service: Service, path: str) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvguard") as c:
            return await c.post(path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)

    return asyncio.run(post())


def admin_post_while_stalled(service: Service, path: str) -> httpx.Response:
    """`admin_post` while the engine thread stalls in a step (released once it answers)."""
    gate = threading.Event()
    held = service.loop.call(lambda: gate.wait(120))
    until(held.running, 60, "the engine thread held")
    try:
        return admin_post(service, path)
    finally:
        gate.set()


def manual_rows(service: Service, tmp_path: Path) -> list[tuple]:
    assert service.audit.flush(30)
    sql = "SELECT rule, action, outcome, detail FROM actions WHERE rule = 'manual'"
    return rows(tmp_path / "audit.db", sql)


def test_an_operator_action_the_engine_never_took_is_withdrawn_audited_and_504(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the API gave up after 60 s with a bare 500, the OOM chain still applied once
    the engine was back (batch halved, FP8 on), and nothing was audited nor counted (the
    audit callback raised on the cancelled Future)."""
    monkeypatch.setattr(admin_api, "ACTION_TIMEOUT_S", WAIT_S)
    before = service.engine.knobs()
    r = admin_post_while_stalled(service, "/admin/actions/handle_oom")
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "action_withdrawn" and "nothing changed" in err["message"], err
    service.loop.call(lambda: None).result(60)  # posted after the chain: it has been passed by
    assert service.engine.knobs() == before  # no step of the chain ran
    [(rule, action, outcome, detail)] = manual_rows(service, tmp_path)
    assert (action, outcome) == ("handle_oom", "failed") and "withdrawn before it ran" in detail
    assert service.control is not None
    assert service.control.evaluator.stats.actions[("manual", "handle_oom", "failed")] == 1


def test_an_operator_action_the_engine_is_still_inside_is_audited_when_it_lands(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine took the chain's first step and is stuck in it: the chain cannot be
    withdrawn (its steps run, all of them), the API says it may still apply, and its outcome
    is audited and counted when it does."""
    monkeypatch.setattr(admin_api, "ACTION_TIMEOUT_S", WAIT_S)
    inside, release = threading.Event(), threading.Event()

    def slow(event: EngineEvent) -> None:  # the chain's first step, on the engine thread
        if event.kind == "knob_changed" and event.data["action"] == "reduce_max_num_seqs":
            inside.set()
            release.wait(120)

    service.engine.events.subscribe(slow)
    posted = service.manual_action

    def taken(name: str, params: dict[str, Any]) -> Future:
        """The API's wait starts once the engine is inside the chain (however slow the
        machine, it is not withdrawn before the engine takes it)."""
        fut = posted(name, params)
        until(inside.is_set, 60, "the engine inside the chain's first step")
        return fut

    monkeypatch.setattr(service, "manual_action", taken)
    try:
        r = admin_post(service, "/admin/actions/handle_oom")
    finally:
        release.set()
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "action_still_applying" and "may still apply" in err["message"], err
    until(lambda: manual_rows(service, tmp_path), 60, "the chain audited once it landed")
    [(rule, action, outcome, detail)] = manual_rows(service, tmp_path)
    assert (action, outcome) == ("handle_oom", "applied"), detail
    knobs = service.engine.knobs()
    assert knobs["max_num_seqs"] == 1 and knobs["kv_cache_dtype"] == "fp8_e4m3"
    assert service.control is not None
    assert service.control.evaluator.stats.actions[("manual", "handle_oom", "applied")] == 1


def test_latency_histograms_count_from_the_requests_arrival(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TTFT and request duration ("request arrival to ...") started their clock after the
    request's grammar (here: logprobs' tokenizer view) was prepared, which for a big schema
    takes seconds: the slow requests were the ones the histograms under-reported. They count
    from the HTTP middleware's arrival time now."""
    slow = 0.5
    view = Grammars.view  # what a logprobs request has built before it is posted

    def slower(grammars: Grammars) -> Any:
        time.sleep(slow)
        return view(grammars)

    monkeypatch.setattr(Grammars, "view", slower)
    body = {"model": service.model_name, "prompt": "hi", "max_tokens": 1, "logprobs": 1}

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvguard") as c:
            return await c.post("/v1/completions", json=body, timeout=120)

    r = asyncio.run(post())
    assert r.status_code == 200, r.text
    reg = service.metrics.registry
    for name in ("kvguard_time_to_first_token_seconds", "kvguard_request_duration_seconds"):
        assert reg.get_sample_value(f"{name}_count", {"priority": "normal"}) == 1
        assert reg.get_sample_value(f"{name}_sum", {"priority": "normal"}) >= slow, name


def test_an_undo_withdrawn_after_some_steps_applied_names_them() -> None:
    """An undo restores settings one action at a time. A later step withdrawn (the engine
    stalled) after earlier ones applied was recorded `ActionWithdrawn: ... nothing changed`,
    untrue: the earlier steps had changed the engine. The failure now names what applied and
    what did not run; withdrawn at its first step, nothing changed, and it says so."""
    calls: list[str] = []

    def execute(action: str, _params: dict[str, Any]) -> ActionResult:
        calls.append(action)
        if action == "restore_batch":
            return ActionResult(action, {}, {}, "max_num_seqs=8", True)
        raise ActionWithdrawn(action, WAIT_S)

    ev = Evaluator(
        load_rules_text(HALT_RULE, "rules.yaml"),
        lambda _name, _signal: 0.5,
        execute,
        clock=lambda: 0.0,
        wall_clock=lambda: 0.0,
    )
    steps = [("restore_batch", {}, ""), ("resume_admission", {}, ""), ("restore_kv_pool", {}, "")]
    with pytest.raises(RuntimeError) as err:
        ev._restore("recover", steps, "")
    assert not isinstance(err.value, ActionWithdrawn) and calls == steps_run(steps, 2)
    said = str(err.value)
    assert said.startswith("restore_batch: max_num_seqs=8; not run: resume_admission, "), said
    assert "restore_kv_pool" in said and "the undo is retried" in said
    calls.clear()
    with pytest.raises(ActionWithdrawn, match="nothing changed"):
        ev._restore("recover", steps[1:], "")
    assert calls == ["resume_admission"]


def steps_run(steps: list[tuple[str, dict[str, Any], str]], n: int) -> list[str]:
    return [name for name, _, _ in steps[:n]]


def test_a_default_written_out_is_no_edit_in_a_reloads_answer() -> None:
    """`rules_changed` lists `~rule` only for a rule that changed: one whose params only wrote
    a default out (or left it out) keeps its state, so the reload's answer must not say edited."""
    from kvguard.daemon.control_plane import rules_diff
    from kvguard.rules.schema import load_rules_text

    head = "version: 1\nrules:\n"
    halt = "  - {name: hot, on: 'alert:Hot', action: halt_admission, undo: resume_admission%s}\n"
    bare = load_rules_text(head + halt % "", "a.yaml")
    spelt = load_rules_text(head + halt % ", params: {allow_priority: high}", "b.yaml")
    other = load_rules_text(head + halt % ", params: {allow_priority: null}", "c.yaml")
    assert rules_diff(bare, spelt) == [] and rules_diff(spelt, bare) == []
    assert rules_diff(bare, other) == ["~hot"]
