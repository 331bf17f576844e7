"""The K=0 tax through the control plane, on both databases: rollups keyed by k0, speedup rows that report
it, a route_instead recommendation that becomes a draft revision, and a what-if that prices the K=0 band."""

from __future__ import annotations

import random
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.db import make_engine
from controlplane.models import Revision
from controlplane.settings import ControlPlaneSettings
from tests.support.telemetry_data import event, lognormal, seed, store

Headers = dict[str, str]

# chat drafts up to batch 4 on an engine that schedules in the engine (K=0 above); plain decisions are
# explored on the n-gram engine, K=0 and drafting decisions on the plain one (the holdout).
IN_ENGINE = """\
apiVersion: specgate/v1
name: seed
engines:
  base: {method: none}
  ngram: {method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 3}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3, schedule: in_engine}
rules:
  - name: chat-low-batch
    when: {route: [chat], batch_size: {max: 4}}
    then: {engine: draft}
default: {engine: base}
exploration: {rate: 0.3, speculative_engine: ngram}
"""


def _on(engine: str, **fields: Any) -> dict[str, Any]:
    e = event(**fields)
    e.update(engine=engine, decided_engine=engine)
    return e


def _traffic(rid: str) -> list[dict[str, Any]]:
    rng = random.Random(18)
    out = []
    for _ in range(300):  # chat at batch 1: the engine drafts
        out.append(_on("draft", revision=rid, batch=1, itl=lognormal(rng, 12.0)))
    for _ in range(150):
        out.append(_on("base", revision=rid, batch=1, speculate=False, explored=True, itl=lognormal(rng, 20.0)))
    for i in range(400):  # chat at batch 12: the engine keeps it, at K=0, and pays for it
        e = _on("draft", revision=rid, batch=12, speculate=False, itl=lognormal(rng, 34.0))
        # a tenth drafted all the same: the engine's own batch dipped below its schedule's threshold
        drafted = 6 if i % 10 == 0 else 0
        e.update(num_speculative_tokens=0, spec_draft_tokens=drafted, spec_accepted_tokens=drafted // 2, spec_steps=0)
        out.append(e)
    for _ in range(200):
        out.append(_on("base", revision=rid, batch=12, speculate=False, explored=True, itl=lognormal(rng, 20.0)))
    # code: plain by default, explored on the n-gram engine, which finds no match for half of them. Those
    # stay n-gram requests: the engine is not scheduled in the engine, and a miss is what n-gram is.
    for i in range(300):
        out.append(_on("base", revision=rid, route="code", batch=1, speculate=False, itl=lognormal(rng, 20.0)))
        if i % 2 == 0:
            e = _on("ngram", revision=rid, route="code", batch=1, explored=True, itl=lognormal(rng, 18.0))
            if i % 4 == 0:
                e.update(spec_draft_tokens=0, spec_accepted_tokens=0, spec_steps=0)
            out.append(e)
    return out


def test_k0_requests_are_their_own_cohort_and_their_tax_routes_the_band_to_the_plain_engine(
        client: TestClient, viewer: Headers, admin: Headers, settings: ControlPlaneSettings) -> None:
    (rid,) = seed(settings.database_url, IN_ENGINE)
    store(settings.database_url, _traffic(rid))

    r = client.get("/v1/telemetry/rollups", params={"policy": "seed", "group_by": "engine,k0"}, headers=viewer)
    assert r.status_code == 200, r.text
    counts = {(g["key"]["engine"], g["key"]["k0"]): g["counters"]["requests"] for g in r.json()["groups"]}
    # by the decision: the n-gram engine's misses were decided to draft, so they are not k0
    assert counts == {("draft", False): 300, ("draft", True): 400, ("base", False): 650, ("ngram", False): 150}
    r = client.get("/v1/telemetry/rollups", params={"policy": "seed", "k0": "true"}, headers=viewer)
    assert r.json()["groups"][0]["counters"]["requests"] == 400

    r = client.get("/v1/analysis/speedups", params={"policy": "seed"}, headers=viewer)
    assert r.status_code == 200, r.text
    rows = {(row["route"], row["batch_bucket"]): row for row in r.json()["rows"]}
    small, large = rows[("chat", 1)], rows[("chat", 9)]
    assert (small["verdict"], small["k0"]) == ("wins", None)
    assert (large["n_speculative"], large["n_plain"]) == (0, 200)  # K=0 is neither cohort
    assert (large["k0"]["engine"], large["k0"]["requests"]) == ("draft", 400)
    assert large["k0"]["drafted_per_request"] == pytest.approx(0.6)
    assert large["k0"]["tax"]["ratio"] == pytest.approx(34 / 20, rel=0.1)
    assert large["k0"]["tax"]["low"] > 1.4
    code = rows[("code", 1)]
    assert (code["n_speculative"], code["k0"]) == (150, None)  # n-gram misses included

    r = client.get("/v1/recommendations", params={"policy": "seed"}, headers=viewer)
    assert r.status_code == 200, r.text
    recs = {rec["kind"]: rec for rec in r.json()["recommendations"]}
    route_instead = recs["route_instead"]
    assert route_instead["edit"] == {"kind": "route_instead", "engine": "draft"}
    assert route_instead["applicable"] is True
    assert route_instead["expected_effect"]["schedule"]["from"] == [[1, 4, 3], [5, 256, 0]]
    r = client.post(f"/v1/recommendations/{route_instead['id']}/apply", params={"policy": "seed"}, headers=admin)
    assert r.status_code == 201, r.text
    draft = r.json()["revision"]
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            doc = conn.execute(select(Revision.document).where(Revision.id == draft)).scalar()
    finally:
        engine.dispose()
    assert "schedule" not in doc["engines"]["draft"]

    # What the draft would do to the recorded traffic: the K=0 band priced at the plain engine's latency.
    r = client.post("/v1/analysis/what-if", json={"policy": "seed", "revision": draft}, headers=viewer)
    assert r.status_code == 200, r.text
    chat = next(row for row in r.json()["routes"] if row["route"] == "chat")
    assert chat["unestimated_requests"] == 0
    assert chat["itl_ms_mean"]["after"] < 0.85 * chat["itl_ms_mean"]["before"]
