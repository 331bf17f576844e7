"""The analysis's pure parts: statistics, the recommender, rule edits, guardrails under repeated looks."""

from __future__ import annotations

import json
import math
import random
import statistics
from typing import Any

import pytest

from analysis import edits
from analysis.cells import Cell, Cohort
from analysis.guardrails import evaluate_step
from analysis.histogram import bucket_index
from analysis.recommend import RecommendConfig, bucket_upper, recommend
from analysis.stats import (
    leviathan_speedup,
    log_moments,
    log_quantile_variance,
    msprt,
    t_quantile,
    welch_ratio,
)
from policies import PolicyValidationError, RequestShape, canonical_document, compile_policy, load_policy
from policies.model import Guardrails

POLICY = """\
apiVersion: specgate/v1
name: seed
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
  ngram: {method: ngram, num_speculative_tokens: 4}
rules:
  - name: no-structured
    when: {structured_output: true}
    then: {engine: base}
  - name: chat-low-batch
    when: {route: [chat, summarize], batch_size: {max: %d}}
    then: {engine: draft}
default: {engine: base}
guardrails: {min_acceptance_rate: 0.3}
"""


def doc(threshold: int = 4) -> dict[str, Any]:
    return canonical_document(load_policy(POLICY % threshold))


def cohort(rng: random.Random, n: int, itl_ms: float, *, sigma: float = 0.25, retry: float = 0.0,
           acceptance: float | None = None, k: int = 3, structured_valid: float | None = None) -> Cohort:
    c = Cohort()
    for _ in range(n):
        itl = itl_ms * math.exp(rng.gauss(0, sigma))
        e2e = itl * 100
        c.requests += 1
        c.itl_count += 1
        c.itl_ms_sum += itl
        c.e2e_ms_sum += e2e
        for metric, value in (("itl", itl), ("e2e", e2e)):
            hist = getattr(c, metric)
            b = bucket_index(value)
            hist[b] = hist.get(b, 0) + 1
        if rng.random() < retry:
            c.retries += 1
        if acceptance is not None:
            steps = 30
            drafted = steps * k
            accepted = sum(rng.random() < acceptance for _ in range(drafted))
            c.spec_reported += 1
            c.draft_tokens += drafted
            c.accepted_tokens += accepted
            c.spec_steps_sum += steps
        if structured_valid is not None:
            c.structured_checked += 1
            c.structured_valid += rng.random() < structured_valid
    return c


def cell(rng: random.Random, route: str, bucket: int, spec_itl: float, plain_itl: float, n: int = 400,
         **spec_kw: Any) -> Cell:
    spec_kw.setdefault("acceptance", 0.7)
    plain_kw = {k: v for k, v in spec_kw.items() if k in ("structured_valid",)}
    if "plain_retry" in spec_kw:
        plain_kw["retry"] = spec_kw.pop("plain_retry")
    spec = cohort(rng, n, spec_itl, **spec_kw)
    return Cell(route, bucket, spec, cohort(rng, n, plain_itl, **plain_kw), "holdout", "draft", "draft_model", 3,
                {"draft": spec})


# --- statistics -----------------------------------------------------------------------------------

def test_log_moments_recover_a_lognormal_from_its_histogram() -> None:
    rng = random.Random(1)
    c = cohort(rng, 20_000, 20.0, sigma=0.4)
    m = log_moments(c.itl)
    assert m is not None
    assert abs(m.mean - math.log(20.0)) < 0.02
    assert abs(math.sqrt(m.var) - 0.4) < 0.02
    assert log_moments({}) is None


def test_welch_ratio_covers_the_true_ratio_and_separates_real_differences() -> None:
    rng = random.Random(2)
    covered = 0
    for _ in range(200):
        a = log_moments(cohort(rng, 200, 20.0).itl)
        b = log_moments(cohort(rng, 200, 20.0).itl)
        assert a is not None
        assert b is not None
        est = welch_ratio(a, b)
        covered += est.low <= 1.0 <= est.high
    assert covered >= 180  # nominal 95 %; the bucketed data keep it near that
    fast = log_moments(cohort(rng, 300, 10.0).itl)
    slow = log_moments(cohort(rng, 300, 20.0).itl)
    assert fast is not None
    assert slow is not None
    est = welch_ratio(slow, fast)
    assert est.above_one
    assert 1.8 < est.ratio < 2.2


def test_t_quantile_matches_known_values() -> None:
    assert abs(t_quantile(0.975, 10) - 2.228) < 0.01
    assert abs(t_quantile(0.975, 30) - 2.042) < 0.005
    assert abs(t_quantile(0.975, math.inf) - 1.960) < 0.001


def test_leviathan_formula() -> None:
    assert leviathan_speedup(0.0, 3, 0.0) == pytest.approx(1.0)
    assert leviathan_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8**5) / 0.2)
    assert leviathan_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / 0.2 / 1.4)
    assert leviathan_speedup(1.0, 3, 0.0) == 4.0


def test_quantile_variance_matches_the_spread_of_the_estimate() -> None:
    rng = random.Random(3)
    for n in (300, 3000):
        values, estimates = [], []
        for _ in range(200):
            c = cohort(rng, n, 20.0)
            p95 = c.quantile("itl", 0.95)
            var = log_quantile_variance(c.itl, 0.95)
            assert p95 is not None
            assert var is not None
            values.append(math.log(p95))
            estimates.append(var)
        empirical = statistics.variance(values)
        assert 0.7 < statistics.mean(estimates) / empirical < 1.5, n
    assert log_quantile_variance({}, 0.95) is None


def test_msprt_breaches_only_beyond_the_margin() -> None:
    assert not msprt(0.05, 0.0001, 0.1, alpha=0.05, tau=0.1).breach
    assert msprt(0.05, 0.0001, 0.1, alpha=0.05, tau=0.1).clear
    strong = msprt(0.3, 0.0001, 0.1, alpha=0.05, tau=0.1)
    assert strong.breach
    assert strong.p_value < 0.05
    thin = msprt(0.3, 0.05, 0.1, alpha=0.05, tau=0.1)
    assert not thin.breach
    assert not thin.clear


# --- guardrails under repeated looks ---------------------------------------------------------------

def _run(seed: int, canary_itl: float, looks: int = 10, per_look: int = 300, canary_retry: float = 0.02) -> str:
    rng = random.Random(seed)
    base, canary = Cohort(), Cohort()
    guardrails = Guardrails(min_acceptance_rate=0.5)
    for _ in range(looks):
        base.add(cohort(rng, per_look, 20.0, sigma=0.3, retry=0.02, acceptance=0.7))
        canary.add(cohort(rng, per_look, canary_itl, sigma=0.3, retry=canary_retry, acceptance=0.7))
        verdict = evaluate_step(base, canary, guardrails, alpha=0.05).verdict
        if verdict != "pending":
            return verdict
    return "pending"


def test_noise_alone_does_not_roll_back_in_95_of_100_runs() -> None:
    outcomes = [_run(seed, 20.0) for seed in range(100)]
    false_alarms = outcomes.count("breach")
    assert false_alarms <= 5, f"{false_alarms} false alarms in 100 runs of pure noise"
    # and an equal canary is cleared, not left pending forever
    assert outcomes.count("pass") >= 80


def test_a_real_regression_is_caught() -> None:
    slower = [_run(seed, 26.0) for seed in range(20)]  # p95 ITL +30 % against a 10 % limit
    assert slower.count("breach") >= 19
    retrying = [_run(seed, 20.0, canary_retry=0.12) for seed in range(20)]  # +0.10 retries/request vs +0.02
    assert retrying.count("breach") >= 19


def test_acceptance_below_the_minimum_is_a_breach_and_thin_cohorts_wait() -> None:
    rng = random.Random(4)
    base = cohort(rng, 600, 20.0, acceptance=0.7)
    low = cohort(rng, 600, 20.0, acceptance=0.3)
    result = evaluate_step(base, low, Guardrails(min_acceptance_rate=0.5), alpha=0.05)
    assert result.verdict == "breach"
    assert [c.guardrail for c in result.breaches] == ["min_acceptance"]
    few = evaluate_step(cohort(rng, 50, 20.0), cohort(rng, 50, 40.0), Guardrails(), alpha=0.05)
    assert few.verdict == "pending"


# --- the recommender -------------------------------------------------------------------------------

def _by_kind(recs: list[Any]) -> dict[tuple[str, str], Any]:
    return {(r.kind, r.route): r for r in recs}


def test_raise_threshold_to_the_largest_winning_bucket() -> None:
    rng = random.Random(5)
    cells = [cell(rng, "chat", 1, 12, 20), cell(rng, "chat", 2, 12, 20), cell(rng, "chat", 3, 13, 20),
             cell(rng, "chat", 5, 15, 20), cell(rng, "chat", 9, 26, 20), cell(rng, "chat", 17, 30, 20)]
    recs = _by_kind(recommend(doc(4), "rev", cells))
    rec = recs[("raise_threshold", "chat")]
    assert rec.edit == {"kind": "set_batch_max", "route": "chat", "batch_max": 8}
    assert rec.expected_effect["batch_max"] == {"from": 4, "to": 8}
    assert rec.expected_effect["latency_change_in_affected_buckets"] < 1
    assert {row["batch_bucket"]: row["verdict"] for row in rec.evidence["buckets"]}[9] == "loses"
    assert rec.confidence in ("high", "medium")


def test_lower_threshold_when_a_speculated_bucket_loses() -> None:
    rng = random.Random(6)
    cells = [cell(rng, "chat", 1, 12, 20), cell(rng, "chat", 2, 13, 20), cell(rng, "chat", 3, 25, 20),
             cell(rng, "chat", 5, 30, 20)]
    rec = _by_kind(recommend(doc(8), "rev", cells))[("lower_threshold", "chat")]
    assert rec.edit == {"kind": "set_batch_max", "route": "chat", "batch_max": 2}
    assert "from 8 to 2" in rec.message


def test_lower_threshold_skips_buckets_that_do_not_win_below_the_loss() -> None:
    # Wins at 1-2, no difference at 3-4, loses from 5-8: speculating at 3-4 buys nothing, so the threshold
    # goes to the largest winning bucket, not to the bucket just below the loss.
    rng = random.Random(16)
    cells = [cell(rng, "chat", 1, 12, 20), cell(rng, "chat", 2, 13, 20), cell(rng, "chat", 3, 20, 20),
             cell(rng, "chat", 5, 30, 20), cell(rng, "chat", 9, 34, 20)]
    rec = _by_kind(recommend(doc(16), "rev", cells))[("lower_threshold", "chat")]
    verdicts = {row["batch_bucket"]: row["verdict"] for row in rec.evidence["buckets"]}
    assert verdicts == {1: "wins", 2: "wins", 3: "no clear difference", 5: "loses", 9: "loses"}
    assert rec.edit == {"kind": "set_batch_max", "route": "chat", "batch_max": 2}
    assert "from 16 to 2" in rec.message
    assert "in 3-4 it is not faster with confidence" in rec.message
    # The affected traffic is every bucket the edit stops speculating in, the unclear one included.
    share = sum(c.speculative.requests + c.plain.requests for c in cells if c.batch_bucket >= 3)
    total = sum(c.speculative.requests + c.plain.requests for c in cells)
    assert rec.expected_effect["share_of_route_traffic"] == round(share / total, 4)
    # Nothing below the loss wins (a win above it keeps the route from being excluded): stop just below it.
    unclear = [cell(rng, "chat", 1, 20, 20), cell(rng, "chat", 2, 20, 20), cell(rng, "chat", 3, 30, 20),
               cell(rng, "chat", 9, 12, 20)]
    rec = _by_kind(recommend(doc(16), "rev", unclear))[("lower_threshold", "chat")]
    assert [row["verdict"] for row in rec.evidence["buckets"]] == ["no clear difference"] * 2 + ["loses", "wins"]
    assert rec.edit == {"kind": "set_batch_max", "route": "chat", "batch_max": 2}


def test_thin_evidence_changes_nothing() -> None:
    rng = random.Random(7)
    cells = [cell(rng, "chat", b, 10, 20, n=20) for b in (1, 2, 3, 5, 9)]
    recs = recommend(doc(4), "rev", cells)
    assert [r.kind for r in recs if r.kind.endswith("threshold")] == []
    from analysis.recommend import cell_report
    assert {cell_report(c, RecommendConfig())["verdict"] for c in cells} == {"insufficient evidence"}


def test_exclude_a_route_where_speculation_loses_or_acceptance_is_too_low() -> None:
    rng = random.Random(8)
    losing = [cell(rng, "summarize", b, 26, 20) for b in (1, 2, 3)]
    rec = _by_kind(recommend(doc(4), "rev", losing))[("exclude_route", "summarize")]
    assert rec.edit == {"kind": "exclude_route", "route": "summarize"}
    low_acc = [cell(rng, "chat", b, 19, 20, acceptance=0.1) for b in (1, 2, 3)]
    rec = _by_kind(recommend(doc(4), "rev", low_acc))[("exclude_route", "chat")]
    assert "below the guardrail minimum" in rec.message


def test_change_k_follows_the_measured_acceptance() -> None:
    rng = random.Random(9)
    cells = [cell(rng, "chat", b, 12, 20, acceptance=0.92) for b in (1, 2, 3)]
    rec = _by_kind(recommend(doc(4), "rev", cells))[("change_k", "chat")]
    assert rec.edit["kind"] == "set_engine_k"
    assert rec.edit["engine"] == "draft"
    assert rec.edit["k"] > 3  # the engine drafts 3: more needs the engine reconfigured
    assert rec.expected_effect["theoretical_speedup"]["to"] > rec.expected_effect["theoretical_speedup"]["from"]
    mediocre = [cell(rng, "chat", b, 12, 20, acceptance=0.55) for b in (1, 2, 3)]
    assert ("change_k", "chat") not in _by_kind(recommend(doc(4), "rev", mediocre))


def test_switch_method_when_another_engine_is_faster() -> None:
    rng = random.Random(10)
    cells = []
    for b in (1, 2, 3):
        c = cell(rng, "chat", b, 14, 20)
        c.engines["ngram"] = cohort(rng, 300, 10, acceptance=0.7, k=4)
        cells.append(c)
    rec = _by_kind(recommend(doc(4), "rev", cells))[("switch_method", "chat")]
    assert rec.edit == {"kind": "set_engine", "route": "chat", "engine": "ngram"}


def test_quality_risk_is_flagged_without_an_edit() -> None:
    rng = random.Random(11)
    cells = [cell(rng, "chat", b, 12, 20, retry=0.15, plain_retry=0.01, structured_valid=0.8) for b in (1, 2)]
    rec = _by_kind(recommend(doc(4), "rev", cells))[("quality_risk", "chat")]
    assert rec.edit is None
    assert "retries" in rec.message


def test_the_recommender_reads_recorded_statistics_from_a_file(tmp_path: Any) -> None:
    rng = random.Random(12)
    cells = [cell(rng, "chat", b, s, 20) for b, s in ((1, 12), (2, 12), (3, 13), (5, 15), (9, 26))]
    path = tmp_path / "cells.json"
    path.write_text(json.dumps([c.to_dict() for c in cells]))
    again = [Cell.from_dict(d) for d in json.loads(path.read_text())]
    first = [r.to_dict() for r in recommend(doc(4), "rev", cells)]
    assert first == [r.to_dict() for r in recommend(doc(4), "rev", again)]
    assert first
    assert first[0]["id"] == recommend(doc(4), "rev", again)[0].id


# --- rule edits --------------------------------------------------------------------------------------

def _decide(document: dict[str, Any], **shape: Any) -> str:
    return compile_policy(load_policy(json.dumps(document))).decide(RequestShape(**shape)).engine


def test_set_batch_max_splits_a_shared_rule_and_keeps_the_other_route() -> None:
    out, _ = edits.apply_edit(doc(4), {"kind": "set_batch_max", "route": "chat", "batch_max": 8})
    assert _decide(out, route="chat", batch_size=8) == "draft"
    assert _decide(out, route="chat", batch_size=9) == "base"
    assert _decide(out, route="summarize", batch_size=5) == "base"
    assert _decide(out, route="summarize", batch_size=4) == "draft"
    assert _decide(out, route="chat", batch_size=2, structured_output=True) == "base"


def test_exclude_route_and_set_k_and_set_engine() -> None:
    out, _ = edits.apply_edit(doc(4), {"kind": "exclude_route", "route": "summarize"})
    assert _decide(out, route="summarize", batch_size=1) == "base"
    assert _decide(out, route="chat", batch_size=1) == "draft"
    out, parsed = edits.apply_edit(doc(4), {"kind": "set_k", "route": "chat", "k": 2})
    decision = compile_policy(parsed).decide(RequestShape(route="chat", batch_size=1))
    assert decision.num_speculative_tokens == 2
    assert compile_policy(parsed).decide(RequestShape(route="summarize", batch_size=1)).num_speculative_tokens == 3
    out, parsed = edits.apply_edit(doc(4), {"kind": "set_engine_k", "route": "chat", "engine": "draft", "k": 6})
    assert compile_policy(parsed).decide(RequestShape(route="chat", batch_size=1)).num_speculative_tokens == 6
    out, _ = edits.apply_edit(doc(4), {"kind": "set_engine", "route": "chat", "engine": "ngram"})
    assert _decide(out, route="chat", batch_size=1) == "ngram"


def test_exclude_route_under_a_general_rule_inserts_a_plain_rule() -> None:
    general = canonical_document(load_policy(POLICY.replace("route: [chat, summarize], ", "") % 4))
    out, _ = edits.apply_edit(general, {"kind": "exclude_route", "route": "code"})
    assert _decide(out, route="code", batch_size=1) == "base"
    assert _decide(out, route="chat", batch_size=1) == "draft"


def test_edits_that_cannot_apply_are_refused() -> None:
    with pytest.raises(ValueError, match="no rule"):
        edits.apply_edit(doc(4), {"kind": "set_batch_max", "route": "other", "batch_max": 8})
    with pytest.raises(ValueError, match="not a speculative engine"):
        edits.apply_edit(doc(4), {"kind": "set_engine", "route": "chat", "engine": "base"})
    with pytest.raises(PolicyValidationError):
        edits.apply_edit(doc(4), {"kind": "set_k", "route": "chat", "k": 99})


def test_bucket_upper_bounds() -> None:
    assert [bucket_upper(b) for b in (1, 2, 3, 5, 9, 17, 33, 65)] == [1, 2, 4, 8, 16, 32, 64, 130]
