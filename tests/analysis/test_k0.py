"""What K=0 steps cost (issue 18, item 6): requests an in-engine-scheduled engine ran without drafting are a
cohort of their own, their latency over the plain engine's is the K=0 tax, and the recommender either routes
around the K=0 band (when the tax is real) or tells its threshold edits as the engine's new schedule."""

from __future__ import annotations

import random

import pytest

from analysis import edits
from analysis.cells import Cell, Cohort
from analysis.recommend import RecommendConfig, recommend
from analysis.rollup import aggregate, decided_k0
from policies import RequestShape, canonical_document, compile_policy, load_policy, revision_id
from tests.support.cohorts import requests
from wire.telemetry import TelemetryEvent

# chat drafts with K 3 up to batch 4 on the draft engine, which schedules in the engine: above that the
# engine keeps chat's requests at K=0. Explored decisions go to the plain engine (the holdout).
IN_ENGINE = """\
apiVersion: specgate/v1
name: pool
engines:
  base: {{method: none}}
  ngram: {{method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 3}}
  draft: {{method: draft_model, model: models/draft, num_speculative_tokens: 3, schedule: in_engine}}
rules:
  - name: chat-small
    when: {{route: [chat], batch_size: {{max: 4}}}}
    then: {{engine: draft}}
default: {{engine: {default}}}
exploration: {{rate: 0.3, speculative_engine: ngram}}
"""


def _event(**changes: object) -> TelemetryEvent:
    data = {"event_id": "e-1", "request_id": "r-1", "time": "2026-12-07T17:00:10Z", "worker_id": "w-1",
            "pool": "a", "route": "chat", "model": "m", "policy": "pool", "revision": "rev-1", "rule": "chat-small",
            "engine": "draft", "decided_engine": "draft", "speculate": False, "num_speculative_tokens": 0,
            "explored": False, "canary": False, "kill_switch": False, "batch_size": 9, "stream": True,
            "structured_output": False, "tools": False, "prompt_tokens": 10, "completion_tokens": 40,
            "e2e_ms": 900.0, "status": "ok", "http_status": 200, "retries": 0, "fallback": False,
            "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_steps": 0}
    data.update(changes)
    return TelemetryEvent.model_validate(data)


def test_a_request_is_k0_when_decided_not_to_draft_on_an_engine_that_reports_drafting() -> None:
    assert decided_k0(_event())
    assert decided_k0(_event(completion_tokens=1))  # by the decision: a short answer is no different
    assert decided_k0(_event(spec_draft_tokens=6, spec_accepted_tokens=2))  # the engine's batch said otherwise
    assert not decided_k0(_event(speculate=True, num_speculative_tokens=3))  # drafting decided, however it went
    assert not decided_k0(_event(engine="base", spec_draft_tokens=None, spec_accepted_tokens=None,
                                 spec_steps=None))  # a plain engine reports no speculative metrics
    keys = aggregate([_event(event_id="a"), _event(event_id="b", speculate=True, num_speculative_tokens=3,
                                                   spec_draft_tokens=0, spec_accepted_tokens=0),
                      _event(event_id="c")])
    by_k0 = {key[-1]: delta.totals.requests for key, delta in keys.items()}
    assert by_k0 == {True: 2, False: 1}


def _cells(rng: random.Random, *, k0_e2e: float, small_spec_e2e: float = 700.0,
           bucket3_spec_e2e: float = 700.0) -> list[Cell]:
    """chat: drafting buckets 1, 2, 3 (3 is 3-4) against explored plain requests; K=0 buckets 5 and 9 with
    the engine's K=0 requests beside the explored plain ones."""
    out = []
    for bucket in (1, 2, 3):
        spec_e2e = bucket3_spec_e2e if bucket == 3 else small_spec_e2e
        out.append(Cell("chat", bucket, requests(rng, 400, itl=12.0, e2e=spec_e2e),
                        requests(rng, 300, itl=20.0, e2e=1000.0), "holdout", "draft", "draft_model", 3))
    for bucket in (5, 9):
        out.append(Cell("chat", bucket, Cohort(), requests(rng, 300, itl=20.0, e2e=1000.0), "holdout",
                        k0=requests(rng, 500, itl=34.0, e2e=k0_e2e), k0_engine="draft"))
    return out


def _doc(default: str = "base") -> tuple[dict[str, object], str]:
    doc = load_policy(IN_ENGINE.format(default=default))
    return canonical_document(doc), revision_id(doc)


def test_a_k0_band_slower_than_plain_is_routed_around_instead_of_tuned() -> None:
    document, rid = _doc()
    # Bucket 3-4 loses too: on its own that would lower the threshold, which here would only move the band.
    cells = _cells(random.Random(1), k0_e2e=1700.0, bucket3_spec_e2e=1400.0)
    recs = recommend(document, rid, cells)
    assert [r.kind for r in recs] == ["route_instead"], [r.title for r in recs]
    rec = recs[0]
    assert rec.edit == {"kind": "route_instead", "engine": "draft"}
    assert rec.route == "*"
    assert rec.measure == "e2e"
    assert rec.confidence == "medium"  # high needs 4 x min_samples (400) in both; the plain cohorts have 300
    assert rec.expected_effect["schedule"] == {"engine": "draft", "from": [[1, 4, 3], [5, 256, 0]], "to": None}
    assert 0.5 < rec.expected_effect["latency_change_in_k0_band"] < 0.7  # 1 / 1.7
    taxes = {row["batch_bucket"]: row["tax"] for row in rec.evidence["k0_tax"]}
    assert set(taxes) == {5, 9}
    for tax in taxes.values():
        assert tax["low"] > 1.5
        assert (tax["n_k0"], tax["n_plain"]) == (500, 300)
    # The edit: the engine drafts at its K whenever it runs, and the band goes to the plain engine.
    _, after = edits.apply_edit(document, rec.edit)
    assert after.engines["draft"].schedule is None
    compiled = compile_policy(after)
    assert compiled.decide(RequestShape(route="chat", batch_size=9)).engine == "base"
    assert compiled.decide(RequestShape(route="chat", batch_size=2)).engine == "draft"


def test_without_a_tax_a_threshold_edit_is_told_as_the_engines_new_schedule() -> None:
    document, rid = _doc()
    cells = _cells(random.Random(2), k0_e2e=1000.0, bucket3_spec_e2e=1400.0)
    recs = recommend(document, rid, cells)
    assert [r.kind for r in recs] == ["lower_threshold"]
    rec = recs[0]
    assert rec.edit == {"kind": "set_batch_max", "route": "chat", "batch_max": 2}
    assert rec.expected_effect["schedule"] == {"engine": "draft", "from": [[1, 4, 3], [5, 256, 0]],
                                               "to": [[1, 2, 3], [3, 256, 0]]}
    assert "[[1, 2, 3], [3, 256, 0]]" in rec.title
    # And the speedup rows say what the K=0 requests cost: nothing beyond noise here.
    k0 = rec.evidence["buckets"][3]["k0"]
    assert (k0["engine"], k0["requests"], k0["measure"]) == ("draft", 500, "e2e")
    assert k0["tax"]["low"] < 1 < k0["tax"]["high"]
    assert rec.evidence["buckets"][0]["k0"] is None


def test_k0_cheaper_than_plain_anywhere_or_thin_evidence_routes_nothing_around() -> None:
    document, rid = _doc()
    cells = _cells(random.Random(3), k0_e2e=1700.0)
    cells[-1] = Cell("chat", 9, Cohort(), requests(random.Random(4), 300, itl=20.0, e2e=1000.0), "holdout",
                     k0=requests(random.Random(5), 500, itl=15.0, e2e=800.0), k0_engine="draft")
    assert not any(r.kind == "route_instead" for r in recommend(document, rid, cells))
    thin = RecommendConfig(min_samples=600)  # fewer requests than that in every K=0 cohort
    assert not any(r.kind == "route_instead" for r in recommend(document, rid, _cells(random.Random(6),
                                                                                       k0_e2e=1700.0), thin))


def test_routing_around_is_not_proposed_when_the_band_would_then_be_speculated() -> None:
    # The default is the n-gram engine: without the in-engine schedule, chat's large batches would speculate
    # there, which the K=0 tax says nothing about.
    document, rid = _doc(default="ngram")
    recs = recommend(document, rid, _cells(random.Random(7), k0_e2e=1700.0))
    assert not any(r.kind == "route_instead" for r in recs)


def test_the_edit_refuses_an_engine_that_does_not_schedule_in_the_engine() -> None:
    document, _ = _doc()
    for engine, why in (("ngram", "does not schedule"), ("nope", "not defined")):
        with pytest.raises(ValueError, match=why):
            edits.apply_edit(document, {"kind": "route_instead", "engine": engine})


def test_cells_carry_their_k0_cohort_through_a_file() -> None:
    cell = _cells(random.Random(8), k0_e2e=1700.0)[-1]
    again = Cell.from_dict(cell.to_dict())
    assert (again.k0.requests, again.k0_engine) == (500, "draft")
    assert again.k0.e2e == cell.k0.e2e


TWO_ROUTES = """\
apiVersion: specgate/v1
name: pool
engines:
  base: {method: none}
  ngram: {method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 3}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3, schedule: in_engine}
rules:
  - name: chat-small
    when: {route: [chat], batch_size: {max: 4}}
    then: {engine: draft}
  - name: extract-small
    when: {route: [extract], batch_size: {max: 4}}
    then: {engine: draft}
  - name: docs
    when: {route: [extract, summarize]}
    then: {engine: ngram}
default: {engine: base}
"""


def test_routing_around_is_not_proposed_when_another_routes_band_would_then_speculate() -> None:
    # chat's K=0 band is taxed; without the schedule extract's band would fall to the n-gram rule.
    doc = load_policy(TWO_ROUTES)
    recs = recommend(canonical_document(doc), revision_id(doc), _cells(random.Random(9), k0_e2e=1700.0))
    assert not any(r.kind == "route_instead" for r in recs)
    # Without that rule the same evidence routes around.
    plain = load_policy(TWO_ROUTES.replace("    when: {route: [extract, summarize]}\n    then: {engine: ngram}\n",
                                           "    when: {route: [summarize]}\n    then: {engine: ngram}\n"))
    recs = recommend(canonical_document(plain), revision_id(plain), _cells(random.Random(9), k0_e2e=1700.0))
    assert [r.kind for r in recs] == ["route_instead"]


def test_routing_around_is_not_proposed_for_a_schedule_of_several_ks() -> None:
    # K 3 up to batch 4, K 1 up to 16: routed, the engine would draft 3 where the schedule says 1.
    text = IN_ENGINE.format(default="base").replace(
        "    then: {engine: draft}\n",
        "    then: {engine: draft}\n  - name: chat-mid\n    when: {route: [chat], batch_size: {min: 5, max: 16}}\n"
        "    then: {engine: draft, num_speculative_tokens: 1}\n")
    doc = load_policy(text)
    recs = recommend(canonical_document(doc), revision_id(doc), _cells(random.Random(10), k0_e2e=1700.0))
    assert not any(r.kind == "route_instead" for r in recs)

