"""analysis: request shape on telemetry events (what-if replays), guardrail evaluations of rollout steps

Revision ID: 20261203_0001
Revises: 20261202_0002
Create Date: 2026-12-03 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261203_0001"
down_revision = "20261202_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("shape_prompt_tokens", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("labels", sa.String(length=2048), server_default="{}", nullable=False))

    op.create_table(
        "guardrail_evaluations",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("rollout_id", sa.String(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("evaluated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("evaluated_by", sa.String(length=128), nullable=False),
        sa.Column("verdict", sa.String(length=16), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("baseline_requests", sa.BigInteger(), nullable=False),
        sa.Column("canary_requests", sa.BigInteger(), nullable=False),
        sa.Column("checks", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"],
                                name=op.f("fk_guardrail_evaluations_rollout_id_rollouts"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_guardrail_evaluations")),
    )
    with op.batch_alter_table("guardrail_evaluations", schema=None) as batch_op:
        batch_op.create_index("ix_guardrail_evaluations_rollout_at", ["rollout_id", "evaluated_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("guardrail_evaluations", schema=None) as batch_op:
        batch_op.drop_index("ix_guardrail_evaluations_rollout_at")
    op.drop_table("guardrail_evaluations")
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.drop_column("labels")
        batch_op.drop_column("shape_prompt_tokens")
