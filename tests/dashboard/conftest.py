"""A live control plane (uvicorn, SQLite) per test, with a key of every scope."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import streamlit as st

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.migrations_state import upgrade
from controlplane.settings import ControlPlaneSettings
from tests.support.dashboard_live import LiveControlPlane, mint_keys
from tests.support.live import serve


@pytest.fixture(autouse=True)
def _keep_the_main_module() -> Iterator[None]:
    # Streamlit's script runner (AppTest included) installs the page as sys.modules["__main__"] and never
    # puts the old one back. A later test that starts a "spawn" process pool then has every worker
    # re-run a dashboard page as its main module; the workers die and the pool waits forever.
    main = sys.modules["__main__"]
    yield
    sys.modules["__main__"] = main


@pytest.fixture(autouse=True)
def _no_cached_reads_from_another_test() -> Iterator[None]:
    # The dashboard's caches live in this process for as long as it runs, as they would in a server.
    st.cache_data.clear()
    yield
    st.cache_data.clear()
    st.cache_resource.clear()


@pytest.fixture
def live_control_plane(tmp_path: Path) -> Iterator[LiveControlPlane]:
    database_url = f"sqlite:///{tmp_path / 'specgate.db'}"
    upgrade(database_url)
    keys = mint_keys(database_url)
    settings = ControlPlaneSettings(database_url=database_url, worker_stale_after_s=600)
    with serve(create_app(settings)) as url:
        yield LiveControlPlane(url, database_url, keys[Scope.admin], keys[Scope.operator], keys[Scope.viewer],
                               keys[Scope.worker])
