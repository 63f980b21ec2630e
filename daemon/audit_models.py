"""The audit database's tables: what the daemon did, what happened to it, and the incidents.

An operator reads these after an incident, often with plain SQL, so the schema stays flat:
one row per remedy (`actions`), one row per daemon event (`events`), one row per incident
(`incidents`), JSON for the parts whose shape depends on the action. `incident` is a plain
string on actions and events rather than a foreign key: incident ids are made by the writer's
callers, and an audit row must never be refused because its incident row has not landed yet.

`uid` on actions and events is a random id given when the row is queued: a row
saved to a spill file because the database could not take it is loaded later by
`kvguard audit import`, and the uid is how that load recognises a row that is already there
(imported twice, or committed by the writer while the spill was being saved). Rows written
before revision 0002 have none.

`host` is the machine a row was written on; `instance` names the daemon that wrote it
(`audit.instance`, the hostname by default), because a fleet's daemons share one database and
two of them may share a host. `kvguard audit ... --instance NAME` filters by it.

An action's `data` is what the engine said it did beyond the settings in `state_before` and
`state_after`: the requests an eviction preempted (`{"evicted": [[request id, "swap" or
"recompute"], ...]}`, the ids the daemon gave them, `<response id>-<choice index>`; a batch
cut's `preempted` alike), the steps of a chain that applied and the requests its steps took off
the device, under those same keys: `kvguard audit list --request ID` finds a request's rows by
them. Rows written before revision 0006, and actions that report nothing more, have none.

Times are stored in UTC. SQLite keeps no offset, so `UTCDateTime` hands back aware UTC
datetimes on every backend and turns any aware datetime into UTC before it is stored.

The migrations in `kvguard.migrations` must describe exactly these tables; a test compares them
with Alembic's autogenerate.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Float, Index, Integer, MetaData, String, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

TRIGGERS = ("signal", "event", "alert", "manual", "reload")
OUTCOMES = ("applied", "failed", "dry_run", "refused", "held")

# Named constraints and indexes: migrations on every backend (and SQLite's batch mode, which
# recreates tables) can then refer to them by a stable name.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend, SQLite included."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()} in the audit database: give a tz")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


class Action(Base):
    """One remedy the rules applied, refused, failed or only simulated (dry run), or an undo."""

    __tablename__ = "actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time: Mapped[datetime]  # when the caller decided, not when the row was written
    host: Mapped[str] = mapped_column(String(255))
    rule: Mapped[str | None] = mapped_column(String(128))  # None: a manual action
    action: Mapped[str] = mapped_column(String(64))
    trigger: Mapped[str] = mapped_column(String(16))  # one of TRIGGERS
    signal: Mapped[str | None] = mapped_column(String(128))
    value: Mapped[float | None] = mapped_column(Float)  # the signal's value when it fired
    threshold: Mapped[float | None] = mapped_column(Float)
    params: Mapped[dict[str, Any]]
    state_before: Mapped[dict[str, Any] | None]
    state_after: Mapped[dict[str, Any] | None]
    outcome: Mapped[str] = mapped_column(String(16))  # one of OUTCOMES
    error: Mapped[str | None] = mapped_column(Text)
    incident: Mapped[str | None] = mapped_column(String(64))
    is_undo: Mapped[bool] = mapped_column(Boolean)
    detail: Mapped[str] = mapped_column(Text)
    uid: Mapped[str | None] = mapped_column(String(32))  # made at enqueue: see the module docstring
    instance: Mapped[str] = mapped_column(String(255))  # the daemon: see the module docstring
    data: Mapped[dict[str, Any] | None]  # what it did beyond its knobs: see the module docstring

    __table_args__ = (
        Index("ix_actions_time", "time"),
        Index("ix_actions_rule_time", "rule", "time"),  # the filtered lists: revision 0005
        Index("ix_actions_incident", "incident"),
        Index("ix_actions_uid", "uid", unique=True),
        Index("ix_actions_instance_time", "instance", "time"),
    )


class Event(Base):
    """Something that happened to the daemon (start, reload, OOM, alert...): `kind` is free text."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time: Mapped[datetime]
    host: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None]
    incident: Mapped[str | None] = mapped_column(String(64))
    uid: Mapped[str | None] = mapped_column(String(32))  # made at enqueue: see the module docstring
    instance: Mapped[str] = mapped_column(String(255))  # the daemon: see the module docstring

    __table_args__ = (
        Index("ix_events_time", "time"),
        Index("ix_events_kind_time", "kind", "time"),
        Index("ix_events_incident", "incident"),
        Index("ix_events_uid", "uid", unique=True),
        Index("ix_events_instance_time", "instance", "time"),
    )


class Incident(Base):
    """A stretch of pressure, from the first escalation to the last undo."""

    __tablename__ = "incidents"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # made by the caller
    opened_at: Mapped[datetime]
    closed_at: Mapped[datetime | None]
    peak_level: Mapped[int] = mapped_column(Integer)  # the highest rung of the remedy ladder
    actions_count: Mapped[int] = mapped_column(Integer)
    host: Mapped[str] = mapped_column(String(255))
    summary: Mapped[str] = mapped_column(Text)
    instance: Mapped[str] = mapped_column(String(255))  # the daemon: see the module docstring

    __table_args__ = (
        Index("ix_incidents_opened_at", "opened_at"),
        Index("ix_incidents_instance_time", "instance", "opened_at", "id"),
    )
