from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query, Request

from controlplane.auth.dependencies import ADMIN, require
from controlplane.auth.repository import ApiKeyRepository
from controlplane.auth.schemas import NO_NUL, KeyCreate, KeyCreated, KeyRead, Scope, WhoAmI
from controlplane.auth.service import Principal, create_key, revoke_key
from controlplane.db import unit_of_work
from controlplane.errors import AUTH_RESPONSES, INVALID_RESPONSE, TOO_LARGE_RESPONSE, problems

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=AUTH_RESPONSES)


@router.post("", status_code=201, response_model=KeyCreated, responses={**TOO_LARGE_RESPONSE, **INVALID_RESPONSE})
def create(body: KeyCreate, request: Request, who: Principal = Depends(require(*ADMIN))) -> KeyCreated:
    with unit_of_work(request.app.state.sessions) as session:
        key, token = create_key(session, name=body.name, scope=body.scope, created_by=who.actor)
        return KeyCreated(**KeyRead.model_validate(key, from_attributes=True).model_dump(), token=token)


@router.get("", response_model=list[KeyRead], responses=INVALID_RESPONSE)
def list_keys(request: Request, include_revoked: bool = Query(False),
              _: Principal = Depends(require(*ADMIN))) -> list[KeyRead]:
    with unit_of_work(request.app.state.sessions) as session:
        keys = ApiKeyRepository(session).list(include_revoked)
        return [KeyRead.model_validate(k, from_attributes=True) for k in keys]


# Its own path: under /v1/keys it would collide with /v1/keys/{key_id}.
whoami_router = APIRouter(prefix="/v1", tags=["keys"], responses=AUTH_RESPONSES)


@whoami_router.get("/whoami", response_model=WhoAmI, summary="The calling key",
                   description="Who the key is and its scope (any valid key): what a client needs to know which "
                               "actions it may offer.")
def whoami(who: Principal = Depends(require(*Scope))) -> WhoAmI:
    return WhoAmI(key_id=who.key_id, name=who.name, scope=who.scope, actor=who.actor)


@router.delete("/{key_id}", response_model=KeyRead,
                responses={**problems({404: "no such key", 409: "the key is already revoked"}), **INVALID_RESPONSE})
def revoke(request: Request, key_id: str = Path(max_length=64, pattern=NO_NUL),
           reason: str = Query("", max_length=2000, pattern=NO_NUL),
           who: Principal = Depends(require(*ADMIN))) -> KeyRead:
    with unit_of_work(request.app.state.sessions) as session:
        key = revoke_key(session, key_id=key_id, actor=who.actor, reason=reason)
        return KeyRead.model_validate(key, from_attributes=True)
