"""A live control plane (uvicorn, SQLite) per test, with a key of every scope."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.auth.service import create_key
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.migrations_state import upgrade
from controlplane.settings import ControlPlaneSettings
from tests.controlplane.live import serve


@dataclass(frozen=True)
class LiveControlPlane:
    url: str
    database_url: str
    admin: str
    operator: str
    viewer: str
    worker: str


@pytest.fixture(autouse=True)
def _keep_the_main_module() -> Iterator[None]:
    # Streamlit's script runner (AppTest included) installs the page as sys.modules["__main__"] and never
    # puts the old one back. A later test that starts a "spawn" process pool then has every worker
    # re-run a dashboard page as its main module; the workers die and the pool waits forever.
    main = sys.modules["__main__"]
    yield
    sys.modules["__main__"] = main


def _keys(database_url: str) -> dict[Scope, str]:
    engine = make_engine(database_url)
    names = {Scope.admin: "alice", Scope.operator: "olga", Scope.viewer: "victor", Scope.worker: "fleet-sidecar"}
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            return {scope: create_key(session, name=name, scope=scope, created_by="test:fixture")[1]
                    for scope, name in names.items()}
    finally:
        engine.dispose()


@pytest.fixture
def live_control_plane(tmp_path: Path) -> Iterator[LiveControlPlane]:
    database_url = f"sqlite:///{tmp_path / 'specgate.db'}"
    upgrade(database_url)
    keys = _keys(database_url)
    settings = ControlPlaneSettings(database_url=database_url, worker_stale_after_s=600)
    with serve(create_app(settings)) as url:
        yield LiveControlPlane(url, database_url, keys[Scope.admin], keys[Scope.operator], keys[Scope.viewer],
                               keys[Scope.worker])
