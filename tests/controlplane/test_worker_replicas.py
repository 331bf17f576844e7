"""Gateways and replica pools on the control plane: a sidecar's kind, the replicas it reports in its
heartbeats, the fleet counting gateways and replicas apart, and the replica a telemetry event names."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from apiclient import models as api_models
from controlplane.models import TelemetryEventRecord, Worker, utcnow
from controlplane.settings import ControlPlaneSettings
from tests.support.factories import seed_policy
from tests.support.fleet_rows import age_heartbeat, register, session_for
from tests.support.telemetry_bodies import event


def replica(engine_name: str, address: str, state: str = "healthy", **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"engine": engine_name, "replica": address, "state": state, "in_flight": 2, "running": 3.0,
                            "waiting": 0.0, "consecutive_failures": 0, "ejections": 1, "returns": 1,
                            "next_probe_in_s": None}
    body.update(changes)
    return body


def listed(client: TestClient, key: dict[str, str], **params: Any) -> dict[str, dict[str, Any]]:
    r = client.get("/v1/workers", params=params, headers=key)
    assert r.status_code == 200, r.text
    return {w["id"]: w for w in r.json()["items"]}


def beat(client: TestClient, key: dict[str, str], worker_id: str, body: Any) -> None:
    r = client.post(f"/v1/workers/{worker_id}/heartbeat", json=body, headers=key)
    assert r.status_code == 200, r.text


def register_kind(client: TestClient, key: dict[str, str], worker_id: str, kind: str | None,
                  pool: str = "pool-a") -> Any:
    body: dict[str, Any] = {"id": worker_id, "pool": pool, "labels": {}, "engines": {"base": "10.0.0.5:8000"},
                            "sidecar_version": "0.2.0"}
    if kind is not None:
        body["kind"] = kind
    return client.post("/v1/workers/register", json=body, headers=key)


def set_reported_at(database_url: str, worker_id: str, seconds_ago: float) -> None:
    with session_for(database_url) as session:
        worker = session.get(Worker, worker_id)
        assert worker is not None
        worker.replicas_reported_at = utcnow() - dt.timedelta(seconds=seconds_ago)


# --- registration -------------------------------------------------------------------------------

def test_registration_stores_the_kind_and_a_re_registration_changes_it(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str]) -> None:
    assert register_kind(client, worker_key, "w1", None).json()["kind"] == "worker"
    created = register_kind(client, worker_key, "w2", "gateway")
    assert created.status_code == 201, created.text
    assert created.json()["kind"] == "gateway"
    assert created.json()["replicas"] == []
    assert created.json()["replicas_reported_at"] is None

    again = register_kind(client, worker_key, "w2", "worker")
    assert again.status_code == 200
    assert again.json()["kind"] == "worker"
    assert listed(client, admin)["w2"]["kind"] == "worker"
    # Changing the kind is a change someone made: audited, with what it was.
    events = client.get("/v1/audit", params={"action": "worker.register"}, headers=admin).json()["items"]
    latest = events[0]
    assert latest["target_id"] == "w2"
    assert (latest["before"]["kind"], latest["after"]["kind"]) == ("gateway", "worker")


@pytest.mark.parametrize("kind", ["router", "", "Gateway", 1, None])
def test_an_unknown_kind_is_refused_naming_it(client: TestClient, worker_key: dict[str, str], kind: Any) -> None:
    body = {"id": "w1", "pool": "pool-a", "kind": kind}
    r = client.post("/v1/workers/register", json=body, headers=worker_key)
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    assert [e["path"] for e in r.json()["errors"]] == ["kind"]


# --- heartbeats with replicas -------------------------------------------------------------------

def test_heartbeat_replicas_are_stored_and_returned_null_keeps_them_and_empty_clears_them(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str]) -> None:
    register_kind(client, worker_key, "w1", "gateway")
    before = utcnow()
    reports = [replica("draft", "10.0.0.7:8000/v1", "ejected", in_flight=0, running=None, waiting=None,
                       consecutive_failures=3, ejections=2, returns=1, next_probe_in_s=4.5),
               replica("base", "10.0.0.5:8000", running=5),  # an integer gauge is a number too
               # A countdown beside "healthy" means nothing: stored as null.
               replica("base", "10.0.0.6:8000", next_probe_in_s=9.0)]
    beat(client, worker_key, "w1", {"in_flight": 2, "replicas": reports})
    shown = listed(client, admin)["w1"]
    # Ordered by engine and replica, every field as reported.
    assert [(r["engine"], r["replica"]) for r in shown["replicas"]] == [
        ("base", "10.0.0.5:8000"), ("base", "10.0.0.6:8000"), ("draft", "10.0.0.7:8000/v1")]
    assert shown["replicas"][0] == reports[1]
    assert shown["replicas"][1] == {**reports[2], "next_probe_in_s": None}
    assert shown["replicas"][2] == reports[0]
    reported_at = dt.datetime.fromisoformat(shown["replicas_reported_at"])
    assert reported_at >= before
    # The typed client reads it as the API sends it.
    page = api_models.WorkerPage.model_validate(client.get("/v1/workers", headers=admin).json())
    assert page.items[0].kind == "gateway"
    assert page.items[0].replicas[2].next_probe_in_s == 4.5

    # Left out or null: this heartbeat says nothing about replicas, the last report stands.
    beat(client, worker_key, "w1", {"active_etag": None})
    beat(client, worker_key, "w1", {"replicas": None})
    beat(client, worker_key, "w1", None)
    kept = listed(client, admin)["w1"]
    assert kept["replicas"] == shown["replicas"]
    assert kept["replicas_reported_at"] == shown["replicas_reported_at"]

    # []: there are none now.
    beat(client, worker_key, "w1", {"replicas": []})
    cleared = listed(client, admin)["w1"]
    assert cleared["replicas"] == []
    assert dt.datetime.fromisoformat(cleared["replicas_reported_at"]) >= reported_at

    # A new report replaces the old one whole.
    beat(client, worker_key, "w1", {"replicas": [replica("ngram", "h:1")]})
    assert [r["replica"] for r in listed(client, admin)["w1"]["replicas"]] == ["h:1"]


@pytest.mark.parametrize(("change", "path"), [
    ({"in_flight": -1}, "replicas[0].in_flight"),
    ({"in_flight": False}, "replicas[0].in_flight"),
    ({"in_flight": "3"}, "replicas[0].in_flight"),
    ({"in_flight": 1.5}, "replicas[0].in_flight"),
    ({"running": -0.5}, "replicas[0].running"),
    ({"running": True}, "replicas[0].running"),
    ({"waiting": "2"}, "replicas[0].waiting"),
    ({"waiting": 1e13}, "replicas[0].waiting"),
    ({"consecutive_failures": 2**31}, "replicas[0].consecutive_failures"),
    ({"ejections": -1}, "replicas[0].ejections"),
    ({"returns": None}, "replicas[0].returns"),
    ({"next_probe_in_s": -1}, "replicas[0].next_probe_in_s"),
    ({"state": "dead"}, "replicas[0].state"),
    ({"replica": ""}, "replicas[0].replica"),
    ({"replica": "h:1\nX-Evil: 1"}, "replicas[0].replica"),
    ({"replica": "h" * 256}, "replicas[0].replica"),
    ({"replica": "h:1\x00"}, "replicas[0].replica"),
    ({"engine": ""}, "replicas[0].engine"),
    ({"engine": "e" * 64}, "replicas[0].engine"),
    ({"weight": 3}, "replicas[0].weight"),
])
def test_a_bad_replica_report_is_a_problem_naming_its_field(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str], change: dict[str, Any],
        path: str) -> None:
    register(client, worker_key, "w1")
    beat(client, worker_key, "w1", {"replicas": [replica("base", "h:1")]})
    r = client.post("/v1/workers/w1/heartbeat", json={"replicas": [replica("base", "h:2", **change)]},
                    headers=worker_key)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert [e["path"] for e in r.json()["errors"]] == [path], r.json()
    # Refused whole: the last good report stands.
    assert [x["replica"] for x in listed(client, admin)["w1"]["replicas"]] == ["h:1"]


def test_a_missing_field_an_infinite_gauge_and_a_second_replica_are_named(
        client: TestClient, worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1")
    good = replica("base", "h:1")
    missing = {k: v for k, v in replica("base", "h:2").items() if k != "state"}
    # JSON has no infinity, but Python's encoder writes one and the body parser reads it.
    body = '{"replicas": [%s, %s, {"engine": "base", "replica": "h:3", "state": "healthy", "running": Infinity}]}'
    r = client.post("/v1/workers/w1/heartbeat", content=body % (json.dumps(good), json.dumps(missing)),
                    headers={**worker_key, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    errors = {e["path"]: e["code"] for e in r.json()["errors"]}
    assert errors.get("replicas[1].state") == "missing", errors
    assert "replicas[2].running" in errors, errors


def test_each_replica_once_and_at_most_256(client: TestClient, worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1")
    twice = [replica("base", "h:1"), replica("draft", "h:1"), replica("base", "h:1", state="ejected")]
    r = client.post("/v1/workers/w1/heartbeat", json={"replicas": twice}, headers=worker_key)
    assert r.status_code == 422
    (error,) = r.json()["errors"]
    assert (error["path"], error["code"]) == ("replicas", "duplicate_key")
    assert "index 2" in error["message"]

    many = [replica("base", f"h:{i}") for i in range(257)]
    r = client.post("/v1/workers/w1/heartbeat", json={"replicas": many}, headers=worker_key)
    assert r.status_code == 422
    assert [e["path"] for e in r.json()["errors"]] == ["replicas"]
    beat(client, worker_key, "w1", {"replicas": many[:256]})


# --- reads --------------------------------------------------------------------------------------

def test_the_worker_list_filters_by_kind(client: TestClient, viewer: dict[str, str],
                                         worker_key: dict[str, str]) -> None:
    register_kind(client, worker_key, "w1", "worker")
    register_kind(client, worker_key, "w2", "gateway")
    register_kind(client, worker_key, "b1", "gateway")
    assert set(listed(client, viewer)) == {"w1", "w2", "b1"}
    assert set(listed(client, viewer, kind="worker")) == {"w1"}
    assert set(listed(client, viewer, kind="gateway")) == {"b1", "w2"}
    # With the other filters and pages.
    first = client.get("/v1/workers", params={"kind": "gateway", "limit": 1}, headers=viewer).json()
    assert [w["id"] for w in first["items"]] == ["b1"]
    rest = client.get("/v1/workers", params={"kind": "gateway", "cursor": first["next_cursor"]}, headers=viewer)
    assert [w["id"] for w in rest.json()["items"]] == ["w2"]
    assert listed(client, viewer, kind="gateway", pool="other") == {}
    for bad in ("gateways", "", "WORKER"):
        r = client.get("/v1/workers", params={"kind": bad}, headers=viewer)
        assert r.status_code == 422, bad
        assert r.headers["content-type"] == "application/problem+json"
        assert [e["path"] for e in r.json()["errors"]] == ["kind"]


def test_the_fleet_counts_gateways_and_replicas_apart_from_workers(
        client: TestClient, settings: ControlPlaneSettings, viewer: dict[str, str],
        worker_key: dict[str, str]) -> None:
    register_kind(client, worker_key, "w1", "worker")
    register_kind(client, worker_key, "w2", "worker")
    register_kind(client, worker_key, "b1", "gateway")
    register_kind(client, worker_key, "gone", "gateway")
    # A worker reports its one replica per engine; the gateway a pool with one replica ejected.
    beat(client, worker_key, "w1", {"replicas": [replica("base", "127.0.0.1:8100")]})
    beat(client, worker_key, "b1", {"replicas": [
        replica("base", "10.0.0.5:8000"), replica("base", "10.0.0.6:8000"),
        replica("base", "10.0.0.7:8000", "ejected", next_probe_in_s=2.0)]})
    # A stale gateway's replicas are not counted: nobody knows what they are now.
    beat(client, worker_key, "gone", {"replicas": [replica("base", "10.9.9.9:8000")]})
    age_heartbeat(settings.database_url, "gone", settings.worker_stale_after_s + 5)
    # Nor are those of a live worker that stopped reporting them (an older sidecar after a downgrade).
    beat(client, worker_key, "w2", {"replicas": [replica("base", "10.8.8.8:8000", "ejected")]})
    set_reported_at(settings.database_url, "w2", settings.worker_stale_after_s + 5)

    fleet = client.get("/v1/fleet", headers=viewer).json()
    # overall and pools count workers only, as before gateways existed.
    assert (fleet["overall"]["workers"], fleet["overall"]["stale"]) == (2, 0)
    assert [(p["pool"], p["workers"]) for p in fleet["pools"]] == [("pool-a", 2)]
    assert (fleet["gateways"]["workers"], fleet["gateways"]["stale"]) == (2, 1)
    assert fleet["gateways"]["converged"] is True  # no policy: nothing expected of the live one
    assert [(p["pool"], p["workers"], p["stale"]) for p in fleet["gateway_pools"]] == [("pool-a", 2, 1)]
    assert fleet["replicas"] == {"reporters": 2, "total": 4, "healthy": 3, "ejected": 1}
    assert api_models.Fleet.model_validate(fleet).replicas.ejected == 1

    # A fleet of workers only reads as it did.
    beat(client, worker_key, "b1", {"replicas": []})
    fleet = client.get("/v1/fleet", headers=viewer).json()
    assert fleet["replicas"] == {"reporters": 2, "total": 1, "healthy": 1, "ejected": 0}


# --- telemetry ------------------------------------------------------------------------------------

def test_an_event_keeps_the_replica_that_served_it_and_one_without_still_ingests(
        client: TestClient, settings: ControlPlaneSettings, viewer: dict[str, str],
        worker_key: dict[str, str]) -> None:
    seed_policy(settings.database_url)
    now = utcnow().replace(microsecond=0) - dt.timedelta(minutes=1)
    at = now.isoformat()
    older = event("old", time=at)
    older.pop("replica", None)  # a sidecar from before replica pools sends no such field
    events = [event("a", time=at, replica="10.0.0.5:8000"), event("b", time=at, replica="10.0.0.5:8000"),
              event("c", time=at, replica="host-b:8000/v1", itl_ms=30.0), older,
              event("n", time=at, replica=None, engine="base", decided_engine="base")]
    r = client.post("/v1/telemetry/batches", headers=worker_key,
                    json={"batch_id": uuid.uuid4().hex, "worker_id": "w-1", "events": events})
    assert r.status_code == 200, r.text
    assert (r.json()["stored"], r.json()["rejected_count"]) == (5, 0)
    with session_for(settings.database_url) as session:
        stored = dict(session.execute(select(TelemetryEventRecord.event_id, TelemetryEventRecord.replica)).all())
    assert stored == {"ev-a": "10.0.0.5:8000", "ev-b": "10.0.0.5:8000", "ev-c": "host-b:8000/v1",
                      "ev-old": None, "ev-n": None}

    # The raw-event summary groups by engine and replica.
    r = client.get("/v1/analysis/summary", params={"group_by": "replica"}, headers=viewer)
    assert r.status_code == 200, r.text
    rows = {(row["key"]["engine"], row["key"]["replica"]): row for row in r.json()["replicas"]}
    assert {k: v["requests"] for k, v in rows.items()} == {
        ("draft", "10.0.0.5:8000"): 2, ("draft", "host-b:8000/v1"): 1, ("draft", None): 1, ("base", None): 1}
    assert rows[("draft", "host-b:8000/v1")]["itl_ms_mean"] == pytest.approx(30.0)
    assert r.json()["workers"] is None
    r = client.get("/v1/analysis/summary", params={"group_by": "replica", "engine": "base"}, headers=viewer)
    assert [(x["key"]["engine"], x["key"]["replica"]) for x in r.json()["replicas"]] == [("base", None)]
    report = api_models.SummaryReport.model_validate(r.json())
    assert report.replicas is not None
    assert report.replicas[0].requests == 1

    r = client.get("/v1/analysis/summary", params={"group_by": "replica,route"}, headers=viewer)
    assert r.status_code == 422
    assert [(e["path"], e["code"]) for e in r.json()["errors"]] == [("group_by", "replica_alone")]


@pytest.mark.parametrize("value", ["h" * 256, "h:1\x00", 5])
def test_a_bad_replica_refuses_only_its_event(client: TestClient, settings: ControlPlaneSettings,
                                              worker_key: dict[str, str], value: Any) -> None:
    seed_policy(settings.database_url)
    at = (utcnow() - dt.timedelta(minutes=1)).isoformat()
    r = client.post("/v1/telemetry/batches", headers=worker_key, json={
        "batch_id": uuid.uuid4().hex, "worker_id": "w-1",
        "events": [event("ok", time=at, replica="h:1"), event("bad", time=at, replica=value)]})
    assert r.status_code == 200, r.text
    assert r.json()["stored"] == 1
    (rejected,) = r.json()["rejected"]
    assert rejected["index"] == 1
    assert [e["path"] for e in rejected["errors"]] == ["replica"]
