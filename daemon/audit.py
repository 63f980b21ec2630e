"""The audit store: every remedy, event and incident, written without ever stalling the caller.

The rules evaluator and the engine's event hooks run on hot paths; a database that is locked,
read-only, slow or gone must not stall or crash them. So callers only append to a bounded
in-memory queue and return, and ONE writer thread drains it in batches, one transaction per
batch. When a write fails for a reason outside the row (a lock, a full disk, a dropped
connection) the batch stays queued and is retried with exponential backoff until it lands:
nothing is lost until the queue bound is reached, and only then are new rows dropped (counted in
`dropped`, logged as errors). A row the database refuses for its own sake (a constraint) would
fail forever, so it is isolated from its batch, logged and counted in `rejected` instead of
wedging the queue.

Counters for the metrics exporter: `failures` (failed write attempts,
kvguard_audit_write_failures_total), `dropped`, `rejected`, `written`, and `depth()`.

Reads (for `kvguard audit` and the admin API) use their own short connections and return plain
dicts, with times as aware UTC datetimes.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time as _time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import groupby
from typing import Any, Literal

from sqlalchemy import Select, Table, delete, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DataError, DBAPIError, DisconnectionError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from kvguard.daemon.audit_migrate import (
    BUSY_TIMEOUT_MS,
    current,
    db_errors,
    downgrade,
    make_engine,
    shown,
    upgrade,
)
from kvguard.daemon.audit_models import OUTCOMES, TRIGGERS, Action, Base, Event, Incident

__all__ = ["AuditStore", "current", "downgrade", "new_incident_id", "upgrade"]

log = logging.getLogger(__name__)

BATCH = 256  # rows per transaction: one fsync for a burst of actions
BACKOFF_START = 0.05  # seconds before the first retry
BACKOFF_MAX = 1.0  # a database that comes back is used again within about a second

OpKind = Literal["actions", "events", "incidents", "incident_update", "purge"]
TABLES: dict[str, Table] = {
    m.__tablename__: Base.metadata.tables[m.__tablename__] for m in (Action, Event, Incident)
}


@dataclass(slots=True, frozen=True)
class _Op:
    kind: OpKind
    row: dict[str, Any]


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
    mutates later, and an odd value (an enum, a Path) is stored as text instead of failing."""
    if value is None:
        return None
    return json.loads(json.dumps(dict(value), default=str))


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"audit {name} {value!r} is not one of {', '.join(allowed)}")
    return value


def _is_transient(e: Exception) -> bool:
    """Retry what the database or connection caused; a row's own fault would fail forever."""
    if isinstance(e, IntegrityError | DataError):
        return False
    return isinstance(e, DBAPIError | DisconnectionError | PoolTimeoutError | OSError)


class AuditStore:
    """Queue-fed writer and reader of the audit database (see the module docstring)."""

    def __init__(
        self,
        url: str,
        host: str | None = None,
        max_queue: int = 10000,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"audit max_queue must be at least 1, not {max_queue}")
        self.url = url
        self.host = host or socket.gethostname()
        self.max_queue = max_queue
        self.busy_timeout_ms = busy_timeout_ms
        self._engine = make_engine(url, busy_timeout_ms)  # a bad URL fails here, at start-up
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._progress = threading.Condition(self._lock)
        self._pending: deque[_Op] = deque()
        self._inflight = 0  # rows taken by the writer, not yet committed
        self._accepted = 0  # rows ever queued; FIFO, so flush() waits for _settled to reach it
        self._settled = 0  # rows ever written or refused
        self._stopping = False
        self._abandon = threading.Event()  # stop() gave up waiting: leave the retry loop
        self._thread: threading.Thread | None = None
        self.failures = 0
        self.dropped = 0
        self.rejected = 0
        self.written = 0
        self.last_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, migrate: bool = True) -> None:
        """Migrate to head (raising ValueError if that fails), then start the writer thread.

        Rows recorded before start() are kept and written once it runs.
        """
        if self._thread is not None and self._thread.is_alive():
            return
        if migrate:
            upgrade(self.url, busy_timeout_ms=self.busy_timeout_ms)
        with self._lock:
            self._stopping = False
        self._abandon.clear()
        self._thread = threading.Thread(target=self._run, name="kvguard-audit", daemon=True)
        self._thread.start()

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
        still exit after `timeout`; the unwritten rows are then lost, and counted in the log.
        """
        ok = self.flush(timeout)
        with self._lock:
            self._stopping = True
            self._has_work.notify_all()
            left = self._depth()
        if not ok:
            self._abandon.set()
            log.error("audit: stopping with %d rows not written to %s", left, shown(self.url))
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            if not self._thread.is_alive():
                self._thread = None
                self._engine.dispose()
        return ok

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
    ) -> None:
        """Queue one remedy. `time` defaults to now: the decision's time, not the write's.

        A bad trigger or outcome is a caller's bug and raises ValueError at once, here, rather
        than becoming a row the database refuses later.
        """
        row = {
            "time": _aware(time),
            "host": self.host,
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
            "kind": kind,
            "detail": detail,
            "data": _jsonable(data),
            "incident": incident,
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
    ) -> None:
        """Queue new values for an incident; writes are in call order, so this follows its open."""
        values: dict[str, Any] = {}
        if peak_level is not None:
            values["peak_level"] = int(peak_level)
        if actions_count is not None:
            values["actions_count"] = int(actions_count)
        if closed_at is not None:
            values["closed_at"] = _aware(closed_at)
        if values:
            self._enqueue(_Op("incident_update", {"id": incident_id, **values}))

    def purge_older_than(self, days: float) -> None:
        """Queue the retention sweep (`audit.retention`): it runs on the writer, in order."""
        self._enqueue(_Op("purge", {"before": utcnow() - timedelta(days=days)}))

    def _enqueue(self, op: _Op) -> None:
        with self._lock:
            if self._depth() < self.max_queue:
                self._pending.append(op)
                self._accepted += 1
                self._has_work.notify()
                return
            self.dropped += 1
            dropped = self.dropped
        if dropped & (dropped - 1) == 0:  # 1, 2, 4, 8...: loud, but not a log flood
            log.error(
                "audit queue full (%d rows, %s not accepting writes: %s): dropped %d rows so far",
                self.max_queue,
                shown(self.url),
                self.last_error or "too slow",
                dropped,
            )

    # -- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while batch := self._take():
            try:
                self._write_until_done(batch)
            except Exception:  # a bug here must not end auditing for the rest of the run
                log.exception("audit writer: unexpected error; %d rows skipped", len(batch))
                self.rejected += len(batch)
                self._done(len(batch), written=False)
            if self._abandon.is_set():
                return

    def _take(self) -> list[_Op]:
        with self._lock:
            while not self._pending and not self._stopping:
                self._has_work.wait()
            n = min(BATCH, len(self._pending))
            batch = [self._pending.popleft() for _ in range(n)]
            self._inflight = n
            return batch

    def _write_until_done(self, batch: list[_Op]) -> None:
        delay = BACKOFF_START
        attempts = 0
        while batch:
            try:
                self._write(batch)
            except Exception as e:
                if not _is_transient(e):
                    raise
                attempts += 1
                self._failed(e, attempts)
                if self._abandon.wait(delay):
                    return
                delay = min(delay * 2, BACKOFF_MAX)
        if attempts:
            log.warning("audit: writes to %s resumed after %d failures", shown(self.url), attempts)
            self.last_error = None

    def _write(self, batch: list[_Op]) -> None:
        """Write the batch in one transaction; on a row's own fault, row by row."""
        try:
            self._commit(batch)
        except Exception as e:
            if _is_transient(e):
                raise
            self.failures += 1
            self._write_singly(batch)
            return
        n = len(batch)
        batch.clear()
        self._done(n)

    def _write_singly(self, batch: list[_Op]) -> None:
        while batch:  # a row leaves the batch once settled: a retry never repeats it
            written = self._commit_or_reject(batch[0])
            batch.pop(0)
            self._done(1, written)

    def _commit_or_reject(self, op: _Op) -> bool:
        """True if written, False if the database refused this row for good."""
        try:
            self._commit([op])
            return True
        except Exception as e:
            if _is_transient(e):
                raise
            self.failures += 1
            self.rejected += 1
            log.error("audit: %s refused a row, skipped: %s: %r", shown(self.url), e, op)
            return False

    def _commit(self, ops: list[_Op]) -> None:
        with self._engine.begin() as conn:
            _apply(conn, ops)

    def _done(self, n: int, written: bool = True) -> None:
        with self._lock:
            self._inflight -= n
            self._settled += n
            self.written += n if written else 0
            self._progress.notify_all()

    def _failed(self, e: Exception, attempts: int) -> None:
        self.failures += 1
        self.last_error = str(getattr(e, "orig", None) or e).splitlines()[0]
        if attempts == 1 or attempts % 60 == 0:  # about once a minute during an outage
            log.warning(
                "audit: cannot write to %s (attempt %d, %d rows waiting, retrying): %s",
                shown(self.url),
                attempts,
                self.depth(),
                self.last_error,
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
    ) -> list[dict[str, Any]]:
        """The newest `limit` matching actions, oldest first (read like a log)."""
        t = TABLES["actions"]
        q = _window(select(t), t.c.time, since, until)
        for col, want in (("rule", rule), ("action", action), ("outcome", outcome)):
            if want is not None:
                q = q.where(t.c[col] == want)
        if incident is not None:
            q = q.where(t.c.incident == incident)
        return self._newest(q, t, t.c.time, limit)

    def list_events(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        kind: str | None = None,
        incident: str | None = None,
        limit: int | None = 100,
    ) -> list[dict[str, Any]]:
        """The newest `limit` matching events, oldest first."""
        t = TABLES["events"]
        q = _window(select(t), t.c.time, since, until)
        if kind is not None:
            q = q.where(t.c.kind == kind)
        if incident is not None:
            q = q.where(t.c.incident == incident)
        return self._newest(q, t, t.c.time, limit)

    def list_incidents(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        open_only: bool = False,
        limit: int | None = 100,
    ) -> list[dict[str, Any]]:
        """The newest `limit` incidents opened in the window, oldest first."""
        t = TABLES["incidents"]
        q = _window(select(t), t.c.opened_at, since, until)
        if open_only:
            q = q.where(t.c.closed_at.is_(None))
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
        acts = [
            {"type": "action", **r} for r in self.list_actions(incident=incident_id, limit=None)
        ]
        evs = [{"type": "event", **r} for r in self.list_events(incident=incident_id, limit=None)]
        # An event that caused an action shares its timestamp at most; show it first.
        return sorted(acts + evs, key=lambda r: (r["time"], r["type"] == "action", r["id"]))

    def _newest(
        self, q: Select[Any], t: Table, time_col: Any, limit: int | None
    ) -> list[dict[str, Any]]:
        q = q.order_by(time_col.desc(), t.c.id.desc())
        if limit is not None:
            q = q.limit(limit)
        return self._rows(q)[::-1]

    def _rows(self, q: Select[Any]) -> list[dict[str, Any]]:
        with db_errors(self.url), self._engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]


def _float(v: float | None) -> float | None:
    return None if v is None else float(v)


def _window(q: Select[Any], col: Any, since: datetime | None, until: datetime | None) -> Select:
    if since is not None:
        q = q.where(col >= _aware(since))
    if until is not None:
        q = q.where(col <= _aware(until))
    return q


def _apply(conn: Connection, ops: list[_Op]) -> None:
    """Run ops in order; consecutive inserts into one table go as one executemany."""
    for kind, group in groupby(ops, key=lambda op: op.kind):
        rows = [op.row for op in group]
        if kind == "purge":
            for r in rows:
                _purge(conn, r["before"])
        elif kind == "incident_update":
            t = TABLES["incidents"]
            for r in rows:
                values = {k: v for k, v in r.items() if k != "id"}
                conn.execute(update(t).where(t.c.id == r["id"]).values(values))
        else:
            conn.execute(insert(TABLES[kind]), rows)


def _purge(conn: Connection, before: datetime) -> None:
    """Retention: drop rows older than `before`; incidents only once closed."""
    for name in ("actions", "events"):
        t = TABLES[name]
        conn.execute(delete(t).where(t.c.time < before))
    t = TABLES["incidents"]
    conn.execute(delete(t).where(t.c.closed_at.is_not(None), t.c.closed_at < before))
