"""k0 rollups: requests decided into a speculative engine's K=0 band get rollup rows of their own

Revision ID: 20261207_0003
Revises: 20261207_0002
Create Date: 2026-12-07 17:00:00
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from alembic import op

revision = "20261207_0003"
down_revision = "20261207_0002"
branch_labels = None
depends_on = None

_KEY = ["minute", "policy", "revision", "route", "engine", "batch_bucket", "explored"]


@contextmanager
def _histograms_kept() -> Iterator[None]:
    """SQLite changes a table constraint by copying the table, dropping the old one and renaming the copy; the
    drop deletes every histogram row through their cascading foreign key. Keep them aside meanwhile (rollup
    ids survive the copy)."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        yield
        return
    columns = "rollup_id, metric, bucket, count"  # constant names: nothing from outside reaches the SQL
    bind.exec_driver_sql(f"CREATE TEMP TABLE k0_migration_histograms AS SELECT {columns} "  # noqa: S608
                         "FROM telemetry_rollup_histograms")
    yield
    bind.exec_driver_sql(f"INSERT INTO telemetry_rollup_histograms ({columns}) SELECT {columns} "  # noqa: S608
                         "FROM k0_migration_histograms")
    bind.exec_driver_sql("DROP TABLE k0_migration_histograms")


def upgrade() -> None:
    # Rows from before are false: nothing then told a K=0-band request apart; they stay in the cohorts they
    # were counted in.
    with _histograms_kept(), op.batch_alter_table("telemetry_rollups", schema=None) as batch_op:
        batch_op.add_column(sa.Column("k0", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.drop_constraint("uq_telemetry_rollups_key", type_="unique")
        batch_op.create_unique_constraint("uq_telemetry_rollups_key", [*_KEY, "k0"])


def _merge_k0_rows() -> None:
    """Fold each k0 row into the row of its key without k0 (or make it that row), histograms included, so
    the old key is unique again and no request is lost."""
    bind = op.get_bind()
    meta = sa.MetaData()
    rollups = sa.Table("telemetry_rollups", meta, autoload_with=bind)
    histograms = sa.Table("telemetry_rollup_histograms", meta, autoload_with=bind)
    counters = [c.name for c in rollups.columns if c.name not in (*_KEY, "k0", "id")]
    for row in bind.execute(sa.select(rollups).where(rollups.c.k0.is_(True))).mappings().all():
        match = sa.and_(*(rollups.c[name] == row[name] for name in _KEY), rollups.c.k0.is_(False))
        other = bind.execute(sa.select(rollups.c.id).where(match)).scalar()
        if other is None:
            bind.execute(rollups.update().where(rollups.c.id == row["id"]).values(k0=False))
            continue
        bind.execute(rollups.update().where(rollups.c.id == other)
                     .values({name: rollups.c[name] + row[name] for name in counters}))
        for metric, bucket, count in bind.execute(
                sa.select(histograms.c.metric, histograms.c.bucket, histograms.c["count"])
                .where(histograms.c.rollup_id == row["id"])).all():
            where = sa.and_(histograms.c.rollup_id == other, histograms.c.metric == metric,
                            histograms.c.bucket == bucket)
            if bind.execute(sa.select(histograms.c.rollup_id).where(where)).first() is None:
                bind.execute(histograms.insert().values(rollup_id=other, metric=metric, bucket=bucket, count=count))
            else:
                bind.execute(histograms.update().where(where).values(count=histograms.c["count"] + count))
        bind.execute(histograms.delete().where(histograms.c.rollup_id == row["id"]))
        bind.execute(rollups.delete().where(rollups.c.id == row["id"]))


def downgrade() -> None:
    _merge_k0_rows()
    with _histograms_kept(), op.batch_alter_table("telemetry_rollups", schema=None) as batch_op:
        batch_op.drop_constraint("uq_telemetry_rollups_key", type_="unique")
        batch_op.create_unique_constraint("uq_telemetry_rollups_key", _KEY)
        batch_op.drop_column("k0")
