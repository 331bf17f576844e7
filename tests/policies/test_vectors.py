"""Runs the shared test vectors in ``tests/vectors`` against the Python library.

``valid.yaml`` pins decisions: both the compiled fast path and the reference
interpreter must return exactly the expected decision for every case.
``invalid.yaml`` pins validation: loading each document must fail with exactly
the expected set of (path, code) errors, all reported at once.
The format is described in ``tests/vectors/README.md``.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
import yaml

import policies
from policies import ErrorCode, PolicyValidationError, RequestShape
from policies.model import When, engine_k
from policies.render import batch_size_schedule
from policies.schedule import engine_schedule
from tests.support import paths

VECTORS = paths.VECTORS
REVISION = "vectors-rev-0001"
DECISION_KEYS = {"engine", "speculate", "num_speculative_tokens", "rule", "explored"}
DOCUMENT_KINDS = ("document", "text", "base64", "oversize")

# Every error code the library reports; each must be pinned by an invalid vector.
KNOWN_CODES = frozenset(
    {
        # structure (per field)
        "unknown_field",
        "missing_field",
        "wrong_type",
        "out_of_range",
        "empty",
        "too_long",
        "invalid_name",
        "invalid_value",
        "empty_range",
        "inverted_range",
        "reserved_name",
        "unsupported_api_version",
        # whole document
        "undefined_engine",
        "no_plain_engine",
        "ambiguous_plain_engine",
        "not_plain_engine",
        "not_speculative_engine",
        "plain_engine_k",
        "k_above_engine",
        "duplicate_rule_name",
        "shadowed_rule",
        "too_complex",
        "schedule_conflict",
        # text
        "yaml_syntax",
        "duplicate_key",
        "document_too_large",
        "empty_document",
        "invalid_encoding",
    }
)


# The document an ``oversize: N`` vector stands for: this valid policy padded
# with one comment line to exactly N bytes.
OVERSIZE_BASE = (
    "apiVersion: specgate/v1\nname: oversize\nengines:\n  base: {method: none}\ndefault: {engine: base}\n"
)


def _load(name: str) -> Any:
    with (VECTORS / name).open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


VALID_GROUPS: list[dict[str, Any]] = _load("valid.yaml")["groups"]
INVALID_VECTORS: list[dict[str, Any]] = _load("invalid.yaml")["vectors"]


def padded_document(size: int) -> str:
    """OVERSIZE_BASE followed by a comment line, exactly ``size`` bytes long."""
    fill = size - len(OVERSIZE_BASE.encode("utf-8")) - 2  # "#" and the final newline
    assert fill >= 0, f"oversize {size} is smaller than the base document"
    text = OVERSIZE_BASE + "#" + "x" * fill + "\n"
    assert len(text.encode("utf-8")) == size
    return text


def document_text(vector: dict[str, Any]) -> str | bytes:
    kinds = [k for k in DOCUMENT_KINDS if k in vector]
    assert len(kinds) == 1, f"vector {vector['name']!r} needs exactly one of {DOCUMENT_KINDS}, has {kinds}"
    kind = kinds[0]
    if kind == "document":
        return yaml.safe_dump(vector["document"], sort_keys=False, allow_unicode=True)
    if kind == "text":
        text = vector["text"]
        assert isinstance(text, str)
        return text
    if kind == "base64":
        return base64.b64decode(vector["base64"], validate=True)
    size = vector["oversize"]
    assert type(size) is int
    return padded_document(size)


def _valid_params() -> list[Any]:
    return [
        pytest.param(group, case, id=f"{group['name']}/{case['name']}")
        for group in VALID_GROUPS
        for case in group["cases"]
    ]


def _invalid_params() -> list[Any]:
    params = []
    for vector in INVALID_VECTORS:
        params.append(pytest.param(vector, id=vector["name"]))
    return params


# --- decisions -----------------------------------------------------------------------


@pytest.mark.parametrize(("group", "case"), _valid_params())
def test_valid_vector(group: dict[str, Any], case: dict[str, Any]) -> None:
    assert set(case["expect"]) == DECISION_KEYS, "expect must give the full decision"
    document = policies.load_policy(yaml.safe_dump(group["policy"], sort_keys=False))
    shape = RequestShape.from_dict(case["shape"])
    expected = {**case["expect"], "policy": group["policy"]["name"], "revision": REVISION}

    compiled = policies.compile_policy(document, REVISION).decide(shape)
    interpreted = policies.interpret(document, shape, REVISION)

    assert compiled.to_dict() == expected, "compiled decision"
    assert interpreted.to_dict() == expected, "interpreted decision"
    for decision in (compiled, interpreted):
        assert type(decision.speculate) is bool
        assert type(decision.explored) is bool
        assert type(decision.num_speculative_tokens) is int
    if "shadow" in case:
        shadowed = policies.compile_policy(document, REVISION).shadowed(shape, compiled)
        assert shadowed is case["shadow"], "sampled for a shadow comparison"
    else:
        assert document.quality is None, "a group with quality pins shadow in every case"
    if "raw_sampled" in case:
        sampled = policies.compile_policy(document, REVISION).raw_sampled(case["shape"]["request_id"])
        assert sampled is case["raw_sampled"], "its raw event is sent (telemetry.raw_sample_rate)"
    else:
        assert document.telemetry is None, "a group with telemetry pins raw_sampled in every case"


def _schedule_params() -> list[Any]:
    return [pytest.param(group, engine, expected, id=f"{group['name']}/{engine}")
            for group in VALID_GROUPS for engine, expected in group.get("schedules", {}).items()]


@pytest.mark.parametrize(("group", "engine", "expected"), _schedule_params())
def test_in_engine_schedule_vector(group: dict[str, Any], engine: str, expected: list[list[Any]]) -> None:
    document = policies.load_policy(yaml.safe_dump(group["policy"], sort_keys=False))
    assert engine in document.in_engine_schedules
    spec = document.engines[engine]
    segments = engine_schedule(engine, engine_k(spec), enumerate(document.rules), document.default,
                               document.exploration)
    assert [list(s) for s in segments] == expected
    # what vLLM is given: the same bands, cut at the engine's largest batch
    rendered = batch_size_schedule(document, engine, 64)
    assert rendered == [(lo, 64 if hi is None else hi, k) for lo, hi, k in expected]
    # and every band holds what the router decides there, for a request of every route the rules send to it
    compiled = policies.compile_policy(document, REVISION)
    mine = [rule for rule in document.rules if rule.then.engine == engine]
    routes = {route for rule in mine for route in rule.when.route or ()}
    if any(rule.when.route is None for rule in mine):
        routes.add("a-route-no-rule-names")
    assert routes
    for lo, hi, k in expected:
        for batch in {lo, hi if hi is not None else lo + 100}:
            for route in routes:
                decision = compiled.decide(RequestShape(route=route, batch_size=batch))
                assert (decision.engine, decision.num_speculative_tokens, decision.speculate) == (engine, k, k > 0)


def test_in_engine_schedules_are_pinned() -> None:
    assert _schedule_params(), "no valid vector pins an in-engine schedule"


# --- validation ------------------------------------------------------------------------


@pytest.mark.parametrize("vector", _invalid_params())
def test_invalid_vector(vector: dict[str, Any]) -> None:
    text = document_text(vector)
    with pytest.raises(PolicyValidationError) as info:
        policies.load_policy(text)
    errors = info.value.errors
    assert all(isinstance(e.code, ErrorCode) for e in errors)
    got = {(e.path, e.code) for e in errors}
    want = {(e["path"], e["code"]) for e in vector["errors"]}
    assert got == want, "\n".join(str(e) for e in errors)

    for expected in vector["errors"]:
        same = [e for e in errors if (e.path, e.code) == (expected["path"], expected["code"])]
        if "line" in expected:
            assert any(e.line == expected["line"] for e in same), (
                f"{expected}: lines reported {[e.line for e in same]}"
            )
        if "message_contains" in expected:
            assert any(expected["message_contains"] in e.message for e in same), (
                f"{expected}: messages {[e.message for e in same]}"
            )


def test_document_at_the_size_limit_is_accepted() -> None:
    # The other side of the oversize vector's boundary.
    document = policies.load_policy(padded_document(policies.MAX_DOCUMENT_BYTES))
    assert document.name == "oversize"


# --- the vectors themselves ----------------------------------------------------------------


def test_vector_counts() -> None:
    valid = sum(len(group["cases"]) for group in VALID_GROUPS)
    assert valid >= 40, f"only {valid} valid cases"
    assert len(INVALID_VECTORS) >= 20, f"only {len(INVALID_VECTORS)} invalid vectors"
    assert any(len(v["errors"]) >= 4 for v in INVALID_VECTORS), "no vector proves errors come together"


def test_vector_names_are_unique() -> None:
    groups = [g["name"] for g in VALID_GROUPS]
    assert len(groups) == len(set(groups))
    for group in VALID_GROUPS:
        cases = [c["name"] for c in group["cases"]]
        assert len(cases) == len(set(cases)), group["name"]
    invalid = [v["name"] for v in INVALID_VECTORS]
    assert len(invalid) == len(set(invalid))


def test_every_predicate_is_exercised() -> None:
    used: set[str] = set()
    for group in VALID_GROUPS:
        for rule in group["policy"].get("rules", []):
            used.update(rule.get("when", {}))
    missing = set(When.model_fields) - used
    assert not missing, f"no valid vector has a rule testing {sorted(missing)}"


def test_every_error_code_is_exercised() -> None:
    used = {e["code"] for v in INVALID_VECTORS for e in v["errors"]}
    missing = KNOWN_CODES - used
    assert not missing, f"no invalid vector expects {sorted(missing)}"
    unknown = used - KNOWN_CODES
    assert not unknown, f"vectors expect codes not listed in KNOWN_CODES: {sorted(unknown)}"


def test_every_code_of_the_vectors_is_an_error_code() -> None:
    # The vectors are the contract other implementations run: their codes are the library's closed set.
    used = {e["code"] for v in INVALID_VECTORS for e in v["errors"]}
    assert used <= {code.value for code in ErrorCode}, sorted(used - set(ErrorCode))
    assert not KNOWN_CODES - {code.value for code in ErrorCode}


def test_exploration_is_exercised_both_ways() -> None:
    outcomes = {
        (case["expect"]["explored"], case["expect"]["speculate"], "request_id" in case["shape"])
        for group in VALID_GROUPS
        if group["policy"].get("exploration", {}).get("rate", 0) > 0
        for case in group["cases"]
    }
    # explored to plain, explored to speculative, not explored despite an id, no id at all
    assert (True, False, True) in outcomes
    assert (True, True, True) in outcomes
    assert any(not explored and has_id for explored, _, has_id in outcomes)
    assert any(not has_id for _, _, has_id in outcomes)
