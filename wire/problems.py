"""RFC 9457 problem+json: the one error body the control plane and the sidecar answer with, and clients read.

Builders (:func:`problem`, :func:`problem_bytes`) are used by every part that
answers an error; :func:`read_problem` is the tolerant reader every client
uses (the sidecar's policy sync, the dashboard, the CLI): a body that is not
a problem (an HTML page from a proxy, an empty body) still becomes a
:class:`Problem` with the HTTP status and the first bytes of the body as its
detail, so a caller can always show something precise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies import ErrorCode, pydantic_error_code

PROBLEM_BASE = "https://specgate.dev/problems/"
PROBLEM_MEDIA_TYPE = "application/problem+json"


class ProblemCode(StrEnum):
    """Every code the control plane puts in a problem's ``errors[].code`` (and in a recommendation's
    ``problems``): the policy library's :class:`policies.ErrorCode`, each of its values under the same
    name, and the API's own.

    docs/control-plane.md has a table of them. Readers stay tolerant (:class:`FieldProblem` keeps any string),
    so a client keeps working against a newer control plane with a code it does not know yet.
    """

    # policies.ErrorCode: a policy document or a request shape, and pydantic's errors in requests
    document_too_large = "document_too_large"
    invalid_encoding = "invalid_encoding"
    empty_document = "empty_document"
    yaml_syntax = "yaml_syntax"
    json_syntax = "json_syntax"
    yaml_alias = "yaml_alias"
    duplicate_key = "duplicate_key"
    too_deep = "too_deep"
    unsupported_api_version = "unsupported_api_version"
    unknown_field = "unknown_field"
    missing_field = "missing_field"
    wrong_type = "wrong_type"
    out_of_range = "out_of_range"
    empty = "empty"
    too_short = "too_short"
    too_long = "too_long"
    invalid_name = "invalid_name"
    invalid_format = "invalid_format"
    invalid_value = "invalid_value"
    inverted_range = "inverted_range"
    empty_range = "empty_range"
    reserved_name = "reserved_name"
    undefined_engine = "undefined_engine"
    not_plain_engine = "not_plain_engine"
    no_plain_engine = "no_plain_engine"
    ambiguous_plain_engine = "ambiguous_plain_engine"
    plain_engine_k = "plain_engine_k"
    k_above_engine = "k_above_engine"
    not_speculative_engine = "not_speculative_engine"
    duplicate_rule_name = "duplicate_rule_name"
    shadowed_rule = "shadowed_rule"
    too_complex = "too_complex"
    schedule_conflict = "schedule_conflict"
    invalid = "invalid"
    # the body as a whole
    invalid_json = "invalid_json"
    invalid_gzip = "invalid_gzip"
    unsupported_media_type = "unsupported_media_type"
    unsupported_encoding = "unsupported_encoding"
    # a request's fields and parameters
    missing = "missing"
    one_of = "one_of"
    before_from = "before_from"
    empty_window = "empty_window"
    worker_alone = "worker_alone"
    replica_alone = "replica_alone"
    invalid_cursor = "invalid_cursor"
    # preconditions (If-Match)
    malformed = "malformed"
    stale = "stale"
    # the objects a request names
    not_found = "not_found"
    unknown_revision = "unknown_revision"
    name_mismatch = "name_mismatch"
    duplicate = "duplicate"
    pool_taken = "pool_taken"
    no_active_revision = "no_active_revision"
    wrong_policy = "wrong_policy"
    already_active = "already_active"
    pool_mismatch = "pool_mismatch"
    worker_not_allowed = "worker_not_allowed"
    # rollout steps
    not_increasing = "not_increasing"
    last_not_100 = "last_not_100"
    # a recommendation whose edit does not apply to the policy (its ``problems`` use these codes too)
    not_applicable = "not_applicable"


def problem_code(error: Mapping[str, Any]) -> ProblemCode:
    """The closed code of one pydantic error in a request: its body, a parameter, a header, a telemetry event.

    :func:`policies.pydantic_error_code`, in the API's own terms where they differ: a body that is not JSON
    is ``invalid_json`` and an absent required field or parameter is ``missing``, as in the API's own
    refusals of the same mistakes.
    """
    if error.get("type") == "json_invalid":
        return ProblemCode.invalid_json
    code = pydantic_error_code(error)
    if code is ErrorCode.missing_field:
        return ProblemCode.missing
    return ProblemCode(code.value)


# What every error body looks like, for OpenAPI documents. Problems may carry more members (current_head, state,
# active_revision, ...), so further properties are allowed.
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
        "errors": {"type": "array", "items": {
            "type": "object",
            "required": ["path", "code", "message"],
            "properties": {"path": {"type": "string"}, "in": {"type": "string"},
                           "code": {"type": "string", "enum": [c.value for c in ProblemCode]},
                           "message": {"type": "string"}, "line": {"type": "integer"},
                           "column": {"type": "integer"}},
        }},
    },
}

_MEMBERS = frozenset({"type", "title", "status", "detail", "instance", "errors"})


def problem(status: int, slug: str, title: str, detail: str, *, instance: str | None = None,
            errors: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    """The body of a problem: ``type`` is :data:`PROBLEM_BASE` + ``slug``; ``extra`` members are added as given."""
    body: dict[str, Any] = {"type": PROBLEM_BASE + slug, "title": title, "status": status, "detail": detail}
    if instance:
        body["instance"] = instance
    if errors:
        body["errors"] = [dict(e) for e in errors]
    body.update(extra)
    return body


def problem_bytes(status: int, slug: str, title: str, detail: str, **members: Any) -> bytes:
    """:func:`problem` encoded as UTF-8 JSON, for servers that write bytes themselves."""
    return json.dumps(problem(status, slug, title, detail, **members)).encode()


class FieldProblem(BaseModel):
    """One entry of a problem's ``errors``: where (``path``, and ``in`` for a header or query), what, why."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    path: str = ""
    in_: str | None = Field(default=None, alias="in")
    code: str = ""
    message: str = ""
    line: int | None = None
    column: int | None = None


class Problem(BaseModel):
    """A problem as a client read it; members beyond RFC 9457's and ``errors`` are kept in ``extra``."""

    model_config = ConfigDict(extra="ignore")

    type: str = "about:blank"
    title: str = "Error"
    status: int = 0
    detail: str = ""
    instance: str | None = None
    errors: list[FieldProblem] = Field(default_factory=list)
    extra: dict[str, Any] = Field(default_factory=dict)

    @property
    def slug(self) -> str:
        """The last part of ``type`` (``invalid-policy`` of ``.../problems/invalid-policy``)."""
        return self.type.removeprefix(PROBLEM_BASE)

    def text(self) -> str:
        """Title, detail and one line per field error, for a terminal or a log."""
        out = f"{self.title}: {self.detail}" if self.detail else self.title
        for err in self.errors:
            line = f" (line {err.line})" if err.line else ""
            out += f"\n  {err.path or '<document>'}{line}: {err.message} [{err.code}]"
        return out


def read_problem(status: int, body: bytes | str) -> Problem:
    """The problem in ``body`` of a response with ``status``; never raises.

    ``status`` wins over the body's own ``status`` member (the response is what
    happened); entries of ``errors`` that are not objects are dropped.
    """
    raw = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return Problem(title=f"HTTP {status}", status=status, detail=raw.strip()[:300])
    errors = []
    for item in data.get("errors") or []:
        if isinstance(item, dict):
            try:
                errors.append(FieldProblem.model_validate(item))
            except ValidationError:
                continue
    return Problem(type=str(data.get("type") or "about:blank"), title=str(data.get("title") or f"HTTP {status}"),
                   status=status, detail=str(data.get("detail") or ""),
                   instance=str(data["instance"]) if data.get("instance") is not None else None,
                   errors=errors, extra={k: v for k, v in data.items() if k not in _MEMBERS})
