"""Request and response models of the workers API: registration, heartbeats, worker pages, the fleet."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from controlplane.distribution.service import normalize_etag

WORKER_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
# PostgreSQL refuses NUL in text, and names with control characters only confuse people.
NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"
NO_NUL = r"^[^\x00]*$"

WorkerId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=WORKER_ID_PATTERN)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_CONTROL)]
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=NO_CONTROL)]
LabelValue = Annotated[str, StringConstraints(max_length=256, pattern=NO_CONTROL)]
EngineName = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=NO_CONTROL)]
EngineDescription = Annotated[str, StringConstraints(max_length=2048, pattern=NO_NUL)]
Short = Annotated[str, StringConstraints(max_length=64, pattern=NO_CONTROL)]


class WorkerRegister(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: WorkerId = Field(description="stable id of the worker: letters, digits and _ . : -")
    pool: Name = Field(description="the pool whose policy the worker runs")
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64,
                                               description="labels rollouts may target")
    engines: dict[EngineName, EngineDescription] = Field(
        default_factory=dict, max_length=64, description="engine variants offered: name -> url or text")
    sidecar_version: Short | None = None


class WorkerHeartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    active_revision: Short | None = Field(None, description="revision the worker runs now")
    active_etag: Short | None = Field(None, description="ETag of the bundle it runs now, quoted or bare")
    # Strict: JSON false is not a count, though Python would read it as 0.
    in_flight: int | None = Field(None, ge=0, strict=True,
                                  description="requests in flight (informational, not stored)")

    @field_validator("active_etag", mode="before")
    @classmethod
    def _bare_etag(cls, value: object) -> object:
        # Stored bare, as the expected ETag is, so the two compare; checked for length afterwards.
        return normalize_etag(value) if isinstance(value, str) else value


class HeartbeatAck(BaseModel):
    expected_etag: str | None = Field(description="the ETag /v1/bundle would serve this worker now; "
                                      "null when no policy applies to it")
    converged: bool = Field(description="whether the reported ETag is the expected one")


class WorkerRead(BaseModel):
    id: str
    pool: str
    labels: dict[str, str]
    engines: dict[str, str]
    sidecar_version: str | None
    registered_at: dt.datetime
    last_heartbeat_at: dt.datetime
    active_revision: str | None
    active_etag: str | None
    expected_etag: str | None
    stale: bool = Field(description="no heartbeat for longer than SPECGATE_WORKER_STALE_AFTER_S")
    converged: bool = Field(description="the reported ETag is the expected one")


class WorkerPage(BaseModel):
    items: list[WorkerRead]
    next_cursor: str | None = Field(description="pass as cursor for the next page; null on the last page")


class RevisionCount(BaseModel):
    revision: str | None = Field(description="revision reported by workers; null when they report none")
    workers: int


class FleetGroup(BaseModel):
    workers: int
    stale: int
    converged_workers: int = Field(description="non-stale workers reporting their expected ETag")
    converged: bool = Field(description="every non-stale worker reports its expected ETag")
    revisions: list[RevisionCount] = Field(description="revisions non-stale workers report running")


class PoolFleet(FleetGroup):
    pool: str


class FleetRead(BaseModel):
    generation: int
    kill_switch: bool
    stale_after_s: float
    overall: FleetGroup
    pools: list[PoolFleet]
