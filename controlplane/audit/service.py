"""Every state change writes one audit event in the same transaction."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from controlplane.audit.repository import AuditRepository
from controlplane.models import AuditEvent


def record(session: Session, *, actor: str, action: str, target_type: str, target_id: str,
           before: dict[str, Any] | None = None, after: dict[str, Any] | None = None,
           reason: str = "") -> AuditEvent:
    return AuditRepository(session).add(AuditEvent(
        actor=actor, action=action, target_type=target_type, target_id=target_id,
        before=before, after=after, reason=reason,
    ))
