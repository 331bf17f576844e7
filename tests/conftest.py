"""Shared fixtures. Database-backed tests run once on SQLite and once on PostgreSQL.

A migrated control plane per test (``settings``, ``client``) and a key of each scope (``admin``, ``operator``,
``viewer``, ``worker_key``), for every part whose tests talk to the API.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.auth.service import create_key
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.migrations_state import upgrade
from controlplane.settings import ControlPlaneSettings
from tests.support.auth import bearer

# Recorded telemetry in the tests is dated on fixed days (tests/support/telemetry_data.py) and retention is tested
# with events weeks old: the suite widens the window of accepted event times (and the retention it is bounded by)
# to ten years. tests/controlplane/test_hardening_cp.py tests the defaults. Set here, so that control planes
# the tests start as processes get it too.
os.environ.setdefault("SPECGATE_TELEMETRY_MAX_EVENT_AGE_S", str(3650 * 86400))
os.environ.setdefault("SPECGATE_TELEMETRY_RETENTION_DAYS", "3650")

FLEET_KEY_WORKERS = ("w-1", "w1", "w2", "w-cpu", "w-gpu", "b-0", "b1", "gone", "wrong-pool")

# The server every machine of this project runs; CI starts it if it is down.
DEFAULT_PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _pg_admin_url() -> str:
    return os.environ.get("SPECGATE_TEST_POSTGRES_URL", DEFAULT_PG_ADMIN_URL)


@pytest.fixture(scope="session")
def postgres_database() -> Iterator[str]:
    """A throw-away database for this test run, so parallel runs never collide."""
    admin_url = _pg_admin_url()
    name = f"specgate_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        pytest.fail(f"PostgreSQL is required for the test suite and is not reachable at {admin_url}: {exc}")
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An empty database (no schema) of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('db') / 'specgate.db'}"
    base: str = request.getfixturevalue("postgres_database")
    engine = create_engine(base, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    return base


@pytest.fixture
def migrated_url(database_url: str) -> str:
    upgrade(database_url)
    return database_url


@pytest.fixture
def settings(migrated_url: str) -> ControlPlaneSettings:
    # No background guardrail evaluator or autopilot: tests look at rollouts when they choose, not on a wall clock.
    return ControlPlaneSettings(database_url=migrated_url, worker_stale_after_s=5, long_poll_max_s=30,
                                guardrail_interval_s=0, autopilot_interval_s=0)


@pytest.fixture
def make_key(migrated_url: str) -> Callable[[Scope, str], str]:
    """Create a key straight in the database, as `specgate keys create` does."""

    def make(scope: Scope, name: str = "", *, pool: str | None = None,
             worker_ids: list[str] | None = None) -> str:
        engine = make_engine(migrated_url)
        try:
            with unit_of_work(make_sessionmaker(engine)) as session:
                _, token = create_key(session, name=name or f"test-{scope.value}", scope=scope,
                                      created_by="test:fixture", pool=pool, worker_ids=worker_ids)
        finally:
            engine.dispose()
        return token

    return make


@pytest.fixture
def client(settings: ControlPlaneSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def admin(make_key: Callable[[Scope, str], str]) -> dict[str, str]:
    return bearer(make_key(Scope.admin, "alice"))


@pytest.fixture
def operator(make_key: Callable[[Scope, str], str]) -> dict[str, str]:
    return bearer(make_key(Scope.operator, "olga"))


@pytest.fixture
def viewer(make_key: Callable[[Scope, str], str]) -> dict[str, str]:
    return bearer(make_key(Scope.viewer, "victor"))


@pytest.fixture
def worker_key(make_key: Callable[..., str]) -> dict[str, str]:
    # The tests' fleet key: any worker of pool-a (where tests/support/fleet_rows.register puts workers), and by
    # id the workers tests send telemetry for or move to other pools. Keys are bound (issue 16); an unbound one
    # would bind itself to the first worker it registers.
    return bearer(make_key(Scope.worker, "pool-a", pool="pool-a", worker_ids=list(FLEET_KEY_WORKERS)))


@pytest.fixture
def generations_count_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generations step by exactly one per change: the clock floor (tested on its own) held at zero.

    Tests that assert how many times an action bumped the generation use this;
    with the real clock every bump jumps to the current millisecond.
    """
    from controlplane.distribution import publish

    monkeypatch.setattr(publish, "clock_ms", lambda: 0)
