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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROBLEM_BASE = "https://specgate.dev/problems/"
PROBLEM_MEDIA_TYPE = "application/problem+json"

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
            "properties": {"path": {"type": "string"}, "in": {"type": "string"}, "code": {"type": "string"},
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
