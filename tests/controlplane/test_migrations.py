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
