"""The recommender against the real engines' sweep, on recorded data (``specgate testbed recommend-check``).

The recorded files are ``bench/results-testbed/crossover/sweep.json`` (the ground truth: each engine
variant alone, real vLLM on CPU) and ``bench/results-testbed/recommend-check-cells.json`` (telemetry of
``specgate loadgen`` through a real sidecar and control plane, exploration on). ``--live`` re-records the
second; the tests here never start an engine.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controlplane.analysis.recommend import Recommendation
from controlplane.cli import app
from testbed import reccheck

runner = CliRunner()


@pytest.fixture(scope="module")
def sweep() -> dict[str, Any]:
    return reccheck.load_json(reccheck.SWEEP_FILE)


@pytest.fixture(scope="module")
def cells() -> dict[str, Any]:
    return reccheck.load_json(reccheck.CELLS_FILE)


def test_recorded_telemetry_was_made_with_the_check_policy(cells: dict[str, Any]) -> None:
    assert cells["policy"] == "recommend-check"
    assert cells["policy_document"] == reccheck.CHECK_POLICY
    assert cells["errors"] == 0
    routes = {c["route"] for c in cells["cells"]}
    assert routes == set(reccheck.route_engines(reccheck.check_policy()))
    # Exploration on: every route has plain holdouts beside its speculative requests.
    assert {c["source"] for c in cells["cells"]} == {"holdout"}


def test_the_ground_truth_has_routes_to_exclude_and_routes_to_keep(sweep: dict[str, Any]) -> None:
    truth = reccheck.ground_truth(sweep, reccheck.route_engines(reccheck.check_policy()))
    assert {t.expect for t in truth.values()} == {"exclude", "threshold"}
    # The sweep measured every route at the five loads the telemetry's buckets stand for.
    assert all(sorted(t.speedups) == [1, 2, 4, 8, 16] for t in truth.values())


def test_the_recommender_on_recorded_telemetry_against_the_sweep(sweep: dict[str, Any],
                                                                   cells: dict[str, Any]) -> None:
    result = reccheck.run_check(sweep, cells)
    verdicts = {v.route: v for v in result.verdicts}
    assert sorted(verdicts) == ["chat", "classify", "creative", "extract"]
    truth = reccheck.ground_truth(sweep, reccheck.route_engines(reccheck.check_policy()))
    # Where the sweep never saw speculation pay, the telemetry made the recommender exclude the route.
    never = {route for route, t in truth.items() if t.expect == "exclude"}
    assert never == {"classify", "creative"}
    for route in never:
        assert verdicts[route].agrees, verdicts[route]
        assert verdicts[route].got == "exclude the route"
    # chat: the draft model paid at every load in the sweep; the telemetry keeps speculation on.
    assert verdicts["chat"].agrees, verdicts["chat"]
    # extract: NOT what the sweep measured. The sweep crosses over between concurrency 4 and 8 (n-gram
    # alone at 16: 0.40x); the recorded telemetry has n-gram losing at buckets 2 and 3-4 and winning at
    # 9-16 with confidence (2.8x), so the recommender changes nothing. The recording runs three engines
    # on two cores (their workers bound to one), which the sweep, one engine at a time, does not; see
    # BENCHMARKS.md. This pins the recorded outcome; the goal (every route agrees) is not met yet.
    assert not verdicts["extract"].agrees
    assert verdicts["extract"].got.startswith("no threshold change")
    assert not result.passed
    # Each recommendation carries its evidence: the bucket rows with sample sizes behind the verdicts.
    excludes = [rec for rec in result.recommendations if rec.kind == "exclude_route"]
    assert sorted(rec.route for rec in excludes) == ["classify", "creative"]
    for rec in excludes:
        rows = rec.evidence["buckets"]
        assert rows
        assert all(row["n_plain"] > 0 and row["n_speculative"] > 0 for row in rows)
        assert any(row["verdict"] == "loses" for row in rows)


def test_the_check_fails_when_the_evidence_is_reversed(sweep: dict[str, Any], cells: dict[str, Any]) -> None:
    # The same telemetry with the cohorts' labels swapped says the opposite about every bucket: the
    # comparison must notice.
    swapped = copy.deepcopy(cells)
    for cell in swapped["cells"]:
        cell["speculative"], cell["plain"] = cell["plain"], cell["speculative"]
    assert not reccheck.run_check(sweep, swapped).passed


def test_the_command_on_recorded_data(tmp_path: Path, cells: dict[str, Any]) -> None:
    out = tmp_path / "report.md"
    result = runner.invoke(app, ["testbed", "recommend-check", "--report", str(out)])
    assert result.exit_code == 1, result.output  # extract disagrees (see above)
    text = out.read_text()
    assert "Result: FAIL (3 of 4 routes agree)" in text
    assert "| classify |" in text
    assert "exclude the route" in text

    swapped = copy.deepcopy(cells)
    for cell in swapped["cells"]:
        cell["speculative"], cell["plain"] = cell["plain"], cell["speculative"]
    bad = tmp_path / "swapped.json"
    bad.write_text(json.dumps(swapped))
    failed = runner.invoke(app, ["testbed", "recommend-check", "--cells", str(bad)])
    assert failed.exit_code == 1
    assert "Result: FAIL (0 of 4 routes agree)" in failed.output


def test_the_command_names_an_unreadable_input(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    result = runner.invoke(app, ["testbed", "recommend-check", "--cells", str(missing)])
    assert result.exit_code == 2
    assert "nope.json" in result.output


# --- the comparison itself, on made-up sweeps -------------------------------------------------------

def _sweep(speedups: dict[int, float], variant: str = "ngram", route: str = "r") -> dict[str, Any]:
    rows = []
    for c, s in speedups.items():
        rows.append({"variant": "base", "route": route, "concurrency": c, "mean_itl_ms": 10.0, "errors": 0})
        rows.append({"variant": variant, "route": route, "concurrency": c, "mean_itl_ms": 10.0 / s, "errors": 0})
    return {"http": rows}


@pytest.mark.parametrize(("speedups", "expect", "allowed", "unbounded", "shape"), [
    ({1: 0.5, 2: 0.7, 4: 0.9, 8: 0.8, 16: 0.6}, "exclude", (), False, "never pays"),
    ({1: 2.0, 2: 1.5, 4: 1.3, 8: 1.1, 16: 1.05}, "threshold", (5, 9, 17), True, "pays everywhere"),
    # pays up to 8, loses at 16: the crossover is bucket 5-8, one bucket either side allowed
    ({1: 2.0, 2: 1.5, 4: 1.3, 8: 1.1, 16: 0.8}, "threshold", (3, 5, 9), False, "clean crossover"),
    ({1: 1.2, 2: 0.9, 4: 0.8, 8: 0.7, 16: 0.6}, "threshold", (1, 2), False, "clean crossover"),
    # a losing cell inside a paying stretch: the threshold may end anywhere from the end of the first
    # paying run to the last paying bucket, one bucket wider on each side
    ({1: 1.5, 2: 1.2, 4: 0.9, 8: 1.1, 16: 0.7}, "threshold", (1, 2, 3, 5, 9), False, "no clean crossover"),
])
def test_ground_truth_shapes(speedups: dict[int, float], expect: str, allowed: tuple[int, ...], unbounded: bool,
                             shape: str) -> None:
    truth = reccheck.ground_truth(_sweep(speedups), {"r": "ngram"})["r"]
    assert (truth.expect, truth.allowed, truth.unbounded_ok, truth.shape) == (expect, allowed, unbounded, shape)


def test_ground_truth_needs_the_routes_cells() -> None:
    with pytest.raises(ValueError, match="route 'other'"):
        reccheck.ground_truth(_sweep({1: 1.0}), {"other": "ngram"})


def _rec(kind: str, route: str, edit: dict[str, Any] | None) -> Recommendation:
    return Recommendation(id="x", kind=kind, route=route, title="", edit=edit, confidence="high",
                          expected_effect={}, evidence={}, message="")


@pytest.mark.parametrize(("recs", "agrees"), [
    ([_rec("lower_threshold", "r", {"kind": "set_batch_max", "route": "r", "batch_max": 8})], True),
    ([_rec("lower_threshold", "r", {"kind": "set_batch_max", "route": "r", "batch_max": 16})], True),
    ([_rec("lower_threshold", "r", {"kind": "set_batch_max", "route": "r", "batch_max": 2})], False),
    ([_rec("exclude_route", "r", {"kind": "exclude_route", "route": "r"})], False),
    ([], False),  # no change keeps speculating at 16, where it loses
    # a recommendation for another route does not count for this one
    ([_rec("lower_threshold", "s", {"kind": "set_batch_max", "route": "s", "batch_max": 8})], False),
])
def test_compare_against_a_clean_crossover(recs: list[Recommendation], agrees: bool) -> None:
    truth = reccheck.ground_truth(_sweep({1: 2.0, 2: 1.5, 4: 1.3, 8: 1.1, 16: 0.8}), {"r": "ngram"})
    [verdict] = reccheck.compare(truth, reccheck.outcome(recs, ["r"]))
    assert verdict.agrees is agrees


def test_compare_against_never_pays_and_pays_everywhere() -> None:
    never = reccheck.ground_truth(_sweep({1: 0.5, 16: 0.6}), {"r": "ngram"})
    always = reccheck.ground_truth(_sweep({1: 1.5, 2: 1.4, 4: 1.3, 8: 1.2, 16: 1.1}), {"r": "ngram"})
    excluded = reccheck.outcome([_rec("exclude_route", "r", {"kind": "exclude_route", "route": "r"})], ["r"])
    unchanged = reccheck.outcome([], ["r"])
    assert reccheck.compare(never, excluded)[0].agrees
    assert not reccheck.compare(never, unchanged)[0].agrees
    assert reccheck.compare(always, unchanged)[0].agrees
    assert not reccheck.compare(always, excluded)[0].agrees
