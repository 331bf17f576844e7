"""The API keys API: create, list and revoke keys; who the calling key is."""

from __future__ import annotations

from fastapi import APIRouter, Path, Query

from controlplane.auth.repository import ApiKeyRepository
from controlplane.auth.schemas import NO_NUL, KeyCreate, KeyCreated, KeyRead, WhoAmI
from controlplane.auth.service import create_key, revoke_key
from controlplane.deps import Admin, AnyKey, SessionDep
from controlplane.errors import AUTH_RESPONSES, INVALID_RESPONSE, TOO_LARGE_RESPONSE, problems

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=AUTH_RESPONSES)


@router.post("", status_code=201, response_model=KeyCreated, responses={**TOO_LARGE_RESPONSE, **INVALID_RESPONSE})
def create(body: KeyCreate, session: SessionDep, who: Admin) -> KeyCreated:
    key, token = create_key(session, name=body.name, scope=body.scope, created_by=who.actor, pool=body.pool,
                            worker_ids=body.worker_ids)
    return KeyCreated(**KeyRead.model_validate(key, from_attributes=True).model_dump(), token=token)


@router.get("", response_model=list[KeyRead], responses=INVALID_RESPONSE)
def list_keys(session: SessionDep, _: Admin, include_revoked: bool = Query(False)) -> list[KeyRead]:
    keys = ApiKeyRepository(session).list(include_revoked)
    return [KeyRead.model_validate(k, from_attributes=True) for k in keys]


# Its own path: under /v1/keys it would collide with /v1/keys/{key_id}.
whoami_router = APIRouter(prefix="/v1", tags=["keys"], responses=AUTH_RESPONSES)


@whoami_router.get("/whoami", response_model=WhoAmI, summary="The calling key",
                   description="Who the key is and its scope (any valid key): what a client needs to know which "
                               "actions it may offer.")
def whoami(who: AnyKey) -> WhoAmI:
    return WhoAmI(key_id=who.key_id, name=who.name, scope=who.scope, actor=who.actor)


@router.delete("/{key_id}", response_model=KeyRead,
                responses={**problems({404: "no such key", 409: "the key is already revoked"}), **INVALID_RESPONSE})
def revoke(session: SessionDep, who: Admin, key_id: str = Path(max_length=64, pattern=NO_NUL),
           reason: str = Query("", max_length=2000, pattern=NO_NUL)) -> KeyRead:
    key = revoke_key(session, key_id=key_id, actor=who.actor, reason=reason)
    return KeyRead.model_validate(key, from_attributes=True)
