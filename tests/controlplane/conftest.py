"""A migrated control plane per test, with an admin key, on both databases."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.auth.service import create_key
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.migrations_state import upgrade
from controlplane.settings import ControlPlaneSettings
from tests.support.auth import bearer


@pytest.fixture
def migrated_url(database_url: str) -> str:
    upgrade(database_url)
    return database_url


@pytest.fixture
def settings(migrated_url: str) -> ControlPlaneSettings:
    # No background guardrail evaluator: tests look at rollouts when they choose, not on a wall clock.
    return ControlPlaneSettings(database_url=migrated_url, worker_stale_after_s=5, long_poll_max_s=30,
                                guardrail_interval_s=0)


@pytest.fixture
def make_key(migrated_url: str) -> Callable[[Scope, str], str]:
    """Create a key straight in the database, as `specgate keys create` does."""

    def make(scope: Scope, name: str = "") -> str:
        engine = make_engine(migrated_url)
        try:
            with unit_of_work(make_sessionmaker(engine)) as session:
                _, token = create_key(session, name=name or f"test-{scope.value}", scope=scope,
                                      created_by="test:fixture")
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
def worker_key(make_key: Callable[[Scope, str], str]) -> dict[str, str]:
    return bearer(make_key(Scope.worker, "pool-a"))
