"""Edges of the audit log's data and of `kvguard audit`: incidents a killed daemon left open,
the retention sweep at start, manual actions in an incident's count, decision times, the
daemon's own events in an incident's timeline, the alert or storm that opens an incident first
in it, `list` on a fleet's database, time windows, non-finite values in JSON, names
and text PostgreSQL refuses, `audit import` (and the start's) into a database that is not the
daemon's, a database a newer kvguard migrated, cut lists, and database text on a terminal.

Real parts throughout: SQLite files, a throwaway PostgreSQL server (tests/test_audit_postgres),
`kvguard serve` processes on loopback (tests/test_server), and the CLI's own entry point.
"""

from __future__ import annotations

import json
import math
import os
import pty
import re
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import closing, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvguard.daemon import audit_migrate
from kvguard.daemon.audit import AuditStore, utcnow
from kvguard.daemon.config import load_config
from kvguard.daemon.control_plane import (
    STORM_PREEMPTIONS,
    STORM_WINDOW_S,
    AlertPayloadError,
    ControlPlane,
    parse_alerts,
)
from kvguard.engine.control import ActionResult
from kvguard.engine.events import EngineEvent
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import RulesFileError, load_rules_text
from tests.test_audit import _act, kvguard
from tests.test_audit_postgres import PgServer, pg, pg_db, pg_url  # noqa: F401 - fixtures
from tests.test_server import KVGUARD, Daemon, until

NOW = datetime.now(UTC).replace(microsecond=0)

# A rule that fires at the first tick and never recovers: its incident stays open until the
# daemon stops (or is killed).
ALWAYS = """version: 1
interval: 1s
signals: {kv: {local: kv_cache_usage_ratio}}
rules:
  - {name: always, signal: kv, below: 1.0, recover_above: 1.0, action: reduce_batch,
     params: {factor: 0.5, min: 1}, undo: restore_batch}
"""


def _rows(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    try:
        with closing(sqlite3.connect(db)) as c:
            return c.execute(sql, args).fetchall()
    except sqlite3.Error:  # not created or not migrated yet
        return []


def _strict_json(text: str) -> Any:
    """JSON as a strict parser (jq, JavaScript) reads it: no NaN or Infinity."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


# -- a daemon killed mid-incident; the start's retention sweep (#3, #12) ------------------------
def test_a_daemon_killed_mid_incident_has_it_closed_and_old_rows_purged_at_next_start(
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    url = f"sqlite:///{db}"
    rules = tmp_path / "rules.yaml"
    rules.write_text(ALWAYS)
    old = AuditStore(url, host="elsewhere")  # a row from before the retention (90 days)
    old.start()
    old.record_event("daemon_start", detail="long ago", time=utcnow() - timedelta(days=100))
    assert old.stop(timeout=10)

    extra = f"rules: {{path: {rules}}}\n"
    first = Daemon(tmp_path, extra=extra)
    try:
        until(
            lambda: _rows(db, "SELECT incident FROM actions WHERE rule = 'always'"),
            60,
            "the rule's action and its incident to land",
        )
        until(lambda: _rows(db, "SELECT id FROM incidents"), 30, "the incident row")
    finally:
        first.proc.kill()  # SIGKILL: no orderly stop closes the incident
        first.proc.wait(30)
        first.log.close()
    [(inc,)] = _rows(db, "SELECT id FROM incidents WHERE closed_at IS NULL")
    [(acted,)] = _rows(db, "SELECT max(time) FROM actions WHERE incident = ?", inc)

    second = Daemon(tmp_path, extra=extra)
    try:
        until(
            lambda: _rows(db, "SELECT closed_at FROM incidents WHERE id = ?", inc)[0][0],
            60,
            "the next start to close the incident the killed daemon left open",
        )
        # the start's sweep also purged the 100-day-old row, without waiting 6 hours
        until(
            lambda: not _rows(db, "SELECT id FROM events WHERE detail = 'long ago'"),
            60,
            "the retention sweep at start",
        )
    finally:
        assert second.stop() == 0  # orderly: closes its own incident
    rc, out = kvguard("audit", "incidents", "--open", "--db", url, "--json")
    assert rc == 0 and json.loads(out) == []
    rc, out = kvguard("audit", "timeline", inc, "--db", url, "--json")
    shown = json.loads(out)
    assert (
        shown["incident"]["closed_at"]
        == datetime.fromisoformat(acted).replace(tzinfo=UTC).isoformat()
    )  # at its last row: when the killed run last acted in it
    closing_events = [r for r in shown["timeline"] if r.get("kind") == "incident_closed"]
    assert len(closing_events) == 1 and "killed" in closing_events[0]["detail"]


def test_the_start_sweep_closes_only_this_instances_incidents_of_earlier_runs(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    killed = AuditStore(url, host="h", instance="gpu-0")
    killed.start()
    mine = killed.open_incident(1, "left open", time=NOW - timedelta(hours=2))
    _act(killed, incident=mine, time=NOW - timedelta(hours=2))
    killed.record_event("engine_oom", incident=mine, time=NOW - timedelta(minutes=90))
    bare = killed.open_incident(1, "no rows", time=NOW - timedelta(hours=1))
    assert killed.stop(timeout=10)  # as if killed: nothing closed them
    other = AuditStore(url, host="h", instance="gpu-1")
    other.start()
    theirs = other.open_incident(1, "another daemon's, running", time=NOW - timedelta(hours=2))
    assert other.stop(timeout=10)

    restarted = AuditStore(url, host="h", instance="gpu-0")
    restarted.start()
    restarted.purge_older_than(90, close_stale=True)  # what the control plane queues at start
    now_open = restarted.open_incident(1, "this run's")
    assert restarted.flush(10)
    got = {r["id"]: r["closed_at"] for r in restarted.list_incidents(limit=None)}
    assert got == {
        mine: NOW - timedelta(minutes=90),  # its last row, the event
        bare: NOW - timedelta(hours=1),  # no rows: its opening
        theirs: None,
        now_open: None,
    }
    restarted.purge_older_than(90)  # the sweeps every 6 h close nothing
    assert restarted.flush(10)
    assert restarted.get_incident(now_open)["closed_at"] is None
    events = restarted.list_events(kind="incident_closed", limit=None)
    assert sorted(e["incident"] for e in events) == sorted([mine, bare])
    assert all(e["instance"] == "gpu-0" for e in events)
    assert restarted.stop(timeout=10)


def _daemon_in_an_incident(tmp_path: Path) -> tuple[Daemon, Path, str]:
    """A daemon whose rules file (ALWAYS) opens an incident at once: (the daemon, its rules
    file, the incident's id), its audit database at tmp_path / "audit.db". The caller stops it."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(ALWAYS)
    d = Daemon(tmp_path, extra=f"rules: {{path: {rules}}}\n")
    try:
        until(lambda: d.admin("GET", "/admin/state").json()["incident"], 60, "an incident")
        return d, rules, d.admin("GET", "/admin/state").json()["incident"]
    except BaseException:
        d.stop()
        raise


# -- manual actions count in their incident (#13), at the time they were asked for --------------
def test_a_manual_action_during_an_incident_counts_in_it(tmp_path: Path) -> None:
    """An operator's action is in the incident open, counted, and recorded when it was asked
    for (as a rule's at its decision): before the event it caused, not when it completed."""
    db = tmp_path / "audit.db"
    d, _, inc = _daemon_in_an_incident(tmp_path)
    try:
        r = d.admin("POST", "/admin/actions/halt_admission", json={"allow_priority": "high"})
        assert r.status_code == 200, r.text
        until(
            lambda: _rows(db, "SELECT id FROM actions WHERE rule = 'manual' AND incident = ?", inc),
            30,
            "the manual action's row, in the incident",
        )
    finally:
        assert d.stop() == 0
    rc, out = kvguard("audit", "timeline", inc, "--db", f"sqlite:///{db}", "--json")
    shown = json.loads(out)
    actions = [r for r in shown["timeline"] if r["type"] == "action"]
    assert [a["trigger"] for a in actions] == ["signal", "manual"]
    assert shown["incident"]["actions_count"] == len(actions) == 2
    order = [r.get("kind") or r["trigger"] for r in shown["timeline"]]
    assert order.index("manual") < order.index("admission_halted"), order  # cause, then effect


# -- the daemon's own events are in the incident they happen in ---------------------------------
def test_an_engine_failure_and_reloads_during_an_incident_are_in_its_timeline(
    tmp_path: Path,
) -> None:
    """A reload, a refused rules file, a refused config, the engine failure that ends the
    daemon and its stop all happen while an incident is open: `kvguard audit timeline` shows
    them, how it ended."""
    db = tmp_path / "audit.db"
    d, rules, inc = _daemon_in_an_incident(tmp_path)
    try:
        assert d.admin("POST", "/admin/reload").json()["reloaded"] is True
        rules.write_text("version: 1\nrules: [{name: x}]\n")  # a rules file refused
        assert d.admin("POST", "/admin/reload").status_code == 400
        rules.write_text(ALWAYS)
        good = d.config.read_text()
        d.config.write_text(good + "no_such_section: 1\n")
        assert d.admin("POST", "/admin/reload").status_code == 400  # refused: config_error
        d.config.write_text(good)
        assert d.admin("POST", "/admin/debug/fail_rank", json={"rank": 1}).status_code == 200
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        assert httpx.post(d.url + "/v1/completions", json=body, timeout=60).status_code == 503
        assert d.proc.wait(60) == 1  # the fatal path: exit 1, systemd restarts it
    finally:
        d.stop()
    rc, out = kvguard("audit", "timeline", inc, "--db", f"sqlite:///{db}", "--json")
    shown = json.loads(out)
    events = [r["kind"] for r in shown["timeline"] if r["type"] == "event"]
    want = ["reload", "config_error", "config_error", "engine_failure", "daemon_stop"]
    assert events == want, events
    assert shown["incident"]["closed_at"] is not None


# -- an action's time is when it was decided (#8) -----------------------------------------------
def test_an_action_is_recorded_at_its_decision_before_the_events_it_causes(
    tmp_path: Path,
) -> None:
    store = AuditStore(f"sqlite:///{tmp_path / 'a.db'}", host="h")
    store.start()
    wall = [1_800_000_000.0]

    def execute(action: str, params: dict[str, Any]) -> ActionResult:
        wall[0] += 1.5  # the engine applies it at a step boundary, a while later...
        store.record_event(  # ...and reports what it did then, as the control plane does
            "admission_halted",
            incident=ev.incident,
            time=datetime.fromtimestamp(wall[0], UTC),
        )
        wall[0] += 1.5
        return ActionResult(action, {}, {}, "halted", True)

    rules = load_rules_text(
        "version: 1\nrules:\n  - {name: halt, on: engine_oom, action: halt_admission}\n", "r.yaml"
    )
    ev = Evaluator(rules, lambda n, s: None, execute, audit=store, wall_clock=lambda: wall[0])
    ev.handle_event("engine_oom")
    assert store.flush(10)
    [action] = store.list_actions()
    assert action["time"] == datetime.fromtimestamp(1_800_000_000.0, UTC)
    timeline = store.timeline(action["incident"])
    assert [r["type"] for r in timeline] == ["action", "event"]  # the cause, then its effect
    assert store.stop(timeout=10)


# -- the alert or storm that opens an incident is the first row of its timeline ---------------
@contextmanager
def _plane_on(tmp_path: Path, on: str) -> Iterator[ControlPlane]:
    """The real ControlPlane and audit store (tmp_path / "audit.db"), the engine left out (as
    test_reload's `plane`), with one rule halting admission `on` the event, resumed when it
    resolves (an hour after, for an engine event), the engine's switch answered here. Its
    scheduler is paused: the test runs each evaluation job itself, in the order queued."""
    audit = AuditStore(f"sqlite:///{tmp_path / 'audit.db'}")
    audit.start()
    rules = tmp_path / "rules.yaml"
    recover = "" if on.startswith("alert:") else ", recover_for: 1h"
    rules.write_text(
        "version: 1\ninterval: 5s\nrules:\n"
        f"  - {{name: h, on: '{on}', action: halt_admission, undo: resume_admission{recover}}}\n"
    )
    config = tmp_path / "config.yaml"
    config.write_text(f"rules: {{path: {rules}}}\n")
    svc = SimpleNamespace(
        cfg=load_config(config), engine=None, audit=audit, rules_at_start=None, api_port=None
    )
    plane = ControlPlane(svc)  # type: ignore[arg-type]
    plane.evaluator.execute = lambda action, params: ActionResult(action, {}, {}, "done", True)
    plane.scheduler.start(paused=True)
    try:
        yield plane
    finally:
        plane.stop()
        audit.stop(timeout=5)


def _queued_job(plane: ControlPlane, seen: set[str]) -> Any:
    """The one evaluation job queued since the jobs `seen` (an engine event's is queued from a
    thread of its own), its id added to `seen`."""
    [job] = until(
        lambda: [j for j in plane.scheduler.get_jobs() if j.id not in seen], 10, "the job"
    )
    seen.add(job.id)
    return job


def _timeline(plane: ControlPlane, incident: str) -> list[dict[str, Any]]:
    """The incident's timeline as `kvguard audit timeline --json` prints it, after the stop."""
    plane.stop()
    audit = plane.service.audit
    assert audit.flush(10)
    rc, out = kvguard("audit", "timeline", incident, "--db", audit.url, "--json")
    assert rc == 0, out
    return json.loads(out)["timeline"]


def _alert(name: str, status: str = "firing") -> dict[str, Any]:
    """A webhook payload of one alert `name`, on GPU 0."""
    labels = {"alertname": name, "gpu": "0"}
    alert = {"status": status, "labels": labels, "startsAt": "2026-12-07T01:57:30Z"}
    return {"version": "4", "alerts": [alert | {"fingerprint": f"fp-{name}"}]}


def test_an_incident_an_alert_opens_begins_with_the_alert(tmp_path: Path) -> None:
    """Before, the alert's row was written before its evaluation opened the incident, in none:
    the timeline showed the alert resolving but never firing, and lost its labels."""
    with _plane_on(tmp_path, "alert:GPUNearOOM") as plane:
        seen: set[str] = set()
        plane.alertmanager(_alert("GPUNearOOM"))
        _queued_job(plane, seen).func()
        incident = plane.evaluator.incident
        assert incident is not None
        plane.alertmanager(_alert("GPUNearOOM", "resolved"))
        _queued_job(plane, seen).func()
        timeline = _timeline(plane, incident)
    steps = [(r["type"], r.get("kind") or r["action"], r.get("detail")) for r in timeline]
    assert steps == [
        ("event", "alert_received", "GPUNearOOM"),
        ("action", "halt_admission", "done"),
        ("event", "alert_resolved", "GPUNearOOM"),
        ("action", "resume_admission", "done"),
    ], steps
    first = timeline[0]  # with what the alert said: which GPU, which alerts
    assert first["data"]["labels"] == {"alertname": "GPUNearOOM", "gpu": "0"}
    assert first["data"]["fingerprints"] == ["fp-GPUNearOOM"]


def test_an_alert_queued_behind_another_evaluation_is_still_its_incidents_cause(
    tmp_path: Path,
) -> None:
    """An alert no rule acts on is recorded at once, in no incident; its evaluation, run first
    (as on busy worker threads), must not take the row of the alert queued behind it, which
    opens an incident, and record it in none."""
    with _plane_on(tmp_path, "alert:GPUNearOOM") as plane:
        seen: set[str] = set()
        plane.alertmanager(_alert("Unwatched"))
        ahead = _queued_job(plane, seen)
        plane.alertmanager(_alert("GPUNearOOM"))
        behind = _queued_job(plane, seen)
        ahead.func()
        assert plane.evaluator.incident is None  # no rule acts on Unwatched
        behind.func()
        incident = plane.evaluator.incident
        assert incident is not None
        timeline = _timeline(plane, incident)
        received = plane.service.audit.list_events(kind="alert_received")
    assert [(r["type"], r.get("detail")) for r in timeline][0] == ("event", "GPUNearOOM")
    assert {e["detail"]: e["incident"] for e in received} == {
        "Unwatched": None,
        "GPUNearOOM": incident,
    }


def test_an_incident_a_preemption_storm_opens_begins_with_the_storm(tmp_path: Path) -> None:
    with _plane_on(tmp_path, "preemption_storm") as plane:
        mono0 = 1_000.0
        assert STORM_PREEMPTIONS * 0.01 < STORM_WINDOW_S  # all in one window: a storm
        for i in range(STORM_PREEMPTIONS):
            plane._on_engine_event(EngineEvent("preempted", {}, monotonic=mono0 + i * 0.01))
        _queued_job(plane, set()).func()
        incident = plane.evaluator.incident
        assert incident is not None
        timeline = _timeline(plane, incident)
    assert [(r["type"], r.get("kind") or r["action"]) for r in timeline] == [
        ("event", "preemption_storm"),
        ("action", "halt_admission"),
    ], timeline
    assert timeline[0]["detail"] == f"{STORM_PREEMPTIONS} preemptions in {STORM_WINDOW_S:g}s"


# -- time windows (#9, #10) ----------------------------------------------------------------------
def test_until_a_printed_time_takes_in_that_whole_second(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    s = AuditStore(url, host="h")
    s.start()
    _act(s, rule="at", time=NOW + timedelta(microseconds=730000))
    _act(s, rule="next", time=NOW + timedelta(seconds=1))
    assert s.stop(timeout=10)
    rc, out = kvguard("audit", "list", "--db", url)
    printed = out.splitlines()[1].split()[1]  # the TIME column, whole seconds
    assert printed == NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
    rc, out = kvguard("audit", "list", "--db", url, "--until", printed, "--json")
    assert rc == 0 and [r["rule"] for r in json.loads(out)] == ["at"]
    rc, out = kvguard(
        "audit", "list", "--db", url, "--since", printed, "--until", printed, "--json"
    )
    assert rc == 0 and [r["rule"] for r in json.loads(out)] == ["at"]
    exact = (NOW + timedelta(microseconds=500000)).isoformat()  # a fraction: that instant
    rc, out = kvguard("audit", "list", "--db", url, "--until", exact, "--json")
    assert rc == 0 and json.loads(out) == []
    from kvguard.daemon.audit_cli import parse_until

    assert parse_until("2h", now=NOW) == NOW - timedelta(hours=2)  # a duration: exactly then
    day = datetime(2026, 1, 5, tzinfo=UTC)
    assert parse_until("2026-01-05") == day + timedelta(days=1, microseconds=-1)  # the whole day
    assert parse_until("9999-12-31T23:59:59") == datetime.max.replace(tzinfo=UTC)  # no overflow
    assert parse_until("9999-12-31") == datetime.max.replace(tzinfo=UTC)
    # every date alone fromisoformat takes is the whole day: a week date was its midnight
    monday = datetime(2026, 12, 7, tzinfo=UTC)
    for text in ("2026-12-07", "20261207", "2026-W50-1", "2026W501"):
        assert parse_until(text) == monday + timedelta(days=1, microseconds=-1), text
    for text in ("2026-W50", "2026W50"):  # a week alone: the whole week
        assert parse_until(text) == monday + timedelta(weeks=1, microseconds=-1), text
    assert parse_until("9999-W52") == datetime.max.replace(tzinfo=UTC)
    assert parse_until("2026-W50-1T10:00:00") == monday.replace(hour=10, microsecond=999999)
    ten = tmp_path / "week.db"  # through the CLI: a row at 10:00 on that Monday
    w = AuditStore(f"sqlite:///{ten}", host="h")
    w.start()
    _act(w, rule="monday", time=monday.replace(hour=10))
    assert w.stop(timeout=10)
    for text in ("2026-12-07", "2026-W50-1", "2026W501", "2026-W50"):
        rc, out = kvguard("audit", "list", "--db", f"sqlite:///{ten}", "--until", text, "--json")
        assert rc == 0 and [r["rule"] for r in json.loads(out)] == ["monday"], text


def test_until_takes_in_the_whole_minute_or_hour_it_names(tmp_path: Path) -> None:
    """`--until` reads the precision a time is written to, as it does a day's or a week's: a
    minute (22:38) is the whole minute and an hour (T22) the whole hour, so `--since 22:38
    --until 22:38` lists what happened in that minute rather than nothing; and a fraction is
    that instant in the basic form too (20261207T223836.5), as in the extended one."""
    from kvguard.daemon.audit_cli import parse_until

    t = datetime(2026, 12, 7, 22, 38, 36, 604931, tzinfo=UTC)  # a row 36.6 s into the minute
    url = f"sqlite:///{tmp_path / 'a.db'}"
    s = AuditStore(url, host="h")
    s.start()
    _act(s, rule="in", time=t)
    _act(s, rule="next-hour", time=t.replace(hour=23, minute=0, second=0, microsecond=0))
    assert s.stop(timeout=10)

    def rules(*window: str) -> list[str]:
        rc, out = kvguard("audit", "list", "--db", url, *window, "--json")
        assert rc == 0, out
        return [r["rule"] for r in json.loads(out)]

    minute, hour = t.replace(second=0, microsecond=0), t.replace(minute=0, second=0, microsecond=0)
    for text in ("2026-12-07T22:38", "2026-12-07 22:38", "20261207T2238", "2026-12-07T22:38Z"):
        assert parse_until(text) == minute + timedelta(minutes=1, microseconds=-1), text
        assert rules("--since", text, "--until", text) == ["in"], text
    assert parse_until("2026-12-07T23:38+01:00") == minute + timedelta(minutes=1, microseconds=-1)
    for text in ("2026-12-07T22", "20261207T22", "2026-12-07T17-05"):
        assert parse_until(text) == hour + timedelta(hours=1, microseconds=-1), text
        assert rules("--since", text, "--until", text) == ["in"], text
    assert rules("--until", "2026-12-07T22:37") == []  # the minute before holds nothing
    # a fraction is that instant, in either form: the row at 36.6 s is after 36.5
    for text in ("2026-12-07T22:38:36.5", "20261207T223836.5", "20261207T223836,5"):
        assert parse_until(text) == t.replace(microsecond=500000), text
        assert rules("--until", text) == [], text
    assert rules("--until", "20261207T223836") == ["in"]  # whole seconds: that second


# -- a fleet's database: `list` names each row's daemon --------------------------------------------
def test_list_names_each_rows_instance_on_a_shared_database(tmp_path: Path) -> None:
    """Two daemons writing one database (as on PostgreSQL): their rows in `kvguard audit list`
    read alike (the same rule, action, signal, no incident) but for the INSTANCE column, last,
    which `incidents` has too; the columns before it are where they were, and --json holds the
    same rows as before (each with its `instance`)."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    for k, instance in enumerate(("gpu-node-1", "gpu-node-2")):
        s = AuditStore(url, host="h", instance=instance)
        s.start()
        _act(s, rule="halt", action="halt_admission", time=NOW + timedelta(seconds=k))
        assert s.stop(timeout=10)
    rc, out = kvguard("audit", "list", "--db", url)  # a pipe: plain columns
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == [
        "ID",
        "TIME",
        "RULE",
        "ACTION",
        "SIGNAL",
        "OUTCOME",
        "INCIDENT",
        "INSTANCE",
    ]
    assert [ln.split()[-1] for ln in lines[1:]] == ["gpu-node-1", "gpu-node-2"]
    assert len({tuple(ln.split()[2:-1]) for ln in lines[1:]}) == 1  # alike but for INSTANCE
    rc, out = kvguard("audit", "list", "--db", url, "--instance", "gpu-node-2")
    assert [ln.split()[-1] for ln in out.splitlines()] == ["INSTANCE", "gpu-node-2"]
    rc, out = kvguard("audit", "list", "--db", url, "--json")
    assert [(r["id"], r["instance"]) for r in json.loads(out)] == [
        (1, "gpu-node-1"),
        (2, "gpu-node-2"),
    ]


def test_incidents_in_a_window_are_those_open_at_some_time_in_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    s = AuditStore(url, host="h")
    s.start()
    still_open = s.open_incident(1, "opened 3h ago, still open", time=NOW - timedelta(hours=3))
    ended_inside = s.open_incident(1, "closed 30m ago", time=NOW - timedelta(hours=2.5))
    s.update_incident(ended_inside, closed_at=NOW - timedelta(minutes=30))
    ended_before = s.open_incident(1, "closed 2h ago", time=NOW - timedelta(hours=2.2))
    s.update_incident(ended_before, closed_at=NOW - timedelta(hours=2))
    opened_inside = s.open_incident(1, "opened 10m ago", time=NOW - timedelta(minutes=10))
    assert s.stop(timeout=10)
    rc, out = kvguard("audit", "incidents", "--db", url, "--since", "1h", "--json")
    assert rc == 0
    assert [r["id"] for r in json.loads(out)] == [still_open, ended_inside, opened_inside]
    rc, out = kvguard("audit", "incidents", "--db", url, "--since", "1h", "--open", "--json")
    assert [r["id"] for r in json.loads(out)] == [still_open, opened_inside]
    until_t = (NOW - timedelta(minutes=20)).isoformat()
    rc, out = kvguard(
        "audit", "incidents", "--db", url, "--since", "1h", "--until", until_t, "--json"
    )
    assert [r["id"] for r in json.loads(out)] == [still_open, ended_inside]


# -- JSON with a non-finite value (#11) -----------------------------------------------------------
def test_json_output_writes_non_finite_numbers_as_null(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    s = AuditStore(url, host="h")
    s.start()
    _act(s, signal="queue", value=math.inf, threshold=-math.inf, params={"x": math.nan})
    assert s.stop(timeout=10)
    for argv in (("audit", "list"), ("audit", "show", "1"), ("audit", "export")):
        rc, out = kvguard(*argv, "--db", url, "--json")
        assert rc == 0
        got = _strict_json(out)
        row = got[0] if isinstance(got, list) else got
        assert row["value"] is None and row["threshold"] is None and row["params"] == {"x": None}


# -- names and text the database refuses (#7) -----------------------------------------------------
def test_rule_signal_and_on_names_are_at_most_128_characters() -> None:
    long, fits = "r" * 129, "r" * 128
    text = (
        "version: 1\n"
        f"signals: {{kv: {{local: kv_cache_usage_ratio}}, {long}: {{local: num_waiting}}}}\n"
        "rules:\n"
        f"  - {{name: {long}, signal: kv, above: 0.9, action: reduce_batch}}\n"
        f"  - {{name: a, on: 'alert:{'A' * 123}', action: halt_admission}}\n"
        f"  - {{name: {fits}, on: 'alert:{'A' * 122}', action: halt_admission}}\n"
    )
    with pytest.raises(RulesFileError) as e:
        load_rules_text(text, "r.yaml")
    assert e.value.errors == [
        f"r.yaml:2: signals.{long}: a signal name is 129 characters long: at most 128 (what "
        "the audit log keeps)",
        "r.yaml:4: rules.0.name: a rule name is 129 characters long: at most 128 (what the "
        "audit log keeps)",
        "r.yaml:5: rules.1.on: `on` is 129 characters long: at most 128 (what the audit log keeps)",
    ]


def test_the_alert_receiver_refuses_nul_characters() -> None:
    alert = {"status": "firing", "labels": {"alertname": "GPU\x00NearOOM"}}
    with pytest.raises(AlertPayloadError) as e:
        parse_alerts({"version": "4", "alerts": [alert]})
    assert e.value.param == "alerts[0].labels.alertname" and "NUL" in str(e.value)
    alert = {"status": "firing", "labels": {"alertname": "A"}, "fingerprint": "f\x00"}
    with pytest.raises(AlertPayloadError) as e:
        parse_alerts({"version": "4", "alerts": [alert]})
    assert e.value.param == "alerts[0].fingerprint"


def test_postgresql_keeps_long_names_and_nul_text_sqlite_would(pg_url: str) -> None:  # noqa: F811
    s = AuditStore(pg_url, host="h")
    s.start()
    _act(s, rule="r" * 128, signal="alert:" + "A" * 122, detail="engine said a\x00b")
    _act(s, rule="manual", error="boom\x00", detail="x")
    s.record_event("engine_failure", detail="rank 1: \x00", data={"why": "a\x00b"})
    assert s.stop(timeout=15)
    assert s.rejected == 0 and s.written == 3
    details = [r["detail"] for r in s.list_actions()] + [r["detail"] for r in s.list_events()]
    assert details == ["engine said a\ufffdb", "x", "rank 1: \ufffd"]
    assert [r["error"] for r in s.list_actions()] == [None, "boom\ufffd"]
    assert s.list_events()[0]["data"] == {"why": "a\x00b"}  # JSON keeps it, escaped


# -- `kvguard audit import` never creates a database, nor loads into another one (#6) -----------
def _spill_of(tmp_path: Path, name: str) -> tuple[str, Path]:
    """A database and a spill file of its rows (written by hand, as a stop would: see
    audit_spill), the database left where it is."""
    from kvguard.daemon import audit_spill

    url = f"sqlite:///{tmp_path / name}"
    row = {"time": NOW, "host": "h", "instance": "h", "kind": "daemon_start", "detail": "spilled"}
    lines = [
        audit_spill.encode_header(url, "h", 1, "database is locked"),
        audit_spill.encode("events", row | {"data": None, "incident": None, "uid": "u1"}),
    ]
    spill = tmp_path / f"{name}.spill.jsonl"
    spill.write_text("\n".join(lines) + "\n")
    return url, spill


def test_import_refuses_a_database_that_does_not_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, spill = _spill_of(tmp_path, "audit.db")
    shell = tmp_path / "shell"
    shell.mkdir()
    monkeypatch.chdir(shell)
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("KVGUARD_STATE_DIR", str(shell / "var"))
    rc, _ = kvguard("audit", "import", str(spill))
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kvguard: error: no audit database at ")
    assert f"sqlite:///{shell}/var/audit.db" in err and "--db URL" in err
    assert "kvguard db upgrade" in err and len(err.strip().splitlines()) == 1
    assert not (shell / "var").exists()  # nothing created...
    assert spill.is_file()  # ...and the file not marked as imported


def test_import_refuses_another_database_than_the_spills_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    origin, spill = _spill_of(tmp_path, "origin.db")
    other = f"sqlite:///{tmp_path / 'other.db'}"
    audit_migrate.upgrade(other)
    rc, _ = kvguard("audit", "import", str(spill), "--db", other)
    err = capsys.readouterr().err
    assert rc == 2 and f"holds rows spilled from {origin}, not {other}" in err
    assert "--force" in err and spill.is_file()
    rc, out = kvguard("audit", "import", str(spill), "--db", other, "--force", "--json")
    assert rc == 0 and json.loads(out)["added"] == {"events": 1}
    # its own database, spelt another way, is its own
    _, spill = _spill_of(tmp_path, "origin.db")
    audit_migrate.upgrade(origin)
    rc, out = kvguard("audit", "import", str(spill), "--db", f"sqlite:///{tmp_path}/./origin.db")
    assert rc == 0, capsys.readouterr().err


def test_the_start_leaves_a_spill_file_of_another_database_where_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two daemons share a state directory, each with its own `audit.db`: the file one spilled
    there names its database, and the other's start neither loads nor renames it; its own
    database's start does."""
    origin, spill = _spill_of(tmp_path, "audit.db")  # tmp_path/audit.db's, in tmp_path
    other = tmp_path / "other" / "audit.db"
    caplog.set_level("WARNING", logger="kvguard.daemon.audit")
    b = AuditStore(f"sqlite:///{other}", host="h", spill_dir=tmp_path)
    assert b.spill_paths[-1] == spill  # where it looks for its own
    b.start()
    assert b.flush(10) and b.stop(timeout=10)
    assert spill.is_file() and not list(tmp_path.glob("*.imported-*"))
    assert _rows(other, "SELECT detail FROM events") == []
    said = [r.getMessage() for r in caplog.records if str(spill) in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"audit: not importing {spill}: "), said
    assert f"spilled from {origin}, not sqlite:///{other}" in said[0]
    a = AuditStore(origin, host="h", spill_dir=tmp_path)
    a.start()
    assert a.flush(10) and a.stop(timeout=10)
    assert _rows(tmp_path / "audit.db", "SELECT detail FROM events") == [("spilled",)]
    assert not spill.exists()  # renamed once imported


# -- a database a newer kvguard migrated ----------------------------------------------------------
def test_a_database_a_newer_kvguard_migrated_is_called_newer_never_to_be_upgraded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, spill = _spill_of(tmp_path, "audit.db")
    audit_migrate.upgrade(url)
    with closing(sqlite3.connect(tmp_path / "audit.db")) as c:
        c.execute("UPDATE alembic_version SET version_num = '9999'")
        c.commit()
    head = audit_migrate.head()
    rc, out = kvguard("db", "current", "--db", url)
    newer = f"9999 (newer than this kvguard's {head}: a newer kvguard migrated it)\n"
    assert rc == 0 and out == newer
    for argv in (
        ("audit", "list", "--db", url),
        ("db", "upgrade", "--db", url),
        ("audit", "import", str(spill), "--db", url),
    ):
        rc, _ = kvguard(*argv)
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith(f"kvguard: error: {url} is at "), (argv, err)
        assert "9999, newer than this kvguard" in err and "a newer kvguard migrated it" in err
        assert "db upgrade" not in err and "Can't locate" not in err and err.count("\n") == 1
    assert spill.is_file()  # not imported, not renamed
    rc, out = kvguard("db", "current", "--db", url, "--json")
    assert json.loads(out)["revision"] == "9999"  # nothing changed it


# -- a list cut at --limit says so -----------------------------------------------------------------
def test_a_list_cut_at_its_limit_says_how_much_it_shows_and_how_to_see_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    s = AuditStore(url, host="h")
    s.start()
    for i in range(3):
        _act(s, rule=f"r{i}", time=NOW - timedelta(minutes=10 - i))
        inc = s.open_incident(1, f"i{i}", time=NOW - timedelta(minutes=10 - i))
        s.update_incident(inc, closed_at=NOW - timedelta(minutes=9 - i))
    assert s.stop(timeout=10)
    for what, argv in (("actions", ("audit", "list")), ("incidents", ("audit", "incidents"))):
        rc, out = kvguard(*argv, "--db", url, "--limit", "2", "--json")
        assert rc == 0 and len(json.loads(out)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"(the newest 2 matching {what} shown, older ones left out: "), err
        assert "--limit 0 shows them all" in err
        rc, out = kvguard(*argv, "--db", url, "--limit", "2")  # the table says so too
        assert rc == 0 and len(out.splitlines()) == 3 and "newest 2" in capsys.readouterr().err
        for limit in ("3", "0"):  # nothing left out: nothing said
            rc, out = kvguard(*argv, "--db", url, "--limit", limit, "--json")
            assert rc == 0 and len(json.loads(out)) == 3 and capsys.readouterr().err == ""
    rc, out = kvguard("audit", "list", "--db", url, "--limit", "2", "--json")
    assert [a["rule"] for a in json.loads(out)] == ["r1", "r2"]  # the newest two, oldest first


# -- database text on a terminal ------------------------------------------------------------------
def _on_a_terminal(*argv: str) -> tuple[int, str]:
    """`kvguard ARGV` with its standard output on a real pseudo-terminal (rich tables), 200
    columns wide; (exit status, what it printed there without colour codes)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [KVGUARD, *argv],
        stdout=follower,
        stderr=subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "200", "LINES": "50"},
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the command exited and closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return proc.wait(60), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_a_terminal_table_prints_database_text_as_it_is(tmp_path: Path) -> None:
    """Alert names, error and engine texts are data: `[/var/lib/x]` or `[red]x[/red]` in them
    is printed as written, not taken for rich markup (which crashed, or ate the brackets)."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    s = AuditStore(url, host="h")
    s.start()
    inc = s.open_incident(1, "kv [red]pressure[/red]", time=NOW - timedelta(minutes=5))
    s.record_event("engine_failure", "cannot read [/var/lib/kvguard]", incident=inc, time=NOW)
    _act(s, outcome="failed", error="[bold]boom[/bold]", incident=inc, time=NOW)
    assert s.stop(timeout=10)
    rc, out = _on_a_terminal("audit", "timeline", inc, "--db", url)
    assert rc == 0, out
    assert "cannot read [/var/lib/kvguard]" in out and "failed: [bold]boom[/bold]" in out, out
    assert "│" in out or "┃" in out  # a rich table, not the plain columns of a pipe


# -- option values out of range, typos, a file that is no spill (operator CLI hunt) ---------------
def test_a_since_or_until_with_an_offset_past_year_1_or_9999_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An ISO time whose offset takes it before 0001-01-01 or after 9999-12-31 in UTC was an
    OverflowError traceback (the forms without an offset and the durations were fine)."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    audit_migrate.upgrade(url)
    for command in ("list", "incidents", "export"):
        for option in ("--since", "--until"):
            for when in ("0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"):
                rc, _ = kvguard("audit", command, "--db", url, "--json", option, when)
                err = capsys.readouterr().err
                assert rc == 2, (command, option, when, err)
                assert err.startswith(f"kvguard: error: {option} {when}: out of range"), err
                assert len(err.strip().splitlines()) == 1
    rc, _ = kvguard("audit", "list", "--db", url, "--until", "9999-12-31T23:59:59+05:00")
    assert rc == 0  # in range once in UTC
    capsys.readouterr()


def test_list_refuses_an_unknown_action_naming_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--action reduce-batch` (a rule's name) printed "(no actions)" as if none had run."""
    from kvguard.rules.actions import ACTIONS

    url = f"sqlite:///{tmp_path / 'a.db'}"
    s = AuditStore(url, host="h")
    s.start()
    _act(s, rule="reduce-batch", action="reduce_batch")
    assert s.stop(timeout=10)
    for typo in ("reduce-batch", "nosuch"):
        with pytest.raises(SystemExit) as e:  # argparse's usage line and its error, as --outcome
            kvguard("audit", "list", "--db", url, "--action", typo)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument --action: {typo!r} is no action" in err
        assert all(name in err for name in ACTIONS)
    rc, out = kvguard("audit", "list", "--db", url, "--action", "reduce_batch", "--json")
    assert rc == 0 and [r["action"] for r in json.loads(out)] == ["reduce_batch"]


def test_import_of_an_empty_file_imports_nothing_and_leaves_it_where_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty file (any file: an older kvguard left empty spills) was "imported" (0 rows)
    and renamed: it is said to be empty now, and left as it is."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    audit_migrate.upgrade(url)
    for text in ("", "\n\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        rc, out = kvguard("audit", "import", str(empty), "--db", url)
        assert rc == 0 and out == f"{empty} is empty: nothing to import; the file left as it is\n"
        assert empty.read_text() == text and [p.name for p in tmp_path.glob("empty*")] == [
            "empty.yaml"
        ]


def test_import_of_a_directory_says_it_is_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory was reported as "no spill file at DIR", as if nothing were there."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    audit_migrate.upgrade(url)
    rc, _ = kvguard("audit", "import", str(tmp_path), "--db", url)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err == f"kvguard: error: {tmp_path} is a directory: name the spill file in it\n"
