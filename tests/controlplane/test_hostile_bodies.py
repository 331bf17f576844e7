"""Bodies Python cannot read as they stand: integers longer than ``int()`` reads and nesting deeper than the
parser recurses. Each policy endpoint that takes a body, and a plain JSON endpoint, answers them with a 4xx
problem that names the field (or says the body nests too deeply), never a 500.

Python refuses to turn more than ``sys.get_int_max_str_digits()`` (4300) digits into an int, with a
ValueError that says neither where nor what; JSON, YAML and the JSON text inside a policy document all reach
that limit.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.support.factories import seed_text

Headers = dict[str, str]
DIGITS = sys.get_int_max_str_digits() + 700  # 5000 with the default limit
HUGE = "9" * DIGITS
DEEP = 5000
JSON = {"content-type": "application/json"}
YAML = {"content-type": "application/yaml"}


def _deep(n: int = DEEP) -> str:
    return "[" * n + "]" * n


def _policy(client: TestClient, admin: Headers) -> str:
    assert client.post("/v1/policies", json={"name": "seed"}, headers=admin).status_code == 201
    r = client.post("/v1/policies/seed/revisions", json={"document": seed_text()}, headers=admin)
    assert r.status_code == 201, r.text
    rid: str = r.json()["id"]
    return rid


def _problem(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = r.json()
    return body


def _errors(body: dict[str, Any]) -> set[tuple[str, str]]:
    return {(e["path"], e["code"]) for e in body.get("errors", [])}


def _huge_yaml() -> str:
    return seed_text().replace("batch_size: {max: 4}", f"batch_size: {{max: {HUGE}}}")


def _huge_json_text() -> str:
    doc = {"apiVersion": "specgate/v1", "name": "seed", "engines": {"base": {"method": "none"}},
           "rules": [{"name": "r", "when": {"batch_size": {"max": 1}}, "then": {"engine": "base"}}],
           "default": {"engine": "base"}}
    return json.dumps(doc).replace('"max": 1', f'"max": {HUGE}')


# --- a huge integer in the policy's own text (YAML, or JSON text) ------------------------------------


@pytest.mark.parametrize("text", [_huge_yaml(), _huge_json_text()], ids=["yaml", "json-text"])
def test_a_huge_integer_in_a_document_text_is_a_422_at_its_path(client: TestClient, admin: Headers,
                                                                text: str) -> None:
    _policy(client, admin)
    where = ("rules[0].when.batch_size.max", "out_of_range")
    validate = client.post("/v1/policies/seed/validate", json={"document": text}, headers=admin)
    assert _errors(_problem(validate, 422)) == {where}
    as_json = client.post("/v1/policies/seed/revisions", json={"document": text},
                          headers={**admin, "If-Match": "*"})
    assert _errors(_problem(as_json, 422)) == {where}
    as_text = client.post("/v1/policies/seed/revisions", content=text, headers={**admin, **YAML, "If-Match": "*"})
    body = _problem(as_text, 422)
    assert _errors(body) == {where}
    assert f"{DIGITS} digits" in body["errors"][0]["message"]
    assert "line" in body["errors"][0]


# --- a huge integer in a JSON body -----------------------------------------------------------------------


def test_a_huge_integer_in_a_json_body_is_a_422_at_its_path(client: TestClient, admin: Headers) -> None:
    rid = _policy(client, admin)
    doc = _huge_json_text()
    cases = [
        ("/v1/policies", f'{{"name": {HUGE}}}', "name"),
        ("/v1/policies/seed/validate", f'{{"document": {doc}}}', "document.rules[0].when.batch_size.max"),
        ("/v1/policies/seed/validate", f'{{"document": "x", "shapes": [{{"batch_size": {HUGE}}}]}}',
         "shapes[0].batch_size"),
        ("/v1/policies/seed/revisions", f'{{"document": {doc}}}', "document.rules[0].when.batch_size.max"),
        (f"/v1/revisions/{rid}/evaluate", f'{{"shapes": [{{"route": "chat", "batch_size": {HUGE}}}]}}',
         "shapes[0].batch_size"),
    ]
    for path, content, field in cases:
        r = client.post(path, content=content, headers={**admin, **JSON, "If-Match": "*"})
        body = _problem(r, 422)
        assert _errors(body) == {(field, "out_of_range")}, (path, body)
        assert body["errors"][0]["in"] == "body"


# --- nesting -----------------------------------------------------------------------------------------------


def test_a_body_nested_too_deeply_is_a_422_saying_so(client: TestClient, admin: Headers) -> None:
    rid = _policy(client, admin)
    cases = [
        ("/v1/policies", _deep()),
        ("/v1/policies/seed/validate", f'{{"document": {_deep()}}}'),
        ("/v1/policies/seed/revisions", f'{{"document": {_deep()}}}'),
        (f"/v1/revisions/{rid}/evaluate", f'{{"shapes": {_deep()}}}'),
    ]
    for path, content in cases:
        body = _problem(client.post(path, content=content, headers={**admin, **JSON, "If-Match": "*"}), 422)
        assert _errors(body) == {("body", "invalid_json")}, (path, body)
        assert "nests" in body["errors"][0]["message"], (path, body)


@pytest.mark.parametrize("text", ["a: " + _deep(), "a: " + _deep(100_000), _deep(), '{"a": ' * DEEP + "1"
                                  + "}" * DEEP], ids=["yaml", "yaml-100k", "json-list", "json-object"])
def test_a_document_text_nested_too_deeply_is_too_deep(client: TestClient, admin: Headers, text: str) -> None:
    _policy(client, admin)
    validate = client.post("/v1/policies/seed/validate", json={"document": text}, headers=admin)
    assert _errors(_problem(validate, 422)) == {("", "too_deep")}
    revision = client.post("/v1/policies/seed/revisions", content=text, headers={**admin, **YAML, "If-Match": "*"})
    assert _errors(_problem(revision, 422)) == {("", "too_deep")}


def test_a_document_object_nested_as_deep_as_json_allows_is_a_policy_error(client: TestClient,
                                                                           admin: Headers) -> None:
    # As deep as the body parser reads: the policy's validation has to take it from there.
    _policy(client, admin)
    deep = f'{{"document": {{"apiVersion": "specgate/v1", "name": "seed", "rules": {_deep(900)}}}}}'
    for path in ("/v1/policies/seed/validate", "/v1/policies/seed/revisions"):
        r = client.post(path, content=deep, headers={**admin, **JSON, "If-Match": "*"})
        assert r.status_code == 422, r.text


def test_a_generic_json_endpoint_says_what_is_wrong_with_an_unreadable_body(client: TestClient,
                                                                            admin: Headers) -> None:
    # POST /v1/policies: a plain JSON body that FastAPI reads, as most endpoints do.
    not_utf8 = client.post("/v1/policies", content=b'{"name": "\xff"}', headers={**admin, **JSON})
    assert _errors(_problem(not_utf8, 422)) == {("body", "invalid_json")}
    assert "UTF-8" in not_utf8.json()["errors"][0]["message"]
    huge_key = client.post("/v1/policies", content=f'{{"name": "p", "description": [1, {HUGE}]}}',
                           headers={**admin, **JSON})
    assert _errors(_problem(huge_key, 422)) == {("description[1]", "out_of_range")}
