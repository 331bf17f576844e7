"""Key names are bounded so that the audited actor "scope:name" fits the String(128) actor columns."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from controlplane.auth.schemas import KEY_NAME_MAX, Scope
from tests.support.auth import bearer


def test_name_one_past_the_bound_is_422_naming_name(client: TestClient, admin: dict[str, str]) -> None:
    r = client.post("/v1/keys", json={"name": "n" * (KEY_NAME_MAX + 1), "scope": "viewer"}, headers=admin)
    assert r.status_code == 422
    assert "name" in r.text


@pytest.mark.parametrize("scope", list(Scope))
def test_longest_name_of_every_scope_makes_audited_changes(
    client: TestClient, admin: dict[str, str], scope: Scope
) -> None:
    created = client.post("/v1/keys", json={"name": "n" * KEY_NAME_MAX, "scope": scope.value}, headers=admin)
    assert created.status_code == 201, created.text
    assert len(f"{scope.value}:{'n' * KEY_NAME_MAX}") <= 128
    if scope is Scope.admin:
        # an audited change made by the longest-named key itself
        r = client.post("/v1/keys", json={"name": "child", "scope": "viewer"}, headers=bearer(created.json()["token"]))
        assert r.status_code == 201, r.text
