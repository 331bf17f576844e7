"""API keys: scoped, stored as SHA-256 of a high-entropy token, shown once."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from controlplane.audit.service import record
from controlplane.auth.repository import ApiKeyRepository
from controlplane.auth.schemas import Scope
from controlplane.errors import Conflict, Forbidden, NotFound, Unauthorized, ValidationFailed
from controlplane.models import ApiKey, utcnow
from wire.problems import ProblemCode

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
    # A worker key's binding (see ApiKey): both None on a key created before keys were bound.
    pool: str | None = None
    worker_ids: frozenset[str] | None = None

    @property
    def actor(self) -> str:
        return f"{self.scope.value}:{self.name}"

    @property
    def unbound(self) -> bool:
        return self.pool is None and self.worker_ids is None

    def names(self, worker_id: str) -> bool:
        """Whether the key is bound to ``worker_id`` by id (then in whatever pool it is)."""
        return self.worker_ids is not None and worker_id in self.worker_ids

    def may_act_as(self, worker_id: str, pool: str | None) -> bool:
        """Whether this key may act as ``worker_id``, registered in ``pool`` (None: not registered)."""
        if self.scope is not Scope.worker or self.names(worker_id):
            return True
        return self.pool is not None and pool == self.pool


def binding_of(pool: str | None, worker_ids: Iterable[str] | None) -> dict[str, object]:
    """A key's binding as the audit log and the key listing show it."""
    return {"pool": pool, "worker_ids": None if worker_ids is None else sorted(worker_ids)}


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_key(session: Session, *, name: str, scope: Scope, created_by: str, pool: str | None = None,
               worker_ids: Collection[str] | None = None) -> tuple[ApiKey, str]:
    """A new key. A worker key may be bound to a ``pool`` and/or ``worker_ids``; one bound to neither binds
    itself to the first worker it registers (how keys created before binding existed keep working)."""
    if scope is not Scope.worker:
        wrong = [field for field, value in (("pool", pool), ("worker_ids", worker_ids)) if value is not None]
        if wrong:
            raise ValidationFailed(f"only a worker key can be bound to workers, not a {scope.value} key", errors=[
                {"path": field, "in": "body", "code": ProblemCode.invalid_value,
                 "message": "only a worker key is bound to a pool or to worker ids"} for field in wrong])
    ids = None if worker_ids is None else sorted(set(worker_ids))
    token = TOKEN_PREFIX + secrets.token_urlsafe(_TOKEN_BYTES)
    key = ApiKey(name=name, scope=scope.value, prefix=token[: len(TOKEN_PREFIX) + 6],
                 secret_hash=hash_token(token), created_by=created_by, pool=pool, worker_ids=ids)
    ApiKeyRepository(session).add(key)
    after: dict[str, object] = {"name": name, "scope": scope.value, "prefix": key.prefix}
    if scope is Scope.worker:
        after.update(binding_of(pool, ids))
    record(session, actor=created_by, action="key.create", target_type="api_key", target_id=key.id, after=after)
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
    return Principal(key.id, key.name, Scope(key.scope), key.pool,
                     None if key.worker_ids is None else frozenset(key.worker_ids))


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


# --- what a worker key may act as ------------------------------------------------------------

class WorkerNotAllowed(Forbidden):
    type_slug, title = "worker-not-allowed", "This key may not act as that worker"


def _not_allowed(principal: Principal, worker_id: str, why: str) -> WorkerNotAllowed:
    return WorkerNotAllowed(f"key {principal.name!r} may not act as worker {worker_id!r}: {why}", worker=worker_id)


def still_allowed(principal: Principal, worker_id: str, pool: str) -> None:
    """Raise 403 unless ``principal`` may read the bundle of ``worker_id``, now registered in ``pool``.

    For long-polls and streams authorised when they opened: the worker may have moved to another pool since
    (a change that wakes them), and a pool-bound key must not go on receiving its bundles. No database read:
    the caller has just read the worker's pool with its bundle.
    """
    if not principal.may_act_as(worker_id, pool):
        raise _not_allowed(principal, worker_id, f"the worker moved to pool {pool!r}")


class WorkerGrant:
    """Which workers one key may act as, resolved lazily: each worker's pool is read at most once.

    Made once per request (or per telemetry batch), so a batch of many events for a few workers costs at
    most one query, and none for a key bound by worker ids alone.
    """

    def __init__(self, session: Session, principal: Principal) -> None:
        self.session = session
        self.principal = principal
        self._pools: dict[str, str | None] = {}

    def _load(self, worker_ids: Collection[str]) -> None:
        missing = [w for w in worker_ids if w not in self._pools]
        if not missing:
            return
        found = ApiKeyRepository(self.session).worker_pools(missing)
        for worker_id in missing:
            self._pools[worker_id] = found.get(worker_id)

    def allowed(self, worker_ids: Collection[str]) -> set[str]:
        """The ids among ``worker_ids`` this key may act as (an admin key: all of them)."""
        p = self.principal
        if p.scope is Scope.worker and p.pool is not None:
            # Only the pool decides for the workers the key does not name: read theirs (at most one query).
            self._load([w for w in worker_ids if not p.names(w)])
        return {w for w in worker_ids if p.may_act_as(w, self._pools.get(w))}

    def pools_of(self, worker_ids: Collection[str]) -> dict[str, str | None]:
        """The pool each worker is registered in; None for one not registered (yet): a key may act as such a
        worker only by naming its id, and such a worker may be in any pool."""
        self._load(worker_ids)
        return {w: self._pools[w] for w in worker_ids}

    def check(self, worker_id: str, *, unregistered_passes: bool = True) -> None:
        """Raise 403 ``worker-not-allowed`` unless this key may act as ``worker_id``.

        By default a worker that is not registered passes: the endpoint then answers its own 404
        (worker-not-found), which tells a sidecar to register, and there is nothing of that worker to read
        or change."""
        if worker_id in self.allowed([worker_id]):
            return
        if unregistered_passes:
            self._load([worker_id])
            if self._pools[worker_id] is None:
                return
        if self.principal.unbound:
            raise _not_allowed(self.principal, worker_id, "the key is bound to no worker yet; its first "
                               "POST /v1/workers/register binds it")
        raise _not_allowed(self.principal, worker_id, "the worker is not one the key is bound to")


def authorize_worker(session: Session, principal: Principal, worker_id: str) -> None:
    """The check of every single-worker endpoint (heartbeat, bundle, events): 403 naming the worker."""
    WorkerGrant(session, principal).check(worker_id)


def _claimed_by_another(keys: ApiKeyRepository, key_id: str, worker_id: str, pools: Collection[str | None]) -> bool:
    """Whether another live worker key is bound to this worker id, or to one of ``pools`` (the pool the worker
    is registered in and the one it announces: an unbound key must not place a worker in another key's pool)."""
    return any((ids is not None and worker_id in ids) or (key_pool is not None and key_pool in pools)
               for key_pool, ids in keys.other_worker_bindings(key_id))


def authorize_registration(session: Session, principal: Principal, worker_id: str, pool: str,
                           existing_pool: str | None) -> None:
    """May this key register ``worker_id`` into ``pool``? ``existing_pool`` is the worker's pool now (None:
    not registered). An unbound key is bound here to ``worker_id`` (trust on first use), audited."""
    p = principal
    if p.unbound:
        # Registration is rare: locking and reading the other worker keys' bindings costs nothing that matters.
        keys = ApiKeyRepository(session)
        keys.lock_worker_bindings()
        key = keys.get(p.key_id)
        if key is None:  # pragma: no cover - the key was read by this request's authentication
            raise Unauthorized("the API key is not known")
        session.refresh(key)  # what a concurrent registration with this very key committed before the lock
        if key.worker_ids is not None or key.pool is not None:
            if key.worker_ids is not None and worker_id in key.worker_ids:
                return
            raise _not_allowed(p, worker_id, "a concurrent registration bound the key to another worker")
        if _claimed_by_another(keys, p.key_id, worker_id, {existing_pool, pool}):
            raise _not_allowed(p, worker_id, "the worker, or the pool it names, is bound to another key")
        key.worker_ids = [worker_id]
        record(session, actor=p.actor, action="key.bind", target_type="api_key", target_id=key.id,
               before=binding_of(None, None), after=binding_of(None, [worker_id]))
        return
    # A worker the key names by id is its own, in whatever pool it announces (moving pools is legitimate).
    if p.names(worker_id):
        return
    if p.pool is not None and pool != p.pool:
        raise WorkerNotAllowed(f"key {p.name!r} may not register worker {worker_id!r} into pool {pool!r}: it "
                               f"registers workers only into pool {p.pool!r}", worker=worker_id, pool=pool)
    if p.pool is not None and existing_pool in (None, p.pool):
        return
    raise _not_allowed(p, worker_id, "the worker is not one the key is bound to")
