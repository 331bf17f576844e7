"""The audit log discloses no part of a key's secret, to viewers or anyone, on both databases."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.models import AuditEvent
from controlplane.settings import ControlPlaneSettings

Headers = dict[str, str]


def _secret_parts(token: str) -> list[str]:
    """Every 4-character piece of the token after its public `sgk_` marker."""
    secret = token.removeprefix("sgk_")
    return [secret[i:i + 4] for i in range(len(secret) - 3)]


def test_a_viewer_sees_no_part_of_a_new_keys_secret_in_the_audit_log(
        client: TestClient, admin: Headers, viewer: Headers) -> None:
    created = client.post("/v1/keys", json={"name": "ci-bot", "scope": "operator"}, headers=admin).json()
    events = client.get("/v1/audit", params={"action": "key.create"}, headers=viewer).json()["items"]
    [event] = [e for e in events if e["target_id"] == created["id"]]
    text = json.dumps(event)
    assert not [part for part in _secret_parts(created["token"]) if part in text]
    assert event["after"] == {"name": "ci-bot", "scope": "operator", "key_id": created["id"]}


def test_events_recorded_before_the_rule_are_cleaned_when_read(
        client: TestClient, viewer: Headers, settings: ControlPlaneSettings) -> None:
    engine = make_engine(settings.database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            session.add(AuditEvent(actor="admin:alice", action="key.create", target_type="api_key",
                                   target_id="k-old", before=None,
                                   after={"name": "old", "scope": "viewer", "prefix": "sgk_AbCdEf"}, reason=""))
    finally:
        engine.dispose()
    events = client.get("/v1/audit", params={"action": "key.create"}, headers=viewer).json()["items"]
    [event] = [e for e in events if e["target_id"] == "k-old"]
    assert event["after"] == {"name": "old", "scope": "viewer", "key_id": "k-old"}
    assert "AbCdEf" not in json.dumps(event)
