"""Bundle distribution: plain GET, long-poll and SSE. Workers' hot path.

Long-polls and streams wait on the in-process ChangeHub without holding a
database connection; every database read runs in the threadpool, batched by
the Recomputer, so a thousand waiting workers cost a thousand parked
coroutines and, per change, one read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from controlplane.auth.repository import ApiKeyRepository
from controlplane.auth.service import Principal, authorize_worker, still_allowed
from controlplane.db import unit_of_work
from controlplane.deps import BundleReader, WorkerKey
from controlplane.distribution.recompute import recomputer_of
from controlplane.distribution.schemas import BundleEnvelope, PublicKeyEntry, PublicKeyRead
from controlplane.distribution.service import Bundle, cached_body, etags_in, signed_body
from controlplane.errors import (
    AUTH_RESPONSES,
    INVALID_RESPONSE,
    SpecgateError,
    Unauthorized,
    ValidationFailed,
    problem_response,
    problems,
)
from controlplane.worker.schemas import WORKER_ID_PATTERN

router = APIRouter(prefix="/v1/bundle", tags=["distribution"])

_NOT_SERVED: dict[int | str, dict[str, Any]] = {404: problem_response("worker-not-found, or no-policy for the worker")}


def _worker_query() -> Any:
    return Query(min_length=1, max_length=128, pattern=WORKER_ID_PATTERN, description="the worker's id")


async def _current(request: Request, worker_id: str) -> Bundle:
    return await recomputer_of(request.app.state).bundle(worker_id)


def _key_revoked(request: Request, key_id: str) -> bool:
    with unit_of_work(request.app.state.sessions) as session:
        key = ApiKeyRepository(session).get(key_id)
        return key is None or key.revoked_at is not None


def _authorize(request: Request, who: Principal, worker_id: str) -> None:
    with unit_of_work(request.app.state.sessions) as session:
        authorize_worker(session, who, worker_id)


def _cache_headers(etag: str) -> dict[str, str]:
    # no-cache: intermediaries may store the bundle but must revalidate, since it changes any time.
    return {"ETag": f'"{etag}"', "Cache-Control": "no-cache"}


@router.get("", response_model=BundleEnvelope,
            responses={304: {"description": "If-None-Match is the current ETag (after `wait`, if given)"},
                       **AUTH_RESPONSES, **_NOT_SERVED, **INVALID_RESPONSE,
                       **problems({500: "revision-corrupt: a stored revision of the worker's policy no longer "
                                        "validates or hashes to its id"})})
async def bundle(request: Request, who: BundleReader,
                 worker: str = _worker_query(),
                 wait: float | None = Query(None, gt=0, allow_inf_nan=False,
                                            description="seconds to hold the request while If-None-Match is "
                                            "current (at most SPECGATE_LONG_POLL_MAX_S)"),
                 if_none_match: str | None = Header(None, max_length=4096)) -> Response:
    longest = request.app.state.settings.long_poll_max_s
    if wait is not None and wait > longest:
        raise ValidationFailed("1 field did not validate", errors=[{
            "path": "wait", "in": "query", "code": "out_of_range",
            "message": f"Input should be less than or equal to {longest:g}"}])
    # A worker key reads only the bundles of workers it is bound to; an admin key reads any.
    await run_in_threadpool(_authorize, request, who, worker)
    hub = request.app.state.hub
    known = etags_in(if_none_match)
    # Read the generation before computing: a change committed meanwhile makes us recompute
    # instead of sleeping through it.
    seen = hub.generation
    current = await _current(request, worker)
    if wait is not None and current.etag in known:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while current.etag in known:
            if hub.generation == seen:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await hub.wait(remaining):
                    break
            seen = hub.generation
            current = await _current(request, worker)
            # Authorised when it opened: the change that woke it may have moved the worker to another pool.
            still_allowed(who, worker, current.pool)
    if current.etag in known:
        return Response(status_code=304, headers=_cache_headers(current.etag))
    signer = request.app.state.bundle_signer
    body = cached_body(signer, current) or await run_in_threadpool(signed_body, signer, current)
    return Response(body, media_type="application/json", headers=_cache_headers(current.etag))


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


@router.get("/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "`event: bundle` with `data: {\"etag\": ...}` at once and on "
                             "every change; `: keepalive` comments while idle"},
                       **AUTH_RESPONSES, **_NOT_SERVED, **INVALID_RESPONSE})
async def events(request: Request, who: WorkerKey, worker: str = _worker_query()) -> StreamingResponse:
    # Before the stream starts, so a refusal is a plain 403 problem.
    await run_in_threadpool(_authorize, request, who, worker)
    hub = request.app.state.hub
    keepalive = request.app.state.settings.sse_keepalive_s
    seen = hub.generation
    # Computed before the stream starts, so an unknown worker or no-policy is a plain 404 problem.
    first = await _current(request, worker)

    async def stream() -> AsyncIterator[str]:
        nonlocal seen
        loop = asyncio.get_running_loop()
        etag = first.etag
        yield _sse("bundle", {"etag": etag})
        last_write = loop.time()
        # No polling for a vanished client here: StreamingResponse listens for the disconnect beside the stream
        # and cancels it (uvicorn speaks ASGI 2.3), and under a server that does not, the next keepalive's write
        # fails. Polling every second cost ~0.7 ms of CPU per stream and second through the middleware stack:
        # 0.7 cores for 1,000 idle workers (bench/fleet.py).
        while True:
            if hub.generation != seen or loop.time() - last_write >= keepalive:
                # The key was checked once when the stream opened; a revocation must also end a
                # stream already open, so look again before every event and every keepalive.
                if await run_in_threadpool(_key_revoked, request, who.key_id):
                    yield _sse("error", Unauthorized("the API key was revoked").to_problem(request.url.path))
                    return
            if hub.generation != seen:
                seen = hub.generation
                try:
                    current = await _current(request, worker)
                    still_allowed(who, worker, current.pool)
                except SpecgateError as exc:
                    # The worker lost its policy (or its registration), or moved out of the key's pool:
                    # say why and end; a reconnect then gets the problem as a plain response.
                    yield _sse("error", exc.to_problem(request.url.path))
                    return
                if current.etag != etag:
                    etag = current.etag
                    yield _sse("bundle", {"etag": etag})
                    last_write = loop.time()
                continue
            idle = loop.time() - last_write
            if idle >= keepalive:
                yield ": keepalive\n\n"
                last_write = loop.time()
                continue
            await hub.wait(keepalive - idle)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/public-key", response_model=PublicKeyRead)
def public_key(request: Request) -> PublicKeyRead:
    """The key(s) bundles are signed with: the current one first; during a rotation also the previous one."""
    keys = request.app.state.bundle_signer.keys
    current = keys[0]
    return PublicKeyRead(public_key=current.public_key_b64, key_id=current.key_id,
                         keys=[PublicKeyEntry(public_key=key.public_key_b64, key_id=key.key_id,
                                              status="current" if i == 0 else "previous")
                               for i, key in enumerate(keys)])
