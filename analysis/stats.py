"""Statistics the analysis needs, in plain Python, over the rollups' fixed log-spaced histograms.

Nothing here touches a database: every function takes counts and sums as the
rollups hold them, so the same code serves the API, the recommender fed from
a file, and the guardrail simulations in the tests.

- :func:`log_moments`: mean and variance of log-latency from a histogram
  (bucket log-midpoints, with Sheppard's correction for the bucket width);
  latency ratios are compared on the log scale, where they are differences.
- :func:`welch_ratio`: ratio of geometric means of two cohorts, with a Welch
  interval on the difference of log means.
- :func:`log_quantile_variance`: the variance of the log of a quantile read
  from a histogram by interpolation (delta method on the interpolation).
- :func:`msprt`: the mixture sequential probability ratio test (normal
  mixture) of one estimate against a margin; its p-value and confidence
  interval stay valid however often the data are looked at, which is what a
  guardrail evaluated every minute needs.
- :func:`wilson_interval`: the Wilson score interval of a share (shadow
  match rates: often near 1 and from few comparisons, where the normal
  interval would reach past 1 or shrink to nothing).
- :func:`leviathan_speedup`: the expected walltime improvement of speculative
  decoding for acceptance ``a``, draft length ``k`` and cost ratio ``c``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist

from analysis.histogram import EDGES, FACTOR, LOWEST_MS, NUM_BUCKETS, quantile

_LOG_WIDTH = math.log(FACTOR)
_NORMAL = NormalDist()


def _log_midpoint(index: int) -> float:
    if index == 0:
        return math.log(LOWEST_MS / 2)
    if index == NUM_BUCKETS - 1:
        return math.log(EDGES[-1]) + _LOG_WIDTH / 2
    return math.log(EDGES[index - 1]) + _LOG_WIDTH / 2


_MIDPOINTS = tuple(_log_midpoint(i) for i in range(NUM_BUCKETS))


@dataclass(frozen=True, slots=True)
class LogMoments:
    n: int
    mean: float  # of ln(latency in ms)
    var: float  # sample variance of ln(latency), corrected for the bucket width


def log_moments(counts: Mapping[int, int]) -> LogMoments | None:
    """Mean and variance of ln(latency) from ``{bucket: count}``; None for fewer than 2 values."""
    n = sum(c for c in counts.values() if c > 0)
    if n < 2:
        return None
    mean = sum(_MIDPOINTS[b] * c for b, c in counts.items() if c > 0) / n
    ss = sum(c * (_MIDPOINTS[b] - mean) ** 2 for b, c in counts.items() if c > 0)
    var = ss / (n - 1) - _LOG_WIDTH**2 / 12  # Sheppard: the grouping adds width**2 / 12
    # Values all in one bucket still differ by up to its width: keep a floor, never zero.
    return LogMoments(n, mean, max(var, _LOG_WIDTH**2 / 48))


def t_quantile(p: float, df: float) -> float:
    """Student t quantile by the Cornish-Fisher expansion around the normal (good for df >= 3)."""
    z = _NORMAL.inv_cdf(p)
    if df == math.inf or df > 1e6:
        return z
    df = max(df, 1.0)
    z3, z5, z7 = z**3, z**5, z**7
    return (z + (z3 + z) / (4 * df) + (5 * z5 + 16 * z3 + 3 * z) / (96 * df**2)
            + (3 * z7 + 19 * z5 + 17 * z3 - 15 * z) / (384 * df**3))


@dataclass(frozen=True, slots=True)
class RatioEstimate:
    """``ratio`` = geometric mean of ``a`` / geometric mean of ``b``, with its interval."""

    ratio: float
    low: float
    high: float
    n_a: int
    n_b: int
    confidence: float

    @property
    def above_one(self) -> bool:
        return self.low > 1.0

    @property
    def below_one(self) -> bool:
        return self.high < 1.0


def welch_ratio(a: LogMoments, b: LogMoments, confidence: float = 0.95) -> RatioEstimate:
    """Welch's interval for mean(ln a) - mean(ln b), reported as a ratio exp(.)."""
    va, vb = a.var / a.n, b.var / b.n
    se = math.sqrt(va + vb)
    den = (va**2 / (a.n - 1) if a.n > 1 else 0.0) + (vb**2 / (b.n - 1) if b.n > 1 else 0.0)
    df = (va + vb) ** 2 / den if den > 0 else math.inf
    t = t_quantile(0.5 + confidence / 2, df)
    diff = a.mean - b.mean
    return RatioEstimate(math.exp(diff), math.exp(diff - t * se), math.exp(diff + t * se), a.n, b.n, confidence)


def log_quantile_variance(counts: Mapping[int, int], q: float, z: float = 1.96) -> float | None:
    """Variance of ln(quantile) as :func:`analysis.histogram.quantile` reads it.

    Distribution-free, from the ranks: the rank of the q-quantile among n
    values has standard deviation sqrt(n q (1-q)), so the quantiles at
    q -/+ z sqrt(q (1-q) / n) bound a ``z`` interval of it; the variance is
    that interval's half-width squared over z**2, on the log scale. Reading
    the interval off the histogram takes the bucket steps into account, which
    a local density (delta method) near a bucket edge would not.
    """
    n = sum(c for c in counts.values() if c > 0)
    if n == 0:
        return None
    spread = z * math.sqrt(q * (1 - q) / n)
    low = quantile(counts, max(q - spread, 0.0))
    high = quantile(counts, min(q + spread, 1.0))
    if low is None or high is None:
        return None
    floor = LOWEST_MS / 2
    width = math.log(max(high, floor)) - math.log(max(low, floor))
    # Never zero: values in one bucket are still uncertain within it.
    return max(width / (2 * z), _LOG_WIDTH / math.sqrt(12 * n)) ** 2


@dataclass(frozen=True, slots=True)
class SequentialTest:
    """One always-valid test of ``estimate > margin`` (a breach) at level ``alpha``."""

    estimate: float
    variance: float
    margin: float
    alpha: float
    likelihood_ratio: float
    ci_low: float
    ci_high: float

    @property
    def breach(self) -> bool:
        """The evidence that ``true value > margin`` crossed 1/alpha."""
        return self.estimate > self.margin and self.likelihood_ratio >= 1 / self.alpha

    @property
    def clear(self) -> bool:
        """The always-valid interval lies wholly below the margin."""
        return self.ci_high < self.margin

    @property
    def p_value(self) -> float:
        return min(1.0, 1 / self.likelihood_ratio) if self.estimate > self.margin else 1.0


def msprt(estimate: float, variance: float, margin: float, *, alpha: float, tau: float) -> SequentialTest:
    """Normal-mixture SPRT (Robbins; Johari et al.) of H0: theta <= margin, mixing N(margin, tau**2).

    ``variance`` is the variance of ``estimate`` at this look. The mixture
    likelihood ratio of theta = margin is
    ``sqrt(V / (V + tau**2)) * exp(tau**2 (est - margin)**2 / (2 V (V + tau**2)))``;
    under H0 the chance that it ever exceeds 1/alpha, at any number of looks,
    is at most alpha (Ville's inequality), and inverting it gives an
    always-valid confidence interval.
    """
    v = max(variance, 1e-18)
    t2 = tau * tau
    d = estimate - margin
    exponent = min(t2 * d * d / (2 * v * (v + t2)), 700.0)
    ratio = math.sqrt(v / (v + t2)) * math.exp(exponent)
    half = math.sqrt(2 * v * (v + t2) / t2 * (math.log(1 / alpha) + 0.5 * math.log((v + t2) / v)))
    return SequentialTest(estimate, v, margin, alpha, ratio, estimate - half, estimate + half)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float] | None:
    """The Wilson score interval of the share ``successes / n``; None when ``n`` is 0.

    It stays within [0, 1] and keeps a width at 0 or n successes (20 of 20 matched is not certainty).
    """
    if n <= 0:
        return None
    z = _NORMAL.inv_cdf(0.5 + confidence / 2)
    p = successes / n
    z2n = z * z / n
    centre = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / n + z2n / (4 * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def leviathan_speedup(acceptance: float, k: int, cost_ratio: float) -> float:
    """(1 - a**(k+1)) / ((1 - a)(k c + 1)): expected walltime improvement (Leviathan et al. 2023)."""
    a = min(max(acceptance, 0.0), 1.0)
    tokens = k + 1.0 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * cost_ratio + 1)


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 1.0)
    return k + 1.0 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


# Draft/target cost ratio assumed per method when the caller gives none: an n-gram lookup and a
# suffix-tree lookup (on the CPU) are nearly free; a draft model costs a few percent of the target per token.
DEFAULT_COST_RATIO: dict[str, float] = {"ngram": 0.0, "draft_model": 0.1, "eagle": 0.05, "eagle3": 0.05,
                                        "mtp": 0.05, "suffix": 0.0}
