"""The audit API: search the log of every change, newest first."""

from __future__ import annotations

from fastapi import APIRouter, Query

from controlplane.audit.repository import AuditRepository
from controlplane.audit.schemas import NO_NUL, AuditEventRead, AuditPage
from controlplane.audit.service import redact
from controlplane.deps import Reader, SessionDep
from controlplane.errors import AUTH_RESPONSES, INVALID_RESPONSE

router = APIRouter(prefix="/v1/audit", tags=["audit"], responses=AUTH_RESPONSES)


@router.get("", response_model=AuditPage, responses=INVALID_RESPONSE)
def search(session: SessionDep, _: Reader,
           action: str | None = Query(None, max_length=64, pattern=NO_NUL),
           actor: str | None = Query(None, max_length=128, pattern=NO_NUL),
           target_type: str | None = Query(None, max_length=32, pattern=NO_NUL),
           target_id: str | None = Query(None, max_length=128, pattern=NO_NUL),
           q: str | None = Query(None, max_length=200, pattern=NO_NUL,
                                 description="text in reason, action, actor or target"),
           # Ids are signed 64-bit: a larger cursor would overflow the driver (a 500), not match nothing.
           cursor: int | None = Query(None, ge=0, le=2**63 - 1, description="next_cursor of the previous page"),
           limit: int = Query(50, ge=1, le=500)) -> AuditPage:
    rows = AuditRepository(session).search(action=action, actor=actor, target_type=target_type,
                                           target_id=target_id, text=q, before_id=cursor, limit=limit)
    items = [AuditEventRead(id=r.id, at=r.at, actor=r.actor, action=r.action, target_type=r.target_type,
                            target_id=r.target_id, reason=r.reason,
                            before=redact(r.target_type, r.target_id, r.before),
                            after=redact(r.target_type, r.target_id, r.after)) for r in rows]
    return AuditPage(items=items, next_cursor=items[-1].id if len(items) == limit else None)
