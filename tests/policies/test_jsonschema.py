"""The published JSON Schema of a policy document agrees with the library on everything a schema can say.

Which error codes a schema can express was decided once, here:

- STRUCTURAL: a statement about one value on its own (its type, presence, bounds, length, pattern, allowed
  values), which is what the models declare per field, plus the one conditional field
  (``exploration.speculative_engine`` once ``rate > 0``). A document the library refuses with any of these
  must fail the schema.
- SEMANTIC: a relation between values (a name that must be defined elsewhere in the document or be of the
  right kind, one number compared with another, names unique across a list, counting plain engines, one rule
  covering another, what the rules cost once compiled). JSON Schema has no way to refer from one value to
  another, so a document refused only for these must pass the schema: the schema never refuses what the
  library would accept.
- TEXT: about the bytes, not the data (encoding, size, YAML syntax and duplicate keys): a schema sees the
  parsed document only.

One limit of JSON itself: it has one kind of number, so ``4.0`` for an integer field passes the schema while
the strict library refuses it.
"""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import policies
from policies import PolicyValidationError, validate_data
from policies.__main__ import main
from policies.jsonschema import DIALECT, SCHEMA_ID, SCHEMA_PATH, policy_schema, schema_text
from tests.support import paths
from tests.support.policy_strategies import raw_documents

STRUCTURAL = frozenset({
    "unknown_field", "missing_field", "wrong_type", "out_of_range", "empty", "too_long", "invalid_name",
    "invalid_value", "empty_range", "reserved_name", "unsupported_api_version",
})
SEMANTIC = frozenset({
    "inverted_range", "undefined_engine", "no_plain_engine", "ambiguous_plain_engine", "not_plain_engine",
    "not_speculative_engine", "plain_engine_k", "k_above_engine", "duplicate_rule_name", "shadowed_rule",
    "too_complex", "schedule_conflict",
})
TEXT = frozenset({"yaml_syntax", "duplicate_key", "document_too_large", "empty_document", "invalid_encoding"})

VALIDATOR = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))


def _load(name: str) -> Any:
    return yaml.safe_load((paths.VECTORS / name).read_text(encoding="utf-8"))


VALID_GROUPS: list[dict[str, Any]] = _load("valid.yaml")["groups"]
INVALID_VECTORS: list[dict[str, Any]] = _load("invalid.yaml")["vectors"]
EXAMPLES = sorted(paths.EXAMPLES.glob("*.yaml"))


def _codes(vector: dict[str, Any]) -> set[str]:
    return {e["code"] for e in vector["errors"]}


def _data(vector: dict[str, Any]) -> Any:
    if "document" in vector:
        return vector["document"]
    assert "text" in vector, f"{vector['name']!r}: a vector with a schema-visible error is data or text"
    return yaml.safe_load(vector["text"])


def _schema_errors(data: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(data)]


# --- the file --------------------------------------------------------------------------------------------


def test_the_committed_schema_is_the_generated_one() -> None:
    # A model change that forgets `python -m policies schema > policies/schema/specgate-v1.json` fails here.
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema_text()


def test_it_is_a_draft_2020_12_schema_with_an_id_and_a_title() -> None:
    schema = policy_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert (schema["$schema"], schema["$id"]) == (DIALECT, SCHEMA_ID)
    assert "specgate/v1" in schema["title"]
    # plain JSON Schema: OpenAPI's discriminator keyword would be noise to an editor
    assert "discriminator" not in SCHEMA_PATH.read_text(encoding="utf-8")


def test_python_m_policies_schema_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert capsys.readouterr().out == SCHEMA_PATH.read_text(encoding="utf-8")


def test_it_is_shipped_with_the_package() -> None:
    package_data = tomllib.loads((paths.ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "package-data"]["policies"]
    inside = SCHEMA_PATH.relative_to(Path(policies.__file__).parent).as_posix()
    assert [pattern for pattern in package_data if fnmatch.fnmatch(inside, pattern)] != []


# --- the examples -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_points_editors_at_the_schema_and_passes_it(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    first_line = text.splitlines()[0]
    assert first_line == "# yaml-language-server: $schema=../schema/specgate-v1.json"
    assert (path.parent / first_line.split("$schema=", 1)[1]).resolve() == SCHEMA_PATH.resolve()
    assert _schema_errors(yaml.safe_load(text)) == []


# --- the vectors ------------------------------------------------------------------------------------------


def test_every_code_of_the_vectors_is_classified_once() -> None:
    assert len(STRUCTURAL | SEMANTIC | TEXT) == len(STRUCTURAL) + len(SEMANTIC) + len(TEXT)
    # The vectors pin every code the library reports (test_vectors.py), so this sees a new one.
    used = {code for vector in INVALID_VECTORS for code in _codes(vector)}
    assert used - (STRUCTURAL | SEMANTIC | TEXT) == set(), "a new error code: decide whether a schema can say it"
    # every code of both classes is pinned by some vector, so each half of the agreement below is tested
    assert used >= STRUCTURAL
    assert used >= SEMANTIC


@pytest.mark.parametrize("group", VALID_GROUPS, ids=lambda g: g["name"])
def test_every_valid_vector_passes(group: dict[str, Any]) -> None:
    assert _schema_errors(group["policy"]) == []


@pytest.mark.parametrize("vector", [v for v in INVALID_VECTORS if _codes(v) & STRUCTURAL], ids=lambda v: v["name"])
def test_every_structurally_invalid_vector_fails(vector: dict[str, Any]) -> None:
    assert _schema_errors(_data(vector)) != []


@pytest.mark.parametrize("vector", [v for v in INVALID_VECTORS if _codes(v) <= SEMANTIC], ids=lambda v: v["name"])
def test_a_vector_refused_only_for_relations_between_values_passes(vector: dict[str, Any]) -> None:
    assert _schema_errors(_data(vector)) == []


# --- any document -----------------------------------------------------------------------------------------

_WRONG_TYPE: dict[type, Any] = {str: 7, int: "7", float: "0.5", bool: "yes", list: {"a": 1}, dict: ["a"]}


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [at] if at else []
    if isinstance(value, dict):
        found += [p for key, item in value.items() for p in _paths(item, (*at, key))]
    elif isinstance(value, list):
        found += [p for i, item in enumerate(value) for p in _paths(item, (*at, i))]
    return found


def _mutated(value: Any, how: str) -> Any:
    if how == "wrong_type":
        return _WRONG_TYPE.get(type(value), "x")
    if how == "negative" and isinstance(value, int | float) and not isinstance(value, bool):
        return -1
    if how == "huge" and isinstance(value, int | float) and not isinstance(value, bool):
        return 10**9
    if how == "empty":
        return type(value)() if isinstance(value, str | list | dict) else None
    return value


@st.composite
def broken_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A valid document (but for shadowed rules) with, usually, one value broken or one field deleted or added."""
    doc = draw(raw_documents(max_rules=4))
    spots = _paths(doc)
    how = draw(st.sampled_from(("none", "wrong_type", "negative", "huge", "empty", "delete", "add")))
    if how == "none":
        return doc
    where = draw(st.sampled_from(spots))
    parent = doc
    for step in where[:-1]:
        parent = parent[step]
    key = where[-1]
    if how == "delete" and isinstance(parent, dict):
        del parent[key]
    elif how == "add" and isinstance(parent[key], dict):
        parent[key]["zz_unknown"] = 1
    else:
        parent[key] = _mutated(parent[key], how)
    return doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broken_documents())
def test_the_schema_refuses_a_document_exactly_when_the_library_finds_a_structural_error(doc: dict[str, Any]) -> None:
    try:
        validate_data(doc)
        codes: set[str] = set()
    except PolicyValidationError as exc:
        codes = {e.code for e in exc.errors}
    assert codes <= STRUCTURAL | SEMANTIC, codes
    assert bool(_schema_errors(doc)) == bool(codes & STRUCTURAL), (codes, _schema_errors(doc), doc)
