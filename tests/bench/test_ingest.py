"""Smoke test of the telemetry ingest benchmark (bench/ingest.py): correctness only, never timings."""

from __future__ import annotations

import gzip
import importlib
import json
import sys
import time
from pathlib import Path

import pytest

from controlplane.telemetry.schemas import ValidBatch
from tests.support import paths

# bench/ is not an installed package: make the repository root importable.
_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
ingest = importlib.import_module("bench.ingest")


def test_prepared_batches_are_valid_unique_and_varied() -> None:
    now = time.time()
    batches = [ValidBatch.model_validate_json(gzip.decompress(ingest.make_body(("run", i, 200, 7, now))))
               for i in range(3)]
    events = [e for b in batches for e in b.events]
    assert len(events) == 600
    assert len({e.event_id for e in events}) == 600
    assert len({b.batch_id for b in batches}) == 3
    assert {e.route for e in events} == {"chat", "code", "summarize", "agent", "extract"}
    assert {e.engine for e in events} == {"base", "draft", "ngram"}
    assert any(e.explored for e in events)
    assert any(e.status != "ok" for e in events)
    for e in events:
        assert (e.spec_draft_tokens is not None) == (e.engine != "base")
        if e.spec_draft_tokens is not None:
            assert e.spec_accepted_tokens is not None
            assert 0 <= e.spec_accepted_tokens <= e.spec_draft_tokens
    # Same arguments, same batch: a run can be repeated.
    assert ingest.make_body(("run", 1, 200, 7, now)) == ingest.make_body(("run", 1, 200, 7, now))


def test_a_tiny_run_stores_every_event_sent_once(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    report = ingest.main(["--database", "sqlite", "--senders", "2", "--seconds", "1.5", "--batch-size", "50",
                          "--supply-rate", "4000", "--json", str(out)])
    (result,) = report["results"]
    assert result["database"] == "sqlite"
    assert result["failure_count"] == 0
    assert result["events_sent"] > 0
    assert result["events_sent"] == result["batches"] * 50
    assert result["events_stored"] == result["events_sent"]
    check = result["verify"]
    assert check["ok"] is True
    assert check["events_in_db"] == check["events_in_rollups"] == result["events_sent"]
    assert check["batch_records"] == result["batches"]
    # the rates are the stored counts over the elapsed time it reports, and every batch's latency was measured
    assert result["events_per_s"] == pytest.approx(result["events_stored"] / result["elapsed_s"], rel=1e-2)
    assert result["batches_per_s"] == pytest.approx(result["batches"] / result["elapsed_s"], rel=1e-2)
    assert result["events_per_s"] > 0
    assert result["latency_ms"]["p50"] > 0
    assert json.loads(out.read_text())["results"][0]["events_stored"] == result["events_stored"]
    assert report["goal"]["met"] is None  # no PostgreSQL in this run


def test_compare_runs_each_path_alternately_on_a_fresh_database_and_reports_the_ratio() -> None:
    report = ingest.main(["--database", "sqlite", "--senders", "1", "--seconds", "0.5", "--batch-size", "20",
                          "--supply-rate", "400", "--compare", "copy,generic", "--rounds", "1"])
    assert [r["ingest_path"] for r in report["results"]] == ["copy", "generic"]
    assert len({r["run"] for r in report["results"]}) == 2
    assert all(r["verify"]["ok"] and r["events_stored"] > 0 for r in report["results"])
    summary = report["comparison"]["sqlite"]
    assert summary["copy"]["vs"] == "generic"
    for path in ("copy", "generic"):
        us = summary[path]["cpu_us_per_event"]
        assert us["postgres"] is None  # SQLite: the control plane's CPU only
        assert us["sum"] == us["control_plane"] > 0
    assert summary["copy"]["ratio"] == pytest.approx(summary["generic"]["cpu_us_per_event"]["sum"]
                                                     / summary["copy"]["cpu_us_per_event"]["sum"], rel=0.02)
    assert "cpu_ratio_copy_vs_json" not in report["goal"]  # only a PostgreSQL comparison of copy with json


def test_the_path_switches_parse() -> None:
    assert ingest.parse_args([]).ingest_path == "copy"
    assert ingest.parse_args(["--generic-insert"]).ingest_path == "generic"
    assert ingest.parse_args(["--ingest-path", "json"]).ingest_path == "json"
    assert ingest.parse_args(["--compare", "copy,json"]).compare == ["copy", "json"]
    for bad in ("copy", "copy,copy", "copy,bulk"):
        with pytest.raises(SystemExit):
            ingest.parse_args(["--compare", bad])
