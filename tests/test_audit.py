"""The audit store, its migrations and `kvguard audit|db`, against real SQLite files.

Faults are real too. Tests run as root, for whom a read-only mode bit changes nothing, so a
"database that refuses writes" is either a second sqlite3 connection holding `BEGIN EXCLUSIVE`
(every other writer fails with "database is locked" once its busy timeout runs out) or the file
and its WAL made immutable with `chattr +i`, which root cannot write through either.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, redirect_stdout
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvguard.daemon import audit, audit_migrate
from kvguard.daemon.audit import AuditStore
from kvguard.daemon.audit_cli import add_audit_parser, add_db_parser, parse_when
from kvguard.daemon.audit_models import Base

NOW = datetime.now(UTC).replace(microsecond=0)
TABLES = {"actions", "events", "incidents"}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "audit.db"  # the directory does not exist yet


@pytest.fixture
def db_url(db_path: Path) -> str:
    return f"sqlite:///{db_path}"


@pytest.fixture
def store(db_url: str) -> Iterator[AuditStore]:
    s = AuditStore(db_url, host="node-1")
    s.start()
    yield s
    s.stop(timeout=5)


def _tables(path: Path) -> set[str]:
    with closing(sqlite3.connect(path)) as c:
        return {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _count(path: Path, table: str) -> int:
    with closing(sqlite3.connect(path)) as c:
        return c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def _details(path: Path, table: str) -> list[str]:
    with closing(sqlite3.connect(path)) as c:
        return [r[0] for r in c.execute(f"SELECT detail FROM {table} ORDER BY id")]


def _act(store: AuditStore, **kw: Any) -> None:
    fields: dict[str, Any] = {
        "rule": "reduce-batch",
        "action": "reduce_batch",
        "outcome": "applied",
    }
    store.record_action(**(fields | kw))


# -- migrations ----------------------------------------------------------------------------
def test_upgrade_downgrade_upgrade(db_url: str, db_path: Path) -> None:
    audit_migrate.upgrade(db_url)
    assert audit_migrate.current(db_url) == audit_migrate.head() == "0006"
    assert _tables(db_path) >= TABLES

    audit_migrate.downgrade(db_url)
    assert audit_migrate.current(db_url) is None
    assert not TABLES & _tables(db_path)

    audit_migrate.upgrade(db_url)
    assert audit_migrate.current(db_url) == "0006"


def test_migrations_run_from_an_install_path_holding_a_percent_sign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alembic's options go through ConfigParser's `%` interpolation: a venv or site-packages
    path with `%` in it must not fail every migration (the audit degraded for good)."""
    moved = tmp_path / "100%dir" / "migrations"
    shutil.copytree(
        audit_migrate.MIGRATIONS_DIR, moved, ignore=shutil.ignore_patterns("__pycache__")
    )
    monkeypatch.setattr(audit_migrate, "MIGRATIONS_DIR", moved)
    db_path = tmp_path / "100%dir" / "audit.db"
    db_url = f"sqlite:///{db_path}"
    audit_migrate.upgrade(db_url)
    assert audit_migrate.current(db_url) == audit_migrate.head() == "0006"
    assert _tables(db_path) >= TABLES
    script = ScriptDirectory.from_config(audit_migrate.alembic_config())
    assert script.dir == str(moved)  # the copy's scripts were the ones run


def test_reading_an_older_database_says_to_upgrade_it(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    audit_migrate.upgrade(db_url, "0001")
    rc, _ = kvguard("audit", "list", "--db", db_url)
    err = capsys.readouterr().err
    assert rc == 2 and "schema revision 0001" in err and "kvguard db upgrade" in err, err
    audit_migrate.upgrade(db_url)
    assert kvguard("audit", "list", "--db", db_url)[0] == 0


def test_models_match_migrations(db_url: str, db_path: Path) -> None:
    audit_migrate.upgrade(db_url)
    engine = audit_migrate.make_engine(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []
    # The comparison does see a difference when there is one.
    with closing(sqlite3.connect(db_path)) as c:
        c.execute("DROP INDEX ix_actions_rule_time")
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert [d[0] for d in compare_metadata(ctx, Base.metadata)] == ["add_index"]
    engine.dispose()


def test_sqlite_connections_use_wal_and_busy_timeout(db_url: str, db_path: Path) -> None:
    db_path.parent.mkdir()
    engine = audit_migrate.make_engine(db_url, busy_timeout_ms=1234)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 1234
    engine.dispose()


def test_bad_urls_and_missing_databases_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a database URL"):
        AuditStore("not a url")
    with pytest.raises(ValueError, match="driver is not installed") as e:
        AuditStore("mysql+mysqldb://kv:s3cret@localhost/audit")
    assert "s3cret" not in str(e.value)
    with pytest.raises(ValueError, match="no audit database at"):
        audit_migrate.current(f"sqlite:///{tmp_path / 'missing.db'}")
    assert not (tmp_path / "missing.db").exists()  # reading never creates a database


# -- writing and reading ---------------------------------------------------------------------
def test_actions_and_events_round_trip(store: AuditStore) -> None:
    params = {"factor": 0.5, "min": 1}
    _act(
        store,
        signal="kv_usage",
        value=0.95,
        threshold=0.92,
        params=params,
        state_before={"max_num_seqs": 32},
        state_after={"max_num_seqs": 16},
        time=NOW - timedelta(minutes=3),
    )
    params["factor"] = 0.1  # the row keeps the values of the call
    _act(store, rule="fp8-kv", action="enable_fp8_kv", outcome="failed", error="no fp8", time=NOW)
    _act(store, action="restore_batch", is_undo=True, trigger="manual", rule=None, time=NOW)
    store.record_event("reload", "rules reloaded", {"rules": 6}, time=NOW)
    assert store.flush(10)

    rows = store.list_actions()
    assert [r["action"] for r in rows] == ["reduce_batch", "enable_fp8_kv", "restore_batch"]
    first = store.get_action(rows[0]["id"])
    assert first is not None
    assert first["params"] == {"factor": 0.5, "min": 1}
    assert first["state_after"] == {"max_num_seqs": 16}
    assert (first["signal"], first["value"], first["threshold"]) == ("kv_usage", 0.95, 0.92)
    assert first["time"] == NOW - timedelta(minutes=3) and first["time"].tzinfo is not None
    assert first["host"] == "node-1" and first["is_undo"] is False
    assert [r["rule"] for r in store.list_actions(outcome="failed")] == ["fp8-kv"]
    assert store.list_actions(since=NOW - timedelta(minutes=1), limit=1)[0]["is_undo"] is True
    assert len(store.list_actions(until=NOW - timedelta(minutes=1))) == 1
    assert store.get_action(999) is None
    assert store.list_events(kind="reload")[0]["data"] == {"rules": 6}
    assert (store.written, store.failures, store.dropped, store.depth()) == (4, 0, 0, 0)


def test_caller_bugs_raise_at_the_call(store: AuditStore) -> None:
    with pytest.raises(ValueError, match="outcome 'done'"):
        _act(store, outcome="done")
    with pytest.raises(ValueError, match="trigger"):
        _act(store, trigger="cron")
    with pytest.raises(ValueError, match="no timezone"):
        store.record_event("reload", time=datetime(2025, 1, 1))
    assert store.depth() == 0


def test_incident_open_update_close_and_timeline(store: AuditStore) -> None:
    t0 = NOW - timedelta(minutes=10)
    inc = store.open_incident(1, "kv cache above 92%", time=t0)
    assert inc.startswith("inc-")  # known before anything is written
    store.record_event("alert_received", "KVCacheHigh", incident=inc, time=t0)
    _act(store, signal="kv_usage", value=0.93, incident=inc, time=t0 + timedelta(seconds=10))
    store.record_event("engine_oom", incident=inc, time=t0 + timedelta(seconds=20))
    _act(store, action="halt_admission", incident=inc, time=t0 + timedelta(seconds=30))
    store.update_incident(inc, peak_level=4, actions_count=2)
    _act(
        store, action="resume_admission", is_undo=True, incident=inc, time=t0 + timedelta(minutes=5)
    )
    store.record_event("daemon_start")  # not part of the incident
    store.update_incident(inc, actions_count=3, closed_at=t0 + timedelta(minutes=5))
    assert store.flush(10)

    row = store.get_incident(inc)
    assert row is not None
    assert (row["peak_level"], row["actions_count"]) == (4, 3)
    assert row["closed_at"] == t0 + timedelta(minutes=5)
    assert store.list_incidents(open_only=True) == []
    steps = [(r["type"], r.get("kind") or r["action"]) for r in store.timeline(inc)]
    assert steps == [
        ("event", "alert_received"),
        ("action", "reduce_batch"),
        ("event", "engine_oom"),
        ("action", "halt_admission"),
        ("action", "resume_admission"),
    ]


# -- faults ----------------------------------------------------------------------------------
@pytest.fixture
def locked(db_path: Path) -> Iterator[sqlite3.Connection]:
    """Another process's write transaction: every other writer gets "database is locked"."""
    audit_migrate.upgrade(f"sqlite:///{db_path}")
    conn = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN EXCLUSIVE")
    yield conn
    if conn.in_transaction:
        conn.execute("ROLLBACK")
    conn.close()


def _wait_for(cond: Any, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_locked_database_never_blocks_callers_and_loses_nothing(
    db_url: str, db_path: Path, locked: sqlite3.Connection
) -> None:
    store = AuditStore(db_url, busy_timeout_ms=50)
    store.start()  # already migrated: start needs no write
    errors: list[BaseException] = []

    def caller(n: int) -> None:
        try:
            for i in range(50):
                _act(store, detail=f"{n}-{i}")
                store.record_event("tick", detail=f"{n}-{i}")
        except BaseException as e:  # noqa: BLE001 - any escape is the failure under test
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # Every call returned while the database was still locked: no caller waited for it.
    assert not any(t.is_alive() for t in threads) and errors == []
    assert store.depth() == 400 and store.written == 0
    assert _wait_for(lambda: store.failures > 0)
    assert store.last_error is not None and "locked" in store.last_error
    assert store.flush(timeout=0.2) is False

    locked.execute("ROLLBACK")
    assert store.flush(timeout=30)
    expected = sorted(f"{n}-{i}" for n in range(4) for i in range(50))
    assert sorted(_details(db_path, "actions")) == expected  # each row exactly once
    assert sorted(_details(db_path, "events")) == expected
    assert (store.dropped, store.rejected, store.depth()) == (0, 0, 0)
    assert store.stop(timeout=5)


def _chattr(flag: str, *files: Path) -> None:
    for f in files:
        r = subprocess.run(["chattr", flag, str(f)], capture_output=True, text=True)
        assert r.returncode == 0, f"chattr {flag} {f} failed (root on ext4 needed): {r.stderr}"


def test_read_only_database_file_loses_nothing(db_url: str, db_path: Path) -> None:
    store = AuditStore(db_url, busy_timeout_ms=50)
    store.start()
    _act(store, detail="before")
    assert store.flush(10)
    # The main file and the WAL refuse writes; -shm stays writable (SQLite maps it).
    files = [db_path, db_path.with_name(db_path.name + "-wal")]
    _chattr("+i", *files)
    try:
        for i in range(20):
            _act(store, detail=f"ro-{i}")
            store.record_event("tick", detail=f"ro-{i}")
        assert _wait_for(lambda: store.failures > 0)
        assert store.written == 1 and store.depth() == 40
        assert store.last_error is not None
    finally:
        _chattr("-i", *files)
    assert store.flush(timeout=30)
    assert _details(db_path, "actions") == ["before"] + [f"ro-{i}" for i in range(20)]
    assert _details(db_path, "events") == [f"ro-{i}" for i in range(20)]
    assert (store.dropped, store.rejected) == (0, 0)
    assert store.stop(timeout=5)


def test_stop_reports_rows_it_could_not_write(
    db_url: str, locked: sqlite3.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    store = AuditStore(db_url, busy_timeout_ms=20)
    store.start(migrate=False)
    store.record_event("daemon_stop")
    with caplog.at_level(logging.ERROR, logger=audit.__name__):
        assert store.stop(timeout=0.3) is False
    assert "stopping with 1 rows not written" in caplog.text


def test_full_queue_drops_new_rows_and_says_so(
    db_url: str, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = AuditStore(db_url, max_queue=5)  # not started: the queue only fills
    with caplog.at_level(logging.ERROR, logger=audit.__name__):
        for i in range(8):
            store.record_event("tick", detail=str(i))
    assert (store.depth(), store.dropped) == (5, 3)
    assert "audit queue full" in caplog.text
    store.start()
    assert store.stop(timeout=10)
    assert _details(db_path, "events") == ["0", "1", "2", "3", "4"]


def test_a_refused_row_is_skipped_without_wedging_the_queue(
    store: AuditStore,
    db_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(audit, "new_incident_id", lambda now=None: "inc-same")
    store.record_event("before")
    store.open_incident(1, "first")
    store.open_incident(2, "duplicate id: the primary key refuses it")
    store.record_event("after")
    with caplog.at_level(logging.ERROR, logger=audit.__name__):
        assert store.flush(10)
    assert (store.rejected, store.written) == (1, 3)
    assert _count(db_path, "incidents") == 1 and _count(db_path, "events") == 2
    assert "refused a row" in caplog.text


# -- CLI ---------------------------------------------------------------------------------------
def _registered() -> bool:
    from kvguard.daemon.cli import SUBCOMMANDS

    return "audit" in SUBCOMMANDS and "db" in SUBCOMMANDS


def kvguard(*argv: str) -> tuple[int, str]:
    """Run `kvguard ARGV` in-process: through the real entry point once it knows audit/db."""
    out = io.StringIO()
    with redirect_stdout(out):
        if _registered():
            from kvguard.daemon.cli import main

            return main(list(argv)), out.getvalue()
        parser = argparse.ArgumentParser(prog="kvguard")
        sub = parser.add_subparsers(dest="command", required=True)
        add_audit_parser(sub)
        add_db_parser(sub)
        args = parser.parse_args(list(argv))
        try:
            return args.func(args), out.getvalue()
        except ValueError as e:  # what cli.main does
            print(f"kvguard: error: {e}", file=sys.stderr)
            return 2, out.getvalue()


@pytest.fixture
def filled(db_url: str) -> tuple[str, str]:
    """An audit database with one old action and an incident of two actions an hour ago."""
    s = AuditStore(db_url, host="node-1")
    s.start()
    _act(s, rule="old", signal="kv_usage", value=0.9, time=NOW - timedelta(hours=5))
    inc = s.open_incident(2, "kv pressure", time=NOW - timedelta(hours=1))
    _act(
        s,
        signal="kv_usage",
        value=0.951,
        threshold=0.92,
        incident=inc,
        time=NOW - timedelta(hours=1),
    )
    s.record_event("engine_oom", "step preempted", incident=inc, time=NOW - timedelta(minutes=59))
    _act(
        s,
        action="halt_admission",
        outcome="dry_run",
        incident=inc,
        time=NOW - timedelta(minutes=58),
    )
    s.update_incident(inc, actions_count=2, closed_at=NOW - timedelta(minutes=30))
    assert s.stop(timeout=10)
    return db_url, inc


def test_cli_list_filters_and_json(filled: tuple[str, str]) -> None:
    url, inc = filled
    rc, out = kvguard("audit", "list", "--db", url, "--json")
    assert rc == 0 and [r["rule"] for r in json.loads(out)] == [
        "old",
        "reduce-batch",
        "reduce-batch",
    ]
    rc, out = kvguard("audit", "list", "--db", url, "--since", "2h", "--json")
    assert [r["incident"] for r in json.loads(out)] == [inc, inc]
    rc, out = kvguard("audit", "list", "--db", url, "--outcome", "dry_run", "--json")
    assert [r["action"] for r in json.loads(out)] == ["halt_admission"]
    rc, out = kvguard("audit", "list", "--db", url, "--since", "2h")  # plain table in a pipe
    assert out.splitlines()[0].split() == [
        "ID",
        "TIME",
        "RULE",
        "ACTION",
        "SIGNAL",
        "OUTCOME",
        "INCIDENT",
        "INSTANCE",
    ]
    assert "kv_usage=0.951 (threshold 0.92)" in out and len(out.splitlines()) == 3


def test_cli_show_incidents_and_timeline(filled: tuple[str, str]) -> None:
    url, inc = filled
    rc, out = kvguard("audit", "show", "2", "--db", url, "--json")
    assert rc == 0 and json.loads(out)["value"] == 0.951
    rc, out = kvguard("audit", "incidents", "--db", url, "--json")
    assert [(r["id"], r["actions_count"]) for r in json.loads(out)] == [(inc, 2)]
    rc, out = kvguard("audit", "timeline", inc, "--db", url, "--json")
    body = json.loads(out)
    assert body["incident"]["summary"] == "kv pressure"
    assert [e.get("kind") or e["action"] for e in body["timeline"]] == [
        "reduce_batch",
        "engine_oom",
        "halt_admission",
    ]
    rc, out = kvguard("audit", "timeline", inc, "--db", url)
    assert "kv_usage=0.951" in out and "engine_oom" in out and "dry_run" in out


def test_cli_export_csv_and_json(filled: tuple[str, str], tmp_path: Path) -> None:
    url, _ = filled
    dest = tmp_path / "actions.csv"
    assert kvguard("audit", "export", "--csv", "--db", url, "--output", str(dest))[0] == 0
    rows = list(csv.DictReader(dest.open()))
    assert [r["rule"] for r in rows] == ["old", "reduce-batch", "reduce-batch"]
    assert rows[0]["params"] == "{}" and rows[2]["is_undo"] == "false"
    rc, out = kvguard("audit", "export", "--json", "--table", "events", "--db", url)
    assert [e["kind"] for e in json.loads(out)] == ["engine_oom"]


def test_cli_reads_the_database_of_a_config(filled: tuple[str, str], tmp_path: Path) -> None:
    url, _ = filled
    cfg = tmp_path / "kvguard.yaml"
    cfg.write_text(f"audit:\n  url: {url}\n")
    rc, out = kvguard("audit", "list", "--config", str(cfg), "--json")
    assert rc == 0 and len(json.loads(out)) == 3


def test_a_relative_sqlite_path_in_a_config_is_relative_to_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`audit.url: sqlite:///audit.db` names one file, beside the config, for the daemon (the
    unit runs it in /var/lib/kvguard) and for `kvguard audit --config` in an operator's shell;
    an in-memory database and an absolute path stay as they are."""
    from kvguard.daemon.config import load_config

    etc, state, home = (tmp_path / d for d in ("etc", "state", "home"))
    for d in (etc, state, home):
        d.mkdir()
    cfg = etc / "kvguard.yaml"
    cfg.write_text("audit: {url: 'sqlite:///audit.db?timeout=5'}\n")
    monkeypatch.chdir(state)  # the daemon's working directory
    assert load_config(cfg).audit.url == f"sqlite:///{etc}/audit.db?timeout=5"
    rc, out = kvguard("db", "upgrade", "--config", str(cfg))
    assert rc == 0 and (etc / "audit.db").is_file(), capsys.readouterr().err
    s = AuditStore(load_config(cfg).audit_url(), host="node-1")
    s.start()
    _act(s)
    assert s.stop(timeout=10)
    monkeypatch.chdir(home)  # an operator's shell
    rc, out = kvguard("audit", "list", "--config", str(cfg), "--json")
    assert rc == 0 and len(json.loads(out)) == 1, capsys.readouterr().err
    assert not (state / "audit.db").exists() and not (home / "audit.db").exists()
    for url in ("sqlite://", "sqlite:///:memory:", f"sqlite:///{tmp_path}/x/audit.db"):
        cfg.write_text(f"audit: {{url: '{url}'}}\n")
        assert load_config(cfg).audit.url == url


def test_a_control_character_in_audit_instance_is_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    """Every row and the start's close of a killed run's incidents carry `audit.instance`:
    PostgreSQL refuses a NUL in text (the start's sweep failed at every start), and a newline
    would split log lines and tables. A name with other characters still loads."""
    from kvguard.daemon.config import ConfigFileError, load_config

    cfg = tmp_path / "kvguard.yaml"
    for text, char in (("node\\0A", "\\x00"), ("node\\nA", "\\n"), ("node\\tA", "\\t")):
        cfg.write_text(f'audit:\n  instance: "{text}"\n')
        with pytest.raises(ConfigFileError) as e:
            load_config(cfg)
        assert str(e.value) == (
            f"{cfg}:2: audit.instance: 'node{char}A' contains the control character "
            f"'{char}' (expected a name of printable characters)"
        )
    cfg.write_text('audit:\n  instance: "gpu-0 \\u00e9 node"\n')
    assert load_config(cfg).audit.instance == "gpu-0 \u00e9 node"


def test_cli_db_upgrade_and_current(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'audit.db'}"
    rc, out = kvguard("db", "upgrade", "--db", url)
    assert rc == 0 and "at revision 0006" in out
    rc, out = kvguard("db", "current", "--db", url, "--json")
    assert json.loads(out)["revision"] == json.loads(out)["head"] == "0006"


def test_cli_reads_the_systemd_daemons_database_from_a_shell(
    filled: tuple[str, str],
    db_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under the shipped unit the database is $STATE_DIRECTORY/audit.db, /var/lib/kvguard; an
    operator's shell has no $STATE_DIRECTORY, yet `kvguard audit` (with or without a --config
    that leaves audit.url unset) reads that one, not ./var/audit.db; KVGUARD_STATE_DIR names
    another. `kvguard db upgrade` says where it creates a database."""
    from kvguard.daemon import config

    monkeypatch.setattr(config, "SYSTEMD_STATE_DIR", db_path.parent)  # /var/lib/kvguard
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("KVGUARD_STATE_DIR", raising=False)
    shell = tmp_path / "home"
    shell.mkdir()
    monkeypatch.chdir(shell)
    etc = tmp_path / "config.yaml"
    etc.write_text("serving: {model: tiny}\n")
    for argv in (("audit", "list", "--json"), ("audit", "list", "--config", str(etc), "--json")):
        rc, out = kvguard(*argv)
        assert rc == 0 and len(json.loads(out)) == 3, capsys.readouterr().err
    rc, out = kvguard("db", "current", "--json")
    assert rc == 0 and json.loads(out)["url"] == filled[0]
    assert not (shell / "var").exists()  # no stray database where the daemon does not look
    mine = tmp_path / "mine"
    monkeypatch.setenv("KVGUARD_STATE_DIR", str(mine))
    rc, _ = kvguard("audit", "list")
    assert rc == 2 and f"no audit database at {mine}/audit.db" in capsys.readouterr().err
    rc, out = kvguard("db", "upgrade")
    err = capsys.readouterr().err
    assert rc == 0 and (mine / "audit.db").is_file() and "at revision" in out
    assert f"created a new audit database at {mine}/audit.db (no --db or audit.url" in err
    rc, out = kvguard("db", "upgrade")  # there now: nothing to announce
    assert rc == 0 and "created" not in capsys.readouterr().err


def test_cli_errors_are_one_line(
    tmp_path: Path, filled: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = filled
    missing = f"sqlite:///{tmp_path / 'missing.db'}"
    cases = [
        (("audit", "list", "--db", missing), "no audit database at"),
        (("audit", "list", "--db", url, "--since", "yesterday"), "is not a time"),
        (("audit", "show", "99", "--db", url), "no action with id 99"),
        (("audit", "timeline", "inc-nope", "--db", url), "no incident 'inc-nope'"),
    ]
    for argv, message in cases:
        rc, _ = kvguard(*argv)
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("kvguard: error: ") and message in err
        assert len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:  # argparse's usage line and its error
        kvguard("audit", "show", "99999999999999999999", "--db", url)
    assert e.value.code == 2 and "expected an action id" in capsys.readouterr().err


def test_parse_when() -> None:
    assert parse_when("1h30m", now=NOW) == NOW - timedelta(minutes=90)
    assert parse_when("2025-01-31T12:00:00") == datetime(2025, 1, 31, 12, tzinfo=UTC)
    assert parse_when("2025-01-31T13:00:00+01:00") == datetime(2025, 1, 31, 12, tzinfo=UTC)
    assert parse_when("99999999w", now=NOW) == datetime.min.replace(tzinfo=UTC)  # all of it


@pytest.mark.skipif(not _registered(), reason="`kvguard audit` is not registered in cli.py yet")
def test_installed_kvguard_command(filled: tuple[str, str]) -> None:
    url, inc = filled
    exe = Path(sys.executable).with_name("kvguard")
    run = subprocess.run(
        [exe, "audit", "list", "--db", url, "--since", "2h", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert [r["incident"] for r in json.loads(run.stdout)] == [inc, inc]
    bad = subprocess.run(
        [exe, "audit", "list", "--db", url, "--since", "soon"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.startswith("kvguard: error: 'soon' is not a time")


def test_retention_purges_old_rows_and_closed_incidents(tmp_path, caplog) -> None:
    """What a sweep deleted is logged by table; a sweep that deleted nothing says nothing."""
    from datetime import timedelta

    from kvguard.daemon.audit import AuditStore, utcnow

    caplog.set_level(logging.INFO, logger="kvguard.daemon.audit")
    store = AuditStore(f"sqlite:///{tmp_path / 'r.db'}")
    store.start()
    old = utcnow() - timedelta(days=100)
    store.record_event("daemon_start", time=old)
    store.record_event("daemon_start")
    inc_old = store.open_incident(1, "old", time=old)
    store.update_incident(inc_old, closed_at=old + timedelta(minutes=5))
    inc_open = store.open_incident(1, "still open", time=old)
    store.record_action(action="reduce_batch", outcome="applied", time=old)
    store.record_action(action="restore_batch", outcome="applied")
    store.purge_older_than(90)
    assert store.flush(10)
    assert len(store.list_events(limit=None)) == 1
    assert [a["action"] for a in store.list_actions(limit=None)] == ["restore_batch"]
    assert [i["id"] for i in store.list_incidents(limit=None)] == [inc_open]
    said = [r.getMessage() for r in caplog.records if "retention deleted" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("audit: retention deleted the rows from before ")
    assert said[0].endswith(" (audit.retention): 1 actions, 1 events, 1 incidents"), said
    store.purge_older_than(90)
    assert store.flush(10)
    assert len([r for r in caplog.records if "retention deleted" in r.getMessage()]) == 1
    store.stop()


def test_retention_keeps_every_row_of_an_incident_it_keeps(tmp_path: Path) -> None:
    """An incident still open, or closed after the cut, keeps its early actions and events:
    its timeline stays whole. One closed before the cut goes with its rows, as do old rows of
    no incident."""
    store = AuditStore(f"sqlite:///{tmp_path / 'r.db'}", host="node-1")
    store.start()
    now = datetime.now(UTC)

    def ago(**kw: float) -> datetime:
        return now - timedelta(**kw)

    def kinds(incident: str) -> list[str]:
        return [r.get("action") or r["kind"] for r in store.timeline(incident)]

    open_inc = store.open_incident(2, "long pressure", time=ago(hours=3))
    _act(store, action="reduce_batch", incident=open_inc, time=ago(hours=3))
    store.record_event("engine_oom", "oom", incident=open_inc, time=ago(hours=2))
    _act(store, action="enable_fp8_kv", incident=open_inc, time=ago(minutes=10))
    late = store.open_incident(1, "closed after the cut", time=ago(hours=2))
    _act(store, action="halt_admission", incident=late, time=ago(hours=2))
    store.update_incident(late, closed_at=ago(minutes=30))
    gone = store.open_incident(1, "closed before the cut", time=ago(hours=4))
    _act(store, action="cap_max_new_tokens", incident=gone, time=ago(hours=4))
    store.record_event("admission_halted", incident=gone, time=ago(hours=4))
    store.update_incident(gone, closed_at=ago(hours=3))
    _act(store, action="restore_batch", time=ago(hours=2))  # no incident
    store.record_event("daemon_start", time=ago(hours=2))
    store.purge_older_than(1 / 24)  # retention 1h
    assert store.flush(10)
    assert kinds(open_inc) == ["reduce_batch", "engine_oom", "enable_fp8_kv"]
    assert kinds(late) == ["halt_admission"]
    assert kinds(gone) == [] and store.get_incident(gone) is None
    assert [i["id"] for i in store.list_incidents(limit=None)] == [open_inc, late]
    assert len(store.list_actions(limit=None)) == 3 and len(store.list_events(limit=None)) == 1
    assert store.stop(timeout=10)


# -- an unwritable database: degraded, never fatal; spill at exit, import later ---------------
def _unchattr(*files: Path) -> None:
    """Undo chattr +i whatever happened (tmp dirs must stay deletable); never fails."""
    for f in files:
        subprocess.run(["chattr", "-i", str(f)], capture_output=True)


def _kinds(path: Path) -> list[str]:
    try:
        with closing(sqlite3.connect(path)) as c:
            return [r[0] for r in c.execute("SELECT kind FROM events ORDER BY id")]
    except sqlite3.Error:  # not created or not migrated yet
        return []


def _metric(url: str, name: str) -> float | None:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_daemon_serves_with_an_unwritable_audit_db_and_writes_once_it_can(tmp_path: Path) -> None:
    import httpx

    from tests.test_server import Daemon, until

    db = tmp_path / "audit.db"
    db.touch()  # it exists but is empty: the start-up migration must write to it, and cannot
    _chattr("+i", db)
    daemon = None
    try:
        daemon = Daemon(tmp_path)  # waits for /ready 200: a degraded audit store is still ready
        ready = httpx.get(daemon.url + "/ready", timeout=10).json()
        assert ready["ready"] is True
        assert ready["reason"].startswith(f"audit degraded: cannot migrate sqlite:///{db}: ")
        assert "readonly database" in ready["reason"]
        done = daemon.client().completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert done.usage.completion_tokens == 4
        assert _metric(daemon.url, "kvguard_audit_up") == 0.0
        state = daemon.admin("GET", "/admin/state").json()["audit"]
        assert state["degraded"] is True and state["queue_depth"] >= 1  # daemon_start, waiting
        rc, out = kvguard(
            "status", "--url", daemon.url, "--token-file", str(tmp_path / "admin.token")
        )
        assert rc == 0 and f"audit        degraded: cannot migrate sqlite:///{db}" in out
        log_text = (tmp_path / "daemon.log").read_text()
        assert f"audit degraded: cannot migrate sqlite:///{db}" in log_text
        assert _kinds(db) == []

        _chattr("-i", db)
        # The writer migrates, then writes what queued meanwhile; /ready and the metric follow.
        until(lambda: "daemon_start" in _kinds(db), 60, "queued rows to land")
        until(lambda: httpx.get(daemon.url + "/ready").json()["reason"] == "ok", 60, "audit ok")
        assert _metric(daemon.url, "kvguard_audit_up") == 1.0
    finally:
        _unchattr(db)
        if daemon is not None:
            assert daemon.stop() == 0
    assert _kinds(db) == ["daemon_start", "daemon_stop"]
    assert not db.with_name("audit.db.spill.jsonl").exists()  # nothing was left to spill


def _imported(spill: Path) -> bool:
    """Whether `spill` was imported: renamed `.imported-…` (it is renamed `.importing-…`, a
    claim, while its import runs)."""
    return not spill.exists() and any(spill.parent.glob(spill.name + ".imported-*"))


def test_database_unwritable_from_the_start_is_degraded_until_it_is_writable(
    db_url: str, db_path: Path
) -> None:
    from kvguard.daemon import audit_spill

    audit_migrate.upgrade(db_url)  # at head: start() itself needs no write
    spill = db_path.with_name("audit.db.spill.jsonl")  # an earlier run's, waiting to be loaded
    earlier = {"time": NOW, "host": "h", "kind": "tick", "detail": "earlier run", "uid": "u1"}
    header = audit_spill.encode_header(db_url, "h", 1, "disk full")
    audit_spill.append([spill], [header, audit_spill.encode("events", earlier)])
    files = [p for p in (db_path, db_path.with_name(db_path.name + "-wal")) if p.exists()]
    _chattr("+i", *files)
    store = AuditStore(db_url, busy_timeout_ms=50)
    try:
        store.start()
        store.record_event("tick", detail="while read-only")
        assert _wait_for(lambda: store.failures > 0)
        problem = store.problem()
        assert problem is not None and problem.startswith(f"cannot write to {db_url}: ")
        assert spill.exists()  # its import failed too, and waits for the database
    finally:
        _unchattr(*files)
    # The writer reconnects: a connection SQLite opened read-only would refuse writes forever.
    assert store.flush(timeout=30)
    assert store.problem() is None
    assert _wait_for(lambda: _imported(spill))  # tried again once a batch landed
    assert _details(db_path, "events") == ["while read-only", "earlier run"]
    assert store.stop(timeout=5)


def test_rows_left_at_stop_are_spilled_and_imported_once(
    db_url: str, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    audit_migrate.upgrade(db_url)
    files = [p for p in (db_path, db_path.with_name(db_path.name + "-wal")) if p.exists()]
    _chattr("+i", *files)
    store = AuditStore(db_url, busy_timeout_ms=50, max_queue=6)
    try:
        store.start()
        inc = store.open_incident(2, "kv pressure", time=NOW)
        _act(store, incident=inc, detail="a0", params={"factor": 0.5}, time=NOW)
        _act(store, detail="a1")
        store.record_event("tick", detail="e0", data={"n": 1})
        store.update_incident(inc, actions_count=1, closed_at=NOW + timedelta(minutes=1))
        store.record_event("tick", detail="e1")
        store.record_event("tick", detail="over the bound")  # the 7th row: dropped, counted
        assert (store.depth(), store.dropped) == (6, 1)
        assert _wait_for(lambda: store.failures > 0)
        with caplog.at_level(logging.ERROR, logger=audit.__name__):
            assert store.stop(timeout=0.5) is False
    finally:
        _unchattr(*files)
    spill = db_path.with_name("audit.db.spill.jsonl")
    assert (store.spill_file, store.spilled, store.depth()) == (spill, 6, 0)
    assert f"saved 6 unwritten rows to {spill}" in caplog.text
    assert "1 rows were dropped during this run" in caplog.text
    assert _count(db_path, "actions") == 0

    rc, out = kvguard("audit", "import", str(spill), "--db", db_url)
    assert rc == 0 and "added 5 rows" in out and "0 already there" in out
    assert not spill.exists()
    (renamed,) = db_path.parent.glob("audit.db.spill.jsonl.imported-*")
    assert f"renamed to {renamed}" in out
    assert _details(db_path, "actions") == ["a0", "a1"]
    assert _details(db_path, "events") == ["e0", "e1"]
    fresh = AuditStore(db_url)
    first = fresh.list_actions()[0]
    assert (first["incident"], first["params"], first["time"]) == (inc, {"factor": 0.5}, NOW)
    assert fresh.list_events()[0]["data"] == {"n": 1}
    incident = fresh.get_incident(inc)
    assert incident is not None and incident["closed_at"] == NOW + timedelta(minutes=1)
    assert (incident["peak_level"], incident["actions_count"]) == (2, 1)

    # A second import of the same rows adds nothing.
    rc, out = kvguard("audit", "import", str(renamed), "--db", db_url, "--keep", "--json")
    assert rc == 0 and json.loads(out)["added"] == {} and json.loads(out)["skipped"] == 5
    assert renamed.exists()
    counts = [_count(db_path, t) for t in ("actions", "events", "incidents")]
    assert counts == [2, 2, 1]
    fresh.stop()


def test_unwritable_directory_spills_to_the_state_dir_and_the_next_start_imports(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db_dir, state = tmp_path / "db", tmp_path / "state"
    db_dir.mkdir()
    url = f"sqlite:///{db_dir / 'audit.db'}"
    _chattr("+i", db_dir)  # no file can be created in it: neither the database nor a spill
    try:
        store = AuditStore(url, busy_timeout_ms=50, spill_dir=state)
        with caplog.at_level(logging.WARNING, logger=audit.__name__):
            store.start()  # does not raise: auditing must not stop the daemon
            assert f"audit degraded: cannot migrate {url}" in caplog.text
            problem = store.problem()
            assert problem is not None and problem.startswith(f"cannot migrate {url}: ")
            store.record_event("tick", detail="queued while unwritable")
            assert store.stop(timeout=0.3) is False
    finally:
        _unchattr(db_dir)
    spill = state / "audit.db.spill.jsonl"
    assert store.spill_file == spill
    assert f"saved 1 unwritten rows to {spill}" in caplog.text

    caplog.clear()
    nxt = AuditStore(url, spill_dir=state)
    with caplog.at_level(logging.WARNING, logger=audit.__name__):
        nxt.start()
        assert f"{spill} holds 1 rows an earlier run could not write" in caplog.text
        assert _wait_for(lambda: _imported(spill))
        nxt.record_event("tick", detail="after restart")
        assert nxt.flush(10)
    assert _details(db_dir / "audit.db", "events") == ["queued while unwritable", "after restart"]
    assert "imported 1 rows from" in caplog.text
    assert len(list(state.glob("audit.db.spill.jsonl.imported-*"))) == 1
    assert nxt.stop(timeout=5)


def test_a_spill_cut_short_by_a_crash_keeps_every_whole_line(tmp_path: Path) -> None:
    from kvguard.daemon import audit_spill

    spill = tmp_path / "audit.db.spill.jsonl"
    first = [
        audit_spill.encode_header("db", "h", 1, None),
        audit_spill.encode("purge", {"before": NOW}),
    ]
    assert audit_spill.append([spill], first) == (spill, [])
    with spill.open("a") as f:
        f.write('{"op": "events", "row": {"kind": "ti')  # the process died here
    second = [
        audit_spill.encode_header("db", "h", 1, None),
        audit_spill.encode("purge", {"before": NOW}),
    ]
    assert audit_spill.append([spill], second) == (spill, [])
    read = audit_spill.read(spill)
    assert read.ops == [("purge", {"before": NOW}), ("purge", {"before": NOW})]
    assert (len(read.headers), read.unreadable) == (2, [3])
    (tmp_path / "other.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match="not a kvguard audit spill"):
        audit_spill.read(tmp_path / "other.jsonl")


# A spill file as the release before spill format 2 wrote it (format 1's header key): an action
# without `data`, which that release did not have.
V1_SPILL = (
    '{{"kvguard_audit_spill": 1, "db": "{url}", "host": "oldhost", '
    '"written_at": "2026-12-06T20:00:00+00:00", "rows": 1, "reason": "database is locked"}}\n'
    '{{"op": "actions", "row": {{"time": "2026-12-06T19:59:59+00:00", "host": "oldhost", '
    '"instance": "oldhost", "rule": "reduce-batch", "action": "reduce_batch", '
    '"trigger": "signal", "signal": "kv_usage", "value": 0.93, "threshold": 0.92, '
    '"params": {{"factor": 0.5}}, "state_before": null, "state_after": null, '
    '"outcome": "applied", "error": null, "incident": null, "is_undo": false, '
    '"detail": "format 1", "uid": "0f1e2d3c4b5a69788796a5b4c3d2e1f0"}}}}\n'
)


def test_a_spill_starts_with_a_format_older_kvguard_refuse_and_both_formats_load(
    tmp_path: Path, db_path: Path, db_url: str
) -> None:
    """The release before spill format 2 took any line with format 1's key for a header,
    whatever its number, and its start imported a newer daemon's spill dropping the actions'
    `data` (which requests an eviction preempted). A spill written now starts with format 2's
    own key, which that reader refuses as `not a kvguard audit spill line`, leaving the file for
    a newer kvguard; this one loads both formats at start, `data` kept, and refuses a format
    newer than its own the same way."""
    from kvguard.daemon import audit_spill

    db_path.parent.mkdir(parents=True)
    db_path.write_text("not a database\n")  # the migration fails: rows queue, then spill
    store = AuditStore(db_url)
    store.start()
    evicted = [["cmpl-abc-0", "swap"], ["cmpl-def-0", "recompute"]]
    _act(store, action="evict_lowest_priority", detail="format 2", data={"evicted": evicted})
    assert store.stop(timeout=0.5) is False
    new = db_path.with_name("audit.db.spill.jsonl")
    assert store.spill_file == new
    header = json.loads(new.read_text().splitlines()[0])
    assert next(iter(header.items())) == ("kvguard_audit_spill_format", 2), header
    assert "kvguard_audit_spill" not in header  # format 1's key: its readers take the file

    db_path.unlink()
    audit_migrate.upgrade(db_url)
    old = tmp_path / "spills" / "audit.db.spill.jsonl"  # the state directory's spill file
    old.parent.mkdir()
    old.write_text(V1_SPILL.format(url=db_url))
    later = AuditStore(db_url, spill_dir=old.parent)
    later.start()
    assert _wait_for(lambda: _imported(new) and _imported(old))
    rows = {a["detail"]: a for a in later.list_actions()}
    assert rows["format 2"]["data"] == {"evicted": evicted}
    assert (rows["format 1"]["instance"], rows["format 1"]["data"]) == ("oldhost", None)
    later.stop(timeout=5)

    newer = tmp_path / "newer.spill.jsonl"
    newer.write_text(
        json.dumps({**header, "kvguard_audit_spill_format": 3})
        + "\n"
        + audit_spill.encode("events", {"time": NOW, "kind": "tick", "uid": "u3"})
        + "\n"
    )
    with pytest.raises(ValueError, match="spill format 3, written by a newer kvguard"):
        audit_spill.read(newer)
    rc, _ = kvguard("audit", "import", str(newer), "--db", db_url)
    assert rc == 2 and newer.exists()


def test_a_server_databases_identity_keeps_the_query_parameters_that_name_it() -> None:
    """A spill file is matched to a server database by what names it, not by its URL's text:
    a password moved out or a connection option added is the same database; a libpq
    `service=` or a MySQL `unix_socket=` names another one (they had been left out, so two
    daemons of two databases sharing a state directory wrote one spill file, each to import
    the other's rows)."""
    from kvguard.daemon import audit_spill

    base = "postgresql+psycopg://kv:pw@db.example:5433/audit"
    assert audit_spill.same_db(
        base, "postgresql+psycopg://kv@DB.example:5433/audit?connect_timeout=3"
    )
    assert audit_spill.same_db(base, base.replace("psycopg", "psycopg2") + "?sslmode=require")
    assert not audit_spill.same_db(base, base.replace("/audit", "/other"))
    prod = "postgresql+psycopg://kv@/audit?service=prod_audit"
    assert not audit_spill.same_db(prod, prod.replace("prod", "staging"))
    assert audit_spill.same_db(prod, prod + "&application_name=kvguard")
    sock = "mysql+pymysql://kv@localhost/audit?unix_socket=/run/mysqld-a.sock"
    assert not audit_spill.same_db(sock, sock.replace("-a.", "-b."))
    spills = {
        audit_spill.spill_paths(u, Path("/state"))[0]
        for u in (prod, prod.replace("prod", "staging"))
    }
    assert len(spills) == 2
