"""Smoke test of the analysis benchmark (bench/analysis.py): it runs end to end at a tiny size; no timings."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from tests.support import paths

# bench/ is not an installed package: make the repository root importable.
_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
analysis = importlib.import_module("bench.analysis")


def test_a_tiny_run_stores_measures_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "analysis.json"
    report = analysis.main(["--database", "sqlite", "--events", "3000", "--minutes", "30", "--repeat", "1",
                            "--json", str(out)])
    assert report["goal_s"] == analysis.GOAL_S
    (result,) = report["results"]
    assert (result["database"], result["events"], result["minutes"]) == ("sqlite", 3000, 30)
    assert result["load_s"] > 0
    # Every event is stored; each of the 30 minutes holds events (one every 0.6 s), a per-minute rollup
    # row at least one of them, and every event carries latencies (so every rollup has histogram rows).
    assert result["rows"]["events"] == 3000
    assert 30 <= result["rows"]["rollups"] <= 3000
    assert result["rows"]["histogram_rows"] >= result["rows"]["rollups"]
    for op in ("summary", "summary_hourly", "recommendations", "what_if"):
        # one repeat: one timing, which is both the median and the best
        assert result[op]["median_s"] == result[op]["best_s"] > 0, op
    assert result["goal_met"] == (result["summary"]["median_s"] < analysis.GOAL_S
                                  and result["recommendations"]["median_s"] < analysis.GOAL_S)
    assert json.loads(out.read_text()) == report
