"""A fleet's audit in one database: the audit store, its migrations and `kvguard audit|db` on a
real PostgreSQL server, with several daemons writing, migrating and failing over at once.

A session fixture starts a throwaway server (`initdb` into a temp dir, loopback only, a port
picked free at run time, fsync off: nothing here needs to survive a power cut) and removes it
at the end; each test gets a database of its own. The server runs as the `postgres` user when
the tests run as root, since PostgreSQL refuses to run as root. Without PostgreSQL installed
these tests fail rather than skip: a fleet's database would otherwise go untested unnoticed.

Every wait is for a condition with a deadline, never a guessed sleep.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, redirect_stdout
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from kvguard.daemon import audit, audit_migrate, audit_spill
from kvguard.daemon.audit import AuditStore
from kvguard.daemon.audit_models import Base

NOW = datetime.now(UTC).replace(microsecond=0)
START_TIMEOUT = 60.0  # seconds for a server start or stop; a loaded CI box is slow, not stuck
INSTALL_HINT = "install PostgreSQL: apt-get install -y --no-install-recommends postgresql"


# -- a throwaway PostgreSQL server -------------------------------------------------------------
def _pg_bindir() -> Path:
    """Debian's PostgreSQL binaries (not on PATH there), else whichever `postgres` PATH has."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if found:
        return found[-1].parent
    on_path = shutil.which("postgres")
    if on_path:
        return Path(on_path).parent
    pytest.fail(f"PostgreSQL binaries (initdb, postgres) not found: {INSTALL_HINT}")


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `cond` until it is truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


class PgServer:
    """One PostgreSQL cluster in `root`, started and stopped by the tests (also mid-test, to
    play a database that goes away under a running daemon)."""

    def __init__(self, root: Path) -> None:
        self.bindir = _pg_bindir()
        self.root = root
        self.data = root / "data"
        self.sockets = root / "sock"
        self.log = root / "postgres.log"
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        # PostgreSQL refuses to run as root; the tests often are root (CI, containers).
        self.user = "postgres" if os.geteuid() == 0 else None

    def _as_server_user(self) -> dict[str, Any]:
        return {"user": self.user, "group": self.user} if self.user else {}

    def init(self) -> None:
        self.sockets.mkdir(parents=True)
        if self.user:
            entry = pwd.getpwnam(self.user)
            for p in (self.root, self.sockets):
                os.chown(p, entry.pw_uid, entry.pw_gid)
        cmd = [self.bindir / "initdb", "-D", self.data, "-U", "postgres", "-A", "trust"]
        cmd += ["-E", "UTF8", "--no-sync", "--no-instructions"]
        done = subprocess.run(cmd, capture_output=True, text=True, **self._as_server_user())
        assert done.returncode == 0, f"initdb failed:\n{done.stdout}\n{done.stderr}"

    def start(self) -> None:
        """Start on the last port, or a free one; a port taken meanwhile means another pick."""
        for _ in range(5):
            port = self.port or _free_port()
            if self._start_on(port):
                self.port = port
                return
            if self.port is not None:
                pytest.fail(f"postgres could not restart on port {port}:\n{self._log_tail()}")
        pytest.fail(f"postgres did not start:\n{self._log_tail()}")

    def _start_on(self, port: int) -> bool:
        cmd = [self.bindir / "postgres", "-D", self.data, "-p", str(port), "-h", "127.0.0.1"]
        cmd += ["-k", self.sockets, "-c", "fsync=off", "-c", "full_page_writes=off"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, **self._as_server_user())
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # e.g. the port was taken after we picked it
                self.proc = None
                return False
            if self._accepts(port):
                return True
            time.sleep(0.05)
        pytest.fail(f"postgres did not accept connections in {START_TIMEOUT:g}s")

    def _accepts(self, port: int) -> bool:
        try:
            psycopg.connect(self._dsn("postgres", port), connect_timeout=2).close()
            return True
        except psycopg.OperationalError:
            return False

    def stop(self, immediate: bool = False) -> None:
        """Fast shutdown (SIGINT): clients are disconnected, as when a database host goes.
        `immediate` (SIGQUIT) skips the shutdown checkpoint: for a cluster about to be deleted."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGQUIT if immediate else signal.SIGINT)
        try:
            self.proc.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def _dsn(self, db: str, port: int | None = None) -> str:
        return f"host=127.0.0.1 port={port or self.port} user=postgres dbname={db}"

    def connect(self, db: str, **kw: Any) -> Any:
        return psycopg.connect(self._dsn(db), **kw)

    def create_database(self) -> str:
        name = f"audit_{uuid.uuid4().hex[:12]}"
        with self.connect("postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def url(self, db: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{db}"


@contextmanager
def throwaway_server(prefix: str) -> Iterator[PgServer]:
    """A PostgreSQL server of its own, initialised in a temp dir, stopped and removed after."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    server = PgServer(root)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.stop(immediate=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg() -> Iterator[PgServer]:
    with throwaway_server("kvguard-pg-") as server:
        yield server


@pytest.fixture
def pg_db(pg: PgServer) -> str:
    """A new, empty database on a running server (a test may have stopped it and failed)."""
    if not pg.running:
        pg.start()
    return pg.create_database()


@pytest.fixture
def pg_url(pg: PgServer, pg_db: str) -> str:
    return pg.url(pg_db)


def _count(pg: PgServer, db: str, sql: str) -> Any:
    with pg.connect(db) as conn:
        return conn.execute(sql).fetchall()


def _act(store: AuditStore, **kw: Any) -> None:
    fields: dict[str, Any] = {
        "rule": "reduce-batch",
        "action": "reduce_batch",
        "outcome": "applied",
    }
    store.record_action(**(fields | kw))


def kvguard(*argv: str) -> tuple[int, str]:
    """`kvguard ARGV` through the real entry point, in-process; (exit status, stdout)."""
    from kvguard.daemon.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


# -- migrations --------------------------------------------------------------------------------
def test_migrations_from_empty_match_the_models_on_postgresql(pg_url: str) -> None:
    audit_migrate.upgrade(pg_url)
    assert audit_migrate.current(pg_url) == audit_migrate.head() == "0006"
    engine = audit_migrate.make_engine(pg_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(ctx, Base.metadata) == []
            insp = sa.inspect(conn)
            cols = {c["name"]: c for c in insp.get_columns("actions")}
            indexes = {i["name"]: i for i in insp.get_indexes("actions")}
    finally:
        engine.dispose()
    assert isinstance(cols["time"]["type"], sa.DateTime) and cols["time"]["type"].timezone
    assert isinstance(cols["params"]["type"], sa.JSON)
    assert isinstance(cols["is_undo"]["type"], sa.Boolean)
    assert isinstance(cols["data"]["type"], sa.JSON) and cols["data"]["nullable"]  # 0006
    assert cols["instance"]["nullable"] is False
    assert indexes["ix_actions_uid"]["unique"] and "ix_actions_instance_time" in indexes

    audit_migrate.downgrade(pg_url)
    assert audit_migrate.current(pg_url) is None
    audit_migrate.upgrade(pg_url)
    assert audit_migrate.current(pg_url) == "0006"


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_rows_from_before_0003_get_their_host_as_instance(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """0003 adds, fills and then requires `instance`: batch ops written for SQLite, on both."""
    url = (
        request.getfixturevalue("pg_url")
        if backend == "postgresql"
        else f"sqlite:///{tmp_path}/a.db"
    )
    audit_migrate.upgrade(url, "0002")
    engine = audit_migrate.make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO events (time, host, kind, detail, uid) "
                    "VALUES (:t, 'old-host', 'daemon_start', '', 'u1')"
                ),
                {"t": NOW},
            )
        audit_migrate.upgrade(url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT instance FROM events")).scalars().all() == [
                "old-host"
            ]
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(ctx, Base.metadata) == []
    finally:
        engine.dispose()


# -- two daemons, one database -----------------------------------------------------------------
def _daemon_burst(store: AuditStore, start: threading.Barrier, n: int) -> str:
    """What one daemon records under pressure: an incident, its actions and events."""
    start.wait(timeout=30)
    inc = store.open_incident(1, f"pressure on {store.instance}")
    for i in range(n):
        _act(store, incident=inc, signal="kv_usage", value=0.9 + i / 10_000)
        store.record_event("engine_oom", f"step {i}", incident=inc)
    store.update_incident(inc, actions_count=n, closed_at=datetime.now(UTC))
    return inc


def test_two_daemons_write_at_once_and_every_row_is_tagged(pg: PgServer, pg_db: str) -> None:
    url, n = pg.url(pg_db), 200
    # Both on one host: the instance, not the host, tells their rows apart.
    stores = [AuditStore(url, host="node-1", instance=f"node-1-gpu{g}") for g in ("0-3", "4-7")]
    for s in stores:
        s.start()
    start = threading.Barrier(len(stores))
    incidents: dict[str, str] = {}
    threads = [
        threading.Thread(
            target=lambda s=s: incidents.__setitem__(s.instance, _daemon_burst(s, start, n))
        )
        for s in stores
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        for s in stores:
            assert s.flush(timeout=60) and s.problem() is None
    finally:
        for s in stores:
            s.stop(timeout=10)
    for table, per in (("actions", n), ("events", n), ("incidents", 1)):
        got = _count(pg, pg_db, f"SELECT instance, count(*) FROM {table} GROUP BY 1 ORDER BY 1")
        assert got == [("node-1-gpu0-3", per), ("node-1-gpu4-7", per)], table
    reader = AuditStore(url, host="-")
    try:
        for s in stores:
            mine = reader.list_incidents(instance=s.instance)
            assert [i["id"] for i in mine] == [incidents[s.instance]]
            assert mine[0]["actions_count"] == n and mine[0]["closed_at"] is not None
            acts = reader.list_actions(instance=s.instance, limit=None)
            assert len(acts) == n and {a["incident"] for a in acts} == {incidents[s.instance]}
            assert len(reader.list_events(instance=s.instance, limit=None)) == n
    finally:
        reader.stop()


# -- kvguard audit and kvguard db against PostgreSQL -------------------------------------------
@pytest.fixture
def fleet(pg_url: str) -> tuple[str, dict[str, str]]:
    """Two daemons' rows in one database: an incident each, an action each an hour apart."""
    incidents = {}
    for name, ago in (("node-a", 2), ("node-b", 1)):
        s = AuditStore(pg_url, host=name, instance=name)
        s.start()
        inc = s.open_incident(2, f"kv pressure on {name}", time=NOW - timedelta(hours=ago))
        _act(
            s,
            signal="kv_usage",
            value=0.95,
            threshold=0.92,
            incident=inc,
            time=NOW - timedelta(hours=ago),
        )
        s.record_event(
            "engine_oom", "step preempted", incident=inc, time=NOW - timedelta(hours=ago)
        )
        s.update_incident(inc, actions_count=1, closed_at=NOW - timedelta(minutes=ago * 10))
        assert s.stop(timeout=30)
        incidents[name] = inc
    return pg_url, incidents


def test_cli_listings_filter_by_instance(fleet: tuple[str, dict[str, str]]) -> None:
    url, incs = fleet
    rc, out = kvguard("audit", "incidents", "--db", url, "--json")
    assert rc == 0 and [r["instance"] for r in json.loads(out)] == ["node-a", "node-b"]
    rc, out = kvguard("audit", "incidents", "--db", url, "--instance", "node-b", "--json")
    assert rc == 0 and [r["id"] for r in json.loads(out)] == [incs["node-b"]]
    rc, out = kvguard("audit", "incidents", "--db", url, "--instance", "node-a")  # a pipe: plain
    assert out.splitlines()[0].split()[5] == "INSTANCE" and incs["node-a"] in out
    assert incs["node-b"] not in out
    rc, out = kvguard("audit", "list", "--db", url, "--instance", "node-a", "--json")
    acts = json.loads(out)
    assert rc == 0 and [(a["instance"], a["incident"]) for a in acts] == [
        ("node-a", incs["node-a"])
    ]
    rc, out = kvguard("audit", "list", "--db", url, "--since", "90m", "--json")
    assert [a["instance"] for a in json.loads(out)] == ["node-b"]
    rc, out = kvguard("audit", "list", "--db", url, "--instance", "nobody", "--json")
    assert rc == 0 and json.loads(out) == []


def test_cli_show_timeline_export_and_db_commands(
    fleet: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, incs = fleet
    first = json.loads(kvguard("audit", "list", "--db", url, "--json")[1])[0]
    rc, out = kvguard("audit", "show", str(first["id"]), "--db", url, "--json")
    shown = json.loads(out)
    assert rc == 0 and shown["value"] == 0.95 and shown["params"] == {}
    assert shown["time"] == (NOW - timedelta(hours=2)).isoformat()  # aware UTC, round trip
    rc, out = kvguard("audit", "timeline", incs["node-b"], "--db", url, "--json")
    body = json.loads(out)
    assert body["incident"]["instance"] == "node-b"
    # Same time: the event is shown first, as the likelier cause.
    assert [e.get("kind") or e["action"] for e in body["timeline"]] == [
        "engine_oom",
        "reduce_batch",
    ]
    rc, out = kvguard("audit", "timeline", incs["node-b"], "--db", url)
    assert rc == 0 and "instance node-b" in out and "kv_usage=0.95" in out
    dest = tmp_path / "events.csv"
    rc, _ = kvguard("audit", "export", "--csv", "--table", "events", "--instance", "node-a",
                    "--db", url, "-o", str(dest))  # fmt: skip
    lines = dest.read_text().splitlines()
    assert rc == 0 and len(lines) == 2 and "instance" in lines[0].split(",")
    rc, out = kvguard("audit", "export", "--json", "--table", "incidents", "--db", url)
    assert [r["id"] for r in json.loads(out)] == [incs["node-a"], incs["node-b"]]
    rc, out = kvguard("db", "current", "--db", url, "--json")
    assert json.loads(out)["revision"] == json.loads(out)["head"] == "0006"
    rc, out = kvguard("db", "upgrade", "--db", url)
    assert rc == 0 and "at revision 0006" in out and "postgresql+psycopg://" in out


def test_config_names_the_database_and_the_instance(
    fleet: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    from kvguard.daemon.config import load_config

    url, incs = fleet
    cfg = tmp_path / "kvguard.yaml"
    cfg.write_text(f"audit:\n  url: {url}\n  instance: node-a\n")
    assert load_config(cfg).audit.instance == "node-a"
    rc, out = kvguard("audit", "incidents", "--config", str(cfg), "--json")
    assert rc == 0 and len(json.loads(out)) == 2


# -- retention ---------------------------------------------------------------------------------
def test_retention_purges_old_rows_and_closed_incidents(pg_url: str) -> None:
    store = AuditStore(pg_url, instance="node-r")
    store.start()
    try:
        old = NOW - timedelta(days=100)
        store.record_event("daemon_start", time=old)
        store.record_event("daemon_start")
        closed = store.open_incident(1, "old", time=old)
        store.update_incident(closed, closed_at=old + timedelta(minutes=5))
        still_open = store.open_incident(1, "still open", time=old)
        _act(store, time=old)
        _act(store, action="enable_fp8_kv", incident=still_open, time=old)  # kept with it
        _act(store, action="restore_batch")
        store.purge_older_than(90)
        assert store.flush(30)
        assert len(store.list_events(limit=None)) == 1
        kept = [a["action"] for a in store.list_actions(limit=None)]
        assert kept == ["enable_fp8_kv", "restore_batch"]
        assert [i["id"] for i in store.list_incidents(limit=None)] == [still_open]
    finally:
        store.stop()


# -- the database goes away: degraded, never fatal ---------------------------------------------
def test_server_stopped_mid_run_rows_queue_and_land_after_restart(pg: PgServer, pg_db: str) -> None:
    store = AuditStore(pg.url(pg_db), instance="node-x")
    store.start()
    try:
        store.record_event("daemon_start")
        assert store.flush(30)
        pg.stop()
        for i in range(5):
            _act(store, detail=f"during the outage {i}")  # never blocks the caller
        problem = wait_for(store.problem, 30, "the writer to notice the server is gone")
        assert problem.startswith("cannot write to postgresql+psycopg://") and store.depth() == 5
        pg.start()
        assert store.flush(timeout=60), store.problem()
        assert store.problem() is None and store.failures > 0
    finally:
        store.stop(timeout=10)
    rows = _count(pg, pg_db, "SELECT detail, instance FROM actions ORDER BY id")
    assert rows == [(f"during the outage {i}", "node-x") for i in range(5)]


def test_server_down_at_start_is_degraded_until_it_comes_back(pg: PgServer, pg_db: str) -> None:
    """The chaos "audit DB unavailable" fault on a fleet database: the daemon starts anyway."""
    url = pg.url(pg_db)
    pg.stop()
    store = AuditStore(url, instance="node-y")
    try:
        store.start()  # does not raise: serving goes on
        assert store.problem().startswith("cannot migrate postgresql+psycopg://")
        store.record_event("daemon_start", "while the database was down")
        pg.start()
        assert store.flush(timeout=60), store.problem()
        assert store.problem() is None
    finally:
        store.stop(timeout=10)
    assert audit_migrate.current(url) == "0006"
    assert _count(pg, pg_db, "SELECT kind, instance FROM events") == [("daemon_start", "node-y")]


def test_rows_left_at_exit_spill_and_kvguard_audit_import_loads_them_once(
    pg: PgServer, pg_db: str, tmp_path: Path
) -> None:
    url = pg.url(pg_db)
    store = AuditStore(url, instance="node-z", spill_dir=tmp_path)
    store.start()
    pg.stop()
    inc = store.open_incident(1, "while the database was down")
    for i in range(3):
        _act(store, incident=inc, detail=f"unwritten {i}")
    store.record_event("daemon_stop", incident=inc)
    assert store.stop(timeout=1) is False  # cannot flush: the rows go to the spill file
    spill = store.spill_paths[-1]
    assert spill.parent == tmp_path and spill.name.startswith(f"audit-{pg_db}-")
    assert store.spill_file == spill and store.spilled == 5
    pg.start()
    rc, out = kvguard("audit", "import", str(spill), "--db", url, "--keep", "--json")
    res = json.loads(out)
    assert rc == 0 and res["added"] == {"incidents": 1, "actions": 3, "events": 1}
    rc, out = kvguard("audit", "import", str(spill), "--db", url, "--json")
    res = json.loads(out)
    assert rc == 0 and res["added"] == {} and res["skipped"] == 5 and res["renamed_to"]
    tags = _count(
        pg, pg_db, "SELECT DISTINCT instance FROM actions UNION SELECT instance FROM incidents"
    )
    assert tags == [("node-z",)]


def test_a_write_held_by_a_table_lock_is_reported_within_seconds_and_lands_once(
    pg: PgServer, pg_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An analyst's transaction holds `actions` (LOCK TABLE, or a CREATE INDEX without
    CONCURRENTLY) while the daemon runs: the write waits a bounded time for the lock, fails
    and is retried; meanwhile the store says it is degraded (readiness, kvguard_audit_up) and
    logs it once, and the row lands once the lock is gone, once."""
    url = pg.url(pg_db)
    store = AuditStore(url, instance="node-k")
    store.start()
    analyst = pg.connect(pg_db)
    try:
        _act(store, detail="before the lock")
        assert store.flush(30)
        analyst.execute("LOCK TABLE actions IN ACCESS EXCLUSIVE MODE")  # left open
        with caplog.at_level(logging.WARNING, logger=audit.__name__):
            _act(store, detail="while locked")
            problem = wait_for(store.problem, 20, "the store to say it is degraded")
            assert problem.startswith(f"cannot write to {url}: a write waited over 3s for a ")
            assert "table lock" in problem and problem.endswith("; 1 rows queued"), problem
            analyst.rollback()
            assert store.flush(30), store.problem()
        assert store.problem() is None
    finally:
        analyst.close()
        store.stop(timeout=10)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("audit degraded")]
    assert len(said) == 1 and "table lock" in said[0], said
    got = _count(pg, pg_db, "SELECT detail FROM actions ORDER BY id")
    assert got == [("before the lock",), ("while locked",)]


def test_a_read_held_by_a_table_lock_fails_within_seconds_naming_the_lock(
    pg: PgServer, pg_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvguard audit list` while an analyst's transaction holds `actions`: the read waits as
    long as a write would (READ_LOCK_WAIT_S), then exits 2 saying what holds it, instead of
    hanging the terminal for as long as the transaction stays open."""
    url = pg.url(pg_db)
    audit_migrate.upgrade(url)
    analyst = pg.connect(pg_db)
    result: list[tuple[int, str]] = []
    try:
        analyst.execute("LOCK TABLE actions IN ACCESS EXCLUSIVE MODE")  # left open
        reader = threading.Thread(
            target=lambda: result.append(kvguard("audit", "list", "--db", url))
        )
        reader.start()
        reader.join(timeout=60)  # the lock is held all along: only the read's bound ends it
        assert not reader.is_alive(), "kvguard audit list still waits for the lock"
    finally:
        analyst.rollback()
        analyst.close()
    assert result and result[0][0] == 2
    err = capsys.readouterr().err
    assert "the audit table is locked by another session (a read waited over 3s" in err, err
    assert "see pg_stat_activity" in err


def _spill_while_down(url: str, instance: str, spill_dir: Path, detail: str) -> Path:
    """A daemon's run while its database server is down: its row is spilled at stop."""
    store = AuditStore(url, instance=instance, spill_dir=spill_dir)
    store.start()
    store.record_event("tick", detail)
    assert store.stop(timeout=1) is False
    assert store.spill_file is not None
    return store.spill_file


def _start_and_stop(url: str, instance: str, spill_dir: Path) -> None:
    """A daemon's next start: its writer imports the spill files it finds before its first
    batch, so once this row is flushed the import is done."""
    store = AuditStore(url, instance=instance, spill_dir=spill_dir)
    store.start()
    try:
        store.record_event("daemon_start")
        assert store.flush(30), store.problem()
    finally:
        store.stop(timeout=10)


def test_daemons_of_two_databases_sharing_a_state_directory_import_their_own_spills(
    pg: PgServer, pg_db: str, tmp_path: Path
) -> None:
    """Two daemons on one host, each with its own database on one server, one state directory:
    the server goes down, each spills its row at stop, and each next start loads its own."""
    other_db = pg.create_database()
    urls = {"node-x": pg.url(pg_db), "node-y": pg.url(other_db)}
    for url in urls.values():
        audit_migrate.upgrade(url)
    pg.stop()
    spills = {
        name: _spill_while_down(url, name, tmp_path, f"from {name}") for name, url in urls.items()
    }
    pg.start()
    for name, url in urls.items():
        _start_and_stop(url, name, tmp_path)
    for db, name in ((pg_db, "node-x"), (other_db, "node-y")):
        got = _count(pg, db, "SELECT detail, instance FROM events ORDER BY id")
        assert got == [(f"from {name}", name), ("", name)]
    assert not any(p.exists() for p in spills.values())  # both renamed once imported


def test_a_spill_file_is_its_databases_however_the_url_names_it(
    pg: PgServer, pg_db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Between two runs the password moved to ~/.pgpass and a connect timeout was added: the
    same database, whose spill file the start and `kvguard audit import` take. Another
    database is still refused."""
    first = f"postgresql+psycopg://postgres:secret@127.0.0.1:{pg.port}/{pg_db}"  # trust: unchecked
    later = f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/{pg_db}?connect_timeout=10"
    audit_migrate.upgrade(first)
    other = pg.url(pg.create_database())
    audit_migrate.upgrade(other)
    pg.stop()
    spill = _spill_while_down(first, "node-p", tmp_path, "spilled")
    assert audit_spill.read(spill).headers[0]["db"].startswith("postgresql+psycopg://postgres:***@")
    pg.start()
    rc, _ = kvguard("audit", "import", str(spill), "--db", other)
    err = capsys.readouterr().err
    assert rc == 2 and "holds rows spilled from postgresql+psycopg://postgres:***@" in err
    assert spill.is_file()
    plain = f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/{pg_db}"
    rc, out = kvguard("audit", "import", str(spill), "--db", plain, "--keep", "--json")
    assert rc == 0 and json.loads(out)["added"] == {"events": 1}, capsys.readouterr().err
    assert AuditStore(later, spill_dir=tmp_path).spill_paths == [spill]
    _start_and_stop(later, "node-p", tmp_path)
    assert not spill.exists()  # the start took it as its own (its row was there already)
    got = _count(pg, pg_db, "SELECT detail FROM events ORDER BY id")
    assert got == [("spilled",), ("",)]
    assert _count(pg, other.rsplit("/", 1)[1], "SELECT count(*) FROM events") == [(0,)]


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_non_finite_floats_in_params_and_data_are_stored_alike_on_both_backends(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """JSON has no NaN or Infinity: PostgreSQL refused (and lost) a row holding one, SQLite
    kept it. Both now store null, which `kvguard audit --json` printed for it anyway."""
    url = (
        request.getfixturevalue("pg_url")
        if backend == "postgresql"
        else f"sqlite:///{tmp_path}/a.db"
    )
    store = AuditStore(url, instance="node-f")
    store.start()
    try:
        inf = float("inf")
        _act(store, params={"factor": float("nan"), "limits": [inf, -inf, 0.5]})
        _act(store, state_before={"usage": {"peak": inf}}, state_after={"usage": 0.25})
        store.record_event("tick", data={"n": float("nan")})
        assert store.flush(30), store.problem()
        assert store.rejected == 0 and store.written == 3
        acts = store.list_actions()
        assert acts[0]["params"] == {"factor": None, "limits": [None, None, 0.5]}
        assert acts[1]["state_before"] == {"usage": {"peak": None}}
        assert acts[1]["state_after"] == {"usage": 0.25}
        assert store.list_events()[0]["data"] == {"n": None}
    finally:
        store.stop(timeout=10)


# -- several daemons migrating at the same moment ----------------------------------------------
MIGRATE = """
import sys
from kvguard.daemon.audit_migrate import upgrade
print("ready", flush=True)
sys.stdin.readline()  # the test's starting gun: every process is imported and waiting
# A SQLite waiter may wait longer than the daemon's 5 s on a loaded machine; the daemon would
# retry, a test process would fail.
upgrade(sys.argv[1], busy_timeout_ms=60_000)
print("migrated", flush=True)
"""


def _migrators(url: str, n: int = 2) -> list[subprocess.Popen[str]]:
    """`n` processes that each migrate `url` once the test writes a line to their stdin."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MIGRATE, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n", p.communicate()
    return procs


def _finish(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "migrated" in out, err


def _assert_at_head(url: str) -> None:
    engine = audit_migrate.make_engine(url)
    try:
        with engine.connect() as conn:
            versions = conn.execute(sa.text("SELECT version_num FROM alembic_version")).all()
            assert versions == [(audit_migrate.head(),)]
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(ctx, Base.metadata) == []
    finally:
        engine.dispose()


def test_two_processes_migrating_postgresql_at_once_take_turns(pg: PgServer, pg_db: str) -> None:
    """While the test holds the migration lock, both wait on it; released, both succeed, and
    the schema is at head exactly once."""
    url = pg.url(pg_db)
    key = audit_migrate.MIGRATION_LOCK_KEY
    with pg.connect(pg_db, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        procs = _migrators(url)
        try:
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            waiting = (
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            wait_for(
                lambda: holder.execute(waiting).fetchone()[0] == 2,
                60,
                "both processes to wait on the migration lock",
            )
            assert audit_migrate.current(url) is None  # nobody got past the lock
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
        _finish(procs)
    _assert_at_head(url)


def test_two_processes_migrating_one_sqlite_file_at_once(tmp_path: Path) -> None:
    """SQLite's write lock (BEGIN IMMEDIATE) serialises them; a few rounds, each from empty."""
    for round_ in range(2):  # without the lock, one of the two failed in every round tried
        url = f"sqlite:///{tmp_path / f'audit{round_}.db'}"
        procs = _migrators(url)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        _finish(procs)
        _assert_at_head(url)
