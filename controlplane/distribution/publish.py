"""Announcing that bundles may have changed, inside the changing transaction."""

from __future__ import annotations

import time

from sqlalchemy import case, select, text, update
from sqlalchemy.orm import Session

from controlplane.models import FleetState

NOTIFY_CHANNEL = "specgate_bundle"


def clock_ms() -> int:
    return time.time_ns() // 1_000_000


def bump_generation(session: Session, *, at_least: int = 0) -> int:
    """Bump the distribution generation; PostgreSQL tells other replicas on commit.

    The new generation is the old one plus one, but never below the clock in
    milliseconds (nor ``at_least``). Sidecars refuse a generation below the
    highest they accepted; a database restored from a backup, or recreated,
    would otherwise issue generations they refuse until someone deletes their
    last-known-good files. With the clock as a floor, the first change after a
    restore is above anything issued before it (clocks permitting; ``at_least``
    covers the rest: ``specgate generation raise``).
    """
    floor = max(clock_ms(), at_least)
    bumped = FleetState.generation + 1
    session.execute(update(FleetState).where(FleetState.id == 1)
                    .values(generation=case((bumped > floor, bumped), else_=floor)))
    generation = int(session.scalar(select(FleetState.generation).where(FleetState.id == 1)) or 0)
    if session.get_bind().dialect.name == "postgresql":
        # NOTIFY is transactional: replicas hear it only if this change commits.
        session.execute(text("SELECT pg_notify(:channel, :payload)"),
                        {"channel": NOTIFY_CHANNEL, "payload": str(generation)})
    return generation
