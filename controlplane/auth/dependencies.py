"""Who is calling, and whether their key's scope allows it."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from controlplane.auth.schemas import Scope
from controlplane.auth.service import Principal, authenticate
from controlplane.db import unit_of_work
from controlplane.errors import Forbidden, Unauthorized

_bearer = HTTPBearer(auto_error=False, description="an API key: Authorization: Bearer sgk_...")

READ = (Scope.admin, Scope.operator, Scope.viewer)
OPERATE = (Scope.admin, Scope.operator)
ADMIN = (Scope.admin,)
WORKER = (Scope.worker,)


def require(*scopes: Scope) -> Callable[..., Principal]:
    allowed = frozenset(scopes)

    def dependency(request: Request,
                   credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Principal:
        if credentials is None or not credentials.credentials:
            raise Unauthorized("this endpoint needs an API key: send 'Authorization: Bearer <key>'")
        with unit_of_work(request.app.state.sessions) as session:
            principal = authenticate(session, credentials.credentials)
        if principal.scope not in allowed:
            needed = ", ".join(sorted(s.value for s in allowed))
            raise Forbidden(f"a {principal.scope.value} key cannot do this; it needs one of: {needed}")
        return principal

    return dependency
