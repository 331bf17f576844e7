"""The dashboard's pure parts: engine kinds, thresholds, chart tables."""

from __future__ import annotations

import datetime as dt

import pytest

from apiclient.models import Rollout, RollupReport
from dashboard import charts
from policies import canonical_document, load_policy
from tests.support import dashboard_seed as seed


def _document(filename: str) -> dict[str, object]:
    return canonical_document(load_policy((seed.EXAMPLES / filename).read_text()))


def test_engine_kinds_and_the_threshold_come_from_the_document() -> None:
    fleet = _document("multi-route.yaml")
    kinds = charts.engine_kinds({"fleet": fleet})
    assert kinds == {("fleet", "base"): "plain", ("fleet", "ngram"): "speculative",
                     ("fleet", "draft"): "speculative"}
    assert charts.speculation_threshold(fleet, "chat") == 8  # the medium-batch rule reaches 8
    assert charts.speculation_threshold(fleet, "extract") == 8
    assert charts.speculation_threshold(fleet, "creative") is None
    assert charts.speculation_threshold(_document("seed.yaml"), "chat") == 4


def _group(route: str, engine: str, bucket: int, requests: int, itl_sum: float, speculated: int) -> dict[str, object]:
    unknown = {"p50": None, "p95": None, "p99": None}
    return {"key": {"policy": "fleet", "route": route, "engine": engine, "batch_bucket": bucket,
                    "batch_range": str(bucket)},
            "counters": {"requests": requests, "speculated": speculated, "itl_ms_sum": itl_sum,
                         "itl_count": requests},
            "acceptance_rate": None, "error_rate": 0.0, "e2e_ms_mean": None, "ttft_ms_mean": None,
            "itl_ms_mean": itl_sum / requests, "itl_ms_token_weighted": None,
            "ttft_ms": unknown, "itl_ms": unknown, "e2e_ms": unknown}


def test_itl_by_batch_merges_engines_of_one_kind_by_their_sums() -> None:
    report = RollupReport.model_validate({"group_by": ["route", "batch_bucket", "policy", "engine"],
                                          "truncated": False, "groups": [
        _group("chat", "draft", 2, 10, 100.0, 10),  # 10 ms
        _group("chat", "eagle", 2, 30, 600.0, 30),  # 20 ms: merged with draft, weighted -> 17.5 ms
        _group("chat", "base", 2, 20, 300.0, 0),
        _group("chat", "mystery", 2, 5, 50.0, 5),  # not in any document: judged by its decisions
    ]})
    kinds = {("fleet", "draft"): "speculative", ("fleet", "eagle"): "speculative", ("fleet", "base"): "plain"}
    merged = charts.itl_by_batch(charts.frame(report, kinds))
    by_kind = {row["kind"]: row for _, row in merged.iterrows()}
    assert by_kind["speculative"]["itl_mean_ms"] == pytest.approx((100 + 600 + 50) / 45)
    assert by_kind["plain"]["itl_mean_ms"] == pytest.approx(15.0)
    chart = charts.itl_vs_batch(merged, {"chat": 4}).to_dict()
    layers = chart["hconcat"][0]["layer"]
    assert len(layers) == 3  # lines, the threshold rule and its label


def test_markers_keep_what_falls_in_the_window() -> None:
    now = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.UTC)
    rollout = Rollout.model_validate({
        "id": "r1", "policy": "fleet", "from_revision": "a" * 64, "to_revision": "b" * 64, "mode": "traffic",
        "target": {}, "state": "rolled_back", "current_step": 0, "current_percent": 10.0, "allowed_actions": [],
        "reason": "canary", "created_by": "operator:olga", "created_at": now - dt.timedelta(minutes=30),
        "updated_at": now,
        "steps": [{"position": 0, "percent": 10, "started_at": now - dt.timedelta(minutes=30), "finished_at": now,
                   "outcome": "rolled_back"},
                  {"position": 1, "percent": 100, "started_at": now - dt.timedelta(hours=3), "finished_at": None,
                   "outcome": None}]})
    marks = charts.markers([rollout], [(now - dt.timedelta(minutes=5), "fleet: rolled back")],
                           now - dt.timedelta(hours=1), now)
    assert sorted(marks["kind"]) == ["rollback", "rollback", "rollout"]
    assert "fleet: 10% of bbbbbbbb" in set(marks["label"])


def _speedup_row(route: str, bucket: str, k0: dict[str, object] | None) -> dict[str, object]:
    return {"route": route, "batch_range": bucket, "source": "holdout", "n_speculative": 0, "n_plain": 200,
            "measure": "e2e", "e2e_speedup": None, "ttft_speedup": None, "itl_speedup": None,
            "verdict": "insufficient evidence", "client_disconnects": {}, "client_disconnect_rate": {},
            "theory": None, "k0": k0}


def test_speedup_rows_show_the_k0_tax_only_where_an_engine_ran_requests_at_k0() -> None:
    from apiclient.models import SpeedupReport
    from dashboard.views.common import speedup_rows

    tax = {"engine": "draft", "requests": 400, "drafted_per_request": 0.1, "measure": "e2e",
           "tax": {"ratio": 1.71, "low": 1.62, "high": 1.8}}
    report = SpeedupReport.model_validate({"policy": "p", "rows": [
        _speedup_row("chat", "1", None), _speedup_row("chat", "9-16", tax),
        _speedup_row("chat", "17-32", {**tax, "tax": None, "requests": 12})]})
    shown = speedup_rows(report.rows)
    assert [r["K=0 / plain [interval]"] for r in shown] == ["-", "1.71 [1.62, 1.80]", "-"]
    assert [r["K=0 requests"] for r in shown] == [0, 400, 12]
    plain = SpeedupReport.model_validate({"policy": "p", "rows": [_speedup_row("chat", "1", None)]})
    assert "K=0 / plain [interval]" not in speedup_rows(plain.rows)[0]
