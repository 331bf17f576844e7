"""The schema comes from migrations only; they must agree with the models, both ways."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select, text

from controlplane.db import make_engine
from controlplane.migrations_state import downgrade, head_revision, migration_status, upgrade
from controlplane.models import Base, FleetState, include_name


def test_upgrade_matches_models_and_downgrade_removes_everything(database_url: str) -> None:
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        current, head = migration_status(engine)
        assert current == head == head_revision()
        with engine.connect() as conn:
            # The one documented difference (controlplane/models.py, TelemetryEventRecord): on PostgreSQL
            # telemetry_events is partitioned by day and keyed (event_id, time). Its day partitions are the
            # database's, not the models' (include_name skips them, as migrations/env.py does), and Alembic
            # does not compare primary keys: both shapes are checked here instead.
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True,
                                                                           "include_name": include_name}),
                                    Base.metadata)
            assert diff == [], f"models and migrations disagree: {diff}"
            key = inspect(conn).get_pk_constraint("telemetry_events")["constrained_columns"]
            if conn.dialect.name == "postgresql":
                assert key == ["event_id", "time"]
                assert conn.execute(text("SELECT partstrat FROM pg_partitioned_table "
                                         "WHERE partrelid = 'telemetry_events'::regclass")).scalar() == "r"
            else:
                assert key == ["event_id"]
            # The one fleet_state row is created by the migration, not by code.
            state = conn.execute(select(FleetState.id, FleetState.kill_switch)).all()
            assert [tuple(r) for r in state] == [(1, False)]
        tables = set(inspect(engine).get_table_names())
        assert {"policies", "revisions", "rollouts", "rollout_steps", "workers", "api_keys",
                "audit_events", "fleet_state"} <= tables

        downgrade(database_url, "base")
        engine.dispose()
        left = set(inspect(engine).get_table_names()) - {"alembic_version"}
        assert left == set()

        # And back up again: migrations are repeatable.
        upgrade(database_url)
        engine.dispose()
        assert migration_status(engine)[0] == head_revision()
    finally:
        engine.dispose()


def test_readyz_reports_a_database_behind_head(database_url: str) -> None:
    from fastapi.testclient import TestClient

    from controlplane.app import create_app
    from controlplane.settings import ControlPlaneSettings

    upgrade(database_url)
    downgrade(database_url, "base")
    upgrade(database_url)  # app start needs the fleet_state row
    app = create_app(ControlPlaneSettings(database_url=database_url))
    with TestClient(app) as client:
        assert client.get("/readyz").status_code == 200
        # Pretend the code is newer than the database.
        with app.state.engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'older'"))
        r = client.get("/readyz")
        assert r.status_code == 503
        assert "older" in r.json()["checks"]["migrations"]


def test_downgrading_past_k0_rollups_folds_them_into_their_key_without_losing_a_request(
        database_url: str) -> None:
    import datetime as dt

    from sqlalchemy import MetaData, Table

    from analysis.rollup import COUNTERS

    upgrade(database_url)
    engine = make_engine(database_url)
    key = {"minute": dt.datetime(2026, 12, 7, 17, 0, tzinfo=dt.UTC), "policy": "p", "revision": "r",
           "route": "chat", "engine": "draft", "batch_bucket": 9, "explored": False}
    try:
        with engine.begin() as conn:
            meta = MetaData()
            rollups = Table("telemetry_rollups", meta, autoload_with=conn)
            histograms = Table("telemetry_rollup_histograms", meta, autoload_with=conn)
            ids = {}
            for k0, n in ((False, 3), (True, 5)):
                ids[k0] = conn.execute(rollups.insert().values(**key, k0=k0, **dict.fromkeys(COUNTERS, n))
                                       .returning(rollups.c.id)).scalar()
            # a k0 row with no twin keeps its requests under the old key
            lone = conn.execute(rollups.insert().values(**{**key, "batch_bucket": 17}, k0=True,
                                                        **dict.fromkeys(COUNTERS, 7)).returning(rollups.c.id)).scalar()
            conn.execute(histograms.insert(), [
                {"rollup_id": ids[False], "metric": "e2e", "bucket": 10, "count": 3},
                {"rollup_id": ids[True], "metric": "e2e", "bucket": 10, "count": 2},
                {"rollup_id": ids[True], "metric": "e2e", "bucket": 12, "count": 3},
                {"rollup_id": lone, "metric": "itl", "bucket": 4, "count": 7}])
        downgrade(database_url, "20261207_0002")
        engine.dispose()
        with engine.connect() as conn:
            meta = MetaData()
            rollups = Table("telemetry_rollups", meta, autoload_with=conn)
            histograms = Table("telemetry_rollup_histograms", meta, autoload_with=conn)
            assert "k0" not in rollups.c
            rows = {r.batch_bucket: r for r in conn.execute(select(rollups)).all()}
            assert set(rows) == {9, 17}
            assert (rows[9].requests, rows[9].e2e_ms_sum, rows[17].requests) == (8, 8, 7)
            hist = {(r.rollup_id, r.metric, r.bucket): r.count for r in conn.execute(select(histograms)).all()}
            assert hist == {(rows[9].id, "e2e", 10): 5, (rows[9].id, "e2e", 12): 3, (rows[17].id, "itl", 4): 7}
        upgrade(database_url)
        engine.dispose()
        with engine.connect() as conn:
            meta = MetaData()
            rollups = Table("telemetry_rollups", meta, autoload_with=conn)
            histograms = Table("telemetry_rollup_histograms", meta, autoload_with=conn)
            assert conn.execute(select(rollups.c.k0)).scalars().all() == [False, False]
            # the upgrade keeps every histogram row (SQLite copies the table to change its key)
            assert sum(conn.execute(select(histograms.c["count"])).scalars()) == 15
    finally:
        engine.dispose()


def test_shadow_comparisons_keep_the_rows_from_before_and_downgrade_without_losing_them(database_url: str) -> None:
    import datetime as dt

    from sqlalchemy import MetaData, Table

    from analysis.rollup import COUNTERS, SHADOW_COUNTERS
    from controlplane.telemetry.repository import EVENT_COLUMNS

    shadow_columns = ("shadow_match", "shadow_first_diff", "shadow_structured_valid", "shadow_check_passed",
                      "shadow_check_reason")
    upgrade(database_url, "20261207_0003")
    engine = make_engine(database_url)
    minute = dt.datetime(2026, 12, 7, 21, 0, tzinfo=dt.UTC)
    key = {"minute": minute, "policy": "p", "revision": "r", "route": "chat", "engine": "draft", "batch_bucket": 1,
           "explored": False, "k0": False}
    before = [name for name in COUNTERS if name not in SHADOW_COUNTERS]
    event = {"event_id": "e-1", "request_id": "r-1", "time": minute, "worker_id": "w", "pool": "a", "route": "chat",
             "model": "m", "policy": "p", "revision": "r", "rule": "x", "engine": "draft", "decided_engine": "draft",
             "speculate": True, "num_speculative_tokens": 3, "explored": False, "canary": False, "kill_switch": False,
             "batch_size": 1, "stream": False, "structured_output": False, "tools": False, "e2e_ms": 5.0,
             "status": "ok", "retries": 0, "fallback": False, "batch_id": "b", "received_at": minute}
    try:
        with engine.begin() as conn:
            meta = MetaData()
            rollups = Table("telemetry_rollups", meta, autoload_with=conn)
            events = Table("telemetry_events", meta, autoload_with=conn)
            histograms = Table("telemetry_rollup_histograms", meta, autoload_with=conn)
            assert not set(shadow_columns) & set(events.c.keys())
            rid = conn.execute(rollups.insert().values(**key, **dict.fromkeys(before, 3))
                               .returning(rollups.c.id)).scalar()
            conn.execute(events.insert().values(**event))
            conn.execute(histograms.insert().values(rollup_id=rid, metric="e2e", bucket=10, count=3))

        upgrade(database_url)
        engine.dispose()
        with engine.begin() as conn:
            meta = MetaData()
            rollups = Table("telemetry_rollups", meta, autoload_with=conn)
            events = Table("telemetry_events", meta, autoload_with=conn)
            histograms = Table("telemetry_rollup_histograms", meta, autoload_with=conn)
            # the events' columns follow the contract's (the bulk inserts name them; order is the model's)
            assert set(EVENT_COLUMNS) <= set(events.c.keys())
            row = conn.execute(select(rollups)).mappings().one()
            assert {name: row[name] for name in SHADOW_COUNTERS} == dict.fromkeys(SHADOW_COUNTERS, 0)
            assert row["requests"] == 3
            stored = conn.execute(select(*(events.c[name] for name in shadow_columns))).one()
            assert tuple(stored) == (None,) * 5
            # what ingest then adds to the row and stores beside the event
            conn.execute(rollups.update().values({name: rollups.c[name] + 2 for name in COUNTERS}))
            conn.execute(events.insert().values(**{**event, "event_id": "e-2", "shadow_match": False,
                                                   "shadow_first_diff": 4, "shadow_structured_valid": True,
                                                   "shadow_check_passed": False, "shadow_check_reason": "differs"}))
            assert conn.execute(select(rollups.c.shadow_compared, rollups.c.requests)).one() == (2, 5)
            assert conn.execute(select(histograms.c["count"])).scalars().all() == [3]

        downgrade(database_url, "20261207_0003")
        engine.dispose()
        with engine.connect() as conn:
            meta = MetaData()
            rollups = Table("telemetry_rollups", meta, autoload_with=conn)
            events = Table("telemetry_events", meta, autoload_with=conn)
            histograms = Table("telemetry_rollup_histograms", meta, autoload_with=conn)
            assert not set(SHADOW_COUNTERS) & set(rollups.c.keys())
            assert not set(shadow_columns) & set(events.c.keys())
            assert conn.execute(select(rollups.c.id, rollups.c.requests)).one() == (rid, 5)
            assert sorted(conn.execute(select(events.c.event_id)).scalars()) == ["e-1", "e-2"]
            # SQLite copies the table to drop a column: the histograms (cascading from it) are kept all the same
            assert conn.execute(select(histograms.c.rollup_id, histograms.c["count"])).all() == [(rid, 3)]
        upgrade(database_url)
        engine.dispose()
        assert migration_status(engine)[0] == head_revision()
    finally:
        engine.dispose()


def test_partitioning_events_keeps_every_row_up_and_down(database_url: str) -> None:
    import datetime as dt

    from sqlalchemy import MetaData, Table

    from controlplane.models import is_event_partition

    upgrade(database_url, "20261207_0004")
    engine = make_engine(database_url)
    today = dt.datetime.now(dt.UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    base = {"request_id": "r", "worker_id": "w", "pool": "a", "route": "chat", "model": "m", "policy": "p",
            "revision": "r", "rule": "x", "engine": "draft", "decided_engine": "draft", "speculate": True,
            "num_speculative_tokens": 3, "explored": False, "canary": False, "kill_switch": False, "batch_size": 1,
            "stream": False, "structured_output": False, "tools": False, "e2e_ms": 5.0, "status": "ok",
            "retries": 0, "fallback": False, "batch_id": "b", "received_at": today}
    # days long past (kept: the migration never purges), both sides of a midnight, today
    times = [dt.datetime(2025, 3, 1, 8, 30, tzinfo=dt.UTC), dt.datetime(2026, 11, 1, 23, 59, 59, 999999, tzinfo=dt.UTC),
             dt.datetime(2026, 11, 2, 0, 0, tzinfo=dt.UTC), today]
    rows = [{**base, "event_id": f"e-{n}", "time": t, "replica": f"h:{n}", "labels": f'{{"n":"{n}"}}',
             "shadow_match": n % 2 == 0, "shadow_check_reason": "x" * n, "ttft_ms": 1.5 * n, "max_tokens": n}
            for n, t in enumerate(times)]

    def stored() -> list[dict[str, object]]:
        with engine.connect() as conn:
            events = Table("telemetry_events", MetaData(), autoload_with=conn)
            return [dict(r) for r in conn.execute(select(events).order_by(events.c.event_id)).mappings()]

    def partitions() -> set[str]:
        return {name for name in inspect(engine).get_table_names() if is_event_partition(name)}

    try:
        with engine.begin() as conn:
            conn.execute(Table("telemetry_events", MetaData(), autoload_with=conn).insert(), rows)
        before = stored()
        assert len(before) == 4

        upgrade(database_url, "20261207_0005")
        engine.dispose()
        assert stored() == before
        indexes = {ix["name"] for ix in inspect(engine).get_indexes("telemetry_events")}
        assert indexes == {"ix_telemetry_events_time", "ix_telemetry_events_policy_time",
                           "ix_telemetry_events_revision_time", "ix_telemetry_events_route_time",
                           "ix_telemetry_events_engine_time", "ix_telemetry_events_worker_time"}
        if engine.dialect.name == "postgresql":
            # one partition per day of the data, and the days around today that ingest accepts
            days = {f"telemetry_events_p{d}" for d in ("20250301", "20261101", "20261102")}
            around = {f"telemetry_events_p{today + dt.timedelta(days=n):%Y%m%d}" for n in range(-7, 3)}
            assert days | around <= partitions()
            with engine.connect() as conn:
                placed = dict(conn.execute(text("SELECT event_id, tableoid::regclass::text "
                                                "FROM telemetry_events")).all())
            assert placed == {"e-0": "telemetry_events_p20250301", "e-1": "telemetry_events_p20261101",
                              "e-2": "telemetry_events_p20261102", "e-3": f"telemetry_events_p{today:%Y%m%d}"}
        else:
            assert partitions() == set()

        downgrade(database_url, "20261207_0004")
        engine.dispose()
        assert stored() == before
        assert partitions() == set()
        assert inspect(engine).get_pk_constraint("telemetry_events")["constrained_columns"] == ["event_id"]
        indexes = {ix["name"] for ix in inspect(engine).get_indexes("telemetry_events")}
        assert len(indexes) == 6

        upgrade(database_url, "20261207_0005")
        engine.dispose()
        assert stored() == before
    finally:
        engine.dispose()


def test_edge_rollups_keep_events_batches_and_rollups_up_and_down(database_url: str) -> None:
    import datetime as dt

    from sqlalchemy import MetaData, Table

    upgrade(database_url, "20261207_0005")
    engine = make_engine(database_url)
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    event = {"event_id": "e-1", "request_id": "r", "time": now, "worker_id": "w", "pool": "a", "route": "chat",
             "model": "m", "policy": "p", "revision": "r", "rule": "x", "engine": "draft", "decided_engine": "draft",
             "speculate": True, "num_speculative_tokens": 3, "explored": False, "canary": False,
             "kill_switch": False, "batch_size": 1, "stream": False, "structured_output": False, "tools": False,
             "e2e_ms": 5.0, "status": "ok", "retries": 0, "fallback": False, "batch_id": "b", "received_at": now}
    batch = {"batch_id": "b", "worker_id": "w", "sent_by": "k", "received_at": now, "event_count": 1,
             "accepted": 1, "stored": 1, "rejected": []}

    def rows(table: str) -> list[dict[str, object]]:
        with engine.connect() as conn:
            t = Table(table, MetaData(), autoload_with=conn)
            return [dict(r) for r in conn.execute(select(t)).mappings()]

    try:
        with engine.begin() as conn:
            conn.execute(Table("telemetry_batches", MetaData(), autoload_with=conn).insert(), [batch])
            conn.execute(Table("telemetry_events", MetaData(), autoload_with=conn).insert(), [event])
        events_before, batches_before = rows("telemetry_events"), rows("telemetry_batches")

        upgrade(database_url, "20261207_0006")
        engine.dispose()
        assert rows("telemetry_events") == [{**events_before[0], "sample_weight": None}]
        assert rows("telemetry_batches") == [{**batches_before[0], "rollup_count": 0, "rollups_accepted": 0,
                                              "rollups_stored": 0, "rollups_rejected": None}]
        with engine.begin() as conn:
            conn.execute(Table("telemetry_rollup_deltas", MetaData(), autoload_with=conn).insert(),
                         [{"worker_id": "w", "delta_id": "d-1", "minute": now.replace(second=0), "batch_id": "b",
                           "received_at": now}])
        assert len(rows("telemetry_rollup_deltas")) == 1

        downgrade(database_url, "20261207_0005")
        engine.dispose()
        assert rows("telemetry_events") == events_before
        assert rows("telemetry_batches") == batches_before
        assert "telemetry_rollup_deltas" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
