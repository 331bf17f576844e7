"""One exception hierarchy, rendered by one handler as RFC 9457 problem+json."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from policies import FieldError
from policies.validate import find_oversized_ints, format_path, parse_int
from wire.problems import PROBLEM_MEDIA_TYPE, PROBLEM_SCHEMA, ProblemCode, problem, problem_code

log = logging.getLogger("specgate.controlplane")


def problem_response(description: str, example: dict[str, Any] | None = None) -> dict[str, Any]:
    """An OpenAPI response whose body is a problem (for a route's ``responses=``)."""
    content: dict[str, Any] = {"schema": PROBLEM_SCHEMA}
    if example is not None:
        content["example"] = example
    return {"description": description, "content": {PROBLEM_MEDIA_TYPE: content}}


def problems(descriptions: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """``problems({404: "no such rollout"})`` -> ``{404: problem_response("no such rollout")}``."""
    return {status: problem_response(text) for status, text in descriptions.items()}


# The responses most routes share. FastAPI would document 422 as its own HTTPValidationError in
# application/json; the handler below answers problem+json, so routes with parameters declare this.
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: problem_response("missing, unknown or revoked API key"),
    403: problem_response("the key's scope does not allow this"),
    # Checking a key reads the database, so every keyed operation may find it down.
    503: problem_response("the database cannot be reached right now; retry after `Retry-After` seconds"),
}
INVALID_RESPONSE: dict[int | str, dict[str, Any]] = {
    422: problem_response("the request did not validate: each error with its path, code and message"),
}
TOO_LARGE_RESPONSE: dict[int | str, dict[str, Any]] = {
    413: problem_response("the body exceeds SPECGATE_MAX_BODY_BYTES"),
}


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
        return problem(self.status, self.type_slug, self.title, self.detail, instance=instance, errors=self.errors,
                       **self.extra)


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


class DatabaseUnavailable(SpecgateError):
    status, type_slug, title = 503, "database-unavailable", "The database is unavailable"


# Errors that say the database could not be reached or used right now (connection refused or lost, a
# server restarting, SQLite busy past its timeout, a pool with no free connection): the request may succeed
# later, so they answer 503 with Retry-After rather than 500.
DATABASE_DOWN = (OperationalError, InterfaceError, DisconnectionError, SQLAlchemyTimeoutError)
RETRY_AFTER_S = 5
# One log line per outage, not one per request: at most one every this many seconds.
DATABASE_LOG_INTERVAL_S = 30.0


def parse_json_body(body: bytes | str) -> Any:
    """A JSON request body, or a 422 naming what is wrong with it: never an exception that would become a 500.

    Python refuses integers of more digits than ``sys.get_int_max_str_digits()`` and nesting deeper than its
    recursion limit, with errors that say neither where nor what; here the first is named by its path and the
    second said as such.
    """
    try:
        data = json.loads(body, parse_int=parse_int)
    except json.JSONDecodeError as exc:
        raise ValidationFailed(f"the body is not valid JSON: {exc.msg}", errors=[{
            "path": "body", "in": "body", "code": ProblemCode.invalid_json,
            "message": f"{exc.msg} at line {exc.lineno}, column {exc.colno}",
            "line": exc.lineno, "column": exc.colno}]) from None
    except RecursionError:
        raise ValidationFailed("the body nests too deeply", errors=[{
            "path": "body", "in": "body", "code": ProblemCode.invalid_json,
            "message": "the body nests deeper than the JSON parser allows"}]) from None
    except ValueError:  # UnicodeDecodeError among them
        raise ValidationFailed("the body is not valid JSON", errors=[{
            "path": "body", "in": "body", "code": ProblemCode.invalid_json,
            "message": "the body is not UTF-8 JSON"}]) from None
    oversized = find_oversized_ints(data)
    if oversized:
        n = len(oversized)
        raise ValidationFailed(f"{n} field{'s' if n != 1 else ''} did not validate", errors=[
            {"path": format_path(loc) or "body", "in": "body", "code": ProblemCode.out_of_range,
             "message": value.message()} for loc, value in oversized])
    return data


def _loc_to_path(loc: Sequence[Any]) -> str:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (Starlette's own 405 names only one route's)."""
    allowed = [method for method in _METHODS
               if any(route.matches({**request.scope, "method": method})[0] == Match.FULL
                      for route in request.app.router.routes)]
    return ", ".join(allowed)


def _unreadable_body(exc: StarletteHTTPException) -> bool:
    # FastAPI answers 400 when a JSON body cannot be decoded at all (bytes that are not UTF-8, nesting
    # deeper than the parser's recursion limit); syntax errors it reports as 422 json_invalid.
    return exc.status_code == 400 and isinstance(exc.__cause__, ValueError | RecursionError)


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
            errors.append({"path": _loc_to_path(loc), "in": where, "code": problem_code(err),
                           "message": err.get("msg", "invalid")})
        n = len(errors)
        return render(request, ValidationFailed(f"{n} field{'s' if n != 1 else ''} did not validate",
                                                errors=errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if _unreadable_body(exc):
            # FastAPI's reading failed without saying where or why; reading the body again (the request keeps
            # it) does, as POST .../revisions says for the bodies it reads itself.
            try:
                body = await request.body()
            except Exception:  # the stream could not be read again: the general answer below still holds
                body = None
            try:
                if body is not None:
                    parse_json_body(body)
            except ValidationFailed as failed:
                return render(request, failed)
            return render(request, ValidationFailed("the body is not valid JSON", errors=[{
                "path": "body", "in": "body", "code": ProblemCode.invalid_json,
                "message": "not UTF-8 JSON, or nested too deeply"}]))
        problem = SpecgateError(str(exc.detail))
        problem.status = exc.status_code
        problem.type_slug = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http")
        problem.title = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, "HTTP error")
        problem.headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # A 405 must list the methods the resource supports (RFC 9110, 15.5.6).
            problem.headers["Allow"] = _allowed_methods(request)
        return render(request, problem)

    last_logged = -DATABASE_LOG_INTERVAL_S

    async def _database_down(request: Request, exc: Exception) -> JSONResponse:
        nonlocal last_logged
        now = time.monotonic()
        if now - last_logged >= DATABASE_LOG_INTERVAL_S:
            last_logged = now
            log.error("the database is unavailable (%s on %s): answering 503 until it is back",
                      type(exc).__name__, request.url.path, exc_info=exc)
        return render(request, DatabaseUnavailable(
            "the database cannot be reached right now; retry later",
            headers={"Retry-After": str(RETRY_AFTER_S)}))

    for kind in DATABASE_DOWN:
        app.add_exception_handler(kind, _database_down)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Never leak a traceback to a client; the log has it.
        log.exception("unhandled error on %s", request.url.path)
        return render(request, SpecgateError("an unexpected error occurred; it has been logged"))
