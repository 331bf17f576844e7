from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request

from controlplane.audit.repository import AuditRepository
from controlplane.audit.schemas import AuditEventRead, AuditPage
from controlplane.auth.dependencies import READ, require
from controlplane.auth.service import Principal
from controlplane.db import unit_of_work

router = APIRouter(prefix="/v1/audit", tags=["audit"])


@router.get("", response_model=AuditPage)
def search(request: Request,
           action: str | None = Query(None, max_length=64),
           actor: str | None = Query(None, max_length=128),
           target_type: str | None = Query(None, max_length=32),
           target_id: str | None = Query(None, max_length=128),
           q: str | None = Query(None, max_length=200, description="text in reason, action, actor or target"),
           cursor: int | None = Query(None, ge=0, description="next_cursor of the previous page"),
           limit: int = Query(50, ge=1, le=500),
           _: Principal = Depends(require(*READ))) -> AuditPage:
    with unit_of_work(request.app.state.sessions) as session:
        rows = AuditRepository(session).search(action=action, actor=actor, target_type=target_type,
                                               target_id=target_id, text=q, before_id=cursor, limit=limit)
        items = [AuditEventRead.model_validate(r, from_attributes=True) for r in rows]
    return AuditPage(items=items, next_cursor=items[-1].id if len(items) == limit else None)
