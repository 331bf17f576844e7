"""Every SQL statement of the autopilot."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from controlplane.models import AuditEvent, Autopilot, AutopilotEvent, Policy, Revision, Rollout


class AutopilotRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, policy_id: str) -> Autopilot | None:
        return self.session.get(Autopilot, policy_id, populate_existing=True)

    def add(self, autopilot: Autopilot) -> Autopilot:
        self.session.add(autopilot)
        self.session.flush()
        return autopilot

    def enabled(self) -> list[tuple[str, str]]:
        """(policy id, policy name) of every enabled autopilot, by name."""
        rows = self.session.execute(select(Policy.id, Policy.name).join(Autopilot, Autopilot.policy_id == Policy.id)
                                    .where(Autopilot.enabled.is_(True)).order_by(Policy.name))
        return [(r[0], r[1]) for r in rows]

    def add_event(self, event: AutopilotEvent) -> AutopilotEvent:
        self.session.add(event)
        self.session.flush()
        return event

    def events(self, policy_id: str, limit: int) -> list[AutopilotEvent]:
        return list(self.session.scalars(select(AutopilotEvent).where(AutopilotEvent.policy_id == policy_id)
                                         .order_by(AutopilotEvent.at.desc(), AutopilotEvent.id.desc())
                                         .limit(limit)))

    def count_events(self, policy_id: str, action: str, since: dt.datetime) -> int:
        return int(self.session.scalar(select(func.count()).select_from(AutopilotEvent).where(
            AutopilotEvent.policy_id == policy_id, AutopilotEvent.action == action,
            AutopilotEvent.at >= since)) or 0)

    def last_person_change(self, policy: Policy, system_prefix: str) -> dt.datetime | None:
        """When a person (an actor not named ``system:...``) last changed the policy: its document, its
        active revision or one of its rollouts, from the audit log."""
        rollouts = select(Rollout.id).where(Rollout.policy_id == policy.id)
        revisions = select(Revision.id).where(Revision.policy_id == policy.id)
        at = self.session.scalar(select(func.max(AuditEvent.at)).where(
            ~AuditEvent.actor.startswith(system_prefix),
            or_((AuditEvent.target_type == "policy") & (AuditEvent.target_id == policy.name),
                (AuditEvent.target_type == "rollout") & AuditEvent.target_id.in_(rollouts),
                (AuditEvent.target_type == "revision") & AuditEvent.target_id.in_(revisions))))
        return at

    def last_activation(self, policy: Policy) -> dt.datetime:
        """When the active revision last changed: the last completed rollout or policy rollback; else the
        policy's creation."""
        completed = self.session.scalar(select(func.max(Rollout.updated_at)).where(
            Rollout.policy_id == policy.id, Rollout.state == "completed"))
        rolled_back = self.session.scalar(select(func.max(AuditEvent.at)).where(
            AuditEvent.target_type == "policy", AuditEvent.target_id == policy.name,
            AuditEvent.action == "policy.rollback"))
        return max(at for at in (completed, rolled_back, policy.created_at) if at is not None)

    def given_up(self, revision_id: str) -> bool:
        """Whether a rollout of this revision ended without making it active (aborted or rolled back)."""
        return bool(self.session.scalar(select(func.count()).select_from(Rollout).where(
            Rollout.to_revision_id == revision_id, Rollout.state.in_(("aborted", "rolled_back")))))

    def rolled_back_since(self, policy_id: str, revision_id: str, since: dt.datetime) -> bool:
        """Whether a rollout of this revision by the autopilot was rolled back since then."""
        return bool(self.session.scalar(select(func.count()).select_from(AutopilotEvent).where(
            AutopilotEvent.policy_id == policy_id, AutopilotEvent.revision_id == revision_id,
            AutopilotEvent.action == "rolled_back", AutopilotEvent.at >= since)))

