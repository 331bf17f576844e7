"""Fixed log-spaced latency histograms: the bucket edges every rollup row shares.

Every latency histogram (``ttft``, ``itl``, ``e2e``, in milliseconds) has the
same :data:`NUM_BUCKETS` = 48 buckets, so histograms merge by adding counts
bucket by bucket (in SQL: ``count = count + excluded.count``), on any database,
in any order, with no loss.

Edges: ``EDGES[k] = 0.1 * 1.35**k`` ms for k = 0..46, i.e. 0.1 ms to about
98.9 s. Bucket 0 holds [0, 0.1) ms, bucket i (1..46) holds
[EDGES[i-1], EDGES[i]), bucket 47 holds [98.9 s, infinity). A bucket is 35 %
wide, so a quantile read from a histogram is within one bucket (at most 35 %
relative error) of the exact value.

Changing the edges changes what stored counts mean: do it only with a
migration that rebuilds the histograms from the raw events.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping

from wire.telemetry import HISTOGRAM_BUCKETS, HISTOGRAM_METRICS

LOWEST_MS = 0.1
FACTOR = 1.35
# The wire contract's: a pre-aggregating worker sends its histograms in these buckets.
NUM_BUCKETS = HISTOGRAM_BUCKETS
# NUM_BUCKETS - 1 edges separate NUM_BUCKETS buckets.
EDGES: tuple[float, ...] = tuple(LOWEST_MS * FACTOR**k for k in range(NUM_BUCKETS - 1))
METRICS: tuple[str, ...] = HISTOGRAM_METRICS


def bucket_index(value: float) -> int:
    """The bucket (0..47) holding a latency in milliseconds; negative values count as 0."""
    return bisect_right(EDGES, value)


def bucket_bounds(index: int) -> tuple[float, float]:
    """[lower, upper) of a bucket; the last bucket's upper bound is ``inf``."""
    if not 0 <= index < NUM_BUCKETS:
        raise ValueError(f"bucket {index} is not in 0..{NUM_BUCKETS - 1}")
    lower = 0.0 if index == 0 else EDGES[index - 1]
    upper = math.inf if index == NUM_BUCKETS - 1 else EDGES[index]
    return lower, upper


def quantile(counts: Mapping[int, int], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) of a histogram ``{bucket: count}``, interpolated.

    The rank ``q * total`` is located in its bucket and the value is
    interpolated linearly between the bucket's bounds by the fraction of the
    bucket's count below that rank. The open last bucket answers its lower
    bound. ``None`` for an empty histogram.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    total = sum(c for c in counts.values() if c > 0)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    last = max(b for b, c in counts.items() if c > 0)
    for index in sorted(counts):
        count = counts[index]
        if count <= 0:
            continue
        if seen + count >= rank or index == last:
            lower, upper = bucket_bounds(index)
            if math.isinf(upper):
                return lower
            fraction = min(max((rank - seen) / count, 0.0), 1.0)
            return lower + (upper - lower) * fraction
        seen += count
    raise AssertionError("unreachable: the last non-empty bucket always answers")
