"""Decisions judged by what clients feel (issue 21): whole-worker switchback comparisons, what the recommender
makes of them, and draft lengths chosen on measured end-to-end latency."""

from __future__ import annotations

import datetime as dt
import math
import random
from typing import Any

from analysis import edits
from analysis.cells import Cell, Cohort
from analysis.recommend import RecommendConfig, recommend
from analysis.switchback import (
    EXPLORED_BETTER,
    INSUFFICIENT,
    MIXED,
    NO_DIFFERENCE,
    POLICY_BETTER,
    Period,
    SwitchbackConfig,
    compare,
    window_exposure,
)
from policies import canonical_document, load_policy, revision_id, sticky_fraction, validate_data
from tests.support.cohorts import requests

T0 = dt.datetime(2026, 12, 7, 9, 0, tzinfo=dt.UTC)

# chat speculates up to batch 4 on the draft engine; exploration in one-minute windows.
POLICY = """\
apiVersion: specgate/v1
name: pool
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
rules:
  - name: chat-small
    when: {route: [chat], batch_size: {max: 4}}
    then: {engine: draft}
default: {engine: base}
exploration: {rate: 0.3, speculative_engine: draft, window_s: 60}
"""


def minutes(rng: random.Random, count: int, *, policy_e2e: float, explored_e2e: float, policy_rate: float,
            explored_rate: float, every: int = 3, policy_spec: float = 1.0, explored_spec: float = 0.0) -> list[Period]:
    """One period per minute: every ``every``-th minute explored; requests per minute from the rates."""
    out = []
    for i in range(count):
        explored = i % every == 1
        e2e, rate, spec = ((explored_e2e, explored_rate, explored_spec) if explored
                           else (policy_e2e, policy_rate, policy_spec))
        n = max(1, round(rate * 60 * math.exp(rng.gauss(0, 0.05))))
        cohort = requests(rng, n, itl=e2e / 50, e2e=e2e)
        out.append(Period(T0 + dt.timedelta(minutes=i), explored, 60.0, cohort, speculated=round(n * spec),
                          completion_tokens=n * 48))
    return out


def test_clients_faring_worse_in_the_policy_windows_is_explored_better_driven_by_e2e() -> None:
    rng = random.Random(1)
    periods = minutes(rng, 60, policy_e2e=900.0, explored_e2e=500.0, policy_rate=4.0, explored_rate=7.0)
    result = compare(periods, 60.0)
    assert result.verdict == EXPLORED_BETTER
    assert result.driver == "e2e"
    e2e = result.estimates["e2e"]
    assert e2e is not None
    assert e2e.high < 1 < 1 / e2e.low  # the policy's advantage is below 1, with confidence
    assert 0.45 < e2e.ratio < 0.7  # 500 / 900 = 0.56
    throughput = result.estimates["requests_per_s"]
    assert throughput is not None
    assert throughput.high < 1
    assert result.policy_speculates_more
    # each explored minute against its two neighbours: 20 explored minutes, the first and last at an edge
    assert result.pairs == 20


def test_the_policy_windows_winning_is_policy_better_and_equal_arms_are_no_difference() -> None:
    rng = random.Random(2)
    better = compare(minutes(rng, 60, policy_e2e=400.0, explored_e2e=600.0, policy_rate=6.0, explored_rate=5.0),
                     60.0)
    assert better.verdict == POLICY_BETTER
    same = compare(minutes(random.Random(20), 60, policy_e2e=500.0, explored_e2e=500.0, policy_rate=5.0,
                           explored_rate=5.0), 60.0)
    assert same.verdict == NO_DIFFERENCE
    assert same.driver is None


def test_noise_alone_seldom_calls_a_difference_across_the_five_measures() -> None:
    """Five measures looked at together: without the Bonferroni level, equal arms were called different in
    5 of these 40 runs."""
    verdicts = [compare(minutes(random.Random(seed), 60, policy_e2e=500.0, explored_e2e=500.0, policy_rate=5.0,
                                explored_rate=5.0), 60.0).verdict for seed in range(40)]
    assert verdicts.count(NO_DIFFERENCE) >= 37


def test_faster_answers_but_fewer_of_them_is_mixed() -> None:
    rng = random.Random(3)
    result = compare(minutes(rng, 60, policy_e2e=400.0, explored_e2e=600.0, policy_rate=3.0, explored_rate=6.0),
                     60.0)
    assert result.verdict == MIXED
    assert result.driver == "requests_per_s"  # the measure on which the policy lost


def test_few_pairs_or_thin_windows_are_insufficient_evidence() -> None:
    rng = random.Random(4)
    short = compare(minutes(rng, 6, policy_e2e=900.0, explored_e2e=500.0, policy_rate=4.0, explored_rate=7.0),
                    60.0)
    assert short.verdict == INSUFFICIENT
    thin = compare(minutes(rng, 60, policy_e2e=900.0, explored_e2e=500.0, policy_rate=0.05, explored_rate=0.05),
                   60.0, SwitchbackConfig(min_requests=5))
    assert thin.pairs == 0
    assert thin.verdict == INSUFFICIENT


def test_windows_shorter_than_a_minute_pair_both_arms_within_the_minute() -> None:
    rng = random.Random(5)
    periods = []
    for i in range(12):
        start = T0 + dt.timedelta(minutes=i)
        periods.append(Period(start, False, 40.0, requests(rng, 40, itl=10, e2e=800.0), speculated=40))
        periods.append(Period(start, True, 20.0, requests(rng, 20, itl=10, e2e=450.0)))
    result = compare(periods, 10.0)
    assert result.pairs == 12
    assert result.verdict == EXPLORED_BETTER
    rate = result.estimates["requests_per_s"]
    assert rate is not None
    assert abs(rate.ratio - 1.0) < 0.05  # 40 per 40 s against 20 per 20 s: the exposure evens them out


def test_window_exposure_splits_each_minute_by_the_sticky_hash_of_its_windows() -> None:
    salt, rate = "explore:pool", 0.3

    def explored(index: int) -> bool:
        return sticky_fraction(f"window:{index}", salt) < rate

    total_explored = 0.0
    for i in range(120):
        policy_s, explored_s = window_exposure(T0 + dt.timedelta(minutes=i), 15.0, explored)
        assert math.isclose(policy_s + explored_s, 60.0)
        start = int((T0 + dt.timedelta(minutes=i)).timestamp())
        expected = sum(15.0 for k in range(4) if explored((start + 15 * k) // 15))
        assert math.isclose(explored_s, expected)
        total_explored += explored_s
    assert 0.2 < total_explored / (120 * 60) < 0.4
    # windows that straddle minutes: 45 s windows cut across minute boundaries
    policy_s, explored_s = window_exposure(T0, 45.0, lambda index: index % 2 == 0)
    assert math.isclose(policy_s + explored_s, 60.0)


# --- the recommender on worker-level evidence -----------------------------------------------------------

def _doc() -> tuple[dict[str, Any], str]:
    doc = load_policy(POLICY)
    return canonical_document(doc), revision_id(doc)


def _itl_wins_e2e_loses_cells(rng: random.Random) -> list[Cell]:
    """chat at batch 1-4: the speculative requests stream faster (ITL 12 vs 20 ms) but clients wait longer
    for them (e2e 900 vs 600 ms: queueing behind the drafter's work); at 5-8 nothing speculates yet."""
    out = []
    for bucket in (1, 2, 3):
        out.append(Cell("chat", bucket, requests(rng, 400, itl=12.0, e2e=900.0),
                        requests(rng, 400, itl=20.0, e2e=600.0), "holdout", "draft", "draft_model", 3))
    out.append(Cell("chat", 5, requests(rng, 400, itl=12.0, e2e=900.0), requests(rng, 400, itl=20.0, e2e=600.0),
                    "holdout", "draft", "draft_model", 3))
    return out


def test_per_request_itl_improving_while_e2e_worsens_never_recommends_more_speculation() -> None:
    rng = random.Random(6)
    document, rid = _doc()
    cells = _itl_wins_e2e_loses_cells(rng)
    by_itl = recommend(document, rid, cells, RecommendConfig(measures=("itl",)))
    assert any(r.kind == "raise_threshold" for r in by_itl)  # what the mechanism view alone would say
    recs = recommend(document, rid, cells)
    kinds = {r.kind for r in recs}
    assert not kinds & {"raise_threshold", "change_k", "switch_method"}
    exclusion = next(r for r in recs if r.kind == "exclude_route")
    assert exclusion.measure == "e2e"
    assert "end-to-end latency" in exclusion.message
    assert all(row["measure"] == "e2e" for row in exclusion.evidence["buckets"])


def test_worker_level_evidence_against_speculation_recommends_stopping_and_names_its_measure() -> None:
    rng = random.Random(7)
    document, rid = _doc()
    # Per cell the speculative requests win on every measure: only the whole worker shows the cost.
    cells = [Cell("chat", b, requests(rng, 400, itl=12.0, e2e=400.0), requests(rng, 400, itl=20.0, e2e=600.0),
                  "holdout", "draft", "draft_model", 3) for b in (1, 2, 3, 5)]
    worker = compare(minutes(rng, 60, policy_e2e=900.0, explored_e2e=500.0, policy_rate=4.0, explored_rate=7.0),
                     60.0)
    assert any(r.kind == "raise_threshold" for r in recommend(document, rid, cells))
    recs = recommend(document, rid, cells, switchback=worker)
    assert [r.kind for r in recs] == ["stop_speculating"]
    stop = recs[0]
    assert stop.edit == {"kind": "plain_only"}
    assert stop.measure == "e2e"
    assert stop.confidence == "high"
    assert stop.evidence["switchback"]["verdict"] == EXPLORED_BETTER
    assert "end-to-end latency" in stop.message
    edited, parsed = edits.apply_edit(document, stop.edit)
    assert edited["rules"] == []
    assert edited["default"] == {"engine": "base"}
    assert parsed.exploration.window_s == 60  # exploration keeps measuring speculation
    assert validate_data(edited).exploration.speculative_engine == "draft"


def test_worker_level_evidence_for_the_policy_or_for_a_plain_policy_stops_nothing() -> None:
    rng = random.Random(8)
    document, rid = _doc()
    cells = _itl_wins_e2e_loses_cells(rng)
    for_policy = compare(minutes(rng, 60, policy_e2e=400.0, explored_e2e=700.0, policy_rate=6.0,
                                 explored_rate=5.0), 60.0)
    assert "stop_speculating" not in {r.kind for r in recommend(document, rid, cells, switchback=for_policy)}
    plain = load_policy(POLICY.replace("then: {engine: draft}", "then: {engine: base}"))
    # A policy that speculates nowhere, whose explored (speculative) windows did worse: nothing to stop.
    worse_explored = compare(minutes(rng, 60, policy_e2e=500.0, explored_e2e=900.0, policy_rate=7.0,
                                     explored_rate=4.0, policy_spec=0.0, explored_spec=1.0), 60.0)
    assert worse_explored.verdict == POLICY_BETTER
    recs = recommend(canonical_document(plain), revision_id(plain), [], switchback=worse_explored)
    assert recs == []


def test_a_window_of_several_minutes_is_one_pair_not_one_per_minute() -> None:
    """Five-minute windows, every third one explored, over two hours: 8 explored windows, so 8 pairs (a pair
    per minute would count each window five times and call thin evidence strong)."""
    rng = random.Random(9)
    periods = []
    for i in range(120):
        explored = (i // 5) % 3 == 1
        n = 60
        periods.append(Period(T0 + dt.timedelta(minutes=i), explored, 60.0,
                              requests(rng, n, itl=10, e2e=500.0 if explored else 900.0),
                              speculated=0 if explored else n))
    result = compare(periods, 300.0)
    assert result.pairs == 8
    assert result.verdict == EXPLORED_BETTER
    assert result.policy_speculates_more


# Two draft-model engines that differ only in K, both run on chat (say, one revision and the next).
TWO_KS = """\
apiVersion: specgate/v1
name: ks
engines:
  base: {method: none}
  draft-k5: {method: draft_model, model: models/draft, num_speculative_tokens: 5}
  draft-k2: {method: draft_model, model: models/draft, num_speculative_tokens: 2}
  ngram: {method: ngram, num_speculative_tokens: 4}
rules:
  - name: chat-draft
    when: {route: [chat]}
    then: {engine: draft-k5}
default: {engine: base}
"""


def _engines_cell(rng: random.Random, bucket: int, k5_e2e: float, k2_e2e: float, ngram_e2e: float | None) -> Cell:
    k5, k2 = requests(rng, 300, itl=8.0, e2e=k5_e2e), requests(rng, 200, itl=9.0, e2e=k2_e2e)
    spec = Cohort().add(k5).add(k2)
    engines = {"draft-k5": k5, "draft-k2": k2}
    if ngram_e2e is not None:
        engines["ngram"] = requests(rng, 200, itl=9.0, e2e=ngram_e2e)
    return Cell("chat", bucket, spec, requests(rng, 400, itl=20.0, e2e=900.0), "holdout", "draft-k5",
                "draft_model", 5, engines)


def test_draft_length_rests_on_measured_end_to_end_latency_of_the_engines_that_ran_it() -> None:
    rng = random.Random(10)
    doc = load_policy(TWO_KS)
    cells = [_engines_cell(rng, b, k5_e2e=600.0, k2_e2e=450.0, ngram_e2e=None) for b in (1, 2)]
    recs = recommend(canonical_document(doc), revision_id(doc), cells)
    change = next(r for r in recs if r.kind == "change_k")
    assert change.edit == {"kind": "set_engine", "route": "chat", "engine": "draft-k2"}
    assert change.measure == "e2e"
    assert change.confidence in ("medium", "high")
    assert change.expected_effect["k"] == {"from": 5, "to": 2}
    assert "measured" in change.expected_effect["text"]
    assert not any(r.kind == "switch_method" for r in recs)  # another K of the same method is not a new method
    _, parsed = edits.apply_edit(canonical_document(doc), change.edit)
    assert parsed.rules[0].then.engine == "draft-k2"


def test_without_a_measured_sibling_the_formula_proposes_k_at_low_confidence_and_methods_still_switch() -> None:
    rng = random.Random(11)
    doc = load_policy(TWO_KS)
    # the K=2 engine is no faster; n-gram is
    cells = [_engines_cell(rng, b, k5_e2e=600.0, k2_e2e=600.0, ngram_e2e=300.0) for b in (1, 2)]
    recs = recommend(canonical_document(doc), revision_id(doc), cells)
    assert not [r for r in recs if r.kind == "change_k" and r.measure != "leviathan"]
    assert all(r.confidence == "low" for r in recs if r.kind == "change_k")
    switch = next(r for r in recs if r.kind == "switch_method")
    assert switch.edit == {"kind": "set_engine", "route": "chat", "engine": "ngram"}
    assert switch.measure == "e2e"
