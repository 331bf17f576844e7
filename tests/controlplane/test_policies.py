"""The policy API: policies, revisions, If-Match, diffs and evaluation, on both databases."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.models import FleetState, Revision
from controlplane.policy import service
from controlplane.policy.repository import RevisionRepository
from tests.support.factories import seed_text

Headers = dict[str, str]

# These tests count how many times an action bumped the generation.
pytestmark = pytest.mark.usefixtures("generations_count_changes")
YAML = {"content-type": "application/yaml"}


def make_policy(client: TestClient, headers: Headers, name: str = "seed", **fields: Any) -> dict[str, Any]:
    r = client.post("/v1/policies", json={"name": name, **fields}, headers=headers)
    assert r.status_code == 201, r.text
    created: dict[str, Any] = r.json()
    return created


def post_yaml(client: TestClient, headers: Headers, text: str, *, policy: str = "seed",
              if_match: str | None = None, **params: str) -> httpx.Response:
    extra = {**YAML, **({"If-Match": if_match} if if_match is not None else {})}
    r: httpx.Response = client.post(f"/v1/policies/{policy}/revisions", content=text.encode(), params=params,
                                    headers={**headers, **extra})
    return r


def first_revision(client: TestClient, headers: Headers, name: str = "seed", pool: str | None = None) -> str:
    make_policy(client, headers, name, pool=pool)
    r = post_yaml(client, headers, seed_text(name), policy=name)
    assert r.status_code == 201, r.text
    rid: str = r.json()["id"]
    return rid


def generation(client: TestClient) -> int:
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        return int(session.get(FleetState, 1).generation)


@pytest.fixture
def notified(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """Generations handed to the hub (on PostgreSQL the NOTIFY listener adds its own echoes)."""
    hub = client.app.state.hub  # type: ignore[attr-defined]
    real = hub.notify
    seen: list[int | None] = []

    def notify(gen: int | None = None) -> None:
        seen.append(gen)
        real(gen)

    monkeypatch.setattr(hub, "notify", notify)
    return seen


def revision_events(client: TestClient, headers: Headers) -> int:
    return len(client.get("/v1/audit", params={"action": "revision.create"}, headers=headers).json()["items"])


def problem_paths(r: httpx.Response) -> set[str]:
    assert r.headers["content-type"] == "application/problem+json", r.text
    return {e["path"] for e in r.json()["errors"]}


# --- policies ------------------------------------------------------------------------------

def test_create_list_and_get_policy(client: TestClient, admin: Headers, viewer: Headers) -> None:
    r = client.post("/v1/policies", json={"name": "seed", "description": "chat", "pool": "a"}, headers=admin)
    assert r.status_code == 201, r.text
    assert r.headers["location"] == "/v1/policies/seed"
    created = r.json()
    assert created["created_by"] == "admin:alice"
    assert created["active_revision_id"] is None
    assert created["head_revision_id"] is None
    assert created["revision_count"] == 0
    make_policy(client, admin, "other")

    listed = client.get("/v1/policies", headers=viewer).json()
    assert [p["name"] for p in listed] == ["other", "seed"]
    got = client.get("/v1/policies/seed", headers=viewer).json()
    assert got == created
    missing = client.get("/v1/policies/nope", headers=viewer)
    assert missing.status_code == 404
    assert missing.json()["type"].endswith("/not-found")


def test_list_shows_active_head_and_count(client: TestClient, admin: Headers) -> None:
    first = first_revision(client, admin)
    second = post_yaml(client, admin, seed_text(threshold=6), if_match=f'"{first}"').json()["id"]
    make_policy(client, admin, "empty", pool="b")
    by_name = {p["name"]: p for p in client.get("/v1/policies", headers=admin).json()}
    assert by_name["seed"]["active_revision_id"] == first
    assert by_name["seed"]["head_revision_id"] == second
    assert by_name["seed"]["revision_count"] == 2
    assert by_name["empty"]["head_revision_id"] is None
    assert by_name["empty"]["revision_count"] == 0
    assert client.get("/v1/policies/seed", headers=admin).json()["revision_count"] == 2


def test_policy_fields_are_validated_with_paths(client: TestClient, admin: Headers) -> None:
    r = client.post("/v1/policies", json={"name": "-bad name", "pool": "has space", "colour": 1},
                    headers=admin)
    assert r.status_code == 422
    assert {"name", "pool", "colour"} <= problem_paths(r)
    too_long = client.post("/v1/policies", json={"name": "a" * 64}, headers=admin)
    assert too_long.status_code == 422
    assert problem_paths(too_long) == {"name"}
    nul = client.post("/v1/policies", json={"name": "ok", "description": "a\u0000b"}, headers=admin)
    assert nul.status_code == 422
    assert problem_paths(nul) == {"description"}
    assert client.get("/v1/policies", headers=admin).json() == []


def test_policy_name_and_pool_conflicts(client: TestClient, admin: Headers) -> None:
    make_policy(client, admin, "seed", pool="a")
    same_name = client.post("/v1/policies", json={"name": "seed", "pool": "z"}, headers=admin)
    assert same_name.status_code == 409
    assert problem_paths(same_name) == {"name"}
    same_pool = client.post("/v1/policies", json={"name": "other", "pool": "a"}, headers=admin)
    assert same_pool.status_code == 409
    assert problem_paths(same_pool) == {"pool"}
    assert same_pool.json()["policy"] == "seed"

    make_policy(client, admin, "fallback")  # the one pool-less policy
    second_poolless = client.post("/v1/policies", json={"name": "fallback2"}, headers=admin)
    assert second_poolless.status_code == 409
    assert second_poolless.json()["policy"] == "fallback"
    make_policy(client, admin, "pool-b", pool="b")
    assert sorted(p["name"] for p in client.get("/v1/policies", headers=admin).json()) == [
        "fallback", "pool-b", "seed"]


def test_policy_create_is_audited_and_announced(client: TestClient, admin: Headers,
                                                notified: list[int | None]) -> None:
    before = generation(client)
    policy = make_policy(client, admin, "seed", pool="a")
    # A pool that gains a policy may stop falling back to the pool-less one.
    assert generation(client) == before + 1
    assert before + 1 in notified
    events = client.get("/v1/audit", params={"action": "policy.create"}, headers=admin).json()["items"]
    assert len(events) == 1
    assert events[0]["actor"] == "admin:alice"
    assert events[0]["target_type"] == "policy"
    assert events[0]["target_id"] == "seed"
    assert events[0]["after"]["id"] == policy["id"]
    assert events[0]["after"]["pool"] == "a"


def test_policy_create_needs_json(client: TestClient, admin: Headers) -> None:
    r = client.post("/v1/policies", content=b'{"name": "seed"}',
                    headers={**admin, "content-type": "text/plain"})
    assert r.status_code == 415
    assert problem_paths(r) == {"Content-Type"}


# --- creating revisions ----------------------------------------------------------------------

def test_first_yaml_revision_is_created_active_and_audited(client: TestClient, admin: Headers,
                                                           notified: list[int | None]) -> None:
    make_policy(client, admin)
    before = generation(client)
    r = post_yaml(client, admin, seed_text(), message="first cut")
    assert r.status_code == 201, r.text
    body = r.json()
    assert r.headers["etag"] == f'"{body["id"]}"'
    assert r.headers["location"] == f"/v1/revisions/{body['id']}"
    assert "x-specgate-unchanged" not in r.headers
    assert len(body["id"]) == 64
    assert (body["seq"], body["parent_id"], body["active"]) == (1, None, True)
    assert body["author"] == "admin:alice"
    assert body["message"] == "first cut"
    assert body["policy"] == "seed"
    assert body["source_text"] == seed_text()
    assert body["document"]["rules"][0]["name"] == "chat-low-batch"
    assert "max: 4" in body["canonical_yaml"]
    assert generation(client) == before + 1
    assert before + 1 in notified

    policy = client.get("/v1/policies/seed", headers=admin).json()
    assert policy["active_revision_id"] == body["id"]
    events = client.get("/v1/audit", params={"action": "revision.create"}, headers=admin).json()["items"]
    assert len(events) == 1
    assert events[0]["actor"] == "admin:alice"
    assert events[0]["target_id"] == body["id"]
    assert events[0]["after"]["id"] == body["id"]
    assert events[0]["after"]["seq"] == 1
    assert events[0]["after"]["message"] == "first cut"
    assert events[0]["after"]["activated"] is True


def test_later_revision_is_a_draft(client: TestClient, admin: Headers) -> None:
    first = first_revision(client, admin)
    before = generation(client)
    r = post_yaml(client, admin, seed_text(threshold=6), if_match=f'"{first}"',
                  message="raise the threshold")
    assert r.status_code == 201, r.text
    second = r.json()
    assert (second["seq"], second["parent_id"], second["active"]) == (2, first, False)
    policy = client.get("/v1/policies/seed", headers=admin).json()
    assert policy["active_revision_id"] == first
    assert policy["head_revision_id"] == second["id"]
    assert generation(client) == before  # a draft changes no worker's bundle
    events = client.get("/v1/audit", params={"action": "revision.create"}, headers=admin).json()["items"]
    assert events[0]["after"] == {"id": second["id"], "seq": 2, "message": "raise the threshold",
                                  "policy": "seed", "parent_id": first, "activated": False}


@pytest.mark.parametrize("media", ["application/yaml", "text/yaml", "application/x-yaml",
                                   "text/yaml; charset=utf-8"])
def test_every_yaml_media_type_is_accepted(client: TestClient, admin: Headers, media: str) -> None:
    make_policy(client, admin)
    r = client.post("/v1/policies/seed/revisions", content=seed_text().encode(),
                    headers={**admin, "content-type": media, "X-Specgate-Message": "from a header"})
    assert r.status_code == 201, r.text
    assert r.json()["message"] == "from a header"


def test_json_body_with_mapping_or_text(client: TestClient, admin: Headers) -> None:
    make_policy(client, admin)
    as_text = client.post("/v1/policies/seed/revisions", json={"document": seed_text(), "message": "text"},
                          headers=admin)
    assert as_text.status_code == 201, as_text.text
    assert as_text.json()["message"] == "text"
    assert as_text.json()["source_text"] == seed_text()

    mapping = dict(as_text.json()["document"])
    mapping["rules"] = [{**mapping["rules"][0], "when": {"route": ["chat"], "batch_size": {"max": 8}}}]
    as_mapping = client.post("/v1/policies/seed/revisions", json={"document": mapping, "message": "map"},
                             headers={**admin, "If-Match": as_text.json()["id"]})
    assert as_mapping.status_code == 201, as_mapping.text
    assert as_mapping.json()["seq"] == 2
    assert as_mapping.json()["document"]["rules"][0]["when"]["batch_size"] == {"max": 8}
    assert '"max": 8' in as_mapping.json()["source_text"]


def test_json_body_errors_name_the_field(client: TestClient, admin: Headers) -> None:
    make_policy(client, admin)
    url = "/v1/policies/seed/revisions"
    wrong = client.post(url, json={"document": 5, "colour": "red"}, headers=admin)
    assert wrong.status_code == 422
    assert {"document", "colour"} <= problem_paths(wrong)
    broken = client.post(url, content=b'{"document":\n  oops}',
                         headers={**admin, "content-type": "application/json"})
    assert broken.status_code == 422
    assert broken.json()["errors"][0]["code"] == "invalid_json"
    assert broken.json()["errors"][0]["line"] == 2
    # A mapping has no lines, but every error still has its path.
    bad = client.post(url, json={"document": {"apiVersion": "specgate/v1", "name": "seed", "engines": {}}},
                      headers=admin)
    assert bad.status_code == 422
    assert {"engines", "default"} <= problem_paths(bad)
    assert client.get("/v1/policies/seed", headers=admin).json()["revision_count"] == 0


INVALID = """\
apiVersion: specgate/v1
name: seed
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
rules:
  - name: chat-low-batch
    when: {route: [chat], batch_size: {max: -1}}
    then: {engine: drfat}
default: {engine: base}
"""


def test_invalid_document_reports_every_error_with_path_and_line(client: TestClient, admin: Headers) -> None:
    make_policy(client, admin)
    r = post_yaml(client, admin, INVALID)
    assert r.status_code == 422
    problem = r.json()
    assert problem["type"].endswith("/invalid-policy")
    by_path = {e["path"]: e for e in problem["errors"]}
    assert by_path["rules[0].when.batch_size.max"]["line"] == 8
    assert by_path["rules[0].when.batch_size.max"]["code"] == "out_of_range"
    assert by_path["rules[0].then.engine"]["line"] == 9
    assert by_path["rules[0].then.engine"]["code"] == "undefined_engine"
    assert "did you mean 'draft'" in by_path["rules[0].then.engine"]["message"]
    assert problem["detail"] == "the document has 2 errors"

    # The same text inside a JSON body keeps its line numbers.
    as_json = client.post("/v1/policies/seed/revisions", json={"document": INVALID}, headers=admin)
    assert as_json.status_code == 422
    assert {e["line"] for e in as_json.json()["errors"]} == {8, 9}


def test_malformed_yaml_is_422_with_a_line(client: TestClient, admin: Headers) -> None:
    make_policy(client, admin)
    r = post_yaml(client, admin, "apiVersion: specgate/v1\nname: seed\nengines: {base: [method: none}\n")
    assert r.status_code == 422
    [error] = r.json()["errors"]
    assert error["code"] == "yaml_syntax"
    assert error["line"] == 3
    empty = post_yaml(client, admin, "")
    assert empty.status_code == 422
    assert empty.json()["errors"][0]["code"] == "empty_document"
    not_utf8 = client.post("/v1/policies/seed/revisions", content=b"name: \xff\xfe",
                           headers={**admin, **YAML})
    assert not_utf8.status_code == 422
    assert not_utf8.json()["errors"][0]["code"] == "invalid_encoding"


def test_name_mismatch_is_422(client: TestClient, admin: Headers) -> None:
    make_policy(client, admin)
    r = post_yaml(client, admin, seed_text("other"))
    assert r.status_code == 422
    assert r.json()["errors"] == [{"path": "name", "code": "name_mismatch",
                                   "message": "document name 'other' differs from policy 'seed'"}]


@pytest.mark.parametrize("media", [None, "text/plain", "application/xml", "text/yaml; charset=latin-1"])
def test_other_content_types_are_415(client: TestClient, admin: Headers, media: str | None) -> None:
    make_policy(client, admin)
    headers = {**admin, **({"content-type": media} if media else {})}
    r = client.post("/v1/policies/seed/revisions", content=seed_text().encode(), headers=headers)
    assert r.status_code == 415
    assert r.json()["type"].endswith("/unsupported-media-type")
    assert problem_paths(r) == {"Content-Type"}


def test_revision_of_unknown_policy_is_404(client: TestClient, admin: Headers) -> None:
    r = post_yaml(client, admin, seed_text(), policy="ghost")
    assert r.status_code == 404


def test_if_match_is_required_and_checked(client: TestClient, admin: Headers) -> None:
    first = first_revision(client, admin)
    missing = post_yaml(client, admin, seed_text(threshold=5))
    assert missing.status_code == 428
    assert missing.json()["current_head"] == first

    for wrong in ('"deadbeef"', "deadbeef", f'W/"{first}"'):
        stale = post_yaml(client, admin, seed_text(threshold=5), if_match=wrong)
        assert stale.status_code == 412, wrong
        assert stale.json()["current_head"] == first
        assert stale.headers["etag"] == f'"{first}"'
    malformed = post_yaml(client, admin, seed_text(threshold=5), if_match='"unterminated')
    assert malformed.status_code == 400
    assert problem_paths(malformed) == {"If-Match"}
    assert client.get("/v1/policies/seed", headers=admin).json()["revision_count"] == 1

    quoted = post_yaml(client, admin, seed_text(threshold=5), if_match=f'"{first}"')
    assert quoted.status_code == 201
    bare = post_yaml(client, admin, seed_text(threshold=6), if_match=quoted.json()["id"])
    assert bare.status_code == 201
    listed = post_yaml(client, admin, seed_text(threshold=7), if_match=f'"nope", "{bare.json()["id"]}"')
    assert listed.status_code == 201
    star = post_yaml(client, admin, seed_text(threshold=8), if_match="*")
    assert star.status_code == 201
    assert star.json()["seq"] == 5
    assert star.json()["parent_id"] == listed.json()["id"]


def test_if_match_on_a_policy_without_revisions(client: TestClient, admin: Headers) -> None:
    make_policy(client, admin)
    wrong = post_yaml(client, admin, seed_text(), if_match='"deadbeef"')
    assert wrong.status_code == 412
    assert wrong.json()["current_head"] is None
    assert post_yaml(client, admin, seed_text(), if_match="*").status_code == 201


def test_same_document_answers_200_with_the_existing_revision(client: TestClient, admin: Headers) -> None:
    first = first_revision(client, admin)
    second = post_yaml(client, admin, seed_text(threshold=6), if_match=first).json()["id"]
    events_before = revision_events(client, admin)

    again = post_yaml(client, admin, seed_text(threshold=6))  # no If-Match needed: nothing is added
    assert again.status_code == 200
    assert again.headers["x-specgate-unchanged"] == "true"
    assert again.json()["id"] == second
    assert again.headers["etag"] == f'"{second}"'
    # Same meaning, different spelling (explicit defaults, other layout): same revision.
    respelled = seed_text().replace("default: {engine: base}",
                                    "default:\n  engine: base\nexploration: {rate: 0.0}")
    old = post_yaml(client, admin, respelled, if_match="*")
    assert old.status_code == 200
    assert old.json()["id"] == first
    assert old.json()["seq"] == 1

    assert client.get("/v1/policies/seed", headers=admin).json()["revision_count"] == 2
    events_after = revision_events(client, admin)
    assert events_after == events_before


# --- races ---------------------------------------------------------------------------------

def _stale_head(monkeypatch: pytest.MonkeyPatch, times: int) -> list[str]:
    """Make the first ``times`` head lookups return seq 1, as if a rival's insert were not visible yet."""
    real = RevisionRepository.head
    calls: list[str] = []

    def head(self: RevisionRepository, policy_id: str) -> Revision | None:
        calls.append(policy_id)
        if len(calls) <= times:
            return self.session.scalar(select(Revision).where(Revision.policy_id == policy_id,
                                                              Revision.seq == 1))
        return real(self, policy_id)

    monkeypatch.setattr(RevisionRepository, "head", head)
    return calls


def test_losing_a_seq_race_is_412_against_the_new_head(client: TestClient, admin: Headers,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    first = first_revision(client, admin)
    second = post_yaml(client, admin, seed_text(threshold=6), if_match=first).json()["id"]
    calls = _stale_head(monkeypatch, times=1)
    r = post_yaml(client, admin, seed_text(threshold=7), if_match=first)
    assert len(calls) == 2  # the insert collided on seq 2, and the retry saw the real head
    assert r.status_code == 412, r.text
    assert r.json()["current_head"] == second


def test_losing_a_seq_race_with_star_takes_the_next_seq(client: TestClient, admin: Headers,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    first = first_revision(client, admin)
    second = post_yaml(client, admin, seed_text(threshold=6), if_match=first).json()["id"]
    _stale_head(monkeypatch, times=1)
    r = post_yaml(client, admin, seed_text(threshold=7), if_match="*")
    assert r.status_code == 201, r.text
    assert (r.json()["seq"], r.json()["parent_id"]) == (3, second)


def test_losing_every_attempt_is_a_409_problem(client: TestClient, admin: Headers,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    first = first_revision(client, admin)
    post_yaml(client, admin, seed_text(threshold=6), if_match=first)
    calls = _stale_head(monkeypatch, times=99)
    r = post_yaml(client, admin, seed_text(threshold=7), if_match="*")
    assert r.status_code == 409
    assert r.headers["content-type"] == "application/problem+json"
    assert len(calls) == 3  # bounded retries
    assert client.get("/v1/policies/seed", headers=admin).json()["revision_count"] == 2


def test_concurrent_submissions_never_fail_with_5xx(client: TestClient, admin: Headers) -> None:
    first_revision(client, admin)
    statuses: list[int] = []
    barrier = threading.Barrier(6)

    def submit(threshold: int) -> None:
        barrier.wait()
        statuses.append(post_yaml(client, admin, seed_text(threshold=threshold), if_match="*").status_code)

    threads = [threading.Thread(target=submit, args=(10 + i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(statuses) <= {201, 409}, statuses
    assert 201 in statuses
    seqs = [r["seq"] for r in client.get("/v1/policies/seed/revisions", headers=admin).json()["items"]]
    assert sorted(seqs) == list(range(1, statuses.count(201) + 2))


# --- reading revisions -------------------------------------------------------------------------

def test_revisions_list_newest_first_with_cursor(client: TestClient, admin: Headers, viewer: Headers) -> None:
    head = first_revision(client, admin)
    ids = [head]
    for threshold in (5, 6, 7, 8):
        head = post_yaml(client, admin, seed_text(threshold=threshold), if_match=head,
                         message=f"t{threshold}").json()["id"]
        ids.append(head)
    page = client.get("/v1/policies/seed/revisions", params={"limit": 2}, headers=viewer).json()
    assert [r["seq"] for r in page["items"]] == [5, 4]
    assert page["next_cursor"] == 4
    assert page["items"][0]["message"] == "t8"
    assert page["items"][0]["parent_id"] == ids[3]
    rest = client.get("/v1/policies/seed/revisions", params={"limit": 2, "cursor": 4}, headers=viewer).json()
    assert [r["seq"] for r in rest["items"]] == [3, 2]
    last = client.get("/v1/policies/seed/revisions", params={"limit": 2, "cursor": 2}, headers=viewer).json()
    assert [(r["seq"], r["active"]) for r in last["items"]] == [(1, True)]
    assert last["next_cursor"] is None
    assert [r["active"] for r in page["items"] + rest["items"]] == [False] * 4
    bad = client.get("/v1/policies/seed/revisions", params={"limit": 0, "cursor": 2**40}, headers=viewer)
    assert bad.status_code == 422
    assert problem_paths(bad) == {"limit", "cursor"}
    assert client.get("/v1/policies/ghost/revisions", headers=viewer).status_code == 404


def test_get_revision_has_document_yaml_source_and_etag(client: TestClient, admin: Headers,
                                                        viewer: Headers) -> None:
    rid = first_revision(client, admin)
    r = client.get(f"/v1/revisions/{rid}", headers=viewer)
    assert r.status_code == 200
    assert r.headers["etag"] == f'"{rid}"'
    body = r.json()
    assert body["id"] == rid
    assert body["policy"] == "seed"
    assert body["active"] is True
    assert body["source_text"] == seed_text()
    assert body["canonical_yaml"].startswith("apiVersion: specgate/v1\nname: seed\n")
    assert body["document"]["engines"]["draft"]["num_speculative_tokens"] == 3
    assert body["document"]["guardrails"]["min_samples"] == 200  # defaults are filled in
    missing = client.get("/v1/revisions/" + "0" * 64, headers=viewer)
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"


# --- diffs ----------------------------------------------------------------------------------

EXTRA_RULE = """\
  - name: extract-ngram
    when: {route: [extract]}
    then: {engine: base}
"""


def test_diff_defaults_to_active_against_head(client: TestClient, admin: Headers, viewer: Headers) -> None:
    first = first_revision(client, admin)
    second = post_yaml(client, admin, seed_text(threshold=6), if_match=first).json()["id"]
    r = client.get("/v1/policies/seed/diff", headers=viewer)
    assert r.status_code == 200, r.text
    diff = r.json()
    assert (diff["from"]["id"], diff["to"]["id"]) == (first, second)
    assert (diff["from"]["seq"], diff["to"]["seq"]) == (1, 2)
    assert diff["identical"] is False
    lines = diff["unified"].splitlines()
    assert "-      max: 4" in lines
    assert "+      max: 6" in lines
    assert lines[0].startswith("--- seed@1")
    assert diff["summary"]["rules_changed"] == ["chat-low-batch"]
    assert diff["summary"]["rules_added"] == diff["summary"]["rules_removed"] == []
    assert diff["summary"]["engines_changed"] == []


def test_diff_between_named_revisions_summarises_rules(client: TestClient, admin: Headers) -> None:
    first = first_revision(client, admin)
    with_rule = seed_text().replace("default:", EXTRA_RULE + "default:")
    second = post_yaml(client, admin, with_rule, if_match=first).json()["id"]
    diff = client.get("/v1/policies/seed/diff", params={"from": second, "to": first}, headers=admin).json()
    assert diff["summary"]["rules_removed"] == ["extract-ngram"]
    assert diff["summary"]["rules_added"] == []
    assert "-- name: extract-ngram" in diff["unified"].splitlines()
    forward = client.get("/v1/policies/seed/diff", params={"from": first, "to": second}, headers=admin).json()
    assert forward["summary"]["rules_added"] == ["extract-ngram"]
    same = client.get("/v1/policies/seed/diff", params={"from": first, "to": first}, headers=admin).json()
    assert same["identical"] is True
    assert same["unified"] == ""


def test_diff_of_unknown_revision_names_the_parameter(client: TestClient, admin: Headers) -> None:
    first_revision(client, admin)
    other = first_revision(client, admin, "other", pool="o")
    r = client.get("/v1/policies/seed/diff", params={"from": other}, headers=admin)
    assert r.status_code == 404
    assert problem_paths(r) == {"from"}
    r = client.get("/v1/policies/seed/diff", params={"to": "nope"}, headers=admin)
    assert problem_paths(r) == {"to"}
    make_policy(client, admin, "empty", pool="e")
    assert client.get("/v1/policies/empty/diff", headers=admin).status_code == 404


def test_summarize_changes_reports_moves_engines_and_fields() -> None:
    before = {"engines": {"a": {"method": "none"}, "b": {"method": "mtp", "num_speculative_tokens": 2}},
              "rules": [{"name": "x", "then": {"engine": "a"}}, {"name": "y", "then": {"engine": "a"}}],
              "default": {"engine": "a"}}
    after = {"engines": {"a": {"method": "none"}, "b": {"method": "mtp", "num_speculative_tokens": 3},
                         "c": {"method": "none"}},
             "rules": [{"name": "y", "then": {"engine": "a"}}, {"name": "x", "then": {"engine": "a"}}],
             "default": {"engine": "c"}}
    summary = service.summarize_changes(before, after)
    assert summary.rules_moved == ("y", "x")
    assert summary.rules_changed == ()
    assert summary.engines_added == ("c",)
    assert summary.engines_changed == ("b",)
    assert summary.fields_changed == ("default",)


# --- evaluation ----------------------------------------------------------------------------------

def test_evaluate_returns_the_seed_policy_decisions(client: TestClient, admin: Headers,
                                                    viewer: Headers) -> None:
    rid = first_revision(client, admin)
    shapes = [{"route": "chat", "batch_size": 2}, {"route": "chat", "batch_size": 8},
              {"route": "chat", "batch_size": 2, "structured_output": True}]
    r = client.post(f"/v1/revisions/{rid}/evaluate", json={"shapes": shapes}, headers=viewer)
    assert r.status_code == 200, r.text
    results = r.json()
    decisions = [(x["decision"]["engine"], x["decision"]["speculate"], x["decision"]["rule"]) for x in results]
    assert decisions == [
        ("draft", True, "chat-low-batch"), ("base", False, "default"), ("base", False, "default")]
    assert results[0]["decision"]["num_speculative_tokens"] == 3
    assert results[0]["decision"]["revision"] == rid
    assert results[1]["shape"]["batch_size"] == 8
    assert results[1]["shape"]["prompt_tokens"] == 0  # defaults filled in
    assert rid in service.compiled_policies


def test_evaluate_uses_the_named_revision(client: TestClient, admin: Headers) -> None:
    first = first_revision(client, admin)
    second = post_yaml(client, admin, seed_text(threshold=16), if_match=first).json()["id"]
    shape = {"shapes": [{"route": "chat", "batch_size": 8}]}
    old = client.post(f"/v1/revisions/{first}/evaluate", json=shape, headers=admin).json()
    new = client.post(f"/v1/revisions/{second}/evaluate", json=shape, headers=admin).json()
    assert old[0]["decision"]["engine"] == "base"
    assert new[0]["decision"]["engine"] == "draft"
    assert new[0]["decision"]["revision"] == second


def test_evaluate_names_every_bad_shape(client: TestClient, admin: Headers) -> None:
    rid = first_revision(client, admin)
    shapes: list[Any] = [{"route": "chat", "batch_size": 2}, {"batch_size": "2"}, "nope",
                         {"route": "chat", "colour": "red"}, {"labels": {"a": 1}, "batch_size": -3}]
    r = client.post(f"/v1/revisions/{rid}/evaluate", json={"shapes": shapes}, headers=admin)
    assert r.status_code == 422
    assert problem_paths(r) == {"shapes[1].batch_size", "shapes[2]", "shapes[3].colour",
                                "shapes[4].labels", "shapes[4].batch_size"}
    codes = {e["path"]: e["code"] for e in r.json()["errors"]}
    assert codes["shapes[3].colour"] == "unknown_field"
    assert codes["shapes[4].batch_size"] == "out_of_range"
    surrogate = client.post(f"/v1/revisions/{rid}/evaluate", content=b'{"shapes": [{"route": "\\ud800"}]}',
                            headers={**admin, "content-type": "application/json"})
    assert surrogate.status_code == 422
    assert problem_paths(surrogate) == {"shapes[0].route"}


def test_evaluate_limits_and_errors(client: TestClient, admin: Headers) -> None:
    rid = first_revision(client, admin)
    url = f"/v1/revisions/{rid}/evaluate"
    assert client.post(url, json={"shapes": [{}] * 1000}, headers=admin).status_code == 200
    too_many = client.post(url, json={"shapes": [{}] * 1001}, headers=admin)
    assert too_many.status_code == 422
    assert problem_paths(too_many) == {"shapes"}
    assert client.post(url, json={"shapes": []}, headers=admin).status_code == 422
    wrong_type = client.post(url, content=b'{"shapes": []}', headers={**admin, "content-type": "text/plain"})
    assert wrong_type.status_code == 415
    unknown = client.post("/v1/revisions/" + "f" * 64 + "/evaluate", json={"shapes": [{}]}, headers=admin)
    assert unknown.status_code == 404


# --- scopes ------------------------------------------------------------------------------------

def test_viewer_reads_but_cannot_write(client: TestClient, admin: Headers, viewer: Headers) -> None:
    rid = first_revision(client, admin)
    for path in ("/v1/policies", "/v1/policies/seed", "/v1/policies/seed/revisions",
                 "/v1/policies/seed/diff", f"/v1/revisions/{rid}"):
        assert client.get(path, headers=viewer).status_code == 200, path
    evaluated = client.post(f"/v1/revisions/{rid}/evaluate", json={"shapes": [{}]}, headers=viewer)
    assert evaluated.status_code == 200
    denied = client.post("/v1/policies", json={"name": "mine"}, headers=viewer)
    assert denied.status_code == 403
    assert denied.json()["type"].endswith("/forbidden")
    assert post_yaml(client, viewer, seed_text(threshold=9), if_match="*").status_code == 403


def test_operator_cannot_create_policies_or_revisions(client: TestClient, admin: Headers,
                                                      operator: Headers) -> None:
    rid = first_revision(client, admin)
    assert client.get("/v1/policies/seed", headers=operator).status_code == 200
    assert client.post("/v1/policies", json={"name": "mine"}, headers=operator).status_code == 403
    r = post_yaml(client, operator, seed_text(threshold=9), if_match=rid)
    assert r.status_code == 403
    assert client.get("/v1/policies/seed", headers=admin).json()["revision_count"] == 1


def test_worker_keys_may_do_nothing_here(client: TestClient, admin: Headers, worker_key: Headers) -> None:
    rid = first_revision(client, admin)
    for path in ("/v1/policies", "/v1/policies/seed", "/v1/policies/seed/revisions",
                 "/v1/policies/seed/diff", f"/v1/revisions/{rid}"):
        assert client.get(path, headers=worker_key).status_code == 403, path
    assert client.post(f"/v1/revisions/{rid}/evaluate", json={"shapes": [{}]},
                       headers=worker_key).status_code == 403
    assert client.post("/v1/policies", json={"name": "mine"}, headers=worker_key).status_code == 403
    assert post_yaml(client, worker_key, seed_text(threshold=9), if_match="*").status_code == 403


def test_no_key_is_401(client: TestClient) -> None:
    assert client.get("/v1/policies").status_code == 401
    assert post_yaml(client, {}, seed_text()).status_code == 401


# --- hostile input ---------------------------------------------------------------------------------

def test_hostile_input_is_4xx_never_5xx(client: TestClient, admin: Headers) -> None:
    make_policy(client, admin)
    deep = post_yaml(client, admin, "a: " + "[" * 3000 + "]" * 3000)
    assert deep.status_code == 422
    assert deep.json()["errors"][0]["code"] == "too_deep"
    deep_json = client.post("/v1/policies/seed/revisions", content=b'{"document": ' + b"[" * 100_000,
                            headers={**admin, "content-type": "application/json"})
    assert deep_json.status_code == 422
    nul = post_yaml(client, admin, seed_text(), message="a\u0000b")
    assert nul.status_code == 422
    assert problem_paths(nul) == {"message"}
    body = b'{"document": {"apiVersion": "specgate/v1", "name": "seed", "description": "\\udc00",' \
           b' "engines": {"base": {"method": "none"}}, "default": {"engine": "base"}}}'
    surrogate = client.post("/v1/policies/seed/revisions", content=body,
                            headers={**admin, "content-type": "application/json"})
    assert surrogate.status_code == 422
    assert client.get("/v1/policies/seed", headers=admin).json()["revision_count"] == 0


def test_nul_in_names_and_ids_is_404_not_a_database_error(client: TestClient, admin: Headers) -> None:
    rid = first_revision(client, admin)
    for path in ("/v1/policies/seed%00", "/v1/policies/seed%00/revisions", "/v1/policies/seed%00/diff",
                 f"/v1/policies/seed/diff?from={rid}%00", "/v1/policies/seed/diff?to=%00",
                 f"/v1/revisions/{rid}%00"):
        assert client.get(path, headers=admin).status_code == 404, path
    assert client.post(f"/v1/revisions/{rid}%00/evaluate", json={"shapes": [{}]},
                       headers=admin).status_code == 404
    assert post_yaml(client, admin, seed_text(), policy="seed%00").status_code == 404


def test_nul_inside_a_document_is_stored_escaped(client: TestClient, admin: Headers) -> None:
    make_policy(client, admin)
    text = seed_text().replace("default:", 'description: "a\\0b"\ndefault:')
    r = post_yaml(client, admin, text)
    assert r.status_code == 201, r.text
    assert r.json()["document"]["description"] == "a\u0000b"
    got = client.get(f"/v1/revisions/{r.json()['id']}", headers=admin).json()
    assert got["document"]["description"] == "a\u0000b"
    assert got["source_text"] == text


def test_openapi_documents_the_policy_api(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    create = spec["paths"]["/v1/policies/{name}/revisions"]["post"]
    assert {"application/yaml", "text/yaml", "application/x-yaml", "application/json"} <= set(
        create["requestBody"]["content"])
    assert {"200", "201", "412", "415", "422", "428"} <= set(create["responses"])
    assert create["summary"]
    assert "/v1/revisions/{revision_id}/evaluate" in spec["paths"]
    assert "/v1/policies/{name}/diff" in spec["paths"]
