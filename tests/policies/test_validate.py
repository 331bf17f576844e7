"""Validation beyond the shared vectors: lines, JSON, limits, hints, robustness."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from pydantic_core.core_schema import ErrorType

from policies import (
    MAX_DOCUMENT_BYTES,
    ErrorCode,
    FieldError,
    PolicyDocument,
    PolicyValidationError,
    RequestShape,
    RequestShapeError,
    load_policy,
    pydantic_error_code,
    revision_id,
    validate_data,
)
from policies.validate import _convert_pydantic
from tests.support import paths

EXAMPLES = sorted(paths.EXAMPLES.glob("*.yaml"))

# Line numbers matter in these documents: keep them as they are.
LINES = textwrap.dedent("""\
    apiVersion: specgate/v1
    name: lines
    engines:
      base: {method: none}
      draft:
        method: draft_model
        model: models/draft
        num_speculative_tokens: 4
    rules:
      - name: chat
        when: {route: [chat], batch_size: {max: 4}}
        then: {engine: draftt}
    default: {engine: base}
    """)

VALID = LINES.replace("draftt", "draft")


def errors_of(text: str | bytes, **kwargs: Any) -> tuple[FieldError, ...]:
    with pytest.raises(PolicyValidationError) as info:
        load_policy(text, **kwargs)
    assert info.value.errors, "a PolicyValidationError always carries its errors"
    return info.value.errors


def only(errors: tuple[FieldError, ...], code: str) -> FieldError:
    matching = [e for e in errors if e.code == code]
    assert len(matching) == 1, errors
    return matching[0]


def test_valid_document_loads() -> None:
    doc = load_policy(VALID)
    assert (doc.name, sorted(doc.engines), [r.name for r in doc.rules]) == ("lines", ["base", "draft"], ["chat"])
    assert doc.rules[0].then.engine == "draft"


# --- where errors are reported ------------------------------------------------------

def test_undefined_engine_reports_its_line_and_column() -> None:
    errors = errors_of(LINES)
    assert len(errors) == 1
    err = errors[0]
    assert (err.path, err.code, err.line) == ("rules[0].then.engine", "undefined_engine", 12)
    assert err.column == LINES.splitlines()[11].index("draftt") + 1
    assert "did you mean 'draft'?" in err.message
    assert "(line 12)" in str(err)


def test_structural_error_reports_its_line() -> None:
    errors = errors_of(VALID.replace("num_speculative_tokens: 4", "num_speculative_tokens: 40"))
    err = only(errors, "out_of_range")
    assert (err.path, err.line) == ("engines.draft.num_speculative_tokens", 8)


def test_missing_field_points_at_its_parent() -> None:
    text = VALID.replace("    then: {engine: draft}\n", "")
    err = only(errors_of(text), "missing_field")
    assert err.path == "rules[0].then"
    assert err.line == 10  # the rule, which is where `then` should have been


def test_duplicate_key_reports_the_second_occurrence() -> None:
    text = VALID.replace("default: {engine: base}\n", "default: {engine: base}\nname: again\n")
    err = only(errors_of(text), "duplicate_key")
    assert (err.path, err.line) == ("name", 14)


def test_yaml_syntax_error_reports_its_line() -> None:
    text = VALID.replace("    when: {route: [chat], batch_size: {max: 4}}",
                         "    when: {route: [chat, batch_size: {max: 4}}")
    err = only(errors_of(text), "yaml_syntax")
    assert err.line == 11
    assert "line 11" in err.message


def test_unsupported_api_version_is_one_error() -> None:
    errors = errors_of(VALID.replace("specgate/v1", "specgate/v2"))
    assert [(e.path, e.code, e.line) for e in errors] == [("apiVersion", "unsupported_api_version", 1)]


def test_label_value_errors_point_at_the_label() -> None:
    # The label value is a `str | list[str]` union; pydantic tags each branch's
    # error with the branch name, which must not leak into the document path.
    text = VALID.replace("batch_size: {max: 4}", "labels: {tier: 5}")
    errors = errors_of(text)
    assert {e.path for e in errors} == {"rules[0].when.labels.tier"}, [str(e) for e in errors]
    assert all(e.line == 11 for e in errors)


def test_label_list_item_error_points_at_the_item() -> None:
    text = VALID.replace("batch_size: {max: 4}", "labels: {tier: [a, '']}")
    errors = errors_of(text)
    assert "rules[0].when.labels.tier[1]" in {e.path for e in errors}, [str(e) for e in errors]
    assert all(e.path.startswith("rules[0].when.labels.tier") and "list[" not in e.path
               and "str" not in e.path.removeprefix("rules[0].when.labels.tier") for e in errors)


# --- all errors at once -----------------------------------------------------------

FIVE_PROBLEMS = textwrap.dedent("""\
    apiVersion: specgate/v1
    name: five
    descripton: a typo in a top-level field
    engines:
      base: {method: none}
      draft: {method: draft_model, model: models/draft, num_speculative_tokens: 4}
    rules:
      - name: a
        when: {route: [chat]}
        then: {engine: drfat}
      - name: b
        when: {route: [code]}
        then: {engine: draft, num_speculative_tokens: 9}
      - name: c
        when: {route: [extract], batch_size: {min: 8, max: 2}}
        then: {engine: draft}
    default: {engine: base}
    exploration: {rate: 0.9, speculative_engine: draft}
    """)


def test_five_independent_problems_are_reported_together() -> None:
    errors = errors_of(FIVE_PROBLEMS)
    found = {(e.path, e.code, e.line) for e in errors}
    assert found == {
        ("descripton", "unknown_field", 3),
        ("rules[0].then.engine", "undefined_engine", 10),
        ("rules[1].then.num_speculative_tokens", "k_above_engine", 13),
        ("rules[2].when.batch_size.max", "inverted_range", 15),
        ("exploration.rate", "out_of_range", 18),
    }
    assert len(errors) == 5
    assert "invalid policy:" in str(PolicyValidationError(list(errors)))


def test_more_than_five_errors_are_summarised() -> None:
    rules = "".join(f"  - {{name: r{i}, when: {{route: [r{i}]}}, then: {{engine: nope{i}}}}}\n"
                    for i in range(7))
    text = VALID.split("rules:")[0] + "rules:\n" + rules + "default: {engine: base}\n"
    with pytest.raises(PolicyValidationError) as info:
        load_policy(text)
    assert len(info.value.errors) == 7
    assert "(and 2 more)" in str(info.value)


# --- JSON -------------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("indent", [None, 2])
def test_json_and_yaml_give_the_same_document(path: Path, indent: int | None) -> None:
    text = path.read_text()
    from_yaml = load_policy(text)
    from_json = load_policy(json.dumps(yaml.safe_load(text), indent=indent))
    assert from_json == from_yaml
    assert revision_id(from_json) == revision_id(from_yaml)


def test_json_errors_match_yaml_errors_with_json_lines() -> None:
    data = yaml.safe_load(FIVE_PROBLEMS)
    text = json.dumps(data, indent=2)
    yaml_errors = {(e.path, e.code) for e in errors_of(FIVE_PROBLEMS)}
    json_errors = errors_of(text)
    assert {(e.path, e.code) for e in json_errors} == yaml_errors
    engine_line = next(i for i, line in enumerate(text.splitlines(), 1) if '"drfat"' in line)
    assert only(json_errors, "undefined_engine").line == engine_line


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_tab_indented_json_is_json(path: Path) -> None:
    # json.dumps(indent="\t") is valid JSON, and editors produce it.
    data = yaml.safe_load(path.read_text())
    assert load_policy(json.dumps(data, indent="\t")) == load_policy(path.read_text())


def test_json_numbers_with_exponents() -> None:
    # json.dumps(0.00001) is '1e-05': a JSON number, and a rate in range.
    data = yaml.safe_load(VALID)
    data["exploration"] = {"rate": 0.00001, "speculative_engine": "draft"}
    text = json.dumps(data)
    assert "1e-05" in text
    assert load_policy(text).exploration.rate == 0.00001


def test_json_unicode_escapes_decode_like_json() -> None:
    # json.dumps escapes non-ASCII (ensure_ascii) and writes astral characters
    # as surrogate pairs; the document must read back as the same text, and
    # hash (revision id) like the YAML original.
    data = yaml.safe_load(VALID)
    data["description"] = "caf\u00e9 \U0001f680"
    text = json.dumps(data)
    assert "\\ud83d\\ude80" in text
    doc = load_policy(text)
    assert doc.description == "caf\u00e9 \U0001f680"
    assert revision_id(doc) == revision_id(validate_data(data))


# --- size and encoding ------------------------------------------------------------

def _padded(text: str, size: int) -> str:
    pad = size - len(text.encode()) - 3
    assert pad >= 0
    return text + "#" + "x" * pad + "\n\n"


def test_default_size_limit() -> None:
    assert load_policy(_padded(VALID, MAX_DOCUMENT_BYTES)).name == "lines"
    err = only(errors_of(_padded(VALID, MAX_DOCUMENT_BYTES + 1)), "document_too_large")
    assert str(MAX_DOCUMENT_BYTES) in err.message


def test_max_bytes_is_exact_and_counts_utf8_bytes() -> None:
    limit = len(VALID.encode()) + 10
    assert load_policy(_padded(VALID, limit), max_bytes=limit).name == "lines"
    errors_of(_padded(VALID, limit + 1), max_bytes=limit)
    # 10 characters, 20 bytes: over the limit although the character count is not.
    text = VALID + "#" + "\u00e9" * 8 + "\n"
    assert len(text) == limit
    only(errors_of(text, max_bytes=limit), "document_too_large")
    only(errors_of(text.encode(), max_bytes=limit), "document_too_large")


def test_non_utf8_bytes_are_rejected_with_the_offset() -> None:
    raw = VALID.replace("name: lines", "name: lines\ndescription: caf\u00e9").encode("latin-1")
    err = only(errors_of(raw), "invalid_encoding")
    position = raw.index("\u00e9".encode("latin-1"))
    assert f"byte {position}" in err.message
    only(errors_of(VALID.encode("utf-16")), "invalid_encoding")


def test_utf8_bytes_and_bom_are_accepted() -> None:
    assert load_policy(VALID.encode()).name == "lines"
    assert load_policy(b"\xef\xbb\xbf" + VALID.encode()).name == "lines"


@pytest.mark.parametrize("text", ["", "   \n", "# only a comment\n"])
def test_empty_documents(text: str) -> None:
    only(errors_of(text), "empty_document")


@pytest.mark.parametrize("text", ["[]", "42", "null", "just a string", "- a\n- b\n"])
def test_a_document_is_a_mapping(text: str) -> None:
    assert [e.code for e in errors_of(text)] == ["wrong_type"]


# --- hints --------------------------------------------------------------------------

@pytest.mark.parametrize(("old", "new", "path", "hint"), [
    ("name: lines", "nmae: lines", "nmae", "name"),
    ("default: {engine: base}", "default: {engine: base}\ndescriptoin: x", "descriptoin", "description"),
    ("    when: {route", "    wehn: {route", "rules[0].wehn", "when"),
    ("batch_size: {max: 4}", "batch-size: {max: 4}", "rules[0].when.batch-size", "batch_size"),
    ("batch_size: {max: 4}", "structured: true", "rules[0].when.structured", "structured_output"),
])
def test_unknown_field_suggests_the_closest_field(old: str, new: str, path: str, hint: str) -> None:
    err = next(e for e in errors_of(VALID.replace(old, new)) if e.code == "unknown_field")
    assert err.path == path
    assert err.message.endswith(f"did you mean '{hint}'?")


def test_no_hint_when_nothing_is_close() -> None:
    err = only(errors_of(VALID.replace("name: lines", "name: lines\nzzzzzz: 1")), "unknown_field")
    assert "did you mean" not in err.message
    err = only(errors_of(VALID.replace("draft}", "qqqqqqq}")), "undefined_engine")
    assert "did you mean" not in err.message
    assert "(defined: base, draft)" in err.message


def test_undefined_engine_hints_everywhere_an_engine_is_named() -> None:
    text = VALID.replace("default: {engine: base}",
                         "default: {engine: bsae}\nplain_engine: bas\n"
                         "exploration: {rate: 0.1, speculative_engine: dfrat}")
    errors = errors_of(text)
    hints = {e.path: e.message.rsplit("did you mean ", 1)[-1] for e in errors if e.code == "undefined_engine"}
    assert hints == {"default.engine": "'base'?", "plain_engine": "'base'?",
                     "exploration.speculative_engine": "'draft'?"}


# --- strict types -------------------------------------------------------------------

@pytest.mark.parametrize(("old", "new", "path"), [
    ("batch_size: {max: 4}", "batch_size: {max: '4'}", "rules[0].when.batch_size.max"),
    ("batch_size: {max: 4}", "batch_size: {max: 4.0}", "rules[0].when.batch_size.max"),
    ("batch_size: {max: 4}", "batch_size: {max: true}", "rules[0].when.batch_size.max"),
    ("batch_size: {max: 4}", "structured_output: 1", "rules[0].when.structured_output"),
    ("batch_size: {max: 4}", "stream: 'true'", "rules[0].when.stream"),
    ("route: [chat]", "route: chat", "rules[0].when.route"),
    ("route: [chat]", "route: [1]", "rules[0].when.route[0]"),
    ("num_speculative_tokens: 4", "num_speculative_tokens: '4'", "engines.draft.num_speculative_tokens"),
    ("engine: draftt}", "engine: draft, num_speculative_tokens: '2'}",
     "rules[0].then.num_speculative_tokens"),
    ("name: lines", "name: 5", "name"),
    ("default: {engine: base}", "default: {engine: base}\nexploration: {rate: '0.1'}", "exploration.rate"),
    ("default: {engine: base}", "default: {engine: base}\nguardrails: {min_samples: 300.0}",
     "guardrails.min_samples"),
])
def test_strict_types(old: str, new: str, path: str) -> None:
    base = LINES if "draftt" in old else VALID
    assert old in base
    text = base.replace(old, new)
    err = only(errors_of(text), "wrong_type")
    assert err.path == path


def test_an_integer_is_a_number() -> None:
    # A JSON number without a fraction is still a number where a float is expected.
    doc = load_policy(VALID + "exploration: {rate: 0}\nguardrails: {max_p95_itl_regression: 1}\n")
    assert doc.exploration.rate == 0.0
    assert doc.guardrails.max_p95_itl_regression == 1.0


# --- nothing but PolicyValidationError ----------------------------------------------

def _load_or_reject(text: str | bytes) -> PolicyDocument | None:
    try:
        return load_policy(text)
    except PolicyValidationError as exc:
        for err in exc.errors:
            assert isinstance(err, FieldError)
            assert isinstance(err.code, ErrorCode)
            assert err.message
            assert isinstance(err.path, str)
        str(exc)
        return None


garbage_settings = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@garbage_settings
@given(st.text())
def test_random_text_never_crashes(text: str) -> None:
    _load_or_reject(text)


@garbage_settings
@given(st.binary())
def test_random_bytes_never_crash(raw: bytes) -> None:
    _load_or_reject(raw)


yaml_fragments = st.sampled_from([
    "apiVersion: specgate/v1\n", "name: x\n", "engines:\n", "  base: {method: none}\n", "rules:\n",
    "  - name: r\n", "    when: {route: [a]}\n", "    then: {engine: base}\n", "default: {engine: base}\n",
    "- ", "  ", ": ", "{", "}", "[", "]", "&a ", "*a ", "!!set ", "!!binary ", "? ", "---\n", "...\n",
    "\t", "'", '"', "#", "|\n", ">\n", "<<: *a\n", "!!python/object:os.system ", "2001-12-14 ", "~ ",
    ".nan ", "-.inf ", "0x1F ", "1_000 ", "1e3 ", "true ", "\n",
])


@garbage_settings
@given(st.lists(yaml_fragments, max_size=30).map("".join))
def test_yamlish_garbage_never_crashes(text: str) -> None:
    _load_or_reject(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.text(max_size=8) | st.integers() | st.none(), children, max_size=4),
    max_leaves=20,
)


@garbage_settings
@given(json_values)
def test_random_data_never_crashes(value: Any) -> None:
    with contextlib.suppress(PolicyValidationError):
        validate_data(value)
    _load_or_reject(json.dumps(value))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


replacements = st.one_of(
    json_values,
    st.sampled_from(["base", "draft", "ngram", "none", "ngram", "chat", "", "specgate/v1", "min", "max"]),
    st.integers(-2, 20),
    st.just("DELETE"),
)

MULTI_ROUTE = yaml.safe_load(next(p for p in EXAMPLES if p.stem == "multi-route").read_text())


@garbage_settings
@given(st.data())
def test_mutated_documents_never_crash_and_text_agrees_with_data(data: st.DataObject) -> None:
    # Replace one node of a real document with something else: this reaches
    # the whole-document checks with every kind of half-valid input.
    doc = json.loads(json.dumps(MULTI_ROUTE))
    path = data.draw(st.sampled_from(_paths(doc)[1:]))
    new = data.draw(replacements)
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    if new == "DELETE":
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    try:
        validate_data(doc)
        data_errors: set[tuple[str, str]] | None = None
    except PolicyValidationError as exc:
        data_errors = {(e.path, e.code) for e in exc.errors}
    text = yaml.safe_dump(doc, allow_unicode=True)
    # PyYAML writes some characters unescaped that YAML reads back as something else (NEL, U+0085, in a key
    # is a line break, folded to a space): then the text is another document, and the two cannot agree.
    assume(yaml.safe_load(text) == doc)
    try:
        # YAML text: the JSON-specific reading problems have their own tests above.
        load_policy(text)
        text_errors: set[tuple[str, str]] | None = None
    except PolicyValidationError as exc:
        text_errors = {(e.path, e.code) for e in exc.errors}
    assert text_errors == data_errors


@pytest.mark.parametrize("text", [
    "[" * 5000,
    "[" * 3000 + "]" * 3000,
    "a: " + "{a: " * 3000 + "1" + "}" * 3000,
    "description: " + "- " * 3000 + "x",
], ids=["unclosed", "closed", "mappings", "block-sequences"])
def test_deep_nesting_is_rejected_not_a_crash(text: str) -> None:
    assert len(text.encode()) < MAX_DOCUMENT_BYTES
    with pytest.raises(PolicyValidationError):
        load_policy(text)


@pytest.mark.parametrize("text", [
    "a: &x [*x]\n",
    "apiVersion: specgate/v1\nname: x\ndescription: &d {a: *d}\n",
])
def test_recursive_aliases_are_rejected_not_a_crash(text: str) -> None:
    with pytest.raises(PolicyValidationError):
        load_policy(text)


def test_alias_expansion_does_not_blow_up() -> None:
    # "Billion laughs": a few hundred bytes of aliases that expand to 9**8
    # nodes. Rejecting it or accepting it are both fine; taking minutes is not.
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 8):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    text = "\n".join(lines) + "\n"
    assert len(text) < 1000
    script = ("import sys, policies\n"
              "try:\n    policies.load_policy(sys.stdin.read())\n"
              "except policies.PolicyValidationError:\n    pass\n")
    try:
        subprocess.run([sys.executable, "-c", script], input=text, text=True, check=True, timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail("load_policy spent more than 5 s on a 600-byte document of aliases")


@pytest.mark.parametrize("text", [
    "!!set {a, b}\n",
    "!!binary aGVsbG8=\n",
    "!!python/object/apply:os.system ['true']\n",
    "name: !!binary aGVsbG8=\n",
    "2001-12-14: x\n",
    "? [a, b]\n: c\n",
    "1.5: x\nnull: y\ntrue: z\n",
    "engines: {1: {method: none}}\n",
    "a: b\n---\nc: d\n",
])
def test_odd_yaml_is_rejected_cleanly(text: str) -> None:
    assert _load_or_reject(text) is None


@pytest.mark.parametrize("value", ["10", True, float("nan"), float("inf"), [1]])
def test_request_shape_rejects_a_bad_arrival_time_by_name(value: Any) -> None:
    with pytest.raises(RequestShapeError) as info:
        RequestShape.from_dict({"route": "chat", "arrival_time": value})
    assert [(e.path, e.code) for e in info.value.errors] == [("arrival_time", "wrong_type")]


def test_request_shape_arrival_time_round_trips_as_a_float() -> None:
    shape = RequestShape.from_dict({"arrival_time": 1_767_225_600})
    assert shape.arrival_time == 1_767_225_600.0
    assert type(shape.arrival_time) is float
    assert RequestShape.from_dict(shape.to_dict()) == shape
    assert RequestShape.from_dict({}).arrival_time is None


# --- the closed set of codes ------------------------------------------------------------------------------

def test_a_field_error_takes_only_a_code_of_the_closed_set() -> None:
    assert FieldError("name", "invalid_name", "x").code is ErrorCode.invalid_name  # a string of the set is read
    assert FieldError("", ErrorCode.invalid, "x").to_dict() == {"path": "", "code": "invalid", "message": "x"}
    assert type(FieldError("", ErrorCode.invalid, "x").to_dict()["code"]) is str  # encodes anywhere, YAML too
    with pytest.raises(ValueError, match="not_a_code"):
        FieldError("", "not_a_code", "x")  # type: ignore[arg-type]


def test_a_pydantic_error_of_an_unknown_kind_is_invalid_value_with_pydantics_message() -> None:
    exc = ValidationError.from_exception_data("PolicyDocument", [
        {"type": "multiple_of", "loc": ("guardrails", "min_samples"), "input": 3, "ctx": {"multiple_of": 2}},
        {"type": "url_scheme", "loc": ("name",), "input": "x", "ctx": {"expected_schemes": "'https'"}},
    ])
    errors = _convert_pydantic(exc, (), None, {})
    assert [(e.path, e.code) for e in errors] == [("guardrails.min_samples", "invalid_value"),
                                                  ("name", "invalid_value")]
    assert [e.message for e in errors] == [e["msg"] for e in exc.errors()]


def test_pydantics_type_and_bound_errors_have_one_code_each() -> None:
    codes = {kind: pydantic_error_code({"type": kind}) for kind in get_args(ErrorType)}
    assert {codes[k] for k in codes if k.endswith(("_type", "_parsing"))} == {ErrorCode.wrong_type}
    assert {codes[k] for k in ("greater_than", "less_than", "greater_than_equal", "less_than_equal",
                               "finite_number")} == {ErrorCode.out_of_range}
    # the models' own validators raise codes of the set, which pass through; anything else is invalid_value
    for code in ("inverted_range", "empty_range", "reserved_name", "wrong_type"):
        assert pydantic_error_code({"type": code}) == code
    assert pydantic_error_code({"type": "my_own_check"}) is ErrorCode.invalid_value


def test_only_the_name_pattern_makes_invalid_name() -> None:
    errors = errors_of(VALID.replace("name: chat", "name: -chat"))
    assert [(e.path, e.code) for e in errors] == [("rules[0].name", "invalid_name")]
    assert pydantic_error_code({"type": "string_pattern_mismatch", "ctx": {"pattern": "^x$"}}) == "invalid_format"


# --- integers longer than Python reads -------------------------------------------------------------------

_HUGE = "9" * (sys.get_int_max_str_digits() + 700)
_HUGE_YAML = textwrap.dedent("""\
    apiVersion: specgate/v1
    name: p
    engines:
      base: {method: none}
    rules:
      - name: r
        when:
          batch_size: {max: HUGE}
          stream: "yes"
        then: {engine: base}
    default: {engine: base}
    """).replace("HUGE", _HUGE)


@pytest.mark.parametrize("text", [_HUGE_YAML, json.dumps(yaml.safe_load(_HUGE_YAML.replace(_HUGE, "1")),
                                                         indent=1).replace('"max": 1', f'"max": {_HUGE}')],
                         ids=["yaml", "json"])
def test_an_integer_too_long_to_read_is_out_of_range_at_its_line_with_the_other_errors(text: str) -> None:
    # int() refuses it with a ValueError that names no place; before, that escaped load_policy.
    with pytest.raises(PolicyValidationError) as info:
        load_policy(text)
    errors = {(e.path, e.code): e for e in info.value.errors}
    assert set(errors) == {("rules[0].when.batch_size.max", "out_of_range"), ("rules[0].when.stream", "wrong_type")}
    huge = errors[("rules[0].when.batch_size.max", "out_of_range")]
    assert huge.line == text.splitlines().index(next(line for line in text.splitlines() if _HUGE in line)) + 1
    assert f"{len(_HUGE)} digits" in huge.message
    assert len(huge.message) < 100


def test_an_integer_too_long_to_read_as_a_key_is_reported_at_the_key() -> None:
    text = _HUGE_YAML.replace("stream: \"yes\"", f"labels:\n          ? {_HUGE}\n          : x")
    with pytest.raises(PolicyValidationError) as info:
        load_policy(text)
    assert {(e.path, e.code) for e in info.value.errors} == {
        ("rules[0].when.batch_size.max", "out_of_range"),
        (f'rules[0].when.labels["<an integer of {len(_HUGE)} digits>"]', "out_of_range")}


def test_a_long_integer_that_can_be_read_is_described_by_its_length() -> None:
    text = _HUGE_YAML.replace(_HUGE, "-" + "9" * 4000).replace("stream: \"yes\"", "stream: true")
    with pytest.raises(PolicyValidationError) as info:
        load_policy(text)
    [error] = info.value.errors
    assert (error.path, error.code) == ("rules[0].when.batch_size.max", "out_of_range")
    assert "4000 digits" in error.message
    assert len(error.message) < 200
