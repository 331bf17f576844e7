"""Cohorts of synthetic requests for the analysis tests: lognormal latencies around given medians."""

from __future__ import annotations

import math
import random

from analysis.cells import Cohort
from analysis.histogram import bucket_index


def requests(rng: random.Random, n: int, *, itl: float, e2e: float, ttft: float = 40.0,
             sigma: float = 0.2) -> Cohort:
    """``n`` requests whose ITL, e2e and TTFT are lognormal around the given medians."""
    c = Cohort()
    for _ in range(n):
        values = {"itl": itl * math.exp(rng.gauss(0, sigma)), "e2e": e2e * math.exp(rng.gauss(0, sigma)),
                  "ttft": ttft * math.exp(rng.gauss(0, sigma))}
        c.requests += 1
        c.itl_count += 1
        c.itl_ms_sum += values["itl"]
        c.e2e_ms_sum += values["e2e"]
        for metric, value in values.items():
            hist: dict[int, int] = getattr(c, metric)
            hist[bucket_index(value)] = hist.get(bucket_index(value), 0) + 1
    return c
