"""The rollouts API: start, promote, pause, resume, abort, guardrails; policy rollback; the kill switch."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Query, Request
from pydantic import WithJsonSchema
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from controlplane.auth.service import Principal
from controlplane.deps import Announce, Announcer, Operator, Reader, SessionDep
from controlplane.errors import AUTH_RESPONSES, INVALID_RESPONSE, TOO_LARGE_RESPONSE, ValidationFailed, problems
from controlplane.models import FleetState
from controlplane.rollout import guardrails as guardrail_service
from controlplane.rollout import service
from controlplane.rollout.evaluator import evaluate_now
from controlplane.rollout.schemas import (
    NO_NUL,
    AbortBody,
    ActionBody,
    GuardrailEvaluationRead,
    GuardrailHistory,
    KillSwitchChange,
    KillSwitchRead,
    KillSwitchUpdate,
    PolicyRollbackRead,
    PromoteBody,
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

# Promote, pause and resume take an optional body: a reason for the audit log.
OptionalActionBody = Annotated[ActionBody | None, Body()]
# Optional for the parser only, so that a missing body reports `reason` as missing; the schema
# says what is required.
RequiredAbortBody = Annotated[AbortBody | None, WithJsonSchema(AbortBody.model_json_schema()), Body()]
RolloutId = Annotated[str, Path(max_length=64, pattern=NO_NUL)]
# The guardrail endpoints keep the stricter id they had under the analysis API: no control characters at all.
GuardrailsOf = Annotated[str, Path(max_length=64, pattern=r"^[^\x00-\x1f\x7f]*$")]
PolicyNameParam = Annotated[str, Path(max_length=63, pattern=NO_NUL)]


@router.post("/v1/rollouts", status_code=201, response_model=RolloutRead,
             responses={**problems({409: "the policy already has a running or paused rollout"}), **_BODY})
def start(body: RolloutCreate, session: SessionDep, announce: Announce, who: Operator) -> RolloutRead:
    rollout, generation = service.start_rollout(session, body, actor=who.actor)
    announce(generation)
    return service.present(session, [rollout])[0]


@router.get("/v1/rollouts", response_model=RolloutPage, responses=INVALID_RESPONSE)
def list_rollouts(session: SessionDep,
                  _: Reader,
                  policy: Annotated[str | None, Query(max_length=63, pattern=NO_NUL,
                                                            description="a policy's name")] = None,
                  state: RolloutState | None = None,
                  cursor: Annotated[str | None, Query(max_length=200,
                                                      description="next_cursor of the previous page")] = None,
                  limit: Annotated[int, Query(ge=1, le=500)] = 50) -> RolloutPage:
    rows, next_cursor = service.list_rollouts(session, policy=policy, state=state, cursor=cursor, limit=limit)
    return RolloutPage(items=service.present(session, rows), next_cursor=next_cursor)


@router.get("/v1/rollouts/{rollout_id}", response_model=RolloutRead,
            responses={**_NO_ROLLOUT, **INVALID_RESPONSE})
def get(rollout_id: RolloutId, session: SessionDep, _: Reader) -> RolloutRead:
    return service.present(session, [service.get_rollout(session, rollout_id)])[0]


def _act(session: Session, announce: Announcer, rollout_id: RolloutId, action: RolloutAction, who: Principal,
         reason: str, expected_step: int | None = None) -> RolloutRead:
    rollout, generation = service.apply_action(session, rollout_id, action, actor=who.actor, reason=reason,
                                               expected_step=expected_step)
    announce(generation)
    return service.present(session, [rollout])[0]


@router.post("/v1/rollouts/{rollout_id}/promote", response_model=RolloutRead,
             responses={**_NO_ROLLOUT, **problems({409: "the rollout's state does not allow a promote (`state` "
                                                        "names it), or it is no longer at `expected_step` "
                                                        "(`current_step` names where it is)"}), **_BODY},
             description="Move to the next step; at the last step the rollout completes and the policy's "
                         "active revision becomes the rollout's revision. With `expected_step`, only from that "
                         "step: a rollout that moved since the caller looked answers 409.")
def promote(rollout_id: RolloutId, session: SessionDep, announce: Announce, who: Operator,
            body: Annotated[PromoteBody | None, Body()] = None) -> RolloutRead:
    return _act(session, announce, rollout_id, RolloutAction.promote, who, body.reason if body else "",
                body.expected_step if body else None)


@router.post("/v1/rollouts/{rollout_id}/pause", response_model=RolloutRead,
             responses={**_NO_ROLLOUT, **_ILLEGAL, **_BODY},
             description="Hold the current step's split until resumed or ended.")
def pause(rollout_id: RolloutId, session: SessionDep, announce: Announce, who: Operator,
          body: OptionalActionBody = None) -> RolloutRead:
    return _act(session, announce, rollout_id, RolloutAction.pause, who, body.reason if body else "")


@router.post("/v1/rollouts/{rollout_id}/resume", response_model=RolloutRead,
             responses={**_NO_ROLLOUT, **_ILLEGAL, **_BODY})
def resume(rollout_id: RolloutId, session: SessionDep, announce: Announce, who: Operator,
           body: OptionalActionBody = None) -> RolloutRead:
    return _act(session, announce, rollout_id, RolloutAction.resume, who, body.reason if body else "")


@router.post("/v1/rollouts/{rollout_id}/abort", response_model=RolloutRead,
             responses={**_NO_ROLLOUT, **_ILLEGAL, **_BODY}, openapi_extra={"requestBody": {"required": True}},
             description="Stop splitting; the policy stays on its active revision. A reason is required.")
def abort(rollout_id: RolloutId, session: SessionDep, announce: Announce, who: Operator,
          body: RequiredAbortBody = None) -> RolloutRead:
    if body is None:
        # Without this, a bodiless abort would report the body, not the reason, as missing.
        raise ValidationFailed("1 field did not validate", errors=[
            {"path": "reason", "in": "body", "code": "missing", "message": "an abort needs a reason"}])
    return _act(session, announce, rollout_id, RolloutAction.abort, who, body.reason)


@router.post("/v1/policies/{name}/rollback", response_model=PolicyRollbackRead, tags=["policies"],
             responses={**problems({404: "no such policy, or no such revision",
                                    409: "the revision is already active (`active_revision` names it)"}),
                        **_BODY},
             description="Make any revision of the policy but the active one active at once; a running or "
                         "paused rollout of the policy ends as rolled_back.")
def rollback(name: PolicyNameParam, body: RollbackBody, session: SessionDep, announce: Announce,
             who: Operator) -> PolicyRollbackRead:
    result = service.rollback_policy(session, name, body.revision, actor=who.actor, reason=body.reason)
    announce(result.generation)
    ended = service.present(session, [result.ended_rollout])[0] if result.ended_rollout else None
    return PolicyRollbackRead(policy=result.policy.name, previous_revision=result.previous_revision,
                              active_revision=body.revision, ended_rollout=ended)


def _switch(state: FleetState) -> KillSwitchRead:
    return KillSwitchRead(enabled=state.kill_switch, reason=state.kill_switch_reason,
                          changed_at=state.kill_switch_changed_at, changed_by=state.kill_switch_changed_by)


@router.get("/v1/killswitch", response_model=KillSwitchRead, tags=["kill switch"])
def get_kill_switch(session: SessionDep, _: Reader) -> KillSwitchRead:
    return _switch(service.get_kill_switch(session))


@router.put("/v1/killswitch", response_model=KillSwitchChange, tags=["kill switch"], responses=_BODY,
            description="Every bundle carries the switch; when on, sidecars send every request to the "
                        "policy's plain engine. Setting the current value again changes nothing.")
def put_kill_switch(body: KillSwitchUpdate, session: SessionDep, announce: Announce,
                    who: Operator) -> KillSwitchChange:
    state, generation = service.set_kill_switch(session, enabled=body.enabled, reason=body.reason,
                                                actor=who.actor)
    announce(generation)
    return KillSwitchChange(**_switch(state).model_dump(), changed=generation is not None)


# --- guardrails ---------------------------------------------------------------------------------

@router.get("/v1/rollouts/{rollout_id}/guardrails", response_model=GuardrailHistory,
            responses={**_NO_ROLLOUT, **INVALID_RESPONSE},
            description="The guardrail evaluations of a rollout's steps, newest first: each guardrail's status, "
                        "observed value, always-valid interval and p-value, and what the evaluation did.")
def guardrails(rollout_id: GuardrailsOf, session: SessionDep, _: Reader,
               limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> GuardrailHistory:
    rollout, rows = guardrail_service.guardrail_history(session, rollout_id, limit)
    return GuardrailHistory(rollout_id=rollout_id, state=rollout.state,
                            evaluations=[GuardrailEvaluationRead.model_validate(r) for r in rows])


@router.post("/v1/rollouts/{rollout_id}/guardrails/evaluate", response_model=GuardrailEvaluationRead,
             responses={**_NO_ROLLOUT, **problems({409: "the rollout is not running"}), **INVALID_RESPONSE},
             description="Evaluate the current step's guardrails now (as the background evaluator does): a breach "
                         "rolls the rollout back, audited with its evidence.")
async def evaluate(rollout_id: GuardrailsOf, request: Request, who: Operator) -> GuardrailEvaluationRead:
    # The background evaluator's own unit of work (commit, then announce), run off the event loop.
    return await run_in_threadpool(evaluate_now, request.app, rollout_id, who.actor)
