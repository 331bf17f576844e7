"""Problem bodies and their closed codes: the builder, the reader, ProblemCode and the mapping from pydantic."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field, StringConstraints, ValidationError

from policies import ErrorCode, pydantic_error_code
from policies.model import NAME_PATTERN
from tests.support import paths
from wire.problems import PROBLEM_BASE, PROBLEM_SCHEMA, ProblemCode, problem, problem_bytes, problem_code, read_problem


def test_problem_codes_are_the_policy_codes_and_the_apis_own() -> None:
    assert {c.value for c in ErrorCode} <= {c.value for c in ProblemCode}
    for code in (*ErrorCode, *ProblemCode):
        assert code.name == code.value  # a member and its string are interchangeable (hash, compare, encode)
    assert PROBLEM_SCHEMA["properties"]["errors"]["items"]["properties"]["code"]["enum"] == [
        c.value for c in ProblemCode]


@pytest.mark.parametrize(("error", "code"), [
    ({"type": "json_invalid"}, "invalid_json"),
    ({"type": "missing"}, "missing"),
    ({"type": "extra_forbidden"}, "unknown_field"),
    ({"type": "model_type"}, "wrong_type"),
    ({"type": "int_parsing"}, "wrong_type"),
    ({"type": "datetime_from_date_parsing"}, "wrong_type"),
    ({"type": "less_than_equal"}, "out_of_range"),
    ({"type": "finite_number"}, "out_of_range"),
    ({"type": "string_too_long"}, "too_long"),
    ({"type": "string_too_short", "ctx": {"min_length": 1}}, "empty"),
    ({"type": "too_short", "ctx": {"min_length": 3}}, "too_short"),
    ({"type": "string_pattern_mismatch", "ctx": {"pattern": NAME_PATTERN}}, "invalid_name"),
    ({"type": "string_pattern_mismatch", "ctx": {"pattern": r"^[^\x00]*$"}}, "invalid_format"),
    ({"type": "enum"}, "invalid_value"),
    ({"type": "literal_error"}, "invalid_value"),
    ({"type": "value_error"}, "invalid_value"),
    ({"type": "inverted_range"}, "inverted_range"),  # a code of the models' own validators
    ({"type": "a_type_pydantic_adds_one_day"}, "invalid_value"),
    ({}, "invalid_value"),
])
def test_pydantic_errors_map_to_one_closed_code(error: dict[str, Any], code: str) -> None:
    assert problem_code(error) == code
    assert isinstance(problem_code(error), ProblemCode)
    if error.get("type") not in ("json_invalid", "missing"):  # the API's own words for these two
        assert pydantic_error_code(error) == code


class _Everything(BaseModel):
    """Fields that between them make most of pydantic's error types."""

    name: Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
    text: Annotated[str, StringConstraints(min_length=1, max_length=3)]
    count: int = Field(ge=0, le=5)
    ratio: float = Field(allow_inf_nan=False)
    kind: Literal["a", "b"]
    items: list[int] = Field(min_length=2)
    flag: bool


@pytest.mark.parametrize("data", [
    {},
    {"name": "-x", "text": "", "count": -1, "ratio": float("inf"), "kind": "c", "items": [1], "flag": "maybe"},
    {"name": 1, "text": "long", "count": 6, "ratio": "x", "kind": None, "items": "no", "flag": [], "extra": 1},
    "not an object",
])
def test_every_error_of_a_real_validation_has_a_problem_code(data: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        _Everything.model_validate(data)
    codes = [problem_code(e) for e in caught.value.errors()]
    assert codes
    assert all(isinstance(c, ProblemCode) for c in codes)


def test_the_builder_writes_what_the_reader_reads() -> None:
    body = problem(422, "validation", "The request did not validate", "1 field did not validate",
                   instance="/v1/x", errors=[{"path": "wait", "in": "query", "code": ProblemCode.out_of_range,
                                              "message": "too long"}], current_head="abc")
    raw = problem_bytes(422, "validation", "The request did not validate", "1 field did not validate",
                        instance="/v1/x", errors=body["errors"], current_head="abc")
    assert json.loads(raw) == body
    assert b'"code": "out_of_range"' in raw  # the member encodes as its plain string
    read = read_problem(422, raw)
    assert (read.type, read.slug, read.status, read.instance) == (PROBLEM_BASE + "validation", "validation", 422,
                                                                   "/v1/x")
    assert [(e.path, e.in_, e.code) for e in read.errors] == [("wait", "query", "out_of_range")]
    assert read.extra == {"current_head": "abc"}


def test_the_sidecars_problem_bytes_are_the_builders() -> None:
    # The sidecar writes these bytes itself; they must not change with the move to one builder.
    assert problem_bytes(503, "no-policy", "No policy", "no policy loaded yet") == (
        b'{"type": "https://specgate.dev/problems/no-policy", "title": "No policy", "status": 503, '
        b'"detail": "no policy loaded yet"}')


def test_the_control_plane_document_explains_every_code() -> None:
    text = (paths.ROOT / "docs" / "control-plane.md").read_text()
    table = text[text.index("## Error codes"):text.index("\n## ", text.index("## Error codes") + 1)]
    explained = {code for line in table.splitlines() if line.startswith("| `")
                 for code in re.findall(r"`(\w+)`", line.split("|")[1])}
    assert explained == {code.value for code in ProblemCode}
