"""The audit store when its database misbehaves under a running fleet: a PostgreSQL server that
hangs (its processes SIGSTOPped) or a lock held by someone else's open transaction at start, a
fleet upgraded one daemon at a time, a SQLite file deleted under the daemon, a stop while the
server does not answer.

Real parts only: a throwaway PostgreSQL server (`tests.test_audit_postgres.PgServer`), real
SQLite files, real locks taken by a second connection. Every wait is for a condition with a
deadline; the only timings asserted are the bounds the daemon promises (start and stop).
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from kvguard.daemon import audit, audit_migrate, audit_spill
from kvguard.daemon.audit import AuditStore
from kvguard.daemon.audit_models import Base
from tests.test_audit_postgres import PgServer, throwaway_server, wait_for

NOW = datetime.now(UTC).replace(microsecond=0)
START_BOUND_S = 15.0  # start() waits 5 s at most for its first migration attempt


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    """A server of this module's own: its tests hang it (SIGSTOP) and hold its locks."""
    with throwaway_server("kvguard-pg-robust-") as server:
        yield server


@pytest.fixture
def pg_db(pg: PgServer) -> str:
    if not pg.running:
        pg.start()
    return pg.create_database()


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


@contextmanager
def hung(pg: PgServer) -> Iterator[None]:
    """The database server hangs: every process of the cluster stopped (SIGSTOP), so the kernel
    still accepts its connections and acknowledges its packets, but nothing answers."""
    assert pg.proc is not None
    pids = [pg.proc.pid, *_children(pg.proc.pid)]
    for p in pids:
        with suppress(ProcessLookupError):  # a backend that ended since it was listed
            os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in pids:
            with suppress(ProcessLookupError):  # ended meanwhile (one already exiting)
                os.kill(p, signal.SIGCONT)


def _start_bounded(store: AuditStore) -> float | None:
    """Seconds start() took, or None if it had not returned after START_BOUND_S."""
    t = threading.Thread(target=store.start, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(START_BOUND_S)
    return None if t.is_alive() else time.monotonic() - t0


def _rows(pg: PgServer, db: str, sql: str) -> list[Any]:
    with pg.connect(db) as conn:
        return conn.execute(sql).fetchall()


# -- 1. a start that cannot migrate does not keep the daemon from READY ------------------------
def test_start_returns_while_the_server_hangs_and_rows_land_once_it_answers(
    pg: PgServer, pg_db: str, tmp_path: Path
) -> None:
    url = pg.url(pg_db)
    store = AuditStore(url, instance="node-h", spill_dir=tmp_path)
    try:
        with hung(pg):
            took = _start_bounded(store)
            assert took is not None, "start() still blocked on a hung server"
            problem = store.problem()
            assert problem is not None and problem.startswith(f"cannot migrate {url}: "), problem
            store.record_event("daemon_start", "while the server hung")
            # each attempt ends (a connect timeout), so the writer's retries go on
            wait_for(lambda: "timeout" in (store.problem() or ""), 30, "an attempt to time out")
        assert store.flush(timeout=60), store.problem()
        assert store.problem() is None
    finally:
        store.stop(timeout=10)
    assert audit_migrate.current(url) == audit_migrate.head()
    assert _rows(pg, pg_db, "SELECT kind, instance FROM events") == [("daemon_start", "node-h")]


def test_start_returns_while_a_transaction_holds_a_table_the_migration_alters(
    pg: PgServer, pg_db: str, tmp_path: Path
) -> None:
    """An analyst's psql session left idle in a transaction after reading `actions`, while a
    daemon of a newer kvguard starts on a database at 0002: its ALTER TABLE waits for that lock."""
    url = pg.url(pg_db)
    audit_migrate.upgrade(url, "0002")
    analyst = pg.connect(pg_db)
    store = AuditStore(url, instance="node-l", spill_dir=tmp_path)
    try:
        analyst.execute("SELECT count(*) FROM actions").fetchall()  # the transaction stays open
        took = _start_bounded(store)
        assert took is not None, "start() still blocked behind the analyst's transaction"
        problem = wait_for(store.problem, 30, "the store to say it is degraded")
        assert problem.startswith(f"cannot migrate {url}: "), problem
        wait_for(lambda: "table lock" in (store.problem() or ""), 30, "the lock wait to end")
        store.record_event("daemon_start", "while the migration waited")
        analyst.rollback()
        assert store.flush(timeout=60), store.problem()
        assert store.problem() is None
    finally:
        analyst.close()
        store.stop(timeout=10)
    assert audit_migrate.current(url) == audit_migrate.head()
    assert _rows(pg, pg_db, "SELECT kind FROM events") == [("daemon_start",)]


def test_start_returns_while_another_migration_holds_the_lock(
    pg: PgServer, pg_db: str, tmp_path: Path
) -> None:
    """A migrator stuck while holding the migration lock (a `kvguard db upgrade` suspended at a
    prompt): the daemon's own migration gives up waiting and retries."""
    url = pg.url(pg_db)
    key = audit_migrate.MIGRATION_LOCK_KEY
    store = AuditStore(url, instance="node-a", spill_dir=tmp_path)
    with pg.connect(pg_db, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        try:
            took = _start_bounded(store)
            assert took is not None, "start() still blocked on the migration lock"
            wait_for(
                lambda: "another migration" in (store.problem() or ""), 30, "the lock wait to end"
            )
            store.record_event("daemon_start")
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
    try:
        assert store.flush(timeout=60), store.problem()
    finally:
        store.stop(timeout=10)
    assert _rows(pg, pg_db, "SELECT kind FROM events") == [("daemon_start",)]


def test_the_kvguard_db_upgrade_command_still_waits_for_the_lock(pg: PgServer, pg_db: str) -> None:
    """Only the daemon's migration is bounded: an operator's `kvguard db upgrade` waits."""
    url = pg.url(pg_db)
    key = audit_migrate.MIGRATION_LOCK_KEY
    done = threading.Event()
    with pg.connect(pg_db, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        t = threading.Thread(target=lambda: (audit_migrate.upgrade(url), done.set()), daemon=True)
        try:
            t.start()
            waiting = (
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            wait_for(lambda: holder.execute(waiting).fetchone()[0] == 1, 30, "the wait")
            assert not done.is_set()
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
        t.join(60)
    assert done.is_set() and audit_migrate.current(url) == audit_migrate.head()


def test_a_connect_timeout_in_the_url_wins() -> None:
    mine = sa.engine.make_url("postgresql+psycopg://u@db.invalid/kv")
    args = audit_migrate._server_connect_args(mine)  # noqa: SLF001
    assert args["connect_timeout"] == audit_migrate.CONNECT_TIMEOUT_S and args["keepalives"] == 1
    own = sa.engine.make_url("postgresql+psycopg://u@db.invalid/kv?connect_timeout=30")
    assert "connect_timeout" not in audit_migrate._server_connect_args(own)  # noqa: SLF001


# -- 2. a fleet upgraded one daemon at a time --------------------------------------------------
def _old_daemon_events() -> sa.Table:
    """`events` as a kvguard from before 0003 knows it: no `instance`."""
    return sa.Table(
        "events",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("time", sa.DateTime(timezone=True)),
        sa.Column("host", sa.String(255)),
        sa.Column("kind", sa.String(64)),
        sa.Column("detail", sa.Text),
        sa.Column("data", sa.JSON),
        sa.Column("incident", sa.String(64)),
        sa.Column("uid", sa.String(32)),
    )


def _old_daemon_incidents() -> sa.Table:
    return sa.Table(
        "incidents",
        sa.MetaData(),
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("opened_at", sa.DateTime(timezone=True)),
        sa.Column("closed_at", sa.DateTime(timezone=True)),
        sa.Column("peak_level", sa.Integer),
        sa.Column("actions_count", sa.Integer),
        sa.Column("host", sa.String(255)),
        sa.Column("summary", sa.Text),
    )


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_rows_of_a_daemon_not_yet_upgraded_are_taken_with_their_host_as_instance(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if backend == "postgresql":
        pg = request.getfixturevalue("pg")
        url = pg.url(request.getfixturevalue("pg_db"))
    else:
        url = f"sqlite:///{tmp_path}/audit.db"
    # The first daemon of the new version has migrated the shared database...
    new = AuditStore(url, host="new-node", instance="new-gpu0")
    new.start()
    try:
        new.record_event("daemon_start", "new")
        assert new.flush(30)
        # ...while one of the old version still writes, without `instance`.
        engine = audit_migrate.make_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(
                    sa.insert(_old_daemon_events()),
                    [
                        {"time": NOW, "host": "old-node", "kind": "tick", "detail": f"old {i}"}
                        for i in range(3)
                    ],
                )
                conn.execute(
                    sa.insert(_old_daemon_incidents()),
                    [
                        {
                            "id": "inc-old",
                            "opened_at": NOW,
                            "peak_level": 1,
                            "actions_count": 0,
                            "host": "old-node",
                            "summary": "old",
                        }
                    ],
                )
            with engine.connect() as conn:
                ctx = MigrationContext.configure(conn, opts={"compare_type": True})
                assert compare_metadata(ctx, Base.metadata) == []
        finally:
            engine.dispose()
        events = new.list_events(limit=None)
        assert sorted((e["detail"], e["instance"]) for e in events) == [
            ("new", "new-gpu0"),
            ("old 0", "old-node"),
            ("old 1", "old-node"),
            ("old 2", "old-node"),
        ]
        assert new.get_incident("inc-old")["instance"] == "old-node"
        new.record_event("tick", "new again")  # a row with its instance keeps it
        assert new.flush(30)
        assert new.list_events(limit=1)[0]["instance"] == "new-gpu0"
    finally:
        new.stop(timeout=10)
    # Down and up again: the triggers go and come back with their revision.
    audit_migrate.downgrade(url, "0003")
    audit_migrate.upgrade(url)
    assert audit_migrate.current(url) == audit_migrate.head()


def test_a_daemon_restarted_on_a_database_a_newer_kvguard_migrated_writes_to_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An older daemon restarts mid-rollout: the database is at a revision it does not know.
    It must not be degraded for good (Alembic cannot migrate to its own, older head)."""
    url = f"sqlite:///{tmp_path}/audit.db"
    audit_migrate.upgrade(url)
    with closing(sqlite3.connect(tmp_path / "audit.db")) as c, c:
        c.execute("UPDATE alembic_version SET version_num = '9999'")  # a newer kvguard's stamp
    store = AuditStore(url, host="h")
    with caplog.at_level(logging.WARNING, logger=audit.__name__):
        store.start()
    try:
        assert store.problem() is None, store.problem()
        assert "at revision 9999, newer than this kvguard knows" in caplog.text
        store.record_event("tick", "from the older daemon")
        assert store.flush(30), store.problem()
    finally:
        store.stop(timeout=10)
    assert _details(tmp_path / "audit.db") == ["from the older daemon"]
    with pytest.raises(ValueError, match="9999"):  # `kvguard db upgrade` still says so
        audit_migrate.upgrade(url)


def test_rows_refused_for_a_newer_schema_are_kept_in_a_file_of_their_own(
    pg: PgServer,
    pg_db: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A newer kvguard's migration (another daemon's) adds a NOT NULL column this one does not
    fill: its rows are refused, and kept for an import instead of vanishing. A duplicate,
    which would be refused again, is only counted and logged. The refused rows' file is not the
    spill file: while its import still fails (the daemon not yet upgraded), the spill file's
    rows (left unwritten at a stop) are imported all the same."""
    url = pg.url(pg_db)
    monkeypatch.setattr(audit, "new_incident_id", lambda now=None: "inc-same")
    store = AuditStore(url, instance="node-r", spill_dir=tmp_path)
    store.start()
    try:
        store.open_incident(1, "first")
        assert store.flush(30)
        with pg.connect(pg_db) as conn:
            conn.execute("ALTER TABLE events ADD COLUMN severity text NOT NULL DEFAULT 'info'")
            conn.execute("ALTER TABLE events ALTER COLUMN severity DROP DEFAULT")
        with caplog.at_level(logging.ERROR, logger=audit.__name__):
            store.record_event("tick", "refused 0")
            store.record_event("tick", "refused 1")
            store.open_incident(1, "the same id again: refused for good")
            assert store.flush(30)
        assert store.rejected == 3 and store.written == 1
    finally:
        store.stop(timeout=10)
    refused = store.refused_paths[-1]
    assert refused.parent == tmp_path and refused.name.startswith(f"audit-{pg_db}-")
    assert store.spill_file == refused
    kept = audit_spill.read(refused)
    assert [(k, r["detail"]) for k, r in kept.ops] == [
        ("events", "refused 0"),
        ("events", "refused 1"),
    ]
    assert kept.headers[0]["reason"] == f"refused by {url}"
    assert "kept in the refused rows' file" in caplog.text and "refused rows to" in caplog.text
    assert "would be refused again" in caplog.text

    # Rows an earlier stop left unwritten (an incident, which the newer schema still takes)
    # land at the next start although the refused rows still cannot. That stop was an older
    # kvguard's, which named every server database's spill file `audit.spill.jsonl`.
    spill = tmp_path / "audit.spill.jsonl"
    opened = datetime(2026, 12, 5, 9, 0, tzinfo=UTC)
    row = {"id": "inc-unwritten", "opened_at": opened, "closed_at": None, "peak_level": 1}
    row |= {"actions_count": 0, "host": "h", "instance": "node-r", "summary": "unwritten"}
    header = audit_spill.encode_header(url, "h", 1, "stopped unwritten")
    assert audit_spill.append([spill], [header, audit_spill.encode("incidents", row)])[0] == spill
    old = AuditStore(url, instance="node-r", spill_dir=tmp_path)
    old.start()
    try:
        wait_for(lambda: not spill.exists(), 30, "the spill file to be imported")
    finally:
        old.stop(timeout=10)
    assert refused.exists()  # still refused: kept for the upgraded daemon
    got = _rows(pg, pg_db, "SELECT id FROM incidents ORDER BY id")
    assert got == [("inc-same",), ("inc-unwritten",)]

    # The daemon upgraded (here: the column gets the default its migration would give) imports
    # them at its next start.
    with pg.connect(pg_db) as conn:
        conn.execute("ALTER TABLE events ALTER COLUMN severity SET DEFAULT 'info'")
    nxt = AuditStore(url, instance="node-r", spill_dir=tmp_path)
    nxt.start()
    try:
        wait_for(lambda: not refused.exists(), 30, "the refused rows to be imported")
    finally:
        nxt.stop(timeout=10)
    got = _rows(pg, pg_db, "SELECT detail, instance FROM events ORDER BY id")
    assert got == [("refused 0", "node-r"), ("refused 1", "node-r")]


# -- 3. the SQLite file deleted under the daemon ------------------------------------------------
def _details(path: Path) -> list[str]:
    with closing(sqlite3.connect(path)) as c:
        return [r[0] for r in c.execute("SELECT detail FROM events ORDER BY id")]


@pytest.mark.parametrize("reconnect", [False, True])
def test_a_deleted_sqlite_file_is_created_again_and_the_rows_land_in_it(
    tmp_path: Path, reconnect: bool
) -> None:
    """An operator (or a tmpfiles cleaner) removes the database while the daemon runs. Without
    `reconnect` the writer's pooled connection still has the deleted file open; with it (as
    after any failed write) a new connection makes a new, empty file."""
    db = tmp_path / "audit.db"
    store = AuditStore(f"sqlite:///{db}", host="h")
    store.start()
    try:
        store.record_event("tick", "before")
        assert store.flush(10)
        for f in tmp_path.glob("audit.db*"):
            f.unlink()
        if reconnect:
            store._engine.dispose()  # noqa: SLF001
        store.record_event("tick", "after 1")
        store.record_event("tick", "after 2")
        assert store.flush(30), store.problem()
        assert store.problem() is None
    finally:
        assert store.stop(timeout=10)
    assert _details(db) == ["after 1", "after 2"]
    assert audit_migrate.current(f"sqlite:///{db}") == audit_migrate.head()


def test_lost_tables_are_migrated_again_on_postgresql(pg: PgServer, pg_db: str) -> None:
    """Someone drops the audit tables (`kvguard db downgrade base`) under a running daemon."""
    url = pg.url(pg_db)
    store = AuditStore(url, instance="node-d")
    store.start()
    try:
        store.record_event("tick", "before")
        assert store.flush(30)
        audit_migrate.downgrade(url, "base")
        store.record_event("tick", "after")
        assert store.flush(60), store.problem()
    finally:
        store.stop(timeout=10)
    assert _rows(pg, pg_db, "SELECT detail FROM events") == [("after",)]


# -- 4. a write to a running server that hangs --------------------------------------------------
def test_a_write_to_a_server_that_hangs_is_reported_within_seconds_and_lands_once(
    pg: PgServer, pg_db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server hangs after the daemon migrated: no timeout of the client's ends the write
    (the kernel acknowledges every packet), but the store says it is degraded (readiness,
    kvguard_audit_up) within seconds and logs it once; the row lands once the server answers."""
    url = pg.url(pg_db)
    store = AuditStore(url, instance="node-w", spill_dir=tmp_path)
    store.start()
    try:
        store.record_event("tick", "before")
        assert store.flush(30)
        with caplog.at_level(logging.WARNING, logger=audit.__name__):
            with hung(pg):
                store.record_event("tick", "while the server hangs")
                problem = wait_for(store.problem, 20, "the store to say it is degraded")
                assert problem.startswith(f"cannot write to {url}: a write has not finished")
                assert problem.endswith("; 1 rows queued"), problem
                wait_for(lambda: "audit degraded: a write to" in caplog.text, 20, "the warning")
            assert store.flush(60), store.problem()
        assert store.problem() is None
    finally:
        store.stop(timeout=10)
    said = [r.getMessage() for r in caplog.records]
    degraded = [m for m in said if m.startswith("audit degraded")]
    assert len(degraded) == 1 and "has not finished after 5s" in degraded[0], degraded
    assert any(m.startswith(f"audit: a write to {url} finished after ") for m in said), said
    got = _rows(pg, pg_db, "SELECT detail FROM events ORDER BY id")
    assert got == [("before",), ("while the server hangs",)]


# -- 5. stop keeps to its timeout with a hung server -------------------------------------------
def test_stop_with_a_hung_server_keeps_to_its_timeout_and_spills(
    pg: PgServer, pg_db: str, tmp_path: Path
) -> None:
    url = pg.url(pg_db)
    store = AuditStore(url, instance="node-s", spill_dir=tmp_path)
    store.start()
    store.record_event("tick", "written")
    assert store.flush(30)
    writer = store._thread  # noqa: SLF001
    with hung(pg):
        for i in range(5):
            store.record_event("tick", f"unwritten {i}")
        wait_for(lambda: store.depth() == 5, 10, "the rows to queue")
        t0 = time.monotonic()
        ok = store.stop(timeout=2)
        took = time.monotonic() - t0
    assert ok is False
    assert took < 3.0, f"stop(timeout=2) took {took:.1f}s"
    spill = store.spill_paths[-1]
    assert store.spill_file == spill
    assert [r["detail"] for _, r in audit_spill.read(spill).ops] == [
        f"unwritten {i}" for i in range(5)
    ]
    if writer is not None:  # the writer left behind ends once the server answers again
        writer.join(60)


def test_a_writer_that_finishes_migrating_during_stops_spill_takes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() gave up on a writer still migrating and spills the queue; the writer's migration
    then succeeds while the spill file is being written. It must not take rows from the queue
    the spill is saving (stop raised IndexError, and rows were written and spilled both)."""
    store = AuditStore(f"sqlite:///{tmp_path / 'audit.db'}", host="h", spill_dir=tmp_path)
    migrate, append = store._try_migrate, audit_spill.append  # noqa: SLF001
    migrating = threading.Event()

    def slow_migrate(attempt: int) -> bool:
        migrating.set()
        time.sleep(1.0)  # longer than stop's timeout below
        return migrate(attempt)

    def slow_append(paths: Any, lines: list[str]) -> Any:
        writer.join(10)  # the writer is done migrating and back for rows meanwhile
        return append(paths, lines)

    monkeypatch.setattr(store, "_try_migrate", slow_migrate)
    monkeypatch.setattr(audit_spill, "append", slow_append)
    store.start(wait=0.01)
    writer = store._thread  # noqa: SLF001
    assert writer is not None and migrating.wait(10)
    for i in range(300):
        store.record_event("tick", f"row {i}")
    assert store.stop(timeout=0.2) is False
    assert not writer.is_alive() and store.written == 0 and store.depth() == 0
    spilled = audit_spill.read(tmp_path / "audit.db.spill.jsonl")
    assert [r["detail"] for _, r in spilled.ops] == [f"row {i}" for i in range(300)]


def test_a_full_queue_drops_events_before_actions_and_incidents(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A database that takes no writes (its file is a directory) and a storm of events fill
    the queue; the remedy and the incident's open and close that come after are what an
    operator reads the timeline for: each takes the place of the newest queued event, and the
    stop spills them. (They were dropped, and the spill held only the storm's rows.)"""
    db = tmp_path / "audit.db"
    db.mkdir()
    store = AuditStore(f"sqlite:///{db}", host="h", max_queue=50, spill_dir=tmp_path)
    store.start(wait=5)
    assert store.problem() is not None  # degraded: the rows queue
    for i in range(100):
        store.record_event("engine_oom", f"storm {i}")
    incident = store.open_incident(2, "OOM")
    store.record_action(action="handle_oom", outcome="applied", trigger="event", incident=incident)
    store.update_incident(incident, actions_count=1, closed_at=datetime.now(UTC))
    store.record_event("engine_oom", "after the action")  # no room, and no room made for it
    assert (store.depth(), store.dropped) == (50, 54)
    with caplog.at_level(logging.ERROR, logger=audit.__name__):
        assert store.stop(timeout=0.5) is False
    ops = audit_spill.read(store.spill_file).ops
    assert [kind for kind, _ in ops if kind != "events"] == [
        "incidents",
        "actions",
        "incident_update",
    ]
    assert [row["detail"] for kind, row in ops if kind == "events"] == [
        f"storm {i}" for i in range(47)
    ]
    assert "audit queue full" in caplog.text


# -- spill files written while they are imported -----------------------------------------------
def _spill(path: Path, url: str, details: list[str]) -> None:
    """What a stopping daemon's `_save` does: one spill of events appended to `path`."""
    rows = [
        audit_spill.encode(
            "events",
            {"time": NOW, "host": "vm", "instance": "node-b", "kind": "tick", "detail": d,
             "data": None, "incident": None, "uid": uuid.uuid4().hex},
        )
        for d in details
    ]  # fmt: skip
    header = audit_spill.encode_header(audit_migrate.shown(url), "vm", len(rows), "stopped")
    assert audit_spill.append([path], [header, *rows]) == (path, [])


def _spill_during_import(monkeypatch: pytest.MonkeyPatch, path: Path, url: str) -> None:
    """A second daemon of the database, sharing the directory, stops right after the import
    read `path` (its second read of it, or of this process's claim of it: the first only
    checks the headers)."""
    real, reads = audit_spill.read, []

    def read_then_spill(p: Path) -> audit_spill.SpillRead:
        spill = real(p)
        if p == path or p.name.startswith(f"{path.name}.importing-{os.getpid()}-"):
            reads.append(p)
            if len(reads) == 2:
                _spill(path, url, ["spilled during the import"])
        return spill

    monkeypatch.setattr(audit_spill, "read", read_then_spill)


def test_rows_spilled_while_the_import_command_runs_stay_for_the_next_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The import claims the file (renames it) before reading it: rows appended meanwhile go
    to a new file at the spill file's name, never into the one renamed `.imported-…`."""
    from tests.test_audit_postgres import kvguard

    db = tmp_path / "audit.db"
    url = f"sqlite:///{db}"
    audit_migrate.upgrade(url)
    spill = tmp_path / "audit.db.spill.jsonl"
    _spill(spill, url, ["a", "b"])
    _spill_during_import(monkeypatch, spill, url)
    rc, out = kvguard("audit", "import", str(spill), "--db", url)
    assert rc == 0 and "added 2 rows" in out
    (done,) = tmp_path.glob("audit.db.spill.jsonl.imported-*")
    assert [r["detail"] for _, r in audit_spill.read(done).ops] == ["a", "b"]
    rc, out = kvguard("audit", "import", str(spill), "--db", url)
    assert rc == 0 and "added 1 rows" in out
    assert _details(db) == ["a", "b", "spilled during the import"]
    assert not list(tmp_path.glob("*.importing-*"))


def test_a_start_imports_a_claim_left_by_a_crash_and_keeps_rows_spilled_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim (`.importing-…`) whose import died is loaded at the next start, before the spill
    file; rows spilled during that start's import are loaded by the start after."""
    db = tmp_path / "audit.db"
    url = f"sqlite:///{db}"
    spill = tmp_path / "audit.db.spill.jsonl"
    _spill(tmp_path / "audit.db.spill.jsonl.importing-1-20260101T000000000000Z", url, ["crash"])
    _spill(spill, url, ["stop"])
    _spill_during_import(monkeypatch, spill, url)
    for imported in (2, 3):
        store = AuditStore(url, host="h")
        store.start()
        wait_for(lambda n=imported: len(list(tmp_path.glob("*.imported-*"))) == n, 30, "import")
        assert store.stop(timeout=10)
    assert _details(db) == ["crash", "stop", "spilled during the import"]
    assert not spill.exists() and not list(tmp_path.glob("*.importing-*"))
    assert len(list(tmp_path.glob("*.imported-*"))) == 3


def test_a_spill_appended_as_an_import_claims_the_file_goes_to_a_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that opened the spill file just before an import renamed it finds so once it
    holds the lock, and appends to a new file instead of the one being imported."""
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    spill = tmp_path / "audit.db.spill.jsonl"
    claim = spill.with_name(spill.name + audit_spill.CLAIM_TAG + "1-x")
    _spill(spill, url, ["read by the import"])
    real_lock = audit_spill._lock  # noqa: SLF001

    def claim_first(fd: int, wait: bool = True) -> bool:
        if not claim.exists():
            spill.rename(claim)  # the import's claim, between the writer's open and lock
        return real_lock(fd, wait)

    monkeypatch.setattr(audit_spill, "_lock", claim_first)
    _spill(spill, url, ["after the claim"])
    assert [r["detail"] for _, r in audit_spill.read(claim).ops] == ["read by the import"]
    assert [r["detail"] for _, r in audit_spill.read(spill).ops] == ["after the claim"]
