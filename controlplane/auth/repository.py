"""Every SQL statement of API keys: look a key up by id or by the hash of its secret, add, list, mark as used."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from controlplane.auth.schemas import Scope
from controlplane.models import ApiKey, Worker


class ApiKeyRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get_by_hash(self, secret_hash: str) -> ApiKey | None:
        return self.session.scalar(select(ApiKey).where(ApiKey.secret_hash == secret_hash))

    def get(self, key_id: str) -> ApiKey | None:
        return self.session.get(ApiKey, key_id)

    def add(self, key: ApiKey) -> ApiKey:
        self.session.add(key)
        self.session.flush()
        return key

    def list(self, include_revoked: bool) -> Sequence[ApiKey]:
        query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
        if not include_revoked:
            query = query.where(ApiKey.revoked_at.is_(None))
        return self.session.scalars(query).all()

    def touch(self, key_id: str, at: dt.datetime) -> None:
        self.session.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=at))

    # -- worker bindings ---------------------------------------------------------------------------

    def worker_pools(self, worker_ids: Collection[str]) -> dict[str, str]:
        """The pool of each registered worker among ``worker_ids``."""
        rows = self.session.execute(select(Worker.id, Worker.pool).where(Worker.id.in_(list(worker_ids))))
        return {worker_id: pool for worker_id, pool in rows}

    def lock_worker_bindings(self) -> None:
        """Serialise binding keys to workers until commit: two unbound keys registering one worker at once
        must not both claim it. A no-op UPDATE of the live worker keys, as lock_policy does (SQLite has no
        row locks; there the write takes the database's write lock before the reads that decide)."""
        self.session.execute(update(ApiKey).where(ApiKey.scope == Scope.worker.value, ApiKey.revoked_at.is_(None))
                             .values(name=ApiKey.name).execution_options(synchronize_session=False))

    def other_worker_bindings(self, key_id: str) -> Sequence[tuple[str | None, Any]]:
        """(pool, worker_ids) of every live worker key but ``key_id``."""
        rows = self.session.execute(select(ApiKey.pool, ApiKey.worker_ids).where(
            ApiKey.scope == Scope.worker.value, ApiKey.revoked_at.is_(None), ApiKey.id != key_id))
        return [(pool, ids) for pool, ids in rows]
