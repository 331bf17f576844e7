"""Request and response models of the keys API, and the closed set of key scopes."""

from __future__ import annotations

import datetime as dt
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

# PostgreSQL text cannot hold NUL: refusing it here makes such input a 422, not a driver error.
NO_NUL = r"^[^\x00]*$"


class Scope(StrEnum):
    admin = "admin"
    operator = "operator"
    worker = "worker"
    viewer = "viewer"


# Audited actors are "scope:name" in String(128) columns; the longest scope prefix must still fit.
ACTOR_MAX = 128
KEY_NAME_MAX = ACTOR_MAX - max(len(f"{s.value}:") for s in Scope)


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=KEY_NAME_MAX, pattern=NO_NUL, description="who or what uses the key")
    scope: Scope


class KeyRead(BaseModel):
    id: str
    name: str
    prefix: str
    scope: Scope
    created_by: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    revoked_at: dt.datetime | None


class KeyCreated(KeyRead):
    token: str = Field(description="the secret; shown only in this response")


class WhoAmI(BaseModel):
    key_id: str
    name: str
    scope: Scope
    actor: str = Field(description="how this key appears in the audit log, e.g. 'operator:olga'")
