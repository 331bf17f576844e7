"""Request and response models of the analysis API: summaries, speedups, recommendations, what-if."""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"
Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_CONTROL)]


class SummaryGroup(StrEnum):
    policy = "policy"
    revision = "revision"
    route = "route"
    engine = "engine"
    batch_bucket = "batch_bucket"
    explored = "explored"
    worker = "worker"
    replica = "replica"


class Window(StrEnum):
    minute = "minute"
    hour = "hour"
    day = "day"


class SummaryQuantiles(BaseModel):
    """The median and 95th percentile of a summary row's latency (telemetry rollups report p99 as well)."""

    p50: float | None
    p95: float | None


class ShadowSummary(BaseModel):
    """Shadow comparisons of a summary row (the policy's ``quality``): greedy requests a speculative engine
    served, sent again to the plain engine off the client's path, and the two answers compared."""

    compared: int = Field(description="requests compared with the plain engine's answer")
    matched: int = Field(description="compared requests whose two answers matched (text, tool calls, finish reason)")
    match_rate: float = Field(description="matched / compared")
    match_interval: list[float] = Field(description="[low, high]: the 95 % Wilson score interval of match_rate")
    first_diff_mean: float | None = Field(description="output tokens the answers shared before they first differed, "
                                                      "on average over the differing ones that counted them; null "
                                                      "when none did")
    first_diff_count: int = Field(description="differing comparisons that counted where they first differed")
    structured_checked: int = Field(description="compared structured-output requests with both answers checked "
                                                "against the schema")
    structured_valid_served: float | None = Field(description="of those, the share whose served (speculative) answer "
                                                              "was valid; null when there were none")
    structured_valid_plain: float | None = Field(description="of the same requests, the share whose plain engine's "
                                                             "answer was valid")
    check_run: int = Field(description="comparisons the worker's quality check (--quality-check) ran on")
    check_failed: int = Field(description="of those, the ones it failed")


class SummaryRow(BaseModel):
    key: dict[str, Any] = Field(description="the group's values; with `window`, also window_start")
    requests: int
    acceptance_rate: float | None = Field(description="accepted / drafted tokens")
    mean_acceptance_length: float | None = Field(description="tokens per target step: 1 + accepted / steps")
    ttft_ms: SummaryQuantiles
    itl_ms: SummaryQuantiles
    e2e_ms: SummaryQuantiles
    retry_rate: float | None = Field(description="retries per request")
    fallback_rate: float | None
    error_rate: float | None = Field(description="requests not answered ok, client disconnects included")
    client_disconnects: int = Field(description="requests whose client went away before the answer was complete")
    client_disconnect_rate: float | None = Field(description="client_disconnects / requests")
    structured_validity_rate: float | None = Field(description="valid / checked structured outputs")
    shadow: ShadowSummary | None = Field(description="shadow comparisons; null when none was made (the policy's "
                                                     "quality.shadow_rate turns them on)")


class Basis(BaseModel):
    """What a figure from the raw events rests on. A pre-aggregating worker (``telemetry.raw_sample_rate`` in its
    policy) sends every request in its rollup deltas but only a sample of them as raw events, each standing for
    ``1 / rate`` requests: figures over raw events count each sampled event with that weight."""

    events: int = Field(description="raw events read")
    sampled_events: int = Field(description="of those, sampled events (each standing for more than one request)")
    represented_requests: int | float = Field(
        description="the requests those events stand for: each sampled event with its weight, each other event "
                    "once; an integer when no event was sampled")
    estimated: bool = Field(description="true when any sampled event is among them: counts, sums and means are "
                                        "then estimates from the sample")


class WorkerRow(BaseModel):
    key: dict[str, Any]
    requests: int | float = Field(description="requests the group's events stand for (sampled events with their "
                                               "weight); an integer unless basis.estimated")
    acceptance_rate: float | None
    retry_rate: float | None
    fallback_rate: float | None
    error_rate: float | None
    client_disconnects: int | float
    client_disconnect_rate: float | None
    structured_validity_rate: float | None
    itl_ms_mean: float | None
    ttft_ms_mean: float | None
    e2e_ms_mean: float | None
    basis: Basis = Field(description="the raw events this row rests on")


class SummaryReport(BaseModel):
    group_by: list[str]
    window: Window | None
    rows: list[SummaryRow] = Field(description="from the rollups (quantiles from their histograms)")
    workers: list[WorkerRow] | None = Field(
        default=None, description="with group_by=worker: per-worker means from the raw events of the window "
                                  "(rollups have no worker; no quantiles)")
    replicas: list[WorkerRow] | None = Field(
        default=None, description="with group_by=replica: per engine and replica (key: engine, replica; replica "
                                  "null for events that name none), means from the raw events of the window")
    basis: Basis | None = Field(
        default=None, description="with group_by=worker or replica: the raw events all the rows rest on; null for "
                                  "rows from the rollups, which count every request exactly")
    truncated: bool


class Interval(BaseModel):
    ratio: float = Field(description="plain / speculative latency (geometric means): above 1, speculation wins")
    low: float
    high: float
    n_plain: int
    n_speculative: int
    confidence: float


class Theory(BaseModel):
    acceptance: float
    k: int
    cost_ratio: float = Field(description="draft / target cost per token, assumed by method unless given")
    expected_tokens_per_step: float
    speedup: float = Field(description="(1 - a^(k+1)) / ((1 - a)(k c + 1)), Leviathan et al. 2023")


class K0Tax(BaseModel):
    ratio: float = Field(description="K=0 / plain latency (geometric means): above 1, the K=0 steps cost more "
                                     "than not speculating")
    low: float
    high: float
    n_k0: int
    n_plain: int
    confidence: float


class K0Requests(BaseModel):
    engine: str | None = Field(description="the in-engine-scheduled engine that ran them (the one seen most)")
    requests: int = Field(description="requests decided into its K=0 band (the rules' catch-all)")
    drafted_per_request: float | None = Field(description="tokens the engine drafted per such request all the "
                                                          "same (it picks K by its own running batch, which the "
                                                          "decision only estimates); null when none reported")
    measure: str | None = Field(description="what the tax read (e2e where both have min_samples requests, else "
                                            "itl); null below min_samples")
    tax: K0Tax | None
    e2e_ms_p50: float | None
    itl_ms_p50: float | None


class SpeedupRow(BaseModel):
    route: str
    batch_bucket: int
    batch_range: str
    source: str = Field(description="holdout (explored requests), rollout (its two cohorts) or observational")
    engine: str | None
    method: str | None
    k: int | None
    n_speculative: int
    n_plain: int
    measure: str = Field(description="what the verdict read: e2e (end-to-end latency, what clients feel) where both "
                                     "cohorts have min_samples requests, else itl (inter-token latency)")
    e2e_speedup: Interval | None = Field(description="Welch interval on log end-to-end latency")
    ttft_speedup: Interval | None = Field(description="Welch interval on log time to first token")
    itl_speedup: Interval | None = Field(description="Welch interval on log inter-token latency (the mechanism)")
    verdict: str = Field(description="wins, loses, no clear difference, insufficient evidence, or confounded by "
                                     "disconnects (the faster cohort's clients went away markedly more often)")
    e2e_ms_p50: dict[str, float | None]
    e2e_ms_p95: dict[str, float | None]
    itl_ms_p50: dict[str, float | None]
    client_disconnects: dict[str, int] = Field(description="per cohort (speculative, plain): requests whose client "
                                                           "went away before the answer was complete")
    client_disconnect_rate: dict[str, float | None] = Field(description="per cohort: client_disconnects / requests")
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    theory: Theory | None
    k0: K0Requests | None = Field(description="requests decided into an in-engine-scheduled engine's K=0 band (in "
                                              "neither "
                                              "cohort) and the K=0 tax over the plain cohort; null: none")


class SpeedupReport(BaseModel):
    policy: str
    rollout: str | None
    start: dt.datetime | None = Field(alias="from")
    end: dt.datetime | None = Field(alias="to")
    confidence: float
    min_samples: int
    rows: list[SpeedupRow]

    model_config = ConfigDict(populate_by_name=True)


class CellsExport(BaseModel):
    policy: str
    start: dt.datetime | None = Field(alias="from")
    end: dt.datetime | None = Field(alias="to")
    cells: list[dict[str, Any]] = Field(description="analysis.cells.Cell.to_dict() each")

    model_config = ConfigDict(populate_by_name=True)


class BeforeAfterReport(BaseModel):
    policy: str
    from_revision: str | None
    to_revision: str | None
    start: dt.datetime | None = Field(alias="from")
    end: dt.datetime | None = Field(alias="to")
    routes: list[dict[str, Any]] = Field(description="per route: before, after (summary figures) and change")
    all_routes: dict[str, Any]

    model_config = ConfigDict(populate_by_name=True)


class RecommendationRead(BaseModel):
    id: str
    kind: str = Field(description="raise_threshold, lower_threshold, exclude_route, change_k, switch_method, "
                                  "stop_speculating, route_instead (route '*': the whole policy), quality_risk")
    route: str
    title: str
    edit: dict[str, Any] | None = Field(description="the rule edit; null for a flag")
    confidence: str = Field(description="high, medium or low")
    expected_effect: dict[str, Any]
    evidence: dict[str, Any] = Field(description="numbers, sample sizes and the per-bucket rows behind it")
    message: str
    applicable: bool = Field(description="false for a flag, or when the edit would not validate (see problems)")
    problems: list[dict[str, Any]]
    measure: str | None = Field(description="what drove it: e2e, e2e_p95, requests_per_s, ttft, tokens_per_s "
                                            "(client-side), itl (the mechanism), acceptance, leviathan (the "
                                            "formula, not measured) or quality")


class RecommendationList(BaseModel):
    policy: str
    revision: str = Field(description="the active revision the edits apply to")
    head: str | None = Field(description="the policy's head revision now: a draft made from a recommendation "
                                         "builds on it, so send it as If-Match when applying one")
    start: dt.datetime | None = Field(alias="from")
    end: dt.datetime | None = Field(alias="to")
    recommendations: list[RecommendationRead]
    switchback: dict[str, Any] | None = Field(
        description="the whole worker's comparison the recommendations read: the policy's time windows against the "
                    "explored ones (see GET /v1/analysis/switchback); null when the policy explores per request")

    model_config = ConfigDict(populate_by_name=True)


class SwitchbackReport(BaseModel):
    policy: str
    revision: str = Field(description="the active revision compared")
    start: dt.datetime | None = Field(alias="from")
    end: dt.datetime | None = Field(alias="to")
    available: bool = Field(description="false when the revision does not explore in time windows")
    reason: str | None
    comparison: dict[str, Any] | None = Field(
        description="pairs, verdict (policy better, explored better, mixed, no clear difference, insufficient "
                    "evidence), driver (the measure that decided), estimates per measure (policy advantage: "
                    "above 1 the policy's windows were better), the two arms' figures and speculated shares")

    model_config = ConfigDict(populate_by_name=True)


class AppliedRecommendation(BaseModel):
    recommendation: RecommendationRead
    revision: str = Field(description="the draft revision created (not active: roll it out to use it)")
    seq: int
    message: str


class WhatIfRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    policy: Name
    revision: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_CONTROL)] | None = Field(
        default=None, description="a revision of the policy to score")
    document: dict[str, Any] | None = Field(default=None, description="or a candidate document (not stored)")
    start: dt.datetime | None = Field(default=None, alias="from", description="recorded window start (UTC)")
    end: dt.datetime | None = Field(default=None, alias="to", description="recorded window end, exclusive")


class WhatIfReport(BaseModel):
    policy: str
    candidate: str = Field(description="the candidate revision's id, or `candidate` for a document")
    baseline: str = Field(description="the active revision it is compared with")
    start: dt.datetime | None = Field(alias="from")
    end: dt.datetime | None = Field(alias="to")
    routes: list[dict[str, Any]] = Field(description="per route: requests, decisions_changed, estimated_requests "
                                                     "(those whose latency could be priced) and "
                                                     "unestimated_requests, counted as the requests the events "
                                                     "stand for, speculated shares, mean ITL and e2e before and "
                                                     "after, and the route's basis")
    all_routes: dict[str, Any]
    truncated: bool
    basis: Basis = Field(description="the recorded raw events the replay rests on (all routes)")
    method: str

    model_config = ConfigDict(populate_by_name=True)
