"""Leadership among control-plane replicas: the one process that runs a background task meant to run once.

Two background tasks act on the whole fleet's rollouts and must not run on
every replica sharing a database: the autopilot (it edits policies and starts
canaries) and the guardrail evaluator (a rollback is safe twice, since it
serialises on the policy, but N replicas would look N times per interval,
record N looks and do N times the database work). Each of them is a *role*
with one leader at a time.

On PostgreSQL the leader of a role is the process holding a session-level
advisory lock (``pg_try_advisory_lock``) on a connection of its own, kept open
while it leads. When the process dies its connection closes, PostgreSQL frees
the lock, and another replica takes over at its next round: within one
interval of the role. Each round the leader checks its connection; a broken
one (the database restarted) drops the leadership, to be tried again. On
SQLite the database belongs to one process, which leads every role
(``specgate serve`` runs one).

One lock per role, not one shared by both (``SPECGATE_AUTOPILOT_LOCK_KEY``,
``SPECGATE_GUARDRAIL_LOCK_KEY``): a process competes only for the roles whose
task it runs (an interval of 0 runs none), so a replica that has the autopilot
off can never win a lock and leave the fleet without an autopilot. The first
process to start usually leads both; nothing relies on it, as every change to
a rollout takes its policy's row lock.

The leader's connection never goes back to the pool holding the lock: on any
error it is invalidated (closed for good). Taking the lock, and each round,
hold :attr:`Leadership.turn`; a shutdown releases the lock only after the
round under way has finished, so that no other replica looks at a rollout
this one is still changing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

log = logging.getLogger("specgate.controlplane.leadership")

T = TypeVar("T")

AUTOPILOT = "autopilot"
GUARDRAILS = "guardrails"


class Leadership:
    """Whether this process leads one role (see the module doc)."""

    def __init__(self, engine: Engine, role: str, lock_key: int) -> None:
        self.engine = engine
        self.role = role
        self.lock_key = lock_key
        self.connection: Connection | None = None
        # A cancelled task leaves its thread running: an acquire or a round still under way when the task
        # stops must finish before release() looks at the connection, or the lock would outlive the task.
        self.turn = threading.Lock()

    def acquire(self) -> bool:
        """Keep or take the leadership; False while another process holds it."""
        if self.engine.dialect.name != "postgresql":
            return True
        with self.turn:
            if self.connection is not None:
                try:
                    self.connection.execute(text("SELECT 1"))
                    return True
                except SQLAlchemyError:
                    log.warning("the %s leader's database connection broke: leadership dropped", self.role)
                    self._drop()
            connection = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            try:
                got = bool(connection.execute(text("SELECT pg_try_advisory_lock(:key)"),
                                              {"key": self.lock_key}).scalar())
            except SQLAlchemyError:
                connection.invalidate()
                connection.close()
                raise
            if not got:
                connection.close()
                return False
            self.connection = connection
            log.info("this process leads the %s", self.role)
            return True

    def run(self, round_: Callable[[], T]) -> T:
        """One round of the role's work, which a shutdown waits for before it lets the leadership go."""
        with self.turn:
            return round_()

    def _drop(self) -> None:
        """Forget a connection that may still hold the lock: invalidated, never returned to the pool."""
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.invalidate()
            connection.close()

    def release(self) -> None:
        """Give the leadership up, after the acquire or round under way."""
        with self.turn:
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
            log.info("this process no longer leads the %s", self.role)


def _report(app: Any, role: str, leads: bool, on_change: Callable[[bool], None] | None) -> None:
    metrics = getattr(app.state, "metrics", None)
    if metrics is not None:
        metrics.leader.labels(role).set(1 if leads else 0)
    if on_change is not None:
        on_change(leads)


async def lead(app: Any, role: str, lock_key: int, interval_s: float, round_: Callable[[], object], *,
               first_round_after_interval: bool = False,
               on_change: Callable[[bool], None] | None = None) -> None:
    """Loop until cancelled: every ``interval_s``, keep or take the role's leadership and, leading, run one round.

    An error in a round is logged and the next round runs. ``first_round_after_interval``: the leadership is
    taken at once, the first round runs one interval later. ``on_change`` hears whether this process leads,
    each round; the gauge ``specgate_leader{role}`` says it too.
    """
    leadership = Leadership(app.state.engine, role, lock_key)
    _report(app, role, False, on_change)
    skip = first_round_after_interval
    try:
        while True:
            try:
                leads = await run_in_threadpool(leadership.acquire)
                _report(app, role, leads, on_change)
                if leads and not skip:
                    await run_in_threadpool(leadership.run, round_)
            except Exception:
                _report(app, role, False, on_change)
                log.exception("%s round failed", role)
            skip = False
            await asyncio.sleep(interval_s)
    finally:
        _report(app, role, False, on_change)
        await run_in_threadpool(leadership.release)
