"""Client disconnects in the speedup evidence: counted per cohort, and never behind a verdict of "faster"."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from analysis.cells import DISCONNECT_MARGIN, Cell, Cohort, more_disconnects
from analysis.guardrails import evaluate_step
from analysis.histogram import bucket_index
from analysis.recommend import CONFOUNDED, RecommendConfig, cell_report, recommend, verdict
from policies import canonical_document, load_policy
from policies.model import Guardrails

POLICY = """\
apiVersion: specgate/v1
name: seed
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
  ngram: {method: ngram, num_speculative_tokens: 4}
rules:
  - name: chat-low-batch
    when: {route: [chat], batch_size: {max: 4}}
    then: {engine: draft}
default: {engine: base}
"""


def cohort(rng: random.Random, n: int, itl_ms: float, *, disconnects: float = 0.0) -> Cohort:
    """``n`` requests around ``itl_ms``; a share ``disconnects`` of them ended by the client."""
    c = Cohort(client_disconnects=round(n * disconnects))
    for _ in range(n):
        itl = itl_ms * math.exp(rng.gauss(0, 0.25))
        c.requests += 1
        c.itl_count += 1
        c.itl_ms_sum += itl
        c.e2e_ms_sum += itl * 100
        for metric, value in (("itl", itl), ("e2e", itl * 100)):
            hist = getattr(c, metric)
            hist[bucket_index(value)] = hist.get(bucket_index(value), 0) + 1
    return c


def chat_cell(rng: random.Random, bucket: int, spec_itl: float, plain_itl: float, *, spec_gone: float = 0.0,
              plain_gone: float = 0.0, n: int = 600) -> Cell:
    spec = cohort(rng, n, spec_itl, disconnects=spec_gone)
    return Cell("chat", bucket, spec, cohort(rng, n, plain_itl, disconnects=plain_gone), "holdout", "draft",
                "draft_model", 3, {"draft": spec})


def test_a_cohort_carries_its_disconnects_through_rollups_and_files() -> None:
    counters: dict[str, Any] = {name: 0 for name in ("requests", "errors", "retries", "fallbacks",
                                                      "structured_checked", "structured_valid", "spec_reported",
                                                      "draft_tokens_sum", "accepted_tokens_sum", "spec_steps_sum",
                                                      "itl_ms_sum", "itl_count", "e2e_ms_sum")}
    c = Cohort.from_rollup({**counters, "requests": 40, "errors": 5, "client_disconnects": 4}, {})
    assert (c.client_disconnects, c.client_disconnect_rate) == (4, 0.1)
    assert Cohort.from_dict(c.to_dict()).client_disconnects == 4
    assert Cohort.from_dict({"requests": 3}).client_disconnects == 0  # files recorded before the count
    assert Cohort().client_disconnect_rate is None
    merged = Cohort().add(c).add(c)
    assert (merged.client_disconnects, merged.requests) == (8, 80)


def test_the_faster_arm_is_not_called_faster_when_its_clients_left_markedly_more() -> None:
    rng = random.Random(1)
    cfg = RecommendConfig()
    assert verdict(chat_cell(rng, 1, 12, 20), cfg)[0] == "wins"
    assert verdict(chat_cell(rng, 1, 12, 20, spec_gone=0.05, plain_gone=0.05), cfg)[0] == "wins"
    # Half a point more is within the margin: still evidence.
    assert verdict(chat_cell(rng, 1, 12, 20, spec_gone=0.005), cfg)[0] == "wins"
    confounded = chat_cell(rng, 1, 12, 20, spec_gone=0.08)
    assert verdict(confounded, cfg)[0] == CONFOUNDED
    # The same rule for plain: a plain cohort its clients left is not "faster" either.
    assert verdict(chat_cell(rng, 9, 26, 20), cfg)[0] == "loses"
    assert verdict(chat_cell(rng, 9, 26, 20, plain_gone=0.08), cfg)[0] == CONFOUNDED
    # More disconnects on the slower arm change nothing.
    assert verdict(chat_cell(rng, 9, 26, 20, spec_gone=0.08), cfg)[0] == "loses"

    row = cell_report(confounded, cfg)
    assert row["client_disconnects"] == {"speculative": 48, "plain": 0}
    assert row["client_disconnect_rate"] == {"speculative": pytest.approx(0.08), "plain": 0.0}


def test_markedly_means_above_the_margin_with_confidence() -> None:
    small = Cohort(requests=100, client_disconnects=3)
    none = Cohort(requests=100)
    assert not more_disconnects(small, none, 0.95)  # 3 % of 100: not sure it is above 1 %
    big = Cohort(requests=10_000, client_disconnects=300)
    assert more_disconnects(big, Cohort(requests=10_000), 0.95)
    assert not more_disconnects(Cohort(requests=10_000, client_disconnects=int(10_000 * DISCONNECT_MARGIN)),
                                Cohort(requests=10_000), 0.95)
    assert not more_disconnects(Cohort(), none, 0.95)


def test_no_threshold_moves_on_a_bucket_its_clients_left() -> None:
    document = canonical_document(load_policy(POLICY))
    rng = random.Random(2)
    clean = [chat_cell(rng, 1, 12, 20), chat_cell(rng, 2, 12, 20), chat_cell(rng, 3, 13, 20),
             chat_cell(rng, 5, 15, 20)]
    raised = {r.kind: r for r in recommend(document, "rev", clean)}["raise_threshold"]
    assert raised.edit == {"kind": "set_batch_max", "route": "chat", "batch_max": 8}
    assert raised.evidence["buckets"][3]["client_disconnect_rate"] == {"speculative": 0.0, "plain": 0.0}

    rng = random.Random(2)
    leaving = [chat_cell(rng, 1, 12, 20), chat_cell(rng, 2, 12, 20), chat_cell(rng, 3, 13, 20),
               chat_cell(rng, 5, 15, 20, spec_gone=0.1)]
    recs = recommend(document, "rev", leaving)
    assert "raise_threshold" not in {r.kind for r in recs}


def test_no_switch_to_an_engine_its_clients_leave() -> None:
    document = canonical_document(load_policy(POLICY))
    for gone, switched in ((0.0, True), (0.1, False)):
        rng = random.Random(3)
        cells = []
        for bucket in (1, 2, 3):
            c = chat_cell(rng, bucket, 14, 20)
            c.engines["ngram"] = cohort(rng, 400, 10, disconnects=gone)
            cells.append(c)
        kinds = {r.kind for r in recommend(document, "rev", cells)}
        assert ("switch_method" in kinds) is switched


def test_a_guardrail_does_not_pass_a_canary_its_clients_leave() -> None:
    rng = random.Random(4)
    base, canary = cohort(rng, 6000, 20.0), cohort(rng, 6000, 20.0)
    assert evaluate_step(base, canary, Guardrails(), alpha=0.05).verdict == "pass"
    # The same latencies, but one canary client in ten went away before its answer was complete.
    canary.client_disconnects = 600
    leaving = evaluate_step(base, canary, Guardrails(), alpha=0.05)
    assert leaving.verdict == "pending"
    p95 = {c.guardrail: c for c in leaving.checks}["p95_itl_regression"]
    assert p95.status == "pending"
    assert "clients went away on 10.0% of canary requests vs 0.0%" in p95.detail
    # A regression shows through the disconnects: still a breach.
    slower = evaluate_step(base, cohort(rng, 6000, 30.0, disconnects=0.1), Guardrails(), alpha=0.05)
    assert slower.verdict == "breach"
