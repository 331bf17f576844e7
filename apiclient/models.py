"""What the control plane's REST API answers, as typed models (checked against its OpenAPI document by tests).

Each model holds the fields its users read, with the API's own names, types and
required-ness (``tests/apiclient/test_drift.py`` compares them with
``create_app(...).openapi()``). Models ignore fields they do not know, so a
newer control plane does not break an older client.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Answer(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# --- keys ----------------------------------------------------------------------------------

class WhoAmI(Answer):
    key_id: str
    name: str
    scope: str
    actor: str


# --- policies and revisions ----------------------------------------------------------------

class Policy(Answer):
    id: str
    name: str
    description: str | None
    pool: str | None
    active_revision_id: str | None
    head_revision_id: str | None
    revision_count: int
    created_at: dt.datetime
    created_by: str


class RevisionSummary(Answer):
    id: str
    seq: int
    parent_id: str | None
    author: str
    message: str
    created_at: dt.datetime
    active: bool


class Revision(RevisionSummary):
    policy: str
    document: dict[str, Any]
    canonical_yaml: str
    source_text: str | None


class RevisionPage(Answer):
    items: list[RevisionSummary]
    next_cursor: int | None


class ChangeSummary(Answer):
    rules_added: list[str]
    rules_removed: list[str]
    rules_changed: list[str]
    rules_moved: list[str]
    engines_added: list[str]
    engines_removed: list[str]
    engines_changed: list[str]
    fields_changed: list[str]

    def lines(self) -> list[str]:
        out = []
        for field, label in (("rules_added", "rules added"), ("rules_removed", "rules removed"),
                             ("rules_changed", "rules changed"), ("rules_moved", "rules moved"),
                             ("engines_added", "engines added"), ("engines_removed", "engines removed"),
                             ("engines_changed", "engines changed"), ("fields_changed", "other fields changed")):
            names = getattr(self, field)
            if names:
                out.append(f"{label}: {', '.join(names)}")
        return out


class RevisionRef(Answer):
    id: str
    seq: int


class DraftDiff(Answer):
    against: RevisionRef
    identical: bool
    unified: str
    summary: ChangeSummary


class Diff(Answer):
    policy: str
    from_: RevisionRef = Field(alias="from")
    to: RevisionRef
    identical: bool
    unified: str
    summary: ChangeSummary


class Decision(Answer):
    engine: str
    speculate: bool
    num_speculative_tokens: int
    rule: str
    policy: str
    revision: str
    explored: bool


class Evaluation(Answer):
    shape: dict[str, Any]
    decision: Decision


class DraftCheck(Answer):
    valid: bool
    revision_id: str
    name: str
    canonical_yaml: str
    existing: bool
    diff: DraftDiff | None
    evaluations: list[Evaluation]


# --- rollouts, rollback, kill switch --------------------------------------------------------

class RolloutStep(Answer):
    position: int
    percent: float
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    outcome: str | None


class RolloutTarget(Answer):
    pool: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class Rollout(Answer):
    id: str
    policy: str
    from_revision: str
    to_revision: str
    mode: str
    target: RolloutTarget
    steps: list[RolloutStep]
    state: str
    current_step: int
    current_percent: float
    allowed_actions: list[str]
    reason: str
    created_by: str
    created_at: dt.datetime
    updated_at: dt.datetime


class RolloutPage(Answer):
    items: list[Rollout]
    next_cursor: str | None


class RollbackResult(Answer):
    policy: str
    previous_revision: str | None
    active_revision: str
    ended_rollout: Rollout | None


class KillSwitch(Answer):
    enabled: bool
    reason: str
    changed_at: dt.datetime | None
    changed_by: str | None


class KillSwitchChange(KillSwitch):
    changed: bool


# --- the fleet -----------------------------------------------------------------------------

class Replica(Answer):
    engine: str
    replica: str
    state: str
    in_flight: int
    running: float | None
    waiting: float | None
    consecutive_failures: int
    ejections: int
    returns: int
    next_probe_in_s: float | None


class TokenizerCheck(Answer):
    """Whether an engine's draft model has its target's tokenizer; aligned None: not checked (see differences)."""

    aligned: bool | None
    draft: str
    differences: list[str]
    notes: list[str] = []  # what differs without changing what an id means (roles, chat template)


class SupervisedEngine(Answer):
    engine: str
    state: str
    config_hash: str | None
    revision: str | None
    restarts: int
    failed_restarts: int
    crashes: int
    last_error: str | None
    error_revision: str | None = None  # the revision whose arguments last_error is about
    # when the engine began serving its current arguments (the control plane's clock); null while it has not
    serving_since: dt.datetime | None = None
    tokenizer: TokenizerCheck | None = None  # the check of its draft model's tokenizer; null: no draft model


class Worker(Answer):
    id: str
    kind: str
    pool: str
    labels: dict[str, str]
    engines: dict[str, str]
    sidecar_version: str | None
    last_heartbeat_at: dt.datetime
    active_revision: str | None
    active_etag: str | None
    expected_etag: str | None
    stale: bool
    converged: bool
    replicas: list[Replica]
    replicas_reported_at: dt.datetime | None
    engines_converged: bool | None
    supervised_engines: list[SupervisedEngine]
    supervised_reported_at: dt.datetime | None

    def engines_lag(self) -> str | None:
        """Why a worker that holds its bundle has not converged, if its supervised engines are why: "engines
        restarting" (on their way to its arguments) or "engines behind" (stuck on the previous ones: a
        restart that failed, a policy the worker cannot render); None otherwise."""
        if self.engines_converged is not False or self.active_etag != self.expected_etag:
            return None
        moving = any(e.state in ("starting", "draining", "restarting") for e in self.supervised_engines)
        return "engines restarting" if moving else "engines behind"


class WorkerPage(Answer):
    items: list[Worker]
    next_cursor: str | None


class RevisionCount(Answer):
    revision: str | None
    workers: int


class FleetGroup(Answer):
    workers: int
    stale: int
    converged_workers: int
    converged: bool
    revisions: list[RevisionCount]


class PoolFleet(FleetGroup):
    pool: str


class ReplicaCounts(Answer):
    reporters: int
    total: int
    healthy: int
    ejected: int


class Fleet(Answer):
    generation: int
    kill_switch: bool
    stale_after_s: float
    overall: FleetGroup
    pools: list[PoolFleet]
    gateways: FleetGroup
    gateway_pools: list[PoolFleet]
    replicas: ReplicaCounts


# --- audit ---------------------------------------------------------------------------------

class AuditEvent(Answer):
    id: int
    at: dt.datetime
    actor: str
    action: str
    target_type: str
    target_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    reason: str


class AuditPage(Answer):
    items: list[AuditEvent]
    next_cursor: int | None


# --- telemetry and analysis ----------------------------------------------------------------

class Quantiles(Answer):
    """The median and the 95th percentile (the API has more quantiles in some places; nobody here reads them)."""

    p50: float | None
    p95: float | None


class RollupKey(Answer):
    minute: dt.datetime | None = None
    policy: str | None = None
    revision: str | None = None
    route: str | None = None
    engine: str | None = None
    batch_bucket: int | None = None
    batch_range: str | None = None
    explored: bool | None = None
    k0: bool | None = None


class RollupGroup(Answer):
    key: RollupKey
    counters: dict[str, float]
    acceptance_rate: float | None
    error_rate: float | None
    e2e_ms_mean: float | None
    ttft_ms_mean: float | None
    itl_ms_mean: float | None
    itl_ms_token_weighted: float | None
    ttft_ms: Quantiles
    itl_ms: Quantiles
    e2e_ms: Quantiles

    def count(self, name: str) -> float:
        return self.counters.get(name, 0)


class RollupReport(Answer):
    group_by: list[str]
    groups: list[RollupGroup]
    truncated: bool


class ShadowSummary(Answer):
    """Shadow comparisons of a summary row: the plain engine's answer to the same greedy request."""

    compared: int
    matched: int
    match_rate: float
    match_interval: list[float]  # [low, high], 95 % Wilson
    first_diff_mean: float | None  # output tokens shared before the first difference, over the differing ones
    structured_checked: int
    structured_valid_served: float | None
    structured_valid_plain: float | None
    check_run: int
    check_failed: int


class SummaryRow(Answer):
    key: dict[str, Any]
    requests: int
    acceptance_rate: float | None
    itl_ms: Quantiles
    e2e_ms: Quantiles
    retry_rate: float | None
    error_rate: float | None
    client_disconnects: int
    client_disconnect_rate: float | None
    shadow: ShadowSummary | None  # None: nothing compared


class Basis(Answer):
    """The raw events a figure rests on; ``estimated`` when a pre-aggregating worker's samples are among them."""

    events: int
    sampled_events: int
    represented_requests: int | float
    estimated: bool

    def note(self, setting: str = "telemetry.raw_sample_rate") -> str | None:
        """The sentence a reader needs where the figures are estimates; None where every event stood for itself.

        The dashboard and the command line both say it, in the same words.
        """
        if not self.estimated:
            return None
        why = f"({setting}: pre-aggregating workers send only a sample of their requests as raw events)"
        if self.sampled_events == self.events:
            return (f"Estimated from {self.sampled_events:,} sampled requests standing for about "
                    f"{self.represented_requests:,.0f} {why}.")
        return (f"Estimated from {self.events:,} recorded requests, {self.sampled_events:,} of them sampled, "
                f"standing for about {self.represented_requests:,.0f} {why}.")


class WorkerSummary(Answer):
    key: dict[str, Any]
    requests: int | float  # a float only when estimated from sampled events
    acceptance_rate: float | None
    itl_ms_mean: float | None
    error_rate: float | None
    basis: Basis


class SummaryReport(Answer):
    group_by: list[str]
    rows: list[SummaryRow]
    workers: list[WorkerSummary] | None = None
    replicas: list[WorkerSummary] | None = None
    basis: Basis | None = None  # with workers or replicas
    truncated: bool


class SpeedupInterval(Answer):
    ratio: float
    low: float
    high: float


class Theory(Answer):
    speedup: float


class K0Requests(Answer):
    """Requests an in-engine-scheduled engine ran at K=0, and their latency over the plain cohort's (tax)."""

    engine: str | None
    requests: int
    drafted_per_request: float | None  # what the engine drafted for them all the same (its batch, not ours)
    measure: str | None
    tax: SpeedupInterval | None  # ratio K=0 / plain: above 1, the K=0 steps cost more than not speculating


class SpeedupRow(Answer):
    route: str
    batch_range: str
    source: str
    n_speculative: int
    n_plain: int
    measure: str  # what the verdict read: e2e where measured, else itl
    e2e_speedup: SpeedupInterval | None
    ttft_speedup: SpeedupInterval | None
    itl_speedup: SpeedupInterval | None
    verdict: str
    client_disconnects: dict[str, int]  # per cohort: speculative, plain
    client_disconnect_rate: dict[str, float | None]
    theory: Theory | None
    k0: K0Requests | None


class SpeedupReport(Answer):
    policy: str
    rows: list[SpeedupRow]


class BeforeAfter(Answer):
    policy: str
    from_revision: str | None
    to_revision: str | None
    routes: list[dict[str, Any]]
    all_routes: dict[str, Any]


class Cells(Answer):
    """The per-bucket statistics the recommender reads (``analysis.cells.Cell.to_dict()`` each)."""

    policy: str
    cells: list[dict[str, Any]]


class Recommendation(Answer):
    """One suggested rule edit of the analysis, with its evidence."""

    id: str
    kind: str
    route: str
    title: str
    edit: dict[str, Any] | None
    confidence: str
    expected_effect: dict[str, Any]
    evidence: dict[str, Any]
    message: str
    applicable: bool
    problems: list[dict[str, Any]]
    measure: str | None  # what drove it (e2e, requests_per_s, itl, acceptance, leviathan, ...)


class RecommendationList(Answer):
    policy: str
    revision: str
    head: str | None  # what a draft made from one of them builds on: pass it to apply_recommendation
    recommendations: list[Recommendation]
    switchback: dict[str, Any] | None  # the whole worker's comparison (see Switchback.comparison)


class Switchback(Answer):
    """The active revision's own time windows against its explored windows, on what clients felt."""

    policy: str
    revision: str
    available: bool
    reason: str | None
    comparison: dict[str, Any] | None


class AppliedRecommendation(Answer):
    recommendation: Recommendation
    revision: str
    seq: int
    message: str


class GuardrailCheck(Answer):
    guardrail: str
    status: str
    limit: float | None
    observed: float | None
    detail: str


class GuardrailEvaluation(Answer):
    step: int
    evaluated_at: dt.datetime
    verdict: str
    action: str
    baseline_requests: int
    canary_requests: int
    checks: list[GuardrailCheck]


class GuardrailHistory(Answer):
    rollout_id: str
    evaluations: list[GuardrailEvaluation]


class WhatIf(Answer):
    policy: str
    candidate: str
    baseline: str
    routes: list[dict[str, Any]]
    all_routes: dict[str, Any]
    truncated: bool
    basis: Basis
    method: str


# --- autopilot -----------------------------------------------------------------------------

class AutopilotEvent(Answer):
    at: dt.datetime
    action: str
    rollout_id: str | None
    revision_id: str | None
    detail: dict[str, Any]


class Autopilot(Answer):
    """A policy's autopilot: its setting, what its last look found and its history (newest first)."""

    policy: str
    enabled: bool
    min_confidence: str
    steps: list[float]
    hold_s: float
    min_samples: int
    max_changes_per_day: int
    kinds: list[str]
    status: str
    status_detail: str
    rollout: str | None
    changes_today: int
    last_look_at: dt.datetime | None
    updated_at: dt.datetime
    updated_by: str
    leader: bool | None
    history: list[AutopilotEvent]
