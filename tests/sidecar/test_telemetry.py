"""TelemetryExporter against a test double of the control plane's ingestion endpoint, and once against the real one.

The double records batches, deduplicates them by ``batch_id`` as the control
plane's ``POST /v1/telemetry/batches`` does, and can be told to fail, to lose
its answers, or to go down entirely and come back on the same port: failures
the real endpoint cannot be made to produce on demand. One test sends
through the real endpoint (``controlplane.telemetry.endpoints``) across an
outage.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from sidecar.settings import SidecarSettings
from sidecar.telemetry import TelemetryExporter, encode_event
from tests.support.ingest_double import KEY, IngestDouble, event, exporter_for, settings, until
from tests.support.live import free_port
from wire.telemetry import TelemetryBatch


def run(scenario: Awaitable[None]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario, 30)

    asyncio.run(bounded())


def balanced(exporter: TelemetryExporter) -> bool:
    c = exporter.counters()
    return c["queued"] + c["recovered"] == c["sent"] + c["dropped"] + exporter.queue_depth()


def spool_files(state: Path) -> list[Path]:
    return sorted(p for p in (state / "spool").iterdir() if p.name.endswith(".json.gz"))


async def start_against_a_hanging_control_plane(state: Path) -> tuple[IngestDouble, TelemetryExporter]:
    """A started exporter whose POSTs never get an answer; a long flush interval leaves sending to full
    batches and ``stop``, which is what the stop-deadline tests exercise."""
    ingest = IngestDouble()
    await ingest.start()
    ingest.mode = "hang"
    exporter = exporter_for(ingest, state, telemetry_flush_s=60)
    await exporter.start()
    return ingest, exporter


# --- the tests --------------------------------------------------------------------------------

def test_every_event_arrives_exactly_once_across_failures_an_outage_and_lost_answers(tmp_path: Path) -> None:
    async def scenario() -> None:
        ingest = IngestDouble()
        await ingest.start()
        exporter = exporter_for(ingest, tmp_path / "state")
        await exporter.start()
        submitted: list[str] = []
        # 5,000 events over about two seconds; the receiver misbehaves in phases meanwhile.
        phases = {5: "answer_lost", 9: "ok", 12: "unavailable", 20: "down", 35: "up"}
        for round_ in range(50):
            change = phases.get(round_)
            if change == "down":
                await ingest.stop()
            elif change == "up":
                ingest.mode = "ok"
                await ingest.start()
            elif change is not None:
                ingest.mode = change
            for i in range(100):
                e = event(i)
                submitted.append(e.event_id)
                exporter.submit(e)
            assert balanced(exporter)
            await asyncio.sleep(0.04)

        await until(lambda: exporter.queue_depth() == 0)
        counters = exporter.counters()
        assert len(submitted) == 5000
        assert sorted(ingest.accepted) == sorted(submitted)  # every event once, none twice
        assert counters["queued"] == counters["sent"] == 5000
        assert counters["dropped"] == 0
        assert balanced(exporter)
        assert counters["spooled"] > 0
        assert counters["retried"] > 0
        assert counters["send_failures"] > 0
        # Lost answers made the exporter resend batches the receiver had: same batch id, deduplicated.
        assert ingest.duplicates > 0
        assert ingest.gzipped == ingest.posts
        assert spool_files(tmp_path / "state") == []
        await exporter.stop()
        await ingest.stop()

    run(scenario())


def test_spooled_batches_survive_a_restart_and_are_sent_by_the_next_exporter(tmp_path: Path) -> None:
    state = tmp_path / "state"

    async def scenario() -> None:
        ingest = IngestDouble()  # not started: the control plane is down
        first = exporter_for(ingest, state, telemetry_flush_s=60)
        await first.start()
        ids = []
        for i in range(1050):
            e = event(i)
            ids.append(e.event_id)
            first.submit(e)
        await first.stop(flush=True, timeout=2)
        assert first.counters()["sent"] == 0
        assert first.counters()["spooled"] == 1050
        assert first.queue_depth() == 1050
        assert balanced(first)
        assert sum(int(p.name.split("-")[3].split(".")[0]) for p in spool_files(state)) == 1050

        await ingest.start()
        second = exporter_for(ingest, state)
        await second.start()
        assert second.counters()["spool_events"] == second.counters()["recovered"] == 1050  # found on disk
        assert balanced(second)
        await until(lambda: second.queue_depth() == 0)
        assert sorted(ingest.accepted) == sorted(ids)
        assert second.counters()["sent"] == second.counters()["retried"] == 1050
        assert spool_files(state) == []

        # Stopping with the control plane up delivers what is still in memory (flush_s is far away).
        last = [event(i) for i in range(10)]
        for e in last:
            second.submit(e)
        await second.stop(flush=True, timeout=2)
        assert ingest.accepted[-10:] == [e.event_id for e in last]
        assert second.counters()["sent"] == 1060
        assert second.queue_depth() == 0
        assert balanced(second)
        await ingest.stop()

    run(scenario())


def test_a_full_spool_drops_its_oldest_batches_and_counts_them(tmp_path: Path) -> None:
    state = tmp_path / "state"

    async def scenario() -> None:
        ingest = IngestDouble()  # down
        exporter = exporter_for(ingest, state, spool_max_events=1000)
        await exporter.start()
        ids = []
        for i in range(2500):
            e = event(i)
            ids.append(e.event_id)
            exporter.submit(e)
            if i % 100 == 99:
                await asyncio.sleep(0.01)
        await until(lambda: exporter.counters()["spooled"] == 2500)
        counters = exporter.counters()
        assert counters["spool_events"] == 1000
        assert counters["dropped"] == 1500
        assert balanced(exporter)
        await until(lambda: len(spool_files(state)) == 10)  # the files of dropped batches are deleted

        await ingest.start()
        await until(lambda: exporter.queue_depth() == 0)
        # What survived is the newest thousand.
        assert sorted(ingest.accepted) == sorted(ids[1500:])
        assert exporter.counters()["sent"] == 1000
        assert balanced(exporter)
        await exporter.stop()
        await ingest.stop()

    run(scenario())


def test_refusals_drop_what_was_refused_and_nothing_else(tmp_path: Path) -> None:
    async def scenario() -> None:
        ingest = IngestDouble()
        await ingest.start()
        exporter = exporter_for(ingest, tmp_path / "state")
        await exporter.start()

        ingest.mode = "reject_odd"  # a 2xx naming refused events: partial success
        for i in range(10):
            exporter.submit(event(i))
        await until(lambda: exporter.queue_depth() == 0)
        assert exporter.counters()["sent"] == 5
        assert exporter.counters()["dropped"] == 5
        assert len(ingest.accepted) == 5

        ingest.mode = "invalid"  # a 4xx for the batch as a whole: dropped, not spooled, not retried
        for i in range(10):
            exporter.submit(event(i))
        await until(lambda: exporter.queue_depth() == 0)
        c = exporter.counters()
        assert c["dropped"] == 15
        assert c["batches_rejected"] == 1
        assert c["spooled"] == 0
        assert c["retried"] == 0

        ingest.mode = "small"  # 413: split in halves until the batches fit
        ids = []
        for i in range(100):
            e = event(i)
            ids.append(e.event_id)
            exporter.submit(e)
        await until(lambda: exporter.queue_depth() == 0)
        assert sorted(ingest.accepted[5:]) == sorted(ids)
        assert exporter.counters()["sent"] == 105
        assert exporter.counters()["dropped"] == 15

        ingest.mode = "unauthorized"  # a key problem says nothing about the batch: kept and retried
        kept = [event(i) for i in range(10)]
        for e in kept:
            exporter.submit(e)
        await until(lambda: exporter.counters()["spooled"] == 10)
        ingest.mode = "ok"
        await until(lambda: exporter.queue_depth() == 0)
        assert ingest.accepted[-10:] == [e.event_id for e in kept]

        exporter.submit("not an event")  # type: ignore[arg-type]
        assert exporter.counters()["dropped"] == 16
        assert balanced(exporter)
        await exporter.stop()
        await ingest.stop()

    run(scenario())


def test_a_split_batch_carries_its_events_as_they_were_encoded(tmp_path: Path) -> None:
    # A 413 halves a batch without judging its events again: one beyond the contract's limits (an engine that
    # reported 2**40 prompt tokens) is the control plane's to refuse by its index, not a reason to fail the split.
    exporter = TelemetryExporter(SidecarSettings(control_plane=f"http://127.0.0.1:{free_port()}", key=KEY,
                                                 worker_id="w1", state_dir=tmp_path))
    events = [event(i) for i in range(5)]
    events[3].prompt_tokens = 2**40
    halves = exporter._split(exporter._join([encode_event(e) for e in events], "b-whole"))
    decoded = [json.loads(gzip.decompress(half.body)) for half in halves]
    assert [(half.batch_id, half.count) for half in halves] == [("b-whole.0", 2), ("b-whole.1", 3)]
    assert [d["batch_id"] for d in decoded] == ["b-whole.0", "b-whole.1"]
    assert [e["event_id"] for d in decoded for e in d["events"]] == [e.event_id for e in events]
    assert decoded[1]["events"][1]["prompt_tokens"] == 2**40
    assert TelemetryBatch.model_validate(decoded[0]).events == events[:2]


def test_memory_over_its_bound_spills_to_the_spool_while_the_control_plane_is_slow(tmp_path: Path) -> None:
    async def scenario() -> None:
        ingest = IngestDouble()
        await ingest.start()
        ingest.mode = "slow"
        exporter = TelemetryExporter(settings(ingest, tmp_path / "state"), memory_max_events=300,
                                     retry_base_s=0.05, retry_max_s=0.25)
        await exporter.start()
        ids = []
        t0 = time.perf_counter()
        for i in range(1000):
            e = event(i)
            ids.append(e.event_id)
            exporter.submit(e)
        assert time.perf_counter() - t0 < 0.5  # submit never waits for the network
        # The sender is stuck in a slow POST; the spill moves the oldest events to disk meanwhile.
        await until(lambda: exporter.counters()["memory_events"] <= 150, timeout=0.25)
        assert exporter.counters()["spooled"] >= 700
        assert balanced(exporter)
        ingest.mode = "ok"
        await until(lambda: exporter.queue_depth() == 0)
        assert sorted(ingest.accepted) == sorted(ids)
        assert exporter.counters()["dropped"] == 0
        assert balanced(exporter)
        await exporter.stop()
        await ingest.stop()

    run(scenario())


def test_stop_spools_what_a_hanging_control_plane_did_not_take_in_time(tmp_path: Path) -> None:
    async def scenario() -> None:
        ingest, exporter = await start_against_a_hanging_control_plane(tmp_path / "state")
        for i in range(150):
            exporter.submit(event(i))
        await until(lambda: ingest.posts == 1)  # the first full batch is stuck in its POST
        t0 = time.perf_counter()
        await exporter.stop(flush=True, timeout=0.3)
        assert time.perf_counter() - t0 < 2
        counters = exporter.counters()
        assert counters["spooled"] == 150
        assert counters["sent"] == 0
        assert exporter.queue_depth() == 150
        assert balanced(exporter)
        assert len(spool_files(tmp_path / "state")) == 2
        await ingest.stop()

    run(scenario())


def test_stop_saves_a_batch_whose_delivery_could_not_be_cancelled_in_time(tmp_path: Path) -> None:
    async def scenario() -> None:
        ingest, exporter = await start_against_a_hanging_control_plane(tmp_path / "state")

        async def stuck_spool_write(batch: Any) -> None:
            await asyncio.sleep(3600)  # a disk that stalls: the sender never finishes on its own

        exporter._spool_write = stuck_spool_write  # type: ignore[method-assign]
        for i in range(120):
            exporter.submit(event(i))
        await until(lambda: ingest.posts == 1)
        await exporter.stop(flush=True, timeout=0.2)
        counters = exporter.counters()
        assert counters["spooled"] == 120
        assert counters["sent"] + counters["dropped"] == 0
        assert balanced(exporter)
        spooled = sorted(spool_files(tmp_path / "state"))
        ids = [e["request_id"] for p in spooled for e in json.loads(gzip.decompress(p.read_bytes()))["events"]]
        assert sorted(ids) == sorted(event(i).request_id for i in range(120))
        await ingest.stop()

    run(scenario())


def test_against_the_real_control_plane_through_an_outage(tmp_path: Path) -> None:
    from sqlalchemy import func, select

    from controlplane.migrations_state import upgrade
    from controlplane.models import TelemetryEventRecord
    from tests.support.factories import seed_policy
    from tests.support.fleet_rows import session_for
    from tests.support.live import ControlPlane

    url = f"sqlite:///{tmp_path / 'cp.db'}"
    upgrade(url)
    seed_policy(url)  # the policy the events name
    cp = ControlPlane(url)
    cp.start()

    async def scenario() -> None:
        values = {"control_plane": cp.base, "key": cp.worker_token, "worker_id": "w1", "state_dir": tmp_path / "s",
                  "telemetry_batch_size": 100, "telemetry_flush_s": 0.05}
        exporter = TelemetryExporter(SidecarSettings(**values), retry_base_s=0.05, retry_max_s=0.25)
        await exporter.start()
        for i in range(250):
            exporter.submit(event(i))
        await until(lambda: exporter.counters()["sent"] == 250)
        await asyncio.to_thread(cp.stop)
        for i in range(100):
            exporter.submit(event(i))
        await until(lambda: exporter.counters()["spool_events"] == 100)
        await asyncio.to_thread(cp.start)
        await until(lambda: exporter.queue_depth() == 0)
        counters = exporter.counters()
        assert counters["sent"] == 350
        assert counters["dropped"] == 0
        await exporter.stop()

    try:
        run(scenario())
    finally:
        cp.stop()
    with session_for(url) as session:
        assert session.scalar(select(func.count()).select_from(TelemetryEventRecord)) == 350


def test_the_refusal_count_is_the_control_planes_total_not_the_listed_few() -> None:
    from sidecar.telemetry import _rejected_count

    answer = json.dumps({"accepted": 470, "rejected": [{"index": i} for i in range(20)],
                         "rejected_count": 30}).encode()
    count, reasons = _rejected_count(answer, 500)
    assert count == 30
    assert len(reasons) == 3
