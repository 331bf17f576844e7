"""Signing keys and the v2 envelope on the control plane's side (issue 16, findings 4 and 10, cohort secret):
delivery fields, two keys during a rotation, the `signing-key` commands, and the start-up warning."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from controlplane.app import create_app
from controlplane.models import AuditEvent, FleetState
from controlplane.settings import ControlPlaneSettings
from policies import BundleSignatureError, BundleVerifier, CompiledBundle, RequestShape, SigningKey, interpret
from specgate.cli import app as cli_app
from tests.support.factories import seed_policy
from tests.support.fleet_rows import register, session_for


def _envelope(client: TestClient, key: dict[str, str], worker: str = "w1") -> dict[str, Any]:
    r = client.get("/v1/bundle", params={"worker": worker}, headers=key)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _run(url: str, *args: str) -> str:
    result = CliRunner().invoke(cli_app, ["signing-key", *args], env={"SPECGATE_DATABASE_URL": url,
                                                                      "SPECGATE_SIGNING_KEY": ""})
    assert result.exit_code == 0, result.output
    return result.output


def test_the_envelope_signs_generation_pool_worker_and_expiry(client: TestClient, settings: ControlPlaneSettings,
                                                       worker_key: dict[str, str],
                                                       operator: dict[str, str]) -> None:
    seed_policy(settings.database_url)
    register(client, worker_key, "w1")
    trusted = BundleVerifier([client.get("/v1/bundle/public-key").json()["public_key"]])
    first = trusted.verify_envelope(_envelope(client, worker_key))
    assert first.delivery.pool == "pool-a"
    assert first.delivery.worker_id == "w1"
    # Another worker of the pool: the same content and ETag, but an envelope only it accepts.
    register(client, worker_key, "w2")
    other = trusted.verify_envelope(_envelope(client, worker_key, "w2"))
    assert (other.etag, other.delivery.pool, other.delivery.worker_id) == (first.etag, "pool-a", "w2")
    ttl = settings.bundle_ttl_s
    assert time.time() + ttl <= first.delivery.expires_at <= time.time() + 1.1 * ttl + 1
    with session_for(settings.database_url) as session:
        state = session.get(FleetState, 1)
        assert state is not None
        assert first.delivery.generation == state.generation
        # The fleet's cohort secret rides in the signed bundle: workers hash request ids alike.
        assert first.payload.cohort_secret == state.cohort_secret
        assert state.cohort_secret
    r = client.put("/v1/killswitch", headers=operator, json={"enabled": True, "reason": "incident"})
    assert r.status_code == 200, r.text
    second = trusted.verify_envelope(_envelope(client, worker_key))
    assert second.delivery.generation > first.delivery.generation
    assert second.payload.kill_switch is True


def test_a_sidecar_decides_as_the_control_plane_given_the_same_bundle(
        client: TestClient, settings: ControlPlaneSettings, worker_key: dict[str, str]) -> None:
    seed_policy(settings.database_url)
    register(client, worker_key, "w1")
    trusted = BundleVerifier([client.get("/v1/bundle/public-key").json()["public_key"]])
    payload = trusted.verify(_envelope(client, worker_key))
    with session_for(settings.database_url) as session:
        secret = session.scalar(select(FleetState.cohort_secret))
    assert secret
    compiled = CompiledBundle(payload)
    for i in range(200):
        shape = RequestShape(request_id=f"r{i}", batch_size=1 + i % 7)
        assert compiled.decide(shape) == interpret(payload.policy.document, shape, payload.policy.id,
                                                   cohort_secret=secret)


def test_env_keys_sign_with_both_and_the_public_key_endpoint_lists_both(
        settings: ControlPlaneSettings, worker_key: dict[str, str]) -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    seed_policy(settings.database_url)
    both = settings.model_copy(update={"signing_key": new.private_key_b64(),
                                       "signing_key_previous": old.private_key_b64()})
    with TestClient(create_app(both)) as client:
        listed = client.get("/v1/bundle/public-key").json()
        assert listed["key_id"] == new.key_id
        assert listed["public_key"] == new.public_key_b64
        assert [(k["key_id"], k["status"]) for k in listed["keys"]] == [(new.key_id, "current"),
                                                                         (old.key_id, "previous")]
        register(client, worker_key, "w1")
        envelope = _envelope(client, worker_key)
    assert [s["key_id"] for s in envelope["signatures"]] == [new.key_id, old.key_id]
    for pinned in (old, new):
        BundleVerifier([pinned.public_key_b64]).verify(envelope)


def test_embedded_rotation_keeps_old_sidecars_until_the_previous_key_is_dropped(
        settings: ControlPlaneSettings, worker_key: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    seed_policy(settings.database_url)
    with caplog.at_level(logging.WARNING, "specgate.controlplane"), TestClient(create_app(settings)) as client:
        old = client.get("/v1/bundle/public-key").json()["public_key"]
        register(client, worker_key, "w1")
    assert any("SPECGATE_SIGNING_KEY is not set" in r.getMessage() for r in caplog.records)
    pinned_to_old = BundleVerifier([old])

    out = _run(settings.database_url, "rotate")
    assert "new current signing key" in out
    with TestClient(create_app(settings)) as client:
        keys = client.get("/v1/bundle/public-key").json()["keys"]
        assert [k["status"] for k in keys] == ["current", "previous"]
        assert keys[1]["public_key"] == old
        pinned_to_old.verify(_envelope(client, worker_key))

    _run(settings.database_url, "drop-previous")
    with TestClient(create_app(settings)) as client:
        assert [k["status"] for k in client.get("/v1/bundle/public-key").json()["keys"]] == ["current"]
        with pytest.raises(BundleSignatureError, match="unknown key"):
            pinned_to_old.verify(_envelope(client, worker_key))
    assert "no previous signing key" in _run(settings.database_url, "drop-previous")

    with session_for(settings.database_url) as session:
        actions = session.scalars(select(AuditEvent.action).where(AuditEvent.target_type == "signing_key")
                                  .order_by(AuditEvent.id)).all()
        assert actions == ["signing_key.rotate", "signing_key.drop_previous", "signing_key.drop_previous"]
        rotated = session.scalars(select(AuditEvent).where(AuditEvent.action == "signing_key.rotate")).one()
        # Key ids only: no private key in the audit log.
        assert rotated.after is not None
        assert set(rotated.after) == {"current", "previous"}
        assert rotated.after["previous"] == rotated.before["current"]  # type: ignore[index]
