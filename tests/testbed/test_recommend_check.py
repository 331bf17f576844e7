"""The recommender against the real engines' sweep, on recorded data (``specgate testbed recommend-check``).

The recorded files are ``bench/results-testbed/crossover/sweep.json`` (the ground truth: each engine
variant alone, real vLLM on CPU) and ``bench/results-testbed/recommend-check-cells.json`` (telemetry of
``specgate loadgen`` through a real sidecar and control plane, exploration on), both made with the model
pair whose fingerprint they carry. ``--live`` re-records the second; the tests here never start an engine.
Beside the recorded outcome, the recommender is checked on evidence built from the sweep itself, which
every route must pass and which, with its cohorts swapped, every route must fail.
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from analysis.buckets import batch_bucket
from analysis.histogram import bucket_index
from analysis.recommend import Recommendation, cell_report
from specgate.cli import app
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
    assert {route for route, t in truth.items() if t.expect == "exclude"} == {"classify", "creative"}
    # The recorded outcome (BENCHMARKS.md, "The recommender against the sweep"): every route agrees, judged
    # on end-to-end latency (what clients feel) as on inter-token latency before it.
    # extract's threshold goes to the largest bucket that still wins (2: end to end it already loses at 3-4,
    # no clear difference at 5-8, a loss at 9-16) where the sweep crosses between loads 4 and 8; chat, where
    # n-gram paid at every load, keeps speculating; classify and creative, where the draft model never paid,
    # are excluded.
    assert result.passed
    assert all(v.agrees for v in verdicts.values()), verdicts
    assert verdicts["extract"].got == "batch_max 2 (bucket 2)"
    assert verdicts["chat"].got.startswith("no threshold change")
    assert verdicts["classify"].got == verdicts["creative"].got == "exclude the route"
    reports = {(c.route, c.batch_bucket): cell_report(c, result.config) for c in result.cells}
    assert [reports[("extract", b)]["verdict"] for b in (1, 2, 3, 5, 9)] == \
        ["wins", "wins", "loses", "no clear difference", "loses"]
    assert {reports[("extract", b)]["measure"] for b in (1, 2, 3, 5, 9)} == {"e2e"}
    assert all(reports[("chat", b)]["verdict"] == "wins" for b in (1, 2, 3, 5, 9))
    assert all(reports[(route, b)]["verdict"] == "loses" for route in ("classify", "creative")
               for b in (1, 2, 3, 5, 9))
    # Every recommendation carries its evidence.
    assert result.recommendations
    assert all(rec.evidence for rec in result.recommendations)


def test_the_check_fails_when_the_evidence_is_reversed(sweep: dict[str, Any], cells: dict[str, Any]) -> None:
    # Evidence with the sweep's shape passes (below); the same evidence with the cohorts' labels swapped
    # says the opposite about every bucket, and the comparison must notice.
    evidence = _evidence_as_the_sweep_measured(sweep, cells)
    assert reccheck.run_check(sweep, evidence).passed
    for cell in evidence["cells"]:
        cell["speculative"], cell["plain"] = cell["plain"], cell["speculative"]
    result = reccheck.run_check(sweep, evidence)
    assert not any(v.agrees for v in result.verdicts), result.verdicts


def test_the_command_on_recorded_data(tmp_path: Path, sweep: dict[str, Any], cells: dict[str, Any]) -> None:
    out = tmp_path / "report.md"
    result = runner.invoke(app, ["testbed", "recommend-check", "--report", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "Result: PASS (4 of 4 routes agree)" in text
    assert "| classify |" in text
    assert "`bb5fc9d2428dd15d`" in text  # the models the two recordings share

    good = tmp_path / "as-the-sweep.json"
    good.write_text(json.dumps(_evidence_as_the_sweep_measured(sweep, cells)))
    passed = runner.invoke(app, ["testbed", "recommend-check", "--cells", str(good)])
    assert passed.exit_code == 0, passed.output
    assert "Result: PASS (4 of 4 routes agree)" in passed.output


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


def test_telemetry_of_other_models_than_the_sweeps_is_refused(tmp_path: Path, sweep: dict[str, Any],
                                                              cells: dict[str, Any]) -> None:
    # Both recordings name the weights they were made with, and they are the same pair.
    assert sweep["models"] == cells["models"]
    assert set(sweep["models"]) == {"target", "draft"}
    other = copy.deepcopy(cells)
    other["models"] = {**cells["models"], "target": "0" * 16}
    with pytest.raises(ValueError, match="the sweep was measured with models"):
        reccheck.run_check(sweep, other)
    unnamed = copy.deepcopy(cells)
    del unnamed["models"]
    with pytest.raises(ValueError, match="the telemetry does not say which models"):
        reccheck.run_check(sweep, unnamed)

    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    result = runner.invoke(app, ["testbed", "recommend-check", "--cells", str(path)])
    assert result.exit_code == 2
    assert "specgate testbed sweep" in result.output


def _evidence_as_the_sweep_measured(sweep: dict[str, Any], cells: dict[str, Any], n: int = 1000,
                                    sigma: float = 0.3) -> dict[str, Any]:
    """The recorded cells with their ITL replaced by what the sweep says: per bucket, plain ITL drawn around
    the base engine's mean and speculative ITL around the speculative engine's (lognormal, seeded)."""
    itl = {(r["variant"], r["route"], r["concurrency"]): r["mean_itl_ms"] for r in sweep["http"]}
    engines = reccheck.route_engines(reccheck.check_policy())
    rng = random.Random(7)

    def cohort(template: dict[str, Any], mean_ms: float) -> dict[str, Any]:
        values = [rng.lognormvariate(math.log(mean_ms), sigma) for _ in range(n)]
        hist: dict[str, int] = {}
        for value in values:
            key = str(bucket_index(value))
            hist[key] = hist.get(key, 0) + 1
        return {**template, "itl": hist, "itl_ms_sum": sum(values), "itl_count": n}

    out = copy.deepcopy(cells)
    load_of_bucket = {batch_bucket(c): c for c in (1, 2, 4, 8, 16)}
    for cell in out["cells"]:
        c = load_of_bucket[cell["batch_bucket"]]
        route = cell["route"]
        cell["plain"] = cohort(cell["plain"], itl[("base", route, c)])
        cell["speculative"] = cohort(cell["speculative"], itl[(engines[route], route, c)])
        cell["engines"] = {}
    return out


def test_evidence_that_matches_the_sweep_makes_every_route_agree(sweep: dict[str, Any],
                                                                 cells: dict[str, Any]) -> None:
    # The recommender itself, apart from how the live recording measures: given per-bucket evidence with
    # the sweep's own speedups (1000 requests a cohort), it ends extract's threshold within a bucket of the
    # crossover between loads 4 and 8, keeps chat speculating (n-gram paid at every load), and excludes
    # classify and creative, where the draft model never paid.
    result = reccheck.run_check(sweep, _evidence_as_the_sweep_measured(sweep, cells))
    verdicts = {v.route: v for v in result.verdicts}
    assert all(v.agrees for v in verdicts.values()), verdicts
    assert result.passed
    assert verdicts["classify"].got == verdicts["creative"].got == "exclude the route"
    assert verdicts["extract"].got.startswith("batch_max")
    assert verdicts["chat"].got.startswith("no threshold change")
