"""Worker keys are bound to the workers they may act as (issue 16, finding 3).

Before, any worker key acted as any worker: a second key re-registered another worker into another pool
with its own engine URL, heartbeated as it and sent telemetry as it.
"""

from __future__ import annotations

import gzip
import json
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from controlplane.auth.schemas import Scope
from controlplane.auth.service import WorkerNotAllowed, authenticate, authorize_registration
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.models import ApiKey, TelemetryEventRecord
from controlplane.settings import ControlPlaneSettings
from specgate.cli import app as cli_app
from tests.support.auth import bearer
from tests.support.factories import seed_policy
from tests.support.fleet_rows import register, session_for
from tests.support.telemetry_bodies import event

MakeKey = Callable[..., str]


def _register(client: TestClient, key: dict[str, str], worker_id: str, pool: str,
              engine: str = "http://127.0.0.1:8000") -> Any:
    return client.post("/v1/workers/register", headers=key, json={
        "id": worker_id, "pool": pool, "labels": {}, "engines": {"base": engine}, "sidecar_version": "0.1.0"})


def _send(client: TestClient, key: dict[str, str], body: dict[str, Any]) -> Any:
    return client.post("/v1/telemetry/batches", headers={**key, "Content-Type": "application/json",
                                                         "Content-Encoding": "gzip"},
                       content=gzip.compress(json.dumps(body).encode()))


def _stored_ids(settings: ControlPlaneSettings) -> set[str]:
    with session_for(settings.database_url) as session:
        return set(session.scalars(select(TelemetryEventRecord.event_id)))


def _forbidden_naming(response: Any, worker_id: str) -> None:
    assert response.status_code == 403, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["type"].endswith("/worker-not-allowed")
    assert body["worker"] == worker_id
    assert repr(worker_id) in body["detail"]


def test_a_second_worker_key_cannot_act_as_another_pools_worker(
        client: TestClient, settings: ControlPlaneSettings, make_key: MakeKey, admin: dict[str, str]) -> None:
    seed_policy(settings.database_url)
    victim = bearer(make_key(Scope.worker, "sidecar-a", pool="pool-a"))
    attacker = bearer(make_key(Scope.worker, "sidecar-b", pool="pool-b"))
    assert _register(client, victim, "gpu-a", "pool-a").status_code == 201
    assert _register(client, attacker, "gpu-b", "pool-b").status_code == 201

    # The attack: re-register A into the attacker's pool with an engine of its own.
    _forbidden_naming(_register(client, attacker, "gpu-a", "pool-b", engine="http://attacker:1"), "gpu-a")
    # ... nor into A's own pool: the key may register only into pool-b.
    assert _register(client, attacker, "gpu-a", "pool-a").status_code == 403
    worker = client.get("/v1/workers", params={"pool": "pool-a"}, headers=admin).json()["items"][0]
    assert (worker["id"], worker["engines"]) == ("gpu-a", {"base": "http://127.0.0.1:8000"})

    _forbidden_naming(client.post("/v1/workers/gpu-a/heartbeat", json={}, headers=attacker), "gpu-a")
    _forbidden_naming(client.get("/v1/bundle", params={"worker": "gpu-a"}, headers=attacker), "gpu-a")
    _forbidden_naming(client.get("/v1/bundle/events", params={"worker": "gpu-a"}, headers=attacker), "gpu-a")

    # The owners keep working, and an admin key still reads any bundle.
    assert client.post("/v1/workers/gpu-a/heartbeat", json={}, headers=victim).status_code == 200
    assert client.get("/v1/bundle", params={"worker": "gpu-a"}, headers=victim).status_code == 200
    assert client.get("/v1/bundle", params={"worker": "gpu-a"}, headers=admin).status_code == 200
    assert client.get("/v1/bundle", params={"worker": "gpu-b"}, headers=attacker).status_code == 200


def test_telemetry_for_another_worker_is_refused_per_event_and_the_rest_stored(
        client: TestClient, settings: ControlPlaneSettings, make_key: MakeKey) -> None:
    seed_policy(settings.database_url)  # pool-less: serves every pool the events claim
    victim = bearer(make_key(Scope.worker, "sidecar-a", pool="pool-a"))
    attacker = bearer(make_key(Scope.worker, "sidecar-b", worker_ids=["gpu-b"]))
    assert _register(client, victim, "gpu-a", "pool-a").status_code == 201

    body = {"batch_id": "b-mixed", "worker_id": "gpu-b", "schema_version": 1, "events": [
        event(0, worker_id="gpu-b"), event(1, worker_id="gpu-a"), event(2, worker_id="gpu-b"),
        event(3, worker_id="ghost")]}
    r = _send(client, attacker, body)
    assert r.status_code == 200, r.text
    ack = r.json()
    assert (ack["accepted"], ack["stored"], ack["rejected_count"]) == (2, 2, 2)
    assert [(x["index"], [(e["path"], e["code"]) for e in x["errors"]]) for x in ack["rejected"]] == [
        (1, [("worker_id", "worker_not_allowed")]), (3, [("worker_id", "worker_not_allowed")])]
    assert _stored_ids(settings) == {"ev-0", "ev-2"}

    # A batch sent in another worker's name is refused whole.
    whole = _send(client, attacker, {"batch_id": "b-as-a", "worker_id": "gpu-a", "schema_version": 1,
                                     "events": [event(9, worker_id="gpu-b")]})
    _forbidden_naming(whole, "gpu-a")
    unregistered = _send(client, attacker, {"batch_id": "b-as-ghost", "worker_id": "ghost", "schema_version": 1,
                                            "events": [event(8, worker_id="gpu-b")]})
    _forbidden_naming(unregistered, "ghost")
    # The pool key sends for its registered worker.
    own = _send(client, victim, {"batch_id": "b-a", "worker_id": "gpu-a", "schema_version": 1,
                                 "events": [event(5, worker_id="gpu-a", pool="pool-a")]})
    assert own.json()["stored"] == 1
    assert _stored_ids(settings) == {"ev-0", "ev-2", "ev-5"}


def test_an_unbound_key_binds_itself_to_its_first_registration(
        client: TestClient, settings: ControlPlaneSettings, make_key: MakeKey, admin: dict[str, str]) -> None:
    old = bearer(make_key(Scope.worker, "legacy"))
    owner = bearer(make_key(Scope.worker, "owner", worker_ids=["taken"]))
    assert _register(client, owner, "taken", "pool-a").status_code == 201
    # Before registering it acts as nobody registered, and cannot claim a worker bound to another key.
    assert client.post("/v1/workers/taken/heartbeat", json={}, headers=old).status_code == 403
    _forbidden_naming(_register(client, old, "taken", "pool-a"), "taken")

    assert _register(client, old, "mine", "pool-x").status_code == 201
    assert client.post("/v1/workers/mine/heartbeat", json={}, headers=old).status_code == 200
    # Now bound: no second worker.
    _forbidden_naming(_register(client, old, "second", "pool-x"), "second")

    keys = {k["name"]: k for k in client.get("/v1/keys", headers=admin).json()}
    assert (keys["legacy"]["pool"], keys["legacy"]["worker_ids"]) == (None, ["mine"])
    assert (keys["owner"]["pool"], keys["owner"]["worker_ids"]) == (None, ["taken"])
    binds = client.get("/v1/audit", params={"action": "key.bind"}, headers=admin).json()["items"]
    assert [(b["target_id"], b["after"]) for b in binds] == [
        (keys["legacy"]["id"], {"pool": None, "worker_ids": ["mine"]})]


def test_the_binding_is_given_at_creation_audited_and_listed(client: TestClient, admin: dict[str, str]) -> None:
    r = client.post("/v1/keys", headers=admin, json={"name": "rack-7", "scope": "worker", "pool": "gpu",
                                                     "worker_ids": ["w-2", "w-1", "w-2"]})
    assert r.status_code == 201, r.text
    assert (r.json()["pool"], r.json()["worker_ids"]) == ("gpu", ["w-1", "w-2"])
    created = client.get("/v1/audit", params={"action": "key.create"}, headers=admin).json()["items"]
    after = next(e["after"] for e in created if e["target_id"] == r.json()["id"])
    assert (after["pool"], after["worker_ids"]) == ("gpu", ["w-1", "w-2"])

    token = bearer(r.json()["token"])
    assert _register(client, token, "w-9", "gpu").status_code == 201  # any worker of its pool
    assert _register(client, token, "w-1", "elsewhere").status_code == 201  # a worker it names, anywhere
    _forbidden_naming(_register(client, token, "w-8", "elsewhere"), "w-8")


def test_a_binding_on_a_non_worker_key_or_a_bad_binding_is_422_naming_the_field(
        client: TestClient, admin: dict[str, str]) -> None:
    for body, path in (({"scope": "operator", "pool": "gpu"}, "pool"),
                       ({"scope": "viewer", "worker_ids": ["w-1"]}, "worker_ids"),
                       ({"scope": "worker", "worker_ids": ["not an id"]}, "worker_ids[0]"),
                       ({"scope": "worker", "worker_ids": []}, "worker_ids"),
                       ({"scope": "worker", "worker_ids": [f"w{i}" for i in range(1001)]}, "worker_ids"),
                       ({"scope": "worker", "pool": ""}, "pool")):
        r = client.post("/v1/keys", headers=admin, json={"name": "k", **body})
        assert r.status_code == 422, (body, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
        assert [e["path"] for e in r.json()["errors"]] == [path], (body, r.json())


def test_cli_creates_a_pool_bound_worker_key(settings: ControlPlaneSettings, client: TestClient) -> None:
    env = {"SPECGATE_DATABASE_URL": settings.database_url}
    result = CliRunner().invoke(cli_app, ["keys", "create", "--scope", "worker", "--name", "rack",
                                          "--pool", "gpu", "--worker", "w-1", "--worker", "w-2"], env=env)
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"sgk_\S+\n", result.stdout)
    with session_for(settings.database_url) as session:
        key = session.scalars(select(ApiKey).where(ApiKey.name == "rack")).one()
        assert (key.pool, key.worker_ids) == ("gpu", ["w-1", "w-2"])
    token = bearer(result.stdout.strip())
    assert _register(client, token, "w-5", "gpu").status_code == 201
    assert _register(client, token, "w-6", "cpu").status_code == 403

    refused = CliRunner().invoke(cli_app, ["keys", "create", "--scope", "viewer", "--name", "v", "--pool", "gpu"],
                                 env=env)
    assert refused.exit_code == 2
    assert "--pool" in refused.stderr


def test_the_tests_fleet_key_registers_into_its_pool(client: TestClient, worker_key: dict[str, str]) -> None:
    # fleet_rows.register's default pool is the fixture key's pool.
    assert register(client, worker_key, "any-id")["pool"] == "pool-a"


@pytest.mark.parametrize("same_key", [False, True], ids=["two-keys-one-worker", "one-key-two-workers"])
def test_concurrent_first_registrations_bind_a_worker_to_one_key_and_a_key_to_one_worker(
        migrated_url: str, make_key: MakeKey, same_key: bool) -> None:
    first_token = make_key(Scope.worker, "legacy-a")
    second_token = first_token if same_key else make_key(Scope.worker, "legacy-b")
    second_worker = "w-2" if same_key else "w-1"
    engine = make_engine(migrated_url)
    sessions = make_sessionmaker(engine)
    try:
        # Both requests authenticated while their keys were still unbound.
        with unit_of_work(sessions) as session:
            first, second = authenticate(session, first_token), authenticate(session, second_token)
        outcome: list[Any] = []

        def register_second() -> None:
            try:
                with unit_of_work(sessions) as session:
                    outcome.append(authorize_registration(session, second, second_worker, "p", None))
            except BaseException as exc:
                outcome.append(exc)

        with unit_of_work(sessions) as session:
            authorize_registration(session, first, "w-1", "p", None)
            thread = threading.Thread(target=register_second)
            thread.start()
            thread.join(0.5)
            assert thread.is_alive(), "the second binding did not wait for the first"
        thread.join(30)
        assert not thread.is_alive()
        [result] = outcome
        assert isinstance(result, WorkerNotAllowed), result
        with unit_of_work(sessions) as session:
            bindings = {key.name: key.worker_ids for key in session.scalars(select(ApiKey))}
    finally:
        engine.dispose()
    assert bindings == ({"legacy-a": ["w-1"]} if same_key else {"legacy-a": ["w-1"], "legacy-b": None})


def test_an_unbound_key_cannot_place_a_new_worker_in_another_keys_pool(
        client: TestClient, make_key: MakeKey) -> None:
    bearer(make_key(Scope.worker, "pool-owner", pool="pool-p"))
    legacy = bearer(make_key(Scope.worker, "legacy"))
    _forbidden_naming(_register(client, legacy, "newcomer", "pool-p"), "newcomer")
    # Still unbound: its first registration elsewhere binds it.
    assert _register(client, legacy, "newcomer", "pool-q").status_code == 201


def test_telemetry_claiming_another_pool_or_policy_is_refused_per_event(
        client: TestClient, settings: ControlPlaneSettings, make_key: MakeKey) -> None:
    # Guardrails and recommendations select by policy and revision: a bound key must not skew another pool's.
    seed_policy(settings.database_url, name="seed-a", pool="pool-a")
    seed_policy(settings.database_url, name="seed-b", pool="pool-b")
    seed_policy(settings.database_url, name="fallback")  # the pool-less one: serves pools without a policy
    key = bearer(make_key(Scope.worker, "sidecar-a", pool="pool-a"))
    assert _register(client, key, "gpu-a", "pool-a").status_code == 201
    mine = {"worker_id": "gpu-a", "pool": "pool-a"}
    body = {"batch_id": "b-claims", "worker_id": "gpu-a", "schema_version": 1, "events": [
        event(0, **mine, policy="seed-a"),
        event(1, **mine, policy="seed-b"),  # another pool's policy
        event(2, worker_id="gpu-a", pool="pool-b", policy="seed-b"),  # another pool altogether
        event(3, **mine, policy="fallback"),  # in flight while the pool moved off the pool-less policy
        event(4, **mine, policy="nonexistent")]}
    r = _send(client, key, body)
    assert r.status_code == 200, r.text
    ack = r.json()
    assert [(x["index"], [(e["path"], e["code"]) for e in x["errors"]]) for x in ack["rejected"]] == [
        (1, [("policy", "wrong_policy")]), (2, [("pool", "pool_mismatch")]), (4, [("policy", "wrong_policy")])]
    assert "'pool-a', not 'pool-b'" in ack["rejected"][1]["errors"][0]["message"]
    assert _stored_ids(settings) == {"ev-0", "ev-3"}


def test_a_long_poll_and_a_stream_end_when_their_worker_leaves_the_keys_pool(
        settings: ControlPlaneSettings, make_key: MakeKey) -> None:
    import asyncio

    import httpx

    from controlplane.app import create_app
    from tests.support.live import serve

    seed_policy(settings.database_url)  # pool-less: the bundle is the same in both pools
    pool_key = bearer(make_key(Scope.worker, "pool-a-fleet", pool="pool-a"))
    own_key = bearer(make_key(Scope.worker, "gpu-m-itself", worker_ids=["gpu-m"]))
    app = create_app(settings)

    async def scenario(base: str) -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=base, timeout=20) as http:
            r = await http.post("/v1/workers/register", headers=own_key, json={"id": "gpu-m", "pool": "pool-a"})
            assert r.status_code == 201, r.text
            etag = (await http.get("/v1/bundle", params={"worker": "gpu-m"}, headers=pool_key)).json()["etag"]
            poll = asyncio.ensure_future(http.get("/v1/bundle", params={"worker": "gpu-m", "wait": 15},
                                                  headers={**pool_key, "If-None-Match": f'"{etag}"'}))
            lines: list[str] = []

            async def stream() -> None:
                async with http.stream("GET", "/v1/bundle/events", params={"worker": "gpu-m"},
                                       headers=pool_key) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        lines.append(line)

            streaming = asyncio.ensure_future(stream())
            deadline = asyncio.get_running_loop().time() + 10
            while app.state.hub.waiters < 2:
                assert asyncio.get_running_loop().time() < deadline, "the poll and the stream never waited"
                await asyncio.sleep(0.02)
            # The worker moves to another pool, with its own key (legitimate): the pool key loses it.
            r = await http.post("/v1/workers/register", headers=own_key, json={"id": "gpu-m", "pool": "pool-b"})
            assert r.status_code in (200, 201), r.text
            polled = await asyncio.wait_for(poll, 10)
            await asyncio.wait_for(streaming, 10)
            return polled, lines

    with serve(app) as base:
        polled, lines = asyncio.run(scenario(base))
    # Before: the long-poll went on waiting (and answered the new pool's bundle on its next change), and the
    # stream went on announcing the worker's bundles to the pool key.
    _forbidden_naming(polled, "gpu-m")
    assert "event: error" in lines
    error = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
    assert error["type"].endswith("/worker-not-allowed")
    assert "pool-b" in error["detail"]
