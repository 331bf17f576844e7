from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from controlplane.settings import ControlPlaneSettings
from tests.support.factories import seed_policy
from tests.support.fleet_rows import age_heartbeat, register, set_kill_switch


def audit(client: TestClient, admin: dict[str, str], action: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = client.get("/v1/audit", params={"action": action}, headers=admin).json()["items"]
    return items


def test_register_creates_then_updates_and_audits_only_changes(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str]) -> None:
    body = {"id": "gpu-01.us-east:1", "pool": "pool-a", "labels": {"zone": "a"},
            "engines": {"base": "http://127.0.0.1:8000"}, "sidecar_version": "0.1.0"}
    first = client.post("/v1/workers/register", json=body, headers=worker_key)
    assert first.status_code == 201, first.text
    assert first.json()["id"] == "gpu-01.us-east:1"
    assert first.json()["stale"] is False
    # A sidecar restart registers again with the same facts: no new audit event.
    again = client.post("/v1/workers/register", json={**body, "sidecar_version": "0.1.1"}, headers=worker_key)
    assert again.status_code == 200
    assert again.json()["sidecar_version"] == "0.1.1"
    assert len(audit(client, admin, "worker.register")) == 1
    moved = client.post("/v1/workers/register", json={**body, "labels": {"zone": "b"}}, headers=worker_key)
    assert moved.status_code == 200
    events = audit(client, admin, "worker.register")
    assert len(events) == 2
    assert events[0]["before"]["labels"] == {"zone": "a"}
    assert events[0]["after"]["labels"] == {"zone": "b"}
    assert events[0]["actor"] == "worker:pool-a"
    assert events[0]["target_id"] == "gpu-01.us-east:1"
    # Heartbeats are not state changes worth auditing.
    assert client.post("/v1/workers/gpu-01.us-east:1/heartbeat", json={}, headers=worker_key).status_code == 200
    assert len(audit(client, admin, "worker.register")) == 2


@pytest.mark.parametrize(("field", "value"), [
    ("id", "has space"), ("id", ""), ("id", "x" * 129), ("pool", ""), ("pool", "a\x00b"),
    ("labels", {"zone": 3}), ("labels", {"zone": "a\nb"}), ("engines", ["base"]),
    ("engines", {"base": "nul\x00"}), ("sidecar_version", "v" * 65),
])
def test_register_validates_fields_with_paths(client: TestClient, worker_key: dict[str, str],
                                              field: str, value: Any) -> None:
    body: dict[str, Any] = {"id": "w1", "pool": "pool-a", "labels": {}, "engines": {}, "sidecar_version": "1"}
    body[field] = value
    r = client.post("/v1/workers/register", json=body, headers=worker_key)
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    assert any(e["path"].split(".")[0] == field for e in r.json()["errors"]), r.json()


def test_only_worker_keys_register_and_heartbeat(client: TestClient, admin: dict[str, str],
                                                 viewer: dict[str, str], worker_key: dict[str, str]) -> None:
    body = {"id": "w1", "pool": "pool-a", "labels": {}, "engines": {}, "sidecar_version": "1"}
    assert client.post("/v1/workers/register", json=body, headers=admin).status_code == 403
    assert client.post("/v1/workers/register", json=body, headers=viewer).status_code == 403
    assert client.post("/v1/workers/register", json=body).status_code == 401
    register(client, worker_key, "w1")
    assert client.post("/v1/workers/w1/heartbeat", json={}, headers=viewer).status_code == 403


def test_heartbeat_unknown_worker_is_404(client: TestClient, worker_key: dict[str, str]) -> None:
    r = client.post("/v1/workers/ghost/heartbeat", json={"active_etag": None}, headers=worker_key)
    assert r.status_code == 404
    assert r.json()["type"].endswith("/worker-not-found")


def test_heartbeat_reports_expected_etag_and_stores_what_the_worker_runs(
        client: TestClient, settings: ControlPlaneSettings, admin: dict[str, str],
        worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1")
    # No policy yet: nothing to expect, and the heartbeat still counts.
    r = client.post("/v1/workers/w1/heartbeat", json={}, headers=worker_key)
    assert r.status_code == 200
    assert r.json() == {"expected_etag": None, "converged": True}

    _, (rev,) = seed_policy(settings.database_url)
    served = client.get("/v1/bundle", params={"worker": "w1"}, headers=worker_key)
    etag = served.json()["etag"]
    ack = client.post("/v1/workers/w1/heartbeat", json={"active_revision": "old", "active_etag": "stale"},
                      headers=worker_key).json()
    assert ack == {"expected_etag": etag, "converged": False}
    # Quoted, as the ETag header carries it: stored bare.
    ack = client.post("/v1/workers/w1/heartbeat", json={"active_revision": rev, "active_etag": f'"{etag}"',
                                                       "in_flight": 3}, headers=worker_key).json()
    assert ack == {"expected_etag": etag, "converged": True}
    (listed,) = client.get("/v1/workers", headers=admin).json()["items"]
    assert listed["active_revision"] == rev
    assert listed["active_etag"] == etag
    assert listed["expected_etag"] == etag
    assert listed["converged"] is True
    # Leaving fields out keeps what was reported.
    client.post("/v1/workers/w1/heartbeat", headers=worker_key)
    (listed,) = client.get("/v1/workers", headers=admin).json()["items"]
    assert listed["active_etag"] == etag


def test_heartbeat_body_is_validated(client: TestClient, worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1")
    r = client.post("/v1/workers/w1/heartbeat", json={"in_flight": -1, "surprise": 1, "active_etag": "e" * 65,
                                                     "active_revision": "\x00"}, headers=worker_key)
    assert r.status_code == 422
    assert {e["path"] for e in r.json()["errors"]} == {"in_flight", "surprise", "active_etag", "active_revision"}
    # A weak, quoted tag is stored bare.
    r = client.post("/v1/workers/w1/heartbeat", json={"active_etag": 'W/"' + "e" * 64 + '"'}, headers=worker_key)
    assert r.status_code == 200


def test_worker_queries_are_validated(client: TestClient, viewer: dict[str, str]) -> None:
    for params in ({"pool": "a\x00"}, {"cursor": "\x00"}, {"stale": "maybe"}, {"limit": 1001}):
        r = client.get("/v1/workers", params=params, headers=viewer)
        assert r.status_code == 422, params
        assert [e["path"] for e in r.json()["errors"]] == list(params)


def test_stale_workers_are_flagged_filtered_and_revived_by_heartbeat(
        client: TestClient, settings: ControlPlaneSettings, viewer: dict[str, str],
        worker_key: dict[str, str]) -> None:
    for worker_id in ("w1", "w2", "w3"):
        register(client, worker_key, worker_id)
    age_heartbeat(settings.database_url, "w2", settings.worker_stale_after_s + 1)
    listed = {w["id"]: w["stale"] for w in client.get("/v1/workers", headers=viewer).json()["items"]}
    assert listed == {"w1": False, "w2": True, "w3": False}
    stale = client.get("/v1/workers", params={"stale": "true"}, headers=viewer).json()["items"]
    assert [w["id"] for w in stale] == ["w2"]
    live = client.get("/v1/workers", params={"stale": "false"}, headers=viewer).json()["items"]
    assert [w["id"] for w in live] == ["w1", "w3"]
    client.post("/v1/workers/w2/heartbeat", json={}, headers=worker_key)
    assert client.get("/v1/workers", params={"stale": "true"}, headers=viewer).json()["items"] == []


def test_workers_paginate_and_filter_by_pool(client: TestClient, operator: dict[str, str],
                                             worker_key: dict[str, str]) -> None:
    for i in range(5):
        register(client, worker_key, f"a-{i}", pool="pool-a")
    register(client, worker_key, "b-0", pool="pool-b")
    page = client.get("/v1/workers", params={"limit": 2, "pool": "pool-a"}, headers=operator).json()
    seen = [w["id"] for w in page["items"]]
    assert seen == ["a-0", "a-1"]
    while page["next_cursor"]:
        page = client.get("/v1/workers", params={"limit": 2, "pool": "pool-a", "cursor": page["next_cursor"]},
                          headers=operator).json()
        seen += [w["id"] for w in page["items"]]
    assert seen == [f"a-{i}" for i in range(5)]
    assert [w["id"] for w in client.get("/v1/workers", params={"pool": "pool-b"},
                                         headers=operator).json()["items"]] == ["b-0"]
    assert client.get("/v1/workers", params={"limit": 0}, headers=operator).status_code == 422


def test_worker_keys_cannot_read_the_fleet(client: TestClient, worker_key: dict[str, str]) -> None:
    assert client.get("/v1/workers", headers=worker_key).status_code == 403
    assert client.get("/v1/fleet", headers=worker_key).status_code == 403


def test_fleet_converges_when_every_live_worker_reports_its_expected_etag(
        client: TestClient, settings: ControlPlaneSettings, viewer: dict[str, str],
        worker_key: dict[str, str]) -> None:
    _, (rev,) = seed_policy(settings.database_url)
    for worker_id, pool in (("a1", "pool-a"), ("a2", "pool-a"), ("b1", "pool-b"), ("gone", "pool-b")):
        register(client, worker_key, worker_id, pool=pool)
    age_heartbeat(settings.database_url, "gone", settings.worker_stale_after_s + 5)

    fleet = client.get("/v1/fleet", headers=viewer).json()
    assert fleet["overall"]["workers"] == 4
    assert fleet["overall"]["stale"] == 1
    assert fleet["overall"]["converged"] is False
    assert [p["pool"] for p in fleet["pools"]] == ["pool-a", "pool-b"]

    def report(worker_id: str) -> None:
        etag = client.get("/v1/bundle", params={"worker": worker_id}, headers=worker_key).json()["etag"]
        client.post(f"/v1/workers/{worker_id}/heartbeat", json={"active_revision": rev, "active_etag": etag},
                    headers=worker_key)

    report("a1")
    report("a2")
    fleet = client.get("/v1/fleet", headers=viewer).json()
    pools = {p["pool"]: p for p in fleet["pools"]}
    assert pools["pool-a"]["converged"] is True
    assert pools["pool-b"]["converged"] is False
    assert fleet["overall"]["converged"] is False
    report("b1")
    fleet = client.get("/v1/fleet", headers=viewer).json()
    # The stale worker never reported, and does not hold convergence back.
    assert fleet["overall"]["converged"] is True
    assert fleet["overall"]["converged_workers"] == 3
    assert fleet["overall"]["revisions"] == [{"revision": rev, "workers": 3}]

    # A change to every bundle un-converges the fleet until workers catch up.
    set_kill_switch(settings.database_url, True)
    fleet = client.get("/v1/fleet", headers=viewer).json()
    assert fleet["kill_switch"] is True
    assert fleet["overall"]["converged"] is False
    assert fleet["overall"]["converged_workers"] == 0
