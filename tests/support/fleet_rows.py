"""Rows the rollout and kill-switch APIs would write, for tests of what workers are served.

Each change bumps the distribution generation in its transaction, as the real
endpoints do; callers then tell the app's hub, as the endpoints do after commit.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.distribution.publish import bump_generation
from controlplane.models import FleetState, Policy, Rollout, RolloutStep, Worker, utcnow


@contextmanager
def session_for(database_url: str) -> Iterator[Session]:
    engine = make_engine(database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            yield session
    finally:
        engine.dispose()


def add_rollout(database_url: str, policy_id: str, to_revision: str, *, mode: str, percent: float,
                state: str = "running", target_pool: str | None = None,
                target_labels: dict[str, str] | None = None) -> tuple[str, int]:
    """A rollout at its first step; returns its id and the new generation."""
    with session_for(database_url) as session:
        policy = session.get(Policy, policy_id)
        assert policy is not None
        assert policy.active_revision_id is not None
        rollout = Rollout(policy_id=policy_id, from_revision_id=policy.active_revision_id,
                          to_revision_id=to_revision, mode=mode, target_pool=target_pool,
                          target_labels=target_labels or {}, state=state, current_step=0,
                          reason="test", created_by="operator:test")
        session.add(rollout)
        session.flush()
        session.add(RolloutStep(rollout_id=rollout.id, position=0, percent=percent, started_at=utcnow()))
        return rollout.id, bump_generation(session)


def set_rollout(database_url: str, rollout_id: str, **values: Any) -> int:
    with session_for(database_url) as session:
        rollout = session.get(Rollout, rollout_id)
        assert rollout is not None
        for name, value in values.items():
            setattr(rollout, name, value)
        return bump_generation(session)


def add_step(database_url: str, rollout_id: str, position: int, percent: float) -> None:
    with session_for(database_url) as session:
        session.add(RolloutStep(rollout_id=rollout_id, position=position, percent=percent))


def set_kill_switch(database_url: str, enabled: bool) -> int:
    with session_for(database_url) as session:
        state = session.get(FleetState, 1)
        assert state is not None
        state.kill_switch = enabled
        state.kill_switch_reason = "test"
        state.kill_switch_changed_at = utcnow()
        state.kill_switch_changed_by = "operator:test"
        return bump_generation(session)


def age_heartbeat(database_url: str, worker_id: str, seconds: float) -> None:
    with session_for(database_url) as session:
        worker = session.get(Worker, worker_id)
        assert worker is not None
        worker.last_heartbeat_at = utcnow() - dt.timedelta(seconds=seconds)


def register(client: TestClient, key: dict[str, str], worker_id: str, *, pool: str = "pool-a",
             labels: dict[str, str] | None = None, engines: dict[str, str] | None = None) -> dict[str, Any]:
    r = client.post("/v1/workers/register", headers=key, json={
        "id": worker_id, "pool": pool, "labels": labels or {},
        "engines": engines or {"base": "http://127.0.0.1:8000"}, "sidecar_version": "0.1.0"})
    assert r.status_code in (200, 201), r.text
    body: dict[str, Any] = r.json()
    return body
