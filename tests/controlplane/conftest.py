"""Fixtures the control plane's tests share (the root conftest has the database, settings, app and keys)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine

from controlplane.db import make_engine
from controlplane.settings import ControlPlaneSettings


@pytest.fixture
def db(settings: ControlPlaneSettings) -> Iterator[Engine]:
    engine = make_engine(settings.database_url)
    try:
        yield engine
    finally:
        engine.dispose()
