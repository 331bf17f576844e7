"""Every SQL statement of the audit log: append an event, search events newest first."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import String, cast, or_, select
from sqlalchemy.orm import Session

from controlplane.models import AuditEvent


class AuditRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, event: AuditEvent) -> AuditEvent:
        self.session.add(event)
        self.session.flush()
        return event

    def search(self, *, action: str | None, actor: str | None, target_type: str | None,
               target_id: str | None, text: str | None, before_id: int | None,
               limit: int) -> Sequence[AuditEvent]:
        """Newest first; ``before_id`` is the keyset cursor from the previous page."""
        query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
        if action:
            query = query.where(AuditEvent.action == action)
        if actor:
            query = query.where(AuditEvent.actor == actor)
        if target_type:
            query = query.where(AuditEvent.target_type == target_type)
        if target_id:
            query = query.where(AuditEvent.target_id == target_id)
        if text:
            pattern = f"%{text}%"
            query = query.where(or_(AuditEvent.reason.ilike(pattern), AuditEvent.action.ilike(pattern),
                                    AuditEvent.actor.ilike(pattern), AuditEvent.target_id.ilike(pattern),
                                    cast(AuditEvent.after, String).ilike(pattern),
                                    cast(AuditEvent.before, String).ilike(pattern)))
        if before_id is not None:
            query = query.where(AuditEvent.id < before_id)
        return self.session.scalars(query).all()
