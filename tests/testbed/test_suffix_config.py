"""The policy language's suffix engine says what the testbed's vLLM says: its fields, defaults and limits.

``policies.model.SuffixEngine`` copies vLLM's ``SpeculativeConfig`` (vllm/config/speculative.py) by hand, and
refuses ``schedule: in_engine`` because vLLM's suffix proposer drafts one fixed K. Both are read here from the
vLLM that the engine environment installs, so that a new pin that changes either fails a test instead of an
engine's start.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from policies import load_policy
from policies.model import SuffixEngine
from policies.render import VLLM_VERSION, vllm_speculative_config
from testbed import env

pytestmark = pytest.mark.engines

SCRIPT = r"""
import dataclasses, inspect, json
import vllm
from vllm.config.speculative import SpeculativeConfig
from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

fields = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
print(json.dumps({
    "version": vllm.__version__,
    "defaults": {k: v for k, v in fields.items() if k.startswith("suffix_decoding_")},
    "fields": sorted(fields),
    "validation": inspect.getsource(SpeculativeConfig._validate_suffix_decoding),
    "propose": inspect.getsource(SuffixDecodingProposer.propose),
}))
"""

POLICY = """apiVersion: specgate/v1
name: suffix
engines:
  base: {method: none}
  sfx: {method: suffix, num_speculative_tokens: 4}
default: {engine: base}
"""


def test_the_suffix_engine_has_vllms_fields_and_defaults() -> None:
    python = env.ensure_env(quiet=True)
    result = subprocess.run([str(python), "-c", SCRIPT], capture_output=True, text=True, env=env.engine_env(),
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    vllm = json.loads(result.stdout.strip().splitlines()[-1])
    assert vllm["version"].startswith(VLLM_VERSION)
    ours = {name: field.default for name, field in SuffixEngine.model_fields.items()
            if name.startswith("suffix_decoding_")}
    assert ours == vllm["defaults"]
    # every key the renderer writes is one vLLM reads
    config = vllm_speculative_config(load_policy(POLICY), "sfx")
    assert config is not None
    assert set(config) - {"method"} <= set(vllm["fields"])
    # vLLM's own lower bounds, which the model repeats
    for check in ("suffix_decoding_max_tree_depth < 1", "suffix_decoding_max_cached_requests < 0",
                  "suffix_decoding_max_spec_factor < 0", "0 <= self.suffix_decoding_min_token_prob <= 1"):
        assert check in vllm["validation"], check
    # why a suffix engine may not schedule in the engine: each step must draft the configured K
    assert "assert num_speculative_tokens == self.num_speculative_tokens" in vllm["propose"]
