"""recommend()'s whole output pinned on recorded cells, so that a refactoring provably changes nothing.

The cells are the testbed's recordings (telemetry of real vLLM CPU engines through a sidecar,
``bench/results-testbed``). Each scenario reads them under a policy and a configuration chosen so that,
together, the scenarios take every path of the recommender: routes excluded for losing and for low
acceptance, thresholds lowered and raised, draft lengths changed on the rule and on the engine, a switch
of engine, a quality risk. Where the recordings hold no such evidence (a second speculative engine on one
route, retries, structured output), a scenario derives it from them by a stated, deterministic edit.

The expected output lives in ``tests/analysis/golden/recommend/<scenario>.json``. Run with
``SPECGATE_UPDATE_GOLDEN=1`` to rewrite it after an intended change, and review the diff.
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from analysis.cells import Cell
from analysis.recommend import RecommendConfig, recommend
from policies import canonical_document, load_policy, revision_id
from tests.support import paths

GOLDEN = Path(__file__).resolve().parent / "golden" / "recommend"
UPDATE = os.environ.get("SPECGATE_UPDATE_GOLDEN") == "1"
RECORDINGS = paths.ROOT / "bench" / "results-testbed"
CROSSOVER_CELLS = RECORDINGS / "recommend-check-cells.json"  # the recording the recommend-check judges
AMD_CELLS = RECORDINGS / "amd-pair-switchback" / "recommend-check-cells.json"

# The check policy's engines with a threshold per route: chat speculates up to 2 (it wins everywhere:
# raise), extract up to 16 (it loses at 9-16: lower), classify up to 4 (loses everywhere: exclude),
# creative everywhere, under an acceptance floor its measured 0.1 lies below (exclude for acceptance).
THRESHOLDS = """\
apiVersion: specgate/v1
name: thresholds
engines:
  base: {method: none}
  ngram: {method: ngram, num_speculative_tokens: 4, prompt_lookup_min: 1, prompt_lookup_max: 3}
  draft: {method: draft_model, model: testbed/draft, num_speculative_tokens: 3}
rules:
  - name: chat-low
    when: {route: [chat], batch_size: {max: 2}}
    then: {engine: ngram}
  - name: extract-to-16
    when: {route: [extract], batch_size: {max: 16}}
    then: {engine: draft}
  - name: classify-low
    when: {route: [classify], batch_size: {max: 4}}
    then: {engine: draft}
  - name: creative
    when: {route: [creative]}
    then: {engine: draft}
default: {engine: base}
guardrails: {min_acceptance_rate: 0.2}
"""

# extract speculates at 1-2 only, where it wins (no change of threshold, so the draft length is looked at),
# on a draft engine configured for up to 8 tokens (a longer draft is a rule edit, not an engine edit);
# chat does not speculate at all although it would win (no threshold to raise from).
NARROW = """\
apiVersion: specgate/v1
name: narrow
engines:
  base: {method: none}
  ngram: {method: ngram, num_speculative_tokens: 4}
  draft: {method: draft_model, model: testbed/draft, num_speculative_tokens: 8}
rules:
  - name: extract-low
    when: {route: [extract], batch_size: {max: 2}}
    then: {engine: draft}
  - name: others
    when: {route: [classify, creative]}
    then: {engine: draft}
default: {engine: base}
"""


def _recorded(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _recorded_policy(path: Path) -> str:
    text: str = _recorded(path)["policy_document"]
    return text


def _second_engine_on_extract(cells: list[dict[str, Any]]) -> None:
    """extract's cells also carry chat's n-gram cohort of the same bucket, as a second speculative engine."""
    ngram = {c["batch_bucket"]: c["speculative"] for c in cells if c["route"] == "chat"}
    for c in cells:
        if c["route"] == "extract":
            c["engines"]["ngram"] = copy.deepcopy(ngram[c["batch_bucket"]])


def _quality_trouble_on_chat(cells: list[dict[str, Any]]) -> None:
    """chat's speculative requests retry one in eight, fall back one in fifty and fail a tenth of structured
    checks; its plain requests do none of that."""
    for c in cells:
        if c["route"] != "chat":
            continue
        spec, plain = c["speculative"], c["plain"]
        spec["retries"], spec["fallbacks"] = spec["requests"] // 8, spec["requests"] // 50
        spec["structured_checked"], spec["structured_valid"] = spec["requests"], spec["requests"] * 9 // 10
        plain["structured_checked"] = plain["structured_valid"] = plain["requests"]


def _plain_only_summarize(cells: list[dict[str, Any]]) -> None:
    """A route "summarize" with classify's plain cohorts and no speculative request at all."""
    for c in [c for c in cells if c["route"] == "classify"]:
        cells.append({"route": "summarize", "batch_bucket": c["batch_bucket"], "source": "observational",
                      "engine": None, "method": None, "k": None, "speculative": {},
                      "plain": copy.deepcopy(c["plain"]), "engines": {}})


@dataclass(frozen=True)
class Scenario:
    cells: Path
    policy: str
    config: RecommendConfig = field(default_factory=RecommendConfig)
    edit: Callable[[list[dict[str, Any]]], None] | None = None


SCENARIOS = {
    "crossover-check-policy": Scenario(CROSSOVER_CELLS, _recorded_policy(CROSSOVER_CELLS)),
    "amd-check-policy": Scenario(AMD_CELLS, _recorded_policy(AMD_CELLS)),
    "crossover-thresholds": Scenario(CROSSOVER_CELLS, THRESHOLDS),
    "amd-thresholds": Scenario(AMD_CELLS, THRESHOLDS),
    "crossover-narrow-cheap-drafts": Scenario(CROSSOVER_CELLS, NARROW, RecommendConfig(cost_ratio=0.01)),
    "crossover-narrow-dear-drafts": Scenario(CROSSOVER_CELLS, NARROW, RecommendConfig(cost_ratio=0.3, max_k=6)),
    "crossover-check-policy-dear-drafts": Scenario(CROSSOVER_CELLS, _recorded_policy(CROSSOVER_CELLS),
                                                   RecommendConfig(cost_ratio=0.3)),
    "crossover-loose-confidence": Scenario(CROSSOVER_CELLS, THRESHOLDS,
                                           RecommendConfig(confidence=0.5, min_samples=10, min_gain=0.0)),
    "crossover-thin-evidence": Scenario(CROSSOVER_CELLS, THRESHOLDS, RecommendConfig(min_samples=5000)),
    # The mechanism view alone (inter-token latency), as the recommender judged before it read e2e first.
    "crossover-thresholds-itl": Scenario(CROSSOVER_CELLS, THRESHOLDS, RecommendConfig(measures=("itl",))),
    "crossover-second-engine": Scenario(CROSSOVER_CELLS, _recorded_policy(CROSSOVER_CELLS),
                                        edit=_second_engine_on_extract),
    "crossover-second-engine-narrow": Scenario(CROSSOVER_CELLS, NARROW, edit=_second_engine_on_extract),
    "crossover-quality-risk": Scenario(CROSSOVER_CELLS, _recorded_policy(CROSSOVER_CELLS),
                                       edit=_quality_trouble_on_chat),
    "crossover-plain-only-route": Scenario(CROSSOVER_CELLS, THRESHOLDS.replace("[creative]", "[creative, summarize]"),
                                           edit=_plain_only_summarize),
}


def _run(scenario: Scenario) -> list[dict[str, Any]]:
    cells = copy.deepcopy(_recorded(scenario.cells)["cells"])
    if scenario.edit is not None:
        scenario.edit(cells)
    policy = load_policy(scenario.policy)
    recs = recommend(canonical_document(policy), revision_id(policy), [Cell.from_dict(c) for c in cells],
                     scenario.config)
    # through JSON, as the API and the CLI hand recommendations on (tuples become lists, keys strings)
    out: list[dict[str, Any]] = json.loads(json.dumps([r.to_dict() for r in recs]))
    return out


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_recommendations_on_recorded_cells_are_unchanged(name: str) -> None:
    got = _run(SCENARIOS[name])
    path = GOLDEN / f"{name}.json"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert path.exists(), f"missing golden file {path}; run with SPECGATE_UPDATE_GOLDEN=1 to create it"
    assert got == json.loads(path.read_text()), f"{name}: recommendations changed; if intended, rerun with " \
                                                 "SPECGATE_UPDATE_GOLDEN=1 and review the diff"


def test_the_scenarios_take_every_path_of_the_recommender() -> None:
    """Pinned output proves little about a path no scenario takes: every kind and edit shape occurs."""
    shapes: Counter[tuple[str, str | None]] = Counter()
    messages = []
    for scenario in SCENARIOS.values():
        for rec in _run(scenario):
            shapes[(rec["kind"], rec["edit"] and rec["edit"]["kind"])] += 1
            messages.append(rec["message"])
    assert set(shapes) == {("exclude_route", "exclude_route"), ("lower_threshold", "set_batch_max"),
                           ("raise_threshold", "set_batch_max"), ("change_k", "set_k"),
                           ("change_k", "set_engine_k"), ("switch_method", "set_engine"),
                           ("quality_risk", None)}
    assert any("below the guardrail minimum" in m for m in messages)
    assert any("slower (end-to-end latency) with confidence in bucket(s)" in m for m in messages)
    assert any("it is not faster with confidence" in m for m in messages)
    assert any("structured-output validity" in m for m in messages)
