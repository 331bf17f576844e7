"""The autopilot's background task: one leader across control-plane replicas, one look per policy per interval.

The leader is elected as :mod:`controlplane.leadership` describes (role
``autopilot``, lock ``SPECGATE_AUTOPILOT_LOCK_KEY``): on PostgreSQL the
process holding a session advisory lock, handed over within one interval when
it dies; on SQLite the one process. A shutdown lets the leadership go after
the round under way, so that no other replica looks at a policy this one is
still changing.
"""

from __future__ import annotations

import logging
from typing import Any

from controlplane.autopilot import service
from controlplane.db import unit_of_work
from controlplane.leadership import AUTOPILOT, lead
from controlplane.models import utcnow

log = logging.getLogger("specgate.controlplane.autopilot")


def look_all(app: Any) -> int:
    """One look at every enabled autopilot, each in its own transaction; returns how many looked."""
    settings = app.state.settings
    with unit_of_work(app.state.sessions) as session:
        policy_ids = service.enabled_policies(session)
    for policy_id in policy_ids:
        try:
            with unit_of_work(app.state.sessions) as session:
                generation = service.look(session, policy_id, now=utcnow(), alpha=settings.guardrail_alpha,
                                          worker_stale_after_s=settings.worker_stale_after_s)
        except Exception:
            log.exception("autopilot look at policy %s failed", policy_id)
            continue
        if generation is not None:
            app.state.hub.publish(generation)
    return len(policy_ids)


async def run_autopilot(app: Any, interval_s: float) -> None:
    """Loop until cancelled: take or keep the leadership, then look; an error in a round is logged."""

    def leads(now: bool) -> None:
        app.state.autopilot_leader = now  # the autopilot API's `leader`

    await lead(app, AUTOPILOT, app.state.settings.autopilot_lock_key, interval_s, lambda: look_all(app),
               on_change=leads)
