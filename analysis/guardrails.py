"""Guardrail checks of a rollout step: canary cohort against baseline cohort, sequentially. Pure.

A step is looked at again and again (every evaluator interval, and whenever
an operator asks), on data that keep accumulating since the step started. A
fixed-sample test repeated like that raises false alarms far above its level,
so each guardrail is a mixture sequential probability ratio test
(:func:`analysis.stats.msprt`), whose error bound holds at any
number of looks. The guardrails share the level ``alpha`` (Bonferroni:
``alpha / 4`` each, ``alpha / 5`` when the policy sets a minimum shadow match
rate: that check exists only then, so the looks of every other policy stay
what they were), so a step that is as good as its baseline is rolled back
with probability at most ``alpha`` over its whole life.

The guardrails of the policy document (``guardrails``), what clients feel first:

- ``max_p95_e2e_regression`` r: breach when ln(p95 canary) - ln(p95 baseline)
  of the end-to-end latency > ln(1 + r) with confidence; the p95s come from
  the rollup histograms, their variances from
  :func:`~analysis.stats.log_quantile_variance`. A document that does not set
  it is held to ``max_p95_itl_regression`` here too.
- ``max_p95_itl_regression`` r: the same test on the inter-token latency (the
  mechanism).
- ``max_retry_rate_increase`` d: breach when the canary's retries and
  fallbacks per request exceed the baseline's by more than d with confidence
  (counts: Poisson variance).
- ``min_acceptance_rate`` m (optional): breach when the canary's acceptance
  (accepted / drafted tokens) is below m with confidence (binomial variance
  over requests, which bounds the variance of a mean of per-request rates).
- ``min_shadow_match_rate`` m (optional; ``min_shadow_match``): breach when
  the share of the canary's shadow comparisons (the policy's ``quality``: the
  plain engine's answer to the same greedy request) whose answers matched is
  below m with confidence (binomial variance over comparisons, the larger of
  the observed rate's and the limit's: calibrated at the boundary, so a pass
  takes more comparisons than a breach). It waits for
  :data:`MIN_SHADOW_COMPARISONS` comparisons (fewer when ``min_samples`` is
  smaller) rather than ``min_samples``: comparisons are a small sample of the
  requests.

A guardrail is ``pass`` when its always-valid interval lies wholly on the good
side, ``breach`` as above, ``pending`` otherwise (or with fewer than
``min_samples`` requests in a cohort). The step's verdict is ``breach`` if any
guardrail breaches, ``pass`` if all pass, else ``pending``.

Client disconnects: neither p95 guardrail passes while the canary's
clients go away markedly more often than the baseline's (by more than
:data:`analysis.cells.DISCONNECT_MARGIN`, with the same always-valid test):
the requests they gave up on are missing from the canary's latencies, so its
p95 would flatter it. It stays ``pending`` (a regression it shows anyway is
still a breach), and the step is neither passed nor promoted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from analysis.cells import DISCONNECT_MARGIN, Cohort
from analysis.stats import log_quantile_variance, msprt
from policies.model import Guardrails

GUARDRAILS = ("p95_e2e_regression", "p95_itl_regression", "retry_rate_increase", "min_acceptance",
              "min_shadow_match")
# Shadow comparisons a minimum match rate waits for (or min_samples, if smaller). A policy samples at most 5 % of
# its greedy speculative requests for them, so a canary holds twenty times fewer comparisons than requests or
# fewer still: waiting for min_samples comparisons would hold a step many times longer than its other checks.
# Below about 30 a binomial share is too far from normal for the test's variance, and a couple of chance
# mismatches would decide.
MIN_SHADOW_COMPARISONS = 30
_P95_LABELS = {"e2e": "end-to-end latency", "itl": "ITL"}


@dataclass(frozen=True, slots=True)
class Check:
    guardrail: str
    status: str  # pass | breach | pending
    limit: float | None
    observed: float | None
    interval: tuple[float, float] | None
    p_value: float | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"guardrail": self.guardrail, "status": self.status, "limit": self.limit,
                "observed": self.observed,
                "interval": None if self.interval is None else [round(v, 6) for v in self.interval],
                "p_value": self.p_value, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class StepEvaluation:
    verdict: str
    checks: list[Check]
    baseline_requests: int
    canary_requests: int
    alpha: float

    @property
    def breaches(self) -> list[Check]:
        return [c for c in self.checks if c.status == "breach"]

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "alpha": self.alpha, "baseline_requests": self.baseline_requests,
                "canary_requests": self.canary_requests, "checks": [c.to_dict() for c in self.checks]}


def _status(breach: bool, clear: bool) -> str:
    return "breach" if breach else "pass" if clear else "pending"


def _p95(base: Cohort, canary: Cohort, limit: float, alpha: float, metric: str = "itl") -> Check:
    name, label = f"p95_{metric}_regression", _P95_LABELS[metric]
    qb, qc = base.quantile(metric, 0.95), canary.quantile(metric, 0.95)
    vb, vc = log_quantile_variance(getattr(base, metric), 0.95), log_quantile_variance(getattr(canary, metric), 0.95)
    if qb is None or qc is None or vb is None or vc is None or qb <= 0 or qc <= 0:
        return Check(name, "pending", limit, None, None, None, f"no {label} measured yet")
    margin = math.log1p(limit)
    test = msprt(math.log(qc) - math.log(qb), vb + vc, margin, alpha=alpha, tau=max(margin, 0.05))
    observed = qc / qb - 1
    interval = (math.expm1(test.ci_low), math.expm1(test.ci_high))
    status = _status(test.breach, test.clear)
    detail = (f"p95 {label} {qc:.2f} ms on the canary vs {qb:.2f} ms on the baseline "
              f"({observed:+.1%}; limit +{limit:.0%})")
    if status == "pass" and _more_disconnects(canary, base, alpha):
        status = "pending"
        detail += (f"; not passed: clients went away on {canary.client_disconnect_rate:.1%} of canary requests "
                   f"vs {base.client_disconnect_rate:.1%} of baseline ones, so the canary's latencies miss "
                   "the answers they gave up on")
    return Check(name, status, limit, round(observed, 6), interval, test.p_value, detail)


def _more_disconnects(canary: Cohort, base: Cohort, alpha: float) -> bool:
    """The canary's disconnect rate exceeds the baseline's by more than DISCONNECT_MARGIN (always valid)."""
    rb = base.client_disconnects / base.requests
    rc = canary.client_disconnects / canary.requests
    variance = (max(rb * (1 - rb), 1 / base.requests) / base.requests
                + max(rc * (1 - rc), 1 / canary.requests) / canary.requests)
    return msprt(rc - rb, variance, DISCONNECT_MARGIN, alpha=alpha, tau=0.02).breach


def _retries(base: Cohort, canary: Cohort, limit: float, alpha: float) -> Check:
    rb = (base.retries + base.fallbacks) / base.requests
    rc = (canary.retries + canary.fallbacks) / canary.requests
    # Poisson variance of a count per request, floored at one event's worth so zero counts are not certain.
    variance = max(rb, 1 / base.requests) / base.requests + max(rc, 1 / canary.requests) / canary.requests
    test = msprt(rc - rb, variance, limit, alpha=alpha, tau=max(limit, 0.005))
    return Check("retry_rate_increase", _status(test.breach, test.clear), limit, round(rc - rb, 6),
                 (test.ci_low, test.ci_high), test.p_value,
                 f"retries+fallbacks per request {rc:.4f} on the canary vs {rb:.4f} on the baseline "
                 f"(limit +{limit})")


def _acceptance(canary: Cohort, limit: float | None, alpha: float, min_samples: int) -> Check:
    a = canary.acceptance_rate
    if limit is None:
        return Check("min_acceptance", "pass", None, a, None, None, "the policy sets no minimum acceptance")
    if a is None or canary.spec_reported < min_samples:
        return Check("min_acceptance", "pending", limit, a, None, None,
                     "not enough speculative requests with acceptance metrics yet")
    variance = max(a * (1 - a), 0.25 / canary.spec_reported) / canary.spec_reported
    # Breach when limit - a > 0: the same one-sided test on the shortfall.
    test = msprt(limit - a, variance, 0.0, alpha=alpha, tau=0.05)
    return Check("min_acceptance", _status(test.breach, test.clear), limit, round(a, 6),
                 (limit - test.ci_high, limit - test.ci_low), test.p_value,
                 f"acceptance {a:.3f} on the canary (minimum {limit})")


def _percent(share: float) -> str:
    """A limit as a percentage with the digits it has: 0.995 is 99.5%, not a rounded 100%."""
    return f"{share * 100:.4g}%"


def _shadow_match(canary: Cohort, limit: float, alpha: float, min_compared: int) -> Check:
    n, matched, rate = canary.shadow_compared, canary.shadow_matched, canary.shadow_match_rate
    if rate is None:
        return Check("min_shadow_match", "pending", limit, None, None, None,
                     f"no shadow comparisons on the canary yet (minimum {_percent(limit)}; decided from "
                     f"{min_compared} comparisons)")
    counts = (f"{matched} of {n} shadow comparisons matched on the canary ({rate:.1%}; "
              f"minimum {_percent(limit)})")
    if n < min_compared:
        return Check("min_shadow_match", "pending", limit, round(rate, 6), None, None,
                     f"{counts}; waiting for {min_compared} comparisons")
    # The larger of the observed rate's binomial variance and the limit's: at 30 of 30 matched the observed one
    # is nearly 0, and a canary whose true rate sits at the limit would then pass by chance (one in eight over
    # many looks, at a limit of 0.99); the limit's is the variance at the boundary the test decides. Floored at
    # a quarter of one comparison's worth, as acceptance is.
    variance = max(rate * (1 - rate), limit * (1 - limit), 0.25 / n) / n
    # Breach when limit - rate > 0: the one-sided test on the shortfall.
    test = msprt(limit - rate, variance, 0.0, alpha=alpha, tau=0.05)
    # The rate's interval, within the shares it can take.
    interval = (max(limit - test.ci_high, 0.0), min(limit - test.ci_low, 1.0))
    return Check("min_shadow_match", _status(test.breach, test.clear), limit, round(rate, 6), interval,
                 test.p_value, counts)


def evaluated(guardrails: Guardrails) -> tuple[str, ...]:
    """The guardrails a step of a policy with these limits is looked at on: every one but ``min_shadow_match``,
    which only when the policy sets its minimum."""
    if guardrails.min_shadow_match_rate is None:
        return tuple(g for g in GUARDRAILS if g != "min_shadow_match")
    return GUARDRAILS


def evaluate_step(baseline: Cohort, canary: Cohort, guardrails: Guardrails, *, alpha: float) -> StepEvaluation:
    """Compare the canary cohort with the baseline cohort on the policy's guardrails (see the module doc)."""
    names = evaluated(guardrails)
    each = alpha / len(names)
    n = guardrails.min_samples
    if baseline.requests < n or canary.requests < n:
        detail = (f"waiting for {n} requests in each cohort (baseline {baseline.requests}, "
                  f"canary {canary.requests})")
        checks = [Check(g, "pending", None, None, None, None, detail) for g in names]
        return StepEvaluation("pending", checks, baseline.requests, canary.requests, alpha)
    e2e_limit = guardrails.max_p95_e2e_regression
    checks = [_p95(baseline, canary, guardrails.max_p95_itl_regression if e2e_limit is None else e2e_limit, each,
                   "e2e"),
              _p95(baseline, canary, guardrails.max_p95_itl_regression, each),
              _retries(baseline, canary, guardrails.max_retry_rate_increase, each),
              _acceptance(canary, guardrails.min_acceptance_rate, each, n)]
    shadow_limit = guardrails.min_shadow_match_rate
    if shadow_limit is not None:
        checks.append(_shadow_match(canary, shadow_limit, each, min(n, MIN_SHADOW_COMPARISONS)))
    if any(c.status == "breach" for c in checks):
        verdict = "breach"
    elif all(c.status == "pass" for c in checks):
        verdict = "pass"
    else:
        verdict = "pending"
    return StepEvaluation(verdict, checks, baseline.requests, canary.requests, alpha)
