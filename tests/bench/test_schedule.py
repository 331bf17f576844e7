"""The in-engine schedule benchmark's figures (bench/schedule.py) from made-up outcomes, and the schedule it
starts the engine with: the benchmark itself needs real vLLM engines (``python -m bench.schedule``)."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest

from policies import RequestShape, compile_policy, load_policy
from sidecar.loadgen import Outcome
from tests.support import paths

if str(paths.ROOT) not in sys.path:
    sys.path.insert(0, str(paths.ROOT))
schedule_bench = importlib.import_module("bench.schedule")


def outcome(index: int, route: str, latency_s: float, *, itl: float | None = 3.0, drafted: int | None = None,
            tokens: int = 40, error: str | None = None) -> Outcome:
    return Outcome(index=index, request_id=f"r{index}", route=route, stage=0, structured=False, stream=False,
                   start_s=0.0, latency_s=latency_s, inflight=1, status=200 if error is None else 502, error=error,
                   engine="draft", completion_tokens=tokens, drafted=drafted, engine_itl_ms=itl)


def test_the_engine_gets_the_schedule_the_policy_library_compiles_from_the_rule() -> None:
    assert schedule_bench.compiled_schedule() == [[1, 4, 3], [5, 256, 0]]
    assert schedule_bench.compiled_schedule(8) == [[1, 4, 3], [5, 8, 0]]
    assert [schedule_bench.k_at([[1, 4, 3], [5, 256, 0]], b) for b in (1, 4, 5, 16, 300)] == [3, 3, 0, 0, 0]
    # the scheduled arm's sidecar sends every request to the engine, with the K the engine's schedule gives
    policy = compile_policy(load_policy(schedule_bench.in_engine_policy()))
    for batch, k in [(1, 3), (4, 3), (5, 0), (16, 0)]:
        decision = policy.decide(RequestShape(route="chat", batch_size=batch))
        assert (decision.engine, decision.num_speculative_tokens) == ("draft", k)
    # and the twin arm routes by the same rule
    twin = compile_policy(load_policy(schedule_bench.ARM_SETUP["twin"][0]))
    assert [twin.decide(RequestShape(batch_size=b)).engine for b in (4, 5)] == ["draft", "base"]


def test_level_figures_read_answers_only_and_count_drafts() -> None:
    outcomes = [outcome(i, "chat" if i % 2 else "extract", 0.1 + i / 100, itl=2.0 + i % 3, drafted=0 if i < 6 else 9)
                for i in range(10)]
    outcomes.append(outcome(99, "chat", 5.0, error="http_502"))
    f = schedule_bench.level_figures(outcomes, stage_s=5.0)
    assert (f["requests"], f["failed"], f["requests_per_s"]) == (11, 1, 2.0)
    assert f["drafted_per_request"] == 3.6
    assert f["drafting_share"] == 0.4
    assert set(f["server_itl_p50_by_route_ms"]) == {"chat", "extract"}
    assert f["server_itl_p50_ms"] == 3.0
    assert f["tokens_per_s_p50"] is not None
    assert len(f["itl_samples"]) == 10
    assert len(f["itl_samples_undrafted"]) == 6


def _arm(itl: float, e2e: float, drafted_itl: float | None = None) -> dict[str, Any]:
    samples = [itl * (1 + (i % 5 - 2) / 100) for i in range(30)]
    drafted = [drafted_itl] * 40 if drafted_itl is not None else []
    return {"levels": {str(c): {"itl_samples": samples + drafted, "itl_samples_undrafted": samples,
                                "e2e_p50_ms": e2e, "drafting_share": 0.25 if drafted else 0.0} for c in (2, 8)}}


def test_the_k0_tax_is_the_ratio_of_server_itl_where_the_schedule_drafts_nothing() -> None:
    # The scheduled engine's requests that drafted (the batch dipped to the threshold) are left out of the tax.
    arms = {"plain": _arm(10.0, 100.0), "scheduled": _arm(11.0, 120.0, drafted_itl=50.0),
            "spec": _arm(15.0, 150.0)}
    rows = schedule_bench.k0_tax(arms, [[1, 4, 3], [5, 256, 0]], [2, 8])
    assert [row["schedule_k"] for row in rows] == [3, 0]
    point, low, high = rows[1]["scheduled_over_plain_itl"]
    assert point == pytest.approx(1.1, abs=1e-3)
    assert low <= point <= high
    assert rows[1]["spec_over_plain_itl"][0] == pytest.approx(1.5, abs=1e-3)
    assert rows[1]["scheduled_drafting_share"] == 0.25
    # where the schedule drafts, all of its requests count
    assert rows[0]["scheduled_over_plain_itl"][0] == pytest.approx(5.0, abs=1e-3)
    assert rows[1]["scheduled_over_plain_e2e_p50"] == 1.2
    assert "twin_over_plain_itl" not in rows[1]  # not run
    assert schedule_bench.ratio_of_medians([1.0] * 4, [1.0] * 10) is None  # too few to say
    text = schedule_bench.render_tax(rows)
    assert "c=8   schedule K=0" in text
    assert "(scheduled requests that drafted: 25%, left out)" in text


def test_the_written_report_drops_the_samples() -> None:
    report = {"arms": {"plain": _arm(10.0, 100.0)}}
    written = schedule_bench._without_samples(report)["arms"]["plain"]["levels"]["2"]
    assert "itl_samples" not in written
    assert "itl_samples_undrafted" not in written
    assert "itl_samples" in report["arms"]["plain"]["levels"]["2"]  # the run's own copy is untouched


@pytest.mark.parametrize(("argv", "message"), [
    (["--arms", "plain,gpu"], "--arms: unknown gpu"),
    (["--levels", "1,x"], "--levels: whole numbers"),
    (["--levels", "0,4"], "--levels: at least one, each 1 or more"),
])
def test_bad_arguments_name_the_option(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        schedule_bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
