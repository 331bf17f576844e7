"""edge pre-aggregation: rollup deltas from workers, sampled events with their weight

Revision ID: 20261207_0006
Revises: 20261207_0005
Create Date: 2026-12-07 23:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261207_0006"
down_revision = "20261207_0005"
branch_labels = None
depends_on = None

_BATCH_COUNTS = ("rollup_count", "rollups_accepted", "rollups_stored")


def upgrade() -> None:
    # Nullable: every event stored before, and every event of a worker that does not pre-aggregate, stands
    # for itself. On PostgreSQL the column reaches every day partition through the partitioned parent.
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sample_weight", sa.Float(), nullable=True))
    # 0 on the batches from before: none carried deltas. Plain string defaults, so SQLite adds in place.
    with op.batch_alter_table("telemetry_batches", schema=None) as batch_op:
        for name in _BATCH_COUNTS:
            batch_op.add_column(sa.Column(name, sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("rollups_rejected", sa.JSON(), nullable=True))
    op.create_table(
        "telemetry_rollup_deltas",
        sa.Column("worker_id", sa.String(length=128), nullable=False),
        sa.Column("delta_id", sa.String(length=64), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("worker_id", "delta_id", name=op.f("pk_telemetry_rollup_deltas")),
    )
    with op.batch_alter_table("telemetry_rollup_deltas", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_telemetry_rollup_deltas_minute"), ["minute"], unique=False)


def downgrade() -> None:
    # The rollups keep what the deltas added: they stay the aggregate of every request the workers reported.
    with op.batch_alter_table("telemetry_rollup_deltas", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_telemetry_rollup_deltas_minute"))
    op.drop_table("telemetry_rollup_deltas")
    with op.batch_alter_table("telemetry_batches", schema=None) as batch_op:
        batch_op.drop_column("rollups_rejected")
        for name in reversed(_BATCH_COUNTS):
            batch_op.drop_column(name)
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.drop_column("sample_weight")
