"""The client against a live control plane (uvicorn in a thread), and against answers no control plane gives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from apiclient import ApiClient, ApiError, calls
from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.settings import ControlPlaneSettings
from tests.support.auth import bearer
from tests.support.factories import seed_text
from tests.support.live import free_port, serve
from tests.support.telemetry_data import policy_text, recorded_window, seed

CHAT_AT_6 = {"route": "chat", "batch_size": 6}


@pytest.fixture
def live(settings: ControlPlaneSettings) -> Iterator[str]:
    with serve(create_app(settings)) as url:
        yield url


@pytest.fixture
def admin_key(make_key: Callable[[Scope, str], str]) -> str:
    return make_key(Scope.admin, "alice")


@pytest.fixture
def api(live: str, admin_key: str) -> Iterator[ApiClient]:
    with ApiClient(live, admin_key) as client:
        yield client


def _direct(live: str, key: str, path: str, **params: Any) -> Any:
    """The same read without the client: what the server answers, byte for byte parsed."""
    with httpx.Client(base_url=live, headers=bearer(key), timeout=10) as client:
        response = client.get(path, params=params)
        assert response.status_code == 200, response.text
        return response.json()


def test_policies_and_revisions(api: ApiClient, live: str, admin_key: str) -> None:
    created = api.send(calls.create_policy("seed", pool="a", description="chat traffic"))
    assert created.status == 201
    assert (created.data.name, created.data.pool, created.data.created_by) == ("seed", "a", "admin:alice")
    assert created.json["description"] == "chat traffic"

    first = api.send(calls.create_revision("seed", seed_text(threshold=4), message="first"))
    assert (first.status, first.data.seq, first.data.active, first.data.message) == (201, 1, True, "first")
    assert first.data.source_text == seed_text(threshold=4)
    again = api.send(calls.create_revision("seed", seed_text(threshold=4), if_match=f'"{first.data.id}"'))
    assert (again.status, again.data.id) == (200, first.data.id)  # an equal document: nothing was created
    second = api.send(calls.create_revision("seed", seed_text(threshold=8), message="raise",
                                            if_match=f'"{first.data.id}"')).data
    assert (second.seq, second.active, second.parent_id) == (2, False, first.data.id)

    policy = api.send(calls.policy("seed")).data
    assert (policy.active_revision_id, policy.head_revision_id, policy.revision_count) == (first.data.id,
                                                                                            second.id, 2)
    listing = api.send(calls.policies())
    assert [p.name for p in listing.data] == ["seed"]
    assert listing.json == _direct(live, admin_key, "/v1/policies")

    newest = api.send(calls.revisions("seed", limit=1)).data
    assert [r.id for r in newest.items] == [second.id]
    assert newest.next_cursor is not None
    older = api.send(calls.revisions("seed", cursor=newest.next_cursor, limit=1)).data
    assert [r.id for r in older.items] == [first.data.id]
    assert older.next_cursor is None
    assert api.send(calls.revision(second.id)).data.document["name"] == "seed"

    check = api.send(calls.validate("seed", seed_text(threshold=6), shapes=[CHAT_AT_6])).data
    assert (check.valid, check.existing) == (True, False)
    assert check.diff is not None
    assert check.diff.against.id == first.data.id  # the active revision, not the head
    assert check.diff.summary.rules_changed
    assert [e.decision.engine for e in check.evaluations] == ["draft"]
    assert api.send(calls.validate("seed", seed_text(threshold=8))).data.existing is True
    assert [e.decision.engine for e in api.send(calls.evaluate(first.data.id, [CHAT_AT_6])).data] == ["base"]

    diff = api.send(calls.diff("seed", from_revision=first.data.id, to_revision=second.id))
    assert (diff.data.from_.seq, diff.data.to.seq, diff.data.identical) == (1, 2, False)
    assert "+      max: 8" in diff.data.unified.splitlines()
    assert diff.json == _direct(live, admin_key, "/v1/policies/seed/diff", **{"from": first.data.id,
                                                                             "to": second.id})


def test_rollouts_rollback_kill_switch_fleet_and_audit(api: ApiClient, live: str, admin_key: str) -> None:
    api.send(calls.create_policy("seed"))
    first = api.send(calls.create_revision("seed", seed_text(threshold=4))).data
    second = api.send(calls.create_revision("seed", seed_text(threshold=8), if_match=f'"{first.id}"')).data

    started = api.send(calls.start_rollout(policy="seed", revision=second.id, mode="traffic", steps=[50, 100],
                                           reason="canary"))
    rollout = started.data
    assert (started.status, rollout.state, rollout.current_percent, rollout.to_revision) == (201, "running", 50.0,
                                                                                            second.id)
    assert [s.percent for s in rollout.steps] == [50.0, 100.0]
    assert api.send(calls.guardrails(rollout.id, limit=1)).data.evaluations == []
    evaluated = api.send(calls.evaluate_guardrails(rollout.id)).data
    assert evaluated.verdict in ("pass", "breach", "pending")
    history = api.send(calls.guardrails(rollout.id)).data
    assert (history.rollout_id, [e.evaluated_at for e in history.evaluations]) == (rollout.id,
                                                                                   [evaluated.evaluated_at])

    paused = api.send(calls.rollout_action(rollout.id, "pause", reason="look")).data
    assert (paused.state, paused.allowed_actions) == ("paused", ["resume", "abort"])
    assert [r.id for r in api.send(calls.rollouts(policy="seed", state="paused")).data.items] == [rollout.id]
    assert api.send(calls.rollouts(state="running")).data.items == []
    assert api.send(calls.rollout(rollout.id)).json == _direct(live, admin_key, f"/v1/rollouts/{rollout.id}")

    back = api.send(calls.rollback("seed", second.id, reason="go straight there")).data
    assert (back.previous_revision, back.active_revision) == (first.id, second.id)
    assert back.ended_rollout is not None
    assert (back.ended_rollout.id, back.ended_rollout.state) == (rollout.id, "rolled_back")

    switched = api.send(calls.set_kill_switch(True, reason="incident 42")).data
    assert (switched.enabled, switched.changed, switched.changed_by) == (True, True, "admin:alice")
    assert api.send(calls.set_kill_switch(True, reason="twice")).data.changed is False
    assert api.send(calls.kill_switch()).data.reason == "incident 42"

    fleet = api.send(calls.fleet()).data
    assert (fleet.kill_switch, fleet.overall.workers, fleet.pools) == (True, 0, [])
    assert api.send(calls.workers(pool="a")).data.items == []

    audit = api.send(calls.audit(action="killswitch.on")).data
    assert [(e.actor, e.reason) for e in audit.items] == [("admin:alice", "incident 42")]
    everything = api.send(calls.audit(limit=2))
    assert len(everything.data.items) == 2
    assert everything.data.next_cursor is not None
    assert everything.json == _direct(live, admin_key, "/v1/audit", limit=2)
    assert api.send(calls.rollups(group_by=["route"])).data.groups == []


def test_workers_and_gateways_with_their_replicas(api: ApiClient, live: str, admin_key: str,
                                                  worker_key: dict[str, str]) -> None:
    with httpx.Client(base_url=live, headers=worker_key, timeout=10) as sidecar:
        for worker_id, kind in (("w1", "worker"), ("w2", "gateway")):
            sidecar.post("/v1/workers/register", json={"id": worker_id, "pool": "pool-a",
                                                       "kind": kind}).raise_for_status()
        sidecar.post("/v1/workers/w2/heartbeat", json={"replicas": [
            {"engine": "base", "replica": "10.0.0.5:8000", "state": "healthy", "in_flight": 3, "running": 2},
            {"engine": "base", "replica": "10.0.0.6:8000", "state": "ejected", "next_probe_in_s": 1.5},
        ]}).raise_for_status()
    (gateway,) = api.send(calls.workers(kind="gateway")).data.items
    assert (gateway.id, gateway.kind, gateway.replicas_reported_at is not None) == ("w2", "gateway", True)
    assert [(r.replica, r.state, r.in_flight, r.running, r.next_probe_in_s) for r in gateway.replicas] == [
        ("10.0.0.5:8000", "healthy", 3, 2.0, None), ("10.0.0.6:8000", "ejected", 0, None, 1.5)]
    (worker,) = api.send(calls.workers(kind="worker")).data.items
    assert (worker.id, worker.replicas, worker.replicas_reported_at) == ("w1", [], None)
    assert api.send(calls.workers(kind="gateway")).json == _direct(live, admin_key, "/v1/workers", kind="gateway")
    fleet = api.send(calls.fleet()).data
    assert (fleet.overall.workers, fleet.gateways.workers) == (1, 1)
    assert [p.pool for p in fleet.gateway_pools] == ["pool-a"]
    assert (fleet.replicas.reporters, fleet.replicas.total, fleet.replicas.healthy, fleet.replicas.ejected) == (
        1, 2, 1, 1)


def test_analysis_calls(live: str, migrated_url: str, admin_key: str) -> None:
    (rid,) = seed(migrated_url, policy_text())
    recorded_window(migrated_url, rid)
    with ApiClient(live, admin_key) as api:
        by_route = api.send(calls.summary(group_by="route", policy="seed")).data
        assert {row.key["route"] for row in by_route.rows} == {"chat", "summarize"}
        assert by_route.workers is None
        by_worker = api.send(calls.summary(group_by="worker")).data
        assert by_worker.workers is not None
        assert sum(w.requests for w in by_worker.workers) == sum(r.requests for r in by_route.rows)

        speedups = api.send(calls.speedups("seed", route="summarize")).data
        assert {row.route for row in speedups.rows} == {"summarize"}
        assert "loses" in {row.verdict for row in speedups.rows}

        cells = api.send(calls.cells("seed")).data
        assert cells.policy == "seed"
        assert cells.cells

        listing = api.send(calls.recommendations("seed"))
        assert listing.data.revision == rid
        assert listing.json == _direct(live, admin_key, "/v1/recommendations", policy="seed")
        raise_chat = next(r for r in listing.data.recommendations if r.kind == "raise_threshold")
        applied = api.send(calls.apply_recommendation(raise_chat.id, "seed"))
        assert (applied.status, applied.data.recommendation.id, applied.data.seq) == (201, raise_chat.id, 2)

        what_if = api.send(calls.what_if("seed", revision=applied.data.revision)).data
        assert (what_if.candidate, what_if.baseline) == (applied.data.revision, rid)
        assert what_if.all_routes["requests"] > 0
        before_after = api.send(calls.before_after(policy="seed", from_revision=rid,
                                                   to_revision=applied.data.revision)).data
        assert (before_after.from_revision, before_after.to_revision) == (rid, applied.data.revision)


# --- refusals ------------------------------------------------------------------------------

def test_refusals_carry_the_problem(api: ApiClient, live: str, make_key: Callable[[Scope, str], str]) -> None:
    with pytest.raises(ApiError) as missing:
        api.send(calls.policy("nope"))
    assert (missing.value.status, missing.value.problem.slug) == (404, "not-found")
    assert not missing.value.unreachable

    api.send(calls.create_policy("seed"))
    first = api.send(calls.create_revision("seed", seed_text(threshold=4))).data
    with pytest.raises(ApiError) as stale:
        api.send(calls.create_revision("seed", seed_text(threshold=8), if_match=f'"{"0" * 64}"'))
    assert (stale.value.status, stale.value.problem.slug) == (412, "precondition-failed")
    assert stale.value.problem.extra["current_head"] == first.id

    second = api.send(calls.create_revision("seed", seed_text(threshold=8), if_match="*")).data
    with pytest.raises(ApiError) as refused:
        api.send(calls.start_rollout(policy="seed", revision=second.id, mode="traffic", steps=[50, 20], reason="r"))
    assert refused.value.status == 422
    assert ("steps[1]", "not_increasing") in {(e.path, e.code) for e in refused.value.problem.errors}
    assert "steps[1]" in str(refused.value)  # the problem's text, for logs and terminals

    with ApiClient(live, make_key(Scope.viewer, "victor")) as viewer, pytest.raises(ApiError) as forbidden:
        viewer.send(calls.set_kill_switch(True, reason="x"))
    assert forbidden.value.status == 403
    with ApiClient(live, "sgk_not-a-key") as stranger, pytest.raises(ApiError) as unknown:
        stranger.send(calls.whoami())
    assert (unknown.value.status, unknown.value.problem.title) == (401, "Missing or invalid API key")

    with pytest.raises(ValueError, match="unknown rollout action 'explode'"):
        calls.rollout_action("r1", "explode")


def test_an_unreachable_control_plane_is_status_0() -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    with ApiClient(nowhere + "/", "sgk_x") as api, pytest.raises(ApiError) as down:
        api.send(calls.policies())
    assert down.value.unreachable
    assert down.value.problem.title == "Control plane unreachable"
    assert down.value.problem.detail.startswith(f"cannot reach the control plane at {nowhere}: ")


def test_a_slow_control_plane_times_out_as_unreachable() -> None:
    async def slow(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await asyncio.sleep(1.5)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"[]"})

    with serve(slow) as url, ApiClient(url, "sgk_x", timeout_s=0.2) as api:  # type: ignore[arg-type]
        started = time.monotonic()
        with pytest.raises(ApiError) as late:
            api.send(calls.policies())
        assert time.monotonic() - started < 1.2
    assert late.value.unreachable
    assert "timed out" in late.value.problem.detail


# --- answers no control plane of this version gives ------------------------------------------

def _mock(handler: Callable[[httpx.Request], httpx.Response]) -> ApiClient:
    return ApiClient("http://cp", "sgk_x", transport=httpx.MockTransport(handler))


def test_the_key_goes_in_the_authorization_header_and_unknown_fields_are_ignored() -> None:
    seen: list[httpx.Request] = []

    def newer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"key_id": "k1", "name": "ci", "scope": "viewer", "actor": "viewer:ci",
                                         "expires_at": None, "new_member": {"nested": [1, 2]}})

    with _mock(newer) as api:
        reply = api.send(calls.whoami())
    assert (reply.data.actor, reply.data.scope) == ("viewer:ci", "viewer")
    assert reply.json["new_member"] == {"nested": [1, 2]}  # the raw answer keeps what the model drops
    assert seen[0].headers["authorization"] == "Bearer sgk_x"
    assert seen[0].headers["accept"] == "application/json"
    assert api.closed


def test_query_path_and_body_are_sent_as_built() -> None:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(201, json={"id": "a" * 64, "seq": 3, "parent_id": None, "author": "x", "message": "m",
                                         "created_at": "2026-12-03T12:00:00Z", "active": False, "policy": "a/b",
                                         "document": {}, "canonical_yaml": "", "source_text": None})

    with _mock(record) as api:
        api.send(calls.create_revision("a/b", "name: a/b\n", message="m", if_match='"h"'))
        with pytest.raises(ApiError):  # a Revision is not an AuditPage: the answer does not fit
            api.send(calls.audit(q="incident", cursor=7))
    assert seen[0].url.raw_path == b"/v1/policies/a%2Fb/revisions"  # one path segment, whatever the name
    assert seen[0].headers["if-match"] == '"h"'
    assert seen[0].read() == b'{"document":"name: a/b\\n","message":"m"}'
    assert dict(seen[1].url.params) == {"q": "incident", "cursor": "7"}  # nothing sent for what was not given


def test_answers_the_client_cannot_read_are_problems_not_tracebacks() -> None:
    with _mock(lambda _: httpx.Response(502, text="<html>bad gateway</html>")) as api, \
            pytest.raises(ApiError) as proxy:
        api.send(calls.fleet())
    assert (proxy.value.status, proxy.value.problem.title) == (502, "HTTP 502")
    assert "bad gateway" in proxy.value.problem.detail

    with _mock(lambda _: httpx.Response(200, json={"key_id": "k1", "name": "ci"})) as api, \
            pytest.raises(ApiError) as short:
        api.send(calls.whoami())
    assert (short.value.status, short.value.problem.title) == (200, "Unexpected answer from the control plane")
    assert short.value.problem.detail == "GET /v1/whoami: scope: Field required (2 error(s))"

    with _mock(lambda _: httpx.Response(200, text="OK")) as api, pytest.raises(ApiError) as text:
        api.send(calls.kill_switch())
    assert "the body is not JSON" in text.value.problem.detail
