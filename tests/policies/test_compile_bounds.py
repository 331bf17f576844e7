"""What a policy costs to compile and validate stays linear in the document, and validation bounds the rest.

Rules without a route apply to every route. They used to be copied into every route's generated function, so
routes x route-less rules conditions were emitted (a 46 KB document: 35 s and 2.4 GiB). Past
``INLINE_BUDGET`` they are now compiled once and shared; what remains proportional to routes x rules (a rule
naming many routes is compiled once per route) is bounded by validation (``MAX_COMPILED_TESTS``, error
``too_complex``). These tests count what is generated, never time it.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import (
    PolicyValidationError,
    RequestShape,
    compile_policy,
    evaluate,
    interpret,
    load_policy,
    validate_data,
)
from policies.evaluate import INLINE_BUDGET, compiled_size
from policies.model import When
from policies.validate import MAX_COMPILED_TESTS, _covers, _Facts, _shadowed_rules
from tests.support.policy_strategies import whens

ENGINES = {"base": {"method": "none"}, "ng": {"method": "ngram", "num_speculative_tokens": 4}}


def _document(rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "specgate/v1", "name": "bounds", "engines": ENGINES, "rules": rules,
            "default": {"engine": "base"}}


def _interleaved(n: int, labels: int = 1) -> dict[str, Any]:
    """The shape that blew up: n rules each on a route of its own, between n rules on no route."""
    rules: list[dict[str, Any]] = []
    for i in range(n):
        rules.append({"name": f"routed-{i}", "when": {"route": [f"route-{i}"], "batch_size": {"max": i + 1}},
                      "then": {"engine": "ng"}})
        rules.append({"name": f"free-{i}", "when": {"labels": {f"k{j}": f"v{i}" for j in range(labels)}},
                      "then": {"engine": "base"}})
    return _document(rules)


def _conditions(source: str) -> int:
    return source.count("\n    if (")


def _tests(source: str) -> int:
    # every test is one parenthesised term of a condition
    return sum(line.count(") and (") + 1 for line in source.splitlines() if line.startswith("    if ("))


def _agree(raw: dict[str, Any], shapes: int = 300) -> None:
    doc = validate_data(raw)
    compiled = compile_policy(doc, "r")
    routes = [*sorted({r for rule in doc.rules for r in rule.when.route or ()}), "unnamed"]
    rng = random.Random(7)
    for _ in range(shapes):
        shape = RequestShape(route=rng.choice(routes), batch_size=rng.randint(1, 3000),
                             labels={"k0": f"v{rng.randrange(len(doc.rules))}"})
        assert compiled.decide(shape) == interpret(doc, shape, "r"), shape


# --- linear compiling --------------------------------------------------------------------------------------


def test_route_less_rules_are_compiled_once_past_the_budget() -> None:
    small, large = validate_data(_interleaved(200)), validate_data(_interleaved(400))
    a, b = compile_policy(small)._source, compile_policy(large)._source
    # Twice the document, about twice the code: copying would have made it four times (and 80,000 conditions).
    assert _conditions(a) <= 2 * 200 + 1
    assert _conditions(b) <= 2 * 400 + 1
    assert len(b) <= 2.2 * len(a)
    # and every emitted test is one the document asked for, once
    assert _tests(b) <= compiled_size(large.rules)


def test_route_less_rules_are_copied_only_within_the_budget() -> None:
    # Copies make the fastest code; they are allowed while they stay within INLINE_BUDGET (as here: 5 routes).
    doc = validate_data(_interleaved(5))
    copies = 6 * 5 * 2  # 6 functions, 5 route-less rules, 2 tests each (its line and its label)
    assert copies <= INLINE_BUDGET
    source = compile_policy(doc)._source
    assert "_free" not in source
    assert _conditions(source) == 6 * 5 + 5
    with mock.patch.object(evaluate, "INLINE_BUDGET", 0):
        shared = compile_policy(doc)._source
    assert "def _free(s)" in shared
    assert _conditions(shared) == 5 + 5


@pytest.mark.parametrize("n", [3, 40, 400])
def test_both_ways_of_compiling_decide_as_the_interpreter(n: int) -> None:
    for budget in (INLINE_BUDGET, 0):
        with mock.patch.object(evaluate, "INLINE_BUDGET", budget):
            _agree(_interleaved(n))


def _at_the_bound() -> dict[str, Any]:
    """The worst kind of document validation accepts: rules that each name many routes and test much."""
    routes = [f"route-{j}" for j in range(100)]
    per_rule = (1 + 1 + 8) * len(routes)  # its line, batch_size and 8 labels, on each of 100 routes
    count = (MAX_COMPILED_TESTS - evaluate.ROUTE_COST * len(routes)) // per_rule
    rules = [{"name": f"r{i}", "when": {"route": routes, "batch_size": {"max": i + 1},
                                         "labels": {f"k{j}": f"v{i}" for j in range(8)}},
              "then": {"engine": "ng"}} for i in range(count)]
    return _document(rules)


def test_a_document_at_the_bound_compiles_to_code_proportional_to_its_cost() -> None:
    raw = _at_the_bound()
    doc = validate_data(raw)
    size = compiled_size(doc.rules)
    assert MAX_COMPILED_TESTS - 1000 < size <= MAX_COMPILED_TESTS
    source = compile_policy(doc)._source
    assert _tests(source) <= size
    assert len(source) <= 40 * size  # about 32 bytes a test
    _agree(raw, shapes=100)


def test_one_over_the_bound_is_refused_at_rules() -> None:
    raw = _at_the_bound()
    routes = [f"extra-{j}" for j in range(MAX_COMPILED_TESTS - compiled_size(validate_data(raw).rules))]
    # the smallest step over: a rule on routes of its own, each costing its line and the route's function
    over = {**raw, "rules": [*raw["rules"], {"name": "more", "when": {"route": routes[: len(routes) // 3 + 1]},
                                              "then": {"engine": "ng"}}]}
    loaders: list[Callable[[], object]] = [lambda: validate_data(over), lambda: load_policy(json.dumps(over))]
    for load in loaders:
        with pytest.raises(PolicyValidationError) as info:
            load()
        assert {(e.path, e.code) for e in info.value.errors} == {("rules", "too_complex")}
        assert str(MAX_COMPILED_TESTS) in info.value.errors[0].message


def test_the_fleet_policy_is_far_below_the_bound() -> None:
    with open("bench/policies/fifty_rules.yaml", encoding="utf-8") as fh:
        doc = load_policy(fh.read())
    assert compiled_size(doc.rules) < MAX_COMPILED_TESTS / 50


# --- validation's own products -----------------------------------------------------------------------------


def _brute_force_shadowed(rules: list[When]) -> list[tuple[int, int]]:
    facts = [_Facts.of(w) for w in rules]
    return [(j, next(i for i in range(j) if _covers(facts[i], facts[j])))
            for j in range(len(rules)) if any(_covers(facts[i], facts[j]) for i in range(j))]


@settings(max_examples=300, deadline=None)
@given(st.lists(whens(), min_size=1, max_size=12))
def test_the_indexed_shadowing_check_finds_what_comparing_every_pair_finds(raw_whens: list[dict[str, Any]]) -> None:
    valid: list[tuple[int, Any]] = []
    for i, when in enumerate(raw_whens):
        try:
            valid.append((i, validate_data(_document([{"name": "x", "when": when, "then": {"engine": "ng"}}]))
                          .rules[0]))
        except PolicyValidationError:
            continue
    found = [(e.path, re.findall(r"rules\[(\d+)\] \('", e.message)) for e in _shadowed_rules(valid)]
    expected = _brute_force_shadowed([rule.when for _, rule in valid])
    # the same rules, each shadowed by the same (first) earlier rule
    assert found == [(f"rules[{valid[j][0]}]", [str(valid[i][0])]) for j, i in expected]


def test_a_thousand_rules_on_one_route_validate_without_comparing_every_pair() -> None:
    # Comparing every pair is what 1000 rules on one route cost before; the indexed check compares the
    # rules that could cover each other. Counted through the comparison itself.
    rules = [{"name": f"r{i}", "when": {"route": ["chat"], "labels": {"tenant": f"t{i}"}, "batch_size": {"max": 4}},
              "then": {"engine": "ng"}} for i in range(1000)]
    calls = 0
    real = _covers

    def counting(earlier: Any, later: Any) -> bool:
        nonlocal calls
        calls += 1
        return real(earlier, later)

    with mock.patch("policies.validate._covers", counting):
        validate_data(_document(rules))
    assert calls < 1000
