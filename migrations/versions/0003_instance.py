"""An `instance` on every action, event and incident: which daemon wrote the row.

Several daemons (one per node or GPU group) may share one PostgreSQL audit database, and two of
them may run on one host, so `host` cannot tell their rows apart; `instance` is the daemon's
name (`audit.instance`, the hostname by default). Rows written before this revision were all
written by one daemon per database, so they get their `host` as instance.

The column is added nullable, filled, then made NOT NULL: PostgreSQL cannot add a NOT NULL
column without a default to a table that has rows, and a server default would outlive the
migration and hide a writer that forgot the tag. On SQLite the NOT NULL step recreates the
table (Alembic's batch mode); elsewhere it is a plain ALTER.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("actions", "events", "incidents")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("instance", sa.String(length=255), nullable=True))
        t = sa.table(table, sa.column("host"), sa.column("instance"))
        op.execute(t.update().values(instance=t.c.host))
        with op.batch_alter_table(table) as batch:
            batch.alter_column("instance", existing_type=sa.String(length=255), nullable=False)
            batch.create_index(f"ix_{table}_instance", ["instance"])


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_index(f"ix_{table}_instance")
            batch.drop_column("instance")
