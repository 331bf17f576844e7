"""Smoke test of the decision-speed benchmark (bench/decisions.py).

Correctness only: every implementation the benchmark times must reach the same
decision for the same request shape, and a tiny run must produce a complete
report. Nothing here asserts a timing.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from policies import interpret, load_policy
from tests.support import paths

# bench/ is not an installed package: make the repository root importable.
_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
decisions = importlib.import_module("bench.decisions")

SHAPES = decisions.make_shapes(200)


def _outcomes(impls: Sequence[Any], shapes: Sequence[Any]) -> dict[str, list[dict[str, tuple[str, bool]]]]:
    """{policy: [{impl key: (rule, speculate)} for each shape]}."""
    pols = decisions.load_policies()
    table: dict[str, list[dict[str, tuple[str, bool]]]] = {"seed": [], "fifty": []}
    for policy in table:
        for s in shapes:
            row: dict[str, tuple[str, bool]] = {}
            for impl in impls:
                if impl.policy != policy or impl.shapes is not None:
                    continue
                result = impl.decide(s)
                rule = impl.rule_of(result)
                speculate = (impl.speculate_of(result) if impl.speculate_of is not None
                             else pols.speculates(policy, rule))
                row[impl.key] = (rule, speculate)
            table[policy].append(row)
    return table


def _assert_all_agree(impls: Sequence[Any], shapes: Sequence[Any], expected_keys: set[str]) -> None:
    table = _outcomes(impls, shapes)
    seen_keys: set[str] = set()
    for policy, rows in table.items():
        for i, row in enumerate(rows):
            seen_keys |= set(row)
            assert len(set(row.values())) == 1, f"{policy} shape {i} {shapes[i].to_dict()}: {row}"
    assert seen_keys == expected_keys


def test_fifty_rule_policy_validates_with_fifty_rules() -> None:
    doc = load_policy(decisions.FIFTY_POLICY.read_text())
    assert len(doc.rules) == 50
    assert len({r.name for r in doc.rules}) == 50


def test_shape_mix_is_fixed_and_reaches_early_rules_late_rules_and_default() -> None:
    assert [s.to_dict() for s in decisions.make_shapes(50)] == [s.to_dict() for s in SHAPES[:50]]
    hist = decisions.rule_histogram(decisions.load_policies(), SHAPES)
    for policy in ("seed", "fifty"):
        assert hist[policy]["default"] > 0
        assert 0 < hist[policy]["speculate"] < len(SHAPES)
    assert hist["seed"]["rules 1-10"] > 0
    assert hist["fifty"]["rules 1-10"] > 0
    assert hist["fifty"]["rules 11-30"] > 0
    assert hist["fifty"]["rules 31-50"] > 0


def test_specgate_and_hand_written_agree() -> None:
    with decisions.implementations(SHAPES, cel=False, unleash=False) as (pols, impls):
        assert decisions.cross_check(pols, impls, SHAPES) == []
        _assert_all_agree(impls, SHAPES, {"specgate-seed", "hand-written", "specgate-fifty"})
    for s in SHAPES:
        assert decisions.hand_written(s) == interpret(pols.seed_doc, s).speculate


def test_fallthrough_row_only_gets_shapes_no_rule_matches() -> None:
    with decisions.implementations(SHAPES, cel=False, unleash=False) as (pols, impls):
        row = next(i for i in impls if i.key == "specgate-fifty-fallthrough")
        assert row.shapes
        assert all(interpret(pols.fifty_doc, s).rule == "default" for s in row.shapes)


def test_cel_compiled_runner_works_after_an_interpreted_one() -> None:
    import celpy
    activation = celpy.json_to_cel({"route": "chat", "batch_size": 2, "structured_output": False})
    assert decisions.cel_program(decisions.SEED_CEL, compiled=False).evaluate(activation)
    assert decisions.cel_program(decisions.SEED_CEL, compiled=True).evaluate(activation)
    assert decisions.cel_program(decisions.SEED_CEL, compiled=False).evaluate(activation)


def test_every_implementation_reaches_the_same_decision() -> None:
    shapes = SHAPES[:120]  # the CEL rows take milliseconds per 50-rule decision
    with decisions.implementations(shapes) as (pols, impls):
        assert decisions.cross_check(pols, impls, shapes) == []
        _assert_all_agree(impls, shapes, {
            "specgate-seed", "hand-written", "cel-seed", "cel-seed-eval", "cel-seed-interpreted",
            "unleash-seed", "specgate-fifty", "cel-fifty", "cel-fifty-chained", "unleash-fifty",
        })


def test_tiny_run_reports_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    decisions.main(["--iterations", "20", "--rounds", "2", "--round-ms", "1", "--shapes", "40",
                    "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    keys = set(result["results"])
    assert keys == {
        "loop", "noop-call", "specgate-seed", "hand-written", "specgate-fifty",
        "specgate-fifty-fallthrough", "cel-seed", "cel-seed-eval", "cel-seed-interpreted", "cel-fifty",
        "cel-fifty-chained", "unleash-seed", "unleash-fifty",
    }
    for key, stats in result["results"].items():
        assert key in printed
        assert stats["samples"] >= 2
        assert stats["samples"] % 2 == 0, (key, stats["samples"])  # two rounds, as many samples in each
        assert stats["raw_us"]["median"] > 0
    assert result["cross_check"]["disagreements"] == 0
    assert {g["goal"] for g in result["goals"]} >= {"seed within 3x of hand-written"}
    assert "specgate-seed / hand-written" in result["ratios"]
    assert result["machine"]["python"]
