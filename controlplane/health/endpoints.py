"""The health API: /healthz (the process answers), /readyz (database reachable, schema at head), /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from controlplane.migrations_state import migration_status

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


_READINESS = {"application/json": {"schema": {
    "type": "object", "required": ["status", "checks"],
    "properties": {"status": {"type": "string", "enum": ["ready", "not ready"]},
                   "checks": {"type": "object", "additionalProperties": {"type": "string"}}}}}}


@router.get("/readyz", responses={
    200: {"description": "the database answers and its schema is at head", "content": _READINESS},
    503: {"description": "not ready: `checks` says which check failed", "content": _READINESS}})
def readyz(request: Request) -> JSONResponse:
    checks: dict[str, str] = {}
    ready = True
    try:
        with request.app.state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # a readiness probe reports, it does not raise
        ready = False
        checks["database"] = f"unreachable: {type(exc).__name__}"
    if ready:
        current, head = migration_status(request.app.state.engine)
        if current != head:
            ready = False
            checks["migrations"] = f"at {current}, head is {head}: run 'specgate db upgrade'"
        else:
            checks["migrations"] = f"at head ({head})"
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks},
                        status_code=200 if ready else 503)


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
