"""The synchronous client: one control plane, one key; a call answers a typed reply or raises :class:`ApiError`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import httpx
from pydantic import ValidationError

from apiclient.calls import Call
from wire.problems import Problem, read_problem

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 15.0


class ApiError(Exception):
    """The control plane refused (4xx/5xx), answered what the client cannot read, or could not be reached.

    ``problem.status`` is the HTTP status, 0 when no answer came at all.
    """

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.text())
        self.problem = problem

    @property
    def status(self) -> int:
        return self.problem.status

    @property
    def unreachable(self) -> bool:
        return self.problem.status == 0


@dataclass(frozen=True)
class Reply(Generic[T]):
    """An answer: its status, the body as the server sent it (parsed JSON), and the same body typed."""

    status: int
    json: Any
    data: T


class ApiClient:
    """The control plane's REST API with one key. Close it (or use ``with``) to release its connections."""

    def __init__(self, base_url: str, key: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, transport=transport,
                                  headers={"Authorization": f"Bearer {key}", "Accept": "application/json"})

    def send(self, call: Call[T]) -> Reply[T]:
        endpoint = call.endpoint
        try:
            response = self._http.request(endpoint.method, call.path, params=dict(call.params) or None,
                                          json=call.body, headers=dict(call.headers) or None)
        except httpx.HTTPError as exc:
            raise ApiError(Problem(title="Control plane unreachable", status=0,
                                   detail=f"cannot reach the control plane at {self.base_url}: {exc}")) from None
        if response.status_code not in endpoint.ok:
            raise ApiError(read_problem(response.status_code, response.content))
        try:
            body = response.json()
            return Reply(response.status_code, body, endpoint.adapter.validate_python(body))
        except (json.JSONDecodeError, UnicodeDecodeError, ValidationError) as exc:
            # A proxy's page, or a control plane whose answer this client does not understand: a refusal with
            # what was wrong, never a traceback.
            raise ApiError(Problem(title="Unexpected answer from the control plane", status=response.status_code,
                                   detail=f"{endpoint.method} {call.path}: {_reason(exc)}")) from None

    @property
    def closed(self) -> bool:
        return self._http.is_closed

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "<body>"
        return f"{where}: {first['msg']} ({exc.error_count()} error(s))"
    return f"the body is not JSON ({exc})"
