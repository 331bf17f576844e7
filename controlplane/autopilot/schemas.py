"""Request and response bodies of the autopilot API."""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from controlplane.rollout.schemas import MAX_STEPS, Percent


class Confidence(StrEnum):
    low = "low"
    medium = "medium"
    high = "high"


class ChangeKind(StrEnum):
    """The recommendations an autopilot may apply (flags such as quality_risk have no edit to apply)."""

    stop_speculating = "stop_speculating"
    exclude_route = "exclude_route"
    route_instead = "route_instead"
    lower_threshold = "lower_threshold"
    raise_threshold = "raise_threshold"
    switch_method = "switch_method"
    change_k = "change_k"


# The order an autopilot prefers among recommendations it may apply: what narrows speculation first (a
# wrong narrowing costs the gain; a wrong widening costs the clients), then by confidence.
KIND_ORDER = tuple(ChangeKind)

Strict = ConfigDict(extra="forbid")


class AutopilotUpdate(BaseModel):
    """The whole autopilot setting of a policy (PUT replaces it)."""

    model_config = Strict

    enabled: StrictBool = Field(description="look at the policy and act on its recommendations")
    min_confidence: Confidence = Field(default=Confidence.high,
                                       description="apply only recommendations at or above this confidence")
    steps: list[Percent] = Field(default=[10.0, 50.0, 100.0], min_length=1, max_length=MAX_STEPS,
                                 description="the traffic canary's percents, strictly increasing, the last one 100")
    hold_s: Annotated[float, Field(strict=True, ge=10, le=7 * 86400)] = Field(
        default=600.0, description="seconds each step runs before its guardrails may promote it; also how long "
                                   "after a person's change to the policy the autopilot keeps its hands off")
    min_samples: Annotated[int, Field(strict=True, ge=1, le=10_000_000)] = Field(
        default=200, description="requests per cohort before a step is promoted, and per cohort of the evidence")
    max_changes_per_day: Annotated[int, Field(strict=True, ge=0, le=100)] = Field(
        default=4, description="rollouts the autopilot may start in 24 hours")
    kinds: list[ChangeKind] = Field(default=list(ChangeKind), min_length=1, max_length=len(ChangeKind),
                                    description="the recommendation kinds it may apply")


class AutopilotEventRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    at: dt.datetime
    action: str = Field(description="enabled, disabled, updated (its setting); started (a draft and its rollout), "
                                    "promoted, completed, rolled_back (by the guardrails), aborted (by a person); "
                                    "paused (disabled mid-rollout: the rollout waits for a person)")
    rollout_id: str | None
    revision_id: str | None
    detail: dict[str, Any]


class AutopilotRead(BaseModel):
    policy: str
    enabled: bool
    min_confidence: Confidence
    steps: list[float]
    hold_s: float
    min_samples: int
    max_changes_per_day: int
    kinds: list[ChangeKind]
    status: str = Field(description="off, idle (nothing to apply), waiting (why in status_detail), rolling_out, "
                                    "paused (a person paused its rollout: resume, promote or abort it)")
    status_detail: str
    rollout: str | None = Field(description="the rollout the autopilot runs now")
    changes_today: int = Field(description="rollouts it started in the last 24 hours")
    last_look_at: dt.datetime | None
    updated_at: dt.datetime
    updated_by: str
    leader: bool | None = Field(description="whether this control-plane process runs the autopilots now (one "
                                            "leader across replicas); null when it runs none (interval 0)")
    history: list[AutopilotEventRead] = Field(description="newest first")
