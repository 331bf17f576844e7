"""One exception hierarchy, rendered by one handler as RFC 9457 problem+json."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from policies import FieldError

PROBLEM_BASE = "https://specgate.dev/problems/"
PROBLEM_MEDIA_TYPE = "application/problem+json"


class SpecgateError(Exception):
    status = 500
    type_slug = "internal"
    title = "Internal error"

    def __init__(self, detail: str, *, errors: Sequence[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = list(errors or [])
        self.headers = headers or {}
        self.extra = extra

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": PROBLEM_BASE + self.type_slug,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance:
            body["instance"] = instance
        if self.errors:
            body["errors"] = self.errors
        body.update(self.extra)
        return body


class BadRequest(SpecgateError):
    status, type_slug, title = 400, "bad-request", "Bad request"


class Unauthorized(SpecgateError):
    status, type_slug, title = 401, "unauthorized", "Missing or invalid API key"

    def __init__(self, detail: str, **kw: Any) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer realm="specgate"'}, **kw)


class Forbidden(SpecgateError):
    status, type_slug, title = 403, "forbidden", "Not allowed for this key's scope"


class NotFound(SpecgateError):
    status, type_slug, title = 404, "not-found", "Not found"


class Conflict(SpecgateError):
    status, type_slug, title = 409, "conflict", "Conflict with the current state"


class PreconditionFailed(SpecgateError):
    status, type_slug, title = 412, "precondition-failed", "Precondition failed"


class PayloadTooLarge(SpecgateError):
    status, type_slug, title = 413, "payload-too-large", "Request body too large"


class UnsupportedMediaType(SpecgateError):
    status, type_slug, title = 415, "unsupported-media-type", "Unsupported content type"


class ValidationFailed(SpecgateError):
    status, type_slug, title = 422, "validation", "The request did not validate"


class PolicyInvalid(ValidationFailed):
    type_slug, title = "invalid-policy", "The policy document is invalid"

    @classmethod
    def from_field_errors(cls, errors: Sequence[FieldError]) -> PolicyInvalid:
        n = len(errors)
        return cls(f"the document has {n} error{'s' if n != 1 else ''}",
                   errors=[e.to_dict() for e in errors])


class PreconditionRequired(SpecgateError):
    status, type_slug, title = 428, "precondition-required", "If-Match is required"


def _loc_to_path(loc: Sequence[Any]) -> str:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def install_error_handlers(app: FastAPI) -> None:
    def render(request: Request, exc: SpecgateError) -> JSONResponse:
        return JSONResponse(exc.to_problem(request.url.path), status_code=exc.status,
                            headers=exc.headers, media_type=PROBLEM_MEDIA_TYPE)

    @app.exception_handler(SpecgateError)
    async def _specgate(request: Request, exc: SpecgateError) -> JSONResponse:
        return render(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for err in exc.errors():
            loc = err.get("loc", ())
            where = loc[0] if loc else "body"
            errors.append({"path": _loc_to_path(loc), "in": where, "code": err.get("type", "invalid"),
                           "message": err.get("msg", "invalid")})
        n = len(errors)
        return render(request, ValidationFailed(f"{n} field{'s' if n != 1 else ''} did not validate",
                                                errors=errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        problem = SpecgateError(str(exc.detail))
        problem.status = exc.status_code
        problem.type_slug = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http")
        problem.title = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, "HTTP error")
        return render(request, problem)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Never leak a traceback to a client; the log has it.
        import logging

        logging.getLogger("specgate.controlplane").exception("unhandled error on %s", request.url.path)
        return render(request, SpecgateError("an unexpected error occurred; it has been logged"))
