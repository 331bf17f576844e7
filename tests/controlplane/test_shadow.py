"""Shadow comparisons on the control plane (issue 19, item 2): the fields an event carries are stored and refused
field by field, the analysis summary reports them per group, and a canary whose answers differ from the plain
engine's too often is rolled back like on any breach. On both databases, through the real API."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from apiclient import models as api_models
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.models import AuditEvent, Policy, utcnow
from controlplane.rollout import guardrails
from controlplane.settings import ControlPlaneSettings
from tests.support.factories import seed_policy, seed_text
from tests.support.telemetry_bodies import event as body
from tests.support.telemetry_data import T0, event, lognormal, store

Headers = dict[str, str]

# A policy that samples shadow comparisons and holds its canaries to a minimum match rate.
SHADOW = ("quality: {shadow_rate: 0.05}\n"
          "guardrails: {max_p95_itl_regression: 0.5, max_retry_rate_increase: 0.05, min_shadow_match_rate: 0.95, "
          "min_samples: 100}\n")


def _shadow(match: bool, **changes: Any) -> dict[str, Any]:
    return {"shadow_match": match, "shadow_first_diff": None if match else 9, **changes}


# --- ingest ---------------------------------------------------------------------------------------

def test_bad_shadow_fields_are_refused_per_event_naming_the_field(client: TestClient, worker_key: Headers,
                                                                   settings: ControlPlaneSettings) -> None:
    seed_policy(settings.database_url)
    seed_policy(settings.database_url, name="other", pool="a")
    events = [body(0, **_shadow(False, shadow_check_passed=False, shadow_check_reason="r" * 256)),
              body(1, shadow_first_diff=-1), body(2, shadow_match="sometimes"),
              body(3, shadow_check_reason="r" * 257), body(4, shadow_check_reason="a\x00b"),
              body(5, shadow_structured_valid=3), body(6, shadow_first_diff=2**31)]
    r = client.post("/v1/telemetry/batches", headers=worker_key,
                    json={"batch_id": "b-shadow", "worker_id": "w-1", "events": events})
    assert r.status_code == 200, r.text
    ack = r.json()
    assert (ack["accepted"], ack["stored"]) == (1, 1)
    assert {rej["index"]: [(e["path"], e["code"]) for e in rej["errors"]] for rej in ack["rejected"]} == {
        1: [("shadow_first_diff", "out_of_range")], 2: [("shadow_match", "wrong_type")],
        3: [("shadow_check_reason", "too_long")], 4: [("shadow_check_reason", "invalid_format")],
        5: [("shadow_structured_valid", "wrong_type")], 6: [("shadow_first_diff", "out_of_range")]}


# --- the summary ----------------------------------------------------------------------------------

def _summary_events(rid: str) -> list[dict[str, Any]]:
    """extract on draft: 20 compared (14 matched), 5 of the differing ones counted where they differ (60 tokens in
    all), 8 of them structured with both answers checked, 6 quality checks of which 2 failed; chat on draft: none
    compared; extract on base: plain, never compared."""
    out = []
    for i in range(30):
        e = event(revision=rid, route="extract", time=T0, structured=True if i < 8 else None)
        if i < 20:
            e.update(_shadow(i < 14, shadow_first_diff=[0, 10, 20, 30, None, None][i - 14] if i >= 14 else None))
            if i < 8:  # served valid on 7 of 8, plain valid on 5 of 8
                e["structured_valid"] = i != 0
                e["shadow_structured_valid"] = i >= 3
            if 10 <= i < 16:
                e["shadow_check_passed"] = i not in (14, 15)
        out.append(e)
    out += [event(revision=rid, route="chat", time=T0) for _ in range(10)]
    out += [event(revision=rid, route="extract", speculate=False, time=T0) for _ in range(10)]
    return out


def test_the_summary_reports_shadow_comparisons_per_group(client: TestClient, viewer: Headers,
                                                          settings: ControlPlaneSettings) -> None:
    _, (rid,) = seed_policy(settings.database_url)
    store(settings.database_url, _summary_events(rid))
    r = client.get("/v1/analysis/summary", params={"group_by": "route,engine"}, headers=viewer)
    assert r.status_code == 200, r.text
    report = r.json()
    api_models.SummaryReport.model_validate(report)
    rows = {(row["key"]["route"], row["key"]["engine"]): row for row in report["rows"]}
    assert set(rows) == {("extract", "draft"), ("chat", "draft"), ("extract", "base")}
    shadow = rows[("extract", "draft")]["shadow"]
    low, high = shadow.pop("match_interval")
    assert (low, high) == pytest.approx((0.4810, 0.8545), abs=5e-4)  # Wilson, 14 of 20
    assert shadow == {"compared": 20, "matched": 14, "match_rate": 0.7, "first_diff_mean": 15.0,
                      "first_diff_count": 4, "structured_checked": 8, "structured_valid_served": 7 / 8,
                      "structured_valid_plain": 5 / 8, "check_run": 6, "check_failed": 2}
    # the served answers' validity is still over every checked one, compared or not
    assert rows[("extract", "draft")]["structured_validity_rate"] == 7 / 8
    assert rows[("chat", "draft")]["shadow"] is None
    assert rows[("extract", "base")]["shadow"] is None

    # merged over engines and windows alike: the counters add up
    by_route = client.get("/v1/analysis/summary", params={"group_by": "route", "window": "hour"},
                          headers=viewer).json()
    merged = {row["key"]["route"]: row["shadow"] for row in by_route["rows"]}
    assert merged["chat"] is None
    assert (merged["extract"]["compared"], merged["extract"]["matched"]) == (20, 14)
    # filtered to a route without comparisons: nothing to report
    chat = client.get("/v1/analysis/summary", params={"route": "chat"}, headers=viewer).json()
    assert [row["shadow"] for row in chat["rows"]] == [None]
    # the raw rollup counters carry them too
    rollups = client.get("/v1/telemetry/rollups", params={"group_by": "route"}, headers=viewer).json()
    counters = {g["key"]["route"]: g["counters"] for g in rollups["groups"]}
    assert (counters["extract"]["shadow_compared"], counters["extract"]["shadow_check_failed"]) == (20, 2)
    assert counters["chat"]["shadow_compared"] == 0


# --- rollouts -------------------------------------------------------------------------------------

@pytest.fixture
def revisions(settings: ControlPlaneSettings) -> tuple[str, str]:
    """Policy ``seed`` with shadow comparisons and their guardrail: revision 0 active, revision 1 a draft."""
    _, (rev0, rev1) = seed_policy(settings.database_url, seed_text(threshold=4) + SHADOW,
                                  extra_revisions=(seed_text(threshold=8) + SHADOW,))
    return rev0, rev1


@pytest.fixture
def sessions(settings: ControlPlaneSettings) -> Iterator[Any]:
    engine = make_engine(settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def _start(client: TestClient, operator: Headers, revision: str) -> dict[str, Any]:
    r = client.post("/v1/rollouts", headers=operator, json={
        "policy": "seed", "revision": revision, "mode": "traffic", "steps": [50, 100], "reason": "threshold 8"})
    assert r.status_code == 201, r.text
    rollout: dict[str, Any] = r.json()
    return rollout


def _traffic(url: str, baseline: str, canary: str, n: int, *, compared: int, matched: int, seed: int = 1) -> None:
    """``n`` alike requests of each revision now; ``compared`` of the canary's shadow-compared, ``matched`` of
    those with the same answer as the plain engine. (The baseline's answers match: it is not what is judged.)"""
    rng = random.Random(seed)
    now = utcnow()
    events = []
    for i in range(n):
        base = event(revision=baseline, itl=lognormal(rng, 20.0, 0.1), time=now)
        if i < compared:
            base.update(_shadow(True))
        events.append(base)
        served = event(revision=canary, itl=lognormal(rng, 20.0, 0.1), time=now)
        if i < compared:
            served.update(_shadow(i < matched))
        events.append(served)
    store(url, events)


def test_a_canary_whose_answers_differ_too_often_is_rolled_back(
        client: TestClient, operator: Headers, viewer: Headers, settings: ControlPlaneSettings, sessions: Any,
        revisions: tuple[str, str]) -> None:
    rev0, rev1 = revisions
    rollout = _start(client, operator, rev1)
    # 20 comparisons say nothing yet, however bad
    _traffic(settings.database_url, rev0, rev1, 150, compared=20, matched=10)
    r = client.post(f"/v1/rollouts/{rollout['id']}/guardrails/evaluate", headers=operator)
    assert r.status_code == 200, r.text
    first = r.json()
    check = {c["guardrail"]: c for c in first["checks"]}["min_shadow_match"]
    assert (first["verdict"], check["status"]) == ("pending", "pending")
    assert check["detail"] == ("10 of 20 shadow comparisons matched on the canary (50.0%; minimum 95%); waiting "
                               "for 30 comparisons")
    # 36 of 60 in all: far below 95 %, with confidence
    _traffic(settings.database_url, rev0, rev1, 150, compared=40, matched=26, seed=2)
    r = client.post(f"/v1/rollouts/{rollout['id']}/guardrails/evaluate", headers=operator)
    look = r.json()
    assert (look["verdict"], look["action"]) == ("breach", "rolled_back")
    checks = {c["guardrail"]: c for c in look["checks"]}
    assert [name for name, c in checks.items() if c["status"] == "breach"] == ["min_shadow_match"]
    assert checks["min_shadow_match"]["observed"] == 0.6
    assert checks["min_shadow_match"]["limit"] == 0.95
    assert checks["min_shadow_match"]["detail"] == ("36 of 60 shadow comparisons matched on the canary (60.0%; "
                                                    "minimum 95%)")
    assert client.get(f"/v1/rollouts/{rollout['id']}", headers=viewer).json()["state"] == "rolled_back"
    with sessions() as session:
        (audit,) = session.scalars(select(AuditEvent).where(AuditEvent.action == "rollout.auto_rollback")).all()
        active = session.scalar(select(Policy.active_revision_id))
    assert audit.actor == "system:guardrails"
    assert "min_shadow_match (36 of 60 shadow comparisons matched on the canary" in audit.reason
    assert active == rev0


def test_a_canary_whose_answers_match_passes_and_is_promoted(
        client: TestClient, operator: Headers, settings: ControlPlaneSettings, sessions: Any,
        revisions: tuple[str, str]) -> None:
    rev0, rev1 = revisions
    rollout = _start(client, operator, rev1)
    # at a 95 % minimum it takes some 250 matching comparisons to show the rate is above it (the test's variance
    # is the limit's, calibrated where it decides)
    _traffic(settings.database_url, rev0, rev1, 300, compared=260, matched=260)
    with unit_of_work(sessions) as session:
        outcome = guardrails.evaluate_guardrails(session, rollout["id"], actor="system:guardrails", now=utcnow(),
                                                 alpha=0.05, auto_promote=True,
                                                 worker_stale_after_s=settings.worker_stale_after_s)
    checks = {c["guardrail"]: c for c in outcome.evaluation.checks}
    assert checks["min_shadow_match"]["status"] == "pass", checks
    assert checks["min_shadow_match"]["observed"] == 1.0
    assert (outcome.evaluation.verdict, outcome.evaluation.action) == ("pass", "promoted")
    assert client.get(f"/v1/rollouts/{rollout['id']}", headers=operator).json()["current_step"] == 1


def test_a_policy_without_the_minimum_is_not_judged_on_shadow_comparisons(
        client: TestClient, operator: Headers, settings: ControlPlaneSettings) -> None:
    loose = "quality: {shadow_rate: 0.05}\nguardrails: {max_p95_itl_regression: 0.5, min_samples: 100}\n"
    _, (rev0, rev1) = seed_policy(settings.database_url, seed_text(threshold=4) + loose,
                                  extra_revisions=(seed_text(threshold=8) + loose,))
    rollout = _start(client, operator, rev1)
    _traffic(settings.database_url, rev0, rev1, 300, compared=60, matched=20)
    look = client.post(f"/v1/rollouts/{rollout['id']}/guardrails/evaluate", headers=operator).json()
    assert "min_shadow_match" not in {c["guardrail"] for c in look["checks"]}
    assert look["verdict"] != "breach"
