"""Every SQL statement of policies and revisions: by name, id or pool, heads, pages of revisions."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session, aliased

from controlplane.models import Policy, Revision


class PolicyRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get_by_name(self, name: str, *, for_update: bool = False) -> Policy | None:
        query = select(Policy).where(Policy.name == name)
        if for_update:
            query = query.with_for_update()
        return self.session.scalar(query)

    def get(self, policy_id: str) -> Policy | None:
        return self.session.get(Policy, policy_id)

    def get_by_pool(self, pool: str | None) -> Policy | None:
        condition = Policy.pool.is_(None) if pool is None else Policy.pool == pool
        return self.session.scalar(select(Policy).where(condition).limit(1))

    def add(self, policy: Policy) -> Policy:
        self.session.add(policy)
        self.session.flush()
        return policy

    def list_with_stats(self, policy_id: str | None = None) -> Sequence[tuple[Policy, str | None, int]]:
        """Policies by name, each with its head revision id and revision count, in one query."""
        stats = (select(Revision.policy_id, func.count().label("n"), func.max(Revision.seq).label("top"))
                 .group_by(Revision.policy_id).subquery())
        head = aliased(Revision)
        query = (select(Policy, head.id, func.coalesce(stats.c.n, 0))
                      .outerjoin(stats, stats.c.policy_id == Policy.id)
                      .outerjoin(head, and_(head.policy_id == Policy.id, head.seq == stats.c.top))
                      .order_by(Policy.name))
        if policy_id is not None:
            query = query.where(Policy.id == policy_id)
        return [(p, h, int(n)) for p, h, n in self.session.execute(query).all()]


class RevisionRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, revision_id: str) -> Revision | None:
        return self.session.get(Revision, revision_id)

    def exists(self, revision_id: str) -> bool:
        return self.session.scalar(select(Revision.id).where(Revision.id == revision_id)) is not None

    def head(self, policy_id: str) -> Revision | None:
        return self.session.scalar(select(Revision).where(Revision.policy_id == policy_id)
                                   .order_by(Revision.seq.desc()).limit(1))

    def add(self, revision: Revision) -> Revision:
        self.session.add(revision)
        self.session.flush()
        return revision

    def page(self, policy_id: str, *, before_seq: int | None, limit: int) -> Sequence[Revision]:
        """Newest first; ``before_seq`` is the keyset cursor from the previous page."""
        query = (select(Revision).where(Revision.policy_id == policy_id)
                 .order_by(Revision.seq.desc()).limit(limit))
        if before_seq is not None:
            query = query.where(Revision.seq < before_seq)
        return self.session.scalars(query).all()
