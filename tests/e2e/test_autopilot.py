"""The autopilot on real vLLM engines: starting from always speculative, it moves the policy towards plain.

The traffic mixes the testbed's chat (where the draft model pays on these cores: measured, clients wait about
a fifth less) with classify and creative (where it does not). With switchback exploration, the per-route
end-to-end comparisons and the whole worker's show where plain wins; the autopilot, looking every second
with short holds, drafts a revision that speculates less there and rolls it out as a traffic canary, with no
failed request on the way. One database (SQLite): the autopilot's state machine runs on both in
tests/controlplane/test_autopilot.py, with synthetic telemetry.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from policies import RequestShape, compile_policy, validate_data
from tests.support.e2e import Ask, Load, StackBuilder, wait_until

pytestmark = pytest.mark.engines

ALWAYS_SPECULATIVE = """\
apiVersion: specgate/v1
name: seed
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
default: {engine: draft}
exploration: {rate: 0.5, speculative_engine: draft, window_s: 5}
guardrails: {max_p95_itl_regression: 1.0, max_p95_e2e_regression: 1.0, max_retry_rate_increase: 0.05, min_samples: 20}
"""


ROUTES = ("creative", "classify", "chat")


def _speculated_share(document: dict[str, Any]) -> float:
    """The share of the mix's routes at batch sizes 1 to 8 that a document sends to a speculative engine."""
    compiled = compile_policy(validate_data(document))
    decisions = [compiled.decide(RequestShape(route=r, batch_size=b)).speculate for r in ROUTES for b in range(1, 9)]
    return sum(decisions) / len(decisions)


def test_from_always_speculative_the_autopilot_moves_the_testbed_towards_plain(build_stack: StackBuilder,
                                                                              tmp_path: Path) -> None:
    stack = build_stack(f"sqlite:///{tmp_path / 'autopilot.db'}", (ALWAYS_SPECULATIVE,),
                        cp_env={"SPECGATE_AUTOPILOT_INTERVAL_S": "1"})
    api = httpx.Client(base_url=stack.cp.base, headers={"Authorization": f"Bearer {stack.cp.admin_token}"},
                       timeout=30)
    first = api.get("/v1/policies/seed").json()["active_revision_id"]
    enabled = api.put("/v1/policies/seed/autopilot", json={
        "enabled": True, "min_confidence": "medium", "steps": [50, 100], "hold_s": 15, "min_samples": 30,
        "max_changes_per_day": 2})
    assert enabled.status_code == 200, enabled.text
    t0 = time.monotonic()
    with Load(stack.sidecar.url, 4, lambda i: Ask(ROUTES[i % 3], i, max_tokens=32), tag="autopilot") as load:
        def moved() -> bool:
            state = api.get("/v1/policies/seed/autopilot").json()
            return any(e["action"] in ("completed", "rolled_back") for e in state["history"])

        try:
            wait_until(moved, 480, "the autopilot completing (or rolling back) a change", interval=2)
        finally:
            load.stop()
        answers = load.join()
    took = time.monotonic() - t0
    state = api.get("/v1/policies/seed/autopilot").json()
    history = list(reversed(state["history"]))  # oldest first
    actions = [e["action"] for e in history]
    started = next(e for e in history if e["action"] == "started")
    ended = next(e for e in history if e["action"] in ("completed", "rolled_back"))
    assert ended["action"] == "completed", (actions, ended["detail"])
    assert ended["revision_id"] == started["revision_id"] != first
    changed = api.get(f"/v1/revisions/{started['revision_id']}").json()
    assert changed["author"] == "system:autopilot"
    assert _speculated_share(changed["document"]) < 1.0  # towards plain
    recommendation = started["detail"]["recommendation"]
    assert recommendation["kind"] in ("stop_speculating", "exclude_route", "lower_threshold")
    assert recommendation["measure"] in ("e2e", "e2e_p95", "requests_per_s", "ttft")
    # Zero failed requests, before, during and after the rollout.
    assert answers
    assert all(a.ok for a in answers), Counter((a.status, a.error) for a in answers if not a.ok)
    switchback = started["detail"]["switchback"]
    print(f"\n{len(answers)} requests ({', '.join(ROUTES)}) at concurrency 4 in {took:.0f} s; autopilot {actions}; "
          f"{recommendation['kind']} on {recommendation['measure']}: {recommendation['message']}; "
          f"switchback {None if switchback is None else (switchback['verdict'], switchback['pairs'])}")
    api.close()
