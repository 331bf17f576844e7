from __future__ import annotations

from fastapi.testclient import TestClient

from tests.support.auth import bearer


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"]["database"] == "ok"
    assert "at head" in ready.json()["checks"]["migrations"]


def test_metrics_are_prometheus_text(client: TestClient) -> None:
    client.get("/healthz")
    body = client.get("/metrics")
    assert body.headers["content-type"].startswith("text/plain")
    assert 'specgate_http_requests_total{method="GET",route="/healthz",status="200"}' in body.text
    assert "specgate_long_poll_waiters" in body.text
    assert "specgate_bundle_publishes_total 0.0" in body.text


def test_missing_and_wrong_keys_are_401_problems(client: TestClient) -> None:
    r = client.get("/v1/audit")
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("/unauthorized")
    assert client.get("/v1/audit", headers=bearer("sgk_nope")).status_code == 401
    assert client.get("/v1/audit", headers=bearer("garbage")).json()["detail"].startswith("the API key is malformed")


def test_admin_creates_scoped_key_shown_once_and_stored_hashed(client: TestClient, admin: dict[str, str]) -> None:
    r = client.post("/v1/keys", json={"name": "ci", "scope": "operator"}, headers=admin)
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    assert token.startswith("sgk_")
    listed = client.get("/v1/keys", headers=admin).json()
    assert all("token" not in k for k in listed)
    assert any(k["name"] == "ci" and k["scope"] == "operator" for k in listed)
    # The new key works, with its own scope.
    assert client.get("/v1/audit", headers=bearer(token)).status_code == 200
    assert client.get("/v1/keys", headers=bearer(token)).status_code == 403


def test_key_fields_are_validated_with_paths(client: TestClient, admin: dict[str, str]) -> None:
    r = client.post("/v1/keys", json={"name": "", "scope": "root", "extra": 1}, headers=admin)
    assert r.status_code == 422
    paths = {e["path"] for e in r.json()["errors"]}
    assert {"name", "scope", "extra"} <= paths


def test_revoked_key_stops_working_and_is_audited(client: TestClient, admin: dict[str, str]) -> None:
    created = client.post("/v1/keys", json={"name": "tmp", "scope": "viewer"}, headers=admin).json()
    r = client.delete(f"/v1/keys/{created['id']}", params={"reason": "rotated"}, headers=admin)
    assert r.status_code == 200
    assert r.json()["revoked_at"] is not None
    assert client.get("/v1/audit", headers=bearer(created["token"])).status_code == 401
    again = client.delete(f"/v1/keys/{created['id']}", headers=admin)
    assert again.status_code == 409
    events = client.get("/v1/audit", params={"action": "key.revoke"}, headers=admin).json()["items"]
    assert events[0]["reason"] == "rotated"
    assert events[0]["actor"] == "admin:alice"


def test_audit_is_newest_first_and_paginates(client: TestClient, admin: dict[str, str]) -> None:
    for i in range(5):
        client.post("/v1/keys", json={"name": f"k{i}", "scope": "viewer"}, headers=admin)
    page = client.get("/v1/audit", params={"limit": 3, "action": "key.create"}, headers=admin).json()
    ids = [e["id"] for e in page["items"]]
    assert ids == sorted(ids, reverse=True)
    assert page["next_cursor"] == ids[-1]
    rest = client.get("/v1/audit", params={"limit": 3, "action": "key.create", "cursor": page["next_cursor"]},
                      headers=admin).json()
    assert all(e["id"] < ids[-1] for e in rest["items"])
    found = client.get("/v1/audit", params={"q": "k3"}, headers=admin).json()["items"]
    assert any(e["after"]["name"] == "k3" for e in found)


def test_oversize_body_is_413_problem(client: TestClient, admin: dict[str, str]) -> None:
    r = client.post("/v1/keys", content=b"x" * 2_000_000, headers={**admin, "content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["status"] == 413


def test_malformed_json_is_422_not_500(client: TestClient, admin: dict[str, str]) -> None:
    r = client.post("/v1/keys", content=b"{not json", headers={**admin, "content-type": "application/json"})
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
