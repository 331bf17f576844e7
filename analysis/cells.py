"""Per-bucket statistics: the one input of speedup estimates, recommendations and the what-if.

A :class:`Cohort` is a set of requests reduced to what the rollups keep
(counters and latency histograms); a :class:`Cell` is one route and one
batch-size bucket with its speculative and its plain cohort. Both are plain
data with ``to_dict``/``from_dict``, so the recommender can be fed recorded
statistics from a file as well as from the database.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from analysis.histogram import quantile
from analysis.rollup import SHADOW_COUNTERS
from analysis.stats import LogMoments, RatioEstimate, log_moments, welch_ratio

# How much more often clients may go away on one arm than on the other before that arm's latencies stop
# being evidence that it is faster: one percentage point, with confidence (see more_disconnects). A client
# that gives up on a slow answer takes its slow tail out of the arm's inter-token latencies (and cuts its
# e2e short), so an arm that loses more clients looks faster than it was.
DISCONNECT_MARGIN = 0.01


def _hist(data: Mapping[Any, Any] | None) -> dict[int, int]:
    return {int(k): int(v) for k, v in (data or {}).items() if int(v) > 0}


@dataclass(slots=True)
class Cohort:
    """Counters and histograms of a set of requests (the rollup counters that the analysis reads)."""

    requests: int = 0
    errors: int = 0
    client_disconnects: int = 0
    retries: int = 0
    fallbacks: int = 0
    structured_checked: int = 0
    structured_valid: int = 0
    spec_reported: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    spec_steps_sum: int = 0
    itl_ms_sum: float = 0.0
    itl_count: int = 0
    e2e_ms_sum: float = 0.0
    # shadow comparisons (the policy's ``quality``): the plain engine's answer to the same greedy request
    shadow_compared: int = 0
    shadow_matched: int = 0
    shadow_first_diff_sum: int = 0
    shadow_first_diff_count: int = 0
    shadow_structured_checked: int = 0
    shadow_structured_valid_served: int = 0
    shadow_structured_valid_plain: int = 0
    shadow_check_run: int = 0
    shadow_check_failed: int = 0
    itl: dict[int, int] = field(default_factory=dict)
    e2e: dict[int, int] = field(default_factory=dict)
    ttft: dict[int, int] = field(default_factory=dict)

    _SCALARS = ("requests", "errors", "client_disconnects", "retries", "fallbacks", "structured_checked",
                "structured_valid", "spec_reported", "draft_tokens", "accepted_tokens", "spec_steps_sum", "itl_ms_sum",
                "itl_count", "e2e_ms_sum", *SHADOW_COUNTERS)

    @classmethod
    def from_rollup(cls, counters: Mapping[str, Any], histograms: Mapping[str, Mapping[int, int]]) -> Cohort:
        return cls(
            requests=int(counters["requests"]), errors=int(counters["errors"]),
            client_disconnects=int(counters.get("client_disconnects", 0)), retries=int(counters["retries"]),
            fallbacks=int(counters["fallbacks"]), structured_checked=int(counters["structured_checked"]),
            structured_valid=int(counters["structured_valid"]), spec_reported=int(counters["spec_reported"]),
            draft_tokens=int(counters["draft_tokens_sum"]), accepted_tokens=int(counters["accepted_tokens_sum"]),
            spec_steps_sum=int(counters["spec_steps_sum"]), itl_ms_sum=float(counters["itl_ms_sum"]),
            itl_count=int(counters["itl_count"]), e2e_ms_sum=float(counters["e2e_ms_sum"]),
            itl=dict(histograms.get("itl", {})), e2e=dict(histograms.get("e2e", {})),
            ttft=dict(histograms.get("ttft", {})),
            # counters recorded before shadow comparisons have none: nothing was compared
            **{name: int(counters.get(name, 0)) for name in SHADOW_COUNTERS})

    def add(self, other: Cohort) -> Cohort:
        for name in self._SCALARS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for metric in ("itl", "e2e", "ttft"):
            mine: dict[int, int] = getattr(self, metric)
            for bucket, count in getattr(other, metric).items():
                mine[bucket] = mine.get(bucket, 0) + count
        return self

    # -- derived figures ------------------------------------------------------------------------

    @staticmethod
    def _ratio(num: float, den: float) -> float | None:
        return num / den if den else None

    @property
    def acceptance_rate(self) -> float | None:
        return self._ratio(self.accepted_tokens, self.draft_tokens)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per target step: 1 + accepted / steps (vLLM's definition)."""
        return None if not self.spec_steps_sum else 1 + self.accepted_tokens / self.spec_steps_sum

    @property
    def retry_rate(self) -> float | None:
        return self._ratio(self.retries, self.requests)

    @property
    def fallback_rate(self) -> float | None:
        return self._ratio(self.fallbacks, self.requests)

    @property
    def error_rate(self) -> float | None:
        return self._ratio(self.errors, self.requests)

    @property
    def client_disconnect_rate(self) -> float | None:
        """Requests whose client went away before the answer was complete, per request."""
        return self._ratio(self.client_disconnects, self.requests)

    @property
    def structured_validity(self) -> float | None:
        return self._ratio(self.structured_valid, self.structured_checked)

    @property
    def shadow_match_rate(self) -> float | None:
        """Shadow comparisons whose two answers matched, per comparison."""
        return self._ratio(self.shadow_matched, self.shadow_compared)

    @property
    def shadow_first_diff_mean(self) -> float | None:
        """Output tokens the two answers shared before they first differed, on average over the differing
        comparisons that counted them."""
        return self._ratio(self.shadow_first_diff_sum, self.shadow_first_diff_count)

    @property
    def itl_mean(self) -> float | None:
        return self._ratio(self.itl_ms_sum, self.itl_count)

    @property
    def e2e_mean(self) -> float | None:
        return self._ratio(self.e2e_ms_sum, self.requests)

    def quantile(self, metric: str, q: float) -> float | None:
        return quantile(getattr(self, metric), q)

    def moments(self, metric: str) -> LogMoments | None:
        return log_moments(getattr(self, metric))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in self._SCALARS}
        for metric in ("itl", "e2e", "ttft"):
            out[metric] = {str(k): v for k, v in sorted(getattr(self, metric).items())}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cohort:
        kwargs: dict[str, Any] = {}
        for name in cls._SCALARS:
            value = data.get(name, 0)
            kwargs[name] = float(value) if name.endswith("_sum") and "ms" in name else int(value)
        return cls(**kwargs, itl=_hist(data.get("itl")), e2e=_hist(data.get("e2e")), ttft=_hist(data.get("ttft")))


def disconnect_excess(arm: Cohort, other: Cohort, confidence: float) -> tuple[float, float] | None:
    """``arm``'s client-disconnect rate minus ``other``'s, and the lower end of its two-sided interval.

    Binomial variance, floored at one request's worth so that a cohort with no disconnect is not certain
    of it; None when a cohort is empty.
    """
    if arm.requests == 0 or other.requests == 0:
        return None
    ra, ro = arm.client_disconnects / arm.requests, other.client_disconnects / other.requests
    se = math.sqrt(max(ra * (1 - ra), 1 / arm.requests) / arm.requests
                   + max(ro * (1 - ro), 1 / other.requests) / other.requests)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    return ra - ro, ra - ro - z * se


def more_disconnects(arm: Cohort, other: Cohort, confidence: float) -> bool:
    """Whether clients left ``arm`` markedly more often than ``other``: by more than DISCONNECT_MARGIN,
    with confidence. Then ``arm`` is never called the faster one."""
    excess = disconnect_excess(arm, other, confidence)
    return excess is not None and excess[1] > DISCONNECT_MARGIN


@dataclass(slots=True)
class Cell:
    """One route and batch-size bucket: the speculative cohort against the plain one.

    ``source`` says how the cohorts were chosen: ``holdout`` (the policy's
    decision against its explored alternative: a randomized comparison),
    ``rollout`` (a rollout's two revisions over the same window) or
    ``observational`` (every speculative request against every plain one:
    the rules chose who got what, so it may be confounded).
    ``engines`` holds the speculative cohort split by engine (method
    comparisons); ``k`` and ``method`` describe the speculative engine seen most.
    ``k0`` holds the requests an in-engine-scheduled engine (``k0_engine``, the
    one seen most) ran at K=0 throughout: in neither cohort, they are what the
    K=0 tax compares with the plain cohort (:meth:`k0_tax`).
    """

    route: str
    batch_bucket: int
    speculative: Cohort
    plain: Cohort
    source: str = "observational"
    engine: str | None = None
    method: str | None = None
    k: int | None = None
    engines: dict[str, Cohort] = field(default_factory=dict)
    k0: Cohort = field(default_factory=Cohort)
    k0_engine: str | None = None

    def speedup(self, metric: str, confidence: float) -> RatioEstimate | None:
        """plain / speculative latency (geometric means): above 1 means speculation is faster."""
        plain, spec = self.plain.moments(metric), self.speculative.moments(metric)
        if plain is None or spec is None:
            return None
        return welch_ratio(plain, spec, confidence)

    def k0_tax(self, metric: str, confidence: float) -> RatioEstimate | None:
        """K=0 / plain latency (geometric means): above 1 means the K=0 steps cost more than not speculating."""
        k0, plain = self.k0.moments(metric), self.plain.moments(metric)
        if k0 is None or plain is None:
            return None
        return welch_ratio(k0, plain, confidence)

    def to_dict(self) -> dict[str, Any]:
        return {"route": self.route, "batch_bucket": self.batch_bucket, "source": self.source,
                "engine": self.engine, "method": self.method, "k": self.k,
                "speculative": self.speculative.to_dict(), "plain": self.plain.to_dict(),
                "engines": {name: c.to_dict() for name, c in sorted(self.engines.items())},
                "k0": self.k0.to_dict(), "k0_engine": self.k0_engine}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cell:
        return cls(route=str(data["route"]), batch_bucket=int(data["batch_bucket"]),
                   speculative=Cohort.from_dict(data.get("speculative", {})),
                   plain=Cohort.from_dict(data.get("plain", {})), source=str(data.get("source", "observational")),
                   engine=data.get("engine"), method=data.get("method"),
                   k=None if data.get("k") is None else int(data["k"]),
                   engines={str(k): Cohort.from_dict(v) for k, v in (data.get("engines") or {}).items()},
                   k0=Cohort.from_dict(data.get("k0") or {}), k0_engine=data.get("k0_engine"))
