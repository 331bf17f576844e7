"""Engine configuration rendered from a policy: vLLM, TensorRT-LLM and SGLang.

The sidecar decides per request; the engine can additionally be told to stop
drafting when its own running batch grows past what the policy allows
(vLLM ``num_speculative_tokens_per_batch_size``, TensorRT-LLM
``draft_len_schedule``). For a router engine that is a second line of defence
(``--schedule``): the sidecar sees the batch at admission, the engine sees it
at every step. For an engine with ``schedule: in_engine`` it is the only one,
and always rendered (policies.schedule).

A method an engine lacks is refused with a :class:`RenderError` that names the engine and says why, never
rendered as something else.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from policies.model import (
    DraftModelEngine,
    EagleEngine,
    MtpEngine,
    NgramEngine,
    PlainEngine,
    PolicyDocument,
    SuffixEngine,
    engine_k,
    schedules_in_engine,
)
from policies.schedule import engine_schedule

# vLLM's default max_num_seqs; the schedule must cover every batch size the engine can run.
DEFAULT_MAX_NUM_SEQS = 256
# The vLLM whose SpeculativeConfig the methods' fields were checked against (vllm/config/speculative.py); the
# testbed runs it (testbed/env.py).
VLLM_VERSION = "0.32.0"

ScheduleEntry = tuple[int, int, int]


class RenderError(ValueError):
    pass


def _engine(doc: PolicyDocument, name: str) -> Any:
    try:
        return doc.engines[name]
    except KeyError:
        raise RenderError(f"engine '{name}' is not defined in policy '{doc.name}' "
                          f"(defined: {', '.join(sorted(doc.engines))})") from None


def batch_size_schedule(doc: PolicyDocument, engine_name: str,
                        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> list[ScheduleEntry]:
    """``[[lo, hi, K], ...]`` covering 1..max_num_seqs for one engine variant.

    K at batch size b is the largest draft length any decision that sends
    requests to this engine uses at b (rules, default and exploration), and 0
    where no decision would send a request here at that batch size. Predicates
    other than batch size are ignored: the schedule is engine-wide, so it must
    allow whatever any route may need.
    """
    engine = _engine(doc, engine_name)
    if isinstance(engine, PlainEngine):
        raise RenderError(f"engine '{engine_name}' has method none; it has no draft schedule")
    if max_num_seqs < 1:
        raise RenderError("max_num_seqs must be at least 1")
    full_k = engine_k(engine)
    if schedules_in_engine(engine):
        segments = engine_schedule(engine_name, full_k, enumerate(doc.rules), doc.default, doc.exploration)
        return [(lo, min(hi, max_num_seqs) if hi is not None else max_num_seqs, k)
                for lo, hi, k in segments if lo <= max_num_seqs]
    k_at = [0] * (max_num_seqs + 1)

    def allow(lo: int, hi: int, k: int) -> None:
        for b in range(max(lo, 1), min(hi, max_num_seqs) + 1):
            k_at[b] = max(k_at[b], k)

    for rule in doc.rules:
        if rule.then.engine == engine_name:
            r = rule.when.batch_size
            lo = r.min if r is not None and r.min is not None else 1
            hi = r.max if r is not None and r.max is not None else max_num_seqs
            allow(lo, hi, rule.then.num_speculative_tokens or full_k)
    if doc.default.engine == engine_name:
        allow(1, max_num_seqs, doc.default.num_speculative_tokens or full_k)
    if doc.exploration.rate > 0 and doc.exploration.speculative_engine == engine_name:
        allow(1, max_num_seqs, full_k)  # explored requests may arrive at any batch size

    schedule: list[ScheduleEntry] = []
    for b in range(1, max_num_seqs + 1):
        if schedule and schedule[-1][2] == k_at[b] and schedule[-1][1] == b - 1:
            lo, _, k = schedule[-1]
            schedule[-1] = (lo, b, k)
        else:
            schedule.append((b, b, k_at[b]))
    return schedule


def _schedule_for(doc: PolicyDocument, engine_name: str, schedule: list[ScheduleEntry] | None,
                  max_num_seqs: int) -> list[ScheduleEntry] | None:
    """The schedule asked for, else the one an engine that schedules in the engine always carries."""
    if schedule is None and schedules_in_engine(_engine(doc, engine_name)):
        return batch_size_schedule(doc, engine_name, max_num_seqs)
    return schedule


def vllm_speculative_config(doc: PolicyDocument, engine_name: str, *, schedule: list[ScheduleEntry] | None = None,
                            max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> dict[str, Any] | None:
    """The ``--speculative-config`` object, or None for a plain engine."""
    engine = _engine(doc, engine_name)
    config: dict[str, Any]
    if isinstance(engine, PlainEngine):
        return None
    schedule = _schedule_for(doc, engine_name, schedule, max_num_seqs)
    if isinstance(engine, NgramEngine):
        config = {"method": "ngram", "num_speculative_tokens": engine.num_speculative_tokens}
        if engine.prompt_lookup_max is not None:
            config["prompt_lookup_max"] = engine.prompt_lookup_max
        if engine.prompt_lookup_min is not None:
            config["prompt_lookup_min"] = engine.prompt_lookup_min
    elif isinstance(engine, DraftModelEngine):
        config = {"method": "draft_model", "model": engine.model,
                  "num_speculative_tokens": engine.num_speculative_tokens}
        if engine.draft_tensor_parallel_size is not None:
            config["draft_tensor_parallel_size"] = engine.draft_tensor_parallel_size
    elif isinstance(engine, EagleEngine):
        config = {"method": engine.method, "model": engine.model,
                  "num_speculative_tokens": engine.num_speculative_tokens}
    elif isinstance(engine, MtpEngine):
        config = {"method": "mtp", "num_speculative_tokens": engine.num_speculative_tokens}
    elif isinstance(engine, SuffixEngine):
        if schedule is not None:
            raise RenderError(f"engine '{engine_name}' (method suffix): vLLM {VLLM_VERSION}'s suffix proposer drafts "
                              "with the configured num_speculative_tokens at every step and stops on any other K, "
                              "so it takes no batch-size schedule")
        # Every field, defaults included: the engine runs what the policy says even where vLLM's defaults move.
        config = {"method": "suffix", "num_speculative_tokens": engine.num_speculative_tokens,
                  "suffix_decoding_max_tree_depth": engine.suffix_decoding_max_tree_depth,
                  "suffix_decoding_max_cached_requests": engine.suffix_decoding_max_cached_requests,
                  "suffix_decoding_max_spec_factor": engine.suffix_decoding_max_spec_factor,
                  "suffix_decoding_min_token_prob": engine.suffix_decoding_min_token_prob}
    else:  # pragma: no cover - the model's union is closed
        raise RenderError(f"cannot render engine method {engine.method!r}")
    if schedule is not None:
        config["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]
    return config


def vllm_serve_args(doc: PolicyDocument, engine_name: str, *, schedule: list[ScheduleEntry] | None = None,
                    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> list[str]:
    """Arguments to add to ``vllm serve`` for this engine variant.

    Per-request metrics are what the sidecar records acceptance from. A plain
    engine gets only ``--enable-per-request-metrics``: vLLM refuses
    ``--per-request-spec-decode-metrics`` without speculation.
    """
    config = vllm_speculative_config(doc, engine_name, schedule=schedule, max_num_seqs=max_num_seqs)
    if config is None:
        return ["--enable-per-request-metrics"]
    return [
        "--speculative-config", json.dumps(config, separators=(",", ":"), sort_keys=True),
        "--per-request-spec-decode-metrics", "summary",
        "--enable-per-request-metrics",
    ]


_TRT_DECODING_TYPES = {
    "ngram": "NGram", "draft_model": "DraftTarget", "eagle": "Eagle", "eagle3": "Eagle3", "mtp": "MTP",
}


def trtllm_speculative_config(doc: PolicyDocument, engine_name: str, *, schedule: list[ScheduleEntry] | None = None,
                              max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> dict[str, Any] | None:
    """TensorRT-LLM's ``speculative_config`` for ``trtllm-serve``, or None for plain."""
    engine = _engine(doc, engine_name)
    if isinstance(engine, PlainEngine):
        return None
    if isinstance(engine, SuffixEngine):
        # The nearest, decoding_type SA (SADecodingConfig), is another algorithm: a suffix automaton of earlier
        # tokens with no tree depth, spec factor or token probability to carry these fields.
        raise RenderError(f"engine '{engine_name}' (method suffix): TensorRT-LLM has no suffix decoding; its "
                          "suffix-automaton decoding (SA) is another algorithm, with none of this engine's fields")
    schedule = _schedule_for(doc, engine_name, schedule, max_num_seqs)
    config: dict[str, Any] = {
        "decoding_type": _TRT_DECODING_TYPES[engine.method],
        "max_draft_len": engine.num_speculative_tokens,
    }
    if isinstance(engine, (DraftModelEngine, EagleEngine)):
        config["speculative_model"] = engine.model
    if isinstance(engine, NgramEngine) and engine.prompt_lookup_max is not None:
        config["max_matching_ngram_size"] = engine.prompt_lookup_max
    if schedule is not None:
        config["draft_len_schedule"] = trtllm_draft_len_schedule(schedule)
    return config


def trtllm_draft_len_schedule(schedule: list[ScheduleEntry]) -> dict[int, int]:
    """vLLM-style ranges -> TensorRT-LLM's ``{upper batch bound: draft length}``.

    TensorRT-LLM reads each key as the upper bound of a band starting after
    the previous key, and drafts nothing above the largest key, so the trailing
    K=0 band is implied rather than written.
    """
    entries = list(schedule)
    while entries and entries[-1][2] == 0:
        entries.pop()
    if not entries:
        # Never drafting must be said explicitly: TensorRT-LLM ignores an empty schedule.
        return {1: 0}
    if entries[0][0] != 1:
        raise RenderError("a draft length schedule must start at batch size 1")
    return {hi: k for _, hi, k in entries}


def trtllm_extra_options_yaml(doc: PolicyDocument, engine_name: str, *, schedule: list[ScheduleEntry] | None = None,
                              max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> str:
    """The ``--extra_llm_api_options`` YAML file for ``trtllm-serve``."""
    config = trtllm_speculative_config(doc, engine_name, schedule=schedule, max_num_seqs=max_num_seqs)
    if config is None:
        return "{}\n"
    return yaml.safe_dump({"speculative_config": config}, sort_keys=False, default_flow_style=False)


# --- SGLang ------------------------------------------------------------------------------------------------------
# Argument names as SGLang 0.5.23 defines them (sglang/srt/arg_groups/fields/spec.py and speculative_hook.py;
# docs: docs.sglang.io, advanced_features/speculative_decoding and adaptive_speculative_decoding). SGLang counts
# draft steps and verified tokens: with one chain (--speculative-eagle-topk 1) it verifies steps + 1 tokens, the
# last accepted token included, and forces that when topk is 1; K drafted tokens are K steps.
SGLANG_VERSION = "0.5.23"
_SGLANG_ALGORITHMS = {
    "ngram": "NGRAM", "draft_model": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3",
    # SGLang runs multi-token-prediction heads through its EAGLE worker (NEXTN is an alias of EAGLE); for
    # DeepSeek- and GLM-style checkpoints it fills in the draft path from the model itself.
    "mtp": "EAGLE",
}
# Only the adaptive mode drafts by batch size, and only for these (with topk 1; 0 steps from 0.5.14).
_SGLANG_ADAPTIVE = frozenset({"eagle", "eagle3", "mtp"})


def sglang_adaptive_config(schedule: list[ScheduleEntry]) -> dict[str, Any]:
    """``--speculative-adaptive-config``: each key a batch size from which its slot's draft steps apply.

    One candidate per slot pins the steps there (the adaptive mode would otherwise move between candidates by
    acceptance). SGLang pads the running batch up to its next CUDA-graph size and then takes the slot whose key
    is the largest at or below that padded size, so a band that starts between two graph sizes already applies
    to batches just above the smaller one: put band edges on graph sizes where it matters.
    """
    return {str(lo): {"candidate_steps": [k]} for lo, _, k in schedule}


def sglang_launch_args(doc: PolicyDocument, engine_name: str, *, schedule: list[ScheduleEntry] | None = None,
                       max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                       adaptive_config_path: str | None = None) -> tuple[list[str], dict[str, Any] | None]:
    """Arguments to add to ``python -m sglang.launch_server`` for this engine variant, and the adaptive config
    to write at ``adaptive_config_path`` when the engine drafts by batch size (None otherwise)."""
    engine = _engine(doc, engine_name)
    if isinstance(engine, PlainEngine):
        return [], None
    if isinstance(engine, SuffixEngine):
        raise RenderError(f"engine '{engine_name}' (method suffix): SGLang {SGLANG_VERSION} has no suffix decoding "
                          "(no SUFFIX speculative algorithm and no argument for its fields)")
    if isinstance(engine, DraftModelEngine) and engine.draft_tensor_parallel_size is not None:
        raise RenderError(f"engine '{engine_name}': draft_tensor_parallel_size has no SGLang {SGLANG_VERSION} "
                          "argument to render to")
    schedule = _schedule_for(doc, engine_name, schedule, max_num_seqs)
    k = engine.num_speculative_tokens
    if schedule is not None:
        if engine.method not in _SGLANG_ADAPTIVE:
            raise RenderError(f"engine '{engine_name}' (method {engine.method}): SGLang {SGLANG_VERSION} drafts by "
                              "batch size only in its adaptive mode, which runs EAGLE, EAGLE3 and MTP heads")
        # The starting steps must be one of the candidates (checked at start-up since 0.5.19): the largest, so
        # that the drafting buffers are sized for every slot, and never 0 while any slot drafts.
        k = max(entry[2] for entry in schedule)
    args = ["--speculative-algorithm", _SGLANG_ALGORITHMS[engine.method]]
    if isinstance(engine, (DraftModelEngine, EagleEngine)):
        args += ["--speculative-draft-model-path", engine.model]
    if isinstance(engine, NgramEngine):
        # The n-gram worker matches against a trie of earlier tokens, not a prompt-lookup window: there is no
        # counterpart of prompt_lookup_min/max, and its topk is its BFS breadth.
        args += ["--speculative-num-draft-tokens", str(k + 1)]
        return args, None
    args += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(k + 1)]
    if schedule is None:
        return args, None
    if adaptive_config_path is None:
        raise RenderError(f"engine '{engine_name}' drafts by batch size: its adaptive config needs a path")
    return [*args, "--speculative-adaptive", "--speculative-adaptive-config", adaptive_config_path], \
        sglang_adaptive_config(schedule)
