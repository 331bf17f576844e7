"""shadow comparisons: the plain engine's answer beside the speculative one, on events and in the rollups

Revision ID: 20261207_0004
Revises: 20261207_0003
Create Date: 2026-12-07 21:00:00
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from alembic import op

revision = "20261207_0004"
down_revision = "20261207_0003"
branch_labels = None
depends_on = None

_COUNTERS = ("shadow_compared", "shadow_matched", "shadow_first_diff_sum", "shadow_first_diff_count",
             "shadow_structured_checked", "shadow_structured_valid_served", "shadow_structured_valid_plain",
             "shadow_check_run", "shadow_check_failed")


@contextmanager
def _histograms_kept() -> Iterator[None]:
    """SQLite drops a column by copying the table, dropping the old one and renaming the copy; the drop deletes
    every histogram row through their cascading foreign key. Keep them aside meanwhile (rollup ids survive the
    copy)."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        yield
        return
    columns = "rollup_id, metric, bucket, count"  # constant names: nothing from outside reaches the SQL
    bind.exec_driver_sql(f"CREATE TEMP TABLE shadow_migration_histograms AS SELECT {columns} "  # noqa: S608
                         "FROM telemetry_rollup_histograms")
    yield
    bind.exec_driver_sql(f"INSERT INTO telemetry_rollup_histograms ({columns}) SELECT {columns} "  # noqa: S608
                         "FROM shadow_migration_histograms")
    bind.exec_driver_sql("DROP TABLE shadow_migration_histograms")


def upgrade() -> None:
    # Nullable: events stored before, and every request that was not compared, have no shadow answer.
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("shadow_match", sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column("shadow_first_diff", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("shadow_structured_valid", sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column("shadow_check_passed", sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column("shadow_check_reason", sa.String(length=256), nullable=True))
    # 0 on the rows from before: nothing was compared then. A plain string default, so SQLite adds the columns
    # in place instead of copying the table.
    with op.batch_alter_table("telemetry_rollups", schema=None) as batch_op:
        for name in _COUNTERS:
            batch_op.add_column(sa.Column(name, sa.BigInteger(), server_default="0", nullable=False))


def downgrade() -> None:
    with _histograms_kept(), op.batch_alter_table("telemetry_rollups", schema=None) as batch_op:
        for name in reversed(_COUNTERS):
            batch_op.drop_column(name)
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.drop_column("shadow_check_reason")
        batch_op.drop_column("shadow_check_passed")
        batch_op.drop_column("shadow_structured_valid")
        batch_op.drop_column("shadow_first_diff")
        batch_op.drop_column("shadow_match")
