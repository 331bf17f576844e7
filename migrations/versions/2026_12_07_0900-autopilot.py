"""autopilot: per-policy settings and the history of what it did

Revision ID: 20261207_0001
Revises: 20261205_0002
Create Date: 2026-12-07 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261207_0001"
down_revision = "20261205_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "autopilots",
        sa.Column("policy_id", sa.String(length=32), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("min_confidence", sa.String(length=16), nullable=False),
        sa.Column("steps", sa.JSON(), nullable=False),
        sa.Column("hold_s", sa.Float(), nullable=False),
        sa.Column("min_samples", sa.Integer(), nullable=False),
        sa.Column("max_changes_per_day", sa.Integer(), nullable=False),
        sa.Column("kinds", sa.JSON(), nullable=False),
        sa.Column("rollout_id", sa.String(length=32), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("status_detail", sa.Text(), nullable=False),
        sa.Column("last_look_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(["policy_id"], ["policies.id"], name=op.f("fk_autopilots_policy_id_policies"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("policy_id", name=op.f("pk_autopilots")),
    )
    op.create_table(
        "autopilot_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("policy_id", sa.String(length=32), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("rollout_id", sa.String(length=32), nullable=True),
        sa.Column("revision_id", sa.String(length=64), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["policy_id"], ["policies.id"], name=op.f("fk_autopilot_events_policy_id_policies"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autopilot_events")),
    )
    op.create_index("ix_autopilot_events_policy_at", "autopilot_events", ["policy_id", "at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_autopilot_events_policy_at", table_name="autopilot_events")
    op.drop_table("autopilot_events")
    op.drop_table("autopilots")
