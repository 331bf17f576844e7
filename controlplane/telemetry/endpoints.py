"""The telemetry API: workers send event batches (idempotent), readers query the per-minute rollups."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import re
from enum import StrEnum
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from controlplane.auth.service import Principal, WorkerGrant
from controlplane.db import unit_of_work
from controlplane.deps import Reader, SessionDep, WorkerKey
from controlplane.errors import AUTH_RESPONSES, INVALID_RESPONSE, TOO_LARGE_RESPONSE, ValidationFailed, problems
from controlplane.models import utcnow
from controlplane.telemetry import service
from controlplane.telemetry.repository import RollupFilter
from controlplane.telemetry.schemas import (
    NO_CONTROL,
    BatchAck,
    BatchEnvelope,
    GroupBy,
    Quantiles,
    RollupGroupRead,
    RollupKeyRead,
    RollupReport,
)
from wire.problems import ProblemCode
from wire.telemetry import TelemetryEvent

router = APIRouter(prefix="/v1/telemetry", tags=["telemetry"], responses=AUTH_RESPONSES)


def _batch_schema() -> dict[str, Any]:
    """The envelope as it is checked; events as what they are: anything, each judged on its own.

    A malformed event does not make the request invalid (it comes back in
    `rejected`), so the schema must not promise a refusal; the event schema is
    there to read.
    """
    schema = BatchEnvelope.model_json_schema()
    event = TelemetryEvent.model_json_schema()
    schema["properties"]["events"]["items"] = {
        "description": "a TelemetryEvent (first schema); anything else is refused on its own, by index",
        "anyOf": [event, {}],
    }
    return schema


_BATCH_BODY: dict[str, Any] = {
    "required": True,
    "description": "A TelemetryBatch (wire/telemetry.py) as JSON, plain or with `Content-Encoding: gzip`.",
    "content": {"application/json": {"schema": _batch_schema()}},
}


def _parse(request: Request, body: bytes) -> service.ParsedBatch:
    settings = request.app.state.settings
    raw = service.decode_body(body, content_type=request.headers.get("content-type"),
                              content_encoding=request.headers.get("content-encoding"),
                              max_decompressed=settings.max_body_bytes * service.DECOMPRESSION_FACTOR)
    return service.parse_batch(raw, service.EventWindow.from_settings(settings, utcnow()))


def _store(app: Any, batch: service.ParsedBatch, who: Principal) -> service.IngestResult:
    with unit_of_work(app.state.sessions) as session:
        return service.ingest(session, batch, sent_by=who.actor, received_at=utcnow(),
                              grant=WorkerGrant(session, who))


def _gate(app: Any) -> asyncio.Semaphore:
    """How many ingest transactions this process runs at once (created on first use, in the app's loop).

    Every batch updates the same hot rollup rows; beyond a few concurrent
    transactions they only queue on those rows' locks inside the database,
    which costs it more CPU per event than waiting here (bench/ingest.py).
    SQLite has one writer at a time: there the gate is 1, so batches wait
    here instead of polling SQLite's busy handler.
    """
    loop = asyncio.get_running_loop()
    held: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None
    held = getattr(app.state, "telemetry_ingest_gate", None)
    if held is None or held[0] is not loop:  # a semaphore belongs to one loop (tests start several)
        sqlite = app.state.engine.dialect.name == "sqlite"
        held = (loop, asyncio.Semaphore(1 if sqlite else app.state.settings.telemetry_ingest_concurrency))
        app.state.telemetry_ingest_gate = held
    return held[1]


def _count(app: Any, result: service.IngestResult) -> None:
    metrics = app.state.metrics
    ack = result.ack
    if ack.duplicate:
        metrics.telemetry_batches.labels("duplicate").inc()
        return
    metrics.telemetry_batches.labels("new").inc()
    metrics.telemetry_events.labels("stored").inc(ack.stored)
    metrics.telemetry_events.labels("already_stored").inc(result.already_stored)
    metrics.telemetry_events.labels("rejected").inc(ack.rejected_count)
    metrics.telemetry_rollup_deltas.labels("stored").inc(ack.rollups_stored)
    metrics.telemetry_rollup_deltas.labels("already_stored").inc(ack.rollups_accepted - ack.rollups_stored)
    metrics.telemetry_rollup_deltas.labels("rejected").inc(ack.rollups_rejected_count)
    metrics.telemetry_represented_requests.inc(result.represented)


@router.post(
    "/batches", response_model=BatchAck,
    openapi_extra={"requestBody": _BATCH_BODY},
    responses={**problems({400: "the body is not valid gzip",
                           415: "a Content-Type other than application/json, or a Content-Encoding "
                                "other than gzip"}),
               **TOO_LARGE_RESPONSE, **INVALID_RESPONSE},
    description="Ingest a batch of telemetry events (worker keys). Each event is validated on its own: "
                "bad ones come back in `rejected` with their index and reasons, the others are stored. "
                "Idempotent by `batch_id` (a replay answers `duplicate: true` with the first answer's "
                "counts) and by event id (an event stored before is not stored or counted again).",
)
async def ingest_batch(request: Request, who: WorkerKey) -> BatchAck:
    body = await request.body()
    # Inflating, validating and storing a batch is CPU and database work: off the event loop.
    batch = await run_in_threadpool(_parse, request, body)
    async with _gate(request.app):  # waiting here holds no thread
        result = await run_in_threadpool(_store, request.app, batch, who)
    _count(request.app, result)
    return result.ack


_DATETIME: TypeAdapter[dt.datetime] = TypeAdapter(dt.datetime)
_DATE_TIME_START = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}")


def _utc(value: str | None, name: str) -> dt.datetime | None:
    """An ISO 8601 date-time (no zone: UTC) in UTC; numbers and bare dates are refused."""
    if value is None:
        return None
    problem = {"path": name, "in": "query", "code": ProblemCode.wrong_type, "message": "must be an ISO 8601 date-time"}
    when: dt.datetime | None = None
    if _DATE_TIME_START.match(value):  # pydantic alone would read "1700000000" as a Unix time
        with contextlib.suppress(ValidationError):
            when = _DATETIME.validate_json(json.dumps(value), strict=True)
    if when is None:
        raise ValidationFailed(f"`{name}` is not a date-time", errors=[problem])
    try:
        return when.replace(tzinfo=dt.UTC) if when.tzinfo is None else when.astimezone(dt.UTC)
    except OverflowError:
        problem.update(code=ProblemCode.out_of_range, message="is out of range in UTC")
        raise ValidationFailed(f"`{name}` is out of range in UTC", errors=[problem]) from None


# For other domains' query parameters: the same reading of a date-time.
parse_utc = _utc


_G = TypeVar("_G", bound=StrEnum)


def parse_group_by(values: list[str], kind: type[_G]) -> list[_G]:
    """Read repeated and comma-separated ``group_by`` values into ``kind``, in order, once each.

    Shared with other domains' query parameters so a bad value is the same 422 everywhere."""
    out: list[_G] = []
    errors = []
    for i, value in enumerate(part.strip() for item in values for part in item.split(",")):
        if not value:
            continue
        try:
            group = kind(value)
        except ValueError:
            errors.append({"path": f"group_by[{i}]", "in": "query", "code": ProblemCode.invalid_value,
                           "message": f"{value!r} is not one of: {', '.join(g.value for g in kind)}"})
            continue
        if group not in out:
            out.append(group)
    if errors:
        raise ValidationFailed(f"{len(errors)} group_by value{'s' if len(errors) != 1 else ''} not known",
                               errors=errors)
    return out


Text = Annotated[str | None, Query(max_length=128, pattern=NO_CONTROL)]


@router.get(
    "/rollups", response_model=RollupReport, responses=INVALID_RESPONSE,
    description="Merged per-minute rollups, grouped by any of minute, policy, revision, route, engine, "
                "batch_bucket, explored, k0 (decided into a speculative engine's K=0 band). A rollup minute counts "
                "when `from <= minute < to`. Latency quantiles "
                "come from the merged histograms (fixed log buckets, 35 % wide).",
)
def rollups(
    session: SessionDep, _: Reader,
    policy: Text = None, revision: Text = None, route: Text = None, engine: Text = None,
    explored: bool | None = None,
    k0: Annotated[bool | None, Query(description="only requests decided into an engine's K=0 band (true) or "
                                                 "not (false)")] = None,
    start: Annotated[str | None, Query(alias="from", max_length=64, json_schema_extra={"format": "date-time"},
                                       description="ISO 8601 date-time; no zone means UTC")] = None,
    end: Annotated[str | None, Query(alias="to", max_length=64, json_schema_extra={"format": "date-time"},
                                     description="ISO 8601 date-time, exclusive")] = None,
    group_by: Annotated[list[str], Query(max_length=20, description="repeat, or comma-separate: "
                                         "minute, policy, revision, route, engine, batch_bucket, explored, k0")] = [],  # noqa: B006
    limit: Annotated[int, Query(ge=1, le=10_000, description="most groups returned")] = 1000,
) -> RollupReport:
    groups = parse_group_by(group_by, GroupBy)
    since, until = _utc(start, "from"), _utc(end, "to")
    if since is not None and until is not None and since >= until:
        raise ValidationFailed("`from` must be before `to`", errors=[
            {"path": "to", "in": "query", "code": ProblemCode.before_from, "message": "must be after `from`"}])
    flt = RollupFilter(policy=policy, revision=revision, route=route, engine=engine, explored=explored,
                       k0=k0, start=since, end=until)
    summaries, truncated = service.summarize(session, flt, [g.value for g in groups], limit)
    return RollupReport(group_by=groups, groups=[_group_read(s) for s in summaries], truncated=truncated)


def _quantiles(summary: service.RollupSummary, metric: str) -> Quantiles:
    return Quantiles(p50=summary.quantile(metric, 0.5), p95=summary.quantile(metric, 0.95),
                     p99=summary.quantile(metric, 0.99))


def _group_read(s: service.RollupSummary) -> RollupGroupRead:
    return RollupGroupRead(
        key=RollupKeyRead(**service.describe_key(s.key)),
        counters=s.counters,
        acceptance_rate=s.acceptance_rate,
        error_rate=s.ratio("errors", "requests"),
        e2e_ms_mean=s.ratio("e2e_ms_sum", "requests"),
        ttft_ms_mean=s.ratio("ttft_ms_sum", "ttft_count"),
        itl_ms_mean=s.ratio("itl_ms_sum", "itl_count"),
        itl_ms_token_weighted=s.ratio("itl_weighted_ms_sum", "itl_weighted_tokens"),
        ttft_ms=_quantiles(s, "ttft"), itl_ms=_quantiles(s, "itl"), e2e_ms=_quantiles(s, "e2e"),
    )
