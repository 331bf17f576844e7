"""Shared fixtures. Database-backed tests run once on SQLite and once on PostgreSQL."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

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
