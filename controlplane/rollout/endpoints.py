from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Path, Query, Request
from pydantic import WithJsonSchema

from controlplane.auth.dependencies import OPERATE, READ, require
from controlplane.auth.service import Principal
from controlplane.db import unit_of_work
from controlplane.errors import AUTH_RESPONSES, INVALID_RESPONSE, TOO_LARGE_RESPONSE, ValidationFailed, problems
from controlplane.models import FleetState
from controlplane.rollout import service
from controlplane.rollout.schemas import (
    NO_NUL,
    AbortBody,
    ActionBody,
    KillSwitchChange,
    KillSwitchRead,
    KillSwitchUpdate,
    PolicyRollbackRead,
    RollbackBody,
    RolloutAction,
    RolloutCreate,
    RolloutPage,
    RolloutRead,
    RolloutState,
)

router = APIRouter(tags=["rollouts"], responses=AUTH_RESPONSES)

_NO_ROLLOUT = problems({404: "no such rollout"})
# Any other transition than the ones listed in allowed_actions: the problem carries `state`.
_ILLEGAL = problems({409: "the rollout's state does not allow this action; `state` names it"})
_BODY = {**TOO_LARGE_RESPONSE, **INVALID_RESPONSE}

Reader = Annotated[Principal, Depends(require(*READ))]
Operator = Annotated[Principal, Depends(require(*OPERATE))]
# Promote, pause and resume take an optional body: a reason for the audit log.
OptionalActionBody = Annotated[ActionBody | None, Body()]
# Optional for the parser only, so that a missing body reports `reason` as missing; the schema
# says what is required.
RequiredAbortBody = Annotated[AbortBody | None, WithJsonSchema(AbortBody.model_json_schema()), Body()]
RolloutId = Annotated[str, Path(max_length=64, pattern=NO_NUL)]
PolicyNameParam = Annotated[str, Path(max_length=63, pattern=NO_NUL)]


@router.post("/v1/rollouts", status_code=201, response_model=RolloutRead,
             responses={**problems({409: "the policy already has a running or paused rollout"}), **_BODY})
def start(body: RolloutCreate, request: Request, who: Operator) -> RolloutRead:
    with unit_of_work(request.app.state.sessions) as session:
        rollout, generation = service.start_rollout(session, body, actor=who.actor)
        read = service.present(session, [rollout])[0]
    request.app.state.hub.publish(generation)
    return read


@router.get("/v1/rollouts", response_model=RolloutPage, responses=INVALID_RESPONSE)
def list_rollouts(request: Request,
                  _: Reader,
                  policy: Annotated[str | None, Query(max_length=63, pattern=NO_NUL,
                                                            description="a policy's name")] = None,
                  state: RolloutState | None = None,
                  cursor: Annotated[str | None, Query(max_length=200,
                                                      description="next_cursor of the previous page")] = None,
                  limit: Annotated[int, Query(ge=1, le=500)] = 50) -> RolloutPage:
    with unit_of_work(request.app.state.sessions) as session:
        rows, next_cursor = service.list_rollouts(session, policy=policy, state=state, cursor=cursor,
                                                  limit=limit)
        return RolloutPage(items=service.present(session, rows), next_cursor=next_cursor)


@router.get("/v1/rollouts/{rollout_id}", response_model=RolloutRead,
            responses={**_NO_ROLLOUT, **INVALID_RESPONSE})
def get(rollout_id: RolloutId, request: Request, _: Reader) -> RolloutRead:
    with unit_of_work(request.app.state.sessions) as session:
        return service.present(session, [service.get_rollout(session, rollout_id)])[0]


def _act(request: Request, rollout_id: RolloutId, action: RolloutAction, who: Principal,
         reason: str) -> RolloutRead:
    with unit_of_work(request.app.state.sessions) as session:
        rollout, generation = service.apply_action(session, rollout_id, action, actor=who.actor,
                                                   reason=reason)
        read = service.present(session, [rollout])[0]
    request.app.state.hub.publish(generation)
    return read


@router.post("/v1/rollouts/{rollout_id}/promote", response_model=RolloutRead,
             responses={**_NO_ROLLOUT, **_ILLEGAL, **_BODY},
             description="Move to the next step; at the last step the rollout completes and the policy's "
                         "active revision becomes the rollout's revision.")
def promote(rollout_id: RolloutId, request: Request, who: Operator,
            body: OptionalActionBody = None) -> RolloutRead:
    return _act(request, rollout_id, RolloutAction.promote, who, body.reason if body else "")


@router.post("/v1/rollouts/{rollout_id}/pause", response_model=RolloutRead,
             responses={**_NO_ROLLOUT, **_ILLEGAL, **_BODY},
             description="Hold the current step's split until resumed or ended.")
def pause(rollout_id: RolloutId, request: Request, who: Operator,
          body: OptionalActionBody = None) -> RolloutRead:
    return _act(request, rollout_id, RolloutAction.pause, who, body.reason if body else "")


@router.post("/v1/rollouts/{rollout_id}/resume", response_model=RolloutRead,
             responses={**_NO_ROLLOUT, **_ILLEGAL, **_BODY})
def resume(rollout_id: RolloutId, request: Request, who: Operator,
           body: OptionalActionBody = None) -> RolloutRead:
    return _act(request, rollout_id, RolloutAction.resume, who, body.reason if body else "")


@router.post("/v1/rollouts/{rollout_id}/abort", response_model=RolloutRead,
             responses={**_NO_ROLLOUT, **_ILLEGAL, **_BODY}, openapi_extra={"requestBody": {"required": True}},
             description="Stop splitting; the policy stays on its active revision. A reason is required.")
def abort(rollout_id: RolloutId, request: Request, who: Operator, body: RequiredAbortBody = None) -> RolloutRead:
    if body is None:
        # Without this, a bodiless abort would report the body, not the reason, as missing.
        raise ValidationFailed("1 field did not validate", errors=[
            {"path": "reason", "in": "body", "code": "missing", "message": "an abort needs a reason"}])
    return _act(request, rollout_id, RolloutAction.abort, who, body.reason)


@router.post("/v1/policies/{name}/rollback", response_model=PolicyRollbackRead, tags=["policies"],
             responses={**problems({404: "no such policy, or no such revision",
                                    409: "the revision is already active (`active_revision` names it)"}),
                        **_BODY},
             description="Make any revision of the policy but the active one active at once; a running or "
                         "paused rollout of the policy ends as rolled_back.")
def rollback(name: PolicyNameParam, body: RollbackBody, request: Request,
             who: Operator) -> PolicyRollbackRead:
    with unit_of_work(request.app.state.sessions) as session:
        result = service.rollback_policy(session, name, body.revision, actor=who.actor, reason=body.reason)
        ended = service.present(session, [result.ended_rollout])[0] if result.ended_rollout else None
        read = PolicyRollbackRead(policy=result.policy.name, previous_revision=result.previous_revision,
                                  active_revision=body.revision, ended_rollout=ended)
    request.app.state.hub.publish(result.generation)
    return read


def _switch(state: FleetState) -> KillSwitchRead:
    return KillSwitchRead(enabled=state.kill_switch, reason=state.kill_switch_reason,
                          changed_at=state.kill_switch_changed_at, changed_by=state.kill_switch_changed_by)


@router.get("/v1/killswitch", response_model=KillSwitchRead, tags=["kill switch"])
def get_kill_switch(request: Request, _: Reader) -> KillSwitchRead:
    with unit_of_work(request.app.state.sessions) as session:
        return _switch(service.get_kill_switch(session))


@router.put("/v1/killswitch", response_model=KillSwitchChange, tags=["kill switch"], responses=_BODY,
            description="Every bundle carries the switch; when on, sidecars send every request to the "
                        "policy's plain engine. Setting the current value again changes nothing.")
def put_kill_switch(body: KillSwitchUpdate, request: Request,
                    who: Operator) -> KillSwitchChange:
    with unit_of_work(request.app.state.sessions) as session:
        state, generation = service.set_kill_switch(session, enabled=body.enabled, reason=body.reason,
                                                    actor=who.actor)
        read = KillSwitchChange(**_switch(state).model_dump(), changed=generation is not None)
    if generation is not None:
        request.app.state.hub.publish(generation)
    return read
