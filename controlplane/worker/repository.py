"""Every SQL statement of workers: by id, pages filtered by pool, kind and staleness, the live ones running a
revision, all of them."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.models import Worker


class WorkerRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, worker_id: str) -> Worker | None:
        return self.session.get(Worker, worker_id)

    def get_many(self, worker_ids: Collection[str]) -> Sequence[Worker]:
        if not worker_ids:
            return []
        return self.session.scalars(select(Worker).where(Worker.id.in_(list(worker_ids)))).all()

    def add(self, worker: Worker) -> Worker:
        self.session.add(worker)
        self.session.flush()
        return worker

    def page(self, *, pool: str | None, stale: bool | None, stale_before: dt.datetime,
             after_id: str | None, limit: int, kind: str | None = None) -> Sequence[Worker]:
        """Ordered by id; ``after_id`` is the keyset cursor from the previous page."""
        query = select(Worker).order_by(Worker.id).limit(limit)
        if pool is not None:
            query = query.where(Worker.pool == pool)
        if kind is not None:
            query = query.where(Worker.kind == kind)
        if stale is True:
            query = query.where(Worker.last_heartbeat_at < stale_before)
        elif stale is False:
            query = query.where(Worker.last_heartbeat_at >= stale_before)
        if after_id is not None:
            query = query.where(Worker.id > after_id)
        return self.session.scalars(query).all()

    def live_running(self, revision_id: str, *, seen_since: dt.datetime) -> Sequence[Worker]:
        """The workers that run ``revision_id`` and heartbeated at or after ``seen_since``, by id."""
        return self.session.scalars(select(Worker).where(Worker.active_revision_id == revision_id,
                                                         Worker.last_heartbeat_at >= seen_since)
                                    .order_by(Worker.id)).all()

    def all(self) -> Sequence[Worker]:
        return self.session.scalars(select(Worker).order_by(Worker.pool, Worker.id)).all()
