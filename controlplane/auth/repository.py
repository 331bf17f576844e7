"""Every SQL statement of API keys: look a key up by id or by the hash of its secret, add, list, mark as used."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from controlplane.models import ApiKey


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
