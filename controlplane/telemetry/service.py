"""Telemetry ingest, retention and rollup reads. Services never commit: the caller owns the unit of work.

Ingest of one batch, in one transaction:

1. the batch id is claimed in ``telemetry_batches`` (``ON CONFLICT DO
   NOTHING``); when it was there already the batch is a replay, answered from
   that row, and nothing else happens;
2. the valid events are inserted into ``telemetry_events``
   (``ON CONFLICT (event_id) DO NOTHING RETURNING event_id``; on PostgreSQL,
   whose table is partitioned by day, the key is ``(event_id, time)`` and a
   resent event carries its time), so an event that arrives in two batches is
   stored once;
3. only the events actually inserted are aggregated in memory
   (:func:`analysis.rollup.aggregate`) and added to the
   per-minute rollups and their histograms (``ON CONFLICT DO UPDATE SET
   n = n + excluded.n``).

So the rollups always equal the same aggregate over the raw events, however
batches are replayed, split or duplicated.
"""

from __future__ import annotations

import datetime as dt
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails, from_json
from sqlalchemy.orm import Session

from analysis.buckets import batch_bucket_label
from analysis.histogram import METRICS, quantile
from analysis.rollup import COUNTERS, KEY_FIELDS, RollupKey, add_delta, aggregate
from analysis.rollup import RollupDelta as Sums
from controlplane.auth.service import WorkerGrant
from controlplane.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType, ValidationFailed
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry.repository import PurgeCounts, RollupFilter, TelemetryRepository
from controlplane.telemetry.schemas import REJECTED_KEPT, BatchAck, BatchEnvelope, EventError, RejectedEvent, ValidBatch
from wire.problems import ProblemCode, problem_code
from wire.telemetry import RollupDelta, TelemetryEvent

# A gzip body may inflate to this many times SPECGATE_MAX_BODY_BYTES, no more (zip bombs).
DECOMPRESSION_FACTOR = 16
JSON_TYPE = "application/json"
# Errors kept per rejected event (an object with thousands of unknown keys has thousands).
MAX_ERRORS_PER_EVENT = 10
_PROBLEM_CODES = frozenset(code.value for code in ProblemCode)


# --- decoding and validation ------------------------------------------------------------------

class EventWindow:
    """The span of event times accepted around a batch's receipt: far-past events would be purged at once,
    future ones would never be (retention cuts by ``time``)."""

    __slots__ = ("earliest", "latest", "_tz", "_bounds")

    def __init__(self, earliest: dt.datetime, latest: dt.datetime) -> None:
        self.earliest = earliest
        self.latest = latest
        self._tz: dt.tzinfo | None = None
        self._bounds = (earliest, latest)

    @classmethod
    def around(cls, received_at: dt.datetime, *, max_age_s: float, max_skew_s: float,
               retention_days: int) -> EventWindow:
        back = min(dt.timedelta(seconds=max_age_s), dt.timedelta(days=retention_days))
        return cls(received_at - back, received_at + dt.timedelta(seconds=max_skew_s))

    def check_minute(self, minute: dt.datetime) -> EventError | None:
        """A rollup delta's minute: accepted when any instant of it is inside the window."""
        if minute + dt.timedelta(minutes=1) <= self.earliest:
            return EventError(path="minute", code=ProblemCode.out_of_range,
                              message=f"ends before {self.earliest.isoformat()}, the oldest time accepted now "
                                      "(SPECGATE_TELEMETRY_MAX_EVENT_AGE_S)")
        if minute > self.latest:
            return EventError(path="minute", code=ProblemCode.out_of_range,
                              message=f"is after {self.latest.isoformat()}, more than "
                                      "SPECGATE_TELEMETRY_MAX_CLOCK_SKEW_S ahead of the control plane's clock")
        return None

    @classmethod
    def from_settings(cls, settings: ControlPlaneSettings, received_at: dt.datetime) -> EventWindow:
        return cls.around(received_at, max_age_s=settings.telemetry_max_event_age_s,
                          max_skew_s=settings.telemetry_max_clock_skew_s,
                          retention_days=settings.telemetry_retention_days)

    def check(self, time: dt.datetime) -> EventError | None:
        """``time`` is in UTC (any tzinfo of offset 0), as ``_to_utc`` leaves it."""
        tz = time.tzinfo
        if tz is not self._tz:
            # Aware datetimes with the same tzinfo object compare field by field; with different ones each
            # comparison asks both for their offset. The events of a batch share one (pydantic's UTC or
            # ours), so the bounds are kept in it.
            self._tz = tz
            self._bounds = (self.earliest.astimezone(tz), self.latest.astimezone(tz))
        earliest, latest = self._bounds
        if earliest <= time <= latest:
            return None
        if time < earliest:
            return EventError(path="time", code=ProblemCode.out_of_range,
                              message=f"is before {self.earliest.isoformat()}, the oldest time accepted now "
                                      "(SPECGATE_TELEMETRY_MAX_EVENT_AGE_S)")
        return EventError(path="time", code=ProblemCode.out_of_range,
                          message=f"is after {self.latest.isoformat()}, more than "
                                  "SPECGATE_TELEMETRY_MAX_CLOCK_SKEW_S ahead of the control plane's clock")


@dataclass(slots=True)
class ParsedBatch:
    batch_id: str
    worker_id: str
    event_count: int
    events: list[TelemetryEvent]  # the valid ones, in batch order
    rejected: list[RejectedEvent]
    # a pre-aggregating worker's rollup deltas: how many came, the valid ones in order, the refused ones
    rollup_count: int = 0
    rollups: list[RollupDelta] = field(default_factory=list)
    rollups_rejected: list[RejectedEvent] = field(default_factory=list)


def _media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def gunzip_bounded(data: bytes, limit: int) -> bytes:
    """Inflate a gzip body (one or more members) without ever holding more than ``limit + 1`` bytes."""
    out = bytearray()
    rest = data
    while True:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            out += inflater.decompress(rest, limit + 1 - len(out))
            while inflater.unconsumed_tail and len(out) <= limit:
                out += inflater.decompress(inflater.unconsumed_tail, limit + 1 - len(out))
        except zlib.error as exc:
            raise BadRequest(f"the body is not valid gzip: {exc}", errors=[
                {"path": "body", "in": "body", "code": ProblemCode.invalid_gzip, "message": str(exc)}]) from None
        if len(out) > limit:
            raise PayloadTooLarge(f"the body inflates to more than {limit} bytes")
        if not inflater.eof:
            raise BadRequest("the gzip body is truncated", errors=[
                {"path": "body", "in": "body", "code": ProblemCode.invalid_gzip,
                 "message": "the gzip stream ends early"}])
        rest = inflater.unused_data
        if not rest:
            return bytes(out)


def decode_body(body: bytes, *, content_type: str | None, content_encoding: str | None,
                max_decompressed: int) -> bytes:
    media = _media_type(content_type)
    if media not in ("", JSON_TYPE):
        message = f"Content-Type {media!r} is not accepted; send {JSON_TYPE}"
        raise UnsupportedMediaType(message, errors=[
            {"path": "Content-Type", "in": "header", "code": ProblemCode.unsupported_media_type, "message": message}])
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "x-gzip"):
        return gunzip_bounded(body, max_decompressed)
    message = f"Content-Encoding {encoding!r} is not accepted; send gzip or none"
    raise UnsupportedMediaType(message, errors=[
        {"path": "Content-Encoding", "in": "header", "code": ProblemCode.unsupported_encoding, "message": message}])


def _path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _event_errors(errors: Sequence[ErrorDetails]) -> list[EventError]:
    return [EventError(path=_path(e["loc"]), code=problem_code(e), message=e["msg"])
            for e in errors[:MAX_ERRORS_PER_EVENT]]


def _as_utc(time: dt.datetime, path: str) -> dt.datetime | EventError:
    """``time`` in UTC: a time without a zone is taken as UTC, as the contract says times are."""
    offset = time.utcoffset()
    if offset is None:
        return time.replace(tzinfo=dt.UTC)
    if not offset:
        return time
    try:
        return time.astimezone(dt.UTC)
    except OverflowError:
        return EventError(path=path, code=ProblemCode.out_of_range, message="is out of range in UTC")


def _to_utc(event: TelemetryEvent, window: EventWindow | None) -> EventError | None:
    """Normalize ``time`` to UTC and hold it to the window."""
    time = _as_utc(event.time, "time")
    if isinstance(time, EventError):
        return time
    event.time = time
    return None if window is None else window.check(time)


def _envelope_failed(exc: ValidationError) -> ValidationFailed:
    errors = [{"path": _path(e["loc"]), "in": "body", "code": problem_code(e), "message": e["msg"]}
              for e in exc.errors(include_url=False)]
    n = len(errors)
    return ValidationFailed(f"the batch envelope has {n} error{'s' if n != 1 else ''}", errors=errors)


def parse_batch(raw: bytes, window: EventWindow | None = None) -> ParsedBatch:
    """Validate a TelemetryBatch: the envelope strictly (422), then each event on its own.

    With ``window``, an event whose time falls outside it is refused on its own (``time``,
    ``out_of_range``); the ingest endpoint always gives one.

    Events are validated against the contract, ``wire.telemetry.TelemetryEvent``,
    which includes the store's limits. The common case, a batch whose every
    event is valid, is validated in one pass; when that fails, the batch is
    taken apart and each event validated on its own, so that the bad ones are
    refused with their index and the good ones kept.
    """
    try:
        whole = ValidBatch.model_validate_json(raw)
    except ValidationError:
        return _parse_event_by_event(raw, window)
    events: list[TelemetryEvent] = []
    rejected: list[RejectedEvent] = []
    for index, event in enumerate(whole.events):
        problem = _to_utc(event, window)
        if problem is not None:
            rejected.append(RejectedEvent(index=index, errors=[problem]))
        else:
            events.append(event)
    rollups, rollups_rejected = _deltas_in_window(whole.rollups, window)
    return ParsedBatch(whole.batch_id, whole.worker_id, len(whole.events), events, rejected,
                       len(whole.rollups), rollups, rollups_rejected)


def _delta_to_utc(delta: RollupDelta, window: EventWindow | None) -> EventError | None:
    """A delta's minute in UTC, held to the window."""
    minute = _as_utc(delta.minute, "minute")
    if isinstance(minute, EventError):
        return minute
    delta.minute = minute
    return None if window is None else window.check_minute(minute)


def _deltas_in_window(deltas: Sequence[RollupDelta],
                      window: EventWindow | None) -> tuple[list[RollupDelta], list[RejectedEvent]]:
    kept: list[RollupDelta] = []
    refused: list[RejectedEvent] = []
    for index, delta in enumerate(deltas):
        problem = _delta_to_utc(delta, window)
        if problem is None:
            kept.append(delta)
        else:
            refused.append(RejectedEvent(index=index, errors=[problem]))
    return kept, refused


def _parse_event_by_event(raw: bytes, window: EventWindow | None) -> ParsedBatch:
    try:
        # pydantic-core's parser, as in the one-pass check: the same bodies are JSON for both
        # (it refuses, for instance, lone UTF-16 surrogates that no database can store).
        data = from_json(raw)
    except ValueError as exc:
        message = str(exc) or "not UTF-8 JSON, or nested too deeply"
        raise ValidationFailed(f"the body is not valid JSON: {message}", errors=[
            {"path": "body", "in": "body", "code": ProblemCode.invalid_json, "message": message}]) from None
    if not isinstance(data, dict):
        raise ValidationFailed("the body must be a JSON object (a TelemetryBatch)", errors=[
            {"path": "", "in": "body", "code": ProblemCode.wrong_type, "message": "must be a JSON object"}])
    try:
        envelope = BatchEnvelope.model_validate(data)
    except ValidationError as exc:
        raise _envelope_failed(exc) from None
    events: list[TelemetryEvent] = []
    rejected: list[RejectedEvent] = []
    for index, item in enumerate(envelope.events):
        try:
            event = TelemetryEvent.model_validate(item)
        except ValidationError as exc:
            rejected.append(RejectedEvent(index=index, errors=_event_errors(exc.errors(include_url=False))))
            continue
        problem = _to_utc(event, window)
        if problem is not None:
            rejected.append(RejectedEvent(index=index, errors=[problem]))
        else:
            events.append(event)
    valid: list[RollupDelta] = []
    invalid: list[RejectedEvent] = []
    for index, item in enumerate(envelope.rollups):
        try:
            valid.append(RollupDelta.model_validate(item))
        except ValidationError as exc:
            invalid.append(RejectedEvent(index=index, errors=_event_errors(exc.errors(include_url=False))))
    rollups, out_of_window = _deltas_in_window(valid, window)
    # the indices of the window's refusals are among the valid deltas: back to the batch's
    invalid_at = {r.index for r in invalid}
    valid_at = [i for i in range(len(envelope.rollups)) if i not in invalid_at]
    for refusal in out_of_window:
        refusal.index = valid_at[refusal.index]
    return ParsedBatch(envelope.batch_id, envelope.worker_id, len(envelope.events), events, rejected,
                       len(envelope.rollups), rollups, sorted([*invalid, *out_of_window], key=lambda r: r.index))


# --- ingest -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class IngestResult:
    ack: BatchAck
    # valid events that were stored before (by another batch, or twice in this one)
    already_stored: int
    # the requests this batch added to the rollups: its new events rolled up on arrival, and its new deltas'
    represented: int = 0


def _refuse_foreign(batch: ParsedBatch, grant: WorkerGrant, repo: TelemetryRepository) -> None:
    """Move the events a worker key may not send from ``events`` to ``rejected``, in place.

    A worker key's events must be for its own workers (``worker_id``), claim the pool the worker is
    registered in (``pool``), and name the policy that serves that pool, or the pool-less one (``policy``):
    guardrails and recommendations select by policy and revision, so a key must not skew another pool's
    rollout. The worker's pool is read once for the batch's distinct workers and the serving policies once for
    its distinct pools, so the per-event cost is a few dict lookups.
    """
    if not batch.events:
        return
    ids = {e.worker_id for e in batch.events}
    allowed = grant.allowed(ids)
    pools = grant.pools_of(allowed)
    serving = repo.policies_serving({e.pool for e in batch.events})
    poolless = serving.get(None)

    def refusal(event: TelemetryEvent) -> EventError | None:
        if event.worker_id not in allowed:
            return EventError(path="worker_id", code=ProblemCode.worker_not_allowed,
                              message=f"the key may not act as worker {event.worker_id!r}")
        expected = pools[event.worker_id]
        if expected is not None and event.pool != expected:
            return EventError(path="pool", code=ProblemCode.pool_mismatch,
                              message=f"worker {event.worker_id!r} is in pool {expected!r}, not {event.pool!r}")
        if event.policy not in (serving.get(event.pool), poolless):
            return EventError(path="policy", code=ProblemCode.wrong_policy,
                              message=f"policy {event.policy!r} does not serve pool {event.pool!r}")
        return None

    refusals = [refusal(e) for e in batch.events]
    if not any(refusals):
        return
    # The valid events' indices are those the parse did not reject, in batch order.
    refused_at = {r.index for r in batch.rejected}
    indices = (i for i in range(batch.event_count) if i not in refused_at)
    kept: list[TelemetryEvent] = []
    refused: list[RejectedEvent] = []
    for index, event, error in zip(indices, batch.events, refusals, strict=False):
        if error is None:
            kept.append(event)
        else:
            refused.append(RejectedEvent(index=index, errors=[error]))
    batch.events = kept
    batch.rejected = sorted([*batch.rejected, *refused], key=lambda r: r.index)


def ingest(session: Session, batch: ParsedBatch, *, sent_by: str, received_at: dt.datetime,
           grant: WorkerGrant | None = None) -> IngestResult:
    """Store a parsed batch once: its new events, and their rollups; see the module docstring.

    With ``grant``, the batch's ``worker_id`` must be a worker the key may act as (403), and each event
    a worker key may not send is refused on its own, never stored: for another worker (``worker_id``,
    ``worker_not_allowed``), claiming another pool than its worker's (``pool``, ``pool_mismatch``) or a
    policy that does not serve its pool (``policy``, ``wrong_policy``)."""
    repo = TelemetryRepository(session)
    if grant is not None:
        # Stored as the batch's sender: it must be the key's own worker, registered or not.
        grant.check(batch.worker_id, unregistered_passes=False)
        _refuse_foreign(batch, grant, repo)
        _refuse_foreign_deltas(batch, grant, repo)
    kept = batch.rejected[:REJECTED_KEPT]
    rejected = [r.model_dump() for r in kept]
    deltas_kept = batch.rollups_rejected[:REJECTED_KEPT]
    claimed = repo.claim_batch({
        "batch_id": batch.batch_id, "worker_id": batch.worker_id, "sent_by": sent_by,
        "received_at": received_at, "event_count": batch.event_count, "accepted": len(batch.events),
        "stored": 0, "rejected": rejected, "rollup_count": batch.rollup_count,
        "rollups_accepted": len(batch.rollups), "rollups_stored": 0,
        "rollups_rejected": [r.model_dump() for r in deltas_kept] if batch.rollup_count else None,
    })
    if not claimed:
        first = repo.batch(batch.batch_id)
        if first is None:  # pragma: no cover - the conflicting row is committed when DO NOTHING sees it
            raise RuntimeError(f"batch {batch.batch_id!r} conflicted but cannot be read")
        ack = BatchAck(batch_id=first.batch_id, accepted=first.accepted, stored=first.stored,
                       rejected=[_stored_rejection(r) for r in first.rejected],
                       rejected_count=first.event_count - first.accepted, duplicate=True,
                       rollups_accepted=first.rollups_accepted, rollups_stored=first.rollups_stored,
                       rollups_rejected=[_stored_rejection(r) for r in first.rollups_rejected or []],
                       rollups_rejected_count=first.rollup_count - first.rollups_accepted)
        return IngestResult(ack, already_stored=0)

    unique: dict[str, TelemetryEvent] = {}
    for event in batch.events:
        unique.setdefault(event.event_id, event)
    # Sorted, so that two transactions inserting the same ids take their locks in one order.
    ordered = [unique[event_id] for event_id in sorted(unique)]
    inserted = repo.insert_events(ordered, batch_id=batch.batch_id, received_at=received_at)
    fresh = [e for e in ordered if e.event_id in inserted]
    fresh_deltas = _fresh_deltas(repo, batch, received_at)
    # A sampled event's request is in its worker's deltas: stored, never rolled up again.
    rolled_up = [e for e in fresh if e.sample_weight is None]
    _add_to_rollups(repo, rolled_up, fresh_deltas)
    repo.set_batch_stored(batch.batch_id, len(fresh), len(fresh_deltas))
    ack = BatchAck(batch_id=batch.batch_id, accepted=len(batch.events), stored=len(fresh),
                   rejected=kept, rejected_count=len(batch.rejected), duplicate=False,
                   rollups_accepted=len(batch.rollups), rollups_stored=len(fresh_deltas),
                   rollups_rejected=deltas_kept, rollups_rejected_count=len(batch.rollups_rejected))
    represented = len(rolled_up) + sum(int(d.counters["requests"]) for d in fresh_deltas)
    return IngestResult(ack, already_stored=len(batch.events) - len(fresh), represented=represented)


def _fresh_deltas(repo: TelemetryRepository, batch: ParsedBatch, received_at: dt.datetime) -> list[RollupDelta]:
    """The batch's deltas not added before: each (worker, delta id) is recorded once, the first time."""
    if not batch.rollups:
        return []
    unique: dict[str, RollupDelta] = {}
    for delta in batch.rollups:
        unique.setdefault(delta.delta_id, delta)
    ordered = [unique[delta_id] for delta_id in sorted(unique)]  # one lock order, as for events
    added = repo.record_deltas(batch.worker_id, [(d.delta_id, d.minute) for d in ordered],
                               batch_id=batch.batch_id, received_at=received_at)
    return [d for d in ordered if d.delta_id in added]


def _refuse_foreign_deltas(batch: ParsedBatch, grant: WorkerGrant, repo: TelemetryRepository) -> None:
    """A worker key's deltas are its batch's worker's (checked before): each must claim that worker's registered
    pool and a policy serving it, as its events must (:func:`_refuse_foreign`); the others are refused."""
    if not batch.rollups:
        return
    expected = grant.pools_of([batch.worker_id])[batch.worker_id]
    serving = repo.policies_serving({d.pool for d in batch.rollups})
    poolless = serving.get(None)
    refused_at = {r.index for r in batch.rollups_rejected}
    valid_at = [i for i in range(batch.rollup_count) if i not in refused_at]
    kept: list[RollupDelta] = []
    refused: list[RejectedEvent] = []
    for index, delta in zip(valid_at, batch.rollups, strict=True):
        error: EventError | None = None
        if expected is not None and delta.pool != expected:
            error = EventError(path="pool", code=ProblemCode.pool_mismatch,
                               message=f"worker {batch.worker_id!r} is in pool {expected!r}, not {delta.pool!r}")
        elif delta.policy not in (serving.get(delta.pool), poolless):
            error = EventError(path="policy", code=ProblemCode.wrong_policy,
                               message=f"policy {delta.policy!r} does not serve pool {delta.pool!r}")
        if error is None:
            kept.append(delta)
        else:
            refused.append(RejectedEvent(index=index, errors=[error]))
    if refused:
        batch.rollups = kept
        batch.rollups_rejected = sorted([*batch.rollups_rejected, *refused], key=lambda r: r.index)


def _stored_rejection(stored: Mapping[str, Any]) -> RejectedEvent:
    """A rejection as its batch record keeps it, in today's codes.

    Records written before the codes were closed hold pydantic's error types
    (``string_pattern_mismatch``); they are read through the same mapping, so
    that a batch replayed across an upgrade is answered as the first time, not
    refused with a 500 its sender would retry for ever.
    """
    errors = [{**e, "code": e["code"] if e.get("code") in _PROBLEM_CODES else problem_code({"type": e.get("code")})}
              for e in stored.get("errors", [])]
    return RejectedEvent(index=stored["index"], errors=errors)


def _add_to_rollups(repo: TelemetryRepository, events: Sequence[TelemetryEvent],
                    worker_deltas: Sequence[RollupDelta] = ()) -> None:
    deltas: dict[RollupKey, Sums] = aggregate(events)
    for delta in worker_deltas:
        add_delta(deltas, delta)
    keys = sorted(deltas)  # one lock order for every transaction
    rows = [{**dict(zip(KEY_FIELDS, key, strict=True)), **deltas[key].totals.as_dict()} for key in keys]
    ids = repo.upsert_rollups(rows)
    histogram_rows = sorted(
        (ids[key], metric, bucket, count)
        for key in keys
        for metric, counts in deltas[key].histograms.items()
        for bucket, count in counts.items()
    )
    repo.upsert_histograms(histogram_rows)


# --- retention ----------------------------------------------------------------------------------

def purge_cutoff(older_than: dt.datetime) -> dt.datetime:
    """The cutoff truncated to the minute, so that events and rollups are cut at the same point."""
    return older_than.astimezone(dt.UTC).replace(second=0, microsecond=0)


def purge(session: Session, older_than: dt.datetime) -> PurgeCounts:
    """Delete raw events, rollups (with their histograms) and batch records older than the cutoff.

    The cutoff is truncated to the minute: an event of 10:41:30 and its rollup
    minute 10:41 are kept or deleted together, so the rollups still equal the
    aggregate of the raw events that remain. On PostgreSQL raw events go by
    whole day partitions, never row by row: events and rollups are cut at the
    cutoff's day (UTC midnight) instead, batch records at the cutoff
    (``PurgeCounts.events_before``, ``PurgeCounts.partitions``).
    """
    return TelemetryRepository(session).purge(purge_cutoff(older_than))


# How far back the background task creates raw-event partitions, whatever the window (see partition_days):
# the default window (7 days) spans 8 calendar days; the migration makes the same 8.
PARTITION_DAYS_BEHIND_MAX = 8


def partition_days(settings: ControlPlaneSettings, now: dt.datetime) -> tuple[dt.date, dt.date]:
    """The first and last day whose raw-event partition should exist at ``now`` (UTC days).

    Every day of the window ingest accepts (:class:`EventWindow`: back to the
    max event age, never past retention; ahead by the clock skew) and
    ``SPECGATE_TELEMETRY_PARTITION_DAYS_AHEAD`` days after today, so that a
    day's partition exists well before its first event and before the next
    round of the background task could fail. Back at most
    :data:`PARTITION_DAYS_BEHIND_MAX` days: a past day's partition was made
    ahead when it was to come, so behind only matters after a fresh migration
    or a purge shorter than the window, and a window of years would make
    thousands of empty tables; an event of a day further back gets its
    partition on demand (``TelemetryRepository.insert_events``).
    """
    window = EventWindow.from_settings(settings, now)
    first = max(window.earliest.astimezone(dt.UTC).date(),
                now.astimezone(dt.UTC).date() - dt.timedelta(days=PARTITION_DAYS_BEHIND_MAX))
    last = max(window.latest.astimezone(dt.UTC).date(),
               now.astimezone(dt.UTC).date() + dt.timedelta(days=settings.telemetry_partition_days_ahead))
    return first, last


def ensure_partitions(session: Session, settings: ControlPlaneSettings, now: dt.datetime) -> list[str]:
    """Create the missing raw-event partitions of :func:`partition_days` (PostgreSQL; nothing on SQLite)."""
    first, last = partition_days(settings, now)
    days = (first + dt.timedelta(days=n) for n in range((last - first).days + 1))
    return TelemetryRepository(session).ensure_partition_days(days)


# --- reads --------------------------------------------------------------------------------------

@dataclass(slots=True)
class RollupSummary:
    """Merged rollups of one group: counters and latency histograms, with the figures derived from them."""

    key: dict[str, Any]
    counters: dict[str, Any]
    histograms: dict[str, dict[int, int]] = field(default_factory=lambda: {m: {} for m in METRICS})

    def ratio(self, numerator: str, denominator: str) -> float | None:
        den = self.counters[denominator]
        return self.counters[numerator] / den if den else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.ratio("accepted_tokens_sum", "draft_tokens_sum")

    def quantile(self, metric: str, q: float) -> float | None:
        return quantile(self.histograms[metric], q)


def summarize(session: Session, flt: RollupFilter, group_by: Sequence[str],
              limit: int | None = None, window_s: int | None = None,
              metrics: Sequence[str] | None = None) -> tuple[list[RollupSummary], bool]:
    """Rollups merged per group of ``group_by`` (key fields), with their histograms.

    Returns the groups (ordered by the group fields) and whether more than
    ``limit`` groups matched. With ``window_s``, a ``minute`` group is the
    start of a window of that many seconds (merged in the database). With
    ``metrics``, only those latency histograms are read (the others stay empty).
    """
    unknown = set(group_by) - set(KEY_FIELDS)
    if unknown:
        raise ValueError(f"cannot group by {sorted(unknown)}")
    repo = TelemetryRepository(session)
    rows = repo.rollup_totals(flt, group_by, None if limit is None else limit + 1, window_s)
    truncated = limit is not None and len(rows) > limit
    rows = rows[:limit] if limit is not None else rows
    groups: dict[tuple[Any, ...], RollupSummary] = {}
    for row in rows:
        values = tuple(row[name] for name in group_by)
        groups[values] = RollupSummary(key=dict(zip(group_by, values, strict=True)),
                                       counters={name: row[name] for name in COUNTERS})
    for values, metric, bucket, count in repo.rollup_histograms(flt, group_by, window_s, metrics):
        summary = groups.get(values)
        if summary is not None:
            summary.histograms[metric][bucket] = count
    return list(groups.values()), truncated


def describe_key(key: dict[str, Any]) -> dict[str, Any]:
    """A group key for people: adds the batch-size range beside its lower bound."""
    out = dict(key)
    if key.get("batch_bucket") is not None:
        out["batch_range"] = batch_bucket_label(key["batch_bucket"])
    return out
