"""Engines that schedule in the engine (``schedule: in_engine``), and rendering for SGLang.

Golden files for SGLang live beside the others in ``tests/policies/golden`` (``SPECGATE_UPDATE_GOLDEN=1``
rewrites them); what they say was checked by hand against SGLang 0.5.23's argument names (see
``policies/render.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import (
    PolicyValidationError,
    RequestShape,
    compile_policy,
    interpret,
    load_policy,
    revision_id,
    validate_data,
)
from policies.__main__ import main
from policies.model import PlainEngine, Range, engine_k
from policies.render import (
    RenderError,
    batch_size_schedule,
    sglang_adaptive_config,
    sglang_launch_args,
    trtllm_speculative_config,
    vllm_serve_args,
)
from policies.schedule import describe, engine_schedule, first_match_segments
from tests.support import paths
from tests.support.golden import assert_golden
from tests.support.policy_strategies import in_engine_documents, shapes, validate_generated

BASE = """apiVersion: specgate/v1
name: gpu
engines:
  base: {method: none}
  eagle: {method: eagle3, model: org/eagle3-head, num_speculative_tokens: 5%s}
  mtp: {method: mtp, num_speculative_tokens: 2}
  ngram: {method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 3}
rules:
  - name: structured-plain
    when: {structured_output: true}
    then: {engine: base}
  - name: chat-eagle-small
    when: {route: [chat], batch_size: {max: 8}}
    then: {engine: eagle}
  - name: chat-eagle-medium
    when: {route: [chat], batch_size: {min: 9, max: 32}}
    then: {engine: eagle, num_speculative_tokens: 2}
  - name: code-mtp
    when: {route: [code]}
    then: {engine: mtp}
  - name: extract-ngram
    when: {route: [extract], batch_size: {max: 4}}
    then: {engine: ngram}
default: {engine: base}
exploration: {rate: 0.05, speculative_engine: ngram}
"""
IN_ENGINE = BASE % ", schedule: in_engine"
ROUTER = BASE % ""


def test_router_is_what_no_schedule_means_and_in_engine_is_another_revision() -> None:
    assert revision_id(load_policy(BASE % ", schedule: router")) == revision_id(load_policy(ROUTER))
    assert revision_id(load_policy(IN_ENGINE)) != revision_id(load_policy(ROUTER))
    assert load_policy(IN_ENGINE).in_engine_schedules == frozenset({"eagle"})
    assert load_policy(ROUTER).in_engine_schedules == frozenset()


def test_the_router_sends_every_chat_request_to_the_engine_with_the_k_of_its_batch() -> None:
    doc, router = load_policy(IN_ENGINE), load_policy(ROUTER)
    compiled, routed = compile_policy(doc, "r"), compile_policy(router, "r")
    for batch, k in [(1, 5), (8, 5), (9, 2), (32, 2), (33, 0), (500, 0)]:
        shape = RequestShape(route="chat", batch_size=batch)
        decision = compiled.decide(shape)
        assert decision == interpret(doc, shape, "r")
        assert (decision.engine, decision.num_speculative_tokens, decision.speculate) == ("eagle", k, k > 0)
        # as a router engine, the same rules send the large batches to the plain default instead
        assert routed.decide(shape).engine == ("eagle" if k else "base")
    # a large batch stays on the engine under the first rule's name; structured output still goes first
    assert compiled.decide(RequestShape(route="chat", batch_size=40)).rule == "chat-eagle-small"
    assert compiled.decide(RequestShape(route="chat", batch_size=1, structured_output=True)).engine == "base"


def test_schedule_segments_from_rules_with_any_bounds() -> None:
    huge = 10**15
    segments = first_match_segments([(Range(max=4), 3), (Range(min=2, max=huge), 1), (Range(min=huge + 5), 2)])
    assert segments == ((1, 4, 3), (5, huge, 1), (huge + 1, huge + 4, 0), (huge + 5, None, 2))
    assert first_match_segments([]) == ((1, None, 0),)
    assert first_match_segments([(None, 4)]) == ((1, None, 4),)
    assert first_match_segments([(Range(min=0, max=0), 4)]) == ((1, None, 0),)  # batch 0 is before any step
    assert describe(((1, 4, 3), (5, None, 0))) == "K=3 at batch 1-4, K=0 from batch 5"
    assert describe(((1, 1, 3), (2, None, 0))) == "K=3 at batch 1, K=0 from batch 2"
    assert describe(((1, None, 2),)) == "K=2 at every batch size"


def test_an_in_engine_engine_carries_its_schedule_in_every_rendering() -> None:
    doc = load_policy(IN_ENGINE)
    assert batch_size_schedule(doc, "eagle", 64) == [(1, 8, 5), (9, 32, 2), (33, 64, 0)]
    assert batch_size_schedule(doc, "eagle", 20) == [(1, 8, 5), (9, 20, 2)]
    args = vllm_serve_args(doc, "eagle")
    assert json.loads(args[1])["num_speculative_tokens_per_batch_size"] == [[1, 8, 5], [9, 32, 2], [33, 256, 0]]
    trt = trtllm_speculative_config(doc, "eagle", max_num_seqs=64)
    assert trt is not None
    assert trt["draft_len_schedule"] == {8: 5, 32: 2}
    # a router engine gets one only when asked for
    assert "num_speculative_tokens_per_batch_size" not in json.loads(vllm_serve_args(load_policy(ROUTER),
                                                                                     "eagle")[1])


@settings(max_examples=200, deadline=None)
@given(raw=in_engine_documents(), shape_list=st.lists(shapes, min_size=1, max_size=25))
def test_generated_in_engine_documents_decide_as_the_interpreter_and_as_the_schedule_says(
        raw: dict[str, Any], shape_list: list[RequestShape]) -> None:
    doc = validate_generated(raw)
    (engine,) = doc.in_engine_schedules
    spec = doc.engines[engine]
    assert not isinstance(spec, PlainEngine)
    schedule = engine_schedule(engine, engine_k(spec), enumerate(doc.rules), doc.default, doc.exploration)
    compiled = compile_policy(doc, "r")
    for shape in shape_list:
        decision = compiled.decide(shape)
        assert decision == interpret(doc, shape, "r")
        if decision.engine == engine and not decision.explored and shape.batch_size >= 1:
            k = next(k for lo, hi, k in schedule if lo <= shape.batch_size and (hi is None or shape.batch_size <= hi))
            # what the router says the request gets is what the engine's schedule drafts at that batch
            assert decision.num_speculative_tokens == k, (shape, decision, schedule)
            assert decision.speculate is (k > 0)


# --- SGLang ---------------------------------------------------------------------------------

def _examples() -> list[Any]:
    out = []
    for path in sorted(paths.EXAMPLES.glob("*.yaml")):
        doc = load_policy(path.read_text())
        out += [pytest.param(path.stem, name, id=f"{path.stem}-{name}")
                for name, spec in doc.engines.items() if not isinstance(spec, PlainEngine)]
    return out


@pytest.mark.parametrize(("stem", "engine"), _examples())
def test_sglang_args_of_the_examples_golden(stem: str, engine: str) -> None:
    doc = load_policy((paths.EXAMPLES / f"{stem}.yaml").read_text())
    args, adaptive = sglang_launch_args(doc, engine)
    assert adaptive is None
    assert_golden(f"{stem}/{engine}.sglang-args.json", json.dumps(args, indent=2) + "\n")


def test_sglang_in_engine_golden_and_checked_by_hand() -> None:
    doc = load_policy(IN_ENGINE)
    args, adaptive = sglang_launch_args(doc, "eagle", adaptive_config_path="eagle-adaptive.json")
    assert_golden("in-engine-gpu/eagle.sglang-args.json", json.dumps(args, indent=2) + "\n")
    assert_golden("in-engine-gpu/eagle.sglang-adaptive-config.json", json.dumps(adaptive, indent=2) + "\n")
    # one chain of 5 steps verifies 6 tokens; the adaptive slots start at each band's first batch size
    assert args == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "org/eagle3-head",
                    "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
                    "--speculative-num-draft-tokens", "6", "--speculative-adaptive",
                    "--speculative-adaptive-config", "eagle-adaptive.json"]
    assert adaptive == {"1": {"candidate_steps": [5]}, "9": {"candidate_steps": [2]},
                        "33": {"candidate_steps": [0]}}


@pytest.mark.parametrize(("engine", "expected"), [
    ("ngram", ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"]),
    ("mtp", ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", "3"]),
    ("eagle", ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "org/eagle3-head",
               "--speculative-num-steps", "5", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens",
               "6"]),
])
def test_sglang_args_per_method(engine: str, expected: list[str]) -> None:
    assert sglang_launch_args(load_policy(ROUTER), engine) == (expected, None)


def test_sglang_refuses_what_it_cannot_express() -> None:
    doc = load_policy(ROUTER)
    assert sglang_launch_args(doc, "base") == ([], None)
    with pytest.raises(RenderError, match="adaptive mode, which runs EAGLE, EAGLE3 and MTP"):
        sglang_launch_args(doc, "ngram", schedule=batch_size_schedule(doc, "ngram", 64))
    with pytest.raises(RenderError, match="needs a path"):
        sglang_launch_args(load_policy(IN_ENGINE), "eagle")
    tp = validate_data({"apiVersion": "specgate/v1", "name": "tp", "default": {"engine": "base"},
                        "engines": {"base": {"method": "none"},
                                    "dm": {"method": "draft_model", "model": "d", "num_speculative_tokens": 3,
                                           "draft_tensor_parallel_size": 2}}})
    with pytest.raises(RenderError, match="draft_tensor_parallel_size"):
        sglang_launch_args(tp, "dm")
    assert sglang_adaptive_config([(1, 4, 3), (5, 256, 0)]) == {"1": {"candidate_steps": [3]},
                                                               "5": {"candidate_steps": [0]}}


def test_the_cli_renders_for_sglang_and_writes_the_adaptive_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "gpu.yaml"
    policy.write_text(IN_ENGINE)
    config = tmp_path / "adaptive.json"
    assert main(["render", str(policy), "--engine", "eagle", "--target", "sglang",
                 "--adaptive-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--speculative-algorithm EAGLE3 ")
    assert f"--speculative-adaptive --speculative-adaptive-config '{config}'" in out
    assert json.loads(config.read_text())["33"] == {"candidate_steps": [0]}
    # without a path for the adaptive config: a usage error that says so, and nothing written
    assert main(["render", str(policy), "--engine", "eagle", "--target", "sglang"]) == 2
    assert "adaptive config needs a path" in capsys.readouterr().err


def _in_engine_doc(rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "specgate/v1", "name": "p", "default": {"engine": "base"}, "rules": rules,
            "engines": {"base": {"method": "none"},
                        "ng": {"method": "ngram", "num_speculative_tokens": 4, "schedule": "in_engine"}}}


def test_the_compiled_size_bound_counts_the_catch_alls() -> None:
    # Five groups over 400 routes each: the rules alone cost under the bound, their catch-alls take it over.
    from policies.validate import MAX_COMPILED_TESTS

    routes = [f"r{i}" for i in range(400)]
    rules = [{"name": f"g{g}", "then": {"engine": "ng"},
              "when": {"route": routes, "max_tokens": {"max": 100 + g}, "prompt_tokens": {"max": 9000},
                       "structured_output": False, "tools": False, "stream": False,
                       "labels": {"tier": "a", "team": "b"}, "batch_size": {"max": 4}}}
             for g in range(5)]
    with pytest.raises(PolicyValidationError) as info:
        validate_data(_in_engine_doc(rules))
    (error,) = [e for e in info.value.errors if e.code == "too_complex"]
    assert int(error.message.split("cost ")[1].split(" ")[0]) > MAX_COMPILED_TESTS
    router = _in_engine_doc(rules)
    del router["engines"]["ng"]["schedule"]
    validate_data(router)  # the same rules, routed by the router: within the bound


def test_groups_compare_predicates_by_meaning() -> None:
    doc = validate_data(_in_engine_doc([
        {"name": "a", "when": {"route": ["x", "y"], "max_tokens": {"min": 0, "max": 5}, "batch_size": {"max": 2}},
         "then": {"engine": "ng"}},
        {"name": "b", "when": {"route": ["y", "x", "x"], "max_tokens": {"max": 5}, "batch_size": {"min": 3, "max": 6}},
         "then": {"engine": "ng", "num_speculative_tokens": 1}},
    ]))
    assert batch_size_schedule(doc, "ng", 16) == [(1, 2, 4), (3, 6, 1), (7, 16, 0)]
    # a range alone with min 0 still refuses a request without max_tokens: another group
    with pytest.raises(PolicyValidationError) as info:
        validate_data(_in_engine_doc([
            {"name": "a", "when": {"max_tokens": {"min": 0}, "batch_size": {"max": 2}}, "then": {"engine": "ng"}},
            {"name": "b", "when": {"batch_size": {"max": 3}}, "then": {"engine": "ng"}},
        ]))
    assert {(e.path, e.code) for e in info.value.errors} == {("rules[1].when.batch_size", "schedule_conflict")}


def test_a_range_that_holds_no_batch_is_refused_for_an_in_engine_engine() -> None:
    with pytest.raises(PolicyValidationError) as info:
        validate_data(_in_engine_doc([{"name": "zero", "when": {"batch_size": {"max": 0}}, "then": {"engine": "ng"}}]))
    assert {(e.path, e.code) for e in info.value.errors} == {("rules[0].when.batch_size.max", "out_of_range")}


def test_sglang_starts_with_the_largest_steps_of_the_schedule() -> None:
    doc = validate_data({"apiVersion": "specgate/v1", "name": "p", "default": {"engine": "base"},
                         "engines": {"base": {"method": "none"},
                                     "e": {"method": "eagle", "model": "m", "num_speculative_tokens": 4,
                                           "schedule": "in_engine"}},
                         "rules": [{"name": "big-only", "when": {"batch_size": {"min": 5}}, "then": {"engine": "e"}}]})
    args, adaptive = sglang_launch_args(doc, "e", adaptive_config_path="a.json")
    assert args[args.index("--speculative-num-steps") + 1] == "4"
    assert adaptive == {"1": {"candidate_steps": [0]}, "5": {"candidate_steps": [4]}}
