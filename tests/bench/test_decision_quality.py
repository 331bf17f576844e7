"""The decision-quality benchmark's figures (bench/decision_quality.py) from made-up outcomes: the benchmark
itself needs real vLLM engines and runs outside the suite (``python -m bench.decision_quality``)."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest

from policies import load_policy
from sidecar.loadgen import Outcome
from tests.support import paths

_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
dq = importlib.import_module("bench.decision_quality")


def outcome(index: int, stage: int, route: str, engine: str, latency_s: float, *, ttft_s: float | None = None,
            tokens: int = 40, itl: float | None = None, error: str | None = None) -> Outcome:
    return Outcome(index=index, request_id=f"r{index}", route=route, stage=stage, structured=False,
                   stream=ttft_s is not None, start_s=0.0, latency_s=latency_s, inflight=1,
                   status=200 if error is None else 502, error=error, ttft_s=ttft_s, engine=engine,
                   completion_tokens=tokens, engine_itl_ms=itl)


def test_stage_figures_count_only_answered_requests_and_give_an_interval() -> None:
    outcomes = [outcome(i, 0, "chat" if i % 2 else "creative", "draft" if i % 2 else "base", 0.1 + i / 1000,
                        ttft_s=0.02 if i % 4 == 0 else None, itl=3.0) for i in range(40)]
    outcomes.append(outcome(99, 0, "chat", "base", 9.0, error="http_502"))
    outcomes.append(outcome(100, 1, "chat", "base", 0.5))
    figures = dq.stage_figures(outcomes, 0, stage_s=10.0)
    assert (figures["requests"], figures["failed"]) == (41, 1)
    assert figures["requests_per_s"] == 4.0
    assert figures["tokens_per_s"] == 160.0
    assert figures["speculated_share"] == 0.5
    assert figures["ttft_p50_ms"] == 20.0
    assert figures["server_itl_p50_ms"] == 3.0
    low, high = figures["e2e_p50_interval_ms"]
    assert low <= figures["e2e_p50_ms"] <= high
    assert set(figures["e2e_p50_by_route_ms"]) == {"chat", "creative"}
    assert dq.bootstrap_median([1.0, 2.0]) is None  # too few to say


def _arm(by_stage: list[dict[str, float]], p50: list[float], failed: int = 0) -> dict[str, Any]:
    return {"stages": [{"e2e_p50_ms": p, "e2e_p50_interval_ms": [p * 0.9, p * 1.1], "failed": failed,
                        "e2e_p50_by_route_ms": routes} for p, routes in zip(p50, by_stage, strict=True)]}


def test_the_oracle_takes_the_best_static_arm_per_route_and_stage_and_the_goals_compare_the_autopilot() -> None:
    report: dict[str, Any] = {"levels": [1, 8], "arms": {
        "plain": _arm([{"chat": 120.0, "creative": 100.0}, {"chat": 300.0, "creative": 250.0}], [110.0, 270.0]),
        "spec": _arm([{"chat": 90.0, "creative": 200.0}, {"chat": 500.0, "creative": 600.0}], [150.0, 550.0]),
        "autopilot": _arm([{"chat": 95.0, "creative": 190.0}, {"chat": 310.0, "creative": 260.0}], [140.0, 280.0]),
    }}
    report["oracle"] = dq.oracle(report["arms"], report["levels"])
    first = report["oracle"][0]["by_route"]
    assert first == {"chat": {"arm": "spec", "e2e_p50_ms": 90.0}, "creative": {"arm": "plain", "e2e_p50_ms": 100.0}}
    assert {r["arm"] for r in report["oracle"][1]["by_route"].values()} == {"plain"}
    rows = dq.goals(report)["stages"]
    assert [(r["best_static_arm"], r["best_static_e2e_p50_ms"]) for r in rows] == [("plain", 110.0), ("plain", 270.0)]
    # stage 0: chat 95/90, creative 190/100 -> geometric mean of the ratios
    assert rows[0]["autopilot_over_oracle"] == pytest.approx((95 / 90 * 190 / 100) ** 0.5, abs=1e-3)
    assert rows[1]["autopilot_over_oracle"] == pytest.approx((310 / 300 * 260 / 250) ** 0.5, abs=1e-3)
    assert dq.goals({"levels": [1], "arms": {}, "oracle": []}) == {}


@pytest.mark.parametrize("arm", dq.STATIC_ARMS)
def test_every_static_arm_runs_a_valid_policy_and_the_testbed_arms_do_not_explore(arm: str) -> None:
    text, kind = dq.static_policy(arm)
    doc = load_policy(text)
    assert kind == ("gateway" if arm == "pools" else "worker")
    assert doc.exploration.rate == 0
    assert set(doc.engines) <= {"base", "draft"}


def test_the_autopilot_arm_starts_always_speculative_exploring_in_windows() -> None:
    doc = load_policy(dq.AUTOPILOT_POLICY)
    assert doc.default.engine == "draft"
    assert doc.rules == []
    assert doc.exploration.window_s == 5
    assert doc.exploration.rate > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--arms", "plain,psychic"], "--arms: unknown psychic"),
    (["--levels", "1,x"], "--levels"),
    (["--levels", "0"], "--levels"),
    (["--stage-s", "1"], "--stage-s"),
])
def test_bad_options_are_refused_naming_the_option(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        dq.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
