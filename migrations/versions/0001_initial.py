"""The audit database: actions, events and incidents.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "actions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("rule", sa.String(length=128), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("trigger", sa.String(length=16), nullable=False),
        sa.Column("signal", sa.String(length=128), nullable=True),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("threshold", sa.Float(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state_before", sa.JSON(), nullable=True),
        sa.Column("state_after", sa.JSON(), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("incident", sa.String(length=64), nullable=True),
        sa.Column("is_undo", sa.Boolean(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_actions")),
    )
    op.create_index("ix_actions_time", "actions", ["time"])
    op.create_index("ix_actions_rule", "actions", ["rule"])
    op.create_index("ix_actions_incident", "actions", ["incident"])

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.Column("incident", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index("ix_events_time", "events", ["time"])
    op.create_index("ix_events_kind", "events", ["kind"])
    op.create_index("ix_events_incident", "events", ["incident"])

    op.create_table(
        "incidents",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("peak_level", sa.Integer(), nullable=False),
        sa.Column("actions_count", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_incidents")),
    )
    op.create_index("ix_incidents_opened_at", "incidents", ["opened_at"])


def downgrade() -> None:
    op.drop_index("ix_incidents_opened_at", table_name="incidents")
    op.drop_table("incidents")
    op.drop_index("ix_events_incident", table_name="events")
    op.drop_index("ix_events_kind", table_name="events")
    op.drop_index("ix_events_time", table_name="events")
    op.drop_table("events")
    op.drop_index("ix_actions_incident", table_name="actions")
    op.drop_index("ix_actions_rule", table_name="actions")
    op.drop_index("ix_actions_time", table_name="actions")
    op.drop_table("actions")
