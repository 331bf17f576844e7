"""API keys: scoped, stored as SHA-256 of a high-entropy token, shown once."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy.orm import Session

from controlplane.audit.service import record
from controlplane.auth.repository import ApiKeyRepository
from controlplane.auth.schemas import Scope
from controlplane.errors import Conflict, NotFound, Unauthorized
from controlplane.models import ApiKey, utcnow

TOKEN_PREFIX = "sgk_"  # noqa: S105 - a public marker, not a secret
# A 256-bit random token needs no slow hash: nothing can be guessed offline.
_TOKEN_BYTES = 32
# last_used_at is informative; writing it on every request would serialise SQLite.
_TOUCH_EVERY = dt.timedelta(minutes=1)


@dataclass(frozen=True, slots=True)
class Principal:
    key_id: str
    name: str
    scope: Scope

    @property
    def actor(self) -> str:
        return f"{self.scope.value}:{self.name}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_key(session: Session, *, name: str, scope: Scope, created_by: str) -> tuple[ApiKey, str]:
    token = TOKEN_PREFIX + secrets.token_urlsafe(_TOKEN_BYTES)
    key = ApiKey(name=name, scope=scope.value, prefix=token[: len(TOKEN_PREFIX) + 6],
                 secret_hash=hash_token(token), created_by=created_by)
    ApiKeyRepository(session).add(key)
    record(session, actor=created_by, action="key.create", target_type="api_key", target_id=key.id,
           after={"name": name, "scope": scope.value, "prefix": key.prefix})
    return key, token


def authenticate(session: Session, token: str) -> Principal:
    if not token.startswith(TOKEN_PREFIX):
        raise Unauthorized("the API key is malformed (expected a token starting with 'sgk_')")
    key = ApiKeyRepository(session).get_by_hash(hash_token(token))
    if key is None:
        raise Unauthorized("the API key is not known")
    if key.revoked_at is not None:
        raise Unauthorized("the API key was revoked")
    now = utcnow()
    if key.last_used_at is None or now - key.last_used_at > _TOUCH_EVERY:
        ApiKeyRepository(session).touch(key.id, now)
    return Principal(key.id, key.name, Scope(key.scope))


def revoke_key(session: Session, *, key_id: str, actor: str, reason: str) -> ApiKey:
    repo = ApiKeyRepository(session)
    key = repo.get(key_id)
    if key is None:
        raise NotFound(f"API key {key_id!r} does not exist")
    if key.revoked_at is not None:
        raise Conflict(f"API key {key_id!r} is already revoked", state="revoked")
    key.revoked_at = utcnow()
    record(session, actor=actor, action="key.revoke", target_type="api_key", target_id=key.id,
           before={"revoked": False}, after={"revoked": True}, reason=reason)
    return key
