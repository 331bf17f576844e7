"""Engine configuration rendered from policies: golden files and schedule rules.

Golden files live in ``tests/policies/golden/<example>/<engine>.<kind>``. Run with
``SPECGATE_UPDATE_GOLDEN=1`` to rewrite them after an intended change, and
read the diff before committing it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import PolicyDocument, RequestShape, compile_policy, load_policy, revision_id, validate_data
from policies.__main__ import main
from policies.model import PlainEngine
from policies.render import (
    DEFAULT_MAX_NUM_SEQS,
    RenderError,
    batch_size_schedule,
    sglang_launch_args,
    trtllm_draft_len_schedule,
    trtllm_extra_options_yaml,
    trtllm_speculative_config,
    vllm_serve_args,
    vllm_speculative_config,
)
from tests.support import paths
from tests.support.golden import GOLDEN, UPDATE, assert_golden
from tests.support.policy_strategies import raw_documents, shapes, validate_generated

EXAMPLES = sorted(paths.EXAMPLES.glob("*.yaml"))
def _cases() -> list[Any]:
    out = []
    for path in EXAMPLES:
        doc = load_policy(path.read_text())
        for engine, spec in doc.engines.items():
            if not isinstance(spec, PlainEngine):
                out.append(pytest.param(path.stem, engine, id=f"{path.stem}-{engine}"))
    return out


CASES = _cases()


def _doc(stem: str) -> PolicyDocument:
    return load_policy(next(p for p in EXAMPLES if p.stem == stem).read_text())


def test_every_example_has_a_speculative_engine_case() -> None:
    assert {c.values[0] for c in CASES} == {p.stem for p in EXAMPLES}
    assert len(CASES) >= 4


@pytest.mark.parametrize(("stem", "engine"), CASES)
def test_vllm_serve_args_golden(stem: str, engine: str) -> None:
    doc = _doc(stem)
    args = vllm_serve_args(doc, engine)
    assert_golden(f"{stem}/{engine}.vllm-args.json", json.dumps(args, indent=2) + "\n")
    scheduled = vllm_serve_args(doc, engine, schedule=batch_size_schedule(doc, engine, 64))
    assert_golden(f"{stem}/{engine}.vllm-args-schedule-64.json", json.dumps(scheduled, indent=2) + "\n")
    # Shape of the arguments, independently of the golden files.
    for a in (args, scheduled):
        assert a[0] == "--speculative-config"
        assert a[2:] == ["--per-request-spec-decode-metrics", "summary", "--enable-per-request-metrics"]
    assert "num_speculative_tokens_per_batch_size" not in json.loads(args[1])
    assert json.loads(scheduled[1])["num_speculative_tokens_per_batch_size"] == [
        list(e) for e in batch_size_schedule(doc, engine, 64)]


@pytest.mark.parametrize(("stem", "engine"), CASES)
def test_vllm_speculative_config_golden(stem: str, engine: str) -> None:
    doc = _doc(stem)
    config = vllm_speculative_config(doc, engine, schedule=batch_size_schedule(doc, engine, 64))
    assert config is not None
    assert_golden(f"{stem}/{engine}.vllm-speculative-config.json",
                  json.dumps(config, indent=2, sort_keys=True) + "\n")
    assert config["method"] == doc.engines[engine].method
    assert config["num_speculative_tokens"] == doc.engines[engine].num_speculative_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(("stem", "engine"), CASES)
def test_trtllm_extra_options_golden(stem: str, engine: str) -> None:
    doc = _doc(stem)
    schedule = batch_size_schedule(doc, engine, 64)
    text = trtllm_extra_options_yaml(doc, engine, schedule=schedule)
    assert_golden(f"{stem}/{engine}.trtllm-extra-options.yaml", text)
    config = yaml.safe_load(text)["speculative_config"]
    assert config["max_draft_len"] == doc.engines[engine].num_speculative_tokens  # type: ignore[union-attr]
    assert config["draft_len_schedule"] == trtllm_draft_len_schedule(schedule)
    assert all(isinstance(k, int) for k in config["draft_len_schedule"])


# What the golden files say, checked by hand against the examples (max_num_seqs=64):
HAND_CHECKED = {
    # low-batch-interactive: batch_size <= 2 -> ngram (k 3); nothing else uses ngram.
    ("conservative", "ngram"): ([[1, 2, 3], [3, 64, 0]], {2: 3}, "NGram"),
    # extract-ngram: batch_size <= 8 -> ngram (k 4).
    ("multi-route", "ngram"): ([[1, 8, 4], [9, 64, 0]], {8: 4}, "NGram"),
    # chat rules: k 3 up to 4, k 2 for 5..8, but exploration sends explored plain
    # decisions to `draft` at its full k at any batch size: 3 everywhere.
    ("multi-route", "draft"): ([[1, 64, 3]], {64: 3}, "DraftTarget"),
    # chat-low-batch: batch_size <= 4 -> draft (k 3).
    ("seed", "draft"): ([[1, 4, 3], [5, 64, 0]], {4: 3}, "DraftTarget"),
    # testbed: extract-ngram, batch_size <= 8 -> ngram (k 4).
    ("testbed", "ngram"): ([[1, 8, 4], [9, 64, 0]], {8: 4}, "NGram"),
    # text-draft-small-batch: k 3 up to 4, and exploration sends explored plain decisions to `draft`
    # at any batch size: 3 everywhere.
    ("testbed", "draft"): ([[1, 64, 3]], {64: 3}, "DraftTarget"),
}


@pytest.mark.parametrize(("stem", "engine"), CASES)
def test_golden_files_say_what_was_checked_by_hand(stem: str, engine: str) -> None:
    vllm_schedule, trt_schedule, decoding_type = HAND_CHECKED[(stem, engine)]
    if UPDATE:
        pytest.skip("golden files are being rewritten")
    config = json.loads((GOLDEN / stem / f"{engine}.vllm-speculative-config.json").read_text())
    assert config["num_speculative_tokens_per_batch_size"] == vllm_schedule
    trt = yaml.safe_load((GOLDEN / stem / f"{engine}.trtllm-extra-options.yaml").read_text())
    assert trt["speculative_config"]["draft_len_schedule"] == trt_schedule
    assert trt["speculative_config"]["decoding_type"] == decoding_type


# --- batch_size_schedule ------------------------------------------------------------

def policy(rules: list[dict[str, Any]], default: dict[str, Any] | None = None,
           exploration: dict[str, Any] | None = None) -> PolicyDocument:
    data: dict[str, Any] = {
        "apiVersion": "specgate/v1",
        "name": "render",
        "engines": {
            "base": {"method": "none"},
            "ng": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5},
            "dm": {"method": "draft_model", "model": "models/d", "num_speculative_tokens": 6},
        },
        "rules": rules,
        "default": default or {"engine": "base"},
    }
    if exploration is not None:
        data["exploration"] = exploration
    return validate_data(data)


def rule(name: str, engine: str, batch: dict[str, int] | None = None, k: int | None = None,
         route: str | None = None) -> dict[str, Any]:
    when: dict[str, Any] = {"route": [route or name]}
    if batch is not None:
        when["batch_size"] = batch
    then: dict[str, Any] = {"engine": engine}
    if k is not None:
        then["num_speculative_tokens"] = k
    return {"name": name, "when": when, "then": then}


def assert_covers(schedule: list[tuple[int, int, int]], max_num_seqs: int) -> None:
    assert schedule[0][0] == 1
    assert schedule[-1][1] == max_num_seqs
    for (lo, hi, _), (next_lo, _, _) in itertools.pairwise(schedule):
        assert lo <= hi
        assert next_lo == hi + 1
    for (_, _, k), (_, _, next_k) in itertools.pairwise(schedule):
        assert k != next_k, f"adjacent entries with the same K should have been merged: {schedule}"


def test_unused_engine_never_drafts() -> None:
    doc = policy([rule("a", "ng", {"max": 4})])
    assert batch_size_schedule(doc, "dm", 16) == [(1, 16, 0)]


def test_rule_with_max_only() -> None:
    assert batch_size_schedule(policy([rule("a", "ng", {"max": 4})]), "ng", 16) == [(1, 4, 4), (5, 16, 0)]


def test_rule_with_min_only() -> None:
    schedule = batch_size_schedule(policy([rule("a", "ng", {"min": 10})]), "ng", 32)
    assert schedule == [(1, 9, 0), (10, 32, 4)]
    assert trtllm_draft_len_schedule(schedule) == {9: 0, 32: 4}


def test_rule_with_both_bounds_and_no_batch_predicate() -> None:
    doc = policy([rule("a", "ng", {"min": 3, "max": 5}), rule("b", "dm")])
    assert batch_size_schedule(doc, "ng", 8) == [(1, 2, 0), (3, 5, 4), (6, 8, 0)]
    assert batch_size_schedule(doc, "dm", 8) == [(1, 8, 6)]


def test_adjacent_ranges_with_the_same_k_merge() -> None:
    doc = policy([rule("a", "ng", {"max": 4}), rule("b", "ng", {"min": 5, "max": 8}),
                  rule("c", "ng", {"min": 9, "max": 12}, k=2)])
    assert batch_size_schedule(doc, "ng", 16) == [(1, 8, 4), (9, 12, 2), (13, 16, 0)]


def test_overlapping_rules_take_the_largest_k() -> None:
    doc = policy([rule("a", "dm", {"max": 8}, k=2), rule("b", "dm", {"max": 4}, k=5),
                  rule("c", "dm", {"min": 6, "max": 10}, k=3)])
    assert batch_size_schedule(doc, "dm", 12) == [(1, 4, 5), (5, 5, 2), (6, 10, 3), (11, 12, 0)]


def test_default_and_exploration_cover_every_batch_size() -> None:
    doc = policy([rule("a", "ng", {"max": 4})], default={"engine": "ng", "num_speculative_tokens": 1})
    assert batch_size_schedule(doc, "ng", 8) == [(1, 4, 4), (5, 8, 1)]
    explored = policy([rule("a", "dm", {"max": 4}, k=2)],
                      exploration={"rate": 0.1, "speculative_engine": "dm"})
    assert batch_size_schedule(explored, "dm", 8) == [(1, 8, 6)]
    off = policy([rule("a", "dm", {"max": 4}, k=2)], exploration={"rate": 0.0, "speculative_engine": "dm"})
    assert batch_size_schedule(off, "dm", 8) == [(1, 4, 2), (5, 8, 0)]


def test_bounds_beyond_max_num_seqs_are_clipped() -> None:
    doc = policy([rule("a", "ng", {"min": 10, "max": 400}), rule("b", "dm", {"min": 0, "max": 0})])
    assert batch_size_schedule(doc, "ng", 8) == [(1, 8, 0)]
    assert batch_size_schedule(doc, "ng", 300) == [(1, 9, 0), (10, 300, 4)]
    assert batch_size_schedule(doc, "dm", 1) == [(1, 1, 0)]


def test_default_max_num_seqs() -> None:
    schedule = batch_size_schedule(policy([rule("a", "ng", {"max": 4})]), "ng")
    assert schedule == [(1, 4, 4), (5, DEFAULT_MAX_NUM_SEQS, 0)]


def test_plain_engine_has_no_schedule() -> None:
    with pytest.raises(RenderError, match="method none"):
        batch_size_schedule(policy([]), "base")


def test_unknown_engine_is_a_render_error() -> None:
    doc = policy([])
    for call in (lambda: batch_size_schedule(doc, "nope"), lambda: vllm_speculative_config(doc, "nope"),
                 lambda: vllm_serve_args(doc, "nope"), lambda: trtllm_speculative_config(doc, "nope"),
                 lambda: trtllm_extra_options_yaml(doc, "nope")):
        with pytest.raises(RenderError, match="'nope' is not defined"):
            call()


@pytest.mark.parametrize("max_num_seqs", [0, -1])
def test_max_num_seqs_must_be_positive(max_num_seqs: int) -> None:
    with pytest.raises(RenderError):
        batch_size_schedule(policy([]), "ng", max_num_seqs)


@settings(max_examples=150, deadline=None)
@given(raw=raw_documents(), max_num_seqs=st.integers(1, 24), shape_list=st.lists(shapes, max_size=20))
def test_schedule_allows_every_decision_the_policy_makes(
        raw: dict[str, Any], max_num_seqs: int, shape_list: list[RequestShape]) -> None:
    # The schedule is a second line of defence: it must never forbid a draft
    # length the sidecar's own decision uses at that batch size.
    doc = validate_generated(raw)
    compiled = compile_policy(doc)
    for name, engine in doc.engines.items():
        if isinstance(engine, PlainEngine):
            continue
        schedule = batch_size_schedule(doc, name, max_num_seqs)
        assert_covers(schedule, max_num_seqs)
        k_at = {b: k for lo, hi, k in schedule for b in range(lo, hi + 1)}
        assert all(0 <= k <= engine.num_speculative_tokens for k in k_at.values())
        for shape in shape_list:
            if not 1 <= shape.batch_size <= max_num_seqs:
                continue
            decision = compiled.decide(shape)
            if decision.engine == name:
                assert decision.num_speculative_tokens <= k_at[shape.batch_size], (shape, decision, schedule)
        trt = trtllm_draft_len_schedule(schedule)
        assert list(trt) == sorted(trt)
        assert all(hi <= max_num_seqs for hi in trt)


def test_trtllm_schedule_drops_only_the_trailing_zero_band() -> None:
    assert trtllm_draft_len_schedule([(1, 4, 0), (5, 8, 3), (9, 64, 0)]) == {4: 0, 8: 3}
    assert trtllm_draft_len_schedule([(1, 4, 3), (5, 8, 0), (9, 16, 2), (17, 64, 0)]) == {4: 3, 8: 0, 16: 2}
    assert trtllm_draft_len_schedule([(1, 64, 3)]) == {64: 3}
    with pytest.raises(RenderError, match="start at batch size 1"):
        trtllm_draft_len_schedule([(2, 8, 3)])


# --- per-method rendering -------------------------------------------------------------

ALL_METHODS = {
    "apiVersion": "specgate/v1",
    "name": "methods",
    "engines": {
        "base": {"method": "none"},
        "ng": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
               "prompt_lookup_max": 4},
        "dm": {"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 4,
               "draft_tensor_parallel_size": 2},
        "ea": {"method": "eagle", "model": "org/eagle", "num_speculative_tokens": 3},
        "e3": {"method": "eagle3", "model": "org/eagle3", "num_speculative_tokens": 6},
        "mt": {"method": "mtp", "num_speculative_tokens": 1},
    },
    "default": {"engine": "base"},
}


@pytest.mark.parametrize(("engine", "vllm", "trt"), [
    ("ng", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
     {"decoding_type": "NGram", "max_draft_len": 5, "max_matching_ngram_size": 4}),
    ("dm", {"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 4,
            "draft_tensor_parallel_size": 2},
     {"decoding_type": "DraftTarget", "max_draft_len": 4, "speculative_model": "org/draft"}),
    ("ea", {"method": "eagle", "model": "org/eagle", "num_speculative_tokens": 3},
     {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": "org/eagle"}),
    ("e3", {"method": "eagle3", "model": "org/eagle3", "num_speculative_tokens": 6},
     {"decoding_type": "Eagle3", "max_draft_len": 6, "speculative_model": "org/eagle3"}),
    ("mt", {"method": "mtp", "num_speculative_tokens": 1}, {"decoding_type": "MTP", "max_draft_len": 1}),
])
def test_each_method_renders_for_both_engines(engine: str, vllm: dict[str, Any], trt: dict[str, Any]) -> None:
    doc = validate_data(ALL_METHODS)
    assert vllm_speculative_config(doc, engine) == vllm
    assert trtllm_speculative_config(doc, engine) == trt
    assert yaml.safe_load(trtllm_extra_options_yaml(doc, engine)) == {"speculative_config": trt}
    args = vllm_serve_args(doc, engine)
    assert json.loads(args[1]) == vllm


def test_plain_engine_renders_without_speculation() -> None:
    doc = validate_data(ALL_METHODS)
    assert vllm_speculative_config(doc, "base") is None
    assert trtllm_speculative_config(doc, "base") is None
    assert vllm_serve_args(doc, "base") == ["--enable-per-request-metrics"]
    assert trtllm_extra_options_yaml(doc, "base") == "{}\n"


# --- suffix decoding ------------------------------------------------------------------------------------------
# vLLM 0.32.0's SpeculativeConfig (vllm/config/speculative.py): method "suffix" with suffix_decoding_max_tree_depth
# (default 24), suffix_decoding_max_cached_requests (10000), suffix_decoding_max_spec_factor (1.0) and
# suffix_decoding_min_token_prob (0.1); num_speculative_tokens is the most one step drafts.

SUFFIX = """apiVersion: specgate/v1
name: suffix
engines:
  base: {method: none}
  sfx:
    method: suffix
    num_speculative_tokens: 8
    suffix_decoding_max_tree_depth: 32
    suffix_decoding_max_cached_requests: 0
    suffix_decoding_max_spec_factor: 2
    suffix_decoding_min_token_prob: 0.25
  sfx-defaults: {method: suffix, num_speculative_tokens: 4, schedule: router}
rules:
  - name: agent-suffix
    when: {route: [agent], batch_size: {max: 8}}
    then: {engine: sfx}
  - name: extract-suffix
    when: {route: [extract]}
    then: {engine: sfx-defaults, num_speculative_tokens: 2}
default: {engine: base}
"""


def test_suffix_renders_vllms_json_golden_and_checked_by_hand() -> None:
    doc = load_policy(SUFFIX)
    config = vllm_speculative_config(doc, "sfx")
    assert config == {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32,
                      "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.0,
                      "suffix_decoding_min_token_prob": 0.25}
    assert isinstance(config["suffix_decoding_max_spec_factor"], float)  # written 2, a float to vLLM
    assert_golden("suffix/sfx.vllm-speculative-config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    args = vllm_serve_args(doc, "sfx")
    assert_golden("suffix/sfx.vllm-args.json", json.dumps(args, indent=2) + "\n")
    assert args[2:] == ["--per-request-spec-decode-metrics", "summary", "--enable-per-request-metrics"]
    assert json.loads(args[1]) == config


def test_a_suffix_engine_renders_vllms_defaults_in_full() -> None:
    # Every field is written, defaults included: the engine runs what the policy says whatever vLLM's defaults.
    doc = load_policy(SUFFIX)
    config = vllm_speculative_config(doc, "sfx-defaults")
    assert config == {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 24,
                      "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
                      "suffix_decoding_min_token_prob": 0.1}
    assert_golden("suffix/sfx-defaults.vllm-args.json", json.dumps(vllm_serve_args(doc, "sfx-defaults"), indent=2)
                  + "\n")
    # a document that spells the defaults out means the same: the same revision
    spelled = SUFFIX.replace("sfx-defaults: {method: suffix, num_speculative_tokens: 4, schedule: router}",
                             "sfx-defaults: {method: suffix, num_speculative_tokens: 4, "
                             "suffix_decoding_max_tree_depth: 24, suffix_decoding_max_cached_requests: 10000, "
                             "suffix_decoding_max_spec_factor: 1.0, suffix_decoding_min_token_prob: 0.1}")
    assert spelled != SUFFIX
    assert revision_id(load_policy(spelled)) == revision_id(doc)


def test_suffix_is_refused_where_it_cannot_run() -> None:
    doc = load_policy(SUFFIX)
    # vLLM's suffix proposer asserts that every step drafts the configured K: no batch-size schedule
    with pytest.raises(RenderError, match=r"engine 'sfx' \(method suffix\): vLLM 0\.32\.0's suffix proposer"):
        vllm_serve_args(doc, "sfx", schedule=batch_size_schedule(doc, "sfx", 64))
    with pytest.raises(RenderError, match="takes no batch-size schedule"):
        vllm_speculative_config(doc, "sfx", schedule=[(1, 64, 8)])
    # TensorRT-LLM's suffix automaton (SA) is another algorithm; SGLang has none
    with pytest.raises(RenderError, match=r"engine 'sfx' \(method suffix\): TensorRT-LLM has no suffix decoding"):
        trtllm_speculative_config(doc, "sfx")
    with pytest.raises(RenderError, match="TensorRT-LLM has no suffix decoding"):
        trtllm_extra_options_yaml(doc, "sfx-defaults")
    with pytest.raises(RenderError, match=r"engine 'sfx' \(method suffix\): SGLang 0\.5\.23 has no suffix decoding"):
        sglang_launch_args(doc, "sfx")
    # the batch schedule itself is only arithmetic, as for any engine
    assert batch_size_schedule(doc, "sfx", 16) == [(1, 8, 8), (9, 16, 0)]


def test_the_cli_renders_suffix_for_vllm_and_says_why_not_elsewhere(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "suffix.yaml"
    policy.write_text(SUFFIX)
    assert main(["render", str(policy), "--engine", "sfx"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--speculative-config '{\"method\":\"suffix\",\"num_speculative_tokens\":8,")
    for target, why in (("sglang", "SGLang 0.5.23 has no suffix decoding"),
                        ("trtllm", "TensorRT-LLM has no suffix decoding")):
        assert main(["render", str(policy), "--engine", "sfx", "--target", target]) == 2
        assert why in capsys.readouterr().err
    assert main(["render", str(policy), "--engine", "sfx", "--schedule"]) == 2
    assert "takes no batch-size schedule" in capsys.readouterr().err
