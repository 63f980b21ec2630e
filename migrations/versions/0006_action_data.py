"""A `data` on every action: what the engine said it did beyond the settings it changed.

An eviction's row said only "evicted 2 sequences of priority <= low": which requests it
preempted (the engine's answer, `{"evicted": [[request id, mode], ...]}`, which the admin API
returns) was dropped, so the audit could not tell whose requests an incident slowed. The
column is JSON, as `events.data` is, and nullable: rows written before this revision, and
actions that report nothing more, have none. Daemons not yet upgraded leave it out.

On SQLite, 0004's trigger for a row without `instance` inserts the row again naming 0004's
columns, which would drop `data`: the trigger is created again with this revision's columns
(and 0004's comes back on the way down). PostgreSQL's trigger sets `instance` on the row
itself, whatever its columns.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `actions`' columns at 0004, `id` left out (the database assigns it), and at this revision.
COLUMNS_0004 = (
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
)
COLUMNS = (*COLUMNS_0004, "data")
TRIGGER = "actions_instance_from_host"  # 0004's name


def _sqlite_trigger(cols: Sequence[str]) -> str:
    """0004's SQLite trigger on `actions`, naming `cols`."""
    names = ", ".join(f'"{c}"' for c in cols)
    values = ", ".join("NEW.host" if c == "instance" else f'NEW."{c}"' for c in cols)
    return (
        f'CREATE TRIGGER "{TRIGGER}" BEFORE INSERT ON "actions" '
        f"WHEN NEW.instance IS NULL BEGIN "
        f'INSERT INTO "actions" ({names}) VALUES ({values}); '
        f"SELECT RAISE(IGNORE); END"
    )


def _is_sqlite() -> bool:
    return op.get_context().dialect.name == "sqlite"  # also offline (`alembic upgrade --sql`)


def upgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        batch.add_column(sa.Column("data", sa.JSON(), nullable=True))
    if _is_sqlite():
        op.execute(f'DROP TRIGGER IF EXISTS "{TRIGGER}"')
        op.execute(_sqlite_trigger(COLUMNS))


def downgrade() -> None:
    if _is_sqlite():  # before the column goes: the trigger names it
        op.execute(f'DROP TRIGGER IF EXISTS "{TRIGGER}"')
    with op.batch_alter_table("actions") as batch:
        batch.drop_column("data")
    if _is_sqlite():  # batch mode recreated the table, which drops its triggers: 0004's again
        op.execute(f'DROP TRIGGER IF EXISTS "{TRIGGER}"')
        op.execute(_sqlite_trigger(COLUMNS_0004))
