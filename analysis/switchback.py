"""Whole-worker switchback comparisons: what clients felt under the policy against its explored windows. Pure.

With ``exploration.window_s`` a policy's exploration is by time: every request
of an explored window gets the other decision, on every worker at once. The
engines then run under one regime per window, so what one engine's work costs
the engines it shares CPUs, memory bandwidth or a GPU with is inside the
measurement — which a per-request comparison (inter-token latency of the
speculative requests against the plain ones running beside them) cannot see.

The unit of the comparison is therefore a stretch of time, not a request.
The rollups give, per minute, the policy's requests and the explored ones
(:class:`Period`, with the seconds of that minute its windows covered). A
*pair* is one explored stretch against the policy's requests closest in time:
with windows under a minute, a minute holding explored requests against the
policy's requests of that same minute (else of the minutes beside it); with
longer windows, a run of consecutive explored minutes (one window, or
adjacent ones) against the policy minutes within one window length before
and after it. Adjacent stretches see the same clients (a load generator's
concurrency or a day's traffic changes slowly next to a window), which is
what makes the arms comparable at equal offered load; each pair's log ratio
is one observation, and the interval is Student's over the pairs. Two
explored stretches may share a policy neighbour, so their pairs are not
wholly independent; windows under a minute (both arms in one minute) avoid
that.

The verdict reads five measures at once, so each interval is at Bonferroni's
level (``1 - (1 - confidence) / 5``). Every ratio is oriented as *the policy's advantage*: above 1 the policy's
windows were better for clients (latency lower, or throughput higher).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import fmean, stdev
from typing import Any

from analysis.cells import Cohort
from analysis.stats import RatioEstimate, t_quantile

INSUFFICIENT = "insufficient evidence"
POLICY_BETTER = "policy better"
EXPLORED_BETTER = "explored better"
MIXED = "mixed"
NO_DIFFERENCE = "no clear difference"


@dataclass(slots=True)
class Period:
    """One arm (the policy's decisions, or the explored ones) over one minute of the fleet."""

    start: dt.datetime
    explored: bool
    exposure_s: float  # seconds of the minute that the arm's windows covered
    cohort: Cohort = field(default_factory=Cohort)
    speculated: int = 0
    completion_tokens: int = 0

    def merge(self, other: Period) -> Period:
        self.exposure_s += other.exposure_s
        self.cohort.add(other.cohort)
        self.speculated += other.speculated
        self.completion_tokens += other.completion_tokens
        return self


def _log_mean(metric: str) -> Callable[[Period], float | None]:
    def read(p: Period) -> float | None:
        m = p.cohort.moments(metric)
        return None if m is None else math.exp(m.mean)
    return read


def _quantile(metric: str, q: float) -> Callable[[Period], float | None]:
    def read(p: Period) -> float | None:
        value = p.cohort.quantile(metric, q)
        return value if value is not None and value > 0 else None
    return read


def _requests_per_s(p: Period) -> float | None:
    return p.cohort.requests / p.exposure_s if p.exposure_s > 0 and p.cohort.requests else None


def _tokens_per_s(p: Period) -> float | None:
    """Output tokens per second of a request's life (total tokens over total end-to-end time)."""
    return p.completion_tokens / (p.cohort.e2e_ms_sum / 1000) if p.cohort.e2e_ms_sum > 0 and p.completion_tokens \
        else None


@dataclass(frozen=True, slots=True)
class Measure:
    name: str
    label: str
    read: Callable[[Period], float | None]
    lower_is_better: bool


# In the order they decide: a client's end-to-end latency first (its typical value, then its tail),
# then what the worker completes per second of offered load, then the first token and the token rate.
MEASURES: tuple[Measure, ...] = (
    Measure("e2e", "end-to-end latency (geometric mean)", _log_mean("e2e"), True),
    Measure("e2e_p95", "end-to-end latency p95", _quantile("e2e", 0.95), True),
    Measure("requests_per_s", "completed requests per second", _requests_per_s, False),
    Measure("ttft", "time to first token (geometric mean)", _log_mean("ttft"), True),
    Measure("tokens_per_s", "output tokens per second per request", _tokens_per_s, False),
)


@dataclass(frozen=True, slots=True)
class SwitchbackConfig:
    confidence: float = 0.95
    min_pairs: int = 4
    min_requests: int = 5  # per arm of a pair: fewer and its figures are noise
    min_exposure_s: float = 5.0  # per arm of a pair: its requests per second need time to count


@dataclass(slots=True)
class SwitchbackResult:
    window_s: float
    pairs: int
    estimates: dict[str, RatioEstimate | None]
    arms: dict[str, Period]
    verdict: str
    driver: str | None  # the measure that decided the verdict
    confidence: float

    @property
    def speculated_share(self) -> dict[str, float | None]:
        return {name: (p.speculated / p.cohort.requests if p.cohort.requests else None)
                for name, p in self.arms.items()}

    @property
    def policy_speculates_more(self) -> bool:
        share = self.speculated_share
        return (share["policy"] or 0.0) > (share["explored"] or 0.0)

    def to_dict(self) -> dict[str, Any]:
        def arm(p: Period) -> dict[str, Any]:
            c = p.cohort
            return {"requests": c.requests, "exposure_s": round(p.exposure_s, 3),
                    "requests_per_s": _requests_per_s(p), "speculated": p.speculated,
                    "e2e_ms": {"p50": c.quantile("e2e", 0.5), "p95": c.quantile("e2e", 0.95)},
                    "ttft_ms": {"p50": c.quantile("ttft", 0.5), "p95": c.quantile("ttft", 0.95)},
                    "itl_ms": {"p50": c.quantile("itl", 0.5)}, "tokens_per_s": _tokens_per_s(p),
                    "error_rate": c.error_rate}

        return {"window_s": self.window_s, "pairs": self.pairs, "verdict": self.verdict, "driver": self.driver,
                "confidence": self.confidence,
                "orientation": "policy advantage: above 1 the policy's windows were better for clients",
                "estimates": {name: None if e is None else
                              {"ratio": round(e.ratio, 4), "low": round(e.low, 4), "high": round(e.high, 4)}
                              for name, e in self.estimates.items()},
                "arms": {name: arm(p) for name, p in self.arms.items()},
                "speculated_share": self.speculated_share}


MINUTE = dt.timedelta(minutes=1)


def _pairs(periods: Sequence[Period], window_s: float, cfg: SwitchbackConfig) -> list[tuple[Period, Period]]:
    """(policy, explored) pairs, one per explored stretch (see the module doc).

    Windows shorter than a minute: each minute with explored requests is a stretch, against the policy's
    requests of the same minute (else of the minutes beside it). A minute or longer: a stretch is a run of
    consecutive minutes with explored requests (one explored window, or adjacent ones), against the policy's
    requests within one window length before and after it; counting its minutes as pairs would count one
    window several times.
    """
    by_minute: dict[dt.datetime, dict[bool, Period]] = {}
    for p in periods:
        slot = by_minute.setdefault(p.start, {})
        slot[p.explored] = Period(p.start, p.explored, 0.0).merge(p) if p.explored not in slot \
            else slot[p.explored].merge(p)

    def enough(p: Period | None) -> bool:
        return p is not None and p.cohort.requests >= cfg.min_requests and p.exposure_s >= cfg.min_exposure_s

    def policy_between(first: dt.datetime, last: dt.datetime) -> Period:
        baseline = Period(first, False, 0.0)
        minute = first
        while minute <= last:
            arm = by_minute.get(minute, {}).get(False)
            if arm is not None:
                baseline.merge(arm)
            minute += MINUTE
        return baseline

    reach = MINUTE * max(1, math.ceil(window_s / 60))
    explored_minutes = sorted(m for m, arms in by_minute.items() if True in arms)
    if window_s < 60:
        stretches = [[m] for m in explored_minutes]
    else:
        stretches = []
        for minute in explored_minutes:
            if stretches and minute - stretches[-1][-1] == MINUTE:
                stretches[-1].append(minute)
            else:
                stretches.append([minute])
    out = []
    for stretch in stretches:
        explored = Period(stretch[0], True, 0.0)
        for minute in stretch:
            explored.merge(by_minute[minute][True])
        if not enough(explored):
            continue
        same = by_minute[stretch[0]].get(False) if window_s < 60 else None
        baseline = same if enough(same) else policy_between(stretch[0] - reach, stretch[-1] + reach)
        assert baseline is not None
        if enough(baseline):
            out.append((baseline, explored))
    return out


def _estimate(pairs: Sequence[tuple[Period, Period]], measure: Measure, confidence: float) -> RatioEstimate | None:
    logs = []
    for policy, explored in pairs:
        a, b = measure.read(policy), measure.read(explored)
        if a is None or b is None or a <= 0 or b <= 0:
            continue
        logs.append(math.log(b / a) if measure.lower_is_better else math.log(a / b))
    if len(logs) < 2:
        return None
    mean = fmean(logs)
    se = stdev(logs) / math.sqrt(len(logs))
    t = t_quantile(0.5 + confidence / 2, len(logs) - 1)
    return RatioEstimate(math.exp(mean), math.exp(mean - t * se), math.exp(mean + t * se), len(logs), len(logs),
                         confidence)


def compare(periods: Sequence[Period], window_s: float, cfg: SwitchbackConfig | None = None) -> SwitchbackResult:
    """The policy's windows against the explored ones, paired in time (see the module doc)."""
    cfg = cfg or SwitchbackConfig()
    arms = {"policy": Period(dt.datetime.min, False, 0.0), "explored": Period(dt.datetime.min, True, 0.0)}
    for p in periods:
        arms["explored" if p.explored else "policy"].merge(p)
    pairs = _pairs(periods, window_s, cfg)
    # Five measures looked at together: each interval at Bonferroni's level, so that arms that do not differ
    # are called different with probability at most 1 - confidence.
    each = 1 - (1 - cfg.confidence) / len(MEASURES)
    estimates = {m.name: _estimate(pairs, m, each) for m in MEASURES}
    if len(pairs) < cfg.min_pairs:
        return SwitchbackResult(window_s, len(pairs), estimates, arms, INSUFFICIENT, None, cfg.confidence)
    worse = [m.name for m in MEASURES if (e := estimates[m.name]) is not None and e.below_one]
    better = [m.name for m in MEASURES if (e := estimates[m.name]) is not None and e.above_one]
    if worse and better:
        verdict, driver = MIXED, worse[0]
    elif worse:
        verdict, driver = EXPLORED_BETTER, worse[0]
    elif better:
        verdict, driver = POLICY_BETTER, better[0]
    else:
        verdict, driver = NO_DIFFERENCE, None
    return SwitchbackResult(window_s, len(pairs), estimates, arms, verdict, driver, cfg.confidence)


def window_exposure(minute: dt.datetime, window_s: float, explored: Callable[[int], bool]) -> tuple[float, float]:
    """Seconds of the minute starting at ``minute`` in the policy's windows and in the explored ones.

    ``explored(index)`` says whether window ``floor(t / window_s)`` is explored (the policy's sticky hash).
    """
    start = minute.timestamp()
    end = start + 60.0
    policy = explored_s = 0.0
    index = math.floor(start / window_s)
    while index * window_s < end:
        lo, hi = max(start, index * window_s), min(end, (index + 1) * window_s)
        if hi > lo:
            if explored(index):
                explored_s += hi - lo
            else:
                policy += hi - lo
        index += 1
    return policy, explored_s
