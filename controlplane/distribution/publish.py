"""Announcing that bundles may have changed, inside the changing transaction."""

from __future__ import annotations

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from controlplane.models import FleetState

NOTIFY_CHANNEL = "specgate_bundle"


def bump_generation(session: Session) -> int:
    """Bump the distribution generation; PostgreSQL tells other replicas on commit."""
    session.execute(update(FleetState).where(FleetState.id == 1)
                    .values(generation=FleetState.generation + 1))
    generation = int(session.scalar(select(FleetState.generation).where(FleetState.id == 1)) or 0)
    if session.get_bind().dialect.name == "postgresql":
        # NOTIFY is transactional: replicas hear it only if this change commits.
        session.execute(text("SELECT pg_notify(:channel, :payload)"),
                        {"channel": NOTIFY_CHANNEL, "payload": str(generation)})
    return generation
