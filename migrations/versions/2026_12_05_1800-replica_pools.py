"""replica pools: gateways, the replicas a sidecar reports, and the replica that served an event

Revision ID: 20261205_0002
Revises: 20261205_0001
Create Date: 2026-12-05 18:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261205_0002"
down_revision = "20261205_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        # Every sidecar registered before gateways existed is a worker.
        batch_op.add_column(sa.Column("kind", sa.String(length=16), server_default="worker", nullable=False))
        batch_op.add_column(sa.Column("replicas", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("replicas_reported_at", sa.DateTime(timezone=True), nullable=True))
    # Nullable: events stored before, and those of older sidecars, name no replica.
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("replica", sa.String(length=255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.drop_column("replica")
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("replicas_reported_at")
        batch_op.drop_column("replicas")
        batch_op.drop_column("kind")
