"""Autopilot use cases: its setting, and one look at a policy that may change it.

A look (:func:`look`) is the whole state machine, run by the leader's loop
(:mod:`controlplane.autopilot.runner`) every interval, one policy per
transaction:

- the kill switch on: nothing (``waiting``); a rollout it runs stays where it is;
- a rollout it runs: a terminal rollout is recorded (``completed``,
  ``rolled_back`` by the guardrails, ``aborted``) and forgotten; a paused one
  waits for a person; a running step is held ``hold_s``, then its guardrails
  (the sequential test, end-to-end latency first) are looked at (a
  workers-mode step waits while its canary's engines restart, and is held from
  the minute after they serve the revision's arguments): a breach rolls
  it back, a step with no breach and ``min_samples`` requests in each cohort
  (the canary alone at 100 %) is promoted, the last promote completing it;
- otherwise a new change, unless a rollout is in flight (anyone's), a person
  changed the policy within ``hold_s``, ``max_changes_per_day`` rollouts began
  in the last 24 hours, or the active revision has run less than ``hold_s``:
  the recommendations on the evidence since the active revision became active,
  the best applicable one of the allowed kinds at or above ``min_confidence``
  (narrowing speculation before widening it), a draft revision with its edit
  (author ``system:autopilot``, the evidence in its message) and a ``traffic``
  canary over ``steps``.

Every action is an autopilot event (its history, with the evidence) and an audit
event (``autopilot.*``, target type ``autopilot``). Services never commit: the
caller owns the unit of work, and publishes the returned generation after it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy.orm import Session

from analysis import edits
from analysis.recommend import Recommendation, RecommendConfig
from controlplane.analysis import service as analysis_service
from controlplane.analysis.repository import AnalysisRepository
from controlplane.audit.service import record
from controlplane.autopilot.repository import AutopilotRepository
from controlplane.autopilot.schemas import KIND_ORDER, AutopilotUpdate, Confidence
from controlplane.errors import Conflict, NotFound, PreconditionFailed, ValidationFailed
from controlplane.models import Autopilot, AutopilotEvent, Policy, Rollout, utcnow
from controlplane.policy import service as policy_service
from controlplane.rollout import guardrails
from controlplane.rollout import service as rollout_service
from controlplane.rollout.repository import RolloutRepository
from controlplane.rollout.schemas import RolloutAction, RolloutCreate, RolloutMode
from policies import PolicyValidationError, revision_id, validate_data

ACTOR = rollout_service.AUTOPILOT_ACTOR
SYSTEM_PREFIX = "system:"
DAY = dt.timedelta(days=1)
# A change rolled back (by the guardrails, or by a person) is not proposed again for this long, whatever the
# evidence says.
ROLLBACK_COOLDOWN = dt.timedelta(days=7)
HISTORY = 50
_RANK = {Confidence.low: 0, Confidence.medium: 1, Confidence.high: 2}


def _policy(session: Session, name: str) -> Policy:
    policy = RolloutRepository(session).policy_by_name(name)
    if policy is None:
        raise NotFound(f"policy {name!r} does not exist")
    return policy


def _snapshot(ap: Autopilot | None) -> dict[str, Any] | None:
    if ap is None:
        return None
    return {"enabled": ap.enabled, "min_confidence": ap.min_confidence, "steps": list(ap.steps),
            "hold_s": ap.hold_s, "min_samples": ap.min_samples, "max_changes_per_day": ap.max_changes_per_day,
            "kinds": list(ap.kinds)}


def _event(session: Session, ap: Autopilot, policy: Policy, action: str, *, actor: str, now: dt.datetime,
           detail: dict[str, Any], rollout_id: str | None = None, revision_id: str | None = None,
           reason: str = "") -> None:
    """One entry of the autopilot's history and its audit event."""
    AutopilotRepository(session).add_event(AutopilotEvent(policy_id=ap.policy_id, at=now, action=action,
                                                          rollout_id=rollout_id, revision_id=revision_id,
                                                          detail=detail))
    record(session, actor=actor, action=f"autopilot.{action}", target_type="autopilot", target_id=policy.name,
           after={"rollout": rollout_id, "revision": revision_id, **detail}, reason=reason or action)


def _status(ap: Autopilot, status: str, detail: str) -> None:
    ap.status, ap.status_detail = status, detail[:4000]


# --- the setting ----------------------------------------------------------------------------------

def configure(session: Session, policy_name: str, body: AutopilotUpdate, *,
              actor: str) -> tuple[Autopilot, int | None]:
    """Replace a policy's autopilot setting; disabling it pauses the rollout it runs, for a person.

    Returns the autopilot and the generation to announce (the pause changes bundles), or None.
    """
    errors = rollout_service.step_errors(body.steps)
    if errors:
        raise ValidationFailed(f"the steps have {len(errors)} error{'s' if len(errors) != 1 else ''}",
                               errors=errors)
    policy = RolloutRepository(session).lock_policy(name=policy_name)
    if policy is None:
        raise NotFound(f"policy {policy_name!r} does not exist")
    repo = AutopilotRepository(session)
    ap = repo.get(policy.id)
    before = _snapshot(ap)
    now = utcnow()
    if ap is None:
        ap = repo.add(Autopilot(policy_id=policy.id, enabled=False, min_confidence=body.min_confidence.value,
                                steps=list(body.steps), hold_s=body.hold_s, min_samples=body.min_samples,
                                max_changes_per_day=body.max_changes_per_day, kinds=[k.value for k in body.kinds],
                                status="off", status_detail="", updated_at=now, updated_by=actor))
    was_enabled = bool(before and before["enabled"])
    ap.enabled = body.enabled
    ap.min_confidence = body.min_confidence.value
    ap.steps = list(body.steps)
    ap.hold_s = body.hold_s
    ap.min_samples = body.min_samples
    ap.max_changes_per_day = body.max_changes_per_day
    ap.kinds = [k.value for k in body.kinds]
    ap.updated_at, ap.updated_by = now, actor
    generation = None
    action = "updated" if body.enabled == was_enabled else ("enabled" if body.enabled else "disabled")
    if body.enabled and ap.status == "off":
        _status(ap, "idle", "enabled; the next look decides")
    if not body.enabled:
        _status(ap, "off", f"disabled by {actor}")
        generation = _hand_over(session, ap, policy, actor=actor, now=now)
    _event(session, ap, policy, action, actor=actor, now=now,
           detail={"before": before, "after": _snapshot(ap)}, reason=f"autopilot {action} by {actor}")
    return ap, generation


def _hand_over(session: Session, ap: Autopilot, policy: Policy, *, actor: str, now: dt.datetime) -> int | None:
    """Disabled mid-rollout: pause the autopilot's rollout and leave it to a person."""
    if ap.rollout_id is None:
        return None
    rollout_id, ap.rollout_id = ap.rollout_id, None
    rollout = RolloutRepository(session).get(rollout_id)
    if rollout is None or rollout.state != "running":
        return None
    _, generation = rollout_service.apply_action(
        session, rollout_id, RolloutAction.pause, actor=actor,
        reason="the autopilot was disabled mid-rollout: paused for a person to promote, resume or abort")
    _status(ap, "off", f"disabled by {actor}; its rollout {rollout_id} is paused for a person")
    _event(session, ap, policy, "paused", actor=actor, now=now, rollout_id=rollout_id,
           revision_id=rollout.to_revision_id, detail={"step": rollout.current_step})
    return generation


def read(session: Session, policy_name: str) -> tuple[Policy, Autopilot | None, list[AutopilotEvent], int]:
    """The policy, its autopilot (None when never set), its history (newest first) and changes today."""
    policy = _policy(session, policy_name)
    repo = AutopilotRepository(session)
    changes = repo.count_events(policy.id, "started", utcnow() - DAY)
    return policy, repo.get(policy.id), repo.events(policy.id, HISTORY), changes


def enabled_policies(session: Session) -> list[str]:
    return [policy_id for policy_id, _ in AutopilotRepository(session).enabled()]


# --- one look -------------------------------------------------------------------------------------

def look(session: Session, policy_id: str, *, now: dt.datetime, alpha: float,
         worker_stale_after_s: float) -> int | None:
    """Look at one policy's autopilot once (see the module doc); returns the generation to announce.

    ``worker_stale_after_s``: a worker silent longer than this does not hold a workers-mode step's engine
    gate (:func:`controlplane.rollout.guardrails.canary_engines`)."""
    repo = AutopilotRepository(session)
    ap = repo.get(policy_id)
    policy = RolloutRepository(session).policy(policy_id)
    if ap is None or policy is None or not ap.enabled:
        return None
    ap.last_look_at = now
    if rollout_service.get_kill_switch(session).kill_switch:
        _status(ap, "waiting", "the kill switch is on: the autopilot changes nothing until it is off")
        return None
    if ap.rollout_id is not None:
        return _follow(session, ap, policy, now=now, alpha=alpha, worker_stale_after_s=worker_stale_after_s)
    return _propose(session, ap, policy, now=now)


def _follow(session: Session, ap: Autopilot, policy: Policy, *, now: dt.datetime, alpha: float,
            worker_stale_after_s: float) -> int | None:
    """Hold, promote or record the end of the rollout the autopilot runs (under the policy's lock: a person's
    disable, pause or rollback of the same policy waits for the look, or the look sees it)."""
    rollouts = RolloutRepository(session)
    rollouts.lock_policy(policy_id=policy.id)
    locked = AutopilotRepository(session).get(policy.id)
    if locked is None or not locked.enabled or locked.rollout_id is None:
        return None
    rollout = rollouts.get(locked.rollout_id)
    if rollout is None:
        ap.rollout_id = None
        _status(ap, "idle", "its rollout no longer exists")
        return None
    if rollout.state in ("completed", "rolled_back", "aborted"):
        _ended(session, ap, policy, rollout, now=now)
        return None
    if rollout.state == "paused":
        _status(ap, "paused", f"rollout {rollout.id} was paused by a person: resume, promote or abort it")
        return None
    step = rollouts.step(rollout.id, rollout.current_step)
    assert step is not None
    started = step.started_at or rollout.created_at
    where = f"rollout {rollout.id} step {rollout.current_step} at {step.percent:g} %"
    gate = guardrails.canary_engines(session, rollout, started, now=now, worker_stale_after_s=worker_stale_after_s)
    if gate.status == "waiting":
        _status(ap, "rolling_out", f"{where}: {gate.detail}")
        return None
    # The hold is of the canary running the revision: it starts when its engines serve the revision's arguments.
    # A canary whose engines cannot run them is not held: the look below rolls it back.
    held = (now - gate.judged_from).total_seconds()
    since = "" if gate.judged_from == started else f" since {gate.judged_from.isoformat()} (its engines restarted)"
    if held < ap.hold_s and gate.status != "failed":
        _status(ap, "rolling_out", f"{where}: held {max(held, 0):.0f} of {ap.hold_s:.0f} s{since}")
        return None
    outcome = guardrails.evaluate_guardrails(session, rollout.id, actor=ACTOR, now=now, alpha=alpha,
                                             auto_promote=False, worker_stale_after_s=worker_stale_after_s)
    result = outcome.step
    if outcome.evaluation.action == "rolled_back":
        ap.rollout_id = None
        _status(ap, "idle", f"{where}: rolled back by the guardrails")
        _event(session, ap, policy, "rolled_back", actor=ACTOR, now=now, rollout_id=rollout.id,
               revision_id=rollout.to_revision_id,
               detail={"step": rollout.current_step, "guardrails": result.to_dict()},
               reason=", ".join(c.detail for c in result.breaches))
        return outcome.generation
    if outcome.engines.status == "waiting":  # an engine began restarting since the gate above
        _status(ap, "rolling_out", f"{where}: {outcome.engines.detail}")
        return None
    # The policy's own guardrail minimum too: below it the sequential test has not looked at all.
    target = rollouts.revision(rollout.to_revision_id)
    floor = validate_data(target.document).guardrails.min_samples if target is not None else 1
    need = max(ap.min_samples, floor)
    last = step.percent >= 100
    enough = result.canary_requests >= need and (last or result.baseline_requests >= need)
    if not enough:
        _status(ap, "rolling_out", f"{where}: waiting for {need} requests per cohort (baseline "
                                   f"{result.baseline_requests}, canary {result.canary_requests})")
        return None
    position = rollout.current_step
    try:
        rollout, generation = rollout_service.apply_action(
            session, rollout.id, RolloutAction.promote, actor=ACTOR, expected_step=position,
            reason=f"autopilot: step {position} held {held:.0f} s with no guardrail breach (verdict {result.verdict}; "
                   f"baseline {result.baseline_requests}, canary {result.canary_requests} requests)")
    except Conflict as exc:  # a person moved it meanwhile: look again next time
        _status(ap, "rolling_out", f"{where}: not promoted ({exc.detail})")
        return None
    done = rollout.state == "completed"
    _event(session, ap, policy, "completed" if done else "promoted", actor=ACTOR, now=now, rollout_id=rollout.id,
           revision_id=rollout.to_revision_id, detail={"step": position, "guardrails": result.to_dict()})
    if done:
        ap.rollout_id = None
        _status(ap, "idle", f"rollout {rollout.id} completed: revision {rollout.to_revision_id[:12]} is active")
    else:
        _status(ap, "rolling_out", f"rollout {rollout.id} promoted to step {rollout.current_step}")
    return generation


def _ended(session: Session, ap: Autopilot, policy: Policy, rollout: Rollout, *, now: dt.datetime) -> None:
    """A rollout of the autopilot's ended by someone else (a guardrail look of the evaluator, a person)."""
    ap.rollout_id = None
    action = {"completed": "completed", "rolled_back": "rolled_back", "aborted": "aborted"}[rollout.state]
    last = RolloutRepository(session).latest_guardrail_evaluations([rollout.id]).get(rollout.id)
    _status(ap, "idle", f"rollout {rollout.id} ended {rollout.state}")
    _event(session, ap, policy, action, actor=ACTOR, now=now, rollout_id=rollout.id,
           revision_id=rollout.to_revision_id,
           detail={"step": rollout.current_step, "ended_by": "another actor",
                   "guardrails": None if last is None else {"verdict": last.verdict, "checks": last.checks}})


def _candidates(recs: list[Recommendation], ap: Autopilot) -> list[Recommendation]:
    """The recommendations it may apply, best first (narrowing before widening, then by confidence)."""
    allowed = set(ap.kinds)
    floor = _RANK[Confidence(ap.min_confidence)]
    usable = [r for r in recs if r.kind in allowed and r.applicable and r.edit is not None
              and _RANK[Confidence(r.confidence)] >= floor]
    order = {k.value: i for i, k in enumerate(KIND_ORDER)}
    usable.sort(key=lambda r: (order.get(r.kind, len(order)), -_RANK[Confidence(r.confidence)], r.route))
    return usable


def _wait(ap: Autopilot, detail: str) -> None:
    _status(ap, "waiting", detail)


def _blocked(session: Session, ap: Autopilot, policy: Policy, now: dt.datetime) -> str | None:
    """Why the autopilot may not start a change now, or None."""
    repo = AutopilotRepository(session)
    hold = dt.timedelta(seconds=ap.hold_s)
    open_rollout = RolloutRepository(session).open_for_policy(policy.id)
    if open_rollout is not None:
        return (f"rollout {open_rollout.id} by {open_rollout.created_by} is {open_rollout.state}: "
                "the autopilot waits for it to end")
    person = repo.last_person_change(policy, SYSTEM_PREFIX)
    if person is not None and now - person < hold:
        return f"a person changed the policy at {person.isoformat()}: hands off for hold_s ({ap.hold_s:.0f} s)"
    changes = repo.count_events(policy.id, "started", now - DAY)
    if changes >= ap.max_changes_per_day:
        return f"{changes} rollouts started in the last 24 hours: max_changes_per_day is {ap.max_changes_per_day}"
    since = repo.last_activation(policy)
    if now - since < hold:
        return (f"the active revision runs since {since.isoformat()}: evidence is gathered for hold_s "
                f"({ap.hold_s:.0f} s) first")
    return None


def _propose(session: Session, ap: Autopilot, policy: Policy, *, now: dt.datetime) -> int | None:
    """A new draft and its traffic canary from the best recommendation, unless something says wait.

    The evidence is read without the policy's lock (it takes a while, and on SQLite the lock is the database's
    write lock); the checks that a person's action could change are made again under the lock, and the draft
    and its rollout are written under it, in the look's transaction: a failure leaves neither behind.
    """
    repo = AutopilotRepository(session)
    blocked = _blocked(session, ap, policy, now)
    if blocked is not None:
        _wait(ap, blocked)
        return None
    since = repo.last_activation(policy)
    cfg = RecommendConfig(min_samples=ap.min_samples)
    try:
        revision, recs, _, worker = analysis_service.recommendations_with_evidence(
            session, policy.name, start=since, end=now, cfg=cfg)
    except Conflict as exc:  # no active revision
        _wait(ap, exc.detail)
        return None
    analysis_service.check_edits(revision, recs)
    head = AnalysisRepository(session).head(policy.id)
    if head is not None and head.id != revision.id and head.author != ACTOR and not repo.given_up(head.id):
        # Its edit applies to the active revision: building on a person's newer draft would drop that draft's
        # changes from the head. A draft whose rollout was aborted or rolled back has had its turn.
        _wait(ap, f"revision #{head.seq} {head.id[:12]} by {head.author}, newer than the active revision, is "
                  "pending: the autopilot does not build over a person's draft (roll it out, or abort its rollout)")
        return None
    chosen: tuple[Recommendation, dict[str, Any], str] | None = None
    passed_over = []
    for rec in _candidates(recs, ap):
        try:
            edited, parsed = edits.apply_edit(revision.document, rec.edit or {})
        except (PolicyValidationError, ValueError):  # checked above; cannot happen on the same document
            continue
        target = revision_id(parsed)
        if repo.rolled_back_since(policy.id, target, now - ROLLBACK_COOLDOWN):
            passed_over.append(rec.kind)
            continue
        chosen = (rec, edited, target)
        break
    if chosen is None:
        kinds = sorted({r.kind for r in recs})
        _status(ap, "idle", f"no applicable recommendation of kinds {', '.join(ap.kinds)} at or above "
                            f"{ap.min_confidence} confidence ({len(recs)} listed"
                            f"{': ' + ', '.join(kinds) if kinds else ''}"
                            f"{'; rolled back within 7 days: ' + ', '.join(passed_over) if passed_over else ''})")
        return None
    best, edited, _ = chosen
    RolloutRepository(session).lock_policy(policy_id=policy.id)
    locked = repo.get(policy.id)
    if locked is None or not locked.enabled or locked.rollout_id is not None:
        return None  # disabled, or acting, since the look began
    blocked = _blocked(session, ap, policy, now)
    if blocked is not None:
        _wait(ap, blocked)
        return None
    message = (f"autopilot: {best.message} [recommendation {best.id}, {best.kind}, confidence {best.confidence}, "
               f"measure {best.measure}, evidence since {since.isoformat()}, based on {revision.id[:12]}]")
    try:
        outcome = policy_service.create_revision(
            session, policy_name=policy.name, submission=policy_service.Submission(data=edited, message=message[:4000]),
            if_match=policy_service.IfMatch(any=False, tags=frozenset({head.id} if head is not None else set())),
            actor=ACTOR)
    except PreconditionFailed:
        _wait(ap, "a revision was saved while the autopilot looked: it looks again next time")
        return None
    rollout, generation = rollout_service.start_rollout(
        session, RolloutCreate(policy=policy.name, revision=outcome.revision.id, mode=RolloutMode.traffic,
                               steps=list(ap.steps), reason=message[:2000]), actor=ACTOR)
    ap.rollout_id = rollout.id
    _status(ap, "rolling_out", f"rollout {rollout.id} of revision {outcome.revision.id[:12]} started: {best.title}")
    evidence = {"recommendation": {k: v for k, v in best.to_dict().items() if k != "evidence"},
                "switchback": None if worker is None else worker.to_dict(),
                "evidence_since": since.isoformat(), "based_on": revision.id}
    _event(session, ap, policy, "started", actor=ACTOR, now=now, rollout_id=rollout.id,
           revision_id=outcome.revision.id, detail=evidence, reason=best.message)
    return generation
