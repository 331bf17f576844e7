"""The autopilot API: a policy's setting (admin) and its state and history (any reader)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request

from controlplane.autopilot import service
from controlplane.autopilot.schemas import AutopilotEventRead, AutopilotRead, AutopilotUpdate, ChangeKind, Confidence
from controlplane.deps import Admin, Announce, Reader, SessionDep
from controlplane.errors import AUTH_RESPONSES, INVALID_RESPONSE, TOO_LARGE_RESPONSE, problems
from controlplane.models import Autopilot, AutopilotEvent, Policy
from controlplane.rollout.schemas import NO_NUL

router = APIRouter(tags=["autopilot"], responses=AUTH_RESPONSES)

PolicyNameParam = Annotated[str, Path(max_length=63, pattern=NO_NUL)]
_NO_POLICY = problems({404: "no such policy"})


def _present(request: Request, policy: Policy, ap: Autopilot | None, history: list[AutopilotEvent],
             changes: int) -> AutopilotRead:
    leader = getattr(request.app.state, "autopilot_leader", None)
    events = [AutopilotEventRead.model_validate(e) for e in history]
    if ap is None:  # never set: what a PUT of {"enabled": true} alone would set, switched off
        defaults = AutopilotUpdate(enabled=False)
        return AutopilotRead(policy=policy.name, enabled=False, min_confidence=defaults.min_confidence,
                             steps=defaults.steps, hold_s=defaults.hold_s, min_samples=defaults.min_samples,
                             max_changes_per_day=defaults.max_changes_per_day, kinds=defaults.kinds, status="off",
                             status_detail="never enabled", rollout=None, changes_today=changes, last_look_at=None,
                             updated_at=policy.created_at, updated_by=policy.created_by, leader=leader,
                             history=events)
    return AutopilotRead(policy=policy.name, enabled=ap.enabled, min_confidence=Confidence(ap.min_confidence),
                         steps=list(ap.steps), hold_s=ap.hold_s, min_samples=ap.min_samples,
                         max_changes_per_day=ap.max_changes_per_day,
                         kinds=[ChangeKind(k) for k in ap.kinds if k in ChangeKind.__members__],
                         status=ap.status, status_detail=ap.status_detail, rollout=ap.rollout_id,
                         changes_today=changes, last_look_at=ap.last_look_at, updated_at=ap.updated_at,
                         updated_by=ap.updated_by, leader=leader, history=events)


@router.put("/v1/policies/{name}/autopilot", response_model=AutopilotRead,
            responses={**_NO_POLICY, **TOO_LARGE_RESPONSE, **INVALID_RESPONSE},
            description="Replace the policy's autopilot setting (admin). Enabled, a control-plane task looks at the "
                        "policy every SPECGATE_AUTOPILOT_INTERVAL_S: it applies the best recommendation of the "
                        "allowed kinds at or above min_confidence as a draft revision (author system:autopilot) and "
                        "rolls it out as a traffic canary over steps, holding each step hold_s and promoting it "
                        "with min_samples per cohort and no guardrail breach. Disabling it mid-rollout pauses "
                        "that rollout for a person.")
def put_autopilot(name: PolicyNameParam, body: AutopilotUpdate, request: Request, session: SessionDep,
                  announce: Announce, who: Admin) -> AutopilotRead:
    _, generation = service.configure(session, name, body, actor=who.actor)
    announce(generation)
    policy, ap, history, changes = service.read(session, name)
    return _present(request, policy, ap, history, changes)


@router.get("/v1/policies/{name}/autopilot", response_model=AutopilotRead,
            responses={**_NO_POLICY, **INVALID_RESPONSE},
            description="The policy's autopilot: setting, what its last look found (status, status_detail), the "
                        "rollout it runs, and its history newest first, each entry with its evidence.")
def get_autopilot(name: PolicyNameParam, request: Request, session: SessionDep, _: Reader) -> AutopilotRead:
    policy, ap, history, changes = service.read(session, name)
    return _present(request, policy, ap, history, changes)
