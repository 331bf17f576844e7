"""The control plane as bench/ingest.py runs it: ``create_app()``, optionally on the generic insert path.

``SPECGATE_BENCH_GENERIC_INSERT=1`` makes the telemetry repository use
SQLAlchemy's executemany statements on both databases (the "before" of the
bulk paths: JSON parameters on PostgreSQL, the driver's executemany on SQLite).
Run it with ``uvicorn --factory bench.ingest_server:make_app``.
"""

from __future__ import annotations

import os

from fastapi import FastAPI

from controlplane.app import create_app
from controlplane.telemetry.repository import TelemetryRepository


def make_app() -> FastAPI:
    if os.environ.get("SPECGATE_BENCH_GENERIC_INSERT") == "1":
        TelemetryRepository.pg_bulk = False
        TelemetryRepository.sqlite_bulk = False
    return create_app()
