from __future__ import annotations

import asyncio
import base64
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.errors import Conflict, NotFound
from controlplane.models import AuditEvent, FleetState, Policy, Rollout, RolloutStep
from controlplane.rollout.schemas import RolloutCreate, RolloutMode
from controlplane.rollout.service import (
    GUARDRAIL_ACTOR,
    TRANSITIONS,
    canary_salt,
    rollback_on_guardrail_breach,
    start_rollout,
    worker_in_canary,
)
from controlplane.settings import ControlPlaneSettings
from tests.support.factories import seed_policy, seed_text

Headers = dict[str, str]

# These tests count how many times an action bumped the generation.
pytestmark = pytest.mark.usefixtures("generations_count_changes")


# -- helpers ------------------------------------------------------------------------------------------

class Db:
    """Reads (and, for the guardrail function, writes) the test database directly."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        self.sessions = make_sessionmaker(self.engine)

    def session(self) -> Session:
        return self.sessions()

    def generation(self) -> int:
        with self.sessions() as s:
            return int(s.scalar(select(FleetState.generation).where(FleetState.id == 1)) or 0)

    def active_revision(self, policy_id: str) -> str | None:
        with self.sessions() as s:
            policy = s.get(Policy, policy_id)
            assert policy is not None
            return policy.active_revision_id

    def audit(self, action: str) -> list[AuditEvent]:
        with self.sessions() as s:
            return list(s.scalars(select(AuditEvent).where(AuditEvent.action == action)
                                  .order_by(AuditEvent.id)))

    def steps(self, rollout_id: str) -> list[RolloutStep]:
        with self.sessions() as s:
            return list(s.scalars(select(RolloutStep).where(RolloutStep.rollout_id == rollout_id)
                                  .order_by(RolloutStep.position)))


@pytest.fixture
def db(settings: ControlPlaneSettings) -> Iterator[Db]:
    d = Db(settings.database_url)
    yield d
    d.engine.dispose()


@pytest.fixture
def notified(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """Generations the endpoints hand to the hub after commit.

    On PostgreSQL the LISTEN task also notifies the hub, from the event loop;
    endpoints run in worker threads with no running loop, which tells them apart.
    """
    hub = client.app.state.hub  # type: ignore[attr-defined]
    original = hub.notify
    calls: list[int | None] = []

    def recording(generation: int | None = None) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            calls.append(generation)
        original(generation)

    monkeypatch.setattr(hub, "notify", recording)
    return calls


@pytest.fixture
def seeded(settings: ControlPlaneSettings) -> tuple[str, list[str]]:
    """Policy "seed": revision 0 active, revisions 1 and 2 drafts."""
    return seed_policy(settings.database_url,
                       extra_revisions=(seed_text(threshold=8), seed_text(threshold=16)))


def start(client: TestClient, headers: Headers, revision: str, *, policy: str = "seed",
          steps: list[Any] | None = None, **extra: Any) -> Any:
    body = {"policy": policy, "revision": revision, "mode": "workers", "steps": steps or [10, 50, 100],
            "reason": "canary the higher threshold", **extra}
    return client.post("/v1/rollouts", json=body, headers=headers)


def act(client: TestClient, headers: Headers, rollout_id: str, action: str, reason: str | None = None) -> Any:
    body = None if reason is None else {"reason": reason}
    return client.post(f"/v1/rollouts/{rollout_id}/{action}", json=body, headers=headers)


def error_paths(response: Any) -> set[tuple[str, str]]:
    """The (path, code) of each field error of a 422 problem."""
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    return {(e["path"], e["code"]) for e in response.json()["errors"]}


# -- the happy path ---------------------------------------------------------------------------------

def test_rollout_walks_every_step_and_only_completion_changes_the_active_revision(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]],
        notified: list[int | None]) -> None:
    policy_id, (rev0, rev1, _) = seeded
    gen0 = db.generation()

    r = start(client, operator, rev1, mode="traffic", target={"pool": "gpu-a", "labels": {"zone": "eu"}})
    assert r.status_code == 201, r.text
    ro = r.json()
    assert ro["policy"] == "seed"
    assert ro["policy_id"] == policy_id
    assert (ro["from_revision"], ro["to_revision"]) == (rev0, rev1)
    assert ro["mode"] == "traffic"
    assert ro["target"] == {"pool": "gpu-a", "labels": {"zone": "eu"}}
    assert (ro["state"], ro["current_step"], ro["current_percent"]) == ("running", 0, 10.0)
    assert ro["created_by"] == "operator:olga"
    assert ro["allowed_actions"] == ["promote", "pause", "abort"]
    assert [s["percent"] for s in ro["steps"]] == [10.0, 50.0, 100.0]
    assert [s["position"] for s in ro["steps"]] == [0, 1, 2]
    assert ro["steps"][0]["started_at"] is not None
    assert all(s["started_at"] is None and s["outcome"] is None for s in ro["steps"][1:])
    assert db.generation() == gen0 + 1
    # The hub was woken after commit with the committed generation.
    assert notified == [gen0 + 1]

    r = act(client, operator, ro["id"], "promote", "10% looked fine")
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["current_step"], r.json()["current_percent"]) == ("running", 1, 50.0)
    assert db.active_revision(policy_id) == rev0
    assert db.generation() == gen0 + 2

    r = act(client, operator, ro["id"], "promote")  # no body at all: the reason is optional
    assert (r.json()["state"], r.json()["current_step"], r.json()["current_percent"]) == ("running", 2, 100.0)
    assert db.active_revision(policy_id) == rev0

    r = act(client, operator, ro["id"], "promote", "all good")
    done = r.json()
    assert r.status_code == 200
    assert done["state"] == "completed"
    assert done["allowed_actions"] == []
    assert db.active_revision(policy_id) == rev1
    assert db.generation() == gen0 + 4
    assert notified == [gen0 + 1, gen0 + 2, gen0 + 3, gen0 + 4]
    assert [s["outcome"] for s in done["steps"]] == ["promoted", "promoted", "completed"]
    assert all(s["started_at"] and s["finished_at"] for s in done["steps"])
    # A step starts when the previous one finishes.
    assert done["steps"][1]["started_at"] == done["steps"][0]["finished_at"]

    fetched = client.get(f"/v1/rollouts/{ro['id']}", headers=operator).json()
    assert fetched == done
    completion = db.audit("rollout.promote")[-1]
    assert completion.before == {"state": "running", "current_step": 2, "percent": 100.0,
                                 "active_revision": rev0}
    assert completion.after == {"state": "completed", "current_step": 2, "percent": 100.0,
                                "active_revision": rev1}
    assert completion.reason == "all good"
    assert completion.actor == "operator:olga"


def test_start_is_audited_with_actor_reason_and_target(
        client: TestClient, admin: Headers, db: Db, seeded: tuple[str, list[str]]) -> None:
    _, (rev0, rev1, _) = seeded
    ro = start(client, admin, rev1, steps=[25, 100], target={"labels": {"gpu": "h100"}}).json()
    [event] = db.audit("rollout.start")
    assert event.actor == "admin:alice"
    assert event.target_type == "rollout"
    assert event.target_id == ro["id"]
    assert event.reason == "canary the higher threshold"
    assert event.before == {"active_revision": rev0}
    assert event.after is not None
    assert event.after["to_revision"] == rev1
    assert event.after["steps"] == [25.0, 100.0]
    assert event.after["target"] == {"pool": None, "labels": {"gpu": "h100"}}
    assert event.after["state"] == "running"


# -- pause, resume, abort -----------------------------------------------------------------------------

def test_pause_holds_the_step_and_resume_continues(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]]) -> None:
    _, (_, rev1, _) = seeded
    ro = start(client, operator, rev1).json()
    act(client, operator, ro["id"], "promote")
    gen = db.generation()

    paused = act(client, operator, ro["id"], "pause", "latency spike, investigating")
    assert paused.status_code == 200
    assert (paused.json()["state"], paused.json()["current_step"], paused.json()["current_percent"]) == \
        ("paused", 1, 50.0)
    assert paused.json()["allowed_actions"] == ["resume", "abort"]
    # The step keeps running: a paused rollout keeps its split.
    assert paused.json()["steps"][1]["finished_at"] is None
    assert db.generation() == gen + 1

    refused = act(client, operator, ro["id"], "promote")
    assert refused.status_code == 409
    assert refused.json()["state"] == "paused"
    assert refused.json()["allowed_actions"] == ["resume", "abort"]
    assert act(client, operator, ro["id"], "pause").status_code == 409
    assert db.generation() == gen + 1

    resumed = act(client, operator, ro["id"], "resume", "false alarm")
    assert resumed.status_code == 200
    assert (resumed.json()["state"], resumed.json()["current_step"]) == ("running", 1)
    assert db.generation() == gen + 2
    assert [e.reason for e in db.audit("rollout.pause")] == ["latency spike, investigating"]
    assert db.audit("rollout.resume")[0].after == {"state": "running", "current_step": 1, "percent": 50.0}
    assert act(client, operator, ro["id"], "promote").json()["current_step"] == 2


@pytest.mark.parametrize("pause_first", [False, True])
def test_abort_needs_a_reason_and_keeps_the_active_revision(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]],
        pause_first: bool) -> None:
    policy_id, (rev0, rev1, _) = seeded
    ro = start(client, operator, rev1).json()
    if pause_first:
        act(client, operator, ro["id"], "pause")
    gen = db.generation()

    assert error_paths(client.post(f"/v1/rollouts/{ro['id']}/abort", headers=operator)) == \
        {("reason", "missing")}
    assert error_paths(act(client, operator, ro["id"], "abort", "   ")) == {("reason", "empty")}
    assert error_paths(act(client, operator, ro["id"], "abort", "")) == {("reason", "empty")}
    assert db.generation() == gen

    r = act(client, operator, ro["id"], "abort", "error rate up")
    assert r.status_code == 200
    assert r.json()["state"] == "aborted"
    assert r.json()["steps"][0]["outcome"] == "aborted"
    assert r.json()["steps"][0]["finished_at"] is not None
    assert db.active_revision(policy_id) == rev0
    assert db.generation() == gen + 1
    [event] = db.audit("rollout.abort")
    assert (event.before or {})["state"] == ("paused" if pause_first else "running")
    assert (event.after or {})["state"] == "aborted"
    assert event.reason == "error rate up"

    for action in ("promote", "pause", "resume"):
        refused = act(client, operator, ro["id"], action)
        assert refused.status_code == 409
        assert refused.json()["state"] == "aborted"
        assert refused.json()["allowed_actions"] == []
    # The policy is free for a new rollout.
    assert start(client, operator, rev1).status_code == 201


def test_illegal_transitions_are_409_problems_with_the_state(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]]) -> None:
    _, (_, rev1, _) = seeded
    ro = start(client, operator, rev1, steps=[100]).json()
    gen = db.generation()

    r = act(client, operator, ro["id"], "resume")
    assert r.status_code == 409
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["type"].endswith("/conflict")
    assert problem["state"] == "running"
    assert problem["allowed_actions"] == ["promote", "pause", "abort"]

    assert act(client, operator, ro["id"], "promote").json()["state"] == "completed"
    again = act(client, operator, ro["id"], "promote")
    assert again.status_code == 409
    assert again.json()["state"] == "completed"
    assert again.json()["allowed_actions"] == []
    assert act(client, operator, ro["id"], "abort", "too late").json()["state"] == "completed"
    # Only the single successful promote bumped the generation.
    assert db.generation() == gen + 1
    assert act(client, operator, "nope", "promote").status_code == 404


def test_transition_table_allows_nothing_out_of_terminal_states() -> None:
    terminal = {"completed", "aborted", "rolled_back"}
    assert not [key for key in TRANSITIONS if key[0].value in terminal]
    assert {(s.value, a.value) for s, a in TRANSITIONS} >= {
        ("running", "promote"), ("running", "pause"), ("paused", "resume"),
        ("running", "abort"), ("paused", "abort")}
    assert ("paused", "promote") not in {(s.value, a.value) for s, a in TRANSITIONS}


def test_a_second_open_rollout_of_a_policy_is_409(
        client: TestClient, operator: Headers, db: Db, settings: ControlPlaneSettings,
        seeded: tuple[str, list[str]]) -> None:
    _, (_, rev1, rev2) = seeded
    first = start(client, operator, rev1).json()
    gen = db.generation()
    r = start(client, operator, rev2)
    assert r.status_code == 409
    assert r.json()["rollout"] == first["id"]
    assert r.json()["state"] == "running"
    act(client, operator, first["id"], "pause")
    assert start(client, operator, rev2).json()["state"] == "paused"
    assert db.generation() == gen + 1  # the pause only
    assert len(db.audit("rollout.start")) == 1
    # Another policy is independent.
    _, (_, other1) = seed_policy(settings.database_url, name="other", pool="gpu-b",
                                 extra_revisions=(seed_text("other", threshold=8),))
    assert start(client, operator, other1, policy="other").status_code == 201


# -- validation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("steps", "expected"), [
    ([50, 10], {("steps[1]", "not_increasing"), ("steps[1]", "last_not_100")}),
    ([10, 50], {("steps[1]", "last_not_100")}),
    ([10, 10, 100], {("steps[1]", "not_increasing")}),
    ([0, 100], {("steps[0]", "out_of_range")}),
    ([10, 150], {("steps[1]", "out_of_range")}),
    ([True, 100], {("steps[0]", "wrong_type")}),
    (["10", 100], {("steps[0]", "wrong_type")}),
    ([], {("steps", "empty")}),
    ([*range(1, 21), 100], {("steps", "too_long")}),
])
def test_step_lists_are_validated_with_paths(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]],
        steps: list[Any], expected: set[tuple[str, str]]) -> None:
    _, (_, rev1, _) = seeded
    gen = db.generation()
    body = {"policy": "seed", "revision": rev1, "mode": "workers", "steps": steps, "reason": "x"}
    paths = error_paths(client.post("/v1/rollouts", json=body, headers=operator))
    assert expected <= paths, paths
    assert db.generation() == gen
    assert client.get("/v1/rollouts", headers=operator).json()["items"] == []


def test_twenty_steps_and_fractional_percents_are_accepted(
        client: TestClient, operator: Headers, seeded: tuple[str, list[str]]) -> None:
    _, (_, rev1, _) = seeded
    steps = [0.5, *range(5, 100, 5)]
    steps[-1] = 100
    assert len(steps) == 20
    r = start(client, operator, rev1, steps=steps)
    assert r.status_code == 201, r.text
    assert r.json()["current_percent"] == 0.5


def test_references_and_fields_are_validated_with_paths(
        client: TestClient, operator: Headers, db: Db, settings: ControlPlaneSettings,
        seeded: tuple[str, list[str]]) -> None:
    _, (rev0, rev1, _) = seeded
    _, (other0,) = seed_policy(settings.database_url, name="other", pool="gpu-b")
    gen = db.generation()

    assert error_paths(start(client, operator, "f" * 64)) == {("revision", "not_found")}
    assert error_paths(start(client, operator, rev0)) == {("revision", "already_active")}
    assert error_paths(start(client, operator, other0)) == {("revision", "wrong_policy")}
    assert ("policy", "not_found") in error_paths(start(client, operator, rev1, policy="ghost"))
    assert error_paths(start(client, operator, rev1, reason="")) == {("reason", "empty")}
    assert error_paths(start(client, operator, rev1, reason=" \t")) == {("reason", "empty")}
    assert error_paths(start(client, operator, rev1, mode="dns")) == {("mode", "invalid_value")}
    assert error_paths(start(client, operator, rev1, target={"pool": "x", "color": "red"})) == \
        {("target.color", "unknown_field")}
    # The "other" policy runs on gpu-b only: a canary on gpu-a would reach nobody.
    assert error_paths(start(client, operator, other0, policy="other", target={"pool": "gpu-a"})) == \
        {("target.pool", "pool_mismatch"), ("revision", "already_active")}

    missing = client.post("/v1/rollouts", json={"policy": "seed", "revision": rev1, "mode": "workers",
                                                "steps": [100]}, headers=operator)
    assert error_paths(missing) == {("reason", "missing")}
    # Several faults come back together.
    both = error_paths(start(client, operator, "f" * 64, steps=[50, 10]))
    assert both == {("revision", "not_found"), ("steps[1]", "not_increasing"), ("steps[1]", "last_not_100")}
    assert db.generation() == gen
    assert db.audit("rollout.start") == []


def test_a_policy_without_an_active_revision_cannot_roll_out(
        client: TestClient, operator: Headers, settings: ControlPlaneSettings,
        seeded: tuple[str, list[str]]) -> None:
    policy_id, (_, rev1, _) = seeded
    engine = make_engine(settings.database_url)
    with unit_of_work(make_sessionmaker(engine)) as s:
        policy = s.get(Policy, policy_id)
        assert policy is not None
        policy.active_revision_id = None
    engine.dispose()
    assert error_paths(start(client, operator, rev1)) == {("policy", "no_active_revision")}


def test_nul_bytes_are_422_problems_not_driver_errors(
        client: TestClient, operator: Headers, seeded: tuple[str, list[str]]) -> None:
    _, (rev0, rev1, _) = seeded
    assert error_paths(start(client, operator, rev1, reason="a\x00b")) == \
        {("reason", "invalid_format")}
    assert error_paths(start(client, operator, rev1, target={"labels": {"zone": "eu\x00"}})) == \
        {("target.labels.zone", "invalid_format")}
    assert error_paths(client.get("/v1/rollouts", params={"policy": "seed\x00"}, headers=operator)) == \
        {("policy", "invalid_format")}
    cursor = base64.urlsafe_b64encode(b"2026-01-01T00:00:00+00:00|ab\x00").decode()
    assert error_paths(client.get("/v1/rollouts", params={"cursor": cursor}, headers=operator)) == \
        {("cursor", "invalid_cursor")}
    assert client.get("/v1/rollouts/ab%00", headers=operator).status_code == 422
    assert client.post("/v1/policies/seed%00/rollback", json={"revision": rev0, "reason": "x"},
                       headers=operator).status_code == 422


# -- listing -------------------------------------------------------------------------------------------

def test_list_filters_newest_first_and_paginates(
        client: TestClient, operator: Headers, viewer: Headers, seeded: tuple[str, list[str]]) -> None:
    _, (_, rev1, rev2) = seeded
    ids = []
    for rev in (rev1, rev2, rev1):
        ro = start(client, operator, rev).json()
        ids.append(ro["id"])
        act(client, operator, ro["id"], "abort", "next")
    last = start(client, operator, rev2).json()
    ids.append(last["id"])

    everything = client.get("/v1/rollouts", headers=viewer).json()
    assert [r["id"] for r in everything["items"]] == ids[::-1]
    assert everything["next_cursor"] is None

    running = client.get("/v1/rollouts", params={"state": "running"}, headers=viewer).json()["items"]
    assert [r["id"] for r in running] == [last["id"]]
    aborted = client.get("/v1/rollouts", params={"state": "aborted", "policy": "seed"}, headers=viewer).json()
    assert [r["id"] for r in aborted["items"]] == ids[2::-1]
    assert client.get("/v1/rollouts", params={"policy": "ghost"}, headers=viewer).json()["items"] == []
    assert error_paths(client.get("/v1/rollouts", params={"state": "done"}, headers=viewer)) == \
        {("state", "invalid_value")}

    page1 = client.get("/v1/rollouts", params={"limit": 3}, headers=viewer).json()
    assert [r["id"] for r in page1["items"]] == ids[:0:-1]
    assert page1["next_cursor"]
    page2 = client.get("/v1/rollouts", params={"limit": 3, "cursor": page1["next_cursor"]},
                       headers=viewer).json()
    assert [r["id"] for r in page2["items"]] == ids[:1]
    assert page2["next_cursor"] is None
    assert error_paths(client.get("/v1/rollouts", params={"cursor": "!!"}, headers=viewer)) == \
        {("cursor", "invalid_cursor")}
    assert client.get("/v1/rollouts/unknown", headers=viewer).status_code == 404


# -- rollback ------------------------------------------------------------------------------------------

def test_rollback_to_an_earlier_revision(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]]) -> None:
    policy_id, (rev0, rev1, _) = seeded
    ro = start(client, operator, rev1, steps=[100]).json()
    act(client, operator, ro["id"], "promote")
    assert db.active_revision(policy_id) == rev1
    gen = db.generation()

    r = client.post("/v1/policies/seed/rollback", json={"revision": rev0, "reason": "rev1 regressed p99"},
                    headers=operator)
    assert r.status_code == 200, r.text
    assert r.json() == {"policy": "seed", "previous_revision": rev1, "active_revision": rev0,
                        "ended_rollout": None}
    assert db.active_revision(policy_id) == rev0
    assert db.generation() == gen + 1
    [event] = db.audit("policy.rollback")
    assert event.actor == "operator:olga"
    assert (event.target_type, event.target_id) == ("policy", "seed")
    assert event.before == {"active_revision": rev1}
    assert event.after == {"active_revision": rev0, "ended_rollout": None}
    assert event.reason == "rev1 regressed p99"
    # The completed rollout stays completed: a rollback ends only open rollouts.
    assert client.get(f"/v1/rollouts/{ro['id']}", headers=operator).json()["state"] == "completed"

    again = client.post("/v1/policies/seed/rollback", json={"revision": rev0, "reason": "again"},
                        headers=operator)
    assert again.status_code == 409
    assert again.json()["active_revision"] == rev0
    assert db.generation() == gen + 1


def test_rollback_ends_an_open_rollout_as_rolled_back(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]]) -> None:
    policy_id, (_, rev1, rev2) = seeded
    ro = start(client, operator, rev1).json()
    act(client, operator, ro["id"], "promote")
    gen = db.generation()

    r = client.post("/v1/policies/seed/rollback", json={"revision": rev2, "reason": "hotfix"},
                    headers=operator)
    assert r.status_code == 200, r.text
    ended = r.json()["ended_rollout"]
    assert ended["id"] == ro["id"]
    assert ended["state"] == "rolled_back"
    assert [s["outcome"] for s in ended["steps"]] == ["promoted", "rolled_back", None]
    assert ended["allowed_actions"] == []
    assert db.active_revision(policy_id) == rev2
    assert db.generation() == gen + 1  # one change, one bump
    [event] = db.audit("policy.rollback")
    assert event.after == {"active_revision": rev2, "ended_rollout": ro["id"]}
    [rollout_event] = db.audit("rollout.rollback")
    assert rollout_event.target_id == ro["id"]
    assert (rollout_event.after or {})["state"] == "rolled_back"

    refused = act(client, operator, ro["id"], "resume")
    assert refused.status_code == 409
    assert refused.json()["state"] == "rolled_back"
    assert start(client, operator, rev1).status_code == 201


def test_rollback_errors(client: TestClient, operator: Headers, db: Db, settings: ControlPlaneSettings,
                         seeded: tuple[str, list[str]]) -> None:
    _, (rev0, rev1, _) = seeded
    _, (other0,) = seed_policy(settings.database_url, name="other", pool="gpu-b")
    ro = start(client, operator, rev1).json()
    gen = db.generation()

    def rollback(name: str, body: dict[str, Any]) -> Any:
        return client.post(f"/v1/policies/{name}/rollback", json=body, headers=operator)

    assert rollback("ghost", {"revision": rev0, "reason": "x"}).status_code == 404
    assert rollback("seed", {"revision": "f" * 64, "reason": "x"}).status_code == 404
    assert error_paths(rollback("seed", {"revision": other0, "reason": "x"})) == \
        {("revision", "wrong_policy")}
    assert error_paths(rollback("seed", {"revision": rev1})) == {("reason", "missing")}
    assert rollback("seed", {"revision": rev0, "reason": "x"}).status_code == 409
    assert db.generation() == gen
    # None of the refusals touched the open rollout.
    assert client.get(f"/v1/rollouts/{ro['id']}", headers=operator).json()["state"] == "running"


# -- automatic rollback --------------------------------------------------------------------------------

def test_guardrail_breach_rolls_back_and_keeps_the_from_revision(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]]) -> None:
    policy_id, (rev0, rev1, _) = seeded
    ro = start(client, operator, rev1).json()
    act(client, operator, ro["id"], "pause")
    gen = db.generation()
    evidence = {"metric": "ttft_p99_ms", "canary": 412.0, "baseline": 180.0, "window_s": 300}

    with unit_of_work(db.sessions) as session:
        rolled = rollback_on_guardrail_breach(session, ro["id"], "p99 TTFT doubled", evidence)
        assert rolled.state == "rolled_back"

    assert db.active_revision(policy_id) == rev0
    assert db.generation() == gen + 1
    assert db.steps(ro["id"])[0].outcome == "rolled_back"
    [event] = db.audit("rollout.auto_rollback")
    assert event.actor == GUARDRAIL_ACTOR == "system:guardrails"
    assert event.target_id == ro["id"]
    assert event.reason == "p99 TTFT doubled"
    assert (event.before or {})["state"] == "paused"
    assert event.after is not None
    assert event.after["state"] == "rolled_back"
    assert event.after["evidence"] == evidence
    assert event.after["active_revision"] == rev0
    fetched = client.get(f"/v1/rollouts/{ro['id']}", headers=operator).json()
    assert fetched["state"] == "rolled_back"

    # A late second breach report finds nothing to roll back; nothing changes.
    with pytest.raises(Conflict) as late, unit_of_work(db.sessions) as session:
        rollback_on_guardrail_breach(session, ro["id"], "again", evidence)
    assert late.value.extra["state"] == "rolled_back"
    with pytest.raises(NotFound), unit_of_work(db.sessions) as session:
        rollback_on_guardrail_breach(session, "missing", "x", {})
    assert db.generation() == gen + 1
    assert len(db.audit("rollout.auto_rollback")) == 1


# -- kill switch ---------------------------------------------------------------------------------------

def test_kill_switch_on_off_and_no_op(client: TestClient, operator: Headers, viewer: Headers, db: Db,
                                     notified: list[int | None]) -> None:
    initial = client.get("/v1/killswitch", headers=viewer)
    assert initial.status_code == 200
    assert initial.json() == {"enabled": False, "reason": "", "changed_at": None, "changed_by": None}
    gen = db.generation()

    on = client.put("/v1/killswitch", json={"enabled": True, "reason": "incident 42"}, headers=operator)
    assert on.status_code == 200
    assert on.json()["enabled"] is True
    assert on.json()["changed"] is True
    assert on.json()["changed_by"] == "operator:olga"
    assert on.json()["changed_at"] is not None
    assert db.generation() == gen + 1
    assert notified == [gen + 1]

    same = client.put("/v1/killswitch", json={"enabled": True, "reason": "still bad"}, headers=operator)
    assert same.status_code == 200
    assert same.json()["changed"] is False
    assert same.json()["enabled"] is True
    assert same.json()["reason"] == "incident 42"
    assert same.json()["changed_at"] == on.json()["changed_at"]
    assert db.generation() == gen + 1
    assert notified == [gen + 1]

    assert client.get("/v1/killswitch", headers=viewer).json() == {
        k: v for k, v in on.json().items() if k != "changed"}

    off = client.put("/v1/killswitch", json={"enabled": False, "reason": "resolved"}, headers=operator)
    assert off.json()["enabled"] is False
    assert off.json()["changed"] is True
    assert db.generation() == gen + 2
    assert notified == [gen + 1, gen + 2]

    [on_event] = db.audit("killswitch.on")
    assert on_event.actor == "operator:olga"
    assert on_event.before == {"enabled": False, "reason": ""}
    assert on_event.after == {"enabled": True, "reason": "incident 42"}
    assert on_event.reason == "incident 42"
    [off_event] = db.audit("killswitch.off")
    assert off_event.before == {"enabled": True, "reason": "incident 42"}
    assert off_event.reason == "resolved"


def test_kill_switch_body_is_validated(client: TestClient, operator: Headers, db: Db) -> None:
    gen = db.generation()
    put = client.put
    assert error_paths(put("/v1/killswitch", json={"enabled": True}, headers=operator)) == \
        {("reason", "missing")}
    assert error_paths(put("/v1/killswitch", json={"enabled": True, "reason": " "}, headers=operator)) == \
        {("reason", "empty")}
    assert error_paths(put("/v1/killswitch", json={"enabled": "yes", "reason": "x"}, headers=operator)) == \
        {("enabled", "wrong_type")}
    assert db.generation() == gen
    assert client.get("/v1/killswitch", headers=operator).json()["enabled"] is False


# -- scopes --------------------------------------------------------------------------------------------

def test_viewers_read_workers_do_nothing_here(
        client: TestClient, operator: Headers, viewer: Headers, worker_key: Headers, db: Db,
        seeded: tuple[str, list[str]]) -> None:
    _, (rev0, rev1, _) = seeded
    ro = start(client, operator, rev1).json()
    gen = db.generation()
    start_body = {"policy": "seed", "revision": rev1, "mode": "workers", "steps": [100], "reason": "x"}
    changes = [
        ("POST", "/v1/rollouts", start_body),
        ("POST", f"/v1/rollouts/{ro['id']}/promote", {}),
        ("POST", f"/v1/rollouts/{ro['id']}/pause", {}),
        ("POST", f"/v1/rollouts/{ro['id']}/resume", {}),
        ("POST", f"/v1/rollouts/{ro['id']}/abort", {"reason": "x"}),
        ("POST", "/v1/policies/seed/rollback", {"revision": rev0, "reason": "x"}),
        ("PUT", "/v1/killswitch", {"enabled": True, "reason": "x"}),
    ]
    reads = ["/v1/rollouts", f"/v1/rollouts/{ro['id']}", "/v1/killswitch"]
    for method, url, body in changes:
        assert client.request(method, url, json=body, headers=viewer).status_code == 403, url
        assert client.request(method, url, json=body, headers=worker_key).status_code == 403, url
        assert client.request(method, url, json=body).status_code == 401, url
    for url in reads:
        assert client.get(url, headers=viewer).status_code == 200, url
        assert client.get(url, headers=worker_key).status_code == 403, url
    assert db.generation() == gen
    assert client.get(f"/v1/rollouts/{ro['id']}", headers=viewer).json()["state"] == "running"


# -- cohorts -------------------------------------------------------------------------------------------

def test_worker_in_canary_is_sticky_monotonic_and_near_the_percent() -> None:
    workers = [f"worker-{i:04d}" for i in range(2000)]
    rollout_id = "0123456789abcdef0123456789abcdef"
    secret = "ab" * 32
    assert canary_salt(rollout_id, cohort_secret=secret) != canary_salt(rollout_id, cohort_secret="cd" * 32)
    n = len(workers)
    cohorts = {}
    for percent in (1, 10, 50, 90):
        cohort = {w for w in workers if worker_in_canary(w, rollout_id, percent, cohort_secret=secret)}
        p = percent / 100
        # 5 standard deviations: a correct hash fails this about once in 3.5 million runs.
        bound = 5 * math.sqrt(n * p * (1 - p))
        assert abs(len(cohort) - n * p) <= bound, (percent, len(cohort))
        cohorts[percent] = cohort
    assert cohorts[10] <= cohorts[50] <= cohorts[90]
    assert cohorts[1] <= cohorts[10]
    assert not any(worker_in_canary(w, rollout_id, 0, cohort_secret=secret) for w in workers)
    assert all(worker_in_canary(w, rollout_id, 100, cohort_secret=secret) for w in workers)
    # Sticky per rollout, independent across rollouts.
    assert cohorts[50] == {w for w in workers if worker_in_canary(w, rollout_id, 50, cohort_secret=secret)}
    other = {w for w in workers if worker_in_canary(w, "another-rollout", 50, cohort_secret=secret)}
    assert other != cohorts[50]
    overlap = len(other & cohorts[50])
    assert abs(overlap - n * 0.25) <= 5 * math.sqrt(n * 0.25 * 0.75)


# -- concurrency ---------------------------------------------------------------------------------------

def _second_waits_on_the_policy_lock(db: Db, first: Callable[[Session], Any],
                                     second: Callable[[Session], Any]) -> Any:
    """Run ``first`` in a transaction that holds the policy lock, ``second`` meanwhile in another thread, which
    must wait until the first commits; what ``second`` returned or raised."""
    outcome: list[Any] = []

    def run_second() -> None:
        try:
            with unit_of_work(db.sessions) as session:
                outcome.append(second(session))
        except BaseException as exc:
            outcome.append(exc)

    with unit_of_work(db.sessions) as session:
        first(session)
        thread = threading.Thread(target=run_second)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()
    thread.join(30)
    assert not thread.is_alive()
    [result] = outcome
    return result


def test_concurrent_starts_of_one_policy_serialise_and_the_second_gets_409(
        db: Db, seeded: tuple[str, list[str]]) -> None:
    _, (_, rev1, rev2) = seeded
    winner: list[str] = []

    def first(session: Session) -> None:
        rollout, _ = start_rollout(session, RolloutCreate(
            policy="seed", revision=rev1, mode=RolloutMode.workers, steps=[50, 100], reason="a"),
            actor="operator:a")
        winner.append(rollout.id)

    def second(session: Session) -> str:
        rollout, _ = start_rollout(session, RolloutCreate(
            policy="seed", revision=rev2, mode=RolloutMode.workers, steps=[100], reason="b"),
            actor="operator:b")
        return rollout.id

    result = _second_waits_on_the_policy_lock(db, first, second)
    assert isinstance(result, Conflict), result
    assert result.extra == {"state": "running", "rollout": winner[0]}
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Rollout).where(Rollout.state == "running")) == 1


# -- promote with an expected step (compare-and-set under the policy lock) ------------------------------

def test_two_promotes_of_the_same_step_move_the_rollout_once(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]]) -> None:
    _, (_, rev1, _) = seeded
    ro = start(client, operator, rev1).json()
    gen = db.generation()
    promote = f"/v1/rollouts/{ro['id']}/promote"

    first = client.post(promote, json={"reason": "10% looked fine", "expected_step": 0}, headers=operator)
    second = client.post(promote, json={"reason": "10% looked fine", "expected_step": 0}, headers=operator)
    assert first.status_code == 200, first.text
    assert first.json()["current_step"] == 1
    assert second.status_code == 409, second.text
    assert second.headers["content-type"] == "application/problem+json"
    problem = second.json()
    assert (problem["current_step"], problem["state"]) == (1, "running")
    assert [(e["path"], e["code"]) for e in problem["errors"]] == [("expected_step", "stale")]
    assert [s.outcome for s in db.steps(ro["id"])] == ["promoted", None, None]
    assert db.generation() == gen + 1
    assert len(db.audit("rollout.promote")) == 1

    # The step it names is promoted; without one, whatever is current (as before).
    assert client.post(promote, json={"expected_step": 1}, headers=operator).json()["current_step"] == 2
    assert client.post(promote, headers=operator).json()["state"] == "completed"
    bad = client.post(promote, json={"expected_step": "1"}, headers=operator)
    assert error_paths(bad) == {("expected_step", "wrong_type")}


def test_concurrent_promotes_of_one_step_serialise_and_the_second_is_stale(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]]) -> None:
    from controlplane.rollout.schemas import RolloutAction
    from controlplane.rollout.service import StaleStep, apply_action

    _, (_, rev1, _) = seeded
    ro = start(client, operator, rev1).json()

    def promote_as(actor: str) -> Callable[[Session], int]:
        def promote(session: Session) -> int:
            rollout, _ = apply_action(session, ro["id"], RolloutAction.promote, actor=f"operator:{actor}",
                                      reason=actor, expected_step=0)
            return rollout.current_step
        return promote

    def first(session: Session) -> None:
        assert promote_as("a")(session) == 1

    result = _second_waits_on_the_policy_lock(db, first, promote_as("b"))
    assert isinstance(result, StaleStep), result
    assert result.extra == {"state": "running", "current_step": 1}
    assert [s.outcome for s in db.steps(ro["id"])] == ["promoted", None, None]


def test_a_guardrail_look_promotes_only_the_step_it_evaluated(
        client: TestClient, operator: Headers, db: Db, seeded: tuple[str, list[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime as dt

    from analysis.guardrails import StepEvaluation
    from controlplane.rollout import guardrails

    _, (_, rev1, _) = seeded
    ro = start(client, operator, rev1).json()

    def operator_promotes_meanwhile(*_: Any, **__: Any) -> StepEvaluation:
        # Between the look's read of step 0 and its promote, an operator promotes step 0 to step 1.
        r = client.post(f"/v1/rollouts/{ro['id']}/promote", json={"reason": "by hand"}, headers=operator)
        assert r.json()["current_step"] == 1, r.text
        return StepEvaluation("pass", [], 500, 500, 0.05)

    monkeypatch.setattr(guardrails, "evaluate_step", operator_promotes_meanwhile)
    with unit_of_work(db.sessions) as session:
        outcome = guardrails.evaluate_guardrails(session, ro["id"], actor=GUARDRAIL_ACTOR,
                                                 now=dt.datetime.now(dt.UTC), alpha=0.05, auto_promote=True,
                                                 worker_stale_after_s=30)
        assert (outcome.evaluation.step, outcome.evaluation.action) == (0, "none")
        assert outcome.generation is None
    # Step 1 (50 %) was not skipped: it waits for a look of its own.
    got = client.get(f"/v1/rollouts/{ro['id']}", headers=operator).json()
    assert (got["state"], got["current_step"]) == ("running", 1)
    assert [s["outcome"] for s in got["steps"]] == ["promoted", None, None]
    assert [e.actor for e in db.audit("rollout.promote")] == ["operator:olga"]
