"""Shadow comparisons end to end on real vLLM: the sidecar compares what the draft engine served with what the
plain engine answers, and the control plane stores it. Ground truth: the test asks the plain engine itself.

Runs on SQLite and on PostgreSQL (the ``database_url`` fixture).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import jsonschema
import pytest

from controlplane.models import FleetState
from policies.evaluate import shadow_salt
from policies.shape import sticky_fraction
from tests.support.e2e import EXTRACT_SCHEMA, MODEL, Answer, Ask, StackFactory, prom_sum, send, wait_until
from tests.support.fleet_rows import session_for

pytestmark = pytest.mark.engines

POLICY = """
apiVersion: specgate/v1
name: seed
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
rules:
  - {name: chat-draft, when: {route: [chat]}, then: {engine: draft}}
  - {name: extract-draft, when: {route: [extract]}, then: {engine: draft}}
default: {engine: base}
quality: {shadow_rate: 0.05}
"""
# Reused by teams as is: both answers parse as JSON and are equal as values.
CHECK = "tests.support.quality_checks:json_equal"


def request_ids(secret: str, sampled: bool) -> itertools.islice[str]:
    """Request ids inside (or outside) the policy's shadow sample, by the wire contract's sticky split."""
    salt = shadow_salt("seed", secret)
    ids = (f"shadow-e2e-{n}" for n in itertools.count())
    return itertools.islice((i for i in ids if (sticky_fraction(i, salt) < 0.05) == sampled), 10**6)


def plain_answer(client: httpx.Client, base_url: str, ask: Ask) -> dict[str, Any]:
    body = {k: v for k, v in ask.body().items() if k not in ("stream", "stream_options")}
    response = client.post(base_url + "/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]  # type: ignore[no-any-return]


def token_ids(client: httpx.Client, base_url: str, text: str) -> list[int]:
    response = client.post(base_url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    response.raise_for_status()
    return list(response.json()["tokens"])


def test_sampled_greedy_requests_are_compared_with_the_plain_engine_and_stored(make_stack: StackFactory) -> None:
    stack = make_stack([POLICY], sidecar_env={"SPECGATE_QUALITY_CHECK": CHECK})
    with session_for(stack.database_url) as session:
        state = session.get(FleetState, 1)
        assert state is not None
        assert state.cohort_secret
        secret = state.cohort_secret
    sampled, outside = request_ids(secret, True), request_ids(secret, False)
    asks = ([(Ask("chat", i, max_tokens=32), next(sampled)) for i in range(4)]
            + [(Ask("chat", 10 + i, stream=True, max_tokens=32), next(sampled)) for i in range(2)]
            + [(Ask("extract", i, structured=True, max_tokens=64), next(sampled)) for i in range(3)]
            + [(Ask("chat", 20 + i, max_tokens=16), next(outside)) for i in range(3)])
    with httpx.Client(timeout=120) as client:
        answers: list[Answer] = []
        for n, (ask, rid) in enumerate(asks, 1):
            answers.append(send(client, stack.sidecar.url, ask, request_id=rid))
            # One at a time, shadow included: the plain engine is slower than the draft one on these cores, and
            # shadows left to pile up would pass the sidecar's bound and be dropped (as they should be, under
            # load); each shadow then also runs alone, as the ground truth below does.
            wait_until(lambda n=n: prom_sum(stack.sidecar.metrics(),
                                            "specgate_sidecar_shadow_comparisons_total") == min(n, 9), 120,
                       "the shadow done")
        assert [(a.request_id, a.status, a.error) for a in answers if not a.ok] == []
        assert {a.decision["engine"] for a in answers} == {"draft"}
        rows = stack.rows_by_request(len(answers), timeout=120)  # each shadow done: its event is stored
        # The ground truth, asked once the shadows are over (the plain engine idle, as each shadow found it).
        base = stack.fleet.urls["base"]
        truth = {a.request_id: plain_answer(client, base, a.ask) for a in answers[:9]}
        prefixes = {}
        for a in answers[:9]:
            served_ids = token_ids(client, base, a.text)
            plain_ids = token_ids(client, base, truth[a.request_id]["message"]["content"] or "")
            prefixes[a.request_id] = next((i for i, (x, y) in enumerate(zip(served_ids, plain_ids, strict=False))
                                           if x != y), min(len(served_ids), len(plain_ids)))

    outcomes = [line for line in stack.sidecar.metrics().splitlines() if "shadow" in line and not line.startswith("#")]
    matched = 0
    for a in answers[:9]:
        row = rows[a.request_id]
        plain = truth[a.request_id]
        plain_text = plain["message"]["content"] or ""
        same = a.text == plain_text and a.finish_reason == plain["finish_reason"]
        matched += same
        assert row["shadow_match"] is same, (a.request_id, row["stream"], row["status"], a.text, plain_text, outcomes)
        assert row["shadow_first_diff"] == (None if same else prefixes[a.request_id]), a.request_id
        if a.ask.structured:
            valid = jsonschema.Draft202012Validator(EXTRACT_SCHEMA).is_valid(_json(plain_text))
            assert row["shadow_structured_valid"] is valid
            assert row["structured_valid"] is jsonschema.Draft202012Validator(EXTRACT_SCHEMA).is_valid(_json(a.text))
        else:
            assert row["shadow_structured_valid"] is None
        # the worker's own check ran on every comparison
        served_json, plain_json = _json(a.text), _json(plain_text)
        if served_json is None:
            assert row["shadow_check_passed"] is False
            assert row["shadow_check_reason"].startswith("not JSON")
        else:
            assert row["shadow_check_passed"] is (served_json == plain_json)
    for a in answers[9:]:  # outside the sample: not compared
        assert [rows[a.request_id][f] for f in ("shadow_match", "shadow_first_diff", "shadow_check_passed")] == [
            None, None, None]
    metrics = stack.sidecar.metrics()
    assert prom_sum(metrics, "specgate_sidecar_shadow_comparisons_total", outcome="matched") == matched
    assert prom_sum(metrics, "specgate_sidecar_shadow_comparisons_total", outcome="differed") == 9 - matched
    assert prom_sum(metrics, "specgate_sidecar_quality_check_errors_total") == 0
    # what the control plane reports of them, per route
    summary = httpx.get(stack.cp.base + "/v1/analysis/summary", params={"policy": "seed", "group_by": "route"},
                        headers={"Authorization": f"Bearer {stack.cp.admin_token}"}, timeout=30)
    assert summary.status_code == 200, summary.text
    shadow = {row["key"]["route"]: row["shadow"] for row in summary.json()["rows"]}
    by_route = {"chat": answers[:6], "extract": answers[6:9]}
    for route, compared in by_route.items():
        same = sum(rows[a.request_id]["shadow_match"] for a in compared)
        assert (shadow[route]["compared"], shadow[route]["matched"]) == (len(compared), same), route
        assert shadow[route]["check_run"] == len(compared)
    assert shadow["extract"]["structured_checked"] == 3
    print(f"\nshadow comparisons on real vLLM: {matched} of 9 greedy draft-model answers equal the plain engine's")


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
