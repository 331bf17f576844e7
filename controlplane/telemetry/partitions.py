"""The background task that creates the day partitions of raw telemetry events ahead (PostgreSQL).

Once at start and every SPECGATE_TELEMETRY_PARTITION_INTERVAL_S, in a
transaction of its own: :func:`controlplane.telemetry.service.ensure_partitions`
creates what is missing of the days ingest accepts and the days ahead. Every
replica runs it; the partition lock makes them take turns, and one that finds
everything there changes nothing and locks nothing. Should it fail (the
database away, a lock not granted in time), ingest still creates a missing day
on demand (``TelemetryRepository.insert_events``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from controlplane.db import unit_of_work
from controlplane.models import utcnow
from controlplane.telemetry import service

log = logging.getLogger("specgate.controlplane.telemetry")

# Attaching a partition waits for a lock that long-running statements on the table may hold; rather than
# queue every ingest behind it, give up and try again next round (the days ahead leave time).
LOCK_TIMEOUT_MS = 5000


def keep_partitions(app: Any) -> list[str]:
    """One round: create the missing partitions; returns their names."""
    with unit_of_work(app.state.sessions) as session:
        if session.get_bind().dialect.name != "postgresql":
            return []
        session.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
        created = service.ensure_partitions(session, app.state.settings, utcnow())
    if created:
        log.info("created telemetry event partitions %s", ", ".join(created))
    return created


def keep_partitions_logged(app: Any) -> None:
    """:func:`keep_partitions`, an error logged, not raised (at start, and each round)."""
    try:
        keep_partitions(app)
    except Exception:
        log.exception("creating telemetry event partitions failed; ingest creates a missing one on demand")


async def run_partition_keeper(app: Any, interval_s: float) -> None:
    """Loop until cancelled; an error in one round is logged and the next round runs."""
    while True:
        await asyncio.sleep(interval_s)
        await run_in_threadpool(keep_partitions_logged, app)
