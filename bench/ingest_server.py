"""The control plane as bench/ingest.py runs it: ``create_app()`` on the raw-event insert path it is told.

``SPECGATE_BENCH_INGEST_PATH`` picks how the telemetry repository stores raw events:

* ``copy`` (the default, as in production): binary COPY on PostgreSQL, the driver's executemany on SQLite;
* ``json``: PostgreSQL's JSON ``INSERT ... ON CONFLICT`` statement for every batch (the path before COPY);
  SQLite as ``copy``;
* ``generic``: SQLAlchemy's executemany statements on both databases (the path before the bulk ones).

``SPECGATE_BENCH_GENERIC_INSERT=1``, the older switch, still means ``generic``.
Run it with ``uvicorn --factory bench.ingest_server:make_app``.
"""

from __future__ import annotations

import os

from fastapi import FastAPI

from controlplane.app import create_app
from controlplane.telemetry.repository import TelemetryRepository

INGEST_PATHS = ("copy", "json", "generic")


def ingest_path() -> str:
    if os.environ.get("SPECGATE_BENCH_GENERIC_INSERT") == "1":
        return "generic"
    path = os.environ.get("SPECGATE_BENCH_INGEST_PATH") or "copy"
    if path not in INGEST_PATHS:
        raise ValueError(f"SPECGATE_BENCH_INGEST_PATH={path!r}: one of {', '.join(INGEST_PATHS)}")
    return path


def use_ingest_path(path: str) -> None:
    """Set the repository's switches for ``path`` (class attributes: every session of this process)."""
    TelemetryRepository.pg_bulk = TelemetryRepository.sqlite_bulk = path != "generic"
    TelemetryRepository.pg_event_path = "json" if path == "json" else "copy"


def make_app() -> FastAPI:
    use_ingest_path(ingest_path())
    return create_app()
