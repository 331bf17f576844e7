"""POST /v1/policies/{name}/validate (a draft checked, diffed and dry-run without being stored) and
GET /v1/whoami, on both databases."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.support.factories import seed_text

Headers = dict[str, str]


def _policy_with_revision(client: TestClient, admin: Headers, name: str = "seed") -> str:
    assert client.post("/v1/policies", json={"name": name}, headers=admin).status_code == 201
    r = client.post(f"/v1/policies/{name}/revisions", json={"document": seed_text(name), "message": "first"},
                    headers=admin)
    assert r.status_code == 201, r.text
    rid: str = r.json()["id"]
    return rid


def _count_revisions(client: TestClient, admin: Headers, name: str = "seed") -> int:
    count: int = client.get(f"/v1/policies/{name}", headers=admin).json()["revision_count"]
    return count


def test_a_valid_draft_answers_its_id_diff_and_decisions_and_stores_nothing(client: TestClient,
                                                                            admin: Headers) -> None:
    active = _policy_with_revision(client, admin)
    draft = seed_text(threshold=6)
    r = client.post("/v1/policies/seed/validate", headers=admin, json={
        "document": draft,
        "shapes": [{"route": "chat", "batch_size": 5}, {"route": "chat", "batch_size": 7}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["valid"] is True
    assert body["name"] == "seed"
    assert body["existing"] is False
    assert body["diff"]["against"] == {"id": active, "seq": 1}
    assert body["diff"]["identical"] is False
    assert body["diff"]["summary"]["rules_changed"] == ["chat-low-batch"]
    assert "-      max: 4" in body["diff"]["unified"]
    assert "+      max: 6" in body["diff"]["unified"]
    assert [e["decision"]["engine"] for e in body["evaluations"]] == ["draft", "base"]
    assert body["evaluations"][0]["decision"]["revision"] == body["revision_id"]
    assert _count_revisions(client, admin) == 1

    same = client.post("/v1/policies/seed/validate", headers=admin, json={"document": seed_text()})
    assert same.json()["existing"] is True
    assert same.json()["revision_id"] == active
    assert same.json()["diff"]["identical"] is True


def test_an_invalid_draft_is_a_problem_with_paths_and_lines(client: TestClient, admin: Headers) -> None:
    _policy_with_revision(client, admin)
    broken = seed_text().replace("batch_size: {max: 4}", "batch_size: {min: 5, max: 4}").replace(
        "then: {engine: draft}", "then: {engine: drfat}")
    r = client.post("/v1/policies/seed/validate", headers=admin, json={"document": broken})
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["type"].endswith("/invalid-policy")
    by_path = {e["path"]: e for e in problem["errors"]}
    assert by_path["rules[0].when.batch_size.max"]["code"] == "inverted_range"
    assert by_path["rules[0].when.batch_size.max"]["line"] == 8
    assert by_path["rules[0].then.engine"]["code"] == "undefined_engine"
    assert by_path["rules[0].then.engine"]["line"] == 9


def test_the_draft_must_carry_the_policys_name(client: TestClient, admin: Headers) -> None:
    _policy_with_revision(client, admin)
    r = client.post("/v1/policies/seed/validate", headers=admin, json={"document": seed_text("other")})
    assert r.status_code == 422
    assert r.json()["errors"][0]["code"] == "name_mismatch"
    missing = client.post("/v1/policies/nope/validate", headers=admin, json={"document": seed_text("nope")})
    assert missing.status_code == 404


def test_before_the_first_revision_there_is_no_diff_and_bad_shapes_are_reported(client: TestClient,
                                                                                 admin: Headers,
                                                                                 viewer: Headers) -> None:
    assert client.post("/v1/policies", json={"name": "fresh"}, headers=admin).status_code == 201
    r = client.post("/v1/policies/fresh/validate", headers=viewer, json={"document": seed_text("fresh")})
    assert r.status_code == 200, r.text
    assert r.json()["diff"] is None
    assert r.json()["evaluations"] == []
    bad = client.post("/v1/policies/fresh/validate", headers=viewer,
                      json={"document": seed_text("fresh"), "shapes": [{"route": "chat", "batch_size": "4"}]})
    assert bad.status_code == 422
    assert bad.json()["errors"][0]["path"] == "shapes[0].batch_size"


def test_validate_needs_a_read_key(client: TestClient, admin: Headers, worker_key: Headers) -> None:
    _policy_with_revision(client, admin)
    body = {"document": seed_text()}
    assert client.post("/v1/policies/seed/validate", json=body, headers=worker_key).status_code == 403
    assert client.post("/v1/policies/seed/validate", json=body).status_code == 401
    yaml_body = client.post("/v1/policies/seed/validate", content=seed_text().encode(),
                            headers={**admin, "content-type": "application/yaml"})
    assert yaml_body.status_code == 415


def test_whoami_names_the_caller_and_its_scope(client: TestClient, admin: Headers, operator: Headers,
                                                viewer: Headers, worker_key: Headers) -> None:
    seen = {}
    for headers in (admin, operator, viewer, worker_key):
        r = client.get("/v1/whoami", headers=headers)
        assert r.status_code == 200, r.text
        seen[r.json()["scope"]] = r.json()["actor"]
    assert seen == {"admin": "admin:alice", "operator": "operator:olga", "viewer": "viewer:victor",
                    "worker": "worker:pool-a"}
    assert client.get("/v1/whoami").status_code == 401
    assert client.get("/v1/whoami", headers={"Authorization": "Bearer sgk_unknown"}).status_code == 401
