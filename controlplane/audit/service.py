"""Every state change writes one audit event in the same transaction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from controlplane.audit.repository import AuditRepository
from controlplane.models import AuditEvent

# Every key may read the audit log, viewers included, so no part of a credential may enter it: a key's
# `prefix` is the first characters of its secret token. Events recorded before this rule may still hold
# one in the database; they are cleaned when read (see redact).
SECRET_FIELDS = frozenset({"prefix", "token", "secret", "secret_hash"})
KEY_TARGET = "api_key"


def redact(target_type: str, target_id: str, values: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``values`` without secret fields; a key's event names the key by its (non-secret) id instead."""
    if values is None:
        return None
    kept = {k: v for k, v in values.items() if k not in SECRET_FIELDS}
    if target_type == KEY_TARGET and len(kept) < len(values):
        kept.setdefault("key_id", target_id)
    return kept


def record(session: Session, *, actor: str, action: str, target_type: str, target_id: str,
           before: dict[str, Any] | None = None, after: dict[str, Any] | None = None,
           reason: str = "") -> AuditEvent:
    return AuditRepository(session).add(AuditEvent(
        actor=actor, action=action, target_type=target_type, target_id=target_id,
        before=redact(target_type, target_id, before), after=redact(target_type, target_id, after),
        reason=reason,
    ))
