"""Per-minute rollups: what is counted, and the in-memory aggregation of one batch.

A rollup row is keyed by (``minute``, ``policy``, ``revision``, ``route``,
``engine``, ``batch_bucket``, ``explored``, ``k0``): ``minute`` is the event's
``time`` truncated to the minute (UTC), ``engine`` the engine the request
finally ran on, ``batch_bucket`` the lower bound of the batch-size bucket
(:mod:`analysis.buckets`), ``k0`` whether the request was decided into a
speculative engine's K=0 band (:func:`decided_k0`).

Every counter is a plain sum over the events of the key, so two rollups of
the same key merge by adding them (and that is what ingest does in SQL):

=========================  ==========================================================
``requests``               events
``ok``                     ``status == "ok"``
``errors``                 ``status != "ok"`` (client disconnects included)
``client_disconnects``     ``status == "client_disconnect"``
``fallbacks``              ``fallback`` true
``retries``                sum of ``retries``
``speculated``             ``speculate`` true (the decision)
``structured_checked``     ``structured_valid`` is not null
``structured_valid``       ``structured_valid`` true
``spec_reported``          both ``spec_draft_tokens`` and ``spec_accepted_tokens`` present
``draft_tokens_sum``       sum of ``spec_draft_tokens`` over ``spec_reported`` events
``accepted_tokens_sum``    sum of ``spec_accepted_tokens`` over ``spec_reported`` events
``spec_steps_sum/_count``  sum and number of present ``spec_steps``
``prompt_tokens_sum/_count``, ``completion_tokens_sum/_count``: sum and number of present values
``e2e_ms_sum``             sum of ``e2e_ms`` (present on every event: its count is ``requests``)
``ttft_ms_sum``, ``ttft_count``: sum and number of present ``ttft_ms``
``itl_ms_sum``, ``itl_count``: sum and number of present ``itl_ms`` (a per-request mean)
``itl_weighted_ms_sum``    sum of ``itl_ms * max(completion_tokens - 1, 0)`` over events with both
``itl_weighted_tokens``    sum of ``max(completion_tokens - 1, 0)`` over the same events
``shadow_compared``        ``shadow_match`` is not null (a shadow comparison: the policy's ``quality``)
``shadow_matched``         ``shadow_match`` true
``shadow_first_diff_sum/_count``: sum and number of present ``shadow_first_diff``
``shadow_structured_checked``  both ``structured_valid`` and ``shadow_structured_valid`` present
``shadow_structured_valid_served``  of those, ``structured_valid`` true (the answer the client got)
``shadow_structured_valid_plain``   of those, ``shadow_structured_valid`` true (the plain engine's answer)
``shadow_check_run``       ``shadow_check_passed`` is not null (a worker's quality check ran)
``shadow_check_failed``    ``shadow_check_passed`` false
=========================  ==========================================================

So acceptance = ``accepted_tokens_sum / draft_tokens_sum``; the per-request
mean ITL = ``itl_ms_sum / itl_count``; the token-weighted mean ITL (the mean
gap between two output tokens over all tokens) =
``itl_weighted_ms_sum / itl_weighted_tokens``; the shadow match rate =
``shadow_matched / shadow_compared``. The structured-output pair is counted
only where both answers were checked, so the two validity rates compare the
same requests.

Beside the counters, each rollup row has three latency histograms (``ttft``,
``itl``, ``e2e``) over :mod:`analysis.histogram`'s fixed
buckets: ``{bucket: events}`` of the present values.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from analysis.buckets import batch_bucket
from analysis.histogram import bucket_index
from wire.telemetry import ROLLUP_FLOAT_COUNTERS, ROLLUP_INT_COUNTERS, TelemetryEvent
from wire.telemetry import RollupDelta as WireDelta

KEY_FIELDS: tuple[str, ...] = ("minute", "policy", "revision", "route", "engine", "batch_bucket", "explored",
                                "k0")

RollupKey = tuple[dt.datetime, str, str, str, str, int, bool, bool]


@dataclass(slots=True)
class Totals:
    """The counters of one rollup key (definitions above); the columns of ``telemetry_rollups``."""

    requests: int = 0
    ok: int = 0
    errors: int = 0
    client_disconnects: int = 0
    fallbacks: int = 0
    retries: int = 0
    speculated: int = 0
    structured_checked: int = 0
    structured_valid: int = 0
    spec_reported: int = 0
    draft_tokens_sum: int = 0
    accepted_tokens_sum: int = 0
    spec_steps_sum: int = 0
    spec_steps_count: int = 0
    prompt_tokens_sum: int = 0
    prompt_tokens_count: int = 0
    completion_tokens_sum: int = 0
    completion_tokens_count: int = 0
    e2e_ms_sum: float = 0.0
    ttft_ms_sum: float = 0.0
    ttft_count: int = 0
    itl_ms_sum: float = 0.0
    itl_count: int = 0
    itl_weighted_ms_sum: float = 0.0
    itl_weighted_tokens: int = 0
    shadow_compared: int = 0
    shadow_matched: int = 0
    shadow_first_diff_sum: int = 0
    shadow_first_diff_count: int = 0
    shadow_structured_checked: int = 0
    shadow_structured_valid_served: int = 0
    shadow_structured_valid_plain: int = 0
    shadow_check_run: int = 0
    shadow_check_failed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in COUNTERS}


COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(Totals))
FLOAT_COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(Totals) if f.type in (float, "float"))
INT_COUNTERS: tuple[str, ...] = tuple(name for name in COUNTERS if name not in FLOAT_COUNTERS)
# A pre-aggregating worker sends these counters by name (wire.telemetry.RollupDelta): the two lists are one.
if set(INT_COUNTERS) != set(ROLLUP_INT_COUNTERS) or set(FLOAT_COUNTERS) != set(ROLLUP_FLOAT_COUNTERS):
    raise ImportError("analysis.rollup.Totals and wire.telemetry's rollup counters differ")
# A cohort (analysis.cells) carries these under the same names.
SHADOW_COUNTERS: tuple[str, ...] = tuple(name for name in COUNTERS if name.startswith("shadow_"))


def minute_of(time: dt.datetime) -> dt.datetime:
    """The UTC minute an (aware) event time falls in."""
    return time.astimezone(dt.UTC).replace(second=0, microsecond=0)


def decided_k0(event: TelemetryEvent) -> bool:
    """Whether the request ran on a speculative engine that the decision told not to draft for it: the K=0
    band of an in-engine schedule (``speculate`` false, and the engine reported its per-request speculative
    metrics, which a plain engine has none of). Its ``spec_draft_tokens`` say what the engine did (it picks
    K by its own running batch, which the sidecar's decision only estimates).

    By the decision, not by what the engine drafted: the holdout's explored plain requests are drawn from the
    same decisions, so the two cohorts differ only by the engine (a cohort chosen by "drafted nothing" would
    gather the short answers). It is a key, not a counter, because the analysis compares these requests'
    latencies (histograms) with the plain engine's: what K=0 steps still cost.
    """
    return not event.speculate and event.spec_draft_tokens is not None


def rollup_key(event: TelemetryEvent) -> RollupKey:
    return (minute_of(event.time), event.policy, event.revision, event.route, event.engine,
            batch_bucket(event.batch_size), event.explored, decided_k0(event))


class RollupDelta:
    """What one batch adds to one rollup key: counters and histograms ``{metric: {bucket: count}}``."""

    __slots__ = ("histograms", "totals")

    def __init__(self) -> None:
        self.totals = Totals()
        self.histograms: dict[str, dict[int, int]] = {"ttft": {}, "itl": {}, "e2e": {}}


def aggregate(events: Iterable[TelemetryEvent],
              into: dict[RollupKey, RollupDelta] | None = None) -> dict[RollupKey, RollupDelta]:
    """Group events by rollup key and sum them; a batch's hundreds of events become a few rows.

    With ``into``, the events are added to those deltas (a pre-aggregating worker's running minute) and
    ``into`` is returned.
    """
    out: dict[RollupKey, RollupDelta] = {} if into is None else into
    minutes: dict[dt.datetime, dt.datetime] = {}
    for ev in events:
        time = ev.time
        minute = minutes.get(time)
        if minute is None:
            minute = minutes[time] = minute_of(time)
        key = (minute, ev.policy, ev.revision, ev.route, ev.engine, batch_bucket(ev.batch_size), ev.explored,
               not ev.speculate and ev.spec_draft_tokens is not None)  # decided_k0, inlined: the ingest's hot path
        delta = out.get(key)
        if delta is None:
            delta = out[key] = RollupDelta()
        t = delta.totals
        hist = delta.histograms
        t.requests += 1
        status = ev.status
        if status == "ok":
            t.ok += 1
        else:
            t.errors += 1
            if status == "client_disconnect":
                t.client_disconnects += 1
        if ev.fallback:
            t.fallbacks += 1
        t.retries += ev.retries
        if ev.speculate:
            t.speculated += 1
        if ev.structured_valid is not None:
            t.structured_checked += 1
            if ev.structured_valid:
                t.structured_valid += 1
        if ev.spec_draft_tokens is not None and ev.spec_accepted_tokens is not None:
            t.spec_reported += 1
            t.draft_tokens_sum += ev.spec_draft_tokens
            t.accepted_tokens_sum += ev.spec_accepted_tokens
        if ev.spec_steps is not None:
            t.spec_steps_sum += ev.spec_steps
            t.spec_steps_count += 1
        if ev.prompt_tokens is not None:
            t.prompt_tokens_sum += ev.prompt_tokens
            t.prompt_tokens_count += 1
        completion = ev.completion_tokens
        if completion is not None:
            t.completion_tokens_sum += completion
            t.completion_tokens_count += 1
        e2e = ev.e2e_ms
        t.e2e_ms_sum += e2e
        h = hist["e2e"]
        b = bucket_index(e2e)
        h[b] = h.get(b, 0) + 1
        ttft = ev.ttft_ms
        if ttft is not None:
            t.ttft_ms_sum += ttft
            t.ttft_count += 1
            h = hist["ttft"]
            b = bucket_index(ttft)
            h[b] = h.get(b, 0) + 1
        itl = ev.itl_ms
        if itl is not None:
            t.itl_ms_sum += itl
            t.itl_count += 1
            h = hist["itl"]
            b = bucket_index(itl)
            h[b] = h.get(b, 0) + 1
            if completion is not None:
                gaps = completion - 1 if completion > 1 else 0
                t.itl_weighted_ms_sum += itl * gaps
                t.itl_weighted_tokens += gaps
        match = ev.shadow_match
        if match is not None:
            t.shadow_compared += 1
            if match:
                t.shadow_matched += 1
        first_diff = ev.shadow_first_diff
        if first_diff is not None:
            t.shadow_first_diff_sum += first_diff
            t.shadow_first_diff_count += 1
        plain_valid = ev.shadow_structured_valid
        if plain_valid is not None and ev.structured_valid is not None:
            t.shadow_structured_checked += 1
            if ev.structured_valid:
                t.shadow_structured_valid_served += 1
            if plain_valid:
                t.shadow_structured_valid_plain += 1
        check = ev.shadow_check_passed
        if check is not None:
            t.shadow_check_run += 1
            if not check:
                t.shadow_check_failed += 1
    return out


def delta_key(delta: WireDelta) -> RollupKey:
    """The rollup key of a worker's delta (its minute in UTC, as :func:`minute_of` gives an event's)."""
    return (minute_of(delta.minute), delta.policy, delta.revision, delta.route, delta.engine, delta.batch_bucket,
            delta.explored, delta.k0)


def add_delta(out: dict[RollupKey, RollupDelta], delta: WireDelta) -> None:
    """Add a worker's delta to the deltas of a batch: the same sums :func:`aggregate` makes from events."""
    key = delta_key(delta)
    into = out.get(key)
    if into is None:
        into = out[key] = RollupDelta()
    totals = into.totals
    for name, value in delta.counters.items():
        setattr(totals, name, getattr(totals, name) + value)
    for metric, counts in delta.histograms.items():
        hist = into.histograms[metric]
        for bucket, count in counts.items():
            hist[bucket] = hist.get(bucket, 0) + count


def to_wire(key: RollupKey, delta: RollupDelta, *, delta_id: str, pool: str) -> dict[str, Any]:
    """A delta as a worker sends it (``wire.telemetry.RollupDelta``'s fields, ready for JSON but for the minute,
    an aware datetime in UTC): only counters above 0, only histograms with counts."""
    minute, policy, revision, route, engine, bucket, explored, k0 = key
    totals = delta.totals
    return {"delta_id": delta_id, "minute": minute, "pool": pool, "policy": policy, "revision": revision,
            "route": route, "engine": engine, "batch_bucket": bucket, "explored": explored, "k0": k0,
            "counters": {name: value for name in COUNTERS if (value := getattr(totals, name))},
            # JSON object keys are strings; the contract reads them back as bucket numbers
            "histograms": {metric: {str(bucket): count for bucket, count in counts.items()}
                           for metric, counts in delta.histograms.items() if counts}}
