"""Guardrails of rollouts: look at a running step's two cohorts, record the look, roll back on a breach.

The statistics are the analysis library's (``analysis.guardrails``); the
cohorts come from the telemetry rollups of the rollout's two revisions since
the step started.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy.orm import Session

from analysis.cells import Cohort
from analysis.guardrails import StepEvaluation, evaluate_step
from analysis.rollup import minute_of
from controlplane.errors import Conflict
from controlplane.models import GuardrailEvaluation, Policy, Rollout
from controlplane.rollout import service as rollout_service
from controlplane.rollout.repository import RolloutRepository
from controlplane.rollout.schemas import RolloutAction
from controlplane.telemetry.repository import RollupFilter
from controlplane.telemetry.service import summarize
from policies import validate_data


@dataclass(frozen=True, slots=True)
class GuardrailOutcome:
    evaluation: GuardrailEvaluation
    step: StepEvaluation
    generation: int | None  # to publish after commit when the rollout changed


def step_cohorts(session: Session, rollout: Rollout, policy: Policy, started_at: dt.datetime,
                 now: dt.datetime) -> tuple[Cohort, Cohort]:
    """Baseline (from-revision) and canary (to-revision) cohorts since the step started, from the rollups."""
    start, end = minute_of(started_at), minute_of(now) + dt.timedelta(minutes=1)
    out = []
    for rid in (rollout.from_revision_id, rollout.to_revision_id):
        rows, _ = summarize(session, RollupFilter(policy=policy.name, revision=rid, explored=False, start=start,
                                                  end=end), [])
        out.append(Cohort.from_rollup(rows[0].counters, rows[0].histograms) if rows else Cohort())
    return out[0], out[1]


def evaluate_guardrails(session: Session, rollout_id: str, *, actor: str, now: dt.datetime, alpha: float,
                        auto_promote: bool) -> GuardrailOutcome:
    """Look at a running rollout's current step: record the look; roll back on a breach.

    With ``auto_promote``, a step whose guardrails all pass moves on to the
    next step (the last one completes the rollout). The caller commits, then
    publishes ``generation`` when it is not None.
    """
    repo = RolloutRepository(session)
    rollout = rollout_service.get_rollout(session, rollout_id)
    if rollout.state != "running":
        raise Conflict(f"rollout {rollout_id!r} is {rollout.state}: only a running rollout's guardrails are "
                       "evaluated", state=rollout.state)
    policy = repo.policy(rollout.policy_id)
    assert policy is not None
    target = repo.revision(rollout.to_revision_id)
    assert target is not None
    guardrails = validate_data(target.document).guardrails
    step = repo.step(rollout.id, rollout.current_step)
    assert step is not None
    baseline, canary = step_cohorts(session, rollout, policy, step.started_at or rollout.created_at, now)
    result = evaluate_step(baseline, canary, guardrails, alpha=alpha)
    action = "none"
    generation = None
    position = rollout.current_step
    if result.verdict == "breach":
        breached = ", ".join(f"{c.guardrail} ({c.detail})" for c in result.breaches)
        rollout_service.rollback_on_guardrail_breach(
            session, rollout.id, reason=f"guardrail breach at step {position}: {breached}",
            evidence=result.to_dict())
        action = "rolled_back"
        generation = repo.generation()
    elif result.verdict == "pass" and auto_promote and rollout.created_by != rollout_service.AUTOPILOT_ACTOR:
        try:
            # The look read the step without the policy lock: promote only the step it evaluated. If an
            # operator moved the rollout meanwhile, the new step has not been looked at yet; the next
            # look evaluates it.
            _, generation = rollout_service.apply_action(
                session, rollout.id, RolloutAction.promote, actor=rollout_service.GUARDRAIL_ACTOR,
                reason=f"guardrails passed at step {position} (baseline {result.baseline_requests}, "
                       f"canary {result.canary_requests} requests)", expected_step=position)
            action = "promoted"
        except rollout_service.StaleStep:
            action = "none"
    evaluation = repo.add_evaluation(GuardrailEvaluation(
        rollout_id=rollout.id, step=position, evaluated_at=now, evaluated_by=actor, verdict=result.verdict,
        action=action, baseline_requests=result.baseline_requests, canary_requests=result.canary_requests,
        checks=[c.to_dict() for c in result.checks]))
    return GuardrailOutcome(evaluation, result, generation)


def guardrail_history(session: Session, rollout_id: str, limit: int) -> tuple[Rollout, list[GuardrailEvaluation]]:
    """The rollout and its guardrail evaluations, newest first; NotFound when there is no such rollout."""
    rollout = rollout_service.get_rollout(session, rollout_id)
    return rollout, RolloutRepository(session).evaluations(rollout_id, limit)


def running_rollouts(session: Session) -> list[str]:
    return RolloutRepository(session).running()
