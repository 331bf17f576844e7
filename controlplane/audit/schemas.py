"""Response models of the audit API: one event, and a page of events."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel

# PostgreSQL text cannot hold NUL: a filter with one is a 422, not a driver error.
NO_NUL = r"^[^\x00]*$"


class AuditEventRead(BaseModel):
    id: int
    at: dt.datetime
    actor: str
    action: str
    target_type: str
    target_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    reason: str


class AuditPage(BaseModel):
    items: list[AuditEventRead]
    next_cursor: int | None
