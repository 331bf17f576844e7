"""Request and response models of the keys API, and the closed set of key scopes."""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

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


# The worker API's own forms (controlplane.worker.schemas), restated: auth sits below the worker domain.
WORKER_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
POOL_PATTERN = r"^[^\x00-\x1f\x7f]*$"
# A key bound to more workers than this should be bound to their pool.
MAX_BOUND_WORKERS = 1000

BoundWorkerId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=WORKER_ID_PATTERN)]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=KEY_NAME_MAX, pattern=NO_NUL, description="who or what uses the key")
    scope: Scope
    pool: str | None = Field(None, min_length=1, max_length=128, pattern=POOL_PATTERN,
                             description="worker keys only: the key acts as any worker of this pool and "
                                         "registers workers only into it")
    worker_ids: list[BoundWorkerId] | None = Field(
        None, min_length=1, max_length=MAX_BOUND_WORKERS,
        description="worker keys only: the workers the key may act as. A worker key with neither this nor "
                    "`pool` binds itself to the first worker it registers")


class KeyRead(BaseModel):
    id: str
    name: str
    prefix: str
    scope: Scope
    created_by: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    revoked_at: dt.datetime | None
    pool: str | None = Field(description="worker keys: the pool the key is bound to")
    worker_ids: list[str] | None = Field(description="worker keys: the workers the key is bound to; "
                                         "null with a null pool: bound at its first registration")


class KeyCreated(KeyRead):
    token: str = Field(description="the secret; shown only in this response")


class WhoAmI(BaseModel):
    key_id: str
    name: str
    scope: Scope
    actor: str = Field(description="how this key appears in the audit log, e.g. 'operator:olga'")
