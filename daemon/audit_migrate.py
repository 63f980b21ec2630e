"""Connecting to the audit database and migrating it with Alembic, run from code.

The daemon migrates its own database at start, before READY, and `kvguard db upgrade` does the
same by hand, so Alembic is driven through its command API with a `Config` built here: an
installed wheel has no alembic.ini, and the URL (which may hold a password with `%` in it) never
passes through ini interpolation. The connection handed to Alembic comes from `make_engine`, so
migrations run with the same SQLite settings as the writer.

Several daemons may migrate one database at the same moment (a fleet sharing a PostgreSQL
database, restarted together), so a migration runs in one transaction that first takes a lock
every other migration of that database waits for: a PostgreSQL advisory lock (released after
the commit, or by the server when a dead process's connection drops), and on SQLite
`BEGIN IMMEDIATE`, the file's write lock. The one that waited then finds the database at
head and does nothing. Without it, two daemons would both see an empty database and both
create its tables, and one of them would fail half-way; with SQLite's default driver mode each
CREATE TABLE would even commit on its own, leaving tables without a revision stamp.

The daemon's own migration must not wait without end either (it runs before READY, and a
database must never keep the daemon from serving): it passes `wait_s`, which bounds the wait
for another migration's lock (`pg_try_advisory_lock`, polled until then) and, through
`SET LOCAL lock_timeout`, each wait of its DDL for a table lock (an analyst's transaction left
open on `actions`). Every connection to a server also has a connect timeout and TCP keepalives
(`make_engine`), so a server that hangs or a host that is gone fails the attempt instead of
holding it; the daemon then runs degraded and its writer tries again. `kvguard db upgrade`
passes no `wait_s` and waits as long as it takes, as an operator at a prompt expects.

Every failure an operator can cause (a malformed URL, a driver that is not installed, a file
that is not there, a database that refuses) becomes a one-line `ValueError`.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.util import CommandError
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

import kvguard.migrations

MIGRATIONS_DIR = Path(kvguard.migrations.__file__).resolve().parent
BUSY_TIMEOUT_MS = 5000  # how long a SQLite writer waits for another's lock before failing
# A SQLite WAL grows to hold what is written between two checkpoints and keeps that size; it is
# cut back to this once checkpointed (a retention sweep, a burst of rows). See README (audit).
WAL_LIMIT_BYTES = 64 * 2**20
MIGRATION_WAIT_MS = 120_000  # how long a SQLite migrator waits for another's migration
# Connections to a database server: a server that accepts TCP but never answers (hung, or
# SIGSTOPped) fails the connect after this long, and keepalives find a host that is gone.
CONNECT_TIMEOUT_S = 5
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}
# Query parameters whose value `shown` hides: libpq's `password` and `sslpassword`, and what
# other drivers call theirs (`passwd`, `pwd`, a token, a whole ODBC connection string)
SECRET_PARAM = re.compile(r"pass|pwd|secret|token|credential|odbc_connect", re.IGNORECASE)
LIBPQ_DRIVERS = ("psycopg", "psycopg2")  # the drivers that take libpq's connection parameters
# The PostgreSQL advisory lock key of audit migrations: any constant shared by every kvguard
# (advisory keys are per database, so other applications' databases are not affected).
MIGRATION_LOCK_KEY = int.from_bytes(b"kvguard!", "big") >> 1  # a positive bigint


def parse_url(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError:
        why = ""
    except ValueError:  # a port that is not a number (or a password whose `@` went missing)
        why = ": its port is not a number"
    raise ValueError(
        f"{_masked(url)!r} is not a database URL{why} (expected e.g. "
        "sqlite:////var/lib/kvguard/audit.db or postgresql://user@host/kvguard)"
    )


def check_url(url: str) -> URL:
    """The parsed URL, once its backend and its database driver are known to be installed:
    what `make_engine` would find, found without connecting (the config check at load)."""
    u = parse_url(url)
    try:
        dialect = u.get_dialect()
    except NoSuchModuleError:
        raise ValueError(_unknown_backend(u)) from None
    try:
        dialect.import_dbapi()
    except ImportError as e:
        raise ValueError(_driver_missing(u, e)) from None
    return u


def _unknown_backend(u: URL) -> str:
    return f"{shown(u)}: unknown database backend {u.drivername!r}"


def _driver_missing(u: URL, e: ImportError) -> str:
    hint = " (pip install 'kvguard[postgres]')" if u.get_backend_name() == "postgresql" else ""
    return f"{shown(u)}: its database driver is not installed ({e.name}){hint}"


def shown(url: str | URL) -> str:
    """The URL as it may appear in a log, an error, `/ready` or a spill file's header: its
    password hidden, in the user part or as a query parameter (`?password=`)."""
    if isinstance(url, str):
        try:
            url = parse_url(url)
        except ValueError:
            return repr(_masked(url))
    u = url
    if u.host and "@" in u.host:  # a password with an `@` not written %40: its rest is here
        u = u.set(host="***@" + u.host.rpartition("@")[2])
    secret = sorted(k for k in u.query if SECRET_PARAM.search(k))
    text = u.difference_update_query(secret).render_as_string(hide_password=True)
    hidden = [f"{k}=***" for k in secret for _ in _values(u.query[k])]
    return text + ("&" if "?" in text else "?") + "&".join(hidden) if hidden else text


def _values(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return value if isinstance(value, tuple) else (value,)


def _masked(url: str) -> str:
    """A URL that does not parse, as an error may quote it: what could be a password is
    replaced by `***`, being all between the scheme and the last `@`, a host's `:` followed by
    something other than a port (an `@` left out), and every query value."""
    base, mark, query = url.partition("?")
    scheme = re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/*", base)
    start = scheme.end() if scheme else 0
    if "@" in base:
        base = base[:start] + "***" + base[base.rindex("@") :]
    else:
        netloc, slash, path = base[start:].partition("/")
        if re.search(r":(?!\d*$)", netloc):
            netloc = netloc.partition(":")[0] + ":***"
        base = base[:start] + netloc + slash + path
    pairs = [p.partition("=") for p in query.split("&")] if query else []
    return base + mark + "&".join(f"{k}=***" if eq else "***" for k, eq, _ in pairs)


def sqlite_path(url: str | URL) -> Path | None:
    """The file behind a SQLite URL; None for other backends and in-memory databases."""
    u = parse_url(url) if isinstance(url, str) else url
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    if u.database.startswith("file:"):  # a URI filename (?uri=true): not a plain path
        return None
    return Path(u.database)


def make_engine(url: str, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> Engine:
    """An engine for any SQLAlchemy URL; on SQLite, WAL and a busy timeout on every connection.

    WAL lets the CLI read while the daemon writes; the busy timeout makes a writer wait out a
    short lock instead of failing at once. An in-memory SQLite database gets one shared
    connection, or the writer thread would see a different, empty database.
    """
    u = parse_url(url)
    kwargs: dict[str, Any] = {}
    sqlite = u.get_backend_name() == "sqlite"
    try:  # an unknown backend fails as early as the driver's name (`_server_connect_args`)
        if sqlite and u.database in (None, "", ":memory:"):
            kwargs = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        elif not sqlite:
            # pool_pre_ping: a server's idle timeout is not a failed write
            kwargs = {"pool_pre_ping": True, "connect_args": _server_connect_args(u)}
        engine = create_engine(u, **kwargs)
    except NoSuchModuleError:
        raise ValueError(_unknown_backend(u)) from None
    except ImportError as e:
        raise ValueError(_driver_missing(u, e)) from None
    if sqlite:
        event.listen(engine, "connect", _sqlite_pragmas(busy_timeout_ms))
    return engine


def _server_connect_args(u: URL) -> dict[str, Any]:
    """A connect timeout (and on PostgreSQL TCP keepalives) for a database server, unless the
    URL's query sets its own (`?connect_timeout=30`)."""
    args: dict[str, Any] = {}
    backend, driver = u.get_backend_name(), u.get_driver_name()
    if backend == "postgresql" and driver in LIBPQ_DRIVERS:
        args = {"connect_timeout": CONNECT_TIMEOUT_S, **KEEPALIVES}
    elif backend in ("mysql", "mariadb") and driver in ("mysqldb", "pymysql"):
        args = {"connect_timeout": CONNECT_TIMEOUT_S}
    return {k: v for k, v in args.items() if k not in u.query}


def _sqlite_pragmas(busy_timeout_ms: int) -> Any:
    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")  # first: WAL may wait
            _journal_wal(cur, busy_timeout_ms)
            cur.execute(f"PRAGMA journal_size_limit = {int(WAL_LIMIT_BYTES)}")
        finally:
            cur.close()

    return on_connect


def _journal_wal(cur: Any, busy_timeout_ms: int) -> None:
    """`PRAGMA journal_mode = WAL`, retried while the file is locked. Switching a new file to
    WAL needs it to itself, and SQLite answers "database is locked" at once, without its busy
    handler, while another process holds it (two daemons, or migrators, opening one new file
    together: one in six such starts failed here)."""
    deadline = time.monotonic() + busy_timeout_ms / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def require_database(url: str) -> None:
    """Refuse a SQLite file that does not exist: reading must not create an empty database.
    A directory is said to be one (`--db sqlite:///var/lib/kvguard`, the file's name left
    out), not called a missing database."""
    path = sqlite_path(url)
    if path is not None and path.is_dir():
        raise ValueError(
            f"{path} is a directory, not an audit database: name the database file in it "
            f"(e.g. sqlite:///{path / 'audit.db'})"
        )
    if path is not None and not path.is_file():
        raise ValueError(
            f"no audit database at {path} (the daemon creates it when it starts; "
            "pass --db URL or --config FILE, or set KVGUARD_STATE_DIR, to read another)"
        )


@contextmanager
def db_errors(url: str) -> Iterator[None]:
    """Turn database and Alembic failures into one line naming the database."""
    try:
        yield
    except CommandError as e:
        raise ValueError(f"{shown(url)}: {e}") from None
    except SQLAlchemyError as e:
        reason = getattr(e, "orig", None) or e
        raise ValueError(f"{shown(url)}: {str(reason).splitlines()[0]}") from None


def alembic_config(connection: Any = None) -> Config:
    """Alembic's configuration, built in memory; env.py uses `connection` when given.

    Its options go through ConfigParser's `%` interpolation: a `%` in the install path is
    doubled, or every migration would fail on it (the audit degraded for good)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@contextmanager
def advisory_lock(conn: Connection, wait_s: float | None = None) -> Iterator[None]:
    """On PostgreSQL, hold the migration lock for the `with` block; elsewhere do nothing.

    A session lock taken before the migration's transaction begins, so that even a server whose
    default isolation is REPEATABLE READ gives the waiter a snapshot taken after the other
    migration committed. The server drops the lock with the connection if the process dies.
    With `wait_s`, a lock another migration still holds after that long is a `ValueError`.
    """
    if conn.dialect.name != "postgresql":
        yield
        return
    if wait_s is None:
        conn.exec_driver_sql(f"SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})")
        conn.commit()
    else:
        _try_advisory_lock(conn, wait_s)
    try:
        yield
    finally:
        with suppress(SQLAlchemyError):  # a broken connection: closing it frees the lock
            conn.rollback()
            conn.exec_driver_sql(f"SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})")
            conn.commit()


def _try_advisory_lock(conn: Connection, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    pause = 0.02
    while True:
        got = conn.exec_driver_sql(f"SELECT pg_try_advisory_lock({MIGRATION_LOCK_KEY})").scalar()
        conn.commit()
        if got:
            return
        if time.monotonic() >= deadline:
            raise ValueError(
                f"another migration of this database has held its lock for over {wait_s:g}s "
                "(a daemon or `kvguard db upgrade` migrating it, or a session holding "
                f"pg_advisory_lock({MIGRATION_LOCK_KEY}))"
            )
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.25)


def pg_lock_timeout(conn: Connection, wait_s: float | None) -> None:
    """On PostgreSQL with `wait_s`, bound each wait of this transaction for a table lock: an
    ALTER TABLE queued behind an open transaction would otherwise wait for it without end,
    and hold up every other session's writes to that table meanwhile."""
    if wait_s is not None and conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{max(1, int(wait_s * 1000))}ms'")


def sqlstate(e: BaseException) -> str | None:
    """The SQLSTATE of a database error, as the driver gives it (psycopg 3 `sqlstate`,
    psycopg2 `pgcode`); None where it gives none (SQLite)."""
    orig = getattr(e, "orig", None)
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def _lock_timed_out(e: BaseException) -> bool:
    return sqlstate(e) == "55P03"  # lock_not_available


def sqlite_write_lock(conn: Connection) -> None:
    """On SQLite, take the file's write lock for the rest of the transaction.

    The sqlite3 module would otherwise run each DDL statement outside any transaction: a second
    migrator would see tables without a revision stamp, and one killed half-way would leave them.
    Other backends (MySQL, ...) get no lock here: a fleet on one should run `kvguard db upgrade`
    once before starting its daemons.
    """
    if conn.dialect.name == "sqlite":
        # wait out another process's whole migration, as pg_advisory_lock does, not just the
        # few seconds a writer waits for an insert (a migration on a busy host takes longer)
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {MIGRATION_WAIT_MS}")
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _at_head(conn: Connection) -> bool:
    """Already migrated: every daemon start but the first ends here, before the SQLite write
    lock (a read-only file at head must not fail for want of one)."""
    return MigrationContext.configure(conn).get_current_revision() == head()


def _newer(conn: Connection) -> str | None:
    """The database's revision if this kvguard does not know it: a newer kvguard's, during a
    fleet's rolling upgrade (or another application's Alembic stamp)."""
    from alembic.script import ScriptDirectory

    rev = MigrationContext.configure(conn).get_current_revision()
    if rev is None:
        return None
    try:
        ScriptDirectory.from_config(alembic_config()).get_revision(rev)
    except CommandError:  # "Can't locate revision"
        return rev
    return None


def _run(
    url: str,
    fn: Any,
    revision: str,
    busy_timeout_ms: int,
    wait_s: float | None = None,
    newer_ok: bool = False,
) -> str | None:
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = make_engine(url, busy_timeout_ms)
    try:
        with db_errors(url), engine.connect() as conn, advisory_lock(conn, wait_s), conn.begin():
            pg_lock_timeout(conn, wait_s)
            if fn is command.upgrade and revision == "head":
                if _at_head(conn):
                    return None
                newer = _newer(conn) if newer_ok else None
                if newer is not None:
                    return newer
            sqlite_write_lock(conn)
            try:
                fn(alembic_config(conn), revision)
            except SQLAlchemyError as e:
                if wait_s is None or not _lock_timed_out(e):
                    raise
                raise ValueError(
                    f"{shown(url)}: the migration waited over {wait_s:g}s for a table lock "
                    "that another session holds (an open transaction? see pg_stat_activity)"
                ) from None
    finally:
        engine.dispose()
    return None


def upgrade(
    url: str,
    revision: str = "head",
    busy_timeout_ms: int = BUSY_TIMEOUT_MS,
    wait_s: float | None = None,
    newer_ok: bool = False,
) -> str | None:
    """Bring the database to `revision`, creating it (and a SQLite file's directory) if needed;
    safe to run from several processes at once. `wait_s` bounds the waits for another
    migration's lock and for table locks on PostgreSQL (see the module docstring).

    `newer_ok` (the daemon's): a database at a revision this kvguard does not know, a newer
    kvguard's during a fleet's rolling upgrade, is left as it is and its revision returned; the
    newer migrations are made to take an older daemon's rows (README: upgrade order). Without
    it that is Alembic's error."""
    return _run(url, command.upgrade, revision, busy_timeout_ms, wait_s, newer_ok)


def downgrade(url: str, revision: str = "base", busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
    """Take the database back to `revision`; "base" drops every audit table."""
    _run(url, command.downgrade, revision, busy_timeout_ms)


def current(url: str) -> str | None:
    """The database's revision; None when it has never been migrated."""
    require_database(url)
    engine = make_engine(url)
    try:
        with db_errors(url), engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    """The newest revision this kvguard ships."""
    from alembic.script import ScriptDirectory

    rev = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert rev is not None, f"no migrations in {MIGRATIONS_DIR}"
    return rev
