"""Guardrails of rollouts: look at a running step's two cohorts, record the look, roll back on a breach.

The statistics are the analysis library's (``analysis.guardrails``); the
cohorts come from the telemetry rollups of the rollout's two revisions since
the step started.

A workers-mode step first passes the engine gate (:func:`engine_gate`): a
canary worker whose sidecar supervises its engines restarts them with the new
revision's arguments, and until they serve, the fallback engine answers the
requests meant for them. Those requests say nothing of the revision (and their
fallbacks would count against it), so the step is not judged while any engine
is on its way, and then only from the first whole minute after the last one
came up. An engine that cannot run the revision's arguments is a breach.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from analysis.cells import Cohort
from analysis.guardrails import Check, StepEvaluation, evaluate_step
from analysis.rollup import minute_of
from controlplane.errors import Conflict
from controlplane.models import GuardrailEvaluation, Policy, Rollout
from controlplane.rollout import service as rollout_service
from controlplane.rollout.repository import RolloutRepository
from controlplane.rollout.schemas import RolloutAction, RolloutMode
from controlplane.telemetry.repository import RollupFilter
from controlplane.telemetry.service import summarize
from controlplane.worker.repository import WorkerRepository
from policies import validate_data

# The gate's status -> the status of its ``engines`` check (``none`` adds no check).
_GATE_CHECKS = {"ready": "pass", "waiting": "pending", "failed": "breach"}
# Engines named in a check's detail; a large canary's rest is counted.
_NAMED = 10


@dataclass(frozen=True, slots=True)
class EngineGate:
    """Whether a step's canary engines run the revision's arguments, and from when the step is judged.

    ``status``: ``none`` (no live canary worker supervises its engines: judged from the step's start),
    ``ready`` (every one serves the revision's arguments), ``waiting`` (some are starting, draining,
    restarting or stopped, or still on other arguments without an error about this revision), ``failed`` (some
    did not come up with the revision's arguments, with an error about them (``error_revision``): back on the
    previous ones, or down).
    """

    status: str
    judged_from: dt.datetime
    detail: str = ""

    def check(self) -> Check | None:
        """The look's ``engines`` check; None when no supervised engine is involved."""
        status = _GATE_CHECKS.get(self.status)
        return None if status is None else Check("engines", status, None, None, None, None, self.detail)


def _time(value: object) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return when.replace(tzinfo=dt.UTC) if when.tzinfo is None else when


def _listing(items: Sequence[str]) -> str:
    more = len(items) - _NAMED
    return "; ".join(items[:_NAMED]) + (f"; and {more} more" if more > 0 else "")


def engine_gate(reports: Mapping[str, Sequence[Mapping[str, Any]]], to_revision: str,
                step_started_at: dt.datetime) -> EngineGate:
    """The engine gate of a workers-mode step (see the module doc) from what its canary reports.

    ``reports``: the engine reports (as the control plane stores them, with ``serving_since``) of each live
    worker that runs ``to_revision`` and supervises its engines, by worker id.
    """
    short = to_revision[:12]
    failed: list[str] = []
    waiting: list[str] = []
    ready: list[tuple[dt.datetime, str, str]] = []
    for worker_id, engines in sorted(reports.items()):
        for report in engines:
            name, state, revision = report.get("engine"), report.get("state"), report.get("revision")
            since = _time(report.get("serving_since"))
            if revision == to_revision and state == "serving" and since is not None:
                ready.append((since, worker_id, str(name)))
            elif not report.get("last_error") or report.get("error_revision") != to_revision:
                # No error about this revision's arguments (one left from before, a crash of the previous
                # arguments, is no verdict on the canary): on its way, or not there yet.
                waiting.append(f"worker {worker_id}: engine {name} {state} "
                               f"(on revision {str(revision)[:12] if revision else 'none'})")
            elif revision != to_revision and state in ("serving", "failed"):
                failed.append(f"worker {worker_id}: engine {name} cannot run revision {short}'s arguments "
                              f"({report['last_error']})")
            elif state == "failed":
                # Down on the revision's own arguments and not coming back: the fallback engine would answer
                # for it for as long as the canary runs.
                failed.append(f"worker {worker_id}: engine {name} is down on revision {short}'s arguments "
                              f"({report['last_error']})")
            else:
                waiting.append(f"worker {worker_id}: engine {name} {state} "
                               f"(on revision {str(revision)[:12] if revision else 'none'})")
    if failed:
        return EngineGate("failed", step_started_at, _listing(failed))
    if waiting:
        return EngineGate("waiting", step_started_at,
                          f"waiting for the canary's engines to serve revision {short}'s arguments (the fallback "
                          f"engine answers for them meanwhile): {_listing(waiting)}")
    if not ready:
        return EngineGate("none", step_started_at)
    latest, worker_id, name = max(ready)
    if latest <= step_started_at:
        return EngineGate("ready", step_started_at,
                          f"the canary's {len(ready)} supervised engines served revision {short}'s arguments "
                          f"before the step started: judged from its start ({step_started_at.isoformat()})")
    # Rollups are per minute, and the minute in which the last engine came up holds requests the fallback
    # engine served: the canary is judged from the next one.
    judged_from = minute_of(latest) + dt.timedelta(minutes=1)
    return EngineGate("ready", judged_from,
                      f"judged from {judged_from.isoformat()}, the first whole minute after the canary's engines "
                      f"came up with revision {short}'s arguments (the last: worker {worker_id}, engine {name}, "
                      f"at {latest.isoformat()}); what the fallback engine served while they restarted is left out")


def canary_engines(session: Session, rollout: Rollout, step_started_at: dt.datetime, *, now: dt.datetime,
                   worker_stale_after_s: float) -> EngineGate:
    """The engine gate of a rollout's current step (started at ``step_started_at``), looked at ``now``."""
    if rollout.mode != RolloutMode.workers.value:
        # A traffic canary runs on the baseline's engines: no worker restarts anything for it.
        return EngineGate("none", step_started_at)
    # A stale worker's report says nothing of now, and a worker that went away must not hold the step forever.
    live = WorkerRepository(session).live_running(
        rollout.to_revision_id, seen_since=now - dt.timedelta(seconds=worker_stale_after_s))
    reports = {w.id: [r for r in w.supervised_engines or () if isinstance(r, dict)] for w in live}
    return engine_gate({w: r for w, r in reports.items() if r}, rollout.to_revision_id, step_started_at)


@dataclass(frozen=True, slots=True)
class GuardrailOutcome:
    evaluation: GuardrailEvaluation
    step: StepEvaluation
    generation: int | None  # to publish after commit when the rollout changed
    engines: EngineGate


def step_cohorts(session: Session, rollout: Rollout, policy: Policy, started_at: dt.datetime,
                 now: dt.datetime) -> tuple[Cohort, Cohort]:
    """Baseline (from-revision) and canary (to-revision) cohorts from the rollups, from ``started_at``'s minute
    (the step's start, or the minute after its canary's engines came up) to ``now``'s."""
    start, end = minute_of(started_at), minute_of(now) + dt.timedelta(minutes=1)
    out = []
    for rid in (rollout.from_revision_id, rollout.to_revision_id):
        rows, _ = summarize(session, RollupFilter(policy=policy.name, revision=rid, explored=False, start=start,
                                                  end=end), [])
        out.append(Cohort.from_rollup(rows[0].counters, rows[0].histograms) if rows else Cohort())
    return out[0], out[1]


def evaluate_guardrails(session: Session, rollout_id: str, *, actor: str, now: dt.datetime, alpha: float,
                        auto_promote: bool, worker_stale_after_s: float) -> GuardrailOutcome:
    """Look at a running rollout's current step: record the look; roll back on a breach.

    With ``auto_promote``, a step whose guardrails all pass moves on to the
    next step (the last one completes the rollout). A workers-mode step whose
    canary engines are not serving the revision's arguments yet is pending,
    and one whose engines cannot run them a breach (the engine gate; workers
    silent for ``worker_stale_after_s`` are left out of it). The caller
    commits, then publishes ``generation`` when it is not None.
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
    gate = canary_engines(session, rollout, step.started_at or rollout.created_at, now=now,
                          worker_stale_after_s=worker_stale_after_s)
    engines = gate.check()
    if engines is not None and gate.status != "ready":
        # No statistics on a window that holds the restart: the fallback engine served the canary's requests.
        result = StepEvaluation("breach" if gate.status == "failed" else "pending", [engines], 0, 0, alpha)
    else:
        baseline, canary = step_cohorts(session, rollout, policy, gate.judged_from, now)
        result = evaluate_step(baseline, canary, guardrails, alpha=alpha)
        if engines is not None:
            result = dataclasses.replace(result, checks=[engines, *result.checks])
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
    return GuardrailOutcome(evaluation, result, generation, gate)


def guardrail_history(session: Session, rollout_id: str, limit: int) -> tuple[Rollout, list[GuardrailEvaluation]]:
    """The rollout and its guardrail evaluations, newest first; NotFound when there is no such rollout."""
    rollout = rollout_service.get_rollout(session, rollout_id)
    return rollout, RolloutRepository(session).evaluations(rollout_id, limit)


def running_rollouts(session: Session) -> list[str]:
    return RolloutRepository(session).running()
