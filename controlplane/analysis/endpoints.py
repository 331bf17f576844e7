"""The analysis API: summaries, speedups, cells, before/after, recommendations and what-if."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query

from analysis.recommend import Recommendation, RecommendConfig
from analysis.switchback import SwitchbackConfig
from controlplane.analysis import service
from controlplane.analysis.schemas import (
    NO_CONTROL,
    AppliedRecommendation,
    BeforeAfterReport,
    CellsExport,
    RecommendationList,
    RecommendationRead,
    SpeedupReport,
    SummaryGroup,
    SummaryReport,
    SwitchbackReport,
    WhatIfReport,
    WhatIfRequest,
    Window,
)
from controlplane.deps import Admin, Reader, SessionDep
from controlplane.errors import AUTH_RESPONSES, INVALID_RESPONSE, TOO_LARGE_RESPONSE, ValidationFailed, problems
from controlplane.models import utcnow
from controlplane.policy.service import parse_if_match
from controlplane.telemetry.endpoints import parse_group_by, parse_utc
from controlplane.telemetry.repository import RollupFilter

router = APIRouter(responses=AUTH_RESPONSES)

Text = Annotated[str | None, Query(max_length=128, pattern=NO_CONTROL)]
PolicyParam = Annotated[str, Query(min_length=1, max_length=63, pattern=NO_CONTROL, description="a policy's name")]
From = Annotated[str | None, Query(alias="from", max_length=64, json_schema_extra={"format": "date-time"},
                                   description="ISO 8601 date-time; no zone means UTC")]
To = Annotated[str | None, Query(alias="to", max_length=64, json_schema_extra={"format": "date-time"},
                                 description="ISO 8601 date-time, exclusive")]
Confidence = Annotated[float, Query(ge=0.5, le=0.999, description="level of the intervals")]
MinSamples = Annotated[int, Query(ge=2, le=10_000_000, description="requests per cohort before a bucket counts")]
CostRatio = Annotated[float | None, Query(ge=0, le=10, description="draft/target cost per token for the theory "
                                                                   "column; default by method")]
RecommendationId = Annotated[str, Path(min_length=1, max_length=64, pattern=NO_CONTROL)]

_NOT_FOUND = problems({404: "no such policy, rollout or revision"})


def _window(start: str | None, end: str | None) -> tuple[dt.datetime | None, dt.datetime | None]:
    a, b = parse_utc(start, "from"), parse_utc(end, "to")
    if a is not None and b is not None and b <= a:
        raise ValidationFailed("`to` must be after `from`", errors=[
            {"path": "to", "in": "query", "code": "empty_window", "message": "must be after `from`"}])
    return a, b


_RAW = (SummaryGroup.worker, SummaryGroup.replica)


def _group_by(values: list[str]) -> list[SummaryGroup]:
    out = parse_group_by(values, SummaryGroup)
    for raw in _RAW:
        if raw in out and len(out) > 1:
            raise ValidationFailed(f"group_by={raw.value} stands alone", errors=[
                {"path": "group_by", "in": "query", "code": f"{raw.value}_alone",
                 "message": f"per-{raw.value} rows come from the raw events and are not split further"}])
    return out


@router.get("/v1/analysis/summary", response_model=SummaryReport, tags=["analysis"],
            responses=INVALID_RESPONSE,
            description="Requests, acceptance, mean acceptance length, TTFT/ITL/e2e p50 and p95, retry, fallback, "
                        "error and structured-output validity rates, shadow comparisons (match rate with its "
                        "interval, where answers first differ, structured validity served vs plain, quality-check "
                        "failures), per any of route, engine, batch_bucket, "
                        "policy, revision, explored (and time window), from the rollups. group_by=worker gives "
                        "per-worker means from the raw events instead, group_by=replica per engine and replica "
                        "(filtered by policy, route and engine), sampled events counted with their weights and "
                        "`basis` saying how many events, and how many sampled, each figure rests on.")
def summary(session: SessionDep, _: Reader, policy: Text = None, revision: Text = None, route: Text = None,
            engine: Text = None, explored: bool | None = None, start: From = None, end: To = None,
            group_by: Annotated[list[str], Query(max_length=20, description="repeat, or comma-separate")] = [],  # noqa: B006
            window: Window | None = None,
            limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> SummaryReport:
    groups = _group_by(group_by or ["route", "engine", "batch_bucket"])
    a, b = _window(start, end)
    if groups == [SummaryGroup.worker]:
        workers = service.worker_summaries(session, policy=policy, route=route, start=a, end=b, limit=limit)
        return SummaryReport(group_by=["worker"], window=None, rows=[], workers=workers,
                             basis=service.total_basis([w["basis"] for w in workers]),
                             truncated=len(workers) >= limit)
    if groups == [SummaryGroup.replica]:
        replicas = service.worker_summaries(session, policy=policy, route=route, start=a, end=b, limit=limit,
                                            by_replica=True, engine=engine)
        return SummaryReport(group_by=["replica"], window=None, rows=[], replicas=replicas,
                             basis=service.total_basis([r["basis"] for r in replicas]),
                             truncated=len(replicas) >= limit)
    flt = RollupFilter(policy=policy, revision=revision, route=route, engine=engine, explored=explored,
                       start=a, end=b)
    rows, truncated = service.summaries(session, flt, [g.value for g in groups],
                                        window.value if window else None, limit)
    return SummaryReport(group_by=[g.value for g in groups], window=window, rows=rows,
                         truncated=truncated)


@router.get("/v1/analysis/speedups", response_model=SpeedupReport, tags=["analysis"],
            responses={**_NOT_FOUND, **INVALID_RESPONSE},
            description="Speculative against plain per route and batch bucket: ITL and e2e ratio with Welch "
                        "intervals on log latency and the sample sizes, from the holdout (explored requests) or, "
                        "with `rollout`, from that rollout's two cohorts; a Leviathan theory column with the "
                        "measured acceptance. Thin cells say `insufficient evidence`.")
def speedups(session: SessionDep, _: Reader, policy: PolicyParam, start: From = None, end: To = None,
             route: Text = None, rollout: Text = None, confidence: Confidence = 0.95, min_samples: MinSamples = 100,
             cost_ratio: CostRatio = None) -> SpeedupReport:
    a, b = _window(start, end)
    cfg = RecommendConfig(confidence=confidence, min_samples=min_samples, cost_ratio=cost_ratio)
    if rollout is not None:
        cells = service.rollout_cells(session, rollout, now=utcnow())
        cells = [c for c in cells if route is None or c.route == route]
    else:
        cells = service.cells(session, policy, start=a, end=b, route=route)
    rows = service.speedups(cells, cfg)
    return SpeedupReport(policy=policy, rollout=rollout, start=a, end=b, confidence=confidence,
                         min_samples=min_samples, rows=rows)


@router.get("/v1/analysis/cells", response_model=CellsExport, tags=["analysis"],
            responses={**_NOT_FOUND, **INVALID_RESPONSE},
            description="The per-route, per-bucket statistics the recommender reads (counters and histograms of "
                        "the speculative and plain cohorts), to feed the recommender offline.")
def export_cells(session: SessionDep, _: Reader, policy: PolicyParam, start: From = None, end: To = None,
                 route: Text = None) -> CellsExport:
    a, b = _window(start, end)
    cells = service.cells(session, policy, start=a, end=b, route=route)
    return CellsExport(policy=policy, start=a, end=b, cells=[c.to_dict() for c in cells])


@router.get("/v1/analysis/before-after", response_model=BeforeAfterReport, tags=["analysis"],
            responses={**_NOT_FOUND, **INVALID_RESPONSE},
            description="p50/p95 ITL and e2e, retries and acceptance per route for two revisions over one window: "
                        "a rollout's (its life), or the policy, from_revision, to_revision and window given.")
def before_after(session: SessionDep, _: Reader, rollout: Text = None, policy: Text = None,
                 from_revision: Text = None, to_revision: Text = None, start: From = None,
                 end: To = None) -> BeforeAfterReport:
    a, b = _window(start, end)
    report = service.before_after(session, rollout_id=rollout, policy_name=policy, from_revision=from_revision,
                                  to_revision=to_revision, start=a, end=b, now=utcnow())
    return BeforeAfterReport.model_validate(report)


def _read(rec: Recommendation) -> RecommendationRead:
    return RecommendationRead.model_validate(rec.to_dict())


@router.get("/v1/recommendations", response_model=RecommendationList, tags=["recommendations"],
            responses={**_NOT_FOUND, **problems({409: "the policy has no active revision"}), **INVALID_RESPONSE},
            description="Rule edits for the policy's active revision, each with evidence, expected effect and "
                        "confidence: batch thresholds, route exclusions, k and method changes; quality-risk flags.")
def list_recommendations(session: SessionDep, _: Reader, policy: PolicyParam, start: From = None, end: To = None,
                         confidence: Confidence = 0.95, min_samples: MinSamples = 100,
                         cost_ratio: CostRatio = None) -> RecommendationList:
    a, b = _window(start, end)
    cfg = RecommendConfig(confidence=confidence, min_samples=min_samples, cost_ratio=cost_ratio)
    revision, recs, head, worker = service.list_recommendations(session, policy, start=a, end=b, cfg=cfg)
    return RecommendationList(policy=policy, revision=revision.id, head=head, start=a, end=b,
                              recommendations=[_read(r) for r in recs],
                              switchback=None if worker is None else worker.to_dict())


@router.get("/v1/analysis/switchback", response_model=SwitchbackReport, tags=["analysis"],
            responses={**_NOT_FOUND, **problems({409: "the policy has no active revision"}), **INVALID_RESPONSE},
            description="What clients felt in the active revision's own time windows against its explored windows "
                        "(exploration.window_s): end-to-end latency, its p95, completed requests per second, time "
                        "to first token and output tokens per second, each as the policy's advantage with a "
                        "Student interval over pairs of neighbouring windows. Whole-worker windows put the cost "
                        "one engine's work imposes on the others inside the measurement.")
def switchback(session: SessionDep, _: Reader, policy: PolicyParam, start: From = None, end: To = None,
               confidence: Confidence = 0.95) -> SwitchbackReport:
    a, b = _window(start, end)
    revision, result = service.switchback(session, policy, start=a, end=b,
                                         cfg=SwitchbackConfig(confidence=confidence))
    return SwitchbackReport(
        policy=policy, revision=revision.id, start=a, end=b, available=result is not None,
        reason=None if result is not None else "the active revision explores request by request (or not at all): "
                                               "set exploration.window_s and a rate to compare whole windows",
        comparison=None if result is None else result.to_dict())


@router.post("/v1/recommendations/{recommendation_id}/apply", status_code=201,
             response_model=AppliedRecommendation, tags=["recommendations"],
             responses={**problems({400: "If-Match is malformed",
                                    404: "no such policy, or the recommendation no longer holds",
                                    409: "the recommendation is a flag with nothing to apply",
                                    412: "If-Match (or, without it, the revision the recommendation was computed "
                                         "against) is not the policy's head: `current_head` names it"}),
                        **INVALID_RESPONSE},
             description="Create a draft revision (not active) with the recommendation's edit and a message citing "
                         "its evidence. Pass the same policy, window and parameters as the listing, and its `head` "
                         "as If-Match.")
def apply(recommendation_id: RecommendationId, session: SessionDep, who: Admin, policy: PolicyParam,
          start: From = None, end: To = None, confidence: Confidence = 0.95, min_samples: MinSamples = 100,
          cost_ratio: CostRatio = None,
          if_match: Annotated[str | None, Header(alias="If-Match", max_length=1000,
                                                 description='"<head>" of the listing: the draft builds on it')]
          = None) -> AppliedRecommendation:
    a, b = _window(start, end)
    cfg = RecommendConfig(confidence=confidence, min_samples=min_samples, cost_ratio=cost_ratio)
    revision, rec = service.apply_recommendation(session, recommendation_id, policy_name=policy, start=a,
                                                 end=b, cfg=cfg, actor=who.actor,
                                                 if_match=parse_if_match(if_match) if if_match is not None else None)
    return AppliedRecommendation(recommendation=_read(rec), revision=revision.id, seq=revision.seq,
                                 message=revision.message)


@router.post("/v1/analysis/what-if", response_model=WhatIfReport, tags=["analysis"],
             responses={**_NOT_FOUND, **problems({409: "the policy has no active revision to compare with"}),
                        **TOO_LARGE_RESPONSE, **INVALID_RESPONSE},
             description="Score a candidate revision (or document) on a recorded window: every recorded request "
                         "shape is decided again with the candidate, latency estimated from the measured "
                         "per-bucket numbers. Sampled events (a pre-aggregating worker's) count as the requests "
                         "they stand for; `basis` says how many events, and how many sampled, it rests on.")
def what_if(body: WhatIfRequest, session: SessionDep, _: Reader) -> WhatIfReport:
    a, b = _aware(body.start, "from"), _aware(body.end, "to")
    if a is not None and b is not None and b <= a:
        raise ValidationFailed("`to` must be after `from`", errors=[
            {"path": "to", "in": "body", "code": "empty_window", "message": "must be after `from`"}])
    report = service.what_if(session, body.policy, revision=body.revision, document=body.document,
                             start=a, end=b)
    return WhatIfReport.model_validate(report)


def _aware(when: dt.datetime | None, name: str) -> dt.datetime | None:
    """In UTC; a time without a zone is UTC."""
    if when is None:
        return None
    try:
        return when.replace(tzinfo=dt.UTC) if when.tzinfo is None else when.astimezone(dt.UTC)
    except OverflowError:
        raise ValidationFailed(f"`{name}` is out of range in UTC", errors=[
            {"path": name, "in": "body", "code": "out_of_range", "message": "is out of range in UTC"}]) from None
