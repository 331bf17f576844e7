"""Smoke test of the fleet simulation (bench/fleet.py) against PostgreSQL: correctness only, never timings.

20 simulated sidecars for an 8-second window with 2 publishes: the report
must be complete, every worker must reach every publish's ETag, every event
the control plane acknowledged must be in the database once (and in the
rollups), and the CPU and growth figures must have been measured.

Then a few pre-aggregating sidecars (``mode="deltas"``) for a few seconds:
the rollups must count exactly the requests the workers represented, every
delta the control plane acknowledged must be recorded once, and the stored
events must be the sampled ones only.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.support import paths

# bench/ is not an installed package: make the repository root importable.
_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
fleet = importlib.import_module("bench.fleet")

PG_ADMIN_URL = os.environ.get("SPECGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    config = fleet.FleetConfig(workers=20, seconds=8.0, publishes=2, warmup_s=2.0, setup_timeout_s=120.0,
                               publish_timeout_s=30.0, drain_timeout_s=60.0)
    result: dict[str, Any] = fleet.run(config, PG_ADMIN_URL)
    return result


def test_the_report_has_every_section(report: dict[str, Any]) -> None:
    assert "aborted" not in report, report.get("aborted")
    for key in ("config", "machine", "environment", "window_s", "propagation", "telemetry", "cpu", "storage",
                "requests_in_window", "refusals_in_window", "client", "verify"):
        assert key in report, key
    assert report["config"]["workers"] == 20
    assert report["machine"]["nproc"] >= 1
    assert report["window_s"] > 0
    assert set(report["storage"]["growth_bytes"]) == set(fleet.TELEMETRY_TABLES)
    assert "20 workers, mode raw" in fleet.render(report)


def test_every_worker_reaches_every_publish(report: dict[str, Any]) -> None:
    propagation = report["propagation"]
    assert propagation["every_worker_every_publish"], propagation["publishes"]
    assert [r["action"] for r in propagation["publishes"]] == ["killswitch on", "rollback to B"]
    for r in propagation["publishes"]:
        assert r["error"] is None
        assert r["converged_workers"] == 20
        assert r["all_s"] is not None
        assert r["all_s"] > 0
    assert len({r["etag"] for r in propagation["publishes"]}) == 2
    assert propagation["all_s"]["n"] == 2
    assert propagation["unexpected_etags"] == 0


def test_every_acknowledged_event_is_stored_once(report: dict[str, Any]) -> None:
    check = report["verify"]
    assert check["ok"], check
    assert check["events_in_db"] > 0
    assert check["events_in_db"] == check["events_acked_stored"] == check["distinct_event_ids"]
    assert check["events_in_rollups"] == check["events_in_db"]
    assert check["batch_records"] == check["batches_acked"]
    assert report["telemetry"]["drained"]


def test_cpu_and_growth_are_measured(report: dict[str, Any]) -> None:
    cpu, storage = report["cpu"], report["storage"]
    assert cpu["control_plane_s"] > 0
    assert cpu["postgres_s"] > 0
    assert cpu["per_1000_requests"]["control_plane_s"] > 0
    assert cpu["per_1000_requests"]["postgres_s"] > 0
    assert storage["growth_bytes_total"] > 0
    assert storage["bytes_per_million_requests"]["total"] > 0
    assert report["telemetry"]["stored_events_per_s"] > 0
    assert report["telemetry"]["offered_requests_per_s"] == 40


def test_the_throw_away_database_is_gone(report: dict[str, Any]) -> None:
    engine = create_engine(PG_ADMIN_URL)
    try:
        with engine.connect() as conn:
            left = conn.execute(text("SELECT count(*) FROM pg_database WHERE datname = :name"),
                                {"name": report["database"]}).scalar_one()
    finally:
        engine.dispose()
    assert left == 0


@pytest.fixture(scope="module")
def deltas_report() -> dict[str, Any]:
    # A high sample rate, so that a few seconds of a few workers store some sampled events, and deltas finished
    # every second (the sidecar's default is a minute), so that the window sees some.
    config = fleet.FleetConfig(workers=4, seconds=4.0, publishes=1, warmup_s=1.0, rps_per_worker=20.0,
                               mode="deltas", raw_sample_rate=0.2, delta_flush_s=1.0, setup_timeout_s=120.0,
                               publish_timeout_s=30.0, drain_timeout_s=60.0)
    result: dict[str, Any] = fleet.run(config, PG_ADMIN_URL)
    return result


def test_deltas_mode_counts_every_represented_request_once(deltas_report: dict[str, Any]) -> None:
    assert "aborted" not in deltas_report, deltas_report.get("aborted")
    check = deltas_report["verify"]
    assert check["ok"], check
    assert check["exact"]
    assert check["requests_represented"] > 0
    assert check["requests_in_rollups"] == check["requests_represented"]
    assert check["deltas_acked"] > 0
    assert check["deltas_stored"] == check["deltas_acked"] == check["delta_records"]
    assert check["deltas_rejected"] == 0
    # Only the sampled requests are stored as events, each with its weight; far fewer than the requests.
    assert 0 < check["events_in_db"] == check["sampled_events_in_db"] < check["requests_represented"]
    assert deltas_report["propagation"]["every_worker_every_publish"]
    assert "4 workers, mode deltas (raw sample 0.2)" in fleet.render(deltas_report)


def test_deltas_mode_reports_represented_requests(deltas_report: dict[str, Any]) -> None:
    telemetry, cpu = deltas_report["telemetry"], deltas_report["cpu"]
    assert telemetry["represented_requests"] > telemetry["events_stored"]
    assert telemetry["raw_sample_rate"] == 0.2
    assert cpu["per_1000_requests"]["control_plane_s"] > 0
    assert "telemetry_rollup_deltas" in deltas_report["storage"]["growth_bytes"]


def test_modes_compare(report: dict[str, Any], deltas_report: dict[str, Any]) -> None:
    comparison = fleet.compare([report, deltas_report])
    assert set(comparison["modes"]) == {"raw", "deltas"}
    assert comparison["modes"]["deltas"]["verified"]
    assert comparison["deltas_over_raw"]["requests_per_control_plane_cpu_s"] > 0
    assert "deltas / raw" in fleet.render_comparison(comparison)
