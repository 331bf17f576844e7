"""The supervision benchmark's policies (bench/supervise.py): the benchmark itself runs real vLLM engines
(``python -m bench.supervise``)."""

from __future__ import annotations

import importlib
import sys

from policies.render import vllm_serve_args
from tests.support import paths

if str(paths.ROOT) not in sys.path:
    sys.path.insert(0, str(paths.ROOT))
supervise_bench = importlib.import_module("bench.supervise")


def test_the_policies_it_applies_change_only_the_draft_engines_arguments() -> None:
    first, second = supervise_bench.policy_variant(), supervise_bench.policy_variant(k=2)
    missing = supervise_bench.policy_variant(k=2, draft_model="testbed/missing-draft")
    assert vllm_serve_args(first, "base") == vllm_serve_args(second, "base") == vllm_serve_args(missing, "base")
    assert '"num_speculative_tokens":3' in vllm_serve_args(first, "draft")[1]
    assert '"num_speculative_tokens":2' in vllm_serve_args(second, "draft")[1]
    assert '"model":"testbed/missing-draft"' in vllm_serve_args(missing, "draft")[1]
    assert vllm_serve_args(first, "ngram") == vllm_serve_args(second, "ngram")
