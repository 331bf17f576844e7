"""The background guardrail evaluator: every SPECGATE_GUARDRAIL_INTERVAL_S, each running rollout's step.

One process looks: the leader of the role ``guardrails``
(:mod:`controlplane.leadership`, lock ``SPECGATE_GUARDRAIL_LOCK_KEY``; on
SQLite the one process), taken over by another replica within one interval
when it dies. Its first round runs one interval after the start. Each look is
its own transaction (one rollout's rollback does not wait for another's
evaluation). A look may still meet another at the same rollout (an
operator's ``POST .../guardrails/evaluate``, an autopilot's look, a leader
that lost its lock's connection mid-round): the rollback serialises on the
policy, so a rollout is rolled back once, and a look at a rollout that ended
meanwhile is skipped.
"""

from __future__ import annotations

import logging
from typing import Any

from controlplane.db import unit_of_work
from controlplane.errors import Conflict, NotFound
from controlplane.leadership import GUARDRAILS, lead
from controlplane.models import utcnow
from controlplane.rollout import guardrails
from controlplane.rollout.schemas import GuardrailEvaluationRead
from controlplane.rollout.service import GUARDRAIL_ACTOR

log = logging.getLogger("specgate.controlplane.guardrails")


def evaluate_now(app: Any, rollout_id: str, actor: str) -> GuardrailEvaluationRead:
    """Evaluate one rollout's current step, commit, and wake the workers if the rollout changed."""
    settings = app.state.settings
    with unit_of_work(app.state.sessions) as session:
        outcome = guardrails.evaluate_guardrails(session, rollout_id, actor=actor, now=utcnow(),
                                                 alpha=settings.guardrail_alpha,
                                                 auto_promote=settings.guardrail_auto_promote,
                                                 worker_stale_after_s=settings.worker_stale_after_s)
        read = GuardrailEvaluationRead.model_validate(outcome.evaluation)
    if outcome.generation is not None:
        app.state.hub.publish(outcome.generation)
    if read.action != "none":
        log.warning("guardrails %s rollout %s at step %d", read.action, rollout_id, read.step)
    return read


def evaluate_all(app: Any) -> list[GuardrailEvaluationRead]:
    """One look at every running rollout."""
    with unit_of_work(app.state.sessions) as session:
        ids = guardrails.running_rollouts(session)
    out = []
    for rollout_id in ids:
        try:
            out.append(evaluate_now(app, rollout_id, GUARDRAIL_ACTOR))
        except (Conflict, NotFound):  # ended or deleted since it was listed
            continue
    return out


async def run_evaluator(app: Any, interval_s: float) -> None:
    """Loop until cancelled, looking while this process leads; an error in one round is logged."""
    await lead(app, GUARDRAILS, app.state.settings.guardrail_lock_key, interval_s, lambda: evaluate_all(app),
               first_round_after_interval=True)
