from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import controlplane.distribution.endpoints as endpoints
import controlplane.distribution.recompute as recompute
import controlplane.distribution.service as distribution
from controlplane.app import create_app
from controlplane.models import Revision
from controlplane.rollout.service import canary_salt
from controlplane.settings import ControlPlaneSettings
from policies import BundlePayload, BundleVerifier, sticky_fraction
from tests.support.factories import seed_policy, seed_text
from tests.support.fleet_rows import (
    add_rollout,
    add_step,
    register,
    session_for,
    set_kill_switch,
    set_rollout,
)
from tests.support.live import serve

Policy = tuple[str, list[str]]


@pytest.fixture
def policy(settings: ControlPlaneSettings) -> Policy:
    """A pool-less policy: its first revision is active, the second is a draft to roll out."""
    return seed_policy(settings.database_url, extra_revisions=(seed_text(threshold=8),))


def verifier(client: TestClient) -> BundleVerifier:
    return BundleVerifier([client.get("/v1/bundle/public-key").json()["public_key"]])


def fetch(client: TestClient, key: dict[str, str], worker_id: str) -> BundlePayload:
    r = client.get("/v1/bundle", params={"worker": worker_id}, headers=key)
    assert r.status_code == 200, r.text
    return verifier(client).verify(r.json())


def test_bundle_is_a_signed_envelope_with_a_quoted_etag(client: TestClient, policy: Policy,
                                                        worker_key: dict[str, str]) -> None:
    _, (active, _draft) = policy
    register(client, worker_key, "w1")
    r = client.get("/v1/bundle", params={"worker": "w1"}, headers=worker_key)
    assert r.status_code == 200
    envelope = r.json()
    assert r.headers["etag"] == f'"{envelope["etag"]}"'
    assert r.headers["cache-control"] == "no-cache"
    payload = verifier(client).verify(envelope)
    assert payload.etag == envelope["etag"]
    assert payload.policy.id == active
    assert payload.canary is None
    assert payload.kill_switch is False
    # Tampering is caught by the public key alone.
    envelope["payload"]["kill_switch"] = True
    with pytest.raises(Exception, match="signature"):
        verifier(client).verify(envelope)


def test_public_key_needs_no_key_and_names_the_signer(client: TestClient, policy: Policy,
                                                      worker_key: dict[str, str]) -> None:
    key = client.get("/v1/bundle/public-key")
    assert key.status_code == 200
    assert key.json()["algorithm"] == "Ed25519"
    assert key.json()["public_key"] == client.app.state.signing_key.public_key_b64  # type: ignore[attr-defined]
    register(client, worker_key, "w1")
    envelope = client.get("/v1/bundle", params={"worker": "w1"}, headers=worker_key).json()
    assert [s["key_id"] for s in envelope["signatures"]] == [key.json()["key_id"]]


@pytest.mark.parametrize("form", ['"{}"', "{}", 'W/"{}"', '"other", "{}"'])
def test_if_none_match_current_etag_is_304(client: TestClient, policy: Policy, worker_key: dict[str, str],
                                           form: str) -> None:
    register(client, worker_key, "w1")
    etag = client.get("/v1/bundle", params={"worker": "w1"}, headers=worker_key).json()["etag"]
    r = client.get("/v1/bundle", params={"worker": "w1"}, headers={**worker_key, "If-None-Match": form.format(etag)})
    assert r.status_code == 304
    assert r.content == b""
    assert r.headers["etag"] == f'"{etag}"'
    other = client.get("/v1/bundle", params={"worker": "w1"}, headers={**worker_key, "If-None-Match": '"nope"'})
    assert other.status_code == 200


@pytest.mark.parametrize("wait", ["31", "0", "-1", "nan", "soon"])
def test_wait_out_of_bounds_is_422(client: TestClient, policy: Policy, worker_key: dict[str, str],
                                   wait: str) -> None:
    register(client, worker_key, "w1")
    r = client.get("/v1/bundle", params={"worker": "w1", "wait": wait}, headers=worker_key)
    assert r.status_code == 422
    assert [e["path"] for e in r.json()["errors"]] == ["wait"]


def test_wait_without_a_matching_etag_answers_at_once(client: TestClient, policy: Policy,
                                                      worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1")
    start = time.monotonic()
    r = client.get("/v1/bundle", params={"worker": "w1", "wait": 20}, headers={**worker_key, "If-None-Match": '"x"'})
    assert r.status_code == 200
    assert time.monotonic() - start < 2


def current_etag(client: TestClient, key: dict[str, str], worker_id: str) -> str:
    etag: str = client.get("/v1/bundle", params={"worker": worker_id}, headers=key).json()["etag"]
    return etag


def later(delay: float, action: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), action()), daemon=True)
    thread.start()
    return thread


def test_long_poll_returns_the_new_bundle_soon_after_a_change(
        client: TestClient, settings: ControlPlaneSettings, policy: Policy, worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1")
    etag = current_etag(client, worker_key, "w1")
    app: Any = client.app
    observed: dict[str, Any] = {}
    changed_at: list[float] = []

    def change() -> None:
        # While the long-poll waits it holds no database connection, only a place on the hub.
        observed["waiters"] = app.state.hub.waiters
        observed["connections"] = app.state.engine.pool.checkedout()
        generation = set_kill_switch(settings.database_url, True)
        changed_at.append(time.monotonic())
        app.state.hub.notify(generation)

    thread = later(0.3, change)
    start = time.monotonic()
    r = client.get("/v1/bundle", params={"worker": "w1", "wait": 10},
                   headers={**worker_key, "If-None-Match": f'"{etag}"'})
    done = time.monotonic()
    thread.join()
    assert r.status_code == 200, r.text
    assert r.json()["etag"] != etag
    assert r.headers["etag"] == f'"{r.json()["etag"]}"'
    assert verifier(client).verify(r.json()).kill_switch is True
    assert observed == {"waiters": 1, "connections": 0}
    wake = done - changed_at[0]
    print(f"long-poll woke {wake * 1000:.1f} ms after the change committed ({done - start:.3f} s in all)")
    assert wake < 1.0


def test_a_change_committed_while_the_bundle_is_computed_is_not_slept_through(
        client: TestClient, settings: ControlPlaneSettings, policy: Policy, worker_key: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    register(client, worker_key, "w1")
    etag = current_etag(client, worker_key, "w1")
    real = recompute.load_bundles
    calls: list[str] = []
    app: Any = client.app

    def racing(sessions: Any, worker_ids: Any) -> recompute.Outcomes:
        outcomes = real(sessions, worker_ids)
        if not calls:
            # The notice lands after this computation read the database, before the wait begins.
            app.state.hub.notify(set_kill_switch(settings.database_url, True))
        calls.append(getattr(outcomes["w1"], "etag", ""))
        return outcomes

    monkeypatch.setattr(recompute, "load_bundles", racing)
    start = time.monotonic()
    r = client.get("/v1/bundle", params={"worker": "w1", "wait": 5}, headers={**worker_key, "If-None-Match": etag})
    assert r.status_code == 200
    assert time.monotonic() - start < 2
    assert calls[0] == etag
    assert r.json()["etag"] == calls[-1] != etag


def test_long_poll_ends_with_304_when_nothing_changes(client: TestClient, policy: Policy,
                                                      worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1")
    etag = current_etag(client, worker_key, "w1")
    app: Any = client.app
    # A notice that does not change this worker's bundle is recomputed and waited through.
    thread = later(0.2, app.state.hub.notify)
    start = time.monotonic()
    r = client.get("/v1/bundle", params={"worker": "w1", "wait": 1}, headers={**worker_key, "If-None-Match": etag})
    elapsed = time.monotonic() - start
    thread.join()
    assert r.status_code == 304
    assert r.headers["etag"] == f'"{etag}"'
    assert 0.9 <= elapsed < 3


def test_re_registering_into_another_pool_wakes_the_long_poll(
        client: TestClient, settings: ControlPlaneSettings, policy: Policy, worker_key: dict[str, str]) -> None:
    _, (pool_b_active,) = seed_policy(settings.database_url, seed_text("for-b", threshold=2), name="for-b",
                                      pool="pool-b")
    register(client, worker_key, "w1", pool="pool-a")
    etag = current_etag(client, worker_key, "w1")
    thread = later(0.3, lambda: register(client, worker_key, "w1", pool="pool-b"))
    r = client.get("/v1/bundle", params={"worker": "w1", "wait": 10},
                   headers={**worker_key, "If-None-Match": f'"{etag}"'})
    thread.join()
    assert r.status_code == 200
    assert verifier(client).verify(r.json()).policy.id == pool_b_active


def test_workers_mode_puts_a_sticky_half_of_the_targeted_workers_in_the_canary(
        client: TestClient, settings: ControlPlaneSettings, policy: Policy, admin: dict[str, str],
        worker_key: dict[str, str]) -> None:
    policy_id, (active, draft) = policy
    ids = [f"gpu-{i:03d}" for i in range(200)]
    for worker_id in ids:
        register(client, worker_key, worker_id)
    rollout_id, _ = add_rollout(settings.database_url, policy_id, draft, mode="workers", percent=50)

    def cohort() -> set[str]:
        listed = client.get("/v1/workers", params={"limit": 1000}, headers=admin).json()["items"]
        assert len(listed) == 200
        canary_etags = {w["expected_etag"] for w in listed if w["id"] in (in_canary_example,)}
        return {w["id"] for w in listed if w["expected_etag"] in canary_etags}

    salt = canary_salt(rollout_id, cohort_secret=client.app.state.cohort_secret)  # type: ignore[attr-defined]
    formula = {w for w in ids if sticky_fraction(w, salt) * 100 < 50}
    in_canary_example = sorted(formula)[0]
    out_example = sorted(set(ids) - formula)[0]
    assert fetch(client, worker_key, in_canary_example).policy.id == draft
    assert fetch(client, worker_key, out_example).policy.id == active
    assert fetch(client, worker_key, in_canary_example).canary is None
    members = cohort()
    assert members == formula
    # Binomial(200, 0.5): mean 100, sd about 7.1; 4.5 sd either side.
    assert 68 <= len(members) <= 132
    # The next step keeps everyone already in and adds more.
    add_step(settings.database_url, rollout_id, 1, 100)
    set_rollout(settings.database_url, rollout_id, current_step=1)
    assert fetch(client, worker_key, out_example).policy.id == draft
    assert len(cohort()) == 200


def test_traffic_mode_gives_every_targeted_worker_the_canary_share(
        client: TestClient, settings: ControlPlaneSettings, policy: Policy,
        worker_key: dict[str, str]) -> None:
    policy_id, (active, draft) = policy
    rollout_id, _ = add_rollout(settings.database_url, policy_id, draft, mode="traffic", percent=10,
                                target_pool="pool-a", target_labels={"zone": "a"})
    targeted = [f"a-{i}" for i in range(10)]
    for worker_id in targeted:
        register(client, worker_key, worker_id, pool="pool-a", labels={"zone": "a", "gpu": "h100"})
    register(client, worker_key, "wrong-zone", pool="pool-a", labels={"zone": "b"})
    register(client, worker_key, "no-labels", pool="pool-a")
    register(client, worker_key, "wrong-pool", pool="pool-b", labels={"zone": "a"})
    for worker_id in targeted:
        payload = fetch(client, worker_key, worker_id)
        assert payload.policy.id == active
        assert payload.canary is not None
        assert payload.canary.revision.id == draft
        assert payload.canary.traffic_percent == 10
        assert payload.canary.salt == canary_salt(
            rollout_id, cohort_secret=client.app.state.cohort_secret)  # type: ignore[attr-defined]
    for worker_id in ("wrong-zone", "no-labels", "wrong-pool"):
        payload = fetch(client, worker_key, worker_id)
        assert (payload.policy.id, payload.canary) == (active, None)


def test_a_paused_rollout_keeps_its_split_and_an_aborted_one_stops(
        client: TestClient, settings: ControlPlaneSettings, policy: Policy,
        worker_key: dict[str, str]) -> None:
    policy_id, (active, draft) = policy
    rollout_id, _ = add_rollout(settings.database_url, policy_id, draft, mode="traffic", percent=25)
    register(client, worker_key, "w1")
    running = fetch(client, worker_key, "w1")
    set_rollout(settings.database_url, rollout_id, state="paused")
    assert fetch(client, worker_key, "w1") == running
    assert running.canary is not None
    assert running.canary.traffic_percent == 25
    set_rollout(settings.database_url, rollout_id, state="aborted")
    stopped = fetch(client, worker_key, "w1")
    assert (stopped.policy.id, stopped.canary) == (active, None)


def test_kill_switch_is_in_every_bundle(client: TestClient, settings: ControlPlaneSettings, policy: Policy,
                                        worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1", pool="pool-a")
    register(client, worker_key, "w2", pool="pool-z")
    before = current_etag(client, worker_key, "w1")
    set_kill_switch(settings.database_url, True)
    assert fetch(client, worker_key, "w1").kill_switch is True
    assert fetch(client, worker_key, "w2").kill_switch is True
    assert current_etag(client, worker_key, "w1") != before
    set_kill_switch(settings.database_url, False)
    assert current_etag(client, worker_key, "w1") == before


def test_pool_policy_wins_over_the_pool_less_one(client: TestClient, settings: ControlPlaneSettings,
                                                 policy: Policy, worker_key: dict[str, str]) -> None:
    _, (everyone, _draft) = policy
    _, (gpu_only,) = seed_policy(settings.database_url, seed_text("gpu", threshold=16), name="gpu", pool="gpu")
    register(client, worker_key, "w-gpu", pool="gpu")
    register(client, worker_key, "w-cpu", pool="cpu")
    assert fetch(client, worker_key, "w-gpu").policy.id == gpu_only
    assert fetch(client, worker_key, "w-cpu").policy.id == everyone


def test_no_policy_and_unknown_worker_are_404_problems(client: TestClient, settings: ControlPlaneSettings,
                                                       worker_key: dict[str, str]) -> None:
    seed_policy(settings.database_url, name="only-gpu", text=seed_text("only-gpu"), pool="gpu")
    register(client, worker_key, "w-cpu", pool="cpu")
    r = client.get("/v1/bundle", params={"worker": "w-cpu"}, headers=worker_key)
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == "https://specgate.dev/problems/no-policy"
    unknown = client.get("/v1/bundle", params={"worker": "ghost"}, headers=worker_key)
    assert unknown.status_code == 404
    assert unknown.json()["type"].endswith("/worker-not-found")
    assert client.get("/v1/bundle/events", params={"worker": "w-cpu"}, headers=worker_key).status_code == 404


def test_bundle_scopes(client: TestClient, policy: Policy, admin: dict[str, str], operator: dict[str, str],
                       viewer: dict[str, str], worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1")
    assert client.get("/v1/bundle", params={"worker": "w1"}, headers=viewer).status_code == 403
    assert client.get("/v1/bundle", params={"worker": "w1"}, headers=operator).status_code == 403
    assert client.get("/v1/bundle", params={"worker": "w1"}).status_code == 401
    assert client.get("/v1/bundle/events", params={"worker": "w1"}, headers=viewer).status_code == 403
    # Admins may look at what a worker is served.
    assert client.get("/v1/bundle", params={"worker": "w1"}, headers=admin).status_code == 200


def test_stored_revisions_are_validated_once_then_served_from_cache(
        client: TestClient, settings: ControlPlaneSettings, worker_key: dict[str, str], viewer: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    seed_policy(settings.database_url, seed_text(threshold=11))
    distribution.clear_caches()
    calls: list[Any] = []
    real = distribution.validate_data

    def counting(raw: Any) -> Any:
        calls.append(raw)
        return real(raw)

    monkeypatch.setattr(distribution, "validate_data", counting)
    for i in range(5):
        register(client, worker_key, f"w{i}")
        fetch(client, worker_key, f"w{i}")
        client.post(f"/v1/workers/w{i}/heartbeat", json={}, headers=worker_key)
    client.get("/v1/fleet", headers=viewer)
    assert len(calls) == 1


def test_a_stored_revision_that_does_not_hash_to_its_id_is_refused(
        client: TestClient, settings: ControlPlaneSettings, worker_key: dict[str, str],
        viewer: dict[str, str]) -> None:
    _, (rev,) = seed_policy(settings.database_url, seed_text(threshold=13))
    _, (healthy,) = seed_policy(settings.database_url, seed_text("healthy", threshold=14), name="healthy",
                                pool="pool-b")
    distribution.clear_caches()
    with session_for(settings.database_url) as session:
        row = session.get(Revision, rev)
        assert row is not None
        document = json.loads(json.dumps(row.document))
        document["rules"][0]["when"]["batch_size"]["max"] = 99
        row.document = document
    register(client, worker_key, "w1")
    register(client, worker_key, "w2", pool="pool-b")
    for _ in range(2):
        r = client.get("/v1/bundle", params={"worker": "w1"}, headers=worker_key)
        assert r.status_code == 500
        assert r.json()["type"].endswith("/revision-corrupt")
        assert r.json()["revision"] == rev
    # Only the workers that need the revision are refused; liveness and the fleet view go on.
    assert fetch(client, worker_key, "w2").policy.id == healthy
    assert client.post("/v1/workers/w1/heartbeat", json={}, headers=worker_key).json()["expected_etag"] is None
    assert client.get("/v1/fleet", headers=viewer).status_code == 200


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) for events, ("comment", text) for comment lines."""
    event, data = "", ""
    for line in lines:
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
        elif line == "" and event:
            yield event, data
            event, data = "", ""


def test_sse_sends_the_current_etag_then_each_change_and_keepalives(
        settings: ControlPlaneSettings, policy: Policy, worker_key: dict[str, str]) -> None:
    app = create_app(settings.model_copy(update={"sse_keepalive_s": 0.3}))
    with serve(app) as base, httpx.Client(base_url=base, timeout=5) as http:
        assert http.post("/v1/workers/register", headers=worker_key, json={
            "id": "w1", "pool": "pool-a", "labels": {}, "engines": {}}).status_code == 201
        first_etag = http.get("/v1/bundle", params={"worker": "w1"}, headers=worker_key).json()["etag"]
        with http.stream("GET", "/v1/bundle/events", params={"worker": "w1"}, headers=worker_key) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = sse_events(stream.iter_lines())
            assert next(events) == ("bundle", json.dumps({"etag": first_etag}, separators=(",", ":")))
            assert next(events) == ("comment", "keepalive")
            app.state.hub.notify(set_kill_switch(settings.database_url, True))
            kind, data = next(e for e in events if e[0] != "comment")
            assert kind == "bundle"
            new_etag = json.loads(data)["etag"]
            assert new_etag != first_etag
            assert new_etag == http.get("/v1/bundle", params={"worker": "w1"}, headers=worker_key).json()["etag"]
        # The stream notices the client left and stops waiting on the hub.
        deadline = time.monotonic() + 5
        while app.state.hub.waiters and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.hub.waiters == 0


def test_sse_ends_once_its_key_is_revoked(
        settings: ControlPlaneSettings, policy: Policy, worker_key: dict[str, str],
        admin: dict[str, str]) -> None:
    app = create_app(settings.model_copy(update={"sse_keepalive_s": 0.3}))
    with serve(app) as base, httpx.Client(base_url=base, timeout=5) as http:
        assert http.post("/v1/workers/register", headers=worker_key, json={
            "id": "w1", "pool": "pool-a", "labels": {}, "engines": {}}).status_code == 201
        key_id = http.get("/v1/whoami", headers=worker_key).json()["key_id"]
        with http.stream("GET", "/v1/bundle/events", params={"worker": "w1"}, headers=worker_key) as stream:
            events = sse_events(stream.iter_lines())
            assert next(events)[0] == "bundle"
            assert http.delete(f"/v1/keys/{key_id}", headers=admin).status_code == 200
            # A change after the revocation must not reach the revoked key, and the idle check ends it too.
            app.state.hub.notify(set_kill_switch(settings.database_url, True))
            rest = [e for e in events if e[0] != "comment"]
        assert [kind for kind, _ in rest] == ["error"]
        assert json.loads(rest[0][1])["status"] == 401


def test_a_herd_of_long_polls_woken_by_one_change_costs_one_read(
        settings: ControlPlaneSettings, policy: Policy, worker_key: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    herd = 60
    app = create_app(settings)
    validations: list[Any] = []
    real = distribution.validate_data
    monkeypatch.setattr(distribution, "validate_data", lambda raw: (validations.append(raw), real(raw))[1])
    hops: list[str] = []
    real_hop = endpoints.run_in_threadpool

    async def counted_hop(func: Any, *args: Any) -> Any:
        hops.append(func.__name__)
        return await real_hop(func, *args)

    monkeypatch.setattr(endpoints, "run_in_threadpool", counted_hop)

    async def scenario(base: str) -> tuple[list[int], int, float]:
        limits = httpx.Limits(max_connections=herd + 10)
        async with httpx.AsyncClient(base_url=base, timeout=20, limits=limits) as http:
            for i in range(herd):
                assert (await http.post("/v1/workers/register", headers=worker_key,
                                        json={"id": f"w{i}", "pool": "pool-a"})).status_code == 201
            etag = (await http.get("/v1/bundle", params={"worker": "w0"}, headers=worker_key)).json()["etag"]

            async def poll(worker_id: str) -> int:
                r = await http.get("/v1/bundle", params={"worker": worker_id, "wait": 15},
                                   headers={**worker_key, "If-None-Match": etag})
                return r.status_code

            polls = [asyncio.ensure_future(poll(f"w{i}")) for i in range(herd)]
            deadline = time.monotonic() + 10
            while app.state.hub.waiters < herd:
                assert time.monotonic() < deadline, "the herd never gathered"
                await asyncio.sleep(0.02)
            reads, validated = app.state.bundle_recomputer.reads, len(validations)
            hops.clear()
            start = time.monotonic()
            generation = await asyncio.to_thread(set_kill_switch, settings.database_url, True)
            app.state.hub.notify(generation)
            statuses = list(await asyncio.gather(*polls))
            assert len(validations) == validated
            # The read signed the new bundle: no woken long-poll goes back to the threadpool to sign it.
            assert hops == []
            return statuses, app.state.bundle_recomputer.reads - reads, time.monotonic() - start

    with serve(app) as base:
        statuses, reads, elapsed = asyncio.run(scenario(base))
    assert statuses == [200] * herd
    # One read answers the whole herd; a second notice (PostgreSQL's NOTIFY echo) may add one more.
    assert reads <= 2
    print(f"{herd} long-polls answered {elapsed * 1000:.0f} ms after the change, from {reads} read(s)")
    assert elapsed < 5
