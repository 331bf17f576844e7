"""Shadow comparisons in the analysis (issue 19, item 2): what the rollups count of them, the Wilson interval of a
match rate, and the ``min_shadow_match`` guardrail: absent unless the policy sets its minimum (so every other
policy's looks stay what they were), pending on few comparisons, a breach below the minimum with confidence."""

from __future__ import annotations

import random
from typing import Any

import pytest

from analysis.cells import Cohort
from analysis.guardrails import GUARDRAILS, MIN_SHADOW_COMPARISONS, Check, evaluate_step, evaluated
from analysis.rollup import COUNTERS, SHADOW_COUNTERS, aggregate
from analysis.stats import wilson_interval
from policies.model import Guardrails
from tests.support.cohorts import requests
from wire.telemetry import TelemetryEvent


def _event(n: int, **changes: Any) -> TelemetryEvent:
    data: dict[str, Any] = {
        "event_id": f"e-{n}", "request_id": f"r-{n}", "time": "2026-12-07T21:00:10Z", "worker_id": "w-1",
        "pool": "a", "route": "extract", "model": "m", "policy": "p", "revision": "rev-1", "rule": "r",
        "engine": "draft", "decided_engine": "draft", "speculate": True, "num_speculative_tokens": 3,
        "explored": False, "canary": False, "kill_switch": False, "batch_size": 1, "stream": False,
        "structured_output": True, "tools": False, "e2e_ms": 100.0, "status": "ok", "retries": 0,
        "fallback": False}
    data.update(changes)
    return TelemetryEvent.model_validate(data)


# --- rollups --------------------------------------------------------------------------------------

def test_rollups_count_each_shadow_field_on_its_own() -> None:
    events = [
        _event(0),  # not compared
        _event(1, shadow_match=True, structured_valid=True, shadow_structured_valid=True, shadow_check_passed=True),
        _event(2, shadow_match=False, shadow_first_diff=12, structured_valid=True, shadow_structured_valid=False,
               shadow_check_passed=False, shadow_check_reason="another city"),
        _event(3, shadow_match=False, shadow_first_diff=0, structured_valid=False, shadow_structured_valid=True),
        # the engine could not count tokens; the plain answer was checked but the served one was not
        _event(4, shadow_match=False, structured_valid=None, shadow_structured_valid=True),
        # the quality check failed to run: null, not a failure
        _event(5, shadow_match=True, shadow_check_passed=None, shadow_check_reason="check timed out"),
    ]
    (delta,) = aggregate(events).values()
    t = delta.totals
    assert {name: getattr(t, name) for name in SHADOW_COUNTERS} == {
        "shadow_compared": 5, "shadow_matched": 2, "shadow_first_diff_sum": 12, "shadow_first_diff_count": 2,
        "shadow_structured_checked": 3, "shadow_structured_valid_served": 2, "shadow_structured_valid_plain": 2,
        "shadow_check_run": 2, "shadow_check_failed": 1}
    # the served answers' own validity is counted as before, compared or not
    assert (t.structured_checked, t.structured_valid) == (3, 2)
    assert set(SHADOW_COUNTERS) < set(COUNTERS)


def test_a_cohort_carries_the_shadow_counters_through_rollups_files_and_merges() -> None:
    counters = {name: 0 for name in COUNTERS} | {"requests": 40, "draft_tokens_sum": 0, "accepted_tokens_sum": 0,
                                                 "shadow_compared": 20, "shadow_matched": 14,
                                                 "shadow_first_diff_sum": 60, "shadow_first_diff_count": 5}
    c = Cohort.from_rollup(counters, {})
    assert (c.shadow_compared, c.shadow_matched, c.shadow_match_rate, c.shadow_first_diff_mean) == (20, 14, 0.7, 12)
    again = Cohort.from_dict(c.to_dict())
    assert all(getattr(again, name) == getattr(c, name) for name in SHADOW_COUNTERS)
    merged = Cohort().add(c).add(c)
    assert (merged.shadow_compared, merged.shadow_matched, merged.shadow_first_diff_mean) == (40, 28, 12)
    # rollups and files recorded before shadow comparisons have none
    old = Cohort.from_rollup({name: counters[name] for name in COUNTERS if name not in SHADOW_COUNTERS}, {})
    assert (old.shadow_compared, old.shadow_match_rate, old.shadow_first_diff_mean) == (0, None, None)
    assert Cohort.from_dict({"requests": 3}).shadow_compared == 0


# --- the Wilson interval --------------------------------------------------------------------------

@pytest.mark.parametrize(("successes", "n", "low", "high"), [
    (14, 20, 0.4810, 0.8545),  # textbook values (Newcombe 1998's method 3)
    (20, 20, 0.8389, 1.0),  # all matched: still not certainty
    (0, 5, 0.0, 0.4345),
    (81, 263, 0.2553, 0.3662),
])
def test_the_wilson_interval_has_its_textbook_values(successes: int, n: int, low: float, high: float) -> None:
    got = wilson_interval(successes, n)
    assert got is not None
    assert got == pytest.approx((low, high), abs=5e-4)


def test_the_wilson_interval_covers_the_true_share_about_95_times_in_100() -> None:
    rng = random.Random(19)
    covered = 0
    for _ in range(1000):
        matched = sum(rng.random() < 0.97 for _ in range(60))
        interval = wilson_interval(matched, 60)
        assert interval is not None
        covered += interval[0] <= 0.97 <= interval[1]
    assert 930 <= covered <= 985
    assert wilson_interval(0, 0) is None


# --- the guardrail --------------------------------------------------------------------------------

def _cohorts(rng: random.Random, n: int, *, compared: int = 0, matched: int = 0) -> tuple[Cohort, Cohort]:
    base = requests(rng, n, itl=20.0, e2e=2000.0)
    canary = requests(rng, n, itl=20.0, e2e=2000.0)
    canary.shadow_compared, canary.shadow_matched = compared, matched
    return base, canary


def _check(checks: list[Check], name: str = "min_shadow_match") -> Check:
    (found,) = [c for c in checks if c.guardrail == name]
    return found


def test_without_a_minimum_there_is_no_check_and_the_other_four_keep_alpha_over_4() -> None:
    rng = random.Random(1)
    base, canary = _cohorts(rng, 400, compared=40, matched=10)
    without = evaluate_step(base, canary, Guardrails(), alpha=0.05)
    assert [c.guardrail for c in without.checks] == ["p95_e2e_regression", "p95_itl_regression",
                                                     "retry_rate_increase", "min_acceptance"]
    assert evaluated(Guardrails()) == GUARDRAILS[:4]
    # With the minimum set there are five, at alpha / 5 each: the four others are then exactly what they are
    # without it at a level 5/4 as large.
    with_it = evaluate_step(base, canary, Guardrails(min_shadow_match_rate=0.95), alpha=0.05 * 5 / 4)
    assert [c.guardrail for c in with_it.checks] == [*(c.guardrail for c in without.checks), "min_shadow_match"]
    assert with_it.checks[:4] == without.checks
    # ... and not what they would be at alpha / 4 of the same level
    same_level = evaluate_step(base, canary, Guardrails(min_shadow_match_rate=0.95), alpha=0.05)
    assert same_level.checks[0].interval != without.checks[0].interval
    # a step that waits for requests lists every evaluated check as pending
    early = evaluate_step(*_cohorts(rng, 50), Guardrails(min_shadow_match_rate=0.95), alpha=0.05)
    assert [(c.guardrail, c.status) for c in early.checks][-1] == ("min_shadow_match", "pending")
    assert len(evaluate_step(*_cohorts(rng, 50), Guardrails(), alpha=0.05).checks) == 4


def test_few_comparisons_wait_and_say_how_many() -> None:
    rng = random.Random(2)
    guardrails = Guardrails(min_shadow_match_rate=0.95)
    none = _check(evaluate_step(*_cohorts(rng, 400), guardrails, alpha=0.05).checks)
    assert (none.status, none.observed) == ("pending", None)
    assert none.detail == "no shadow comparisons on the canary yet (minimum 95%; decided from 30 comparisons)"
    # 14 of 20 is far below 95 %, but 20 comparisons decide nothing yet
    few = _check(evaluate_step(*_cohorts(rng, 400, compared=20, matched=14), guardrails, alpha=0.05).checks)
    assert (few.status, few.observed, few.limit) == ("pending", 0.7, 0.95)
    assert few.detail == ("14 of 20 shadow comparisons matched on the canary (70.0%; minimum 95%); waiting for 30 "
                          "comparisons")
    assert MIN_SHADOW_COMPARISONS == 30
    # a policy with fewer min_samples waits for as many comparisons, no more
    small = Guardrails(min_shadow_match_rate=0.5, min_samples=10)
    decided = _check(evaluate_step(*_cohorts(rng, 400, compared=12, matched=12), small, alpha=0.05).checks)
    # tested (an interval, no "waiting for"), though 12 comparisons are not yet evidence enough either way
    assert decided.interval is not None
    assert decided.detail == "12 of 12 shadow comparisons matched on the canary (100.0%; minimum 50%)"


def test_a_low_match_rate_is_a_breach_and_a_matching_canary_passes() -> None:
    rng = random.Random(3)
    guardrails = Guardrails(min_shadow_match_rate=0.95, min_samples=100)
    low = evaluate_step(*_cohorts(rng, 400, compared=60, matched=36), guardrails, alpha=0.05)
    check = _check(low.checks)
    assert (low.verdict, check.status, check.observed) == ("breach", "breach", 0.6)
    assert [c.guardrail for c in low.breaches] == ["min_shadow_match"]
    assert check.p_value is not None
    assert check.p_value < 0.01
    assert check.interval is not None
    assert check.interval[0] < 0.6 < check.interval[1] < 0.95
    assert check.detail == "36 of 60 shadow comparisons matched on the canary (60.0%; minimum 95%)"
    good = _check(evaluate_step(*_cohorts(rng, 400, compared=260, matched=260), guardrails, alpha=0.05).checks)
    assert good.status == "pass"
    assert good.interval is not None
    assert good.interval[0] > 0.95
    assert good.interval[1] == 1.0
    # just above the minimum on few comparisons: neither
    near = _check(evaluate_step(*_cohorts(rng, 400, compared=100, matched=97), guardrails, alpha=0.05).checks)
    assert near.status == "pending"
    # limits keep their digits in the detail
    strict = Guardrails(min_shadow_match_rate=0.995, min_samples=100)
    assert "minimum 99.5%" in _check(evaluate_step(*_cohorts(rng, 400, compared=40, matched=40), strict,
                                                   alpha=0.05).checks).detail


def _looks(seed: int, true_rate: float, looks: int = 10, per_look: int = 30) -> str:
    """The shadow check of a canary whose answers match with ``true_rate``, looked at after every ``per_look``
    more comparisons; the first status that is not pending."""
    rng = random.Random(seed)
    base, canary = _cohorts(rng, 300)
    guardrails = Guardrails(min_shadow_match_rate=0.95, min_samples=200)
    for _ in range(looks):
        canary.shadow_compared += per_look
        canary.shadow_matched += sum(rng.random() < true_rate for _ in range(per_look))
        status = _check(evaluate_step(base, canary, guardrails, alpha=0.05).checks).status
        if status != "pending":
            return status
    return "pending"


def test_at_the_minimum_repeated_looks_rarely_roll_back_and_a_real_shortfall_is_caught() -> None:
    at_limit = [_looks(seed, 0.95) for seed in range(200)]
    assert at_limit.count("breach") <= 4, at_limit.count("breach")  # alpha / 5 = 1 %, the floor keeps it near
    # passing takes more comparisons than breaching: the variance is the limit's, calibrated where it decides
    above = [_looks(seed, 0.995, looks=20) for seed in range(100)]
    assert above.count("breach") == 0
    assert above.count("pass") >= 80
    below = [_looks(seed, 0.8) for seed in range(50)]
    assert below.count("breach") >= 48
