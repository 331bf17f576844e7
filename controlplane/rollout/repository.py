"""Every SQL statement of rollouts, rollbacks, the kill switch and guardrail evaluations."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from controlplane.models import FleetState, GuardrailEvaluation, Policy, Revision, Rollout, RolloutStep

# The states in which a rollout still splits its policy's workers or traffic.
OPEN_STATES = ("running", "paused")


class RolloutRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    # -- locks -------------------------------------------------------------------------------------

    def lock_policy(self, *, name: str | None = None, policy_id: str | None = None) -> Policy | None:
        """The policy, locked until commit: every change to its rollouts or active revision takes this.

        A no-op UPDATE rather than SELECT ... FOR UPDATE because SQLite has no row
        locks: there the write takes the database's write lock before the reads
        that decide anything, and on PostgreSQL it locks the row. Reading again
        afterwards (populate_existing) sees what a concurrent winner committed.
        """
        where = Policy.name == name if name is not None else Policy.id == policy_id
        self.session.execute(update(Policy).where(where).values(name=Policy.name)
                             .execution_options(synchronize_session=False))
        return self.session.scalar(select(Policy).where(where).execution_options(populate_existing=True))

    def cohort_secret(self) -> str:
        """The fleet's cohort secret ('' before the first start on this database)."""
        return self.session.scalar(select(FleetState.cohort_secret).where(FleetState.id == 1)) or ""

    def lock_fleet_state(self) -> FleetState:
        # Same reasoning as lock_policy: two concurrent PUTs must not both see "off" and both turn it on.
        self.session.execute(update(FleetState).where(FleetState.id == 1)
                             .values(kill_switch=FleetState.kill_switch)
                             .execution_options(synchronize_session=False))
        state = self.session.scalar(select(FleetState).where(FleetState.id == 1)
                                    .execution_options(populate_existing=True))
        if state is None:
            raise RuntimeError("the database has no fleet_state row: run the migrations first")
        return state

    # -- reads -------------------------------------------------------------------------------------

    def policy_by_name(self, name: str) -> Policy | None:
        return self.session.scalar(select(Policy).where(Policy.name == name))

    def policy(self, policy_id: str) -> Policy | None:
        return self.session.get(Policy, policy_id)

    def policy_names(self, policy_ids: Iterable[str]) -> dict[str, str]:
        ids = set(policy_ids)
        if not ids:
            return {}
        rows = self.session.execute(select(Policy.id, Policy.name).where(Policy.id.in_(ids)))
        return {pid: name for pid, name in rows}

    def revision(self, revision_id: str) -> Revision | None:
        return self.session.get(Revision, revision_id)

    def get(self, rollout_id: str, *, refresh: bool = False) -> Rollout | None:
        query = select(Rollout).where(Rollout.id == rollout_id)
        if refresh:
            query = query.execution_options(populate_existing=True)
        return self.session.scalar(query)

    def open_for_policy(self, policy_id: str) -> Rollout | None:
        """The policy's running or paused rollout; the service keeps it to at most one."""
        return self.session.scalar(select(Rollout)
                                   .where(Rollout.policy_id == policy_id, Rollout.state.in_(OPEN_STATES))
                                   .order_by(Rollout.created_at.desc(), Rollout.id.desc()).limit(1)
                                   .execution_options(populate_existing=True))

    def steps(self, rollout_id: str) -> list[RolloutStep]:
        return list(self.session.scalars(select(RolloutStep).where(RolloutStep.rollout_id == rollout_id)
                                         .order_by(RolloutStep.position)
                                         .execution_options(populate_existing=True)))

    def steps_of(self, rollout_ids: Iterable[str]) -> dict[str, list[RolloutStep]]:
        ids = set(rollout_ids)
        out: dict[str, list[RolloutStep]] = {rid: [] for rid in ids}
        if not ids:
            return out
        for step in self.session.scalars(select(RolloutStep).where(RolloutStep.rollout_id.in_(ids))
                                         .order_by(RolloutStep.rollout_id, RolloutStep.position)):
            out[step.rollout_id].append(step)
        return out

    def step(self, rollout_id: str, position: int) -> RolloutStep | None:
        return self.session.scalar(select(RolloutStep).where(RolloutStep.rollout_id == rollout_id,
                                                             RolloutStep.position == position))

    def running(self) -> list[str]:
        """Ids of the running rollouts, oldest first."""
        return list(self.session.scalars(select(Rollout.id).where(Rollout.state == "running")
                                         .order_by(Rollout.created_at)))

    def generation(self) -> int:
        return int(self.session.scalar(select(FleetState.generation).where(FleetState.id == 1)) or 0)

    def evaluations(self, rollout_id: str, limit: int) -> list[GuardrailEvaluation]:
        """A rollout's guardrail evaluations, newest first."""
        return list(self.session.scalars(
            select(GuardrailEvaluation).where(GuardrailEvaluation.rollout_id == rollout_id)
            .order_by(GuardrailEvaluation.evaluated_at.desc(), GuardrailEvaluation.id.desc()).limit(limit)))

    def latest_guardrail_evaluations(self, rollout_ids: Sequence[str]) -> dict[str, GuardrailEvaluation]:
        """The newest guardrail evaluation of each rollout that has one."""
        if not rollout_ids:
            return {}
        newest = (select(GuardrailEvaluation.rollout_id, func.max(GuardrailEvaluation.id).label("id"))
                  .where(GuardrailEvaluation.rollout_id.in_(set(rollout_ids)))
                  .group_by(GuardrailEvaluation.rollout_id).subquery())
        rows = self.session.scalars(select(GuardrailEvaluation).join(newest, GuardrailEvaluation.id == newest.c.id))
        return {row.rollout_id: row for row in rows}

    def search(self, *, policy_id: str | None, state: str | None,
               before: tuple[dt.datetime, str] | None, limit: int) -> Sequence[Rollout]:
        """Newest first; ``before`` is the (created_at, id) keyset cursor of the previous page."""
        query = select(Rollout).order_by(Rollout.created_at.desc(), Rollout.id.desc()).limit(limit)
        if policy_id is not None:
            query = query.where(Rollout.policy_id == policy_id)
        if state is not None:
            query = query.where(Rollout.state == state)
        if before is not None:
            at, rid = before
            query = query.where(or_(Rollout.created_at < at,
                                    and_(Rollout.created_at == at, Rollout.id < rid)))
        return self.session.scalars(query).all()

    # -- writes ------------------------------------------------------------------------------------

    def add(self, rollout: Rollout, percents: Sequence[float], started_at: dt.datetime) -> list[RolloutStep]:
        self.session.add(rollout)
        self.session.flush()
        steps = [RolloutStep(rollout_id=rollout.id, position=i, percent=p,
                             started_at=started_at if i == 0 else None)
                 for i, p in enumerate(percents)]
        self.session.add_all(steps)
        self.session.flush()
        return steps

    def add_evaluation(self, evaluation: GuardrailEvaluation) -> GuardrailEvaluation:
        self.session.add(evaluation)
        self.session.flush()
        return evaluation

    def flush(self) -> None:
        self.session.flush()
