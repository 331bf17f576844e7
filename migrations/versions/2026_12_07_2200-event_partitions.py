"""raw telemetry events partitioned by day on PostgreSQL (key (event_id, time)); SQLite unchanged

Revision ID: 20261207_0005
Revises: 20261207_0004
Create Date: 2026-12-07 22:00:00

PostgreSQL: the plain table is renamed aside, a table of the same columns partitioned by range of ``time``
takes its name, with one partition per UTC day of the rows it holds and of the days around today that
ingest accepts (the control plane creates the later ones ahead, and any missing one on demand), the rows
are copied, the old table dropped, and the key and indexes built on the partitioned table (each partition
gets its own). A partitioned table's unique constraints must include the partition key, so the primary
key becomes (event_id, time). All of it in the migration's one transaction: an error leaves the old table.

Downgrade copies the rows back into a plain table keyed by event_id. An event id the partitioned table
holds with two times (a sidecar reusing ids; the old key refuses it) keeps one of its rows.

SQLite keeps its single table: nothing to do.
"""

from __future__ import annotations

import datetime as dt

from alembic import op

revision = "20261207_0005"
down_revision = "20261207_0004"
branch_labels = None
depends_on = None

# (name, columns) of the indexes on telemetry_events, as migration 20261202_0002 made them.
_INDEXES = (
    ("ix_telemetry_events_time", "time"),
    ("ix_telemetry_events_policy_time", "policy, time"),
    ("ix_telemetry_events_revision_time", "revision, time"),
    ("ix_telemetry_events_route_time", "route, time"),
    ("ix_telemetry_events_engine_time", "engine, time"),
    ("ix_telemetry_events_worker_time", "worker_id, time"),
)
# Days around today given a partition besides the data's: ingest accepts events up to
# SPECGATE_TELEMETRY_MAX_EVENT_AGE_S (7 days by default) old and a clock skew ahead. The control plane
# creates what its own settings need at start; these only spare a first ingest the on-demand creation.
_DAYS_BEHIND = 8
_DAYS_AHEAD = 3


def _partition(day: dt.date) -> str:
    start = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
    end = start + dt.timedelta(days=1)
    # Names and bounds come from dates: nothing from outside reaches the SQL.
    return (f"CREATE TABLE telemetry_events_p{day:%Y%m%d} PARTITION OF telemetry_events "
            f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')")


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    for name, _ in _INDEXES:
        op.execute(f"DROP INDEX {name}")
    op.execute("ALTER TABLE telemetry_events RENAME TO telemetry_events_unpartitioned")
    op.execute("ALTER TABLE telemetry_events_unpartitioned RENAME CONSTRAINT pk_telemetry_events "
               "TO pk_telemetry_events_unpartitioned")
    # The same columns, types, NOT NULLs and defaults, in the same order.
    op.execute("CREATE TABLE telemetry_events (LIKE telemetry_events_unpartitioned INCLUDING DEFAULTS) "
               "PARTITION BY RANGE (time)")
    days = set(bind.exec_driver_sql(
        "SELECT DISTINCT (time AT TIME ZONE 'UTC')::date FROM telemetry_events_unpartitioned").scalars())
    today = dt.datetime.now(dt.UTC).date()
    days.update(today + dt.timedelta(days=n) for n in range(-_DAYS_BEHIND, _DAYS_AHEAD + 1))
    for day in sorted(days):
        op.execute(_partition(day))
    op.execute("INSERT INTO telemetry_events SELECT * FROM telemetry_events_unpartitioned")
    op.execute("DROP TABLE telemetry_events_unpartitioned")
    # Built after the copy (faster than maintaining them row by row), on the parent: every partition,
    # present and future, gets them.
    op.execute("ALTER TABLE telemetry_events ADD CONSTRAINT pk_telemetry_events PRIMARY KEY (event_id, time)")
    for name, columns in _INDEXES:
        op.execute(f"CREATE INDEX {name} ON telemetry_events ({columns})")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    for name, _ in _INDEXES:
        op.execute(f"DROP INDEX {name}")
    op.execute("ALTER TABLE telemetry_events RENAME TO telemetry_events_partitioned")
    op.execute("ALTER TABLE telemetry_events_partitioned RENAME CONSTRAINT pk_telemetry_events "
               "TO pk_telemetry_events_partitioned")
    op.execute("CREATE TABLE telemetry_events (LIKE telemetry_events_partitioned INCLUDING DEFAULTS)")
    op.execute("ALTER TABLE telemetry_events ADD CONSTRAINT pk_telemetry_events PRIMARY KEY (event_id)")
    op.execute("INSERT INTO telemetry_events SELECT * FROM telemetry_events_partitioned "
               "ON CONFLICT (event_id) DO NOTHING")
    op.execute("DROP TABLE telemetry_events_partitioned")  # and its partitions
    for name, columns in _INDEXES:
        op.execute(f"CREATE INDEX {name} ON telemetry_events ({columns})")
