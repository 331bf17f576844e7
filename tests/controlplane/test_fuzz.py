"""Property-based fuzzing of the REST API against its own OpenAPI schema (schemathesis).

Every operation of ``/openapi.json`` is called with generated requests (positive and negative
data; the examples, coverage and fuzzing phases; ``MAX_EXAMPLES`` per operation in fuzzing)
against a migrated control plane, once on SQLite and once on PostgreSQL. Each database holds a
pool-less policy ``seed`` with an active revision and a draft, a registered worker, a running
rollout of the draft and a spare key. ``test_api_on_real_objects`` runs the operations that take
identifiers again (fuzzing phase only) and, drawn per field, swaps in the names of those objects
(path parameters, ``worker``/``policy``/``from``/``to`` queries, rollout and rollback bodies,
``If-Match`` and ``If-None-Match``), so that the code behind a found object is fuzzed too, not
only its 404.

Requests carry an admin key, or a worker key for the operations only worker keys may call
(read off the routes' ``require(...)``), so every operation is reachable.

Checks (``CHECKS``), all of which must pass:

- ``not_a_server_error``: no input gives a 5xx.
- ``status_code_conformance``: every status answered is declared for the operation.
- ``content_type_conformance``: errors are declared ``application/problem+json``, as sent.
- ``response_schema_conformance``: bodies match the declared models (problems included).
- ``response_headers_conformance``: declared response headers are present and valid.
- ``negative_data_rejection``: a request that violates the schema is refused with a 4xx
  (schemathesis's list of refusal statuses plus 413, the declared answer to a body over
  ``SPECGATE_MAX_BODY_BYTES``, which is how a too-long array is usually refused).
- ``missing_required_header``, ``ignored_auth``: a request without its key, or with a wrong
  one, is refused with 401.
- ``unsupported_method``, ``allow_header_conformance``: an undeclared method is 405 with an
  ``Allow`` header naming exactly the path's methods.

Left out, and why:

- ``positive_data_acceptance`` (a schema-valid request must get 2xx/401/403/404/409): the API
  refuses schema-valid requests on purpose where the rule cannot be written in a static JSON
  schema, with the statuses docs/control-plane.md gives: a policy document is any text for
  the schema but 422 ``invalid-policy`` unless it is a valid policy; rollout steps must be
  strictly increasing and end at 100, and references must name a revision of that policy
  that is not active (422); ``If-Match`` depends on the current head (412/428) and a malformed
  one is 400; cursors are opaque tokens the API gave out (422 ``invalid_cursor``); ``wait`` is
  bounded by the ``SPECGATE_LONG_POLL_MAX_S`` setting (422); reasons are stripped before their
  minimum length applies (422). ``status_code_conformance`` still requires each of those
  statuses to be declared, and ``response_schema_conformance`` that they are problems.
- ``use_after_free``, ``ensure_resource_availability``: they judge sequences of calls linked
  through the schema (schemathesis's stateful runner); a per-operation run has none.
- ``max_response_time``: the API declares no latency budget, and timing on shared CI is noise.

Generation settings: keys are sent by the test, so schemathesis does not generate or mutate
``Authorization`` (``with-security-parameters = false``; a generated "missing key" case would
otherwise carry our key and look like accepted invalid data), and it does not add undeclared
query parameters (``allow-extra-parameters = false``), which the API ignores by design (see
docs/control-plane.md). Authentication is fuzzed through ``ignored_auth`` and
``missing_required_header`` instead.

Not fuzzed: ``GET /v1/bundle/events``, the SSE stream. It never ends by design (an event at
once, then keepalives until the client goes away), so every accepted case would hold until the
transport's read timeout; tests/controlplane/test_distribution.py covers it against a live
server. Long-polls cannot hang the run: the target's ``SPECGATE_LONG_POLL_MAX_S`` is
``LONG_POLL_MAX_S`` (a longer ``wait`` is 422), and some ``GET /v1/bundle`` cases name the worker
with its current ETag in ``If-None-Match`` and a ``wait``, so the hold-then-304 path runs too,
for at most that long.

What the fuzzer found, fixed in the control plane and pinned by the plain tests at the end:
422s documented as FastAPI's ``HTTPValidationError`` JSON while the API sends problem+json;
401/403/404/409/413/400 answered but not declared; 405 without ``Allow`` (and, once kept,
naming only the first route's methods); a JSON body that is not UTF-8 answered 400 ``http``
instead of 422 ``invalid_json``; heartbeat ``in_flight: false`` accepted as 0; abort's body
declared optional though a reason is required; and two 500s: an audit ``cursor`` of 2**63 or
more overflowed the database driver, and on PostgreSQL a NUL character in an audit filter reached
the driver (a probe of every text input then found the same for a key's name, a key id and a
revocation reason). ``/readyz``'s 503 was declared along the way.
"""

from __future__ import annotations

import inspect
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi as schemathesis_asgi
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    content_type_conformance,
    ignored_auth,
    missing_required_header,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.auth.service import create_key
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.migrations_state import upgrade
from controlplane.settings import ControlPlaneSettings
from policies import SigningKey
from tests.support import paths
from tests.support.auth import bearer
from tests.support.factories import empty_postgres_schema, seed_policy, seed_text
from wire.problems import PROBLEM_MEDIA_TYPE, PROBLEM_SCHEMA, ProblemCode

MAX_EXAMPLES = 25
LONG_POLL_MAX_S = 0.5
WORKER_ID = "fuzz-worker-1"
SSE_PATH = "/v1/bundle/events"

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection, missing_required_header, ignored_auth,
          unsupported_method, allow_header_conformance]
GENERATION = {"max-examples": MAX_EXAMPLES, "with-security-parameters": False, "allow-extra-parameters": False}
# Schemathesis's list of refusals, plus 413: a body over SPECGATE_MAX_BODY_BYTES (e.g. events past
# maxItems) is refused before it is parsed, and that status is declared.
REFUSED = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
CHECK_CONFIG = {"negative_data_rejection": {"expected-statuses": REFUSED}}

# The schema is the app's own /openapi.json; requests go to the target's app. Its lifespan reads the
# cohort secret (made on first start), so even loading the schema needs a migrated database.
_schema_dir = tempfile.TemporaryDirectory(prefix="specgate-fuzz-schema-")
_schema_url = f"sqlite:///{Path(_schema_dir.name) / 'schema.db'}"
upgrade(_schema_url)
_schema_app = create_app(ControlPlaneSettings(database_url=_schema_url,
                                              signing_key=SigningKey.generate().private_key_b64()))
schema = schemathesis.openapi.from_asgi(
    "/openapi.json", _schema_app,
    config=schemathesis.Config.from_dict({"generation": GENERATION, "checks": CHECK_CONFIG}),
).exclude(path=SSE_PATH)
# Schemathesis cannot combine drawn data (`given`) with the schema's examples: fuzzing only.
real_schema = schemathesis.openapi.from_asgi(
    "/openapi.json", _schema_app,
    config=schemathesis.Config.from_dict({
        "generation": GENERATION, "checks": CHECK_CONFIG,
        "phases": {"examples": {"enabled": False}, "coverage": {"enabled": False}}}),
).include(path_regex=r"\{|^/v1/rollouts$|^/v1/bundle$").exclude(path=SSE_PATH)


def _api_routes(app: FastAPI) -> Iterator[tuple[str, set[str], Any]]:
    """(path, methods, dependant) of each route, through included routers on FastAPIs that nest them."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # FastAPI that flattens included routers into app.routes
        for route in app.routes:
            if isinstance(route, APIRoute):
                yield route.path, route.methods, route.dependant
        return
    for context in iter_route_contexts(app.routes):
        if isinstance(context.original_route, APIRoute):
            yield context.path, context.methods, context.original_route.dependant


def route_scopes(app: FastAPI) -> dict[tuple[str, str], frozenset[Scope]]:
    """(METHOD, path) -> the scopes its ``require(...)`` allows, for the routes that need a key."""
    out: dict[tuple[str, str], frozenset[Scope]] = {}
    for path, methods, dependant in _api_routes(app):
        pending = list(dependant.dependencies)
        while pending:
            dependency = pending.pop()
            pending.extend(dependency.dependencies)
            call = dependency.call
            if getattr(call, "__qualname__", "").startswith("require."):
                allowed = inspect.getclosurevars(call).nonlocals["allowed"]
                out.update({(method, path): frozenset(allowed) for method in methods})
    return out


SCOPES = route_scopes(_schema_app)


@dataclass
class Target:
    app: FastAPI
    admin: dict[str, str]
    worker: dict[str, str]

    def headers_for(self, case: Any) -> dict[str, str]:
        allowed = SCOPES.get((case.method.upper(), case.operation.path), frozenset())
        return self.worker if allowed and Scope.admin not in allowed else self.admin


# Values that name objects of the running target, by "location:name", filled by the `target`
# fixture. A callable is asked at draw time (the worker's ETag changes as the fuzz runs).
REAL: dict[str, list[Any]] = {}


def _key(url: str, scope: Scope, name: str) -> tuple[str, str]:
    engine = make_engine(url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            key, token = create_key(session, name=name, scope=scope, created_by="test:fuzz")
            return key.id, token
    finally:
        engine.dispose()


def _current_etag(app: FastAPI, worker: dict[str, str]) -> Callable[[], str]:
    def etag() -> str:
        with schemathesis_asgi.get_client(app) as client:
            response = client.get("/v1/bundle", params={"worker": WORKER_ID}, headers=worker)
        return response.headers.get("etag", '"none"')

    return etag


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'specgate.db'}"
    else:
        url = empty_postgres_schema(request.getfixturevalue("postgres_database"))
    upgrade(url)
    settings = ControlPlaneSettings(database_url=url, worker_stale_after_s=30, long_poll_max_s=LONG_POLL_MAX_S)
    _, revisions = seed_policy(url, extra_revisions=(seed_text(threshold=8),))
    worker = bearer(_key(url, Scope.worker, "fuzz-worker")[1])
    admin = bearer(_key(url, Scope.admin, "fuzz-admin")[1])
    spare_key_id, _ = _key(url, Scope.viewer, "fuzz-spare")
    app = create_app(settings)
    with TestClient(app) as client:
        r = client.post("/v1/workers/register", headers=worker,
                        json={"id": WORKER_ID, "pool": "a", "labels": {"zone": "z1"}, "engines": {}})
        assert r.status_code == 201, r.text
        r = client.post("/v1/rollouts", headers=admin, json={
            "policy": "seed", "revision": revisions[1], "mode": "traffic", "steps": [10, 50, 100],
            "reason": "fuzz"})
        assert r.status_code == 201, r.text
        rollout_id = r.json()["id"]
    REAL.clear()
    REAL.update({
        "path:name": ["seed"], "path:revision_id": revisions, "path:worker_id": [WORKER_ID],
        "path:rollout_id": [rollout_id], "path:key_id": [spare_key_id],
        "query:worker": [WORKER_ID], "query:policy": ["seed"], "query:from": revisions, "query:to": revisions,
        "query:wait": [0.05, LONG_POLL_MAX_S],
        "header:if-match": ["*", f'"{revisions[-1]}"'], "header:if-none-match": [_current_etag(app, worker)],
        "body:policy": ["seed"], "body:revision": revisions, "body:steps": [[10, 50, 100], [100]],
        "body:target": [{}], "body:reason": ["fuzz"],
    })
    try:
        yield Target(app, admin=admin, worker=worker)
    finally:
        REAL.clear()
        # Ends the lifespans schemathesis started: engines disposed, PostgreSQL listener stopped.
        schemathesis_asgi.shutdown_lifespans()


@schema.parametrize()
def test_api(case: Any, target: Target) -> None:
    case.call_and_validate(headers=target.headers_for(case), app=target.app, checks=CHECKS)


def _aim_at_real_objects(case: Any, data: st.DataObject) -> None:
    """Sometimes name existing objects, field by field; drawn, so a failure shrinks to the fields that matter.

    Positive cases only: swapping a real name into the field a negative case broke would make it
    valid while schemathesis still expects a refusal.
    """
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return
    for location, container in (("path", case.path_parameters), ("query", case.query),
                                ("header", case.headers), ("body", case.body)):
        if not isinstance(container, dict):
            continue
        for name in list(container):
            # Header names are case-insensitive (FastAPI declares `if-none-match`).
            values = REAL.get(f"{location}:{name.lower() if location == 'header' else name}")
            if values and data.draw(st.booleans(), label=f"real {location} {name}"):
                value = data.draw(st.sampled_from(values), label=f"{location} {name}")
                container[name] = value() if callable(value) else value
    if case.operation.path == "/v1/bundle" and data.draw(st.booleans(), label="long-poll"):
        # The registered worker, holding its current ETag: the request waits, then answers 304.
        case.query = {**(case.query or {}), "worker": WORKER_ID,
                      "wait": data.draw(st.sampled_from(REAL["query:wait"]), label="wait")}
        etag = REAL["header:if-none-match"][0]
        case.headers = {**(case.headers or {}), "if-none-match": etag() if callable(etag) else etag}


@real_schema.parametrize()
@real_schema.given(data=st.data())
def test_api_on_real_objects(case: Any, data: st.DataObject, target: Target) -> None:
    _aim_at_real_objects(case, data)
    case.call_and_validate(headers=target.headers_for(case), app=target.app, checks=CHECKS)


# --- what the fuzzer found, pinned ------------------------------------------------------------------

def _operations() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in _schema_app.openapi()["paths"].items():
        for method, operation in item.items():
            yield method.upper(), path, operation


def test_every_error_response_is_declared_as_a_problem() -> None:
    seen = 0
    for method, path, operation in _operations():
        for status, response in operation["responses"].items():
            if not status.startswith(("4", "5")) or (path, status) == ("/readyz", "503"):
                continue
            seen += 1
            assert list(response.get("content", {})) == [PROBLEM_MEDIA_TYPE], (method, path, status)
            assert response["content"][PROBLEM_MEDIA_TYPE]["schema"] == PROBLEM_SCHEMA, (method, path, status)
    assert seen > 50
    assert "HTTPValidationError" not in _schema_app.openapi().get("components", {}).get("schemas", {})


def test_every_operation_that_needs_a_key_declares_401_and_403() -> None:
    assert SCOPES, "no route found with require(...)"
    for method, path, operation in _operations():
        if (method, path) in SCOPES:
            assert {"401", "403"} <= set(operation["responses"]), (method, path)
        else:
            assert "401" not in operation["responses"], (method, path)
    assert SCOPES[("POST", "/v1/workers/register")] == {Scope.worker}
    assert Scope.admin in SCOPES[("GET", "/v1/bundle")]


def test_abort_declares_its_body_required() -> None:
    body = _schema_app.openapi()["paths"]["/v1/rollouts/{rollout_id}/abort"]["post"]["requestBody"]
    assert body["required"] is True
    schema = body["content"]["application/json"]["schema"]
    assert schema["required"] == ["reason"]
    assert "anyOf" not in schema


def test_405_names_every_method_of_the_path(client: TestClient, admin: dict[str, str]) -> None:
    r = client.request("TRACE", "/v1/keys", headers=admin)
    assert r.status_code == 405
    assert r.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "POST"}
    r = client.request("OPTIONS", "/v1/killswitch", headers=admin)
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "PUT"}
    r = client.delete("/healthz")
    assert r.status_code == 405
    assert r.headers["allow"] == "GET"


@pytest.mark.parametrize("body", [b'{"name": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000],
                         ids=["not-utf8", "too-deep"])
def test_unreadable_json_body_is_422_invalid_json(client: TestClient, admin: dict[str, str], body: bytes) -> None:
    r = client.post("/v1/policies", content=body, headers={**admin, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert [(e["path"], e["code"]) for e in r.json()["errors"]] == [("body", "invalid_json")]


def test_heartbeat_in_flight_is_a_strict_count(client: TestClient, worker_key: dict[str, str]) -> None:
    r = client.post("/v1/workers/register", headers=worker_key, json={"id": "w1", "pool": "a"})
    assert r.status_code == 201, r.text
    for bad in (False, "3", 1.5, -1):
        r = client.post("/v1/workers/w1/heartbeat", headers=worker_key, json={"in_flight": bad})
        assert r.status_code == 422, (bad, r.text)
        assert [e["path"] for e in r.json()["errors"]] == ["in_flight"]
    assert client.post("/v1/workers/w1/heartbeat", headers=worker_key, json={"in_flight": 3}).status_code == 200


def test_audit_cursor_beyond_64_bits_is_422_not_500(client: TestClient, admin: dict[str, str]) -> None:
    r = client.get("/v1/audit", params={"cursor": 2**63}, headers=admin)
    assert r.status_code == 422, r.text
    assert [e["path"] for e in r.json()["errors"]] == ["cursor"]
    r = client.get("/v1/audit", params={"cursor": 2**63 - 1}, headers=admin)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("method", "path", "params", "body", "where"), [
    *[("GET", "/v1/audit", {name: "a\x00b"}, None, name)
      for name in ("action", "actor", "target_type", "target_id", "q")],
    ("POST", "/v1/keys", None, {"name": "a\x00b", "scope": "viewer"}, "name"),
    ("DELETE", "/v1/keys/a%00b", None, None, "key_id"),
])
def test_nul_in_text_is_422_not_a_driver_error(client: TestClient, admin: dict[str, str], method: str, path: str,
                                               params: dict[str, str] | None, body: dict[str, str] | None,
                                               where: str) -> None:
    # PostgreSQL text cannot hold NUL; before the fix these reached the driver and answered 500 there.
    r = client.request(method, path, params=params, json=body, headers=admin)
    assert r.status_code == 422, r.text
    assert [e["path"] for e in r.json()["errors"]] == [where]


def test_revoke_reason_with_nul_is_422_and_revokes_nothing(client: TestClient, admin: dict[str, str],
                                                           make_key: Callable[[Scope, str], str]) -> None:
    make_key(Scope.viewer, "victim")
    [victim] = [k for k in client.get("/v1/keys", headers=admin).json() if k["name"] == "victim"]
    r = client.delete(f"/v1/keys/{victim['id']}", params={"reason": "a\x00b"}, headers=admin)
    assert r.status_code == 422, r.text
    assert [k["revoked_at"] for k in client.get("/v1/keys", headers=admin).json() if k["name"] == "victim"] == [None]


# --- the codes of errors are a closed set ---------------------------------------------------------------------
# The problem schema lists every ProblemCode, so response_schema_conformance above already refuses any other code
# the fuzzer provokes; these cover what random requests rarely reach.

CODES = {code.value for code in ProblemCode}


def test_the_documented_problem_lists_the_closed_codes() -> None:
    errors = PROBLEM_SCHEMA["properties"]["errors"]["items"]["properties"]
    assert errors["code"]["enum"] == [code.value for code in ProblemCode]


@pytest.mark.parametrize(("method", "path", "params", "body"), [
    ("POST", "/v1/policies", None, {"name": 7, "pool": ["a"], "colour": "red"}),
    ("POST", "/v1/policies", None, "not an object"),
    ("POST", "/v1/rollouts", None, {"policy": "seed\x00", "revision": "", "steps": [0, 150, "x"],
                                    "mode": "dns", "target": {"color": 1}}),
    ("GET", "/v1/rollouts", {"state": "done", "limit": "many", "cursor": "!"}, None),
    ("GET", "/v1/telemetry/rollups", {"from": "yesterday", "group_by": "colour", "limit": 0}, None),
    ("GET", "/v1/telemetry/rollups", {"from": "9999-12-31T23:59:59-12:00"}, None),
    ("GET", "/v1/bundle", {"worker": "w\x00", "wait": 10**9}, None),
    ("GET", "/v1/audit", {"cursor": 2**63}, None),
    ("POST", "/v1/workers/register", None, {"id": "", "pool": "a\x01", "in_flight": True}),
    ("POST", "/v1/telemetry/batches", None, [1, 2]),
    ("POST", "/v1/telemetry/batches", None, {"batch_id": "b", "worker_id": "w", "schema_version": 2, "events": 1}),
])
def test_the_error_handler_answers_only_closed_codes(client: TestClient, admin: dict[str, str],
                                                     worker_key: dict[str, str], method: str, path: str,
                                                     params: dict[str, Any] | None, body: Any) -> None:
    headers = worker_key if path.startswith(("/v1/workers", "/v1/telemetry/batches")) else admin
    r = client.request(method, path, params=params, json=body, headers=headers)
    assert r.status_code in (400, 404, 422), r.text
    codes = [e["code"] for e in r.json().get("errors", [])]
    assert codes, r.text
    assert set(codes) <= CODES, r.text


def test_every_code_written_in_the_control_plane_is_a_problem_code() -> None:
    # Codes written as literals where the API builds its own field errors, in every domain.
    written = re.compile(r'"code":\s*"(\w+)"|_field(?:_error)?\([^,()]+,\s*"(\w+)"|code="(\w+)"')
    found: dict[str, str] = {}
    for source in sorted((paths.ROOT / "controlplane").rglob("*.py")):
        for match in written.finditer(source.read_text()):
            found.setdefault(next(g for g in match.groups() if g), source.name)
    assert len(found) >= 15, found  # the pattern still finds the API's codes
    assert {code: where for code, where in found.items() if code not in CODES} == {}
