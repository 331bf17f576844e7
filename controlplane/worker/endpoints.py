"""The workers API: registration, heartbeats, the worker list and the fleet's overview."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Path, Query, Request, Response
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from controlplane.auth.service import Principal
from controlplane.db import unit_of_work
from controlplane.deps import Reader, SessionDep, WorkerKey
from controlplane.distribution.service import ViewCache
from controlplane.errors import AUTH_RESPONSES, INVALID_RESPONSE, TOO_LARGE_RESPONSE, problems
from controlplane.worker import service
from controlplane.worker.schemas import (
    NO_CONTROL,
    WORKER_ID_PATTERN,
    FleetRead,
    HeartbeatAck,
    WorkerHeartbeat,
    WorkerKind,
    WorkerPage,
    WorkerRead,
    WorkerRegister,
)

router = APIRouter(prefix="/v1", tags=["workers"], responses=AUTH_RESPONSES)

_BODY = {**TOO_LARGE_RESPONSE, **INVALID_RESPONSE}

@router.post("/workers/register", response_model=WorkerRead,
             responses={201: {"model": WorkerRead, "description": "registered for the first time"},
                        **problems({403: "worker-not-allowed: the key is not bound to this worker, or may "
                                         "register only into its own pool"}), **_BODY})
def register(body: WorkerRegister, request: Request, response: Response,
             who: WorkerKey) -> WorkerRead:
    settings = request.app.state.settings
    # Two transactions when the first loses a race, so the unit of work is explicit here.
    for attempt in (1, 2):
        try:
            with unit_of_work(request.app.state.sessions) as session:
                registration = service.register(session, body, who=who)
                read = service.describe_one(session, registration.worker, settings.worker_stale_after_s)
            break
        except IntegrityError:
            # Two first registrations of one id raced and this one lost; the retry updates
            # the winner's row instead.
            if attempt == 2:
                raise
    if registration.generation is not None:
        request.app.state.hub.publish(registration.generation)
    response.status_code = 201 if registration.created else 200
    return read


@router.post("/workers/{worker_id}/heartbeat", response_model=HeartbeatAck,
             responses={**problems({403: "worker-not-allowed: the key is not bound to this worker",
                                    404: "worker-not-found: the worker is not registered"}), **_BODY})
async def heartbeat(request: Request, who: WorkerKey,
                    worker_id: str = Path(max_length=128, pattern=WORKER_ID_PATTERN),
                    body: WorkerHeartbeat | None = None) -> HeartbeatAck:
    # Its own unit of work, committed in the thread that did the work, not SessionDep: a synchronous endpoint's
    # session keeps its connection until the response has been validated, which FastAPI does on another thread.
    # A burst of heartbeats (every sidecar at once after a publish) then held every connection while waiting
    # for a thread, and every thread while waiting for a connection, until the pool timed out: from about 100
    # workers the control plane stalled (bench/fleet.py).
    return await run_in_threadpool(_heartbeat, request.app, worker_id, body or WorkerHeartbeat(), who)


def _heartbeat(app: Any, worker_id: str, body: WorkerHeartbeat, who: Principal) -> HeartbeatAck:
    with unit_of_work(app.state.sessions) as session:
        return service.heartbeat(session, worker_id, body, who=who, views=_views_of(app.state))


def _views_of(state: Any) -> ViewCache:
    found: ViewCache | None = getattr(state, "heartbeat_views", None)
    if found is None:
        # Two threads may both make one at first; either is right, one is kept.
        found = state.heartbeat_views = ViewCache()
    return found


@router.get("/workers", response_model=WorkerPage, responses=INVALID_RESPONSE)
def list_workers(request: Request, session: SessionDep, _: Reader,
                 pool: str | None = Query(None, max_length=128, pattern=NO_CONTROL),
                 kind: WorkerKind | None = Query(None, description="only workers or only gateways"),
                 stale: bool | None = Query(None, description="only stale (true) or live (false) workers"),
                 cursor: str | None = Query(None, max_length=128, pattern=NO_CONTROL,
                                            description="next_cursor of the last page"),
                 limit: int = Query(100, ge=1, le=1000)) -> WorkerPage:
    return service.list_workers(session, pool=pool, kind=kind, stale=stale, cursor=cursor, limit=limit,
                                stale_after_s=request.app.state.settings.worker_stale_after_s)


@router.get("/fleet", response_model=FleetRead)
def fleet(request: Request, session: SessionDep, _: Reader) -> FleetRead:
    return service.fleet(session, stale_after_s=request.app.state.settings.worker_stale_after_s)
