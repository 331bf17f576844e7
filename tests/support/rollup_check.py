"""The rollups checked against the raw events they were built from, recomputed plainly (test_telemetry.py and
test_event_partitions.py share it)."""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from analysis.histogram import bucket_index
from analysis.rollup import COUNTERS, FLOAT_COUNTERS
from controlplane.models import TelemetryEventRecord, TelemetryRollup, TelemetryRollupHistogram

# The bucket table spelled out, independently of analysis.buckets.
EXPECTED_BATCH_BUCKET = [(0, 1, 1), (2, 2, 2), (3, 4, 3), (5, 8, 5), (9, 16, 9), (17, 32, 17), (33, 64, 33),
                         (65, 10**9, 65)]


def expected_bucket(size: int) -> int:
    return next(lower for lo, hi, lower in EXPECTED_BATCH_BUCKET if lo <= size <= hi)


def recompute_from_raw(engine: Engine) -> tuple[dict[tuple[Any, ...], dict[str, float]],
                                                dict[tuple[Any, ...], int]]:
    """Every rollup counter and histogram count, computed again from the raw events, plainly."""
    with engine.connect() as conn:
        rows = conn.execute(select(TelemetryEventRecord.__table__)).mappings().all()
    return recompute(rows)


def recompute(rows: Sequence[Mapping[Any, Any]]) -> tuple[dict[tuple[Any, ...], dict[str, float]],
                                                          dict[tuple[Any, ...], int]]:
    """Every rollup counter and histogram count of these events (``time`` a datetime), plainly."""
    counters: dict[tuple[Any, ...], dict[str, float]] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
    hist: dict[tuple[Any, ...], int] = defaultdict(int)
    for r in rows:
        t = r["time"].astimezone(dt.UTC)
        k0_band = not r["speculate"] and r["spec_draft_tokens"] is not None
        key = (t.replace(second=0, microsecond=0), r["policy"], r["revision"], r["route"], r["engine"],
               expected_bucket(r["batch_size"]), r["explored"], k0_band)
        c = counters[key]
        c["requests"] += 1
        c["ok"] += r["status"] == "ok"
        c["errors"] += r["status"] != "ok"
        c["client_disconnects"] += r["status"] == "client_disconnect"
        c["fallbacks"] += r["fallback"]
        c["retries"] += r["retries"]
        c["speculated"] += r["speculate"]
        c["structured_checked"] += r["structured_valid"] is not None
        c["structured_valid"] += r["structured_valid"] is True
        if r["spec_draft_tokens"] is not None and r["spec_accepted_tokens"] is not None:
            c["spec_reported"] += 1
            c["draft_tokens_sum"] += r["spec_draft_tokens"]
            c["accepted_tokens_sum"] += r["spec_accepted_tokens"]
        if r["spec_steps"] is not None:
            c["spec_steps_sum"] += r["spec_steps"]
            c["spec_steps_count"] += 1
        for name in ("prompt_tokens", "completion_tokens"):
            if r[name] is not None:
                c[f"{name}_sum"] += r[name]
                c[f"{name}_count"] += 1
        c["e2e_ms_sum"] += r["e2e_ms"]
        hist[(*key, "e2e", bucket_index(r["e2e_ms"]))] += 1
        if r["ttft_ms"] is not None:
            c["ttft_ms_sum"] += r["ttft_ms"]
            c["ttft_count"] += 1
            hist[(*key, "ttft", bucket_index(r["ttft_ms"]))] += 1
        if r["itl_ms"] is not None:
            c["itl_ms_sum"] += r["itl_ms"]
            c["itl_count"] += 1
            hist[(*key, "itl", bucket_index(r["itl_ms"]))] += 1
            if r["completion_tokens"] is not None:
                gaps = max(r["completion_tokens"] - 1, 0)
                c["itl_weighted_ms_sum"] += r["itl_ms"] * gaps
                c["itl_weighted_tokens"] += gaps
        c["shadow_compared"] += r["shadow_match"] is not None
        c["shadow_matched"] += r["shadow_match"] is True
        if r["shadow_first_diff"] is not None:
            c["shadow_first_diff_sum"] += r["shadow_first_diff"]
            c["shadow_first_diff_count"] += 1
        if r["structured_valid"] is not None and r["shadow_structured_valid"] is not None:
            c["shadow_structured_checked"] += 1
            c["shadow_structured_valid_served"] += r["structured_valid"] is True
            c["shadow_structured_valid_plain"] += r["shadow_structured_valid"] is True
        c["shadow_check_run"] += r["shadow_check_passed"] is not None
        c["shadow_check_failed"] += r["shadow_check_passed"] is False
    return dict(counters), dict(hist)


def assert_rollups_equal_raw(engine: Engine) -> int:
    """Rollups == recomputation from raw events (integers exactly, float sums to 1e-9); returns #rows."""
    return assert_rollups_equal(engine, recompute_from_raw(engine), raw_totals=True)


def assert_rollups_equal(engine: Engine, expected_rollups: tuple[dict[tuple[Any, ...], dict[str, float]],
                                                                 dict[tuple[Any, ...], int]],
                         *, raw_totals: bool = False) -> int:
    """The stored rollups == ``expected_rollups`` (:func:`recompute`'s); with ``raw_totals`` also, in plain
    SQL, that the totals over all rollup rows equal those over all raw rows. Returns #rows."""
    expected, expected_hist = expected_rollups
    key_cols = ("minute", "policy", "revision", "route", "engine", "batch_bucket", "explored", "k0")
    with engine.connect() as conn:
        rows = conn.execute(select(TelemetryRollup.__table__)).mappings().all()
        hist_rows = conn.execute(
            select(*(TelemetryRollup.__table__.c[k] for k in key_cols), TelemetryRollupHistogram.metric,
                   TelemetryRollupHistogram.bucket, TelemetryRollupHistogram.count)
            .join(TelemetryRollup, TelemetryRollup.id == TelemetryRollupHistogram.rollup_id)).all()
        # And in plain SQL: totals over all rollup rows equal totals over all raw rows.
        raw_sums = conn.execute(select(func.count(), func.sum(TelemetryEventRecord.retries),
                                       func.sum(TelemetryEventRecord.e2e_ms))).one()
        rollup_sums = conn.execute(select(func.sum(TelemetryRollup.requests), func.sum(TelemetryRollup.retries),
                                            func.sum(TelemetryRollup.e2e_ms_sum))).one()
    actual = {tuple(r[k] for k in key_cols): r for r in rows}
    assert set(actual) == set(expected)
    for key, want in expected.items():
        got = actual[key]
        for name in COUNTERS:
            if name in FLOAT_COUNTERS:
                assert math.isclose(got[name], want[name], rel_tol=1e-9, abs_tol=1e-6), (key, name)
            else:
                assert got[name] == want[name], (key, name, got[name], want[name])
    assert {tuple(r[:-1]): r[-1] for r in hist_rows} == expected_hist
    if raw_totals:
        assert raw_sums[0] == (rollup_sums[0] or 0)
        assert (raw_sums[1] or 0) == (rollup_sums[1] or 0)
        assert math.isclose(raw_sums[2] or 0.0, rollup_sums[2] or 0.0, rel_tol=1e-9)
    return len(rows)
