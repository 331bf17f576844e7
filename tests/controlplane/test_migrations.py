"""The schema comes from migrations only; they must agree with the models, both ways."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select

from controlplane.db import make_engine
from controlplane.migrations_state import downgrade, head_revision, migration_status, upgrade
from controlplane.models import Base, FleetState


def test_upgrade_matches_models_and_downgrade_removes_everything(database_url: str) -> None:
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        current, head = migration_status(engine)
        assert current == head == head_revision()
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}),
                                    Base.metadata)
            assert diff == [], f"models and migrations disagree: {diff}"
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
            from sqlalchemy import text

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
