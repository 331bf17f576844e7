"""Every SQL statement of distribution: the fleet's switches, the policies by pool, live rollouts, documents."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from controlplane.models import FleetState, Policy, Revision, Rollout, RolloutStep


class DistributionRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def fleet_switches(self) -> tuple[bool, int, str]:
        """The kill switch, the distribution generation and the cohort secret ('' on a database from before
        cohort secrets: the empty secret keeps the old public salts)."""
        row = self.session.execute(select(FleetState.kill_switch, FleetState.generation, FleetState.cohort_secret)
                                   .where(FleetState.id == 1)).first()
        if row is None:
            return False, 0, ""
        return bool(row.kill_switch), int(row.generation or 0), row.cohort_secret or ""

    def lock_generation(self) -> int | None:
        """The generation, its row locked until the transaction ends (None without the row)."""
        value = self.session.scalar(select(FleetState.generation).where(FleetState.id == 1).with_for_update())
        return None if value is None else int(value)

    def policies(self, pools: Collection[str] | None) -> Sequence[Policy]:
        """Policies that can serve ``pools`` (theirs and the pool-less one); all when None."""
        query = select(Policy).order_by(Policy.name)
        if pools is not None:
            query = query.where(or_(Policy.pool.in_(list(pools)), Policy.pool.is_(None)))
        return self.session.scalars(query).all()

    def live_rollouts(self, policy_ids: Collection[str],
                      states: Collection[str]) -> Sequence[tuple[Rollout, float | None]]:
        """Rollouts in ``states`` with the percent of their current step (None without that step)."""
        if not policy_ids:
            return []
        query = (select(Rollout, RolloutStep.percent)
                 .outerjoin(RolloutStep, and_(RolloutStep.rollout_id == Rollout.id,
                                              RolloutStep.position == Rollout.current_step))
                 .where(Rollout.policy_id.in_(list(policy_ids)), Rollout.state.in_(list(states)))
                 .order_by(Rollout.created_at.desc(), Rollout.id))
        return [(rollout, percent) for rollout, percent in self.session.execute(query).all()]

    def revision_documents(self, ids: Collection[str]) -> dict[str, dict[str, Any]]:
        if not ids:
            return {}
        rows = self.session.execute(select(Revision.id, Revision.document).where(Revision.id.in_(list(ids))))
        return {rid: document for rid, document in rows}
