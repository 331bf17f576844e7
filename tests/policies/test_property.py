"""The compiled evaluator agrees with the reference interpreter.

``interpret`` reads like the specification; ``compile_policy`` partitions the
rules by route and generates code. On any valid document and any request
shape they must return the same Decision, field for field (engine, draft
length, rule, exploration), with and without a cohort secret, and with the
route-less rules copied into every route's function or compiled once and
shared (the two ways ``policies.evaluate`` generates code).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import random
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from policies import (
    CompiledPolicy,
    PolicyDocument,
    RequestShape,
    compile_policy,
    evaluate,
    interpret,
    sticky_fraction,
    validate_data,
)
from tests.support.policy_strategies import (
    present_request_ids,
    raw_documents,
    shapes,
    validate_generated,
    witness_shapes,
)

REVISION = "3f" * 32

property_settings = settings(max_examples=300, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


# "" (the public salt the vectors pin) or a secret; the same secret must give both readings the same split.
cohort_secrets = st.sampled_from(["", "cohort-secret-1"]) | st.text(min_size=1, max_size=12)
# Copy the route-less rules into every route's function (the default for documents this size), or never.
inline_budgets = st.sampled_from([evaluate.INLINE_BUDGET, 0])


def _assert_agree(doc: PolicyDocument, shape_list: list[RequestShape], secret: str = "",
                  budget: int = evaluate.INLINE_BUDGET) -> None:
    with mock.patch.object(evaluate, "INLINE_BUDGET", budget):
        compiled = compile_policy(doc, REVISION, cohort_secret=secret)
    for shape in shape_list:
        expected = interpret(doc, shape, REVISION, cohort_secret=secret)
        got = compiled.decide(shape)
        assert got == expected, (
            f"compiled and interpreted decisions differ for {shape}\n"
            f"compiled:    {got}\ninterpreted: {expected}\ngenerated source:\n{compiled._source}"
        )
        event(f"rule={'default' if expected.rule == 'default' else 'a rule'}")
        event(f"explored={expected.explored}")


@property_settings
@given(raw=raw_documents(), shape_list=st.lists(shapes, min_size=1, max_size=25), secret=cohort_secrets,
       budget=inline_budgets)
def test_compiled_agrees_with_interpreter(raw: dict[str, Any], shape_list: list[RequestShape], secret: str,
                                         budget: int) -> None:
    doc = validate_generated(raw)
    _assert_agree(doc, shape_list + witness_shapes(doc), secret, budget)


@property_settings
@given(
    raw=raw_documents(route_modes=st.booleans(), min_rules=2, max_rules=8),
    shape_list=st.lists(shapes, min_size=1, max_size=25),
    secret=cohort_secrets,
    budget=inline_budgets,
)
def test_compiled_agrees_with_routed_and_unrouted_rules_mixed(
    raw: dict[str, Any], shape_list: list[RequestShape], secret: str, budget: int
) -> None:
    # Rules with a route go into that route's function; rules without one go
    # into every route's function *and* the fallback function, in document
    # order, or (budget 0) into one shared function each route asks. A mix of
    # both is where the partitioning could reorder rules.
    doc = validate_generated(raw)
    routed = sum(r.when.route is not None for r in doc.rules)
    event(f"routed={routed > 0} unrouted={routed < len(doc.rules)}")
    event(f"budget={budget}")
    _assert_agree(doc, shape_list + witness_shapes(doc), secret, budget)


@pytest.mark.parametrize("budget", [evaluate.INLINE_BUDGET, 0])
def test_unrouted_rule_between_routed_rules_keeps_its_place(budget: int) -> None:
    # A hand-written case of the partitioning hazard: the unrouted rule must
    # still win over the later routed rule for a chat request, and lose to
    # the earlier one.
    doc = validate_data({
        "apiVersion": "specgate/v1",
        "name": "order",
        "engines": {"base": {"method": "none"}, "ng": {"method": "ngram", "num_speculative_tokens": 4}},
        "rules": [
            {"name": "chat-small", "when": {"route": ["chat"], "batch_size": {"max": 2}},
             "then": {"engine": "ng", "num_speculative_tokens": 2}},
            {"name": "any-stream", "when": {"stream": True}, "then": {"engine": "base"}},
            {"name": "chat-all", "when": {"route": ["chat", "code"]}, "then": {"engine": "ng"}},
        ],
        "default": {"engine": "base"},
    })
    with mock.patch.object(evaluate, "INLINE_BUDGET", budget):
        compiled = compile_policy(doc, REVISION)
    cases = [
        (RequestShape(route="chat", batch_size=1, stream=True), "chat-small"),
        (RequestShape(route="chat", batch_size=3, stream=True), "any-stream"),
        (RequestShape(route="chat", batch_size=3, stream=False), "chat-all"),
        (RequestShape(route="other", batch_size=1, stream=True), "any-stream"),
        (RequestShape(route="other", batch_size=1, stream=False), "default"),
        (RequestShape(route="code", batch_size=1, stream=False), "chat-all"),
    ]
    for shape, rule in cases:
        assert compiled.decide(shape).rule == rule, shape
        assert interpret(doc, shape, REVISION).rule == rule, shape


# --- exploration is sticky ----------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(
    raw=raw_documents(exploration=True, min_rules=1).filter(
        lambda d: "speculative_engine" in d.get("exploration", {}) and "window_s" not in d["exploration"]),
    first=shapes,
    second=shapes,
    request_id=present_request_ids,
    secret=cohort_secrets,
)
def test_exploration_depends_only_on_request_id(raw: dict[str, Any], first: RequestShape,
                                                second: RequestShape, request_id: str, secret: str) -> None:
    doc = validate_generated(raw)
    compiled = compile_policy(doc, REVISION, cohort_secret=secret)
    first = dataclasses.replace(first, request_id=request_id)
    second = dataclasses.replace(second, request_id=request_id)
    a = compiled.decide(first)
    # The same request, decided again (a retry, a replay), is decided the same way.
    assert compiled.decide(first) == a
    assert compile_policy(doc, REVISION, cohort_secret=secret).decide(first) == a
    assert interpret(doc, first, REVISION, cohort_secret=secret) == a
    # A different request with the same id explores the same way: with
    # exploration on, every decision has an alternative, so `explored` is a
    # function of the request id alone.
    assert compiled.decide(second).explored == a.explored


@settings(max_examples=100, deadline=None)
@given(
    raw=raw_documents(exploration=True, min_rules=1).filter(lambda d: "window_s" in d.get("exploration", {})),
    first=shapes,
    second=shapes,
    offset=st.floats(0.0, 1.0, exclude_max=True),
)
def test_window_exploration_depends_only_on_the_window(raw: dict[str, Any], first: RequestShape,
                                                       second: RequestShape, offset: float) -> None:
    doc = validate_generated(raw)
    compiled = compile_policy(doc, REVISION)
    window_s = doc.exploration.window_s
    assert window_s is not None
    start = math.floor((first.arrival_time or 1_750_000_000.0) / window_s) * window_s
    first = dataclasses.replace(first, arrival_time=start)
    # another request (other id, other shape) later in the same window
    later = start + offset * window_s
    if math.floor(later / window_s) != math.floor(start / window_s):  # float rounding at the window's end
        later = start
    second = dataclasses.replace(second, arrival_time=later)
    a = compiled.decide(first)
    assert interpret(doc, first, REVISION) == a
    assert interpret(doc, second, REVISION) == compiled.decide(second)
    assert compiled.decide(second).explored == a.explored


@settings(max_examples=50, deadline=None)
@given(raw=raw_documents(exploration=True), shape=shapes)
def test_no_request_id_is_never_explored(raw: dict[str, Any], shape: RequestShape) -> None:
    doc = validate_generated(raw)
    # the key of a request-level split is the request id, of a window split the arrival time
    shape = dataclasses.replace(shape, request_id=None) if doc.exploration.window_s is None else \
        dataclasses.replace(shape, arrival_time=None)
    assert not compile_policy(doc, REVISION).decide(shape).explored
    assert not interpret(doc, shape, REVISION).explored


@pytest.mark.parametrize("window_s", [1.0, 7.5, 300.0])
def test_window_exploration_explores_the_rate_of_windows(window_s: float) -> None:
    doc = validate_data({**_exploring_doc(0.2).model_dump(by_alias=True, exclude_none=True),
                         "exploration": {"rate": 0.2, "speculative_engine": "draft", "window_s": window_s}})
    compiled = compile_policy(doc, REVISION)
    start = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    n = 5_000
    explored = 0
    for i in range(n):
        at = start + i * window_s
        decisions = {compiled.decide(RequestShape(route="chat", arrival_time=at + f * window_s,
                                                  request_id=f"r{i}-{f}")).explored for f in (0.0, 0.5, 0.99)}
        assert len(decisions) == 1  # the whole window goes one way
        explored += decisions.pop()
    sigma = math.sqrt(n * 0.2 * 0.8)
    assert abs(explored - n * 0.2) <= 5 * sigma, (explored, sigma)


def _exploring_doc(rate: float) -> PolicyDocument:
    return validate_data({
        "apiVersion": "specgate/v1",
        "name": "explore",
        "engines": {"base": {"method": "none"},
                    "draft": {"method": "draft_model", "model": "d", "num_speculative_tokens": 3}},
        "rules": [{"name": "chat", "when": {"route": ["chat"]}, "then": {"engine": "draft"}}],
        "default": {"engine": "base"},
        "exploration": {"rate": rate, "speculative_engine": "draft"},
    })


@pytest.mark.parametrize("rate", [0.01, 0.05, 0.2, 0.5])
@pytest.mark.parametrize("route", ["chat", "other"])
def test_explored_share_matches_rate(rate: float, route: str) -> None:
    doc = _exploring_doc(rate)
    compiled = compile_policy(doc, REVISION)
    rng = random.Random(f"{rate}-{route}")
    n = 20_000
    explored = 0
    for _ in range(n):
        shape = RequestShape(route=route, request_id=f"{rng.getrandbits(64):016x}")
        decision = compiled.decide(shape)
        if decision.explored:
            explored += 1
            # The explored decision is the *other* one, tagged with the rule it replaced.
            if route == "chat":
                assert (decision.engine, decision.speculate, decision.rule) == ("base", False, "chat")
            else:
                assert (decision.engine, decision.speculate, decision.num_speculative_tokens,
                        decision.rule) == ("draft", True, 3, "default")
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(explored - n * rate) <= 5 * sigma, (explored, n * rate, sigma)


def _explored_ids(secret: str, ids: list[str], via: str = "compiled") -> frozenset[str]:
    doc = _exploring_doc(0.2)
    if via == "compiled":
        decide = compile_policy(doc, REVISION, cohort_secret=secret).decide
    else:
        def decide(shape: RequestShape) -> Any:
            return interpret(doc, shape, REVISION, cohort_secret=secret)
    return frozenset(i for i in ids if decide(RequestShape(route="chat", request_id=i)).explored)


def test_a_cohort_secret_changes_which_ids_are_explored_and_keeps_it_stable() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    public = _explored_ids("", ids)
    salted = _explored_ids("s3cret", ids)
    # Anyone can compute the public split from the policy name; the salted one is another, independent split
    # (two independent 20 % splits share about 4 % of the ids, not 20 %).
    assert public == frozenset(i for i in ids if sticky_fraction(i, "explore:explore") < 0.2)
    assert salted != public
    assert len(salted & public) < 0.5 * len(public)
    assert abs(len(salted) - 0.2 * len(ids)) <= 5 * math.sqrt(len(ids) * 0.2 * 0.8)
    # The same secret gives the same split in another process (a sidecar restart, another replica) ...
    assert _explored_ids("s3cret", ids) == salted
    assert _explored_ids("s3cret", ids, via="interpreted") == salted
    # ... another secret another one.
    assert _explored_ids("other", ids) != salted


def test_the_salt_with_a_secret_is_the_hmac_of_the_public_salt() -> None:
    assert evaluate.exploration_salt("fleet") == "explore:fleet"
    assert evaluate.exploration_salt("fleet", "") == "explore:fleet"
    expected = hmac.new(b"k", b"explore:fleet", hashlib.sha256).hexdigest()
    assert evaluate.exploration_salt("fleet", "k") == expected
    compiled = compile_policy(_exploring_doc(0.2), REVISION, cohort_secret="k")
    # Only the salt derived from it is kept, so nothing the compiled policy holds gives the secret away.
    assert all(getattr(compiled, name) != "k" for name in CompiledPolicy.__slots__)


def test_explored_share_is_zero_at_rate_zero() -> None:
    doc = _exploring_doc(0.0)
    compiled = compile_policy(doc, REVISION)
    assert not any(compiled.decide(RequestShape(route="chat", request_id=str(i))).explored
                   for i in range(2000))
