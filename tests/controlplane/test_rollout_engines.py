"""The engine gate of workers-mode rollout steps: a canary is judged only once its supervised engines serve the
revision's arguments, from the next whole minute, and rolled back when they cannot run them; and the
``serving_since`` the control plane stamps on each engine for it. On both databases, and on plain data."""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from apiclient import models as api_models
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.models import AuditEvent, utcnow
from controlplane.rollout import guardrails
from controlplane.rollout.guardrails import EngineGate, engine_gate
from controlplane.settings import ControlPlaneSettings
from tests.support.factories import seed_policy, seed_text
from tests.support.fleet_rows import age_heartbeat, register
from tests.support.telemetry_data import event, lognormal, store

Headers = dict[str, str]

# Limits a clean canary of a few hundred requests passes with confidence.
GUARDRAILS = "guardrails: {max_p95_itl_regression: 0.5, max_retry_rate_increase: 0.05, min_samples: 50}\n"
REFUSED = ("the new arguments did not come up: vLLM exited with 1 (log engines/draft.log); back on the previous "
           "ones")
OLD_HASH, NEW_HASH, BASE_HASH = "0a0a0a0a", "0b0b0b0b", "0c0c0c0c"


def minute_of(when: dt.datetime) -> dt.datetime:
    return when.replace(second=0, microsecond=0)


def report(name: str, revision: str | None, state: str = "serving", config_hash: str = OLD_HASH,
           **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"engine": name, "state": state, "config_hash": config_hash, "revision": revision,
                            "restarts": 0, "failed_restarts": 0, "crashes": 0, "last_error": None}
    body.update(changes)
    return body


def beat(client: TestClient, key: Headers, worker: str, revision: str | None,
         *engines: dict[str, Any]) -> None:
    r = client.post(f"/v1/workers/{worker}/heartbeat", headers=key,
                    json={"active_revision": revision, "supervised_engines": list(engines)})
    assert r.status_code == 200, r.text


def engines_of(client: TestClient, key: Headers, worker: str) -> dict[str, dict[str, Any]]:
    page = client.get("/v1/workers", headers=key).json()
    api_models.WorkerPage.model_validate(page)
    (item,) = [w for w in page["items"] if w["id"] == worker]
    return {e["engine"]: e for e in item["supervised_engines"]}


class Clock:
    """The control plane's clock where heartbeats are stamped and rollouts started, set by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def at(self, when: dt.datetime) -> None:
        for module in ("controlplane.worker.service", "controlplane.rollout.service"):
            self.monkeypatch.setattr(f"{module}.utcnow", lambda: when)

    def real(self) -> None:
        for module in ("controlplane.worker.service", "controlplane.rollout.service"):
            self.monkeypatch.setattr(f"{module}.utcnow", utcnow)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch)


@pytest.fixture
def revisions(settings: ControlPlaneSettings) -> tuple[str, str]:
    """Policy ``seed``: revision 0 active, revision 1 (another threshold, so other engine arguments) a draft."""
    _, (rev0, rev1) = seed_policy(settings.database_url, seed_text(threshold=4) + GUARDRAILS,
                                  extra_revisions=(seed_text(threshold=8) + GUARDRAILS,))
    return rev0, rev1


@pytest.fixture
def sessions(settings: ControlPlaneSettings) -> Iterator[Any]:
    engine = make_engine(settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def start(client: TestClient, operator: Headers, revision: str, mode: str = "workers") -> dict[str, Any]:
    r = client.post("/v1/rollouts", headers=operator, json={
        "policy": "seed", "revision": revision, "mode": mode, "steps": [50, 100], "reason": "canary threshold 8"})
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def look(client: TestClient, operator: Headers, rollout_id: str) -> dict[str, Any]:
    r = client.post(f"/v1/rollouts/{rollout_id}/guardrails/evaluate", headers=operator)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def look_promoting(sessions: Any, settings: ControlPlaneSettings, rollout_id: str) -> guardrails.GuardrailOutcome:
    """A look as the evaluator with SPECGATE_GUARDRAIL_AUTO_PROMOTE=true makes it."""
    with unit_of_work(sessions) as session:
        return guardrails.evaluate_guardrails(session, rollout_id, actor="system:guardrails", now=utcnow(),
                                              alpha=0.05, auto_promote=True,
                                              worker_stale_after_s=settings.worker_stale_after_s)


def traffic(url: str, baseline: str | None, canary: str | None, at: dt.datetime, n: int, *,
            fallbacks: bool = False, seed: int = 1) -> None:
    """``n`` requests of each given revision at ``at``: alike, the canary's all served by the fallback engine with
    ``fallbacks``. (All at once: stamped now, none may fall in a minute after the look's.)"""
    rng = random.Random(seed)
    events = []
    for _ in range(n):
        when = at
        if baseline is not None:
            events.append(event(revision=baseline, itl=lognormal(rng, 20.0, 0.1), time=when))
        if canary is not None:
            served = event(revision=canary, itl=lognormal(rng, 20.0, 0.1), time=when)
            served["fallback"] = fallbacks
            events.append(served)
    store(url, events)


def checks(evaluation: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["guardrail"]: c for c in evaluation["checks"]}


# --- serving_since ---------------------------------------------------------------------------------

def test_serving_since_is_stamped_by_the_control_plane_kept_across_a_crash_and_cleared_by_new_arguments(
        client: TestClient, worker_key: Headers, admin: Headers, clock: Clock) -> None:
    register(client, worker_key, "w1")
    t0 = dt.datetime(2026, 12, 7, 10, 0, 15, tzinfo=dt.UTC)
    t = [t0 + dt.timedelta(minutes=i) for i in range(8)]

    # Started before the bundle: starting, then serving (stamped then, by this clock).
    clock.at(t[0])
    beat(client, worker_key, "w1", None, report("draft", None, "starting"))
    assert engines_of(client, admin, "w1")["draft"]["serving_since"] is None
    clock.at(t[1])
    beat(client, worker_key, "w1", None, report("draft", None))
    assert dt.datetime.fromisoformat(engines_of(client, admin, "w1")["draft"]["serving_since"]) == t[1]

    # A crash and a restart with the same arguments: still serving them since t1.
    clock.at(t[2])
    beat(client, worker_key, "w1", None, report("draft", None, "restarting", crashes=1, last_error="exited with -9"))
    clock.at(t[3])
    beat(client, worker_key, "w1", None, report("draft", None, crashes=1))
    assert dt.datetime.fromisoformat(engines_of(client, admin, "w1")["draft"]["serving_since"]) == t[1]

    # New arguments: cleared while it drains and restarts (the old hash while draining keeps it), stamped once
    # it serves them.
    clock.at(t[4])
    beat(client, worker_key, "w1", "r1", report("draft", None, "draining"))
    assert dt.datetime.fromisoformat(engines_of(client, admin, "w1")["draft"]["serving_since"]) == t[1]
    clock.at(t[5])
    beat(client, worker_key, "w1", "r1", report("draft", "r1", "starting", config_hash=NEW_HASH))
    assert engines_of(client, admin, "w1")["draft"]["serving_since"] is None
    clock.at(t[6])
    beat(client, worker_key, "w1", "r1", report("draft", "r1", config_hash=NEW_HASH, restarts=1))
    listed = engines_of(client, admin, "w1")["draft"]
    assert dt.datetime.fromisoformat(listed["serving_since"]) == t[6]
    assert api_models.SupervisedEngine.model_validate(listed).serving_since == t[6]

    # A registration (a sidecar starting) clears the reports: an engine first reported serving is stamped then.
    register(client, worker_key, "w1")
    clock.at(t[7])
    beat(client, worker_key, "w1", "r1", report("draft", "r1", config_hash=NEW_HASH))
    assert dt.datetime.fromisoformat(engines_of(client, admin, "w1")["draft"]["serving_since"]) == t[7]


def test_a_worker_cannot_send_serving_since(client: TestClient, worker_key: Headers) -> None:
    register(client, worker_key, "w1")
    r = client.post("/v1/workers/w1/heartbeat", headers=worker_key, json={"supervised_engines": [
        report("draft", None, serving_since="2020-01-01T00:00:00+00:00")]})
    assert r.status_code == 422
    assert [e["path"] for e in r.json()["errors"]] == ["supervised_engines[0].serving_since"]


# --- the gate in the guardrail look ----------------------------------------------------------------------

def test_a_canary_whose_engine_restarts_is_pending_whatever_its_fallbacks(
        client: TestClient, operator: Headers, worker_key: Headers, settings: ControlPlaneSettings,
        revisions: tuple[str, str]) -> None:
    rev0, rev1 = revisions
    register(client, worker_key, "w-1")
    beat(client, worker_key, "w-1", rev0, report("base", rev0, config_hash=BASE_HASH), report("draft", rev0))
    rollout = start(client, operator, rev1)
    # The bundle arrived: the plain engine's arguments did not change, the draft engine restarts.
    beat(client, worker_key, "w-1", rev1, report("base", rev1, config_hash=BASE_HASH),
         report("draft", rev1, "restarting", config_hash=NEW_HASH))
    # Meanwhile the fallback engine answers the canary's requests: a retries breach, were they judged.
    traffic(settings.database_url, rev0, rev1, utcnow(), 300, fallbacks=True)

    evaluation = look(client, operator, rollout["id"])
    assert (evaluation["verdict"], evaluation["action"]) == ("pending", "none")
    assert [c["guardrail"] for c in evaluation["checks"]] == ["engines"]
    (gate,) = evaluation["checks"]
    assert gate["status"] == "pending"
    assert "worker w-1: engine draft restarting" in gate["detail"]
    assert "engine base" not in gate["detail"]  # it serves the revision's arguments already
    assert (evaluation["baseline_requests"], evaluation["canary_requests"]) == (0, 0)
    got = client.get(f"/v1/rollouts/{rollout['id']}", headers=operator).json()
    assert (got["state"], got["current_step"]) == ("running", 0)
    assert got["last_guardrail_evaluation"]["checks"][0]["guardrail"] == "engines"


def test_a_clean_canary_is_not_promoted_before_its_engines_serve(
        client: TestClient, operator: Headers, worker_key: Headers, settings: ControlPlaneSettings,
        sessions: Any, revisions: tuple[str, str]) -> None:
    rev0, rev1 = revisions
    register(client, worker_key, "w-1")
    rollout = start(client, operator, rev1)
    beat(client, worker_key, "w-1", rev1, report("draft", rev0, "draining"))
    traffic(settings.database_url, rev0, rev1, utcnow(), 300)

    outcome = look_promoting(sessions, settings, rollout["id"])
    assert (outcome.evaluation.verdict, outcome.evaluation.action) == ("pending", "none")
    assert outcome.engines.status == "waiting"
    assert "worker w-1: engine draft draining (on revision " + rev0[:12] in outcome.engines.detail
    assert client.get(f"/v1/rollouts/{rollout['id']}", headers=operator).json()["current_step"] == 0


def test_once_the_engines_serve_the_canary_is_judged_from_the_next_whole_minute_and_promoted(
        client: TestClient, operator: Headers, worker_key: Headers, settings: ControlPlaneSettings,
        sessions: Any, clock: Clock, revisions: tuple[str, str]) -> None:
    rev0, rev1 = revisions
    url = settings.database_url
    step_start = minute_of(utcnow()) - dt.timedelta(minutes=10) + dt.timedelta(seconds=5)
    register(client, worker_key, "w-1")
    clock.at(step_start - dt.timedelta(minutes=1))
    beat(client, worker_key, "w-1", rev0, report("base", rev0, config_hash=BASE_HASH), report("draft", rev0))
    clock.at(step_start)
    rollout = start(client, operator, rev1)
    clock.at(step_start + dt.timedelta(seconds=10))
    beat(client, worker_key, "w-1", rev1, report("base", rev1, config_hash=BASE_HASH),
         report("draft", rev1, "restarting", config_hash=NEW_HASH))
    came_up = step_start + dt.timedelta(minutes=2, seconds=25)
    clock.at(came_up)
    beat(client, worker_key, "w-1", rev1, report("base", rev1, config_hash=BASE_HASH),
         report("draft", rev1, config_hash=NEW_HASH, restarts=1))
    clock.real()  # and it goes on heartbeating: a live worker
    beat(client, worker_key, "w-1", rev1, report("base", rev1, config_hash=BASE_HASH),
         report("draft", rev1, config_hash=NEW_HASH, restarts=1))
    judged_from = minute_of(came_up) + dt.timedelta(minutes=1)

    # The fallback engine served the canary until the minute the draft engine came up, that minute included.
    for minute in range(3):
        traffic(url, rev0, rev1, minute_of(step_start) + dt.timedelta(minutes=minute, seconds=5), 100,
                fallbacks=True, seed=minute)
    traffic(url, rev0, rev1, judged_from + dt.timedelta(seconds=5), 200, seed=10)
    traffic(url, rev0, rev1, judged_from + dt.timedelta(minutes=1, seconds=5), 150, seed=11)

    evaluation = look(client, operator, rollout["id"])
    assert (evaluation["baseline_requests"], evaluation["canary_requests"]) == (350, 350)
    gate = checks(evaluation)["engines"]
    assert gate["status"] == "pass"
    assert judged_from.isoformat() in gate["detail"]
    assert "worker w-1, engine draft" in gate["detail"]
    assert evaluation["checks"][0]["guardrail"] == "engines"
    assert checks(evaluation)["retry_rate_increase"]["status"] == "pass"
    assert evaluation["verdict"] == "pass", evaluation

    outcome = look_promoting(sessions, settings, rollout["id"])
    assert (outcome.evaluation.verdict, outcome.evaluation.action) == ("pass", "promoted")
    assert outcome.engines.judged_from == judged_from
    assert client.get(f"/v1/rollouts/{rollout['id']}", headers=operator).json()["current_step"] == 1


def test_engines_that_served_before_the_step_are_judged_from_its_start(
        client: TestClient, operator: Headers, worker_key: Headers, settings: ControlPlaneSettings,
        revisions: tuple[str, str]) -> None:
    rev0, rev1 = revisions
    register(client, worker_key, "w-1")
    beat(client, worker_key, "w-1", rev0, report("draft", rev0))
    rollout = start(client, operator, rev1)
    # The new revision does not change the engine's arguments: it now runs them as the new revision's.
    beat(client, worker_key, "w-1", rev1, report("draft", rev1))
    traffic(settings.database_url, rev0, rev1, utcnow(), 120)
    evaluation = look(client, operator, rollout["id"])
    assert (evaluation["baseline_requests"], evaluation["canary_requests"]) == (120, 120)
    gate = checks(evaluation)["engines"]
    assert gate["status"] == "pass"
    assert "before the step started" in gate["detail"]


@pytest.mark.parametrize("state", ["serving", "failed"])
def test_a_canary_whose_engine_cannot_run_the_revision_is_rolled_back(
        client: TestClient, operator: Headers, worker_key: Headers, settings: ControlPlaneSettings,
        sessions: Any, revisions: tuple[str, str], state: str) -> None:
    rev0, rev1 = revisions
    register(client, worker_key, "w-1")
    register(client, worker_key, "w2")
    rollout = start(client, operator, rev1)
    # vLLM refused the new arguments: back on the previous revision's (or down), with the error.
    beat(client, worker_key, "w-1", rev1, report("base", rev1, config_hash=BASE_HASH),
         report("draft", rev0, state, failed_restarts=1, last_error=REFUSED, error_revision=rev1))
    beat(client, worker_key, "w2", rev1, report("draft", rev1, "restarting", config_hash=NEW_HASH))

    evaluation = look(client, operator, rollout["id"])
    assert (evaluation["verdict"], evaluation["action"]) == ("breach", "rolled_back")
    (gate,) = evaluation["checks"]
    assert (gate["guardrail"], gate["status"]) == ("engines", "breach")
    assert gate["detail"] == f"worker w-1: engine draft cannot run revision {rev1[:12]}'s arguments ({REFUSED})"
    assert client.get(f"/v1/rollouts/{rollout['id']}", headers=operator).json()["state"] == "rolled_back"
    with sessions() as session:
        (audit,) = session.scalars(select(AuditEvent).where(AuditEvent.action == "rollout.auto_rollback")).all()
        assert audit.actor == "system:guardrails"
        assert f"worker w-1: engine draft cannot run revision {rev1[:12]}'s arguments ({REFUSED})" in audit.reason
        assert audit.after is not None
        assert audit.after["evidence"]["checks"][0]["detail"] == gate["detail"]


def test_a_traffic_rollout_is_never_gated(
        client: TestClient, operator: Headers, worker_key: Headers, settings: ControlPlaneSettings,
        revisions: tuple[str, str]) -> None:
    rev0, rev1 = revisions
    register(client, worker_key, "w-1")
    rollout = start(client, operator, rev1, mode="traffic")
    # Whatever a worker says: a traffic canary runs on the baseline's engines.
    beat(client, worker_key, "w-1", rev1, report("draft", rev1, "restarting", config_hash=NEW_HASH))
    traffic(settings.database_url, rev0, rev1, utcnow(), 300, fallbacks=True)
    evaluation = look(client, operator, rollout["id"])
    assert "engines" not in checks(evaluation)
    assert checks(evaluation)["retry_rate_increase"]["status"] == "breach", evaluation
    assert (evaluation["verdict"], evaluation["action"]) == ("breach", "rolled_back")


def test_a_stale_worker_does_not_hold_the_step(
        client: TestClient, operator: Headers, worker_key: Headers, settings: ControlPlaneSettings,
        revisions: tuple[str, str]) -> None:
    rev0, rev1 = revisions
    register(client, worker_key, "w-1")
    register(client, worker_key, "w2")
    rollout = start(client, operator, rev1)
    beat(client, worker_key, "w-1", rev1, report("draft", rev1, "restarting", config_hash=NEW_HASH))
    beat(client, worker_key, "w2", rev0, report("draft", rev0))  # not in the canary: never gates
    traffic(settings.database_url, rev0, rev1, utcnow(), 120)
    assert look(client, operator, rollout["id"])["verdict"] == "pending"
    age_heartbeat(settings.database_url, "w-1", settings.worker_stale_after_s + 1)
    evaluation = look(client, operator, rollout["id"])
    assert "engines" not in checks(evaluation)  # as if it supervised nothing: today's checks
    assert evaluation["canary_requests"] == 120
    assert checks(evaluation)["retry_rate_increase"]["status"] == "pass"


# --- the gate on plain data -----------------------------------------------------------------------

START = dt.datetime(2026, 12, 7, 10, 1, 30, tzinfo=dt.UTC)


def served(name: str, revision: str, since: dt.datetime | None, **changes: Any) -> dict[str, Any]:
    return report(name, revision, serving_since=None if since is None else since.isoformat(), **changes)


def test_no_supervising_canary_worker_no_gate() -> None:
    gate = engine_gate({}, "r1", START)
    assert gate == EngineGate("none", START)
    assert gate.check() is None


def test_engines_serving_since_before_the_step_judge_it_from_its_start() -> None:
    gate = engine_gate({"w1": [served("base", "r1", START - dt.timedelta(hours=1)),
                               served("draft", "r1", START)]}, "r1", START)
    assert (gate.status, gate.judged_from) == ("ready", START)
    check = gate.check()
    assert check is not None
    assert (check.guardrail, check.status) == ("engines", "pass")


@pytest.mark.parametrize(("since", "judged_from"), [
    (dt.datetime(2026, 12, 7, 10, 3, 20, tzinfo=dt.UTC), dt.datetime(2026, 12, 7, 10, 4, tzinfo=dt.UTC)),
    (dt.datetime(2026, 12, 7, 10, 3, 0, tzinfo=dt.UTC), dt.datetime(2026, 12, 7, 10, 4, tzinfo=dt.UTC)),
    (dt.datetime(2026, 12, 7, 10, 1, 31, tzinfo=dt.UTC), dt.datetime(2026, 12, 7, 10, 2, tzinfo=dt.UTC)),
])
def test_engines_that_came_up_in_the_step_judge_it_from_the_next_whole_minute(
        since: dt.datetime, judged_from: dt.datetime) -> None:
    gate = engine_gate({"w1": [served("base", "r1", START - dt.timedelta(hours=1))],
                        "w2": [served("draft", "r1", since), served("base", "r1", START)]}, "r1", START)
    assert (gate.status, gate.judged_from) == ("ready", judged_from)
    assert "worker w2, engine draft" in gate.detail
    assert judged_from.isoformat() in gate.detail


@pytest.mark.parametrize("engine", [
    report("draft", "r1", "restarting", config_hash=NEW_HASH),
    report("draft", "r1", "starting", config_hash=NEW_HASH),
    report("draft", "r0", "draining"),
    report("draft", "r1", "stopped"),
    report("draft", "r0"),  # still on the old revision, no error: the bundle has just arrived
    served("draft", "r1", None),  # not stamped yet
])
def test_engines_on_their_way_wait(engine: dict[str, Any]) -> None:
    gate = engine_gate({"w1": [served("base", "r1", START)], "w2": [engine]}, "r1", START)
    assert gate.status == "waiting"
    assert f"worker w2: engine draft {engine['state']}" in gate.detail
    assert "worker w1" not in gate.detail
    check = gate.check()
    assert check is not None
    assert (check.guardrail, check.status) == ("engines", "pending")


@pytest.mark.parametrize("state", ["serving", "failed"])
def test_an_engine_left_on_other_arguments_with_an_error_fails_the_gate(state: str) -> None:
    gate = engine_gate({"w1": [report("draft", "r1", "restarting")],
                        "w2": [report("draft", "r0", state, failed_restarts=1, last_error="vLLM exited with 1",
                                      error_revision="r1")],
                        "w3": [report("base", None, state, last_error="revision r1 cannot be rendered",
                                      error_revision="r1")]},
                       "r1", START)
    assert gate.status == "failed"
    assert gate.detail == ("worker w2: engine draft cannot run revision r1's arguments (vLLM exited with 1); "
                           "worker w3: engine base cannot run revision r1's arguments (revision r1 cannot be "
                           "rendered)")
    check = gate.check()
    assert check is not None
    assert (check.guardrail, check.status) == ("engines", "breach")


def test_an_engine_down_on_the_revisions_own_arguments_fails_the_gate() -> None:
    gate = engine_gate({"w1": [served("base", "r1", START)],
                        "w2": [report("draft", "r1", "failed", last_error="exited with -9", error_revision="r1")]},
                       "r1", START)
    assert gate.status == "failed"
    assert gate.detail == "worker w2: engine draft is down on revision r1's arguments (exited with -9)"


def test_a_large_canary_names_ten_engines_and_counts_the_rest() -> None:
    gate = engine_gate({f"w{i:02d}": [report("draft", "r1", "restarting")] for i in range(25)}, "r1", START)
    assert gate.status == "waiting"
    assert "worker w09:" in gate.detail
    assert "worker w10:" not in gate.detail
    assert gate.detail.endswith("; and 15 more")


@pytest.mark.parametrize("engine", [
    # a crash of the previous arguments, revived and serving them while the new bundle's restart waits its turn
    report("draft", "r0", "serving", crashes=1, last_error="exited with -9 while serving", error_revision="r0"),
    # a refusal of an earlier revision's arguments, still shown
    report("draft", "r0", "serving", failed_restarts=1, last_error="vLLM exited with 1", error_revision="rX"),
    # a sidecar that does not say which revision its error is about
    report("draft", "r0", "serving", failed_restarts=1, last_error="vLLM exited with 1"),
])
def test_an_error_about_other_arguments_is_no_verdict_on_the_canary(engine: dict[str, Any]) -> None:
    gate = engine_gate({"w1": [engine]}, "r1", START)
    assert gate.status == "waiting"
