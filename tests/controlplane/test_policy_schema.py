"""GET /v1/schema/policy: the published JSON Schema of a policy document, for editors, without a key."""

from __future__ import annotations

import jsonschema
import yaml
from fastapi.testclient import TestClient

from policies.jsonschema import SCHEMA_ID, SCHEMA_PATH
from tests.support import paths


def test_it_serves_the_committed_schema_to_anyone(client: TestClient) -> None:
    r = client.get("/v1/schema/policy")  # no Authorization header: like /openapi.json
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/schema+json"
    assert r.content == SCHEMA_PATH.read_bytes()
    schema = r.json()
    assert schema["$id"] == SCHEMA_ID
    validator = jsonschema.Draft202012Validator(schema)
    seed = yaml.safe_load((paths.EXAMPLES / "seed.yaml").read_text(encoding="utf-8"))
    assert list(validator.iter_errors(seed)) == []
    assert [e.validator for e in validator.iter_errors({**seed, "rule": []})] == ["additionalProperties"]


def test_the_openapi_document_lists_it_without_security(client: TestClient) -> None:
    operation = client.get("/openapi.json").json()["paths"]["/v1/schema/policy"]["get"]
    assert "security" not in operation
    assert list(operation["responses"]["200"]["content"]) == ["application/schema+json"]
    assert operation["tags"] == ["policies"]

