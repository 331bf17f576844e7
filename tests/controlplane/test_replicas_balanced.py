"""Two control-plane processes behind a TCP load balancer on one PostgreSQL (issue 20, "replicas under load").

Clients see one address (``tests/support/balancer.py``, round-robin per
connection): telemetry sent over several connections at once is stored once,
by whichever replica it landed on; long-polls parked on either replica wake
when a policy is published through any; one process leads the autopilot and
one the guardrail evaluator, and when the guardrail leader is killed the other
takes over and rolls back a breaching canary.

PostgreSQL only, like test_replicas.py (SQLite serves one process), except
the check that the one process on SQLite leads both roles, and a look at the
election itself (two leaderships in one process, on PostgreSQL).
"""

from __future__ import annotations

import datetime as dt
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text

from controlplane.app import create_app
from controlplane.db import make_engine
from controlplane.leadership import AUTOPILOT, GUARDRAILS, Leadership
from controlplane.models import AuditEvent, Policy, TelemetryEventRecord
from controlplane.settings import ControlPlaneSettings
from policies import SigningKey
from tests.support.balancer import Balancer, backend_of
from tests.support.e2e import wait_until
from tests.support.factories import seed_policy, seed_text
from tests.support.replicas import (
    LongPoll,
    Replica,
    long_poll_waiters,
    metric,
    register_worker,
    start_replica,
    wait_ready,
)
from tests.support.rollup_check import assert_rollups_equal_raw
from tests.support.telemetry_bodies import event as wire_event
from tests.support.telemetry_data import event, lognormal, policy_text, seed, store

POSTGRESQL = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)

# The background tasks' interval in these processes: a handover is due within one.
INTERVAL_S = 0.5
# BENCHMARKS.md "Policy propagation" and issue 20 set the goal (every worker within 1 s, p99); a test on a
# shared, loaded machine asserts the behaviour with room, the benchmark measures the number.
PROPAGATION_BOUND_S = 5.0
# A handover is due within one interval; the bound leaves room for a loaded machine.
HANDOVER_BOUND_S = 10.0
ROLES = (AUTOPILOT, GUARDRAILS)


@dataclass
class Fleet:
    replicas: list[Replica]
    balancer: Balancer

    @property
    def url(self) -> str:
        return self.balancer.url


@pytest.fixture
def fleet(migrated_url: str, tmp_path: Path) -> Iterator[Fleet]:
    key = SigningKey.generate().private_key_b64()
    env = {"SPECGATE_GUARDRAIL_INTERVAL_S": str(INTERVAL_S), "SPECGATE_AUTOPILOT_INTERVAL_S": str(INTERVAL_S)}
    started: list[Replica] = []
    balancer: Balancer | None = None
    try:
        for name in ("a", "b"):
            started.append(start_replica(name, migrated_url, key, tmp_path, env))
        for replica in started:
            wait_ready(replica)
        balancer = Balancer([backend_of(r.url) for r in started]).start()
        yield Fleet(started, balancer)
    finally:
        if balancer is not None:
            balancer.stop()
        for replica in started:
            if replica.process.poll() is None:
                replica.process.terminate()
        for replica in started:
            replica.stop()


# --- telemetry ---------------------------------------------------------------------------------------------

CONNECTIONS = 6
BATCHES_PER_CONNECTION = 5
EVENTS_PER_BATCH = 40


def _batch(connection: int, index: int) -> dict[str, Any]:
    events = []
    for i in range(EVENTS_PER_BATCH):
        n = f"{connection}-{index}-{i}"
        # Several rollup keys (minute, route, batch size) so that concurrent upserts meet on shared rows.
        events.append(wire_event(n, time=f"2026-12-02T10:0{i % 3}:30Z", route=("chat", "summarize")[i % 2],
                                 batch_size=1 + i % 4, itl_ms=10.0 + i, retries=i % 3 == 0))
    return {"batch_id": f"b-{connection}-{index}", "worker_id": "w-1", "schema_version": 1, "events": events}


@POSTGRESQL
def test_ingest_through_the_balancer_spreads_over_both_and_stores_each_event_once(
        fleet: Fleet, worker_key: dict[str, str], migrated_url: str) -> None:
    seed_policy(migrated_url)  # the events' policy: a worker key's events must name one that serves their pool
    batches = {c: [_batch(c, i) for i in range(BATCHES_PER_CONNECTION)] for c in range(CONNECTIONS)}
    start = threading.Barrier(CONNECTIONS)

    def send(connection: int) -> list[dict[str, Any]]:
        answers = []
        # One client, one kept-alive connection: the balancer chose its replica once, at connect.
        with httpx.Client(base_url=fleet.url, headers=worker_key, timeout=30) as http:
            start.wait(10)
            for body in batches[connection]:
                r = http.post("/v1/telemetry/batches", json=body)
                assert r.status_code == 200, r.text
                answers.append(r.json())
        return answers

    with ThreadPoolExecutor(CONNECTIONS) as pool:
        answers = [a for result in pool.map(send, range(CONNECTIONS)) for a in result]
    sent = CONNECTIONS * BATCHES_PER_CONNECTION * EVENTS_PER_BATCH
    assert sum(a["stored"] for a in answers) == sent, answers[0]
    assert not any(a["duplicate"] for a in answers)

    # The same batches again, each on a new connection (so on the other replica as often as not): recognised,
    # answered as the first time, nothing stored.
    resent = 0
    for connection in range(2):
        for body in batches[connection][:2]:
            r = httpx.post(f"{fleet.url}/v1/telemetry/batches", json=body, headers=worker_key, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["duplicate"] is True
            resent += 1

    counts = fleet.balancer.counts()
    assert all(n > 0 for n in counts.values()), counts
    stored = [metric(r.url, "specgate_telemetry_events_total", outcome="stored") or 0.0 for r in fleet.replicas]
    print(f"connections per replica {list(counts.values())}, events stored per replica {stored}")
    assert all(n > 0 for n in stored), stored
    assert sum(stored) == sent
    assert sum(metric(r.url, "specgate_telemetry_batches_total", outcome="duplicate") or 0.0
               for r in fleet.replicas) == resent

    engine = make_engine(migrated_url)
    try:
        with engine.connect() as conn:
            rows, distinct = conn.execute(select(func.count(), func.count(TelemetryEventRecord.event_id.distinct()))
                                          ).one()
        assert (rows, distinct) == (sent, sent)
        assert assert_rollups_equal_raw(engine) > 0
    finally:
        engine.dispose()


# --- long-polls --------------------------------------------------------------------------------------------

POLLS = 6


@POSTGRESQL
def test_long_polls_on_either_replica_wake_when_a_policy_is_published_through_the_balancer(
        fleet: Fleet, worker_key: dict[str, str], operator: dict[str, str], migrated_url: str) -> None:
    _, (active, draft) = seed_policy(migrated_url, extra_revisions=(seed_text(threshold=6),))
    workers = [f"w-lp-{i}" for i in range(POLLS)]
    etags = {}
    for worker in workers:
        register_worker(fleet.url, worker_key, worker, {})
        r = httpx.get(f"{fleet.url}/v1/bundle", params={"worker": worker}, headers=worker_key, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["payload"]["policy"]["revision"] == active
        etags[worker] = r.json()["etag"]

    # One connection per poll, so the balancer alternates them over the replicas.
    polls = [LongPoll(fleet.url, worker_key, worker, etags[worker], wait=30, parked=False) for worker in workers]
    waiting: list[float] = []

    def all_parked() -> bool:
        waiting[:] = [long_poll_waiters(r.url) for r in fleet.replicas]
        return sum(waiting) == POLLS

    wait_until(all_parked, 15, f"{POLLS} long-polls parked")
    assert all(n >= 1 for n in waiting), waiting  # some on each replica

    published = time.monotonic()
    r = httpx.post(f"{fleet.url}/v1/policies/seed/rollback", json={"revision": draft, "reason": "balanced test"},
                   headers=operator, timeout=10)
    assert r.status_code == 200, r.text
    woke = []
    for worker, poll in zip(workers, polls, strict=True):
        response, done = poll.finish()
        assert response.status_code == 200, response.text
        assert response.json()["etag"] != etags[worker]
        assert response.json()["payload"]["policy"]["revision"] == draft
        woke.append(done - published)
    print(f"long-polls parked per replica {waiting}; woke {min(woke) * 1000:.0f}-{max(woke) * 1000:.0f} ms "
          "after the publish")
    assert max(woke) < PROPAGATION_BOUND_S


# --- leadership --------------------------------------------------------------------------------------------

def _leads(replica: Replica) -> dict[str, float | None]:
    return {role: metric(replica.url, "specgate_leader", role=role) for role in ROLES}


def _one_leader_each(replicas: list[Replica]) -> bool:
    seen = [_leads(r) for r in replicas]
    return all(sorted(s[role] or 0.0 for s in seen) == [0.0, 1.0] for role in ROLES)


@POSTGRESQL
def test_one_leader_per_role_and_a_killed_leader_is_replaced_and_rolls_back_a_breach(
        fleet: Fleet, operator: dict[str, str], migrated_url: str) -> None:
    a, b = fleet.replicas
    wait_until(lambda: _one_leader_each(fleet.replicas), 15, "exactly one leader of each role")
    for _ in range(6):  # and it stays so, round after round
        assert _one_leader_each(fleet.replicas), [_leads(r) for r in fleet.replicas]
        time.sleep(INTERVAL_S)

    leader, survivor = (a, b) if _leads(a)[GUARDRAILS] == 1 else (b, a)
    leader.process.kill()  # no graceful stop: the lock goes with the leader's database connection
    leader.process.wait(10)
    killed = time.monotonic()
    fleet.balancer.remove(backend_of(leader.url))
    took = wait_until(lambda: _leads(survivor) == dict.fromkeys(ROLES, 1.0), HANDOVER_BOUND_S,
                      "the survivor leads both roles")
    print(f"the survivor led {took:.2f} s after the kill ({time.monotonic() - killed:.2f} s; interval {INTERVAL_S} s)")

    # A canary with a breach: +50 % ITL against the baseline, enough requests for the sequential test.
    baseline, candidate = seed(migrated_url, policy_text(), policy_text(threshold=8))
    r = httpx.post(f"{fleet.url}/v1/rollouts", headers=operator, timeout=10,
                   json={"policy": "seed", "revision": candidate, "mode": "traffic", "steps": [10, 50, 100],
                         "reason": "a canary the guardrails should stop"})
    assert r.status_code == 201, r.text
    rollout_id = r.json()["id"]
    now = dt.datetime.now(dt.UTC)
    rng = random.Random(7)
    store(migrated_url, [event(revision=baseline, itl=lognormal(rng, 20.0), time=now) for _ in range(600)]
          + [event(revision=candidate, itl=lognormal(rng, 30.0), time=now) for _ in range(600)])

    def state() -> str:
        got = httpx.get(f"{fleet.url}/v1/rollouts/{rollout_id}", headers=operator, timeout=10)
        assert got.status_code == 200, got.text
        return str(got.json()["state"])

    wait_until(lambda: state() == "rolled_back", 30, "the new leader rolls the canary back", interval=0.2)
    looks = httpx.get(f"{fleet.url}/v1/rollouts/{rollout_id}/guardrails", headers=operator, timeout=10).json()
    newest = looks["evaluations"][0]
    assert (newest["verdict"], newest["action"], newest["evaluated_by"]) == ("breach", "rolled_back",
                                                                            "system:guardrails")
    engine = make_engine(migrated_url)
    try:
        with engine.connect() as conn:
            actors = conn.execute(select(AuditEvent.actor).where(AuditEvent.action == "rollout.auto_rollback")
                                  ).scalars().all()
            active = conn.execute(select(Policy.active_revision_id)).scalar()
    finally:
        engine.dispose()
    assert actors == ["system:guardrails"]  # rolled back once
    assert active == baseline
    assert survivor.process.poll() is None


@POSTGRESQL
def test_a_shutdown_lets_the_leadership_go_after_the_round_under_way(migrated_url: str) -> None:
    engine = make_engine(migrated_url)
    key = 0x5347_7E57
    first, second = Leadership(engine, "test", key), Leadership(engine, "test", key)
    try:
        assert first.acquire()
        assert not second.acquire()
        in_round, finish = threading.Event(), threading.Event()

        def round_() -> str:
            in_round.set()
            assert finish.wait(10)
            return "done"

        rounds = threading.Thread(target=first.run, args=(round_,))
        rounds.start()
        assert in_round.wait(5)
        releasing = threading.Thread(target=first.release)
        releasing.start()
        time.sleep(0.3)
        assert releasing.is_alive()  # waits for the round
        assert not second.acquire()
        finish.set()
        rounds.join(5)
        releasing.join(5)
        assert not releasing.is_alive()
        assert second.acquire()

        # A leader whose connection is cut (the database restarted, an administrator ended it) drops out.
        assert second.connection is not None
        pid = second.connection.execute(text("SELECT pg_backend_pid()")).scalar()
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        wait_until(first.acquire, 5, "the lock freed with the ended connection")
        assert not second.acquire()
        assert second.connection is None
    finally:
        first.release()
        second.release()
        engine.dispose()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_only_process_on_sqlite_leads_both_roles(migrated_url: str) -> None:
    settings = ControlPlaneSettings(database_url=migrated_url, guardrail_interval_s=0.1, autopilot_interval_s=0.1)
    with TestClient(create_app(settings)) as client:
        def leads() -> bool:
            body = client.get("/metrics").text
            return all(f'specgate_leader{{role="{role}"}} 1.0' in body for role in ROLES)

        wait_until(leads, 10, "the one process leads both roles")


def test_settings_refuse_one_lock_for_both_roles() -> None:
    with pytest.raises(ValueError, match="must differ"):
        ControlPlaneSettings(autopilot_lock_key=7, guardrail_lock_key=7)
