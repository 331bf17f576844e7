"""Request and response models of the telemetry API: batch envelopes and acks, rollup reports."""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints

from wire.problems import ProblemCode
from wire.telemetry import EVENT_SCHEMA_VERSION, RollupDelta, TelemetryEvent

# PostgreSQL text cannot hold NUL, and ids with control characters only confuse people.
NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"
MAX_EVENTS = 10_000
MAX_ROLLUPS = 10_000

BatchId = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=64, pattern=NO_CONTROL)]
WorkerId = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=128, pattern=NO_CONTROL)]


class BatchEnvelope(BaseModel):
    """The envelope of a ``wire.telemetry.TelemetryBatch``, checked strictly before any event is.

    Events are validated one by one afterwards (each with
    ``wire.telemetry.TelemetryEvent``), so that one bad event does not cost
    the batch.
    """

    model_config = ConfigDict(extra="forbid")

    batch_id: BatchId
    worker_id: WorkerId
    schema_version: StrictInt = Field(default=EVENT_SCHEMA_VERSION, ge=EVENT_SCHEMA_VERSION,
                                      le=EVENT_SCHEMA_VERSION)
    events: list[Any] = Field(max_length=MAX_EVENTS)
    rollups: list[Any] = Field(default_factory=list, max_length=MAX_ROLLUPS)


class ValidBatch(BatchEnvelope):
    """The strict envelope with every event and delta valid: the one-pass check of a batch with nothing bad."""

    events: list[TelemetryEvent] = Field(max_length=MAX_EVENTS)
    rollups: list[RollupDelta] = Field(default_factory=list, max_length=MAX_ROLLUPS)


class EventError(BaseModel):
    path: str = Field(description="field of the event at fault ('' for the event as a whole)")
    code: ProblemCode
    message: str


# A tiny gzipped batch of empty events would otherwise be echoed and stored as megabytes of reasons.
REJECTED_KEPT = 20


class RejectedEvent(BaseModel):
    index: int = Field(description="position of the event in the batch's events, from 0")
    errors: list[EventError]


class BatchAck(BaseModel):
    batch_id: str
    accepted: int = Field(description="events that validated (stored now or before)")
    stored: int = Field(description="events stored by this batch; an event id seen before is not stored again")
    rejected: list[RejectedEvent] = Field(
        description=f"the first {REJECTED_KEPT} events refused, each with its index and reasons")
    rejected_count: int = Field(description="events refused in all; `rejected` lists only the first few")
    duplicate: bool = Field(description="the batch id was received before: nothing was stored, and the "
                                        "counts are those of the first time")
    rollups_accepted: int = Field(0, description="rollup deltas that validated (added now or before)")
    rollups_stored: int = Field(0, description="rollup deltas added to the rollups by this batch; a delta id "
                                               "seen before from the same worker is not added again")
    rollups_rejected: list[RejectedEvent] = Field(
        default_factory=list, description=f"the first {REJECTED_KEPT} rollup deltas refused, each with its index "
                                          "in the batch's rollups and reasons")
    rollups_rejected_count: int = Field(0, description="rollup deltas refused in all")


class GroupBy(StrEnum):
    minute = "minute"
    policy = "policy"
    revision = "revision"
    route = "route"
    engine = "engine"
    batch_bucket = "batch_bucket"
    explored = "explored"
    k0 = "k0"


class Quantiles(BaseModel):
    p50: float | None
    p95: float | None
    p99: float | None


class RollupKeyRead(BaseModel):
    minute: dt.datetime | None = None
    policy: str | None = None
    revision: str | None = None
    route: str | None = None
    engine: str | None = None
    batch_bucket: int | None = Field(None, description="lower bound of the batch-size bucket")
    batch_range: str | None = Field(None, description="the batch-size bucket, e.g. '3-4' or '65+'")
    explored: bool | None = None
    k0: bool | None = Field(None, description="requests decided into a speculative engine's K=0 band (an "
                                                 "in-engine schedule's catch-all)")


class RollupGroupRead(BaseModel):
    key: RollupKeyRead = Field(description="the group_by fields of this group (the others are null)")
    counters: dict[str, int | float] = Field(description="merged rollup counters (analysis.rollup)")
    acceptance_rate: float | None = Field(description="accepted / drafted tokens; null when nothing was drafted")
    error_rate: float | None
    e2e_ms_mean: float | None
    ttft_ms_mean: float | None
    itl_ms_mean: float | None = Field(description="mean of the per-request mean inter-token latencies")
    itl_ms_token_weighted: float | None = Field(description="mean gap between output tokens over all tokens")
    ttft_ms: Quantiles = Field(description="from the rollup histograms: within one bucket (35 %) of exact")
    itl_ms: Quantiles
    e2e_ms: Quantiles


class RollupReport(BaseModel):
    group_by: list[GroupBy]
    groups: list[RollupGroupRead]
    truncated: bool = Field(description="more groups matched than `limit`")
