"""A unique id on every action and event, made when the row is queued.

Rows that could not be written before the daemon stopped are saved to a spill file and loaded
later by `kvguard audit import` (or by the next start). The id is what lets that load skip
rows already present: a row the writer committed while the spill was being saved, or a spill
file imported twice. Rows written before this revision keep NULL, which a unique index allows
any number of times.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("actions", "events")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("uid", sa.String(length=32), nullable=True))
            batch.create_index(f"ix_{table}_uid", ["uid"], unique=True)


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_index(f"ix_{table}_uid")
            batch.drop_column("uid")
