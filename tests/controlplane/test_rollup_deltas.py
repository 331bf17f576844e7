"""Pre-aggregation at the edge: a worker's rollup deltas and sampled events make the rollups of every request.

A pre-aggregating worker (the policy's ``telemetry.raw_sample_rate`` below 1) sends, per flush, what its
requests added to each rollup key (``wire.telemetry.RollupDelta``) and the raw events of a sample only, each
with its weight. The rollups must come out as if every request had been sent raw (checked against a plain
recomputation from all the requests, tests/support/rollup_check.py), however batches and deltas are replayed;
a bad delta is refused on its own, with its index and the field at fault.
"""

from __future__ import annotations

import datetime as dt
import gzip
import random
from typing import Any

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from analysis.rollup import aggregate, to_wire
from controlplane.db import make_sessionmaker, unit_of_work
from controlplane.models import TelemetryDeltaRecord, TelemetryEventRecord, TelemetryRollup
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry.service import purge
from tests.support.factories import seed_policy
from tests.support.rollup_check import assert_rollups_equal, recompute
from tests.support.telemetry_bodies import event, random_event
from wire.problems import ProblemCode
from wire.telemetry import TelemetryEvent

URL = "/v1/telemetry/batches"
NOW = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
T0 = NOW - dt.timedelta(minutes=30)  # inside the accepted window, and ten minutes of keys


@pytest.fixture
def worker_key(worker_key: dict[str, str], settings: ControlPlaneSettings) -> dict[str, str]:
    """The fleet key, and the policies its events name: "seed" (pool-less) and "other" (pool "a")."""
    seed_policy(settings.database_url)
    seed_policy(settings.database_url, name="other", pool="a")
    return worker_key


def post(client: TestClient, headers: dict[str, str], body: dict[str, Any]) -> httpx.Response:
    raw = gzip.compress(orjson.dumps(body, option=orjson.OPT_UTC_Z))
    return client.post(URL, content=raw, headers={**headers, "Content-Type": "application/json",
                                                  "Content-Encoding": "gzip"})


def deltas_of(events: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """What a worker sends for these requests: one delta per rollup key, as the sidecar builds them."""
    sums = aggregate(TelemetryEvent.model_validate(e) for e in events)
    return [to_wire(key, delta, delta_id=f"{prefix}-{i}", pool="a") for i, (key, delta) in enumerate(sums.items())]


def as_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events as stored rows: every field, defaults included, ``time`` a datetime."""
    return [TelemetryEvent.model_validate(e).model_dump() for e in events]


def test_deltas_and_weighted_samples_make_the_rollups_of_every_request_through_replays(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    rng = random.Random(20261208)
    requests = [random_event(rng, n, T0) for n in range(2400)]
    sent: list[dict[str, Any]] = []
    sampled: dict[str, float] = {}
    flushes = 0
    i = 0
    while i < len(requests):
        chunk = requests[i:i + rng.randint(1, 120)]
        i += len(chunk)
        flushes += 1
        deltas = deltas_of(chunk, f"proc-1-{flushes}")
        raw = []
        for e in chunk:
            if rng.random() < 0.1:  # the sample, each event standing for ten requests
                raw.append({**e, "sample_weight": 10.0})
                sampled[e["event_id"]] = 10.0
        if sent and rng.random() < 0.3:  # deltas sent before (a split, a resend under a new batch id)
            deltas += rng.sample(sent[-1]["rollups"], min(3, len(sent[-1]["rollups"])))
        body = {"batch_id": f"b-{flushes}", "worker_id": "w-1", "schema_version": 1, "events": raw,
                "rollups": deltas}
        answer = post(client, worker_key, body)
        assert answer.status_code == 200, answer.text
        ack = answer.json()
        assert ack["rollups_rejected_count"] == 0, ack
        assert ack["rollups_accepted"] == len(deltas)
        sent.append(body)
        if rng.random() < 0.2:  # a whole batch again
            again = post(client, worker_key, rng.choice(sent)).json()
            assert again["duplicate"] is True
    rows = assert_rollups_equal(db, recompute(as_rows(requests)))
    assert rows > 300  # many keys, so the comparison means something
    with db.connect() as conn:
        stored = dict(conn.execute(select(TelemetryEventRecord.event_id, TelemetryEventRecord.sample_weight)).all())
        delta_records = conn.scalar(select(func.count()).select_from(TelemetryDeltaRecord))
    assert stored == sampled  # only the sample is stored raw, with its weight
    assert delta_records == len({d["delta_id"] for b in sent for d in b["rollups"]})  # each recorded once


def test_a_delta_resent_in_another_batch_is_added_once_and_the_ack_says_so(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    requests = [event(n, time=(T0 + dt.timedelta(seconds=n)).isoformat()) for n in range(5)]
    deltas = deltas_of(requests, "p")
    assert len(deltas) == 1
    first = post(client, worker_key, {"batch_id": "b-1", "worker_id": "w-1", "events": [], "rollups": deltas})
    assert first.json() | {"rollups_stored": 1, "rollups_accepted": 1, "stored": 0, "duplicate": False} == first.json()
    second = post(client, worker_key, {"batch_id": "b-2", "worker_id": "w-1", "events": [], "rollups": deltas * 2})
    assert second.json()["rollups_accepted"] == 2
    assert second.json()["rollups_stored"] == 0
    replay = post(client, worker_key, {"batch_id": "b-1", "worker_id": "w-1", "events": [], "rollups": deltas})
    assert replay.json()["duplicate"] is True
    assert replay.json()["rollups_stored"] == 1  # as answered the first time
    with db.connect() as conn:
        assert conn.scalar(select(func.sum(TelemetryRollup.requests))) == 5
    metrics = client.get("/metrics").text
    assert 'specgate_telemetry_rollup_deltas_total{outcome="stored"} 1.0' in metrics
    assert 'specgate_telemetry_rollup_deltas_total{outcome="already_stored"} 2.0' in metrics
    assert "specgate_telemetry_represented_requests_total 5.0" in metrics


def test_a_bad_delta_is_refused_alone_with_its_index_and_field(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    good = deltas_of([event(n, time=T0.isoformat()) for n in range(3)], "p")[0]
    assert good["counters"]["requests"] == 3

    def changed(delta_id: str, **changes: Any) -> dict[str, Any]:
        return {**good, "delta_id": delta_id, **changes}

    bad = [
        changed("d1", counters={**good["counters"], "ok": 1}),  # ok + errors != requests
        changed("d2", counters={**good["counters"], "tokens": 3}),  # no such counter
        changed("d3", histograms={**good["histograms"], "e2e": {"3": 2}}),  # counts 2 of 3 requests
        changed("d4", minute=T0 + dt.timedelta(seconds=30)),  # not a whole minute
        changed("d5", minute=NOW + dt.timedelta(hours=1)),  # ahead of the clock by more than the skew allowed
        changed("d6", pool="b", policy="other"),  # "other" serves pool "a" only
        changed("d7", policy="nope"),
        changed("d8", counters={**good["counters"], "retries": -1}),
        changed("d9", histograms={"e2e": {"48": 3}}),  # beyond the last bucket
    ]
    body = {"batch_id": "b-bad", "worker_id": "w-1", "events": [], "rollups": [good, *bad]}
    ack = post(client, worker_key, body).json()
    assert ack["rollups_accepted"] == 1, [r["index"] for r in ack["rollups_rejected"]]
    assert ack["rollups_stored"] == 1
    assert ack["rollups_rejected_count"] == len(bad)
    refused = {r["index"]: r["errors"] for r in ack["rollups_rejected"]}
    assert sorted(refused) == list(range(1, len(bad) + 1))
    assert refused[2][0]["path"] == "counters"
    assert "tokens" in refused[2][0]["message"]
    assert "ok + errors" in refused[1][0]["message"]
    assert "histograms.e2e" in refused[3][0]["message"]
    assert refused[4][0]["path"] == "minute"
    assert refused[5][0] | {"path": "minute", "code": ProblemCode.out_of_range} == refused[5][0]
    assert refused[6][0] | {"path": "policy", "code": ProblemCode.wrong_policy} == refused[6][0]
    assert refused[7][0] | {"path": "policy", "code": ProblemCode.wrong_policy} == refused[7][0]
    assert refused[8][0]["path"].startswith("counters")
    assert refused[9][0]["path"].startswith("histograms")
    with db.connect() as conn:
        assert conn.scalar(select(func.sum(TelemetryRollup.requests))) == 3


def test_a_sampled_event_is_stored_with_its_weight_and_not_rolled_up(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    body = {"batch_id": "b-s", "worker_id": "w-1",
            "events": [event("s", time=T0.isoformat(), sample_weight=100.0), event("o", time=T0.isoformat())]}
    ack = post(client, worker_key, body).json()
    assert ack["stored"] == 2
    with db.connect() as conn:
        weights = dict(conn.execute(select(TelemetryEventRecord.event_id, TelemetryEventRecord.sample_weight)).all())
        assert conn.scalar(select(func.sum(TelemetryRollup.requests))) == 1  # the ordinary one only
    assert weights == {"ev-s": 100.0, "ev-o": None}
    for weight in (0.5, 0.0, 2e6):
        refused = post(client, worker_key, {"batch_id": f"b-w{weight}", "worker_id": "w-1",
                                            "events": [event(f"w{weight}", time=T0.isoformat(),
                                                             sample_weight=weight)]}).json()
        assert refused["rejected"][0]["errors"][0]["path"] == "sample_weight", weight


def test_purge_removes_the_delta_records_with_their_rollups(
        client: TestClient, worker_key: dict[str, str], db: Engine, settings: ControlPlaneSettings) -> None:
    old = deltas_of([event(n, time=(NOW - dt.timedelta(days=2)).isoformat()) for n in range(2)], "old")
    new = deltas_of([event(n + 10, time=T0.isoformat()) for n in range(2)], "new")
    assert post(client, worker_key, {"batch_id": "b-p", "worker_id": "w-1", "events": [],
                                     "rollups": old + new}).json()["rollups_stored"] == 2
    with unit_of_work(make_sessionmaker(db)) as session:
        purge(session, NOW - dt.timedelta(days=1))
    with db.connect() as conn:
        left = set(conn.scalars(select(TelemetryDeltaRecord.delta_id)))
        assert conn.scalar(select(func.sum(TelemetryRollup.requests))) == 2
    assert left == {"new-0"}
