"""Batch-size buckets of the telemetry rollups: the one place they are defined.

A rollup row counts the requests of one batch-size *bucket*, stored as the
bucket's lower bound:

=========  ==============================
stored     batch sizes it holds
=========  ==============================
1          0 and 1 (0 only if a sidecar reports it; its in-flight count includes the request itself)
2          2
3          3-4
5          5-8
9          9-16
17         17-32
33         33-64
65         65 and more
=========  ==============================

Powers of two, because speculation stops paying somewhere between a handful
and a few dozen requests in flight, and policies cut there (``batch_size <= 4``).
Changing these bounds changes what old rollup rows mean: do it only with a
migration that rebuilds the rollups from the raw events.
"""

from __future__ import annotations

from bisect import bisect_right

# Lower bounds, ascending; the first one also takes batch size 0.
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 3, 5, 9, 17, 33, 65)


def _bucket(batch_size: int) -> int:
    if batch_size <= 1:
        return 1
    return BATCH_BUCKETS[bisect_right(BATCH_BUCKETS, batch_size) - 1]


# Sizes below the last bound, looked up rather than searched (ingest does this per event).
_SMALL = tuple(_bucket(size) for size in range(BATCH_BUCKETS[-1]))


def batch_bucket(batch_size: int) -> int:
    """The lower bound of the bucket holding ``batch_size``."""
    if 0 <= batch_size < len(_SMALL):
        return _SMALL[batch_size]
    return _bucket(batch_size)


def batch_bucket_label(lower: int) -> str:
    """``3`` -> ``"3-4"``, ``65`` -> ``"65+"``, ``1`` -> ``"1"``."""
    i = BATCH_BUCKETS.index(lower)
    if i == len(BATCH_BUCKETS) - 1:
        return f"{lower}+"
    upper = BATCH_BUCKETS[i + 1] - 1
    return str(lower) if upper == lower else f"{lower}-{upper}"
