"""hardening: worker keys bound to a pool or workers, a second signing key, a cohort secret, clock-floored generations

Revision ID: 20261205_0001
Revises: 20261203_0001
Create Date: 2026-12-05 09:00:00
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "20261205_0001"
down_revision = "20261203_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pool", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("worker_ids", sa.JSON(), nullable=True))
    with op.batch_alter_table("fleet_state", schema=None) as batch_op:
        batch_op.add_column(sa.Column("previous_signing_key", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("cohort_secret", sa.String(length=64), nullable=True))
    # Generations are signed into bundles and sidecars refuse older ones, so a new database must not start
    # below what an earlier one issued: start at the clock in milliseconds. Each change adds one after that,
    # and no database sees a change per millisecond of its life, so a later database starts higher.
    now_ms = time.time_ns() // 1_000_000
    op.execute(sa.text("UPDATE fleet_state SET generation = :now WHERE generation < :now").bindparams(now=now_ms))


def downgrade() -> None:
    with op.batch_alter_table("fleet_state", schema=None) as batch_op:
        batch_op.drop_column("cohort_secret")
        batch_op.drop_column("previous_signing_key")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("worker_ids")
        batch_op.drop_column("pool")
