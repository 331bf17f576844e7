"""The client follows the API: every call's method, path, parameters and answer model against ``app.openapi()``.

Schemas are compared as JSON Schema, with every ``$ref`` resolved on both
sides, so the check does not depend on what the components are called. The
client may read fewer fields than the API sends, and accept more than it
sends; never the other way round.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict

from apiclient import Endpoint, calls, models
from controlplane.app import create_app
from controlplane.settings import ControlPlaneSettings

Schema = dict[str, Any]
_MISSING = object()


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> Schema:
    # Building the document opens no database: a file that never comes to exist is enough.
    url = f"sqlite:///{tmp_path_factory.mktemp('openapi') / 'unused.db'}"
    openapi: Schema = create_app(ControlPlaneSettings(database_url=url)).openapi()
    return openapi


# --- the comparison ------------------------------------------------------------------------

def _resolve(schema: Any, root: Schema) -> Schema:
    """The schema with its ``$ref`` followed (keywords beside the ``$ref`` are kept); ``True`` is ``{}``."""
    if schema is True:
        return {}
    seen = 0
    while "$ref" in schema:
        pointer = schema["$ref"]
        assert pointer.startswith("#/"), pointer
        target: Any = root
        for part in pointer[2:].split("/"):
            target = target[part]
        schema = {**{k: v for k, v in schema.items() if k != "$ref"}, **target}
        seen += 1
        assert seen < 50, f"a $ref cycle at {pointer}"
    return dict(schema)


def _variants(schema: Any, root: Schema) -> list[Schema]:
    """The alternatives a value may take (``anyOf``/``oneOf`` flattened, one entry per ``type``)."""
    resolved = _resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        if key in resolved:
            return [v for sub in resolved[key] for v in _variants(sub, root)]
    if len(resolved.get("allOf", [])) == 1:
        return _variants(resolved["allOf"][0], root)
    if isinstance(resolved.get("type"), list):
        return [{**resolved, "type": t} for t in resolved["type"]]
    return [resolved]


def _kind(schema: Schema) -> str:
    if "enum" in schema or "const" in schema:
        return "enum"
    if "type" in schema:
        return str(schema["type"])
    return "object" if "properties" in schema else "any"


def _values(schema: Schema) -> list[Any]:
    return list(schema["enum"]) if "enum" in schema else [schema["const"]]


def _describe(schema: Schema) -> str:
    kind = _kind(schema)
    if kind == "enum":
        return f"one of {_values(schema)}"
    if kind == "string" and "format" in schema:
        return f"string ({schema['format']})"
    return kind


_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}


def _accepts(client: Schema, api: Schema, where: str, croot: Schema, aroot: Schema) -> list[str]:
    """Why a value the API may send (``api``, one alternative) would not fit the client's ``client``."""
    ckind, akind = _kind(client), _kind(api)
    if ckind == "any":
        return []
    if akind == "any":
        return [f"{where}: the API may send anything, the client expects {_describe(client)}"]
    if akind == "enum":
        if ckind == "enum":
            extra = [v for v in _values(api) if v not in _values(client)]
            return [f"{where}: the API may send {extra}, the client expects {_describe(client)}"] if extra else []
        kinds = {_JSON_TYPES.get(type(v), "?") for v in _values(api)}
        if kinds <= {ckind} or (ckind == "number" and kinds <= {"integer", "number"}):
            return []
        return [f"{where}: the API sends {_describe(api)}, the client expects {_describe(client)}"]
    if ckind == "enum":
        return [f"{where}: the API sends any {_describe(api)}, the client only {_describe(client)}"]
    if ckind != akind and not (ckind == "number" and akind == "integer"):
        return [f"{where}: the API sends {_describe(api)}, the client expects {_describe(client)}"]
    if ckind == "string" and client.get("format") not in (None, api.get("format")):
        return [f"{where}: the API sends {_describe(api)}, the client expects {_describe(client)}"]
    if ckind == "array":
        return compare(client.get("items", {}), api.get("items", {}), f"{where}[]", croot, aroot)
    if ckind == "object":
        return _objects(client, api, where, croot, aroot)
    return []


def _objects(client: Schema, api: Schema, where: str, croot: Schema, aroot: Schema) -> list[str]:
    if "properties" in client:
        if "properties" not in api:
            return [f"{where}: the API sends a free-form object, the client expects the fields "
                    f"{sorted(client['properties'])}"]
        return compare_model(client, api, where, croot, aroot)
    # The client reads a mapping: every value the API may put in it must fit the mapping's values.
    values = client.get("additionalProperties", {})
    problems = []
    for name, prop in api.get("properties", {}).items():
        problems += compare(values, prop, f"{where}.{name}", croot, aroot)
    if "additionalProperties" in api:
        free = [] if api["additionalProperties"] is False else [api["additionalProperties"]]
    elif "patternProperties" in api:
        free = list(api["patternProperties"].values())
    else:
        free = [] if "properties" in api else [{}]
    for api_values in free:
        problems += compare(values, api_values, f"{where}{{}}", croot, aroot)
    return problems


def compare(client: Any, api: Any, where: str, croot: Schema, aroot: Schema) -> list[str]:
    """Why values the API may send at ``where`` would not fit the client's schema there (empty: they all fit)."""
    problems: list[str] = []
    options = _variants(client, croot)
    for sent in _variants(api, aroot):
        found = [_accepts(option, sent, where, croot, aroot) for option in options]
        if not any(not f for f in found):
            # Report the closest alternative: the one that failed deepest (it matched the kind at least).
            problems += max(found, key=lambda f: max(len(p.split(":")[0]) for p in f))
    return problems


def compare_model(client: Schema, api: Schema, where: str, croot: Schema, aroot: Schema) -> list[str]:
    """Field by field: the client's fields exist in the API with a fitting type, required-ness and default."""
    problems = []
    api_props: Schema = api.get("properties", {})
    client_required, api_required = set(client.get("required", [])), set(api.get("required", []))
    for name, cprop in client["properties"].items():
        here = f"{where}.{name}" if where else name
        if name not in api_props:
            problems.append(f"{here}: the API declares no such field")
            continue
        aprop = api_props[name]
        problems += compare(cprop, aprop, here, croot, aroot)
        if name in api_required and name not in client_required:
            problems.append(f"{here}: required by the API, optional in the client "
                            f"(default {cprop.get('default', 'from a factory')!r})")
        elif name in client_required and name not in api_required:
            problems.append(f"{here}: the API may leave it out, the client requires it")
        elif name not in client_required:
            problems += _defaults(cprop, aprop, here)
    return problems


def _defaults(cprop: Schema, aprop: Schema, where: str) -> list[str]:
    api_default = aprop.get("default", _MISSING)
    client_default = cprop.get("default", _MISSING)
    if api_default is not _MISSING:
        if client_default != api_default:
            shown = "none" if client_default is _MISSING else repr(client_default)
            return [f"{where}: default {shown} in the client, {api_default!r} in the API"]
        return []
    # FastAPI leaves `default: null` out of the document, and a default factory has no default in JSON Schema:
    # an absent default is one of those two, so the client may only default to null or to a factory.
    if client_default not in (_MISSING, None):
        return [f"{where}: default {client_default!r} in the client, null or empty in the API"]
    return []


def answer_schema(document: Schema, method: str, path: str, status: int) -> Schema:
    response = document["paths"][path][method.lower()]["responses"][str(status)]
    schema: Schema = response["content"]["application/json"]["schema"]
    return schema


def endpoint_problems(endpoint: Endpoint[Any], document: Schema) -> list[str]:
    """Everything about ``endpoint`` the API's document contradicts."""
    name = f"{endpoint.method} {endpoint.path}"
    operation = document["paths"].get(endpoint.path, {}).get(endpoint.method.lower())
    if operation is None:
        return [f"{name}: no such operation in the API"]
    problems = []
    declared = {(p["in"], p["name"]) for p in operation.get("parameters", [])}
    path_names = {n for kind, n in declared if kind == "path"}
    if path_names != set(endpoint.path_names):
        problems.append(f"{name}: path parameters {sorted(endpoint.path_names)}, the API's {sorted(path_names)}")
    problems += [f"{name}: the API has no query parameter {q!r}" for q in endpoint.query
                 if ("query", q) not in declared]
    successes = {int(code) for code in operation["responses"] if code.startswith("2")}
    if successes != set(endpoint.ok):
        problems.append(f"{name}: the client takes {sorted(endpoint.ok)} as success, the API answers "
                        f"{sorted(successes)}")
    client = endpoint.adapter.json_schema()
    for status in sorted(successes & set(endpoint.ok)):
        problems += [f"{name} {status}: {p}" for p in
                     compare(client, answer_schema(document, endpoint.method, endpoint.path, status), "",
                             client, document)]
    return problems


# --- the client against the API --------------------------------------------------------------

@pytest.mark.parametrize("endpoint", calls.ENDPOINTS, ids=lambda e: f"{e.method} {e.path}")
def test_every_call_matches_the_api(endpoint: Endpoint[Any], document: Schema) -> None:
    assert endpoint_problems(endpoint, document) == []


def test_every_endpoint_of_the_calls_module_is_checked() -> None:
    # ENDPOINTS is collected from the module: an endpoint defined there and left out would escape the check.
    defined = re.findall(r"^(\w+) = Endpoint\(", Path(calls.__file__).read_text(), flags=re.MULTILINE)
    assert len(defined) == len(calls.ENDPOINTS) > 30
    assert {e.path for e in calls.ENDPOINTS} >= {"/v1/audit", "/v1/whoami", "/v1/recommendations"}


# --- the check catches drift -----------------------------------------------------------------

class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OldDashboardAuditEvent(_Model):
    """The dashboard's hand-copied AuditEvent before this client: defaults the API does not have."""

    id: int
    at: str
    actor: str
    action: str
    target_type: str
    target_id: str
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    reason: str = ""


class OldAuditPage(_Model):
    items: list[OldDashboardAuditEvent]
    next_cursor: int | None


def test_defaults_the_api_does_not_have_are_drift(document: Schema) -> None:
    problems = endpoint_problems(Endpoint("GET", "/v1/audit", OldAuditPage), document)
    assert sorted(problems) == [
        "GET /v1/audit 200: items[].after: required by the API, optional in the client (default None)",
        "GET /v1/audit 200: items[].before: required by the API, optional in the client (default None)",
        "GET /v1/audit 200: items[].reason: required by the API, optional in the client (default '')",
    ]


class KillSwitchWithMore(_Model):
    enabled: bool
    reason: str
    changed: bool  # only PUT answers it
    changed_by: str  # the API sends null before the first change
    changed_at: int  # a date-time


def test_unknown_fields_and_narrower_types_are_drift(document: Schema) -> None:
    problems = endpoint_problems(Endpoint("GET", "/v1/killswitch", KillSwitchWithMore), document)
    assert sorted(problems) == [
        "GET /v1/killswitch 200: changed: the API declares no such field",
        "GET /v1/killswitch 200: changed_at: the API sends null, the client expects integer",
        "GET /v1/killswitch 200: changed_at: the API sends string (date-time), the client expects integer",
        "GET /v1/killswitch 200: changed_by: the API sends null, the client expects string",
    ]


class StrictWorkers(_Model):
    items: list[dict[str, int]]  # the values of a worker are not all integers
    next_cursor: str | None
    total: int = 0


def test_mappings_query_parameters_and_unknown_operations_are_checked(document: Schema) -> None:
    problems = endpoint_problems(Endpoint("GET", "/v1/workers", StrictWorkers, query=("pool", "colour")), document)
    assert "GET /v1/workers: the API has no query parameter 'colour'" in problems
    assert "GET /v1/workers 200: total: the API declares no such field" in problems
    assert "GET /v1/workers 200: items[].id: the API sends string, the client expects integer" in problems
    assert "GET /v1/workers 200: items[].stale: the API sends boolean, the client expects integer" in problems
    assert "GET /v1/workers 200: items[].labels: the API sends object, the client expects integer" in problems
    assert "GET /v1/workers 200: items[].registered_at: the API sends string (date-time), the client expects " \
           "integer" in problems
    assert endpoint_problems(Endpoint("DELETE", "/v1/workers", StrictWorkers), document) == [
        "DELETE /v1/workers: no such operation in the API"]
    assert endpoint_problems(Endpoint("GET", "/v1/policies/{policy}", models.Policy), document) == [
        "GET /v1/policies/{policy}: no such operation in the API"]


class PublicKey(_Model):
    public_key: str
    key_id: str
    algorithm: str = "RSA"


class CreatedRevision(models.Revision):
    seq: int = 1  # the API always sends it


def test_defaults_success_statuses_and_required_fields_are_checked(document: Schema) -> None:
    assert endpoint_problems(Endpoint("GET", "/v1/bundle/public-key", PublicKey), document) == [
        "GET /v1/bundle/public-key 200: algorithm: default 'RSA' in the client, 'Ed25519' in the API"]
    problems = endpoint_problems(Endpoint("POST", "/v1/policies/{name}/revisions", CreatedRevision, ok=(201,)),
                                 document)
    assert problems == [
        "POST /v1/policies/{name}/revisions: the client takes [201] as success, the API answers [200, 201]",
        "POST /v1/policies/{name}/revisions 201: seq: required by the API, optional in the client (default 1)"]


class FewStates(models.Rollout):
    state: Literal["running", "paused"]  # type: ignore[assignment]


def test_a_closed_set_narrower_than_the_api_is_drift(document: Schema) -> None:
    assert endpoint_problems(Endpoint("GET", "/v1/rollouts/{rollout_id}", FewStates), document) == [
        "GET /v1/rollouts/{rollout_id} 200: state: the API may send ['completed', 'aborted', 'rolled_back'], "
        "the client expects one of ['running', 'paused']"]
