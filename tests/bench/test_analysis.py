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
    (result,) = report["results"]
    assert result["database"] == "sqlite"
    assert result["rows"]["events"] == 3000
    assert 0 < result["rows"]["rollups"] <= 3000
    assert result["rows"]["histogram_rows"] >= result["rows"]["rollups"]
    for op in ("summary", "summary_hourly", "recommendations", "what_if"):
        assert result[op]["best_s"] <= result[op]["median_s"]
    assert isinstance(result["goal_met"], bool)
    assert json.loads(out.read_text())["results"][0]["rows"] == result["rows"]
