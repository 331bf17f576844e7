"""Rollouts, rollbacks and the kill switch: every way the fleet's active policy changes after creation.

A rollout moves a policy from its active revision to another one step by step;
an explicit transition table decides which actions each state allows. Every
change locks the policy (or the fleet_state row), writes an audit event and
bumps the distribution generation in the caller's transaction; the caller
commits and then wakes the hub with the returned generation.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from controlplane.audit.service import record
from controlplane.distribution.publish import bump_generation
from controlplane.errors import Conflict, NotFound, ValidationFailed
from controlplane.models import FleetState, Policy, Rollout, RolloutStep, utcnow
from controlplane.rollout.repository import RolloutRepository
from controlplane.rollout.schemas import (
    GuardrailSnapshot,
    RolloutAction,
    RolloutCreate,
    RolloutRead,
    RolloutState,
    StepOutcome,
    StepRead,
    Target,
)
from policies import sticky_fraction

GUARDRAIL_ACTOR = "system:guardrails"
# The autopilot's rollouts promote on its own hold and sample rules, never on the evaluator's auto-promote.
AUTOPILOT_ACTOR = "system:autopilot"

S, A = RolloutState, RolloutAction

# (state, action) -> the state after it. Promote keeps a rollout running on the
# next step, except at the last step, where it completes (see _next_state).
# Anything not listed is refused with 409.
TRANSITIONS: dict[tuple[RolloutState, RolloutAction], RolloutState] = {
    (S.running, A.promote): S.running,
    (S.running, A.pause): S.paused,
    (S.paused, A.resume): S.running,
    (S.running, A.abort): S.aborted,
    (S.paused, A.abort): S.aborted,
    (S.running, A.rollback): S.rolled_back,
    (S.paused, A.rollback): S.rolled_back,
}

TERMINAL_STATES = frozenset({S.completed, S.aborted, S.rolled_back})

# The actions a client can ask for at /v1/rollouts/{id}/{action}; rollback comes
# only from a policy rollback or a guardrail breach.
ENDPOINT_ACTIONS = (A.promote, A.pause, A.resume, A.abort)

# How the current step ends when an action leaves it; pause and resume leave it running.
_STEP_OUTCOMES = {A.promote: StepOutcome.promoted, A.abort: StepOutcome.aborted,
                  A.rollback: StepOutcome.rolled_back}


# -- cohorts (the distribution code builds bundles with these; the salts are pure) ---------------------

def canary_salt(rollout_id: str, *, cohort_secret: str) -> str:
    """The salt of a rollout's split: sidecars bucket requests by it in traffic mode.

    The hex HMAC-SHA256 of the rollout id keyed by the fleet's cohort secret: a public salt would let a
    client compute which request ids land in the canary and choose its cohort.
    """
    return hmac.new(cohort_secret.encode(), rollout_id.encode(), hashlib.sha256).hexdigest()


def worker_in_canary(worker_id: str, rollout_id: str, percent: float, *, cohort_secret: str) -> bool:
    """Whether a targeted worker runs the new revision at this percent (workers mode).

    Sticky per (worker, rollout) and monotonic in ``percent``: a worker in the
    canary at one step stays in at every later, larger step.
    """
    return sticky_fraction(worker_id, canary_salt(rollout_id, cohort_secret=cohort_secret)) * 100 < percent


def fleet_cohort_secret(session: Session) -> str:
    """The fleet's cohort secret (generated at start-up; '' before the first start on this database)."""
    return RolloutRepository(session).cohort_secret()


# -- the state machine -----------------------------------------------------------------------------

def allowed_actions(state: RolloutState | str) -> list[RolloutAction]:
    return [a for a in ENDPOINT_ACTIONS if (RolloutState(state), a) in TRANSITIONS]


def _next_state(rollout: Rollout, action: RolloutAction, last_step: int) -> RolloutState:
    state = RolloutState(rollout.state)
    after = TRANSITIONS.get((state, action))
    if after is None:
        allowed = allowed_actions(state)
        hint = f"allowed: {', '.join(allowed)}" if allowed else "it has ended; start a new rollout"
        raise Conflict(f"cannot {action.value} rollout {rollout.id!r}: it is {state.value} ({hint})",
                       state=state.value, allowed_actions=[a.value for a in allowed])
    if action is A.promote and rollout.current_step >= last_step:
        return S.completed
    return after


def _field_error(path: str, code: str, message: str) -> dict[str, str]:
    return {"path": path, "in": "body", "code": code, "message": message}


def step_errors(steps: Sequence[float]) -> list[dict[str, str]]:
    """What the schema cannot say about a step list (each percent's range it checks itself)."""
    errors = [_field_error(f"steps[{i}]", "not_increasing",
                           f"steps must be strictly increasing: {steps[i]} follows {steps[i - 1]}")
              for i in range(1, len(steps)) if not steps[i] > steps[i - 1]]
    if steps and steps[-1] != 100:
        errors.append(_field_error(f"steps[{len(steps) - 1}]", "last_not_100",
                                   f"the last step must be 100 (everyone), got {steps[-1]}"))
    return errors


def _snapshot(rollout: Rollout, steps: Sequence[RolloutStep]) -> dict[str, Any]:
    return {"state": rollout.state, "current_step": rollout.current_step,
            "percent": steps[rollout.current_step].percent if steps else None}


def _transition(session: Session, rollout: Rollout, action: RolloutAction, *, actor: str, reason: str,
                audit_action: str | None = None, extra_after: dict[str, Any] | None = None) -> Rollout:
    """Apply one table transition to a rollout whose policy the caller has locked."""
    repo = RolloutRepository(session)
    steps = repo.steps(rollout.id)
    state = _next_state(rollout, action, last_step=len(steps) - 1)
    before = _snapshot(rollout, steps)
    now = utcnow()
    current = steps[rollout.current_step]
    outcome = _STEP_OUTCOMES.get(action)
    if outcome is not None:
        current.finished_at = now
        current.outcome = (StepOutcome.completed if state is S.completed else outcome).value
    if action is A.promote and state is S.running:
        rollout.current_step += 1
        steps[rollout.current_step].started_at = now
    rollout.state = state.value
    rollout.updated_at = now
    after = _snapshot(rollout, steps)
    if state is S.completed:
        policy = repo.policy(rollout.policy_id)
        if policy is None:
            raise NotFound(f"the policy of rollout {rollout.id!r} no longer exists")
        before["active_revision"] = policy.active_revision_id
        policy.active_revision_id = rollout.to_revision_id
        after["active_revision"] = rollout.to_revision_id
    after.update(extra_after or {})
    repo.flush()
    record(session, actor=actor, action=audit_action or f"rollout.{action.value}", target_type="rollout",
           target_id=rollout.id, before=before, after=after, reason=reason)
    return rollout


def _locked_rollout(session: Session, rollout_id: str) -> Rollout:
    repo = RolloutRepository(session)
    rollout = repo.get(rollout_id)
    if rollout is None:
        raise NotFound(f"rollout {rollout_id!r} does not exist")
    # Every change of a policy's rollouts and active revision serialises on the
    # policy, so a promote racing a rollback cannot both win.
    repo.lock_policy(policy_id=rollout.policy_id)
    rollout = repo.get(rollout_id, refresh=True)
    if rollout is None:
        raise NotFound(f"rollout {rollout_id!r} does not exist")
    return rollout


# -- use cases ---------------------------------------------------------------------------------------

def start_rollout(session: Session, body: RolloutCreate, *, actor: str) -> tuple[Rollout, int]:
    repo = RolloutRepository(session)
    errors = step_errors(body.steps)
    policy = repo.lock_policy(name=body.policy)
    if policy is None:
        errors.append(_field_error("policy", "not_found", f"policy {body.policy!r} does not exist"))
    elif policy.active_revision_id is None:
        errors.append(_field_error("policy", "no_active_revision",
                                   f"policy {body.policy!r} has no active revision to roll out from"))
    revision = repo.revision(body.revision)
    if revision is None:
        errors.append(_field_error("revision", "not_found", f"revision {body.revision!r} does not exist"))
    elif policy is not None and revision.policy_id != policy.id:
        errors.append(_field_error("revision", "wrong_policy",
                                   f"revision {body.revision!r} belongs to another policy"))
    elif policy is not None and revision.id == policy.active_revision_id:
        errors.append(_field_error("revision", "already_active",
                                   f"revision {body.revision!r} is already the active revision"))
    if policy is not None and policy.pool is not None and body.target.pool not in (None, policy.pool):
        # Only the policy's own pool runs it: such a canary would reach no worker.
        errors.append(_field_error("target.pool", "pool_mismatch",
                                   f"policy {policy.name!r} runs on pool {policy.pool!r} only"))
    if errors:
        n = len(errors)
        raise ValidationFailed(f"the rollout has {n} error{'s' if n != 1 else ''}", errors=errors)
    assert policy is not None
    assert policy.active_revision_id is not None
    assert revision is not None
    open_rollout = repo.open_for_policy(policy.id)
    if open_rollout is not None:
        raise Conflict(f"policy {policy.name!r} already has a {open_rollout.state} rollout "
                       f"({open_rollout.id}); finish or abort it first",
                       state=open_rollout.state, rollout=open_rollout.id)
    now = utcnow()
    rollout = Rollout(policy_id=policy.id, from_revision_id=policy.active_revision_id,
                      to_revision_id=revision.id, mode=body.mode.value, target_pool=body.target.pool,
                      target_labels=dict(body.target.labels),
                      state=S.running.value, current_step=0, reason=body.reason, created_by=actor,
                      created_at=now, updated_at=now)
    steps = repo.add(rollout, body.steps, started_at=now)
    record(session, actor=actor, action="rollout.start", target_type="rollout", target_id=rollout.id,
           before={"active_revision": policy.active_revision_id},
           after={"policy": policy.name, "from_revision": rollout.from_revision_id,
                  "to_revision": rollout.to_revision_id, "mode": rollout.mode,
                  "target": body.target.model_dump(), "steps": [s.percent for s in steps],
                  **_snapshot(rollout, steps)},
           reason=body.reason)
    return rollout, bump_generation(session)


class StaleStep(Conflict):
    """A promote named a step that is no longer the rollout's current one."""


def _check_expected_step(rollout: Rollout, expected_step: int) -> None:
    # Compared under the policy lock: whoever read the step before (an operator's page, a guardrail
    # look) promotes only the step they saw, so two promotes of one step cannot both move it on, and a
    # look at step 0 cannot promote step 1, which it never evaluated.
    if rollout.current_step != expected_step:
        raise StaleStep(
            f"rollout {rollout.id!r} is at step {rollout.current_step}, not {expected_step}: it moved since "
            "it was read; look at it again before promoting",
            errors=[{"path": "expected_step", "in": "body", "code": "stale",
                     "message": f"the current step is {rollout.current_step}"}],
            state=rollout.state, current_step=rollout.current_step)


def apply_action(session: Session, rollout_id: str, action: RolloutAction, *, actor: str,
                 reason: str, expected_step: int | None = None) -> tuple[Rollout, int]:
    """One client action; a promote with ``expected_step`` moves on only from that step (else StaleStep)."""
    if action not in ENDPOINT_ACTIONS:
        raise ValueError(f"{action.value} is not a client action")
    rollout = _locked_rollout(session, rollout_id)
    if expected_step is not None and action is A.promote:
        _check_expected_step(rollout, expected_step)
    rollout = _transition(session, rollout, action, actor=actor, reason=reason)
    return rollout, bump_generation(session)


def rollback_on_guardrail_breach(session: Session, rollout_id: str, reason: str,
                                 evidence: dict[str, Any]) -> Rollout:
    """End a running or paused rollout as rolled_back because its canary breached a guardrail.

    The policy stays on the rollout's from_revision (a rollout changes the
    active revision only when it completes). Raises Conflict when the rollout
    has already ended, NotFound when it does not exist. The caller commits and
    then wakes the hub (``hub.notify()``): this bumps the generation.
    """
    rollout = _locked_rollout(session, rollout_id)
    policy = RolloutRepository(session).policy(rollout.policy_id)
    _transition(session, rollout, A.rollback, actor=GUARDRAIL_ACTOR, reason=reason,
                audit_action="rollout.auto_rollback",
                extra_after={"active_revision": policy.active_revision_id if policy is not None else None,
                             "evidence": evidence})
    bump_generation(session)
    return rollout


@dataclass(frozen=True, slots=True)
class RollbackResult:
    policy: Policy
    previous_revision: str | None
    ended_rollout: Rollout | None
    generation: int


def rollback_policy(session: Session, name: str, revision_id: str, *, actor: str,
                    reason: str) -> RollbackResult:
    repo = RolloutRepository(session)
    policy = repo.lock_policy(name=name)
    if policy is None:
        raise NotFound(f"policy {name!r} does not exist")
    revision = repo.revision(revision_id)
    if revision is None:
        raise NotFound(f"revision {revision_id!r} does not exist")
    if revision.policy_id != policy.id:
        raise ValidationFailed("the revision belongs to another policy", errors=[
            _field_error("revision", "wrong_policy",
                         f"revision {revision_id!r} is not a revision of {name!r}")])
    previous = policy.active_revision_id
    if revision.id == previous:
        raise Conflict(f"revision {revision_id!r} is already active for policy {name!r}; "
                       "to stop a rollout of it, abort the rollout", active_revision=previous)
    ended = repo.open_for_policy(policy.id)
    if ended is not None:
        _transition(session, ended, A.rollback, actor=actor, reason=reason,
                    extra_after={"rolled_back_to": revision.id})
    policy.active_revision_id = revision.id
    repo.flush()
    record(session, actor=actor, action="policy.rollback", target_type="policy", target_id=policy.name,
           before={"active_revision": previous},
           after={"active_revision": revision.id, "ended_rollout": ended.id if ended is not None else None},
           reason=reason)
    return RollbackResult(policy, previous, ended, bump_generation(session))


def get_rollout(session: Session, rollout_id: str) -> Rollout:
    rollout = RolloutRepository(session).get(rollout_id)
    if rollout is None:
        raise NotFound(f"rollout {rollout_id!r} does not exist")
    return rollout


def encode_cursor(rollout: Rollout) -> str:
    raw = f"{rollout.created_at.isoformat()}|{rollout.id}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, rid = raw.split("|", 1)
        when = dt.datetime.fromisoformat(at)
        when = (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).astimezone(dt.UTC)
        if not rid or len(rid) > 64 or "\x00" in rid:
            raise ValueError(rid)
    except (binascii.Error, UnicodeDecodeError, ValueError, OverflowError):
        raise ValidationFailed("the cursor is not one this API gave out", errors=[
            {"path": "cursor", "in": "query", "code": "invalid_cursor",
             "message": "pass next_cursor of the previous page unchanged"}]) from None
    return when, rid


def list_rollouts(session: Session, *, policy: str | None, state: RolloutState | None, cursor: str | None,
                  limit: int) -> tuple[list[Rollout], str | None]:
    repo = RolloutRepository(session)
    policy_id: str | None = None
    if policy is not None:
        found = repo.policy_by_name(policy)
        if found is None:
            return [], None
        policy_id = found.id
    before = decode_cursor(cursor) if cursor else None
    rows = list(repo.search(policy_id=policy_id, state=state.value if state else None, before=before,
                            limit=limit))
    return rows, encode_cursor(rows[-1]) if len(rows) == limit else None


def present(session: Session, rollouts: Sequence[Rollout]) -> list[RolloutRead]:
    repo = RolloutRepository(session)
    names = repo.policy_names(r.policy_id for r in rollouts)
    steps_of = repo.steps_of(r.id for r in rollouts)
    looks = repo.latest_guardrail_evaluations([r.id for r in rollouts])
    out = []
    for r in rollouts:
        steps = steps_of[r.id]
        out.append(RolloutRead(
            id=r.id, policy=names.get(r.policy_id, ""), policy_id=r.policy_id,
            from_revision=r.from_revision_id, to_revision=r.to_revision_id, mode=r.mode,
            target=Target(pool=r.target_pool, labels=r.target_labels),
            steps=[StepRead.model_validate(s, from_attributes=True) for s in steps],
            state=r.state, current_step=r.current_step,
            current_percent=steps[r.current_step].percent if steps else 0.0,
            allowed_actions=allowed_actions(r.state), reason=r.reason, created_by=r.created_by,
            created_at=r.created_at, updated_at=r.updated_at,
            last_guardrail_evaluation=(GuardrailSnapshot.model_validate(looks[r.id], from_attributes=True)
                                       if r.id in looks else None),
        ))
    return out


# -- kill switch ---------------------------------------------------------------------------------

def get_kill_switch(session: Session) -> FleetState:
    state = session.get(FleetState, 1)
    if state is None:
        raise RuntimeError("the database has no fleet_state row: run the migrations first")
    return state


def set_kill_switch(session: Session, *, enabled: bool, reason: str,
                    actor: str) -> tuple[FleetState, int | None]:
    """Returns the switch and the new generation, or None when it already had this value.

    Setting the same value again changes nothing: no audit event, no generation
    bump, so a retried PUT does not make every worker refetch its bundle.
    """
    state = RolloutRepository(session).lock_fleet_state()
    if state.kill_switch == enabled:
        return state, None
    before = {"enabled": state.kill_switch, "reason": state.kill_switch_reason}
    state.kill_switch = enabled
    state.kill_switch_reason = reason
    state.kill_switch_changed_at = utcnow()
    state.kill_switch_changed_by = actor
    record(session, actor=actor, action="killswitch.on" if enabled else "killswitch.off",
           target_type="fleet", target_id="killswitch", before=before,
           after={"enabled": enabled, "reason": reason}, reason=reason)
    return state, bump_generation(session)
