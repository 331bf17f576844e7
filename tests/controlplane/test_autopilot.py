"""The autopilot: its API, and its state machine on synthetic telemetry, on both databases (issue 21)."""

from __future__ import annotations

import datetime as dt
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from controlplane.autopilot import service as autopilot_service
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.models import AuditEvent, Autopilot, AutopilotEvent, Policy, Revision, Rollout, utcnow
from controlplane.rollout.service import fleet_cohort_secret, set_kill_switch
from controlplane.settings import ControlPlaneSettings
from policies import sticky_fraction
from policies.evaluate import exploration_salt
from tests.support.factories import seed_policy
from tests.support.fleet_rows import register
from tests.support.telemetry_data import event, store

Headers = dict[str, str]

# Always speculative, exploring whole one-minute windows on the plain engine half of the time.
ALWAYS_SPECULATIVE = """\
apiVersion: specgate/v1
name: seed
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
default: {engine: draft}
exploration: {rate: 0.5, speculative_engine: draft, window_s: 60}
guardrails: {max_p95_itl_regression: 0.25, max_retry_rate_increase: 0.05, min_samples: 40}
"""

SETTING = {"enabled": True, "min_confidence": "medium", "steps": [50, 100], "hold_s": 60, "min_samples": 40,
           "max_changes_per_day": 4}


class Db:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self.sessions = make_sessionmaker(self.engine)

    def look(self, policy_id: str, now: dt.datetime, *, worker_stale_after_s: float = 30) -> int | None:
        with unit_of_work(self.sessions) as session:
            return autopilot_service.look(session, policy_id, now=now, alpha=0.05,
                                          worker_stale_after_s=worker_stale_after_s)

    def autopilot(self, policy_id: str) -> Autopilot:
        with self.sessions() as session:
            ap = session.get(Autopilot, policy_id)
            assert ap is not None
            return ap

    def events(self, policy_id: str) -> list[AutopilotEvent]:
        with self.sessions() as session:
            return list(session.scalars(select(AutopilotEvent).where(AutopilotEvent.policy_id == policy_id)
                                        .order_by(AutopilotEvent.id)))

    def rollout(self, rollout_id: str) -> Rollout:
        with self.sessions() as session:
            rollout = session.get(Rollout, rollout_id)
            assert rollout is not None
            return rollout

    def policy(self, policy_id: str) -> Policy:
        with self.sessions() as session:
            policy = session.get(Policy, policy_id)
            assert policy is not None
            return policy

    def revision(self, revision_id: str) -> Revision:
        with self.sessions() as session:
            revision = session.get(Revision, revision_id)
            assert revision is not None
            return revision

    def audit(self, prefix: str) -> list[AuditEvent]:
        with self.sessions() as session:
            return list(session.scalars(select(AuditEvent).where(AuditEvent.action.startswith(prefix))
                                        .order_by(AuditEvent.id)))

    def session(self) -> Session:
        return self.sessions()


@pytest.fixture
def db(settings: ControlPlaneSettings) -> Iterator[Db]:
    d = Db(settings.database_url)
    yield d
    d.engine.dispose()


@pytest.fixture
def policy(settings: ControlPlaneSettings, client: TestClient, db: Db) -> tuple[str, str]:
    """Policy ``seed`` (always speculative, switchback windows), created two hours ago; (id, revision)."""
    policy_id, (rid,) = seed_policy(settings.database_url, ALWAYS_SPECULATIVE)
    with unit_of_work(db.sessions) as session:
        session.execute(update(Policy).where(Policy.id == policy_id)
                        .values(created_at=utcnow() - dt.timedelta(hours=2)))
    return policy_id, rid


def _e2e(rng: random.Random, median: float, sigma: float = 0.15) -> float:
    """An ITL whose event's e2e (50 + 100 ITL ms) is lognormal around ``median``."""
    return max(0.5, (median * math.exp(rng.gauss(0, sigma)) - 50) / 100)


def switchback_window(db: Db, rid: str, *, end: dt.datetime, minutes: int = 40, per_minute: int = 24,
                      speculative_ms: float = 900.0, plain_ms: float = 500.0, seed: int = 1,
                      sigma: float = 0.15) -> None:
    """``minutes`` of the always-speculative revision before ``end``: explored windows ran plain."""
    with db.session() as session:
        salt = exploration_salt("seed", fleet_cohort_secret(session))
    rng = random.Random(seed)
    events = []
    first = end.replace(second=0, microsecond=0) - dt.timedelta(minutes=minutes)
    for m in range(minutes):
        start = first + dt.timedelta(minutes=m)
        explored = sticky_fraction(f"window:{math.floor(start.timestamp() / 60)}", salt) < 0.5
        for i in range(per_minute):
            when = start + dt.timedelta(seconds=(i + 0.5) * 60 / per_minute)
            median = plain_ms if explored else speculative_ms
            events.append(event(revision=rid, speculate=not explored, explored=explored,
                                itl=_e2e(rng, median, sigma), time=when))
    store(db.url, events)


def canary_traffic(db: Db, rollout: Rollout, *, baseline_ms: float, canary_ms: float, n: int = 60,
                   seed: int = 2, baseline: bool = True, at: dt.datetime | None = None) -> None:
    """Requests of both revisions of a traffic rollout, stamped from now (or ``at``) on, so inside its current
    step: the guardrails read the step's cohorts from the minute it started, and a step started just after a
    minute turned would leave out requests stamped before it (one run did, at 06:24:00.035)."""
    rng = random.Random(seed)
    now = at or utcnow()
    events = []
    for i in range(n):
        when = now + dt.timedelta(milliseconds=10 * i)
        if baseline:
            events.append(event(revision=rollout.from_revision_id, speculate=True, itl=_e2e(rng, baseline_ms),
                                time=when))
        events.append(event(revision=rollout.to_revision_id, speculate=False, itl=_e2e(rng, canary_ms), time=when))
    store(db.url, events)


def enable(client: TestClient, admin: Headers, **overrides: Any) -> Any:
    response = client.put("/v1/policies/seed/autopilot", json={**SETTING, **overrides}, headers=admin)
    assert response.status_code == 200, response.text
    return response.json()


def rolled_back_once(client: TestClient, admin: Headers, db: Db, policy: tuple[str, str], **setting: Any) -> None:
    """The autopilot starts stopping speculation, and its canary regresses: the guardrails roll it back."""
    policy_id, rid = policy
    now = utcnow()
    switchback_window(db, rid, end=now)
    enable(client, admin, **setting)
    rollout = started(db, policy_id, now)
    canary_traffic(db, rollout, baseline_ms=400, canary_ms=1600, n=120)
    assert db.look(policy_id, utcnow() + dt.timedelta(seconds=61)) is not None
    assert db.rollout(rollout.id).state == "rolled_back"


def started(db: Db, policy_id: str, now: dt.datetime) -> Rollout:
    """Look once, expecting the autopilot to start a rollout; that rollout."""
    assert db.look(policy_id, now) is not None
    ap = db.autopilot(policy_id)
    assert ap.rollout_id is not None, ap.status_detail
    return db.rollout(ap.rollout_id)


# --- the API ------------------------------------------------------------------------------------------

def test_put_and_get_with_history_and_roles(client: TestClient, admin: Headers, operator: Headers,
                                            viewer: Headers, worker_key: Headers, policy: tuple[str, str]) -> None:
    fresh = client.get("/v1/policies/seed/autopilot", headers=viewer)
    assert fresh.status_code == 200
    assert fresh.json()["enabled"] is False
    assert fresh.json()["status"] == "off"
    assert fresh.json()["min_confidence"] == "high"  # what an enable without it would use
    assert fresh.json()["history"] == []
    for headers, code in ((operator, 403), (viewer, 403), (worker_key, 403)):
        assert client.put("/v1/policies/seed/autopilot", json=SETTING, headers=headers).status_code == code
    body = enable(client, admin)
    assert body["enabled"] is True
    assert body["status"] == "idle"
    assert body["steps"] == [50, 100]
    assert body["kinds"][0] == "stop_speculating"
    assert body["leader"] is None  # the test app runs no autopilot loop
    assert [e["action"] for e in body["history"]] == ["enabled"]
    off = client.put("/v1/policies/seed/autopilot", json={**SETTING, "enabled": False}, headers=admin).json()
    assert off["status"] == "off"
    assert [e["action"] for e in off["history"]] == ["disabled", "enabled"]
    assert off["history"][0]["detail"]["before"]["enabled"] is True
    assert client.get("/v1/policies/nope/autopilot", headers=viewer).status_code == 404
    assert client.put("/v1/policies/nope/autopilot", json=SETTING, headers=admin).status_code == 404


def test_bad_settings_are_422_problems_naming_the_field(client: TestClient, admin: Headers,
                                                       policy: tuple[str, str]) -> None:
    cases = [({"steps": [50, 20, 100]}, "steps[1]"), ({"steps": [10, 50]}, "steps[1]"), ({"hold_s": 1}, "hold_s"),
             ({"min_confidence": "certain"}, "min_confidence"), ({"kinds": ["rewrite_everything"]}, "kinds[0]"),
             ({"max_changes_per_day": -1}, "max_changes_per_day"), ({"enabled": "yes"}, "enabled"),
             ({"surprise": 1}, "surprise"), ({"min_samples": 0}, "min_samples")]
    for override, path in cases:
        response = client.put("/v1/policies/seed/autopilot", json={**SETTING, **override}, headers=admin)
        assert response.status_code == 422, (override, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        assert path in {e["path"] for e in response.json()["errors"]}, (override, response.json())
    missing = client.put("/v1/policies/seed/autopilot", json={"hold_s": 60}, headers=admin)
    assert missing.status_code == 422
    assert "enabled" in {e["path"] for e in missing.json()["errors"]}


# --- the state machine -----------------------------------------------------------------------------------

def test_happy_path_stops_speculating_rolls_out_and_completes(client: TestClient, admin: Headers, db: Db,
                                                              policy: tuple[str, str]) -> None:
    policy_id, rid = policy
    now = utcnow()
    switchback_window(db, rid, end=now)
    enable(client, admin)
    rollout = started(db, policy_id, now)
    assert rollout.mode == "traffic"
    assert rollout.created_by == "system:autopilot"
    draft = db.revision(rollout.to_revision_id)
    assert draft.author == "system:autopilot"
    assert draft.document["rules"] == []
    assert draft.document["default"] == {"engine": "base"}
    assert "stop_speculating" in draft.message
    assert "measure e2e" in draft.message
    assert db.policy(policy_id).active_revision_id == rid  # a draft: nothing changes before the rollout ends
    first = db.events(policy_id)[-1]
    assert first.action == "started"
    assert first.detail["switchback"]["verdict"] == "explored better"
    assert first.detail["recommendation"]["measure"] == "e2e"

    # Held: a look before hold_s promotes nothing, whatever the traffic.
    canary_traffic(db, rollout, baseline_ms=600, canary_ms=600)
    assert db.look(policy_id, utcnow()) is None
    assert db.rollout(rollout.id).current_step == 0
    assert "held" in db.autopilot(policy_id).status_detail
    # After hold_s with min_samples per cohort and no breach: promoted to 100 %, then completed.
    assert db.look(policy_id, utcnow() + dt.timedelta(seconds=61)) is not None
    assert db.rollout(rollout.id).current_step == 1
    canary_traffic(db, rollout, baseline_ms=600, canary_ms=600, baseline=False, seed=3)
    assert db.look(policy_id, utcnow() + dt.timedelta(seconds=30)) is None  # the step started just now
    assert db.look(policy_id, utcnow() + dt.timedelta(seconds=61)) is not None
    assert db.rollout(rollout.id).state == "completed"
    assert db.policy(policy_id).active_revision_id == rollout.to_revision_id
    assert [e.action for e in db.events(policy_id)] == ["enabled", "started", "promoted", "completed"]
    assert db.autopilot(policy_id).rollout_id is None
    audited = [a.action for a in db.audit("autopilot.")]
    assert audited == ["autopilot.enabled", "autopilot.started", "autopilot.promoted", "autopilot.completed"]
    # The new revision has just become active: the next look gathers evidence first.
    assert db.look(policy_id, utcnow() + dt.timedelta(seconds=30)) is None
    assert db.autopilot(policy_id).status == "waiting"
    assert "evidence is gathered" in db.autopilot(policy_id).status_detail


def test_a_breach_rolls_back_with_its_evidence(client: TestClient, admin: Headers, db: Db,
                                              policy: tuple[str, str]) -> None:
    policy_id, rid = policy
    now = utcnow()
    switchback_window(db, rid, end=now)
    enable(client, admin)
    rollout = started(db, policy_id, now)
    canary_traffic(db, rollout, baseline_ms=400, canary_ms=1600, n=120)
    assert db.look(policy_id, utcnow() + dt.timedelta(seconds=61)) is not None
    assert db.rollout(rollout.id).state == "rolled_back"
    assert db.policy(policy_id).active_revision_id == rid
    last = db.events(policy_id)[-1]
    assert last.action == "rolled_back"
    checks = {c["guardrail"]: c for c in last.detail["guardrails"]["checks"]}
    assert checks["p95_e2e_regression"]["status"] == "breach"  # what clients feel, checked first
    assert db.audit("rollout.auto_rollback")
    assert db.audit("autopilot.rolled_back")[-1].after["guardrails"]["verdict"] == "breach"
    assert db.autopilot(policy_id).rollout_id is None


def test_a_workers_step_waits_for_its_canarys_engines_and_is_held_from_when_they_serve(
        client: TestClient, admin: Headers, worker_key: Headers, db: Db, policy: tuple[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    policy_id, rid = policy
    now = utcnow()
    switchback_window(db, rid, end=now)
    enable(client, admin)
    rollout = started(db, policy_id, now)
    # A workers-mode step (the autopilot starts traffic ones today; the gate is the rollout's, whoever runs it).
    with unit_of_work(db.sessions) as session:
        session.execute(update(Rollout).where(Rollout.id == rollout.id).values(mode="workers"))
    register(client, worker_key, "w-1")

    def beat(state: str, revision: str, config_hash: str) -> None:
        r = client.post("/v1/workers/w-1/heartbeat", headers=worker_key, json={
            "active_revision": rollout.to_revision_id, "supervised_engines": [
                {"engine": "draft", "state": state, "config_hash": config_hash, "revision": revision}]})
        assert r.status_code == 200, r.text

    beat("restarting", rollout.to_revision_id, "0b0b")
    # Past hold_s with min_samples per cohort and no breach (what the happy path promotes): its engine restarts.
    canary_traffic(db, rollout, baseline_ms=600, canary_ms=600)
    stale_after = 3600  # the looks below are in the future; the worker stays live for them
    assert db.look(policy_id, utcnow() + dt.timedelta(seconds=61), worker_stale_after_s=stale_after) is None
    assert db.rollout(rollout.id).current_step == 0
    ap = db.autopilot(policy_id)
    assert ap.status == "rolling_out"
    assert "waiting for the canary's engines" in ap.status_detail
    assert "worker w-1: engine draft restarting" in ap.status_detail

    # Serving the revision's arguments from then on (the control plane's clock, set apart from the minute of
    # the requests above): held hold_s from the next whole minute, whose requests only count.
    came_up = utcnow().replace(second=20, microsecond=0) + dt.timedelta(minutes=1)
    monkeypatch.setattr("controlplane.worker.service.utcnow", lambda: came_up)
    beat("serving", rollout.to_revision_id, "0b0b")
    judged_from = came_up.replace(second=0) + dt.timedelta(minutes=1)
    assert db.look(policy_id, came_up + dt.timedelta(seconds=30), worker_stale_after_s=stale_after) is None
    assert db.rollout(rollout.id).current_step == 0
    detail = db.autopilot(policy_id).status_detail
    assert f"since {judged_from.isoformat()} (its engines restarted)" in detail, detail
    canary_traffic(db, rollout, baseline_ms=600, canary_ms=600, seed=4, at=judged_from + dt.timedelta(seconds=1))
    assert db.look(policy_id, judged_from + dt.timedelta(seconds=61), worker_stale_after_s=stale_after) is not None
    assert db.rollout(rollout.id).current_step == 1
    promoted = db.events(policy_id)[-1]
    assert promoted.action == "promoted"
    # Only the requests from the minute after the engine came up: not the 60 a cohort sent while it restarted.
    assert promoted.detail["guardrails"]["canary_requests"] == 60
    assert promoted.detail["guardrails"]["checks"][0]["guardrail"] == "engines"


def test_a_persons_rollout_the_kill_switch_and_a_recent_change_keep_its_hands_off(
        client: TestClient, admin: Headers, operator: Headers, db: Db, policy: tuple[str, str]) -> None:
    policy_id, rid = policy
    now = utcnow()
    switchback_window(db, rid, end=now)
    enable(client, admin)
    # the kill switch
    with unit_of_work(db.sessions) as session:
        set_kill_switch(session, enabled=True, reason="incident", actor="operator:test")
    assert db.look(policy_id, now) is None
    assert "kill switch" in db.autopilot(policy_id).status_detail
    with unit_of_work(db.sessions) as session:
        set_kill_switch(session, enabled=False, reason="over", actor="operator:test")
    # a person's rollout in flight
    text = ALWAYS_SPECULATIVE.replace("rate: 0.5", "rate: 0.4")
    draft = client.post("/v1/policies/seed/revisions", content=text,
                        headers={**admin, "content-type": "application/yaml", "if-match": "*"})
    assert draft.status_code == 201, draft.text
    person = client.post("/v1/rollouts", headers=operator, json={
        "policy": "seed", "revision": draft.json()["id"], "mode": "traffic", "steps": [10, 100],
        "reason": "a person's canary"})
    assert person.status_code == 201, person.text
    assert db.look(policy_id, now + dt.timedelta(hours=1)) is None
    assert "is running" in db.autopilot(policy_id).status_detail
    assert client.post(f"/v1/rollouts/{person.json()['id']}/abort", json={"reason": "changed my mind"},
                       headers=operator).status_code == 200
    # the person acted (the abort) within hold_s: still hands off
    assert db.look(policy_id, utcnow() + dt.timedelta(seconds=30)) is None
    assert "a person changed the policy" in db.autopilot(policy_id).status_detail
    # nothing was created by the autopilot meanwhile
    assert [e.action for e in db.events(policy_id)] == ["enabled"]
    # once hold_s has passed since the person's change, it proposes
    assert db.look(policy_id, now + dt.timedelta(seconds=90)) is not None
    assert db.events(policy_id)[-1].action == "started"


def test_max_changes_per_day_stops_it(client: TestClient, admin: Headers, db: Db, policy: tuple[str, str]) -> None:
    policy_id, _ = policy
    rolled_back_once(client, admin, db, policy, max_changes_per_day=1)
    # the same evidence would start the same change again, but one change a day is the limit
    assert db.look(policy_id, utcnow() + dt.timedelta(minutes=30)) is None
    ap = db.autopilot(policy_id)
    assert ap.status == "waiting"
    assert "max_changes_per_day is 1" in ap.status_detail
    assert [e.action for e in db.events(policy_id)].count("started") == 1


def test_disabled_mid_rollout_pauses_it_for_a_person(client: TestClient, admin: Headers, db: Db,
                                                     policy: tuple[str, str]) -> None:
    policy_id, rid = policy
    now = utcnow()
    switchback_window(db, rid, end=now)
    enable(client, admin)
    rollout = started(db, policy_id, now)
    off = client.put("/v1/policies/seed/autopilot", json={**SETTING, "enabled": False}, headers=admin).json()
    assert off["status"] == "off"
    assert off["rollout"] is None
    assert "paused for a person" in off["status_detail"]
    assert db.rollout(rollout.id).state == "paused"
    assert [e["action"] for e in off["history"]][:2] == ["disabled", "paused"]
    # disabled: looks do nothing, and the paused rollout is the person's
    assert db.look(policy_id, utcnow() + dt.timedelta(minutes=5)) is None
    assert db.rollout(rollout.id).state == "paused"
    # enabled again, it does not adopt that rollout, and waits for it to end
    enable(client, admin)
    assert db.look(policy_id, utcnow() + dt.timedelta(hours=1)) is None
    assert "is paused" in db.autopilot(policy_id).status_detail


def test_nothing_to_apply_below_min_confidence_or_outside_its_kinds(client: TestClient, admin: Headers, db: Db,
                                                                    policy: tuple[str, str]) -> None:
    policy_id, rid = policy
    now = utcnow()
    switchback_window(db, rid, end=now)
    enable(client, admin, kinds=["raise_threshold", "change_k"])
    assert db.look(policy_id, now) is None
    ap = db.autopilot(policy_id)
    assert ap.status == "idle"
    assert "no applicable recommendation" in ap.status_detail
    assert "stop_speculating" in ap.status_detail  # listed, but not a kind it may apply
    # The plain arm did not win: nothing to stop.
    with unit_of_work(db.sessions) as session:
        session.execute(update(Autopilot).values(kinds=["stop_speculating"]))
    assert db.look(policy_id, now) is not None  # sanity: with the kind allowed it acts


def test_no_evidence_no_change(client: TestClient, admin: Headers, db: Db, policy: tuple[str, str]) -> None:
    policy_id, rid = policy
    now = utcnow()
    # Both arms answer in exactly 600 ms: no interval can exclude 1, whatever windows the cohort secret explores
    # (with noise, a comparison at 95 % would see a difference in about one run in twenty).
    switchback_window(db, rid, end=now, speculative_ms=600, plain_ms=600, sigma=0.0)
    enable(client, admin, min_confidence="low", kinds=["stop_speculating", "exclude_route", "lower_threshold",
                                                       "raise_threshold", "switch_method"])
    assert db.look(policy_id, now) is None
    ap = db.autopilot(policy_id)
    assert ap.status == "idle"
    assert ap.rollout_id is None


def test_a_change_the_guardrails_rolled_back_is_not_proposed_again_for_a_week(
        client: TestClient, admin: Headers, db: Db, policy: tuple[str, str]) -> None:
    policy_id, _ = policy
    rolled_back_once(client, admin, db, policy)
    # the same evidence recommends the same edit (the same content-addressed revision): passed over
    assert db.look(policy_id, utcnow() + dt.timedelta(minutes=30)) is None
    ap = db.autopilot(policy_id)
    assert ap.status == "idle"
    assert "rolled back within 7 days: stop_speculating" in ap.status_detail
    assert [e.action for e in db.events(policy_id)].count("started") == 1
    # a week later it may try again
    assert db.look(policy_id, utcnow() + dt.timedelta(days=7, minutes=5)) is not None, \
        db.autopilot(policy_id).status_detail
    assert [e.action for e in db.events(policy_id)].count("started") == 2


def test_a_persons_pending_draft_is_never_built_over(client: TestClient, admin: Headers, db: Db,
                                                     policy: tuple[str, str]) -> None:
    policy_id, rid = policy
    now = utcnow()
    switchback_window(db, rid, end=now)
    enable(client, admin)
    draft = client.post("/v1/policies/seed/revisions", content=ALWAYS_SPECULATIVE.replace("rate: 0.5", "rate: 0.4"),
                        headers={**admin, "content-type": "application/yaml", "if-match": "*"})
    assert draft.status_code == 201, draft.text
    # long after the person's change, the draft is still the head: the autopilot leaves it alone
    assert db.look(policy_id, now + dt.timedelta(hours=1)) is None
    ap = db.autopilot(policy_id)
    assert ap.status == "waiting"
    assert "does not build over a person's draft" in ap.status_detail
    with db.session() as session:
        head = session.scalar(select(Revision).where(Revision.policy_id == policy_id)
                              .order_by(Revision.seq.desc()).limit(1))
        assert head is not None
        assert head.id == draft.json()["id"]


def test_a_look_that_fails_midway_leaves_no_draft_behind(client: TestClient, admin: Headers, db: Db,
                                                         policy: tuple[str, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    policy_id, rid = policy
    now = utcnow()
    switchback_window(db, rid, end=now)
    enable(client, admin)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the rollout could not start")

    monkeypatch.setattr("controlplane.autopilot.service.rollout_service.start_rollout", refused)
    with pytest.raises(RuntimeError):
        db.look(policy_id, now)
    with db.session() as session:
        revisions = session.scalars(select(Revision.id).where(Revision.policy_id == policy_id)).all()
    assert list(revisions) == [rid]  # the draft went with the failed look's transaction
    assert db.autopilot(policy_id).rollout_id is None
