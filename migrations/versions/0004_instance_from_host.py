"""A row written without `instance` gets its `host`: daemons not yet upgraded keep writing.

A fleet upgrades one daemon at a time, and the first one of the new version migrates the shared
database. A daemon still running a kvguard from before 0003 knows nothing of `instance` and
inserts rows without it, which 0003's NOT NULL refused: its audit was lost until its own
upgrade. Such a daemon was its database's only writer when it was the newest, so its host names
it, as 0003 filled the rows already there.

The column stays NOT NULL (readers never see a row without an instance); an insert that leaves
it NULL gets `host` from a trigger instead:

- PostgreSQL: a BEFORE INSERT trigger sets `NEW.instance := COALESCE(NEW.instance, NEW.host)`
  (NOT NULL is checked after BEFORE triggers).
- SQLite: a BEFORE INSERT trigger cannot change NEW, so for a row without instance it inserts
  the same row with `host` as instance and drops the original (`RAISE(IGNORE)`). It names the
  columns of this revision: a later revision that adds a column which an old daemon could
  leave out must create these triggers again, and batch mode (which recreates a table) drops
  them, so a later revision that recreates one of these tables must create its trigger again.
  The statement that left `instance` out then reports no row (rowcount 0, no lastrowid, an
  empty RETURNING), the row being the trigger's: kvguard's writers read none of these back,
  an ORM writing such rows would (give it `instance`).
- Other backends get no trigger: upgrade every daemon before migrating such a database.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The columns at this revision, `id` left out where the database assigns it.
COLUMNS = {
    "actions": (
        "time",
        "host",
        "rule",
        "action",
        "trigger",
        "signal",
        "value",
        "threshold",
        "params",
        "state_before",
        "state_after",
        "outcome",
        "error",
        "incident",
        "is_undo",
        "detail",
        "uid",
        "instance",
    ),
    "events": ("time", "host", "kind", "detail", "data", "incident", "uid", "instance"),
    "incidents": (
        "id",
        "opened_at",
        "closed_at",
        "peak_level",
        "actions_count",
        "host",
        "summary",
        "instance",
    ),
}
PG_FUNCTION = "kvguard_instance_from_host"


def _trigger(table: str) -> str:
    return f"{table}_instance_from_host"


def _sqlite_trigger(table: str) -> str:
    cols = COLUMNS[table]
    names = ", ".join(f'"{c}"' for c in cols)
    values = ", ".join("NEW.host" if c == "instance" else f'NEW."{c}"' for c in cols)
    return (
        f'CREATE TRIGGER "{_trigger(table)}" BEFORE INSERT ON "{table}" '
        f"WHEN NEW.instance IS NULL BEGIN "
        f'INSERT INTO "{table}" ({names}) VALUES ({values}); '
        f"SELECT RAISE(IGNORE); END"
    )


def upgrade() -> None:
    dialect = op.get_context().dialect.name  # also offline (`alembic upgrade --sql`)
    if dialect == "postgresql":
        op.execute(
            f"CREATE OR REPLACE FUNCTION {PG_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN NEW.instance := COALESCE(NEW.instance, NEW.host); RETURN NEW; END $$"
        )
        for table in COLUMNS:
            op.execute(
                f'CREATE TRIGGER "{_trigger(table)}" BEFORE INSERT ON "{table}" FOR EACH ROW '
                f"WHEN (NEW.instance IS NULL) EXECUTE FUNCTION {PG_FUNCTION}()"
            )
    elif dialect == "sqlite":
        for table in COLUMNS:
            op.execute(_sqlite_trigger(table))


def downgrade() -> None:
    dialect = op.get_context().dialect.name  # also offline (`alembic upgrade --sql`)
    if dialect == "postgresql":
        for table in COLUMNS:
            op.execute(f'DROP TRIGGER IF EXISTS "{_trigger(table)}" ON "{table}"')
        op.execute(f"DROP FUNCTION IF EXISTS {PG_FUNCTION}()")
    elif dialect == "sqlite":
        for table in COLUMNS:
            op.execute(f'DROP TRIGGER IF EXISTS "{_trigger(table)}"')
