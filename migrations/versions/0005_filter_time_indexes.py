"""Composite (column, time) indexes for the filtered lists.

`kvguard audit list --rule R` / `--instance I`, `kvguard audit incidents --instance I` and the
events by kind or instance ask for the newest matching rows. With an index on the filter column
alone the database found every matching row, then sorted them all by time for the newest few:
seconds on a table of months, growing with it. An index on (column, time) gives them in time
order, so the newest few are read and no more. Each replaces its single-column index, which
it covers (a lookup by the column alone uses the new one's prefix).

On SQLite an index also holds the rowid (`id`), so the order by (time, id) comes from the index
as it is; incidents (a text id) get `id` as a third column for the same reason.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column, its time): index ix_<table>_<column> becomes ix_<table>_<column>_time.
REPLACED = (
    ("actions", "rule", "time"),
    ("actions", "instance", "time"),
    ("events", "kind", "time"),
    ("events", "instance", "time"),
    ("incidents", "instance", "opened_at"),
)


def _columns(table: str, column: str, time: str) -> list[str]:
    return [column, time, "id"] if table == "incidents" else [column, time]


def upgrade() -> None:
    for table, column, time in REPLACED:
        op.create_index(f"ix_{table}_{column}_time", table, _columns(table, column, time))
        op.drop_index(f"ix_{table}_{column}", table_name=table)


def downgrade() -> None:
    for table, column, _ in REPLACED:
        op.create_index(f"ix_{table}_{column}", table, [column])
        op.drop_index(f"ix_{table}_{column}_time", table_name=table)
