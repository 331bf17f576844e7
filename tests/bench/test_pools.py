"""The pool benchmark's report (bench/pools.py) from made-up outcomes: the benchmark itself needs real vLLM
engines and runs outside the suite (``python -m bench.pools``)."""

from __future__ import annotations

import importlib
import sys

from sidecar.loadgen import Outcome
from tests.support import paths

_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
pools = importlib.import_module("bench.pools")


def outcome(index: int, stage: int, route: str, engine: str, replica: str, latency_s: float,
            itl: float | None = None, error: str | None = None) -> Outcome:
    return Outcome(index=index, request_id=f"r{index}", route=route, stage=stage, structured=False, stream=False,
                   start_s=0.0, latency_s=latency_s, inflight=1, status=200 if error is None else 502,
                   error=error, engine=engine, replica=replica, engine_itl_ms=itl)


def test_the_report_per_level_route_and_replica() -> None:
    outcomes = [
        outcome(0, 0, "chat", "draft", "h:1", 0.100, itl=10.0),
        outcome(1, 0, "chat", "draft", "h:1", 0.300, itl=20.0),
        outcome(2, 1, "chat", "base", "h:2", 0.200, itl=30.0),
        outcome(3, 1, "extract", "draft", "h:1", 0.400, itl=None),
        outcome(4, 1, "extract", "base", "h:2", 9.0, error="http_502"),
    ]
    summary = pools.summarize_arm(outcomes, [1, 2], stage_s=2.0)
    assert (summary["requests"], summary["errors"], summary["errors_by_kind"]) == (5, 1, {"http_502": 1})
    assert summary["by_level"]["1"] == {"requests": 2, "requests_per_s": 1.0, "e2e_p50_ms": 200.0,
                                        "e2e_p95_ms": 290.0, "speculated_share": 1.0}
    assert summary["by_level"]["2"]["speculated_share"] == 0.5  # the failed request is not counted
    assert summary["engine_itl_median_ms"] == {"chat": {"1": 15.0, "2": 30.0}, "extract": {"1": None, "2": None}}
    assert summary["replicas"] == {"draft@h:1": 3, "base@h:2": 1}
    text = pools.render_arm("pools", {**summary, "requests_per_s": 1.2, "proxy_cpu_ms_per_request": 0.2,
                                      "speculative_engine_running": {"samples": 10, "peak": 6.0,
                                                                     "share_over_threshold": 0.2,
                                                                     "mean_over_when_over": 1.5}}, [1, 2])
    assert "chat 15.0/30.0" in text
    assert "peak 6.0, above the threshold (4) in 20.0% of 10 samples" in text


def test_the_running_poller_counts_time_over_the_threshold() -> None:
    poller = pools.RunningPoller("http://127.0.0.1:1")
    poller.samples = [1.0, 4.0, 5.0, 7.0]
    assert poller.summary() == {"samples": 4, "peak": 7.0, "share_over_threshold": 0.5, "mean_over_when_over": 2.0}
    assert pools.RunningPoller("http://x").summary()["share_over_threshold"] is None
