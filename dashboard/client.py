"""The control plane's REST API, as the dashboard uses it: typed results, problem+json errors.

The dashboard never touches the database; everything it shows or changes goes
through here. Models ignore fields they do not know, so a newer control plane
does not break an older dashboard.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

T = TypeVar("T")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# --- errors --------------------------------------------------------------------------------

class FieldProblem(_Model):
    path: str = ""
    code: str = ""
    message: str = ""
    line: int | None = None
    column: int | None = None


class Problem(_Model):
    """An RFC 9457 problem as the control plane answers it."""

    type: str = "about:blank"
    title: str = "Error"
    status: int = 0
    detail: str = ""
    errors: list[FieldProblem] = Field(default_factory=list)
    extra: dict[str, Any] = Field(default_factory=dict)


class ApiError(Exception):
    """The control plane refused (4xx/5xx), or could not be reached (status 0)."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(f"{problem.title}: {problem.detail}")
        self.problem = problem

    @property
    def status(self) -> int:
        return self.problem.status

    @property
    def unreachable(self) -> bool:
        return self.problem.status == 0


def problem_of(response: httpx.Response) -> Problem:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        text = response.text.strip()[:300] or response.reason_phrase
        return Problem(title=f"HTTP {response.status_code}", status=response.status_code, detail=text)
    known = {"type", "title", "status", "detail", "errors", "instance"}
    try:
        errors = TypeAdapter(list[FieldProblem]).validate_python(body.get("errors") or [])
    except ValidationError:
        errors = []
    return Problem(type=str(body.get("type", "about:blank")), title=str(body.get("title", "Error")),
                   status=response.status_code, detail=str(body.get("detail", "")), errors=errors,
                   extra={k: v for k, v in body.items() if k not in known})


# --- results -------------------------------------------------------------------------------

class WhoAmI(_Model):
    key_id: str
    name: str
    scope: str
    actor: str


class Policy(_Model):
    id: str
    name: str
    description: str | None = None
    pool: str | None = None
    active_revision_id: str | None = None
    head_revision_id: str | None = None
    revision_count: int = 0
    created_at: dt.datetime
    created_by: str = ""


class RevisionSummary(_Model):
    id: str
    seq: int
    parent_id: str | None = None
    author: str = ""
    message: str = ""
    created_at: dt.datetime
    active: bool = False


class Revision(RevisionSummary):
    policy: str
    document: dict[str, Any] = Field(default_factory=dict)
    canonical_yaml: str = ""
    source_text: str | None = None


class RevisionPage(_Model):
    items: list[RevisionSummary]
    next_cursor: int | None = None


class ChangeSummary(_Model):
    rules_added: list[str] = Field(default_factory=list)
    rules_removed: list[str] = Field(default_factory=list)
    rules_changed: list[str] = Field(default_factory=list)
    rules_moved: list[str] = Field(default_factory=list)
    engines_added: list[str] = Field(default_factory=list)
    engines_removed: list[str] = Field(default_factory=list)
    engines_changed: list[str] = Field(default_factory=list)
    fields_changed: list[str] = Field(default_factory=list)

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


class RevisionRef(_Model):
    id: str
    seq: int


class DraftDiff(_Model):
    against: RevisionRef
    identical: bool
    unified: str
    summary: ChangeSummary


class Decision(_Model):
    engine: str
    speculate: bool
    num_speculative_tokens: int = 0
    rule: str
    policy: str = ""
    revision: str = ""
    explored: bool = False


class Evaluation(_Model):
    shape: dict[str, Any]
    decision: Decision


class DraftCheck(_Model):
    valid: bool
    revision_id: str
    name: str
    canonical_yaml: str
    existing: bool = False
    diff: DraftDiff | None = None
    evaluations: list[Evaluation] = Field(default_factory=list)


class RolloutStep(_Model):
    position: int
    percent: float
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    outcome: str | None = None


class RolloutTarget(_Model):
    pool: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class Rollout(_Model):
    id: str
    policy: str
    from_revision: str
    to_revision: str
    mode: str
    target: RolloutTarget = Field(default_factory=RolloutTarget)
    steps: list[RolloutStep] = Field(default_factory=list)
    state: str
    current_step: int = 0
    current_percent: float = 0
    allowed_actions: list[str] = Field(default_factory=list)
    reason: str = ""
    created_by: str = ""
    created_at: dt.datetime
    updated_at: dt.datetime


class RolloutPage(_Model):
    items: list[Rollout]
    next_cursor: str | None = None


class RollbackResult(_Model):
    policy: str
    previous_revision: str | None = None
    active_revision: str
    ended_rollout: Rollout | None = None


class KillSwitch(_Model):
    enabled: bool
    reason: str = ""
    changed_at: dt.datetime | None = None
    changed_by: str | None = None
    changed: bool | None = None


class Worker(_Model):
    id: str
    pool: str
    labels: dict[str, str] = Field(default_factory=dict)
    engines: dict[str, str] = Field(default_factory=dict)
    sidecar_version: str | None = None
    last_heartbeat_at: dt.datetime | None = None
    active_revision: str | None = None
    active_etag: str | None = None
    expected_etag: str | None = None
    stale: bool = False
    converged: bool = False


class WorkerPage(_Model):
    items: list[Worker]
    next_cursor: str | None = None


class RevisionCount(_Model):
    revision: str | None = None
    workers: int = 0


class FleetGroup(_Model):
    workers: int = 0
    stale: int = 0
    converged_workers: int = 0
    converged: bool = True
    revisions: list[RevisionCount] = Field(default_factory=list)


class PoolFleet(FleetGroup):
    pool: str


class Fleet(_Model):
    generation: int = 0
    kill_switch: bool = False
    stale_after_s: float = 0
    overall: FleetGroup = Field(default_factory=FleetGroup)
    pools: list[PoolFleet] = Field(default_factory=list)


class AuditEvent(_Model):
    id: int
    at: dt.datetime
    actor: str
    action: str
    target_type: str
    target_id: str
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    reason: str = ""


class AuditPage(_Model):
    items: list[AuditEvent]
    next_cursor: int | None = None


class Quantiles(_Model):
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


class RollupKey(_Model):
    minute: dt.datetime | None = None
    policy: str | None = None
    revision: str | None = None
    route: str | None = None
    engine: str | None = None
    batch_bucket: int | None = None
    batch_range: str | None = None
    explored: bool | None = None


class RollupGroup(_Model):
    key: RollupKey
    counters: dict[str, float] = Field(default_factory=dict)
    acceptance_rate: float | None = None
    error_rate: float | None = None
    e2e_ms_mean: float | None = None
    ttft_ms_mean: float | None = None
    itl_ms_mean: float | None = None
    itl_ms_token_weighted: float | None = None
    ttft_ms: Quantiles = Field(default_factory=Quantiles)
    itl_ms: Quantiles = Field(default_factory=Quantiles)
    e2e_ms: Quantiles = Field(default_factory=Quantiles)

    def count(self, name: str) -> float:
        return self.counters.get(name, 0)


class RollupReport(_Model):
    group_by: list[str] = Field(default_factory=list)
    groups: list[RollupGroup] = Field(default_factory=list)
    truncated: bool = False


class Recommendation(_Model):
    """One suggested rule edit of the analysis, with its evidence."""

    id: str
    kind: str = ""
    route: str = ""
    title: str = ""
    edit: dict[str, Any] | None = None
    confidence: str = ""
    expected_effect: dict[str, Any] = Field(default_factory=dict)
    evidence: dict[str, Any] = Field(default_factory=dict)
    message: str = ""
    applicable: bool = False
    problems: list[dict[str, Any]] = Field(default_factory=list)


class RecommendationList(_Model):
    policy: str
    revision: str = ""
    recommendations: list[Recommendation] = Field(default_factory=list)


class AppliedRecommendation(_Model):
    recommendation: Recommendation
    revision: str
    seq: int
    message: str = ""


class GuardrailCheck(_Model):
    guardrail: str
    status: str
    limit: float | None = None
    observed: float | None = None
    detail: str = ""


class GuardrailEvaluation(_Model):
    step: int
    evaluated_at: dt.datetime
    verdict: str
    action: str = "none"
    baseline_requests: int = 0
    canary_requests: int = 0
    checks: list[GuardrailCheck] = Field(default_factory=list)


class GuardrailHistory(_Model):
    rollout_id: str
    evaluations: list[GuardrailEvaluation] = Field(default_factory=list)


class WhatIf(_Model):
    policy: str
    candidate: str
    baseline: str
    routes: list[dict[str, Any]] = Field(default_factory=list)
    all_routes: dict[str, Any] = Field(default_factory=dict)
    truncated: bool = False
    method: str = ""


# --- the client ----------------------------------------------------------------------------

class ApiClient:
    """One control plane, one key. Every call answers a typed result or raises :class:`ApiError`."""

    def __init__(self, base_url: str, key: str, *, timeout_s: float = 15.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s, transport=transport,
                                    headers={"Authorization": f"Bearer {key}", "Accept": "application/json"})

    def close(self) -> None:
        self._client.close()

    def request(self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201), **kwargs: Any) -> httpx.Response:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(Problem(title="Control plane unreachable", status=0,
                                   detail=f"cannot reach {self.base_url}: {exc}")) from None
        if response.status_code not in ok:
            raise ApiError(problem_of(response))
        return response

    def _get(self, path: str, model: type[T], **params: Any) -> T:
        clean = {k: v for k, v in params.items() if v is not None and v != ""}
        return TypeAdapter(model).validate_python(self.request("GET", path, params=clean).json())

    # who
    def whoami(self) -> WhoAmI:
        return self._get("/v1/whoami", WhoAmI)

    # policies and revisions
    def policies(self) -> list[Policy]:
        return self._get("/v1/policies", list[Policy])

    def policy(self, name: str) -> Policy:
        return self._get(f"/v1/policies/{name}", Policy)

    def create_policy(self, name: str, pool: str | None, description: str | None = None) -> Policy:
        body = {"name": name, "pool": pool or None, "description": description or None}
        return Policy.model_validate(self.request("POST", "/v1/policies", json=body).json())

    def revisions(self, policy: str, *, cursor: int | None = None, limit: int = 50) -> RevisionPage:
        return self._get(f"/v1/policies/{policy}/revisions", RevisionPage, cursor=cursor, limit=limit)

    def revision(self, revision_id: str) -> Revision:
        return self._get(f"/v1/revisions/{revision_id}", Revision)

    def validate(self, policy: str, document: str, *, shapes: list[dict[str, Any]] | None = None) -> DraftCheck:
        """Checks a draft of the policy's next revision (nothing is stored): errors raise ApiError (422)."""
        body: dict[str, Any] = {"document": document, "shapes": shapes or []}
        response = self.request("POST", f"/v1/policies/{policy}/validate", json=body)
        return DraftCheck.model_validate(response.json())

    def evaluate(self, revision_id: str, shapes: list[dict[str, Any]]) -> list[Evaluation]:
        response = self.request("POST", f"/v1/revisions/{revision_id}/evaluate", json={"shapes": shapes})
        return TypeAdapter(list[Evaluation]).validate_python(response.json())

    def save_revision(self, policy: str, document: str, message: str, *, head: str | None) -> tuple[Revision, bool]:
        """Adds a revision against ``head``; answers it and whether it was created (False: an equal one exists)."""
        headers = {"If-Match": f'"{head}"' if head else "*"}
        response = self.request("POST", f"/v1/policies/{policy}/revisions", headers=headers,
                                json={"document": document, "message": message})
        return Revision.model_validate(response.json()), response.status_code == 201

    # rollouts
    def rollouts(self, *, policy: str | None = None, state: str | None = None, cursor: str | None = None,
                 limit: int = 50) -> RolloutPage:
        return self._get("/v1/rollouts", RolloutPage, policy=policy, state=state, cursor=cursor, limit=limit)

    def start_rollout(self, *, policy: str, revision: str, mode: str, steps: list[float],
                      pool: str | None, labels: dict[str, str], reason: str) -> Rollout:
        target: dict[str, Any] = {"labels": labels}
        if pool:
            target["pool"] = pool
        body = {"policy": policy, "revision": revision, "mode": mode, "steps": steps, "target": target,
                "reason": reason}
        return Rollout.model_validate(self.request("POST", "/v1/rollouts", json=body).json())

    def rollout_action(self, rollout_id: str, action: str, reason: str) -> Rollout:
        response = self.request("POST", f"/v1/rollouts/{rollout_id}/{action}", json={"reason": reason})
        return Rollout.model_validate(response.json())

    def rollback(self, policy: str, revision: str, reason: str) -> RollbackResult:
        response = self.request("POST", f"/v1/policies/{policy}/rollback",
                                json={"revision": revision, "reason": reason})
        return RollbackResult.model_validate(response.json())

    def kill_switch(self) -> KillSwitch:
        return self._get("/v1/killswitch", KillSwitch)

    def set_kill_switch(self, enabled: bool, reason: str) -> KillSwitch:
        response = self.request("PUT", "/v1/killswitch", json={"enabled": enabled, "reason": reason})
        return KillSwitch.model_validate(response.json())

    # fleet
    def fleet(self) -> Fleet:
        return self._get("/v1/fleet", Fleet)

    def workers(self, *, pool: str | None = None, cursor: str | None = None, limit: int = 100) -> WorkerPage:
        return self._get("/v1/workers", WorkerPage, pool=pool, cursor=cursor, limit=limit)

    # audit
    def audit(self, *, q: str | None = None, action: str | None = None, actor: str | None = None,
              target_type: str | None = None, cursor: int | None = None, limit: int = 50) -> AuditPage:
        return self._get("/v1/audit", AuditPage, q=q, action=action, actor=actor, target_type=target_type,
                         cursor=cursor, limit=limit)

    # telemetry
    def rollups(self, *, group_by: list[str], since: dt.datetime | None = None, until: dt.datetime | None = None,
                policy: str | None = None, revision: str | None = None, route: str | None = None,
                engine: str | None = None, limit: int = 1000) -> RollupReport:
        params: dict[str, Any] = {"group_by": ",".join(group_by), "policy": policy, "revision": revision,
                                  "route": route, "engine": engine, "limit": limit}
        if since is not None:
            params["from"] = since.isoformat()
        if until is not None:
            params["to"] = until.isoformat()
        return self._get("/v1/telemetry/rollups", RollupReport, **params)

    # analysis (optional: a control plane without it answers 404)
    @staticmethod
    def _analysis_params(policy: str, since: dt.datetime | None, until: dt.datetime | None,
                         min_samples: int | None) -> dict[str, Any]:
        params: dict[str, Any] = {"policy": policy}
        if since is not None:
            params["from"] = since.isoformat()
        if until is not None:
            params["to"] = until.isoformat()
        if min_samples is not None:
            params["min_samples"] = min_samples
        return params

    def recommendations(self, policy: str, *, since: dt.datetime | None = None, until: dt.datetime | None = None,
                        min_samples: int | None = None) -> RecommendationList:
        return self._get("/v1/recommendations", RecommendationList,
                         **self._analysis_params(policy, since, until, min_samples))

    def apply_recommendation(self, recommendation_id: str, policy: str, *, since: dt.datetime | None = None,
                             until: dt.datetime | None = None,
                             min_samples: int | None = None) -> AppliedRecommendation:
        """Creates a draft revision with the edit; pass the window and parameters the listing had."""
        response = self.request("POST", f"/v1/recommendations/{recommendation_id}/apply",
                                params=self._analysis_params(policy, since, until, min_samples))
        return AppliedRecommendation.model_validate(response.json())

    def guardrails(self, rollout_id: str, *, limit: int = 5) -> GuardrailHistory:
        """The guardrail evaluations of a rollout's steps, newest first."""
        return self._get(f"/v1/rollouts/{rollout_id}/guardrails", GuardrailHistory, limit=limit)

    def what_if(self, policy: str, *, revision: str | None = None, since: dt.datetime | None = None,
                until: dt.datetime | None = None) -> WhatIf:
        body: dict[str, Any] = {"policy": policy, "revision": revision}
        if since is not None:
            body["from"] = since.isoformat()
        if until is not None:
            body["to"] = until.isoformat()
        return WhatIf.model_validate(self.request("POST", WHAT_IF_PATH, json=body).json())


WHAT_IF_PATH = "/v1/analysis/what-if"

