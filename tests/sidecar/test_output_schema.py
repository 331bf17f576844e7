"""Output-schema validators match regular expressions with RE2 (linear time, syntax closer to ECMA-262 than
Python's re): the same verdicts as jsonschema's where the two engines agree, and no remote reference fetched."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import jsonschema
import pytest

import sidecar.proxy as proxy
from sidecar.output_schema import compile_output_schema

# Python's re takes about 2**n steps for this pattern on n letters and a mismatch at the end.
CATASTROPHIC = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(a+)+$"}}}


def _verdict_within(validator: Any, value: Any, seconds: float = 60.0) -> bool:
    """The verdict, from a thread; a verdict that does not come in ``seconds`` is a hang (the backtracking
    engine would need hours here), not a slow run."""
    verdict: list[bool] = []
    worker = threading.Thread(target=lambda: verdict.append(bool(validator.is_valid(value))), daemon=True)
    worker.start()
    worker.join(seconds)
    assert verdict, "validation did not finish: the pattern is matched by a backtracking engine"
    return verdict[0]


def test_a_catastrophic_pattern_against_a_near_miss_is_answered() -> None:
    validator = compile_output_schema(CATASTROPHIC)
    assert validator is not None
    assert _verdict_within(validator, {"x": "a" * 64 + "!"}) is False
    assert _verdict_within(validator, {"x": "a" * 64}) is True


def test_catastrophic_pattern_properties_and_additional_properties_are_answered() -> None:
    schema = {"type": "object", "patternProperties": {"^(a|aa)+$": {"type": "integer"}},
              "additionalProperties": False}
    validator = compile_output_schema(schema)
    assert validator is not None
    assert _verdict_within(validator, {"a" * 64 + "!": 1}) is False  # matches no pattern: an extra property
    assert _verdict_within(validator, {"a" * 64: 1}) is True
    assert _verdict_within(validator, {"a" * 64: "one"}) is False


@pytest.mark.parametrize(("schema", "values"), [
    ({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, ["ab-12", "ab-123", "AB-12", "", 5]),
    ({"type": "string", "pattern": "b"}, ["abc", "xyz"]),  # unanchored: a search, not a full match
    ({"type": "object", "properties": {"id": {"type": "string"}},
      "patternProperties": {"^x-": {"type": "number"}, "_n$": {"type": "integer"}},
      "additionalProperties": False},
     [{"id": "1"}, {"id": "1", "x-a": 1.5}, {"x-a": "no"}, {"other": 1}, {"a_n": 2}, {"a_n": 2.5}, []]),
    ({"type": "object", "patternProperties": {"^p": {"type": "string"}},
      "additionalProperties": {"type": "boolean"}},
     [{"pa": "s", "q": True}, {"pa": "s", "q": 1}, {"pa": 1}]),
    ({"type": "object", "additionalProperties": False, "properties": {"a": {}}}, [{"a": 1}, {"b": 1}]),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
      "items": {"type": "string", "pattern": "^\\d+$"}}, [["1", "22"], ["1", "x"]]),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
      "patternProperties": {"^[A-Z]": {"minimum": 0}}}, [{"A": 1}, {"A": -1}, {"a": -1}]),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, [{"abc": 1}, {"aB": 1}]),
])
def test_verdicts_equal_jsonschemas_own(schema: dict[str, Any], values: list[Any]) -> None:
    ours = compile_output_schema(schema)
    assert ours is not None
    stock = jsonschema.validators.validator_for(schema)(schema)
    assert [ours.is_valid(v) for v in values] == [stock.is_valid(v) for v in values]
    # Both verdicts occur, so the comparison says something.
    assert {ours.is_valid(v) for v in values} == {True, False}


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^(a)\\1$"},                        # a backreference
    {"type": "string", "pattern": "^(?=.*[0-9]).{8,}$"},             # lookahead
    {"type": "object", "patternProperties": {"(?<!x)y": {}}},       # lookbehind
    {"type": "object", "patternProperties": {"^a": {}}, "unevaluatedProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "patternProperties": {"^a": {}}}},
     "$defs": {"b": {"unevaluatedProperties": False}}},
], ids=["backreference", "lookahead", "lookbehind", "unevaluated-properties", "unevaluated-elsewhere"])
def test_what_re2_cannot_match_in_linear_time_gets_no_validator(schema: dict[str, Any]) -> None:
    # No verdict (structured_valid null), never a backtracking match.
    assert compile_output_schema(schema) is None


def test_a_schema_without_patterns_validates_as_jsonschema_does() -> None:
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    validator = compile_output_schema(schema)
    assert validator.is_valid({"a": 1})
    assert not validator.is_valid({"a": "1"})


def test_unique_items_over_a_long_answer_is_answered() -> None:
    validator = compile_output_schema({"type": "array", "uniqueItems": True})
    distinct = [{"a": i} for i in range(20_000)]
    assert _verdict_within(validator, distinct) is True  # pairwise, this is minutes
    assert _verdict_within(validator, [*distinct, {"a": 7}]) is False


@pytest.mark.parametrize("items", [
    [1, 1.0], [1, True], [0, False], [{"a": 1, "b": [1, 2]}, {"b": [1, 2.0], "a": 1}], [[1, 2], [2, 1]],
    ["1", 1], [None, None], [{"a": {"b": True}}, {"a": {"b": 1}}], [1.5, 1.5], [2**70, 2**70 + 1],
])
def test_unique_items_verdicts_equal_jsonschemas_own(items: list[Any]) -> None:
    schema = {"type": "array", "uniqueItems": True}
    ours = compile_output_schema(schema)
    stock = jsonschema.validators.validator_for(schema)(schema)
    assert ours.is_valid(items) == stock.is_valid(items)


def test_an_invalid_schema_gets_no_validator() -> None:
    assert compile_output_schema({"type": "no-such-type"}) is None
    assert compile_output_schema({"type": "string", "pattern": 5}) is None


def test_the_sidecars_schema_cache_compiles_validators_with_linear_patterns() -> None:
    async def compiled() -> Any:
        cache = proxy._SchemaCache(1 << 20)
        try:
            return await cache.lookup(b"catastrophic", CATASTROPHIC)
        finally:
            cache.close()

    validator = asyncio.run(compiled())
    assert _verdict_within(validator, {"x": "a" * 64 + "!"}) is False


@pytest.mark.parametrize("with_a_pattern", [False, True])
def test_a_remote_reference_is_never_fetched_and_gets_no_verdict(tmp_path: Any, with_a_pattern: bool) -> None:
    remote = tmp_path / "remote.json"
    remote.write_text('{"type": "string", "pattern": "^(a+)+$"}')
    schema: dict[str, Any] = {"type": "object", "properties": {"x": {"$ref": remote.as_uri()}}}
    if with_a_pattern:
        schema["properties"]["y"] = {"type": "string", "pattern": "^b"}
    validator = compile_output_schema(schema)
    assert validator is not None
    with pytest.raises(Exception, match="Unresolvable"):
        validator.is_valid({"x": "a" * 64 + "!"})  # the sidecar records no verdict for it


def test_references_within_the_schema_and_to_metaschemas_resolve() -> None:
    schema = {"$defs": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "type": "array",
              "items": {"$ref": "#/$defs/code"}}
    validator = compile_output_schema(schema)
    assert validator.is_valid(["ABC"])
    assert not validator.is_valid(["abc"])
    meta = {"$ref": "https://json-schema.org/draft/2020-12/schema"}
    checker = compile_output_schema(meta)
    assert checker.is_valid({"type": "string"})
    assert not checker.is_valid({"type": 5})
