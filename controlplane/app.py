"""The control plane's FastAPI application."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI
from sqlalchemy import update
from sqlalchemy.engine import CursorResult
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.analysis.endpoints import router as analysis_router
from controlplane.audit.endpoints import router as audit_router
from controlplane.auth.endpoints import router as keys_router
from controlplane.auth.endpoints import whoami_router
from controlplane.autopilot.endpoints import router as autopilot_router
from controlplane.autopilot.runner import run_autopilot
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.distribution.endpoints import router as distribution_router
from controlplane.distribution.hub import ChangeHub
from controlplane.distribution.listener import listen_for_changes
from controlplane.distribution.service import BundleSigner
from controlplane.errors import PayloadTooLarge, install_error_handlers
from controlplane.health.endpoints import router as health_router
from controlplane.metrics import ControlPlaneMetrics
from controlplane.models import FleetState
from controlplane.policy.endpoints import router as policy_router
from controlplane.rollout.endpoints import router as rollout_router
from controlplane.rollout.evaluator import run_evaluator
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry.endpoints import router as telemetry_router
from controlplane.telemetry.partitions import keep_partitions_logged, run_partition_keeper
from controlplane.worker.endpoints import router as worker_router
from policies import SigningKey
from wire.problems import PROBLEM_MEDIA_TYPE, problem_bytes

log = logging.getLogger("specgate.controlplane")


class Measure:
    """Requests and latency by method, route and status (``/metrics``), taken when the response starts.

    A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware runs every
    request in a task group of its own and passes every response, streams included, through a memory stream,
    a cost on each of a fleet's heartbeats, long-polls and change streams (bench/fleet.py).
    """

    def __init__(self, app: ASGIApp, owner: FastAPI) -> None:
        self.app = app
        self.owner = owner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def measured_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                # Routing has put the matched route in the scope by the time the response starts.
                route: Any = scope.get("route")
                path = getattr(route, "path", "unmatched")
                metrics = self.owner.state.metrics
                metrics.requests.labels(scope["method"], path, str(message["status"])).inc()
                metrics.latency.labels(scope["method"], path).observe(time.perf_counter() - start)
            await send(message)

        await self.app(scope, receive, measured_send)


class BodySizeLimit:
    """Refuses bodies over the limit before they are read into memory."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, send)
            return
        seen = 0
        exceeded = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise _TooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:
                # FastAPI turns an error while it reads the body into its own 400 "error parsing the body";
                # that answer is dropped here and the 413 below sent instead.
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded or started:
                raise
        if exceeded and not started:
            await self._refuse(scope, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        error = PayloadTooLarge(f"request body exceeds {self.max_bytes} bytes")
        body = problem_bytes(error.status, error.type_slug, error.title, error.detail, instance=scope.get("path"))
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", PROBLEM_MEDIA_TYPE.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def _load_signing_key(app: FastAPI, settings: ControlPlaneSettings) -> SigningKey:
    """The current signing key; also sets ``app.state.bundle_signer`` (current and previous key, bundle TTL).

    From SPECGATE_SIGNING_KEY (and SPECGATE_SIGNING_KEY_PREVIOUS during a rotation) when set; otherwise
    the embedded default: a key generated once and kept in ``fleet_state`` with its previous one, which
    ``specgate signing-key rotate`` manages.
    """
    if settings.signing_key:
        keys = [SigningKey.from_b64(settings.signing_key)]
        if settings.signing_key_previous:
            keys.append(SigningKey.from_b64(settings.signing_key_previous))
    else:
        with unit_of_work(app.state.sessions) as session:
            state = session.get(FleetState, 1, with_for_update=True)
            if state is None:
                raise RuntimeError("the database has no fleet_state row: run the migrations first")
            if not state.signing_key:
                # Embedded default: generate once and keep it, so restarts keep the key.
                state.signing_key = SigningKey.generate().private_key_b64()
                log.warning("generated a bundle signing key and stored it in the database")
            keys = [SigningKey.from_b64(state.signing_key)]
            if state.previous_signing_key:
                keys.append(SigningKey.from_b64(state.previous_signing_key))
        # Loud on every start: whoever can read the database can sign bundles every sidecar accepts.
        log.warning("SPECGATE_SIGNING_KEY is not set: bundles are signed with the key stored in the database "
                    "(fleet_state). For production, generate a key (`specgate signing-key "
                    "generate`) and set SPECGATE_SIGNING_KEY to it")
        if settings.signing_key_previous:
            log.warning("SPECGATE_SIGNING_KEY_PREVIOUS is ignored without SPECGATE_SIGNING_KEY")
    app.state.bundle_signer = BundleSigner(keys, settings.bundle_ttl_s)
    return keys[0]


def _load_cohort_secret(app: FastAPI) -> str:
    """The fleet's cohort secret (exploration and canary salts), generated on the first start.

    A conditional UPDATE, committed before the read: of two processes starting on one database, whichever
    writes second changes nothing, and both read the same secret.
    """
    with unit_of_work(app.state.sessions) as session:
        result = session.execute(
            update(FleetState).where(FleetState.id == 1, FleetState.cohort_secret.is_(None))
            .values(cohort_secret=secrets.token_hex(32)))
        generated = cast(CursorResult[Any], result).rowcount
    with unit_of_work(app.state.sessions) as session:
        state = session.get(FleetState, 1)
        if state is None or not state.cohort_secret:
            raise RuntimeError("the database has no fleet_state row: run the migrations first")
        if generated:
            log.info("generated the fleet's cohort secret and stored it in the database")
        return state.cohort_secret


def create_app(settings: ControlPlaneSettings | None = None) -> FastAPI:
    settings = settings or ControlPlaneSettings()
    engine = make_engine(settings.database_url)
    hub = ChangeHub()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hub.bind(asyncio.get_running_loop())
        app.state.signing_key = _load_signing_key(app, settings)
        app.state.cohort_secret = _load_cohort_secret(app)
        listener: asyncio.Task[None] | None = None
        partitions: asyncio.Task[None] | None = None
        if engine.dialect.name == "postgresql":
            listener = asyncio.create_task(listen_for_changes(settings.database_url, hub))
            # Raw events' day partitions: created ahead now, then every interval (telemetry/partitions.py).
            await run_in_threadpool(keep_partitions_logged, app)
            if settings.telemetry_partition_interval_s > 0:
                partitions = asyncio.create_task(run_partition_keeper(app, settings.telemetry_partition_interval_s))
        # Every replica competes, each task acts only where its role is led (controlplane/leadership.py).
        led: list[asyncio.Task[None]] = []
        if settings.guardrail_interval_s > 0:
            led.append(asyncio.create_task(run_evaluator(app, settings.guardrail_interval_s)))
        if settings.autopilot_interval_s > 0:
            led.append(asyncio.create_task(run_autopilot(app, settings.autopilot_interval_s)))
        try:
            yield
        finally:
            # Cancelled together: each lets its leadership go once its round under way has finished.
            for task in led:
                task.cancel()
            for task in led:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if partitions is not None:
                partitions.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await partitions
            if listener is not None:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
            engine.dispose()

    app = FastAPI(
        title="specgate control plane",
        version="0.1.0",
        description="Policies, revisions, rollouts, workers and bundle distribution for per-request "
        "speculative decoding decisions. Errors are RFC 9457 problem+json.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = make_sessionmaker(engine)
    app.state.hub = hub
    app.state.metrics = ControlPlaneMetrics(hub)
    install_error_handlers(app)

    app.add_middleware(Measure, owner=app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    for router in (health_router, keys_router, whoami_router, audit_router, policy_router, rollout_router,
                   worker_router, distribution_router, telemetry_router, analysis_router, autopilot_router):
        app.include_router(router)
    return app
