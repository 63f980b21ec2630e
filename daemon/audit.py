"""The audit store: every remedy, event and incident, written without ever stalling the caller.

The rules evaluator and the engine's event hooks run on hot paths; a database that is locked,
read-only, slow or gone must not stall or crash them. So callers only append to a bounded
in-memory queue and return, and ONE writer thread drains it in batches, one transaction per
batch. When a write fails for a reason outside the row (a lock, a full disk, a dropped
connection) the batch stays queued and is retried with exponential backoff until it lands:
nothing is lost until the queue bound is reached, and only then are new rows dropped (counted in
`dropped`, logged as errors, totalled again at stop). A row the database refuses for its own
sake (a constraint) would fail forever, so it is isolated from its batch, logged and counted in
`rejected` instead of wedging the queue.

A database that cannot even be migrated at start (a read-only file or directory, a full disk, a
server that is down, hung, or a lock held) does not stop the daemon either: the writer thread
migrates, `start()` waits for its first attempt a few seconds at most (`START_WAIT_S`), logs why
it failed or has not finished and returns; the store is *degraded* (`problem()` says why, for
readiness and kvguard_audit_up), rows queue, and the writer retries the migration with the same
backoff before it writes anything. Each attempt is bounded (a connect timeout, and on
PostgreSQL bounded lock waits: `audit_migrate`), so the retries go on. After a failed write the
writer also drops its pooled connections: SQLite opens an immutable file read-only, and a
connection opened then would refuse writes even after the file became writable again.

A write to a running database may also block: a table lock held by someone's open transaction,
or a server that hangs (the kernel still acknowledges its packets, so neither keepalives nor a
timeout of the client's end it). On PostgreSQL a write waits WRITE_LOCK_WAIT_S at most for a
lock, then fails and is retried like any failed write; and whatever blocks it, a write not
done after WRITE_STALL_S makes the store degraded (`problem()`) and is logged once, until it
ends. Its rows stay queued meanwhile, and are spilled at stop as any others. A read
(`kvguard audit`) waits READ_LOCK_WAIT_S at most for a lock, then fails naming it.

The database may also vanish under a running daemon: a SQLite file deleted or replaced (its
device and inode change) is noticed before the next batch, and a write that finds no table
(`no such table`, UndefinedTable) makes the writer migrate again, then write: the rows land in
the new database instead of a deleted file.

Rows still queued when `stop()` gives up are appended to a spill file
(`kvguard.daemon.audit_spill`) rather than lost; `stop()` keeps to its timeout as a whole, and
a writer stuck on a database that does not answer is left behind (it is a daemon thread) while
what it holds is spilled. `import_file` loads a spill file, skipping rows already present by
the `uid` every action and event gets when queued. The writer imports any spill file of this
database by itself once the database takes writes, then renames it. A row the database refuses
because of a schema this kvguard does not know (a NOT NULL, CHECK or foreign key another
daemon's newer migration added) goes to the spill file too, for a later import; a row that
would fail again (a duplicate) is logged whole and counted in `rejected`.

Counters for the metrics exporter: `failures` (failed write and migration attempts,
kvguard_audit_write_failures_total), `dropped`, `rejected`, `written`, `spilled`, `depth()`.

Every row carries `host` (the machine) and `instance` (the daemon, `audit.instance`): a
fleet's daemons may write to one PostgreSQL database, and the readers filter by instance.

Reads (for `kvguard audit` and the admin API) use their own short connections and return plain
dicts, with times as aware UTC datetimes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time as _time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import groupby
from pathlib import Path
from typing import Any, Literal, cast

from sqlalchemy import Select, Table, Text, and_, delete, exists, func, insert, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DataError, DBAPIError, DisconnectionError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from kvguard.daemon import audit_spill
from kvguard.daemon.audit_migrate import (
    BUSY_TIMEOUT_MS,
    current,
    db_errors,
    downgrade,
    head,
    make_engine,
    pg_lock_timeout,
    shown,
    sqlite_path,
    sqlstate,
    upgrade,
)
from kvguard.daemon.audit_models import OUTCOMES, TRIGGERS, Action, Base, Event, Incident

__all__ = ["AuditStore", "current", "downgrade", "new_incident_id", "upgrade"]

log = logging.getLogger(__name__)

BATCH = 256  # rows per transaction: one fsync for a burst of actions
PURGE_CHUNK = 5000  # rows a retention sweep deletes per transaction (see _Sweep)
CHECKPOINT_WAIT_MS = 200  # the longest a sweep's closing checkpoint waits for readers
BACKOFF_START = 0.05  # seconds before the first retry
BACKOFF_MAX = 1.0  # a database that comes back is used again within about a second
START_WAIT_S = 5.0  # how long start() (before READY) waits for the first migration attempt
MIGRATION_WAIT_S = 3.0  # a migration's longest wait for a lock (PostgreSQL), then a retry
WRITE_LOCK_WAIT_S = 3.0  # a write's longest wait for a table lock (PostgreSQL), then a retry
READ_LOCK_WAIT_S = WRITE_LOCK_WAIT_S  # a read's (`kvguard audit`): then an error naming the lock
WRITE_STALL_S = 5.0  # a write not done after this long (a server that hangs): degraded
JOIN_MIN_S = 0.1  # stop() past its deadline still lets a writer that is done exit

STALLED = "a server that does not answer, or a lock held"

OpKind = Literal["actions", "events", "incidents", "incident_update", "purge"]
TABLES: dict[str, Table] = {
    m.__tablename__: Base.metadata.tables[m.__tablename__] for m in (Action, Event, Incident)
}


@dataclass(slots=True, frozen=True)
class _Op:
    kind: OpKind
    row: dict[str, Any]


@dataclass(slots=True)
class ImportResult:
    """What `import_file` did: rows added per table, rows skipped as already present, and
    incident updates and purges applied (again)."""

    added: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    reapplied: int = 0
    unreadable: list[int] = field(default_factory=list)  # line numbers cut short, skipped

    @property
    def total(self) -> int:
        return sum(self.added.values())


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_incident_id(now: datetime | None = None) -> str:
    """Sortable, readable and unique without asking the database: inc-20250131-120102-a3f9c1."""
    return f"inc-{(now or utcnow()).astimezone(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def _aware(t: datetime | None) -> datetime:
    if t is None:
        return utcnow()
    if t.tzinfo is None:
        raise ValueError(f"audit time {t.isoformat()} has no timezone (use an aware datetime)")
    return t.astimezone(UTC)


def _jsonable(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A JSON-safe deep copy: the row records the state at the call, whatever the caller
    mutates later, and an odd value (an enum, a Path) is stored as text instead of failing.

    A float that is not finite (NaN, an infinity) is stored as null on every backend: JSON
    has no such numbers, PostgreSQL refused the whole row for one while SQLite kept it, and
    `kvguard audit --json` prints one as null all the same."""
    if value is None:
        return None
    return json.loads(json.dumps(dict(value), default=str), parse_constant=lambda _: None)


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"audit {name} {value!r} is not one of {', '.join(allowed)}")
    return value


def _new_uid() -> str:
    return uuid.uuid4().hex


def _reason(e: BaseException, url: str) -> str:
    """The first line of why, without the URL prefix `db_errors` puts on its ValueErrors."""
    whole = str(getattr(e, "orig", None) or e).strip()
    text = whole.splitlines()[0] if whole else type(e).__name__
    prefix = f"{shown(url)}: "
    return text[len(prefix) :] if text.startswith(prefix) else text


def _is_transient(e: Exception) -> bool:
    """Retry what the database or connection caused; a row's own fault would fail forever."""
    if isinstance(e, IntegrityError | DataError):
        return False
    return isinstance(e, DBAPIError | DisconnectionError | PoolTimeoutError | OSError)


def _schema_missing(e: Exception) -> bool:
    """A table is not there (the database was deleted, recreated or downgraded): migrate again."""
    if sqlstate(e) in ("42P01", "42S02"):  # PostgreSQL, ODBC/MySQL
        return True
    orig = getattr(e, "orig", None)
    return "no such table" in str(orig or e) or type(orig).__name__ == "UndefinedTable"


def _replayable(e: Exception) -> bool:
    """A refusal that a later import may get past: a NOT NULL, CHECK or foreign key that a newer
    kvguard's migration added (its import fills what this one leaves out). A duplicate key (the
    row is there already) or a value the column cannot hold would be refused again."""
    if not isinstance(e, IntegrityError):
        return False
    code = sqlstate(e)
    if code:
        return code in ("23502", "23503", "23514")  # not_null, foreign_key, check violation
    text = str(e.orig)
    return text.startswith(("NOT NULL constraint", "CHECK constraint", "FOREIGN KEY constraint"))


class AuditStore:
    """Queue-fed writer and reader of the audit database (see the module docstring)."""

    def __init__(
        self,
        url: str,
        host: str | None = None,
        max_queue: int = 10000,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
        spill_dir: Path | None = None,
        instance: str | None = None,
    ) -> None:
        """`spill_dir` (the daemon passes its state directory) is where rows left at stop go
        when the database is not a SQLite file or the file's own directory refuses them.
        `instance` tags every row with the daemon's name (default: `host`), so daemons that
        share a database, even on one host, can be told apart."""
        if max_queue < 1:
            raise ValueError(f"audit max_queue must be at least 1, not {max_queue}")
        self.url = url
        self.host = host or socket.gethostname()
        self.instance = instance or self.host
        self.max_queue = max_queue
        self.busy_timeout_ms = busy_timeout_ms
        self._engine = make_engine(url, busy_timeout_ms)  # a bad URL fails here, at start-up
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._progress = threading.Condition(self._lock)
        self._pending: deque[_Op] = deque()
        self._batch: list[_Op] = []  # taken by the writer, not yet settled (shrinks as they are)
        self._inflight = 0  # rows taken by the writer, not yet committed
        self._purging: _Op | None = None  # a retention sweep under way (see _Sweep)
        self._sweep: _Sweep | None = None
        self._held = 0  # rows written during a sweep, settled with it (flush() counts in order)
        self._accepted = 0  # rows ever queued; FIFO, so flush() waits for _settled to reach it
        self._settled = 0  # rows ever written or refused
        self._stopping = False
        self._abandon = threading.Event()  # stop() gave up waiting: leave the retry loop
        self._thread: threading.Thread | None = None
        self._migrated = False
        self._migrating_since: float | None = None  # monotonic start of the attempt under way
        self._writing_since: float | None = None  # monotonic start of the write under way
        self._stall_logged = False  # that write was logged as not done after WRITE_STALL_S
        self._db_path = sqlite_path(url)
        self._db_file: tuple[int, int] | None = None  # (st_dev, st_ino) of the file migrated
        self._spills_waiting = False  # a spill file's import failed on the database: retry
        self.spill_paths = audit_spill.spill_paths(url, spill_dir)
        self.refused_paths = audit_spill.spill_paths(url, spill_dir, audit_spill.REFUSED_SUFFIX)
        # the files a start imports, in order: an older kvguard's name first (its rows are older)
        self._spills_to_import = [
            *audit_spill.legacy_paths(url, spill_dir),
            *self.spill_paths,
            *audit_spill.legacy_paths(url, spill_dir, audit_spill.REFUSED_SUFFIX),
            *self.refused_paths,
        ]
        self._spill_lock = threading.Lock()  # one spill at a time (a forced exit's stop too)
        self.spill_file: Path | None = None  # where stop() saved unwritten rows, if it had to
        # when this run's store first started: the start's sweep looks at the run before it
        # (`_note_unclean_stop`), whose rows are all older
        self.started_at: datetime | None = None
        self.failures = 0
        self.dropped = 0
        self.rejected = 0
        self.written = 0
        self.spilled = 0
        self.last_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, migrate: bool = True, wait: float = START_WAIT_S) -> None:
        """Start the writer thread, which migrates to head first. Rows recorded before are kept.

        Waits `wait` seconds at most for the first migration attempt. One that fails, or has not
        finished by then (a server that does not answer, a lock held), does not raise or hold
        the caller: the audit store must never stop the daemon from serving. The store is then
        degraded (`problem()`), and the writer goes on migrating (retrying) before its first
        write. `migrate=False` trusts that the database is at head already.
        """
        if self._thread is not None and self._thread.is_alive():
            return
        if self.started_at is None:
            self.started_at = utcnow()
        if not migrate:
            self._migrated = True
        self._announce_spills()
        with self._lock:
            self._stopping = False
        self._abandon.clear()
        first_try = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(first_try,), name="kvguard-audit", daemon=True
        )
        self._thread.start()
        if not first_try.wait(wait):
            log.error(
                "audit degraded: migrating %s has not finished after %gs (a long migration, a "
                "server that does not answer, or a lock held); serving goes on, rows queue (up "
                "to %d) until it is done, and are saved to %s if still queued at exit",
                shown(self.url),
                wait,
                self.max_queue,
                self.spill_paths[0] if self.spill_paths else "the log",
            )

    def problem(self) -> str | None:
        """Why rows are not reaching the database now (one line), or None while they are."""
        err = self.last_error
        writing = self._writing_since  # read once: the writer may end it meanwhile
        stalled = 0.0 if writing is None else _time.monotonic() - writing
        if self._migrated and err is None and stalled < WRITE_STALL_S:
            return None
        what = "cannot write to" if self._migrated else "cannot migrate"
        since = self._migrating_since
        if err is None and since is not None:
            err = (
                f"migration still running after {_time.monotonic() - since:.0f}s (a long "
                "one, a server that does not answer, or a lock held)"
            )
        elif err is None and stalled >= WRITE_STALL_S:
            err = f"a write has not finished after {stalled:.0f}s ({STALLED})"
        return f"{what} {shown(self.url)}: {err or 'not started'}; {self.depth()} rows queued"

    def _try_migrate(self, attempt: int) -> bool:
        self._migrating_since = _time.monotonic()
        try:
            newer = upgrade(
                self.url,
                busy_timeout_ms=self.busy_timeout_ms,
                wait_s=MIGRATION_WAIT_S,
                newer_ok=True,
            )
        except Exception as e:  # noqa: BLE001 - whatever the database says, serving goes on
            self._migrating_since = None
            self.failures += 1
            self.last_error = _reason(e, self.url)
            if attempt == 1 or attempt % 60 == 0:
                log.error(
                    "audit degraded: cannot migrate %s (attempt %d): %s; serving goes on, "
                    "%d rows queued (up to %d) until it can be migrated (retrying), "
                    "saved to %s if still queued at exit",
                    shown(self.url),
                    attempt,
                    self.last_error,
                    self.depth(),
                    self.max_queue,
                    self.spill_paths[0] if self.spill_paths else "the log",
                )
            return False
        self._migrating_since = None
        self._remember_file()
        if newer is not None:
            log.warning(
                "audit: %s is at revision %s, newer than this kvguard knows (its head: %s): "
                "writing to it without migrating; upgrade this daemon (README: upgrade order)",
                shown(self.url),
                newer,
                head(),
            )
        if attempt > 1:
            log.warning("audit: migrated %s after %d failed attempts", shown(self.url), attempt - 1)
        self.last_error = None
        return True

    def _remember_file(self) -> None:
        """Note which file a SQLite database is, to notice it deleted or replaced later."""
        if self._db_path is None:
            return
        try:
            st = os.stat(self._db_path)
        except OSError:
            self._db_file = None
            return
        self._db_file = (st.st_dev, st.st_ino)

    def _replaced(self) -> bool:
        """The SQLite file migrated is gone, or its name is another file's now (deleted by an
        operator or a cleaner, restored from a backup): its connections would write to a
        deleted file, or to one without tables."""
        if self._db_path is None or self._db_file is None:
            return False
        try:
            st = os.stat(self._db_path)
        except FileNotFoundError:
            return True
        except OSError:  # cannot tell (a directory made unreadable): the write will say
            return False
        return (st.st_dev, st.st_ino) != self._db_file

    def _migrate_until_done(self) -> bool:
        """The writer's retry of a migration start() could not do; False if stopped first."""
        delay = BACKOFF_START
        attempt = 1
        while not self._migrated:
            if self._abandon.wait(delay) or (self._stopping and not self.depth()):
                return False
            attempt += 1
            self._migrated = self._try_migrate(attempt)
            delay = min(delay * 2, BACKOFF_MAX)
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every row queued before the call is written; False after `timeout`.

        Rows queued meanwhile by other threads are not waited for: a busy daemon still flushes.
        """
        deadline = _time.monotonic() + timeout
        with self._lock:
            target = self._accepted
            while self._settled < target:
                remaining = deadline - _time.monotonic()
                if remaining <= 0:
                    return False
                self._progress.wait(remaining)
            return True

    def stop(self, timeout: float = 10.0) -> bool:
        """Flush, then end the writer. False (and an error log) if rows were left unwritten.

        The writer is a daemon thread: when the database never comes back, the process can
        still exit after `timeout`. The unwritten rows then go to a spill file (see the module
        docstring); only if no spill file can be written either are they lost, and then each
        is logged as an `audit row:` line so that even a full disk leaves them in the journal.
        """
        deadline = _time.monotonic() + timeout  # for the whole stop, spill excepted
        ok = self.flush(timeout)
        with self._lock:
            self._stopping = True
            self._has_work.notify_all()
            left = self._depth()
        if not ok:
            self._abandon.set()
            log.error(
                "audit: stopping with %d rows not written to %s (%s)",
                left,
                shown(self.url),
                self.last_error or "too slow",
            )
        # What is left of the deadline, no more: a writer stuck in a commit or a migration (a
        # server that does not answer) is left behind, a daemon thread, and what it holds is
        # spilled now. It may yet commit rows the spill also holds: an import skips those.
        self._join(max(deadline - _time.monotonic(), JOIN_MIN_S))
        if self.depth():  # unwritten however it came to be (also rows recorded during stop)
            self._abandon.set()
            self._spill()
            ok = False
        if self._thread is None:
            self._engine.dispose()
        if self.dropped:
            log.error(
                "audit: %d rows were dropped during this run because the queue was full "
                "(%d rows; see kvguard_audit_dropped_total)",
                self.dropped,
                self.max_queue,
            )
        return ok

    def _join(self, timeout: float) -> None:
        thread = self._thread  # read once: a second stop() (the forced exit's) may clear it
        if thread is None:
            return
        thread.join(timeout=timeout)
        if not thread.is_alive():
            self._thread = None

    def _spill(self) -> None:
        """Save what is still queued to the spill file (appending), or at worst to the log."""
        with self._spill_lock:
            with self._lock:
                queued = list(self._pending)
                purging = [self._purging] if self._purging is not None else []
                ops = [*purging, *self._batch, *queued]
            if not ops:
                return
            self._save(ops, self.last_error, "unwritten")
            with self._lock:  # saved (or logged): no longer queued; rows queued since stay
                saved = {id(op) for op in queued}  # (a writer still running may have taken
                left = [op for op in self._pending if id(op) not in saved]  # some meanwhile)
                self._settled += len(self._pending) - len(left)
                self._pending = deque(left)
                if self._thread is None:
                    self._settled += self._inflight + self._held
                    self._batch, self._inflight, self._held = [], 0, 0
                    self._purging = self._sweep = None
                self._progress.notify_all()

    def _save(self, ops: list[_Op], reason: str | None, what: str) -> Path | None:
        """Append `ops` to the spill file (rows the database `refused`: to a file of their own,
        whose import may fail until an upgrade), or at worst log each as an `audit row:` line."""
        lines = [audit_spill.encode(op.kind, op.row) for op in ops]
        header = audit_spill.encode_header(shown(self.url), self.host, len(ops), reason)
        paths = self.refused_paths if what == "refused" else self.spill_paths
        path, errors = audit_spill.append(paths, [header, *lines])
        if path is not None:
            self.spilled += len(ops)
            self.spill_file = path
            log.error(
                "audit: saved %d %s rows to %s%s; load them with `kvguard audit import %s` "
                "(the daemon also does at its next start, once %s takes writes)",
                len(ops),
                what,
                path,
                f" (could not use {'; '.join(errors)})" if errors else "",
                path,
                shown(self.url),
            )
            return path
        log.error(
            "audit: %d %s rows could not be saved to a spill file (%s); they follow as "
            "'audit row:' lines: collect them into a file for `kvguard audit import`",
            len(ops),
            what,
            "; ".join(errors) or "no spill location",
        )
        for line in lines:
            log.error("audit row: %s", line)
        return None

    def _announce_spills(self) -> None:
        for path in self._pending_spills():
            # one of another database is not imported: the import says so when it skips it
            if _nonempty(path) and not audit_spill.spilled_elsewhere(
                audit_spill.headers(path), self.url
            ):
                log.warning(
                    "audit: %s holds %d rows an earlier run could not write; they are imported "
                    "once %s takes writes (or run `kvguard audit import %s`)",
                    path,
                    audit_spill.count_lines(path),
                    shown(self.url),
                    path,
                )

    def depth(self) -> int:
        """Rows queued or being written."""
        with self._lock:
            return self._depth()

    def _depth(self) -> int:
        return len(self._pending) + self._inflight

    # -- recording (any thread, never blocks on the database) ---------------------------------
    def record_action(
        self,
        *,
        action: str,
        outcome: str,
        rule: str | None = None,
        trigger: str = "signal",
        signal: str | None = None,
        value: float | None = None,
        threshold: float | None = None,
        params: Mapping[str, Any] | None = None,
        state_before: Mapping[str, Any] | None = None,
        state_after: Mapping[str, Any] | None = None,
        error: str | None = None,
        incident: str | None = None,
        is_undo: bool = False,
        detail: str = "",
        time: datetime | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue one remedy. `time` defaults to now: the decision's time, not the write's.
        `data`: the action result's (`ActionResult.data`, e.g. the requests an eviction
        preempted), which the settings before and after do not show; empty is stored as none.

        A bad trigger or outcome is a caller's bug and raises ValueError at once, here, rather
        than becoming a row the database refuses later.
        """
        row = {
            "time": _aware(time),
            "host": self.host,
            "instance": self.instance,
            "rule": rule,
            "action": action,
            "trigger": _one_of("trigger", trigger, TRIGGERS),
            "signal": signal,
            "value": _float(value),
            "threshold": _float(threshold),
            "params": _jsonable(params) or {},
            "state_before": _jsonable(state_before),
            "state_after": _jsonable(state_after),
            "outcome": _one_of("outcome", outcome, OUTCOMES),
            "error": error,
            "incident": incident,
            "is_undo": bool(is_undo),
            "detail": detail,
            "uid": _new_uid(),
            "data": _jsonable(data) or None,
        }
        self._enqueue(_Op("actions", row))

    def record_event(
        self,
        kind: str,
        detail: str = "",
        data: Mapping[str, Any] | None = None,
        incident: str | None = None,
        time: datetime | None = None,
    ) -> None:
        """Queue one daemon event (daemon_start, reload, engine_oom, alert_received, ...)."""
        row = {
            "time": _aware(time),
            "host": self.host,
            "instance": self.instance,
            "kind": kind,
            "detail": detail,
            "data": _jsonable(data),
            "incident": incident,
            "uid": _new_uid(),
        }
        self._enqueue(_Op("events", row))

    def open_incident(self, level: int, summary: str, time: datetime | None = None) -> str:
        """Start an incident and return its id at once; the row is written like any other."""
        opened = _aware(time)
        incident_id = new_incident_id(opened)
        row = {
            "id": incident_id,
            "opened_at": opened,
            "closed_at": None,
            "peak_level": int(level),
            "actions_count": 0,
            "host": self.host,
            "instance": self.instance,
            "summary": summary,
        }
        self._enqueue(_Op("incidents", row))
        return incident_id

    def update_incident(
        self,
        incident_id: str,
        peak_level: int | None = None,
        actions_count: int | None = None,
        closed_at: datetime | None = None,
        summary: str | None = None,
    ) -> None:
        """Queue new values for an incident; writes are in call order, so this follows its open."""
        values: dict[str, Any] = {}
        if summary is not None:
            values["summary"] = summary
        if peak_level is not None:
            values["peak_level"] = int(peak_level)
        if actions_count is not None:
            values["actions_count"] = int(actions_count)
        if closed_at is not None:
            values["closed_at"] = _aware(closed_at)
        if values:
            self._enqueue(_Op("incident_update", {"id": incident_id, **values}))

    def purge_older_than(self, days: float, close_stale: bool = False) -> None:
        """Queue the retention sweep (`audit.retention`): it runs on the writer, in order.

        `close_stale` (the daemon's sweep at start) first closes the incidents of this
        instance opened before now and never closed: an earlier run's, killed before its
        orderly stop could close them (see `_close_stale`). Else they would stay open, and
        be kept by every later sweep, forever. It also records an `unclean_stop` event where
        the run before this one has no `daemon_stop` (`_note_unclean_stop`)."""
        now = utcnow()
        row: dict[str, Any] = {"before": now - timedelta(days=days)}
        if close_stale:
            row |= {"stale_of": self.instance, "stale_before": now, "host": self.host}
            row["run_since"] = self.started_at or now
        self._enqueue(_Op("purge", row))

    def _enqueue(self, op: _Op) -> None:
        """Queue `op`; on a full queue drop a row: the newest queued event, to make room for
        anything else (an action, an incident's open or close, a sweep), else `op` itself.
        What the remedies did is what an operator reads an incident's timeline for: a storm
        of events (thousands of OOM rows while the database was down) must not push it out."""
        with self._lock:
            full = self._depth() >= self.max_queue
            if full and (op.kind == "events" or not self._drop_newest_event()):
                self.dropped += 1  # `op` itself
            else:
                self._pending.append(op)
                self._accepted += 1
                self._has_work.notify()
                if not full:
                    return
                self.dropped += 1  # the event dropped for it
            dropped = self.dropped
        if dropped & (dropped - 1) == 0:  # 1, 2, 4, 8...: loud, but not a log flood
            log.error(
                "audit queue full (%d rows, %s not accepting writes: %s): dropped %d rows so "
                "far (events first: actions and incidents are kept while events are queued)",
                self.max_queue,
                shown(self.url),
                self.last_error or "too slow",
                dropped,
            )

    def _drop_newest_event(self) -> bool:
        """Take the newest queued event off the queue, settled (under the lock); False where
        none is queued (the batch the writer has taken is not touched)."""
        for i in range(len(self._pending) - 1, -1, -1):
            if self._pending[i].kind == "events":
                del self._pending[i]
                # flush() waits for it no more: settled as a written row is (`_done`)
                if self._purging is not None:
                    self._held += 1
                else:
                    self._settled += 1
                self._progress.notify_all()
                return True
        return False

    # -- the writer thread ---------------------------------------------------------------------
    def _run(self, first_try: threading.Event) -> None:
        try:
            if not self._migrated:
                self._migrated = self._try_migrate(1)
            else:
                self._remember_file()
        finally:
            first_try.set()  # start() returns
        if not self._migrated and not self._migrate_until_done():
            return
        self._import_spills()
        while batch := self._take():
            try:
                self._write_until_done(batch)
            except Exception:  # a bug here must not end auditing for the rest of the run
                self._unexpected(batch)
            if self._abandon.is_set():
                return
            if self._spills_waiting and self.last_error is None:
                self._import_spills(again=True)

    def _unexpected(self, batch: list[_Op]) -> None:
        """Settle, count and save the rows of a batch the writer failed on by a bug."""
        if batch and batch[0] is self._purging:
            left = [batch[0]]
            self._purge_settled(batch, written=False)
        else:
            left = list(batch)
            self._done(len(left), written=False)
        log.exception("audit writer: unexpected error; %d rows not written", len(left))
        self.rejected += len(left)
        self._save(left, "unexpected error in the audit writer", "unwritten")

    def _take(self) -> list[_Op]:
        with self._lock:
            while not self._pending and not self._stopping:
                self._has_work.wait()
            if self._abandon.is_set():  # stop() gave up on this writer and spills the queue
                return []
            sweep = bool(self._pending) and self._pending[0].kind == "purge"
            n = 1 if sweep else self._ordinary()  # a sweep is a batch of its own (_write_purge)
            self._batch = [self._pending.popleft() for _ in range(n)]
            self._inflight += n
            return self._batch

    def _ordinary(self) -> int:
        """How many queued rows, up to BATCH, come before the next purge (under the lock)."""
        n = 0
        while n < min(BATCH, len(self._pending)) and self._pending[n].kind != "purge":
            n += 1
        return n

    def _take_between(self) -> list[_Op]:
        """Rows queued behind a sweep under way, up to BATCH: written between its chunks."""
        with self._lock:
            if self._abandon.is_set():
                return []
            n = self._ordinary()
            self._batch = [self._pending.popleft() for _ in range(n)]
            self._inflight += n
            return self._batch

    def _write_until_done(self, batch: list[_Op]) -> None:
        delay = BACKOFF_START
        attempts = 0  # failed writes and migrations
        migrations = 0
        while batch:
            if self._abandon.is_set():  # a sweep's chunks end here (stop() spills it)
                return
            if self._migrated and self._replaced():
                log.warning(
                    "audit: %s was deleted or replaced while the daemon ran: migrating it again "
                    "before writing (%d rows waiting)",
                    self._db_path,
                    self.depth(),
                )
                self._migrated = False
            if not self._migrated:
                # Close the old file's connections first: the last one to close also removes a
                # deleted database's -wal and -shm, which a new file of that name would misread.
                self._engine.dispose()
                migrations += 1
                self._migrated = self._try_migrate(migrations)
                if not self._migrated:
                    attempts += 1
                    if self._abandon.wait(delay):
                        return
                    delay = min(delay * 2, BACKOFF_MAX)
                    continue
            try:
                self._write(batch)
            except Exception as e:
                if not _is_transient(e):
                    raise
                attempts += 1
                self._failed(e, attempts)
                if _schema_missing(e):  # tables gone (a database recreated, or deleted)
                    if attempts == 1 or attempts % 60 == 0:
                        log.warning("audit: %s has lost tables: migrating again", shown(self.url))
                    self._migrated = False
                self._engine.dispose()  # reconnect: a connection may have opened read-only
                if self._abandon.wait(delay):
                    return
                delay = min(delay * 2, BACKOFF_MAX)
        if attempts:
            log.warning("audit: writes to %s resumed after %d failures", shown(self.url), attempts)
            self.last_error = None

    def _write(self, batch: list[_Op]) -> None:
        """Write the batch in one transaction; on a row's own fault, row by row."""
        if batch[0].kind == "purge":  # alone in its batch (_take)
            self._write_purge(batch)
            return
        try:
            self._commit(batch)
        except Exception as e:
            if _is_transient(e):
                raise
            self.failures += 1
            self._write_singly(batch)
            return
        self._done(len(batch))

    def _write_singly(self, batch: list[_Op]) -> None:
        kept: list[_Op] = []  # refused rows a later import may write: spilled
        try:
            while batch:  # a row leaves the batch once settled (_done): a retry never repeats it
                written = self._commit_or_reject(batch[0], kept)
                self._done(1, written)
        finally:
            if kept:
                self._save(kept, f"refused by {shown(self.url)}", "refused")

    def _commit_or_reject(self, op: _Op, kept: list[_Op]) -> bool:
        """True if written, False if the database refused this row (then in `kept` if a later
        import may write it: see `_replayable`)."""
        try:
            self._commit([op])
            return True
        except Exception as e:
            if _is_transient(e):
                raise
            self._refused(op, e, kept)
            return False

    def _refused(self, op: _Op, e: Exception, kept: list[_Op]) -> None:
        """Count and log a row the database refused for its own sake (`kept` if a later
        import may write it)."""
        self.failures += 1
        self.rejected += 1
        if _replayable(e):
            kept.append(op)
            log.error(
                "audit: %s refused a row (%s): kept in the refused rows' file, for an import once "
                "this kvguard is upgraded (a newer one changed the schema?): %r",
                shown(self.url),
                _reason(e, self.url),
                op,
            )
        else:
            log.error(
                "audit: %s refused a row, which would be refused again: skipped, counted "
                "in rejected (%d so far): %s: %r",
                shown(self.url),
                self.rejected,
                _reason(e, self.url),
                op,
            )

    def _write_purge(self, batch: list[_Op]) -> None:
        """One transaction of the retention sweep `batch[0]`, then the rows queued behind it
        (a batch at most): a big backlog's sweep neither holds the writer nor needs WAL (or
        disk) for the whole backlog at once. A transient failure raises, and the retry goes
        on from the last chunk committed. The sweep is settled (flush() returns) after its
        last chunk, with the rows written meanwhile."""
        op = batch[0]
        if self._purging is not op:
            with self._lock:
                self._purging, self._sweep = op, _Sweep(op.row)
                self._batch = []  # the sweep is in _purging now (and still in _inflight)
        sweep = self._sweep
        assert sweep is not None
        try:
            with self._writing():
                finished = sweep.step(self._engine)
        except Exception as e:
            if _is_transient(e):
                raise
            kept: list[_Op] = []
            self._refused(op, e, kept)
            self._purge_settled(batch, written=False)
            if kept:
                self._save(kept, f"refused by {shown(self.url)}", "refused")
            return
        if finished:
            sweep.report()
            if any(sweep.deleted.values()):
                self._checkpoint()
            self._purge_settled(batch, written=True)
            return
        between = self._take_between()
        if between:
            try:
                self._write_until_done(between)
            except Exception:  # as in _run: a bug must not end auditing
                self._unexpected(between)

    def _checkpoint(self) -> None:
        """Give a SQLite WAL back to the disk after a sweep (TRUNCATE). A reader holding an
        old snapshot (an export under way) would make it wait: it waits CHECKPOINT_WAIT_MS
        at most, and then the WAL is cut back at a later checkpoint (journal_size_limit)."""
        if self._db_path is None:
            return
        try:
            with self._engine.connect() as conn:
                conn.exec_driver_sql(f"PRAGMA busy_timeout = {CHECKPOINT_WAIT_MS}")
                try:
                    conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").all()
                finally:
                    conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
        except Exception as e:  # noqa: BLE001 - the sweep is done; this only frees disk
            log.debug("audit: checkpoint after the retention sweep failed: %s", e)

    def _purge_settled(self, batch: list[_Op], written: bool) -> None:
        with self._lock:
            self._purging = self._sweep = None
            self._inflight -= 1
            self._settled += 1 + self._held
            self._held = 0
            self.written += 1 if written else 0
            batch.clear()
            self._progress.notify_all()

    def _commit(self, ops: list[_Op]) -> None:
        with self._writing(), self._engine.begin() as conn:
            pg_lock_timeout(conn, WRITE_LOCK_WAIT_S)
            _apply(conn, ops)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Mark a write under way, for `problem()`. One not done after WRITE_STALL_S is logged
        once, by a timer: the writer is the thread stuck in it."""
        started = _time.monotonic()
        with self._lock:
            self._writing_since, self._stall_logged = started, False
        timer = threading.Timer(WRITE_STALL_S, self._stalled, args=(started,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            with self._lock:
                since, logged = self._writing_since, self._stall_logged
                self._writing_since, self._stall_logged = None, False
            if logged and since is not None:
                log.warning(
                    "audit: a write to %s finished after %.0fs",
                    shown(self.url),
                    _time.monotonic() - since,
                )

    def _stalled(self, started: float) -> None:
        with self._lock:
            if self._writing_since != started:  # done meanwhile
                return
            self._stall_logged = True
            depth = self._depth()
        log.warning(
            "audit degraded: a write to %s has not finished after %gs (%s); serving goes on, "
            "%d rows queued (up to %d) until it does, saved to %s if still queued at exit",
            shown(self.url),
            WRITE_STALL_S,
            STALLED,
            depth,
            self.max_queue,
            self.spill_paths[0] if self.spill_paths else "the log",
        )

    def _done(self, n: int, written: bool = True) -> None:
        """Settle the first `n` rows of the batch (under the lock: stop() may be reading it)."""
        with self._lock:
            del self._batch[:n]
            self._inflight -= n
            if self._purging is not None:  # rows behind a sweep under way: settled with it
                self._held += n
            else:
                self._settled += n
            self.written += n if written else 0
            if written:  # before flush() returns: a caller then sees the store healthy
                self.last_error = None
            self._progress.notify_all()

    def _failed(self, e: Exception, attempts: int) -> None:
        self.failures += 1
        self.last_error = str(getattr(e, "orig", None) or e).splitlines()[0]
        if sqlstate(e) == "55P03":  # lock_not_available: pg_lock_timeout's bound reached
            self.last_error = (
                f"a write waited over {WRITE_LOCK_WAIT_S:g}s for a table lock that another "
                "session holds (an open transaction? see pg_stat_activity); retrying"
            )
        if attempts == 1 or attempts % 60 == 0:  # about once a minute during an outage
            log.warning(
                "audit degraded: cannot write to %s (attempt %d, %d rows waiting, retrying): %s",
                shown(self.url),
                attempts,
                self.depth(),
                self.last_error,
            )

    # -- spill files ---------------------------------------------------------------------------
    def import_file(self, path: Path, lock_wait_s: float | None = None) -> ImportResult:
        """Load a spill file in one transaction, skipping rows already in the database.

        Actions and events are matched by `uid`, incidents by id; incident updates and purges
        are applied again, which changes nothing the second time (an update sets the totals
        the evaluator had then, and no later run touches an incident of an earlier one).
        `lock_wait_s` (the writer's) bounds each wait for a table lock on PostgreSQL; an
        operator's `kvguard audit import` waits as long as it takes.
        """
        spill = audit_spill.read(path)
        ops = [_Op(cast(OpKind, kind), _tagged(kind, row)) for kind, row in spill.ops]
        with db_errors(self.url), self._engine.begin() as conn:
            pg_lock_timeout(conn, lock_wait_s)
            fresh, skipped = _absent(conn, ops)
            _apply(conn, fresh)
        result = ImportResult(skipped=skipped, unreadable=spill.unreadable)
        for op in fresh:
            if op.kind in TABLES:
                result.added[op.kind] = result.added.get(op.kind, 0) + 1
            else:
                result.reapplied += 1
        return result

    def _import_spills(self, again: bool = False) -> None:
        """Load spill files of earlier runs now that the database takes writes.

        The database may be migrated and still refuse writes (a read-only file at head): then
        the import is tried once more after the first batch that lands. A file that still
        cannot be loaded, or cannot be read at all, is left for `kvguard audit import`; so is
        one whose header names another database (daemons sharing a state directory).
        """
        self._spills_waiting = False
        for path in self._pending_spills():  # each file its own transaction
            if not path.is_file():
                continue
            try:
                spill = audit_spill.read(path)
            except ValueError as e:
                log.error("audit: cannot import %s: %s", path, e)
                continue
            others = audit_spill.spilled_elsewhere(spill.headers, self.url)
            if others:  # another daemon's, sharing this state directory: never load it here
                log.warning(
                    "audit: not importing %s: it holds rows spilled from %s, not %s (another "
                    "daemon's, sharing this directory?); left as it is: load it into its own "
                    "database with `kvguard audit import --db URL %s`",
                    path,
                    ", ".join(others),
                    shown(self.url),
                    path,
                )
                continue
            with audit_spill.claimed(path) as claim:
                if claim is None:  # another import (a daemon sharing this directory) has it
                    continue
                if not _nonempty(claim):  # an older kvguard's spill that failed: holds nothing
                    _remove_empty(claim)
                    continue
                try:
                    # not under the stall timer: a spill of 150k rows takes its seconds on a
                    # healthy database (one transaction), which reported it degraded; its lock
                    # waits are bounded
                    res = self.import_file(claim, WRITE_LOCK_WAIT_S)
                    done = audit_spill.mark_imported(claim)
                except Exception as e:  # noqa: BLE001 - a failed import must not end the writer
                    self._import_failed(audit_spill.unclaim(claim), e, again)
                    continue
            log.warning(
                "audit: imported %d rows from %s into %s (%d already there%s); the file is now "
                "%s and can be deleted",
                res.total,
                path,
                shown(self.url),
                res.skipped,
                f"; skipped unreadable lines {res.unreadable}" if res.unreadable else "",
                done,
            )

    def _pending_spills(self) -> list[Path]:
        """The files a start imports: each spill file after the claims an import that died
        left of it (older rows first)."""
        return [p for path in self._spills_to_import for p in (*audit_spill.leftovers(path), path)]

    def _import_failed(self, path: Path, e: Exception, again: bool) -> None:
        self._spills_waiting = not again
        log.error(
            "audit: could not import %s: %s; %s",
            path,
            e,
            "trying again once rows land"
            if not again
            else f"run `kvguard audit import {path}` once fixed",
        )

    # -- reading -------------------------------------------------------------------------------
    def list_actions(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        rule: str | None = None,
        action: str | None = None,
        outcome: str | None = None,
        incident: str | None = None,
        limit: int | None = 100,
        instance: str | None = None,
        request: str | None = None,
    ) -> list[dict[str, Any]]:
        """The newest `limit` matching actions, oldest first (read like a log); with `request`,
        those whose data names it (`names_request`: an eviction that preempted it)."""
        t = TABLES["actions"]
        q = _window(select(t), t.c.time, since, until)
        filters = (("rule", rule), ("action", action), ("outcome", outcome), ("instance", instance))
        for col, want in filters:
            if want is not None:
                q = q.where(t.c[col] == want)
        if incident is not None:
            q = q.where(t.c.incident == incident)
        return self._newest(q, t, t.c.time, limit, request)

    def export(
        self,
        table: str,
        since: datetime | None = None,
        until: datetime | None = None,
        instance: str | None = None,
        chunk: int = 1000,
    ) -> Iterator[dict[str, Any]]:
        """Every row of `table` that `list_<table>(since, until, instance, limit=None)` would
        return, in its order (oldest first), fetched `chunk` rows at a time: an export of a
        whole table never holds it in memory (`kvguard audit export`)."""
        t = TABLES[table]
        if table == "incidents":
            q, col = _open_between(select(t), since, until), t.c.opened_at
        else:
            q, col = _window(select(t), t.c.time, since, until), t.c.time
        if instance is not None:
            q = q.where(t.c.instance == instance)
        q = q.order_by(col.asc(), t.c.id.asc())
        with self._reading() as conn:
            for r in conn.execution_options(yield_per=chunk).execute(q):
                yield dict(r._mapping)

    def list_events(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        kind: str | None = None,
        incident: str | None = None,
        limit: int | None = 100,
        instance: str | None = None,
        request: str | None = None,
    ) -> list[dict[str, Any]]:
        """The newest `limit` matching events, oldest first; with `request`, those whose data
        names it (`names_request`: an `engine_oom` that requeued it)."""
        t = TABLES["events"]
        q = _window(select(t), t.c.time, since, until)
        if kind is not None:
            q = q.where(t.c.kind == kind)
        if instance is not None:
            q = q.where(t.c.instance == instance)
        if incident is not None:
            q = q.where(t.c.incident == incident)
        return self._newest(q, t, t.c.time, limit, request)

    def list_incidents(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        open_only: bool = False,
        limit: int | None = 100,
        instance: str | None = None,
    ) -> list[dict[str, Any]]:
        """The newest `limit` incidents open at some time in the window (opened before its
        end, and still open or closed after its start), oldest first by opening."""
        t = TABLES["incidents"]
        q = _open_between(select(t), since, until)
        if open_only:
            q = q.where(t.c.closed_at.is_(None))
        if instance is not None:
            q = q.where(t.c.instance == instance)
        return self._newest(q, t, t.c.opened_at, limit)

    def get_action(self, action_id: int) -> dict[str, Any] | None:
        t = TABLES["actions"]
        rows = self._rows(select(t).where(t.c.id == action_id))
        return rows[0] if rows else None

    def get_incident(self, incident_id: str) -> dict[str, Any] | None:
        t = TABLES["incidents"]
        rows = self._rows(select(t).where(t.c.id == incident_id))
        return rows[0] if rows else None

    def timeline(self, incident_id: str) -> list[dict[str, Any]]:
        """The incident's actions and events merged in time order, each with `type`."""
        acts = self.list_actions(incident=incident_id, limit=None)
        return in_time_order(acts, self.list_events(incident=incident_id, limit=None))

    def _newest(
        self,
        q: Select[Any],
        t: Table,
        time_col: Any,
        limit: int | None,
        request: str | None = None,
    ) -> list[dict[str, Any]]:
        q = q.order_by(time_col.desc(), t.c.id.desc())
        if request is not None:
            return self._naming(q.where(_may_name(t, request)), request, limit)
        if limit is not None:
            q = q.limit(limit)
        return self._rows(q)[::-1]

    def _naming(self, q: Select[Any], request: str, limit: int | None) -> list[dict[str, Any]]:
        """The first `limit` rows of `q` (newest first) whose data names `request`, oldest
        first. SQL has narrowed them to those whose JSON text holds the id (`_may_name`); which
        of those name it as a request, not inside a longer id, is told here, in Python, the
        same on every backend (SQLite's and PostgreSQL's JSON functions differ). The rows
        holding request ids are the few that preempted or requeued requests, so fetching
        them is cheap; they are streamed, and the fetch ends at `limit`."""
        out: list[dict[str, Any]] = []
        with self._reading() as conn:
            for r in conn.execution_options(yield_per=500).execute(q):
                row = dict(r._mapping)
                if names_request(row["data"], request):
                    out.append(row)
                    if limit is not None and len(out) >= limit:
                        break
        return out[::-1]

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Connection]:
        """A connection for `kvguard audit`'s reads. On PostgreSQL its waits for a table lock
        are bounded as the writer's are: an analyst's open transaction, a VACUUM FULL or a
        CREATE INDEX holding a table would otherwise hang the operator's terminal without a
        word, just when a lock is what the operator is looking into."""
        with db_errors(self.url):
            try:
                with self._engine.connect() as conn:
                    pg_lock_timeout(conn, READ_LOCK_WAIT_S)
                    yield conn
            except DBAPIError as e:
                if sqlstate(e) != "55P03":  # lock_not_available: pg_lock_timeout's bound
                    raise
                raise ValueError(
                    f"{shown(self.url)}: the audit table is locked by another session (a read "
                    f"waited over {READ_LOCK_WAIT_S:g}s for a table lock that another session "
                    "holds: an open transaction? see pg_stat_activity); try again once it is "
                    "released"
                ) from None

    def _rows(self, q: Select[Any]) -> list[dict[str, Any]]:
        with self._reading() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]


def in_time_order(
    actions: list[dict[str, Any]], events: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Actions and events merged in time order, each with `type`. An event that caused an
    action shares its timestamp at most: it comes first."""
    rows = [{"type": "action", **r} for r in actions] + [{"type": "event", **r} for r in events]
    return sorted(rows, key=lambda r: (r["time"], r["type"] == "action", r["id"]))


def names_request(data: Any, request: str) -> bool:
    """Whether a row's `data` names the request `request` anywhere in it (an eviction's
    `evicted`, an `engine_oom`'s `requeued`, a pool resize's `preempted`): a request id
    (`cmpl-...-0`) itself, or a response id, whose requests are named by it, `-` and a
    choice's index.
    Not a longer id that merely begins with it (`cmpl-ab` names neither `cmpl-abc-0` nor,
    for `cmpl-abc-1`, `cmpl-abc-10`)."""
    return any(_is_request(s, request) for s in _strings(data))


def _is_request(text: str, request: str) -> bool:
    """`text` is `request`, or `request`, `-`, a choice's index."""
    if text == request:
        return True
    index = text[len(request) + 1 :]
    return text.startswith(f"{request}-") and index.isascii() and index.isdigit()


def _strings(value: Any) -> Iterator[str]:
    """Every string among the values of a JSON document (not its keys)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _may_name(t: Table, request: str) -> Any:
    """Rows whose JSON `data`, as text, holds `request` as the JSON writer spells it (both
    backends store what `json.dumps` wrote): SQL both take, narrowing the rows `_naming`
    fetches to those that may name it."""
    spelled = json.dumps(request)[1:-1]
    return t.c.data.is_not(None) & t.c.data.cast(Text).contains(spelled, autoescape=True)


def _remove_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
        log.info("audit: removed %s, an empty spill file", path)


def _nonempty(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def _tagged(kind: str, row: dict[str, Any]) -> dict[str, Any]:
    """A spilled row as it goes in now: one spilled before revision 0003 has no `instance`,
    and its writer was then the only daemon of its database, so its host names it. An action
    spilled before revision 0006 has no `data`: none, given explicitly, because the rows of
    one insert must all name the same columns."""
    if kind == "actions" and "data" not in row:
        row = {**row, "data": None}
    if kind in TABLES and not row.get("instance"):
        return {**row, "instance": row.get("host") or "-"}
    return row


def _float(v: float | None) -> float | None:
    return None if v is None else float(v)


def _open_between(q: Select[Any], since: datetime | None, until: datetime | None) -> Select:
    """Incidents open at some time in the window: opened before its end, and still open or
    closed after its start."""
    t = TABLES["incidents"]
    if since is not None:
        q = q.where(or_(t.c.closed_at.is_(None), t.c.closed_at >= _aware(since)))
    if until is not None:
        q = q.where(t.c.opened_at <= _aware(until))
    return q


def _window(q: Select[Any], col: Any, since: datetime | None, until: datetime | None) -> Select:
    if since is not None:
        q = q.where(col >= _aware(since))
    if until is not None:
        q = q.where(col <= _aware(until))
    return q


_KEYS = {"actions": "uid", "events": "uid", "incidents": "id"}  # what identifies an insert


def _absent(conn: Connection, ops: list[_Op]) -> tuple[list[_Op], int]:
    """The ops minus inserts whose row is already in the database (or earlier in `ops`)."""
    present: dict[str, set[str]] = {}
    for kind, col in _KEYS.items():
        keys = [op.row[col] for op in ops if op.kind == kind and op.row.get(col)]
        t, found = TABLES[kind], set()
        for i in range(0, len(keys), 500):  # stay under every backend's bound-parameter limit
            found.update(conn.scalars(select(t.c[col]).where(t.c[col].in_(keys[i : i + 500]))))
        present[kind] = found
    fresh: list[_Op] = []
    skipped = 0
    for op in ops:
        col = _KEYS.get(op.kind)
        key = op.row.get(col) if col else None
        if key is not None:
            if key in present[op.kind]:
                skipped += 1
                continue
            present[op.kind].add(key)
        fresh.append(op)
    return fresh, skipped


def _apply(conn: Connection, ops: list[_Op]) -> None:
    """Run ops in order; consecutive inserts into one table go as one executemany."""
    for kind, group in groupby(ops, key=lambda op: op.kind):
        rows = [op.row for op in group]
        if kind == "purge":
            for r in rows:
                if r.get("stale_of"):
                    _close_stale(conn, r)
                _purge(conn, r["before"])
        elif kind == "incident_update":
            t = TABLES["incidents"]
            for r in rows:
                values = {k: v for k, v in r.items() if k != "id"}
                conn.execute(update(t).where(t.c.id == r["id"]).values(values))
        else:
            conn.execute(insert(TABLES[kind]), [_no_nul(r) for r in rows])


def _no_nul(row: dict[str, Any]) -> dict[str, Any]:
    """PostgreSQL's text columns refuse a NUL character (SQLite keeps it): in free text (an
    action's detail, an engine's error) it becomes U+FFFD rather than cost the whole row.
    JSON columns keep it, escaped (\\u0000), as PostgreSQL's json type does."""
    if not any(isinstance(v, str) and "\x00" in v for v in row.values()):
        return row
    return {k: v.replace("\x00", "\ufffd") if isinstance(v, str) else v for k, v in row.items()}


def _close_stale(conn: Connection, r: dict[str, Any]) -> None:
    """Close the incidents of instance `stale_of` opened before `stale_before` and still open.

    The evaluator closes its incident when the daemon stops in order; one killed (SIGKILL, the
    OOM killer, a watchdog's abort, a power cut) leaves it open, and its next start queues this
    (`purge_older_than(close_stale=True)`). Each is closed at the time of its last row, the
    last the log knows of that run's pressure (its opening if it has none), and gets an
    `incident_closed` event saying how: the incidents table has no column for that.
    """
    before = _when(r["stale_before"])
    t, acts, evs = TABLES["incidents"], TABLES["actions"], TABLES["events"]
    stale = conn.execute(
        select(t.c.id, t.c.opened_at).where(
            t.c.instance == r["stale_of"], t.c.closed_at.is_(None), t.c.opened_at < _aware(before)
        )
    ).all()
    now = utcnow()
    closed_here: list[tuple[str, datetime]] = []
    for incident, opened in stale:
        closed_here.append((incident, opened))
        lasts = [
            conn.scalar(select(func.max(x.c.time)).where(x.c.incident == incident))
            for x in (acts, evs)
        ]
        closed = max([opened, *(x for x in lasts if x is not None)])
        conn.execute(update(t).where(t.c.id == incident).values(closed_at=closed))
        conn.execute(
            insert(evs),
            [
                {
                    "time": now,
                    "host": r.get("host") or "-",
                    "instance": r["stale_of"],
                    "kind": "incident_closed",
                    "detail": "closed at a later start: the run that opened it ended without "
                    "closing it (killed or crashed); closed at its last row",
                    "data": {"closed_at": closed.isoformat(), "closed_by": "start"},
                    "incident": incident,
                    "uid": _new_uid(),
                }
            ],
        )
        log.warning(
            "audit: incident %s of %s was left open by an earlier run (killed before its "
            "orderly stop?): closed at %s, its last row",
            incident,
            r["stale_of"],
            closed.isoformat(),
        )
    if r.get("run_since") is not None:  # none in a sweep spilled by an older kvguard
        _note_unclean_stop(conn, r, now, closed_here)


def _when(value: datetime | str) -> datetime:
    """A time of a sweep's row: from a spill file it is text (only the rows' own times are
    parsed there)."""
    return datetime.fromisoformat(value) if isinstance(value, str) else value


def _note_unclean_stop(
    conn: Connection, r: dict[str, Any], now: datetime, closed: list[tuple[str, datetime]]
) -> None:
    """Record an `unclean_stop` event where the run of instance `stale_of` before this one (its
    last `daemon_start` before `run_since`, when this run's store started) has no `daemon_stop`
    after it: it was killed (SIGKILL, the OOM killer, a SIGBUS), crashed, or its host went
    down. Without it, such a run with no incident open left no trace but a start with no stop.
    The event names that run's start, its pid (where its `daemon_start` has it) and its last
    row, and belongs to the incident it left open, if `_close_stale` just closed one (`closed`:
    id, opening), so that the incident's timeline says how the run ended. Recorded once: a
    sweep applied again (a spill file imported twice) finds the event it wrote."""
    instance, since = r["stale_of"], _aware(_when(r["run_since"]))
    start = _previous_start(conn, instance, since)
    if start is None or _stopped_or_noted(conn, instance, start):
        return
    last = _last_row(conn, instance, start.time, since)
    pid = start.data.get("pid") if isinstance(start.data, dict) else None
    ran = f"started {_stamp(start.time)}" + (f" (pid {pid})" if pid is not None else "")
    row = {
        "time": now,
        "host": r.get("host") or "-",
        "instance": instance,
        "kind": "unclean_stop",
        "detail": f"the run {ran} ended without an orderly stop (killed, crashed, or its host "
        f"went down): no daemon_stop after its daemon_start; its last row {_stamp(last)}",
        "data": {"started_at": start.time.isoformat(), "pid": pid, "last_row_at": last.isoformat()},
        "incident": next((i for i, opened in reversed(closed) if opened >= start.time), None),
        "uid": _new_uid(),
    }
    conn.execute(insert(TABLES["events"]), [row])
    log.warning(
        "audit: the previous run of %s (%s) ended without an orderly stop: killed, crashed, or "
        "its host went down (no daemon_stop; its last row %s); see `journalctl -u kvguard` "
        "and the kernel log (`journalctl -k`: the OOM killer) for why",
        instance,
        ran,
        _stamp(last),
    )


def _previous_start(conn: Connection, instance: str, since: datetime) -> Any:
    """The last `daemon_start` (id, time, data) of `instance` before `since`, or None."""
    ev = TABLES["events"]
    return conn.execute(
        select(ev.c.id, ev.c.time, ev.c.data)
        .where(ev.c.instance == instance, ev.c.kind == "daemon_start", ev.c.time < since)
        .order_by(ev.c.time.desc(), ev.c.id.desc())
        .limit(1)
    ).first()


def _of_kind_after(conn: Connection, kind: str, instance: str, after: datetime) -> Any:
    """The events of `kind` (id, time, data) of `instance` at or after `after`, oldest first.

    Asked by kind and time only (`ix_events_kind_time`), the instance picked out of the few
    rows that gives (starts, stops and unclean stops of every instance): asked by instance
    too, the database may take `ix_events_instance_time` and read every row of the run since
    `after`, a million on a busy one, inside the start's write transaction."""
    ev = TABLES["events"]
    rows = conn.execute(
        select(ev.c.id, ev.c.time, ev.c.data, ev.c.instance)
        .where(ev.c.kind == kind, ev.c.time >= after)
        .order_by(ev.c.time, ev.c.id)
    )
    return [r for r in rows if r.instance == instance]


def _stopped_or_noted(conn: Connection, instance: str, start: Any) -> bool:
    """Whether the run that began at `start` has its `daemon_stop` (after it and before the
    instance's next `daemon_start`, this run's as a rule), or its `unclean_stop` already
    (recorded after it, by a start or an import, naming that start). Bounded by the next
    start, not by `since`: a stop stamped after this store started but before its
    `daemon_start` (a clock a little ahead in the run before) is still that run's."""
    nexts = [
        s for s in _of_kind_after(conn, "daemon_start", instance, start.time) if s.id != start.id
    ]
    until = nexts[0].time if nexts else None
    if any(
        until is None or s.time <= until
        for s in _of_kind_after(conn, "daemon_stop", instance, start.time)
    ):
        return True
    began = start.time.isoformat()
    return any(
        isinstance(r.data, dict) and r.data.get("started_at") == began
        for r in _of_kind_after(conn, "unclean_stop", instance, start.time)
    )


def _last_row(conn: Connection, instance: str, start: datetime, since: datetime) -> datetime:
    """The time of the last action or event of `instance` from `start` to `since`."""
    lasts = [
        conn.scalar(
            select(func.max(t.c.time)).where(
                t.c.instance == instance, t.c.time >= start, t.c.time < since
            )
        )
        for t in (TABLES["actions"], TABLES["events"])
    ]
    return max(x for x in lasts if x is not None)  # the run's daemon_start at least


def _stamp(t: datetime) -> str:
    """A time as `kvguard audit` prints them."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _purgeable(name: str, before: datetime) -> Any:
    """Rows of actions or events a sweep with cut `before` deletes: older, and of no incident
    it keeps (one still open, or closed at or after the cut)."""
    t, x = TABLES["incidents"], TABLES[name]
    kept = or_(t.c.closed_at.is_(None), t.c.closed_at >= before)
    return and_(
        x.c.time < before,
        or_(x.c.incident.is_(None), ~exists().where(t.c.id == x.c.incident, kept)),
    )


def _expired(before: datetime) -> Any:
    t = TABLES["incidents"]
    return and_(t.c.closed_at.is_not(None), t.c.closed_at < before)


def _log_purge(before: Any, deleted: dict[str, int]) -> None:
    if any(n > 0 for n in deleted.values()):
        log.info(
            "audit: retention deleted the rows from before %s (audit.retention): %s",
            before.isoformat(timespec="seconds") if isinstance(before, datetime) else before,
            ", ".join(f"{n} {name}" for name, n in deleted.items()),
        )


def _purge(conn: Connection, before: datetime) -> None:
    """Retention: drop rows older than `before`; incidents only once closed. An incident kept
    (still open, or closed after `before`) keeps every row of it, its early actions and events
    too: its timeline stays whole. What it deleted, if anything, is logged by table: a
    retention set too short (or a clock far ahead) shows in the log instead of as history
    silently gone. In one transaction (an import's); the writer's sweep is a `_Sweep`."""
    deleted: dict[str, int] = {}
    for name in ("actions", "events"):
        deleted[name] = conn.execute(delete(TABLES[name]).where(_purgeable(name, before))).rowcount
    closed = delete(TABLES["incidents"]).where(_expired(before))
    deleted["incidents"] = conn.execute(closed).rowcount
    _log_purge(before, deleted)


class _Sweep:
    """The writer's retention sweep: `_purge`'s rules, in transactions of PURGE_CHUNK rows.

    One transaction for a whole backlog (months of rows after a retention cut) held the writer
    for seconds while the queue grew, and needed a WAL (and free disk) as large as what it
    deleted: on a nearly full disk it failed, was retried as transient, for ever, with every
    row queued behind it. A chunk is small, and the rows queued meanwhile are written between
    chunks (`AuditStore._write_purge`).

    Its first step closes the stale incidents (`_close_stale`) and notes the rows there are
    then: the last id of actions and events, the incidents closed before the cut. It deletes
    only those, so the rows written between its chunks (after it in the queue) are left as
    they would be by a sweep done at once. A failed step is retried from the last committed."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row
        self.before = row["before"]
        self.last_id: dict[str, int] | None = None
        self.incidents: list[str] = []
        self.left = ["actions", "events", "incidents"]
        self.deleted = {name: 0 for name in self.left}

    def step(self, engine: Any) -> bool:
        """One transaction; True once the sweep is done (then `report()` logs it)."""
        with engine.begin() as conn:
            pg_lock_timeout(conn, WRITE_LOCK_WAIT_S)
            if self.last_id is None:
                if self.row.get("stale_of"):
                    _close_stale(conn, self.row)
                last_id = {
                    name: conn.scalar(select(func.max(TABLES[name].c.id))) or 0
                    for name in ("actions", "events")
                }
                t = TABLES["incidents"]
                incidents = list(conn.scalars(select(t.c.id).where(_expired(self.before))))
                done, name = 0, None
            else:
                name = self.left[0]
                done, deleted = self._chunk(conn, name)
        if self.last_id is None:  # committed: note what it found
            self.last_id, self.incidents = last_id, incidents
        elif name is not None:
            if name == "incidents":  # committed: those ids are done (a failed try keeps them)
                self.incidents = self.incidents[done:]
            self.deleted[name] += deleted
            if done < PURGE_CHUNK:
                self.left.pop(0)
        return not self.left

    def _chunk(self, conn: Connection, name: str) -> tuple[int, int]:
        """Delete up to PURGE_CHUNK rows of `name`: (rows chosen, rows deleted)."""
        x = TABLES[name]
        if name == "incidents":
            ids = self.incidents[:PURGE_CHUNK]  # dropped from the list once committed (`step`)
            where = _expired(self.before)
        else:
            assert self.last_id is not None
            chosen = (
                select(x.c.id)
                .where(x.c.id <= self.last_id[name], _purgeable(name, self.before))
                .order_by(x.c.time)
                .limit(PURGE_CHUNK)
            )
            ids, where = list(conn.scalars(chosen)), None
        deleted = 0
        for i in range(0, len(ids), 500):  # under every backend's bound-parameter limit
            q = delete(x).where(x.c.id.in_(ids[i : i + 500]))
            deleted += conn.execute(q if where is None else q.where(where)).rowcount
        return len(ids), deleted

    def report(self) -> None:
        _log_purge(self.before, self.deleted)
