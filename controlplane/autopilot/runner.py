"""The autopilot's background task: one leader across control-plane replicas, one look per policy per interval.

On PostgreSQL the leader is the process holding a session-level advisory lock
(``pg_try_advisory_lock``) on a connection of its own, kept open while it
leads: when the process dies, its connection closes and the database frees
the lock, so another replica takes over at its next round (within one
interval). Each round the leader checks its connection; a broken one (the
database restarted) drops the leadership, to be tried again. On SQLite the
database belongs to one process, which leads (``specgate serve`` runs one).

The leader's connection never goes back to the pool holding the lock: on any
error it is invalidated (closed for good). A shutdown releases the lock only
after the round under way has finished, so that no other replica looks at
a policy this one is still changing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from controlplane.autopilot import service
from controlplane.db import unit_of_work
from controlplane.models import utcnow

log = logging.getLogger("specgate.controlplane.autopilot")


class Leadership:
    """Whether this process runs the autopilots (see the module doc)."""

    def __init__(self, engine: Engine, lock_key: int) -> None:
        self.engine = engine
        self.lock_key = lock_key
        self.connection: Connection | None = None
        self.round = threading.Lock()  # held by a round of looks

    def acquire(self) -> bool:
        """Keep or take the leadership; False while another process holds it."""
        if self.engine.dialect.name != "postgresql":
            return True
        if self.connection is not None:
            try:
                self.connection.execute(text("SELECT 1"))
                return True
            except SQLAlchemyError:
                log.warning("the autopilot leader's database connection broke: leadership dropped")
                self._drop()
        connection = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            got = bool(connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": self.lock_key}).scalar())
        except SQLAlchemyError:
            connection.invalidate()
            connection.close()
            raise
        if not got:
            connection.close()
            return False
        self.connection = connection
        log.info("this process leads the autopilots")
        return True

    def _drop(self) -> None:
        """Forget a connection that may still hold the lock: invalidated, never returned to the pool."""
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.invalidate()
            connection.close()

    def release(self) -> None:
        """Give the leadership up, after the round under way."""
        with self.round:
            connection = self.connection
            if connection is None:
                return
            try:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": self.lock_key})
            except SQLAlchemyError:
                self._drop()  # gone with its connection, or to be taken with it
                return
            self.connection = None
            connection.close()


def look_all(app: Any, leadership: Leadership | None = None) -> int:
    """One look at every enabled autopilot, each in its own transaction; returns how many looked."""
    if leadership is not None:
        with leadership.round:
            return look_all(app)
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
    leadership = Leadership(app.state.engine, app.state.settings.autopilot_lock_key)
    app.state.autopilot_leader = False
    try:
        while True:
            try:
                app.state.autopilot_leader = await run_in_threadpool(leadership.acquire)
                if app.state.autopilot_leader:
                    await run_in_threadpool(look_all, app, leadership)
            except Exception:
                app.state.autopilot_leader = False
                log.exception("autopilot round failed")
            await asyncio.sleep(interval_s)
    finally:
        app.state.autopilot_leader = False
        await run_in_threadpool(leadership.release)
