"""A pre-aggregating exporter (the policy's ``telemetry.raw_sample_rate`` below 1): rollup deltas and a weighted
sample of raw events, through the real control plane, an outage, a restart, a too-large batch and a refusal."""

from __future__ import annotations

import asyncio
import datetime as dt
import gzip
import json
import random
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

import policies
from controlplane.migrations_state import upgrade
from controlplane.models import TelemetryEventRecord, TelemetryRollup
from sidecar.settings import SidecarSettings
from sidecar.telemetry import TelemetryExporter, _Batch, _parse_spool_name, _spool_name
from tests.support.factories import seed_policy
from tests.support.fake_upstream import FakeEngine
from tests.support.fleet_rows import session_for
from tests.support.ingest_double import IngestDouble, exporter_for
from tests.support.ingest_double import event as ingest_event
from tests.support.live import ControlPlane
from tests.support.rollup_check import assert_rollups_equal, recompute
from tests.support.sidecars import SEED, SidecarFactory, seed_bundle, wait_for
from tests.support.telemetry_bodies import random_event
from wire.telemetry import TelemetryEvent


def run(scenario: Awaitable[None]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario, 60)

    asyncio.run(bounded())


async def until(predicate: Any, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def requests(n: int, seed: int) -> list[TelemetryEvent]:
    """Requests of the last few minutes, of worker w1 in pool "a", every key field and counter varying."""
    rng = random.Random(seed)
    t0 = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=12)
    return [TelemetryEvent.model_validate({**random_event(rng, i, t0), "worker_id": "w1", "policy": "seed"})
            for i in range(n)]


def sampled(event: TelemetryEvent, i: int) -> TelemetryEvent:
    """Every fifth request is in the raw sample (weight 5), as the proxy marks one."""
    return event.model_copy(update={"sample_weight": 5.0}) if i % 5 == 0 else event


def test_deltas_and_samples_reach_the_rollups_exactly_through_an_outage_and_a_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    upgrade(url)
    seed_policy(url)
    cp = ControlPlane(url)
    cp.start()
    made = requests(900, 11)

    def exporter() -> TelemetryExporter:
        values = {"control_plane": cp.base, "key": cp.worker_token, "worker_id": "w1", "state_dir": tmp_path / "s",
                  "telemetry_batch_size": 50, "telemetry_flush_s": 0.05, "telemetry_rollup_flush_s": 0.05}
        return TelemetryExporter(SidecarSettings(**values), retry_base_s=0.05, retry_max_s=0.25)

    async def scenario() -> None:
        first = exporter()
        await first.start()
        for i, event in enumerate(made[:300]):
            first.submit(sampled(event, i), aggregate=True)
        await until(lambda: first.counters()["rollups_pending"] == 0 and first.queue_depth() == 0)
        await asyncio.to_thread(cp.stop)  # an outage: deltas and samples go to the spool
        for i, event in enumerate(made[300:600], 300):
            first.submit(sampled(event, i), aggregate=True)
        await until(lambda: first.counters()["rollups_pending"] == 0 and first.counters()["spool_batches"] > 0)
        for i, event in enumerate(made[600:], 600):  # still down when the sidecar stops: spooled at stop
            first.submit(sampled(event, i), aggregate=True)
        await first.stop(flush=False)
        counters = first.counters()
        assert counters["aggregated"] == 900
        assert counters["queued"] == 180  # the sample only
        assert counters["rollups_dropped"] == 0
        assert counters["rollups_made"] > 0
        # The next process finds the spool and sends it once the control plane is back.
        await asyncio.to_thread(cp.start)
        second = exporter()
        await second.start()
        await until(lambda: second.queue_depth() == 0 and second.counters()["spool_batches"] == 0)
        assert second.counters()["rollups_dropped"] == 0
        await second.stop()

    try:
        run(scenario())
    finally:
        cp.stop()
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        assert_rollups_equal(engine, recompute([e.model_dump() for e in made]))
    finally:
        engine.dispose()
    with session_for(url) as session:
        assert session.scalar(select(func.count()).select_from(TelemetryEventRecord)) == 180
        assert session.scalar(select(func.sum(TelemetryEventRecord.sample_weight))) == 900.0
        assert session.scalar(select(func.sum(TelemetryRollup.requests))) == 900


def test_a_batch_too_large_is_split_with_its_deltas_and_the_spool_name_keeps_their_count(tmp_path: Path) -> None:
    exporter = TelemetryExporter(SidecarSettings(control_plane="http://127.0.0.1:9", worker_id="w1",
                                                 state_dir=tmp_path))
    for i, event in enumerate(requests(40, 3)):
        exporter.submit(sampled(event, i), aggregate=True)
    exporter._finish_rollups()
    deltas = list(exporter._delta_memory)
    events = list(exporter._memory)
    assert len(events) == 8
    assert len(deltas) > 4
    batch = exporter._join(events, deltas=deltas)
    assert (batch.count, batch.deltas) == (8, len(deltas))
    halves = exporter._split(batch)
    bodies = [json.loads(gzip.decompress(half.body)) for half in halves]
    assert [half.count for half in halves] == [4, 4]
    assert sum(half.deltas for half in halves) == len(deltas)
    assert [len(body.get("rollups", [])) for body in bodies] == [half.deltas for half in halves]
    ids = [d["delta_id"] for body in bodies for d in body["rollups"]]
    assert sorted(ids) == sorted(json.loads(d)["delta_id"] for d in deltas)  # each once, as encoded
    for half in halves:
        parsed = _parse_spool_name(_spool_name(half, 1))
        assert parsed == (half.batch_id, half.count, half.deltas)
    assert _parse_spool_name(_spool_name(_Batch("b", 3, b""), 2)) == ("b", 3, 0)  # names from before: no deltas
    assert _parse_spool_name("00000000000000000001-000001-b-3+x.json.gz") is None


def test_a_pre_aggregated_policy_sends_every_request_to_the_deltas_and_its_sample_raw_with_weights(
        make_sidecar: SidecarFactory, draft: FakeEngine, base: FakeEngine) -> None:
    document = SEED.read_text() + "\ntelemetry: {raw_sample_rate: 0.25}\n"
    revision = policies.Revision.of(policies.load_policy(document))
    sidecar = make_sidecar(bundle=policies.CompiledBundle(policies.BundlePayload(revision)))
    ids = [f"req-{i}" for i in range(40)]
    for request_id in ids:
        answer = httpx.post(sidecar.url + "/v1/chat/completions", timeout=10,
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                            headers={"X-Specgate-Route": "chat", "X-Request-Id": request_id})
        assert answer.status_code == 200
    wait_for(lambda: len(sidecar.exporter.aggregated) == len(ids))
    current = sidecar.store.current
    assert current is not None
    expected = {request_id for request_id in ids if current.active.raw_sampled(request_id)}
    assert 0 < len(expected) < len(ids)
    assert {e.request_id for e in sidecar.exporter.events} == expected
    assert {e.sample_weight for e in sidecar.exporter.events} == {4.0}
    assert {e.request_id for e in sidecar.exporter.aggregated} == set(ids)
    assert all(e.sample_weight is None for e in sidecar.exporter.aggregated if e.request_id not in expected)


def test_a_policy_without_telemetry_sends_every_event_raw(make_sidecar: SidecarFactory, draft: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=seed_bundle())
    for i in range(5):
        httpx.post(sidecar.url + "/v1/chat/completions", timeout=10,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                   headers={"X-Specgate-Route": "chat", "X-Request-Id": f"r-{i}"})
    wait_for(lambda: len(sidecar.exporter.events) == 5)
    assert sidecar.exporter.aggregated == []
    assert all(e.sample_weight is None for e in sidecar.exporter.events)


def test_the_sample_and_the_deltas_wait_for_the_rollup_flush_and_an_ordinary_event_does_not(tmp_path: Path) -> None:
    async def scenario() -> None:
        ingest = IngestDouble()
        await ingest.start()
        exporter = exporter_for(ingest, tmp_path, telemetry_flush_s=0.05, telemetry_rollup_flush_s=60)
        await exporter.start()
        for i, event in enumerate(requests(20, 5)):
            exporter.submit(sampled(event, i), aggregate=True)
        await asyncio.sleep(0.5)  # ten event flushes
        assert ingest.posts == 0  # one batch a rollup flush, not one a second: what makes it cheap
        ordinary = ingest_event(99)
        exporter.submit(ordinary)
        await until(lambda: ordinary.event_id in ingest.accepted, 5)
        assert ingest.deltas == []  # the running deltas are not finished by an event flush
        assert len(ingest.accepted) == 5  # the sample that waited went with it
        await exporter.stop()
        assert len(ingest.deltas) == exporter.counters()["rollups_made"] > 0  # stop finishes and sends them
        assert exporter.counters()["rollups_sent"] == len(ingest.deltas)
        await ingest.stop()

    run(scenario())
