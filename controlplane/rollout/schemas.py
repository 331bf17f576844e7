"""Request and response models of the rollouts API: rollouts, steps, guardrail evaluations, the kill switch."""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints

MAX_STEPS = 20

# PostgreSQL text cannot hold NUL: refusing it here makes such input a 422, not a driver error.
NO_NUL = r"^[^\x00]*$"
# A reason is what an operator reads months later in the audit log: blank ones say nothing.
Reason = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=2000,
                                          pattern=NO_NUL)]
OptionalReason = Annotated[str, StringConstraints(strip_whitespace=True, max_length=2000, pattern=NO_NUL)]
PolicyName = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=NO_NUL)]
RevisionId = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]
PoolName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_NUL)]
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_NUL)]
LabelValue = Annotated[str, StringConstraints(max_length=256, pattern=NO_NUL)]
# Strict: a JSON true or "10" is a mistake in a step list, not a percent.
Percent = Annotated[float, Field(strict=True, gt=0, le=100)]


class RolloutState(StrEnum):
    running = "running"
    paused = "paused"
    completed = "completed"
    aborted = "aborted"
    rolled_back = "rolled_back"


class RolloutMode(StrEnum):
    workers = "workers"
    traffic = "traffic"


class RolloutAction(StrEnum):
    promote = "promote"
    pause = "pause"
    resume = "resume"
    abort = "abort"
    # Not an endpoint of its own: a policy rollback or a guardrail breach ends the rollout.
    rollback = "rollback"


class StepOutcome(StrEnum):
    promoted = "promoted"
    completed = "completed"
    aborted = "aborted"
    rolled_back = "rolled_back"


class Target(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool: PoolName | None = Field(default=None,
                                  description="only workers of this pool; else all the policy's workers")
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32,
                                               description="only workers whose labels have all these values")


class RolloutCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = Field(description="the policy's name")
    revision: RevisionId = Field(description="the revision to move the policy to")
    mode: RolloutMode
    steps: list[Percent] = Field(min_length=1, max_length=MAX_STEPS,
                               description="strictly increasing percents in (0, 100], the last one 100")
    target: Target = Field(default_factory=Target)
    reason: Reason


class ActionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: OptionalReason = ""


class PromoteBody(ActionBody):
    # Strict: a JSON true or "1" as a step is a client bug, not a step to compare with.
    expected_step: Annotated[int, Field(strict=True, ge=0, lt=MAX_STEPS)] | None = Field(
        default=None, description="the step (current_step) the caller saw: the promote is refused with 409 "
                                  "when the rollout is at another step by now")


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: Reason


class RollbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    revision: RevisionId = Field(description="any revision of the policy but the active one")
    reason: Reason


class StepRead(BaseModel):
    position: int = Field(description="0-based; the rollout's current_step names one of these")
    percent: float
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    outcome: StepOutcome | None


class GuardrailSnapshot(BaseModel):
    """The latest guardrail evaluation of a rollout (all of them: GET /v1/rollouts/{id}/guardrails)."""

    step: int
    evaluated_at: dt.datetime
    verdict: str = Field(description="pass, breach or pending")
    action: str = Field(description="none, rolled_back or promoted")
    baseline_requests: int
    canary_requests: int
    checks: list[dict[str, Any]]


class CheckRead(BaseModel):
    guardrail: str
    status: str = Field(description="pass, breach or pending")
    limit: float | None
    observed: float | None
    interval: list[float] | None = Field(description="always-valid confidence interval of the compared quantity")
    p_value: float | None = Field(description="always-valid p-value of a breach")
    detail: str


class GuardrailEvaluationRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    rollout_id: str
    step: int
    evaluated_at: dt.datetime
    evaluated_by: str
    verdict: str = Field(description="pass, breach or pending")
    action: str = Field(description="none, rolled_back or promoted")
    baseline_requests: int
    canary_requests: int
    checks: list[CheckRead]


class GuardrailHistory(BaseModel):
    rollout_id: str
    state: str
    evaluations: list[GuardrailEvaluationRead] = Field(description="newest first")


class RolloutRead(BaseModel):
    id: str
    policy: str
    policy_id: str
    from_revision: str
    to_revision: str
    mode: RolloutMode
    target: Target
    steps: list[StepRead]
    state: RolloutState
    current_step: int
    current_percent: float
    allowed_actions: list[RolloutAction]
    reason: str
    created_by: str
    created_at: dt.datetime
    updated_at: dt.datetime
    last_guardrail_evaluation: GuardrailSnapshot | None = None


class RolloutPage(BaseModel):
    items: list[RolloutRead]
    next_cursor: str | None


class PolicyRollbackRead(BaseModel):
    policy: str
    previous_revision: str | None
    active_revision: str
    ended_rollout: RolloutRead | None


class KillSwitchUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Strict: "no" or 0 turning the fleet's speculation off by coercion would be a nasty surprise.
    enabled: StrictBool
    reason: Reason


class KillSwitchRead(BaseModel):
    enabled: bool
    reason: str
    changed_at: dt.datetime | None
    changed_by: str | None


class KillSwitchChange(KillSwitchRead):
    changed: bool = Field(description="false when the switch already had this value (nothing was done)")
