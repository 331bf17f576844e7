"""supervised engines: what a sidecar that runs its own engines reports of them

Revision ID: 20261207_0002
Revises: 20261207_0001
Create Date: 2026-12-07 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261207_0002"
down_revision = "20261207_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable: workers that never reported supervised engines (most: engines started by someone else).
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("supervised_engines", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("supervised_reported_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("supervised_reported_at")
        batch_op.drop_column("supervised_engines")
