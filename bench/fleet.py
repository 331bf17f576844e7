"""A simulated fleet against the real control plane on PostgreSQL: propagation and telemetry at scale.

Run ``python -m bench.fleet --workers 1000 --seconds 60 --out /tmp/fleet.json``
(``--help`` for the knobs). It:

1. makes a throw-away PostgreSQL database, migrated, with one pool-less
   policy (revision A active, B a draft), a worker key bound to the pool
   ``bench`` and an operator key (``bench.propagation.seed``), and starts the
   control plane as its own process (``bench.propagation.control_plane``:
   uvicorn with ``controlplane.app:create_app``);
2. runs ``--workers`` simulated sidecars as asyncio tasks in this process,
   each doing what ``sidecar/sync.py`` and ``sidecar/telemetry.py`` do over
   HTTP, with their defaults (``SidecarSettings``): register
   (``POST /v1/workers/register``); long-poll ``GET /v1/bundle`` with
   ``If-None-Match`` and ``wait``; listen on ``GET /v1/bundle/events`` (SSE,
   ``--no-sse`` to leave it out), whose notices cut a waiting long-poll short;
   heartbeat every ``heartbeat_s`` and at once after a new bundle; and send
   telemetry for ``--rps-per-worker`` represented requests a second, batched
   as the exporter batches (every ``telemetry_flush_s``, or sooner when
   ``telemetry_batch_size`` events wait), gzip-compressed with an
   ``Idempotency-Key``, a batch that fails (network, timeout, 408/429/5xx)
   sent again under its id after a backoff. A fleet that is not up (every
   worker holding a bundle) within ``--setup-timeout`` ends the run with a
   report of how far it got and what failed;
3. after ``--warmup`` seconds measures a window of ``--seconds``: the control
   plane's CPU (``/proc/PID/stat``), the CPU of the PostgreSQL backends that
   serve this database (sampled every half second, so a backend that exits
   keeps what it used until its last sample), the growth of the telemetry
   tables (``pg_total_relation_size``, partitions included), the events
   stored, and what the simulator itself managed (offered against generated
   and delivered requests, its own CPU, its event loop's lag), while
   ``--publishes``
   changes (a kill-switch flip, then a rollback, alternately; spread over the
   window) are timed from the publish request to the last worker holding the
   new ETag;
4. stops generating, lets the workers deliver what they hold (at most
   ``--drain-timeout`` seconds), stops, and checks in the database that every
   event the control plane acknowledged is stored once and counted in the
   rollups.

Telemetry modes (``--mode``): ``raw`` sends one event per request, as the
sidecar does under a policy without a ``telemetry`` section; ``deltas`` gives
the fleet's policy ``telemetry: {raw_sample_rate: R}`` (``--raw-sample-rate``,
0.01 by default) and each worker sends what sidecar/telemetry.py sends then:
rollup deltas of every request (``analysis.rollup.aggregate`` into its running
deltas, finished with ``to_wire`` every ``--delta-flush-s``, by default the
sidecar's ``telemetry_rollup_flush_s``) plus the sampled events
(``CompiledPolicy.raw_sampled``) with their ``sample_weight``, held until the
deltas go (or a batch is full), as the exporter holds them; ``off`` sends none (the fleet's cost without
telemetry: long-polls, streams, heartbeats, publishes). Several modes,
comma-separated (``--mode raw,deltas``), run one after the other, each on a
fresh database and control plane (``--rounds`` repeats the sequence), and end
with a comparison: represented requests (what the rollups gained), events
stored, control-plane and PostgreSQL CPU per 1,000 represented requests,
represented requests per control-plane CPU-second, table growth per million,
and deltas against raw. Every run checks that the rollups count exactly the
requests the workers represented.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gzip
import json
import os
import random
import secrets
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson
import yaml
from sqlalchemy import Connection, Engine, create_engine, text, update
from sqlalchemy.engine import make_url

from analysis.rollup import RollupDelta as Sums
from analysis.rollup import RollupKey, aggregate, to_wire
from bench.ingest import make_event, process_tree_cpu_s
from bench.machine import machine_facts
from bench.propagation import (
    GOAL_P99_S,
    POLICY,
    POOL,
    BenchError,
    Fixture,
    Round,
    Server,
    check_bundle,
    control_plane,
    environment,
    fresh_database,
    loadavg,
    machine_cpu,
    percentile,
    policy_text,
    seed_policy,
    summarize,
)
from bench.propagation import _loop_factory as loop_factory
from controlplane.auth.local import mint_keys
from controlplane.auth.schemas import Scope
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.models import FleetState
from policies import BundlePayload, CompiledPolicy, Revision, load_policy
from sidecar.settings import SidecarSettings
from sidecar.support import Backoff
from sidecar.sync import LONG_POLL_GRACE_S, REQUEST_TIMEOUT_S, SSE_READ_TIMEOUT_S, normalize_etag, sidecar_version
from sidecar.telemetry import BATCHES_PATH, GZIP_LEVEL, RETRY_STATUSES, encode_event
from wire.telemetry import EVENT_SCHEMA_VERSION, TelemetryBatch, TelemetryEvent

DEFAULT_POSTGRES_URL = os.environ.get("SPECGATE_BENCH_POSTGRES_URL",
                                      "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
TELEMETRY_TABLES = ("telemetry_events", "telemetry_rollups", "telemetry_rollup_histograms", "telemetry_batches",
                    "telemetry_rollup_deltas")
MODES = ("raw", "deltas", "off")
SAMPLE_S = 0.5
# Issue 20: pre-aggregated at 1 % samples, this many times the represented requests per control-plane CPU-second.
GOAL_DELTAS_OVER_RAW = 50.0
LAG_TICK_S = 0.1
# The exporter's defaults (sidecar/telemetry.py: TelemetryExporter.__init__).
TELEMETRY_RETRY_BASE_S, TELEMETRY_RETRY_MAX_S, TELEMETRY_TIMEOUT_S = 0.5, 10.0, 10.0


def _sidecar_default(name: str) -> Any:
    return SidecarSettings.model_fields[name].default


@dataclass
class FleetConfig:
    workers: int = 1000
    seconds: float = 60.0
    publishes: int = 10
    rps_per_worker: float = 2.0
    mode: str = "raw"
    # deltas mode: the policy's telemetry.raw_sample_rate, and how often a worker finishes its running deltas
    # (sidecar/telemetry.py: telemetry_rollup_flush_s; 0: at every flush)
    raw_sample_rate: float = 0.01
    delta_flush_s: float = _sidecar_default("telemetry_rollup_flush_s")
    sse: bool = True
    warmup_s: float = 5.0
    heartbeat_s: float = _sidecar_default("heartbeat_s")
    long_poll_s: float = _sidecar_default("long_poll_s")
    batch_size: int = _sidecar_default("telemetry_batch_size")
    flush_s: float = _sidecar_default("telemetry_flush_s")
    publish_timeout_s: float = 30.0
    setup_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    register_concurrency: int = 32
    # Sidecars come up over this many seconds (0: all at once, as after a fleet-wide restart).
    ramp_s: float = 0.0
    seed: int = 20261220


# --- what a batch holds ------------------------------------------------------------------------


@dataclass(slots=True)
class OutgoingBatch:
    batch_id: str
    path: str
    body: bytes  # gzip-compressed
    events: int  # rows it asks the control plane to store
    requests: int  # requests it represents
    deltas: int = 0  # rollup deltas it carries


class TelemetryShape(Protocol):
    """How a worker turns the requests it served into batches: the one place a mode differs."""

    name: str

    def batches(self, worker: SimWorker, requests: int, now: float) -> list[OutgoingBatch]: ...


class RawTelemetry:
    """One event per request (what sidecar/telemetry.py sends today), ``batch_size`` events a batch at most."""

    name = "raw"

    def __init__(self, batch_size: int, run: str) -> None:
        self.batch_size = batch_size
        self.run = run

    def batches(self, worker: SimWorker, requests: int, now: float) -> list[OutgoingBatch]:
        at = dt.datetime.fromtimestamp(now, dt.UTC)
        events = []
        for i in range(requests):
            worker.sequence += 1
            values = make_event(worker.rng, f"{self.run}-{worker.index}-{worker.sequence}", worker.id,
                                # a few ms apart, oldest first: requests finish one after another
                                at - dt.timedelta(milliseconds=(requests - 1 - i) * 7))
            values.update(pool=POOL, policy=POLICY, revision=worker.revision or "", kill_switch=worker.kill_switch)
            events.append(TelemetryEvent.model_validate(values))
        out = []
        for start in range(0, len(events), self.batch_size):
            chunk = events[start:start + self.batch_size]
            batch = TelemetryBatch(batch_id=uuid.uuid4().hex, worker_id=worker.id, events=chunk)
            out.append(OutgoingBatch(batch.batch_id, BATCHES_PATH, gzip.compress(batch.to_json(), GZIP_LEVEL, mtime=0),
                                     len(chunk), len(chunk)))
        return out


class DeltaTelemetry:
    """Pre-aggregated (the policy's ``telemetry.raw_sample_rate`` below 1), as sidecar/telemetry.py sends it.

    Every request goes into the worker's running rollup deltas (``analysis.rollup.aggregate(..., into=)``);
    the sampled ones (``CompiledPolicy.raw_sampled``) also go as events carrying ``sample_weight``. The running
    deltas are finished (``to_wire``, an id of the worker's sequence) every ``delta_flush_s`` (the sidecar's
    ``telemetry_rollup_flush_s``), and the sampled events wait for them unless a batch's worth is held, as the
    exporter does. A batch carries at most ``batch_size`` events and ``batch_size`` deltas.
    """

    name = "deltas"

    def __init__(self, batch_size: int, run: str, policies: dict[str, CompiledPolicy], delta_flush_s: float) -> None:
        self.batch_size = batch_size
        self.run = run
        self.policies = policies  # by revision id
        self.delta_flush_s = delta_flush_s

    def batches(self, worker: SimWorker, requests: int, now: float) -> list[OutgoingBatch]:
        at = dt.datetime.fromtimestamp(now, dt.UTC)
        policy = self.policies[worker.revision or ""]
        weight = 1.0 / policy.raw_sample_rate
        events = []
        for i in range(requests):
            worker.sequence += 1
            values = make_event(worker.rng, f"{self.run}-{worker.index}-{worker.sequence}", worker.id,
                                at - dt.timedelta(milliseconds=(requests - 1 - i) * 7))
            values.update(pool=POOL, policy=POLICY, revision=worker.revision or "", kill_switch=worker.kill_switch)
            if policy.raw_sampled(values["request_id"]):
                values["sample_weight"] = weight
            events.append(TelemetryEvent.model_validate(values))
        aggregate(events, into=worker.running)
        worker.held.extend(encode_event(e) for e in events if e.sample_weight is not None)
        deltas: list[tuple[bytes, int]] = []
        if not worker.deltas_finished_at:
            # Workers started at different moments: their held deltas do not all fall due at once.
            worker.deltas_finished_at = now - worker.rng.random() * self.delta_flush_s
        due = worker.final_flush or now - worker.deltas_finished_at >= self.delta_flush_s
        if due and worker.running:
            running, worker.running = worker.running, {}
            worker.deltas_finished_at = now
            for key, sums in running.items():
                worker.delta_seq += 1
                delta = to_wire(key, sums, delta_id=f"{self.run}-{worker.index}-{worker.delta_seq}", pool=POOL)
                deltas.append((orjson.dumps(delta, option=orjson.OPT_UTC_Z), sums.totals.requests))
        sampled: list[bytes] = []
        if due or len(worker.held) >= self.batch_size:
            sampled, worker.held = worker.held, []
        out = []
        head = orjson.dumps({"batch_id": "", "worker_id": worker.id, "schema_version": EVENT_SCHEMA_VERSION})
        for start in range(0, max(len(sampled), len(deltas)), self.batch_size):
            part = sampled[start:start + self.batch_size]
            ride = deltas[start:start + self.batch_size]
            batch_id = uuid.uuid4().hex
            # The exporter's _join: the envelope, the events as encoded, the deltas; gzip level 1.
            parts = [head[:-1].replace(b'"batch_id":""', f'"batch_id":"{batch_id}"'.encode()),
                     b',"events":[', b",".join(part), b'],"rollups":[', b",".join(d for d, _ in ride), b"]}"]
            out.append(OutgoingBatch(batch_id, BATCHES_PATH, gzip.compress(b"".join(parts), GZIP_LEVEL, mtime=0),
                                     len(part), sum(n for _, n in ride), len(ride)))
        return out


def fleet_policy_text(threshold: int, raw_sample_rate: float) -> str:
    """bench.propagation's policy, pre-aggregated below a rate of 1 (``telemetry.raw_sample_rate``)."""
    document = yaml.safe_load(policy_text(threshold))
    if raw_sample_rate < 1.0:
        document["telemetry"] = {"raw_sample_rate": raw_sample_rate}
    return yaml.safe_dump(document, sort_keys=False)


def seed(url: str, raw_sample_rate: float = 1.0) -> tuple[Fixture, dict[str, CompiledPolicy]]:
    """bench.propagation.seed with the fleet's policy: revision A active, B a draft, keys, expected ETags; and
    the revisions compiled as a worker compiles its bundle (the raw sample's salt comes from the cohort
    secret)."""
    texts = [fleet_policy_text(4 + i, raw_sample_rate) for i in range(2)]
    revisions = seed_policy(url, texts)
    keys = mint_keys(url, {"bench-workers": Scope.worker, "bench-operator": Scope.operator}, created_by="bench",
                     pools={"bench-workers": POOL})
    cohort_secret = secrets.token_hex(32)
    engine = make_engine(url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            session.execute(update(FleetState).where(FleetState.id == 1).values(cohort_secret=cohort_secret))
    finally:
        engine.dispose()
    etags, compiled = {}, {}
    for rid, source in zip(revisions, texts, strict=True):
        document = load_policy(source)
        revision = Revision.of(document)
        if revision.id != rid:
            raise BenchError(f"revision {rid} was stored, the document hashes to {revision.id}")
        compiled[rid] = CompiledPolicy(document, rid, cohort_secret=cohort_secret)
        for kill_switch in (False, True):
            etags[(rid, kill_switch)] = BundlePayload(revision, None, kill_switch, cohort_secret).etag
    return Fixture(keys["bench-workers"], keys["bench-operator"], revisions, etags), compiled


# --- the simulated workers ----------------------------------------------------------------------


@dataclass(eq=False)
class SimWorker:
    index: int
    id: str
    rng: random.Random
    sync: aiohttp.ClientSession | None = None  # long-poll, SSE, heartbeats: PolicySync's session
    export: aiohttp.ClientSession | None = None  # telemetry: the exporter's own session
    etag: str | None = None
    revision: str | None = None
    kill_switch: bool = False
    # The long-poll in flight asks about this ETag (set just before it is sent).
    polling_with: str | None = None
    sequence: int = 0
    # deltas mode: the running rollup deltas, their sequence, when they were last finished, and whether this
    # is the last flush (the drain: whatever runs is finished now)
    running: dict[RollupKey, Sums] = field(default_factory=dict)
    delta_seq: int = 0
    deltas_finished_at: float = 0.0
    final_flush: bool = False
    held: list[bytes] = field(default_factory=list)  # sampled events waiting for the deltas
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    heartbeat_now: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    telemetry_task: asyncio.Task[None] | None = None


@dataclass
class Accounting:
    """What the simulator offered, did and saw; snapshots at the window's edges give rates."""

    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)
    batch_latencies: list[tuple[float, float]] = field(default_factory=list)  # (monotonic end, seconds)
    loop_lags: list[tuple[float, float]] = field(default_factory=list)

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.error_examples) < 20:
            self.error_examples.append(f"{kind}: {detail[:200]}")


class SetupIncomplete(BenchError):
    """The fleet did not come up in time: the control plane's first limit, reported rather than measured past."""


class Fleet:
    def __init__(self, server: Server, fixture: Fixture, config: FleetConfig, shape: TelemetryShape | None) -> None:
        self.base = server.url
        self.fixture = fixture
        self.config = config
        self.shape = shape
        self.auth = {"Authorization": f"Bearer {fixture.worker_token}"}
        self.workers = [SimWorker(i, f"fleet-{i:05d}", random.Random(config.seed * 1_000_003 + i))
                        for i in range(config.workers)]
        # Which (revision, kill switch) each ETag stands for: heartbeats report the revision, events carry it.
        self.states = {etag: state for state, etag in fixture.etags.items()}
        self.acc = Accounting()
        self.round: Round | None = None
        self.unexpected: list[tuple[str, str]] = []
        self.generating = True
        self.first_bundle = asyncio.Event()
        self.holding = 0
        self.registered = 0

    # --- life cycle

    async def start(self) -> None:
        gate = asyncio.Semaphore(self.config.register_concurrency)

        async def begin(worker: SimWorker) -> None:
            await asyncio.sleep(self.config.ramp_s * worker.index / len(self.workers))
            # Connections as a sidecar holds them: PolicySync and the exporter each have a session of their own.
            worker.sync = aiohttp.ClientSession(self.base, connector=aiohttp.TCPConnector(limit=0))
            worker.export = aiohttp.ClientSession(self.base, connector=aiohttp.TCPConnector(limit=0))
            async with gate:
                await self.register(worker)
            self.registered += 1
            worker.tasks = [asyncio.create_task(self.poll_loop(worker))]
            if self.config.sse:
                worker.tasks.append(asyncio.create_task(self.sse_loop(worker)))
            worker.tasks.append(asyncio.create_task(self.heartbeat_loop(worker)))

        async def everyone() -> None:
            await asyncio.gather(*(begin(w) for w in self.workers))
            await self.first_bundle.wait()

        try:
            await asyncio.wait_for(everyone(), self.config.setup_timeout_s)
        except TimeoutError:
            raise SetupIncomplete(f"{self.registered} workers registered, {self.holding} of {len(self.workers)} "
                                  f"got a first bundle in {self.config.setup_timeout_s:g}s") from None

    def start_telemetry(self) -> None:
        if self.shape is None:
            return
        interval = self.telemetry_interval()
        for worker in self.workers:
            # Sidecars start at different moments: their flushes do not line up.
            worker.telemetry_task = asyncio.create_task(
                self.telemetry_loop(worker, worker.rng.random() * interval))

    def telemetry_interval(self) -> float:
        # The exporter sends every flush interval, or as soon as a batch is full.
        if self.config.rps_per_worker <= 0:
            return self.config.flush_s
        return min(self.config.flush_s, self.config.batch_size / self.config.rps_per_worker)

    async def drain(self) -> bool:
        """Stop generating; wait until every worker has delivered what it holds. True when all did in time."""
        self.generating = False
        tasks = [w.telemetry_task for w in self.workers if w.telemetry_task is not None]
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=self.config.drain_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return not pending

    async def stop(self) -> None:
        tasks = [t for w in self.workers for t in (*w.tasks, w.telemetry_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in self.workers:
            for session in (worker.sync, worker.export):
                if session is not None:
                    await session.close()

    # --- the sync loops (sidecar/sync.py)

    async def register(self, worker: SimWorker) -> None:
        assert worker.sync is not None
        body = {"id": worker.id, "pool": POOL, "labels": {"bench": "fleet"}, "kind": "worker",
                "engines": {"base": f"127.0.0.1:{8100 + worker.index % 50}",
                            "draft": f"127.0.0.1:{8102 + worker.index % 50}"},
                "sidecar_version": sidecar_version()[:64]}
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                async with worker.sync.post("/v1/workers/register", json=body, headers=self.auth,
                                            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
                    answer = await resp.read()
                    self.acc.counts[f"register.{resp.status}"] += 1
                    if resp.status in (200, 201):
                        return
                    if resp.status < 500 and resp.status not in RETRY_STATUSES:
                        raise BenchError(f"registering {worker.id}: HTTP {resp.status} {answer[:300]!r}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.acc.error("register", f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(backoff.next())

    async def poll_loop(self, worker: SimWorker) -> None:
        assert worker.sync is not None
        session = worker.sync
        backoff = Backoff(0.1, 5.0)
        wait = self.config.long_poll_s
        timeout = aiohttp.ClientTimeout(total=wait + LONG_POLL_GRACE_S, sock_connect=REQUEST_TIMEOUT_S)
        while True:
            headers = dict(self.auth)
            params = {"worker": worker.id}
            if worker.etag is not None:
                headers["If-None-Match"] = f'"{worker.etag}"'
                params["wait"] = f"{wait:g}"
            worker.wake.clear()
            worker.polling_with = worker.etag

            async def fetch(params: dict[str, str], headers: dict[str, str]) -> tuple[int, str, bytes, float]:
                async with session.get("/v1/bundle", params=params, headers=headers, timeout=timeout) as resp:
                    body = await resp.read()
                    return resp.status, normalize_etag(resp.headers.get("ETag", "")), body, time.monotonic()

            request = asyncio.create_task(fetch(params, headers))
            if self.config.sse:
                woken = asyncio.create_task(worker.wake.wait())
                try:
                    await asyncio.wait({request, woken}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                    if not request.done():
                        # As the sidecar does: a change notice means this long-poll may sit on a dead
                        # connection, so it is dropped and asked again at once.
                        request.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await request
                if request.cancelled():
                    self.acc.counts["bundle.superseded"] += 1
                    continue
            else:
                await asyncio.wait({request})
            worker.polling_with = None
            try:
                status, etag, body, at = request.result()
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.acc.error("bundle", f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(backoff.next())
                continue
            self.acc.counts[f"bundle.{status}"] += 1
            if status == 304:
                continue
            if status != 200:
                self.acc.error("bundle", f"HTTP {status} {body[:200]!r}")
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            self.arrived(worker, etag, at, body)

    def arrived(self, worker: SimWorker, etag: str, at: float, body: bytes) -> None:
        if etag == worker.etag:
            return
        first = worker.etag is None
        state = self.states.get(etag)
        if state is None:
            self.unexpected.append((worker.id, etag))
            return
        worker.etag = etag
        worker.revision, worker.kill_switch = state
        worker.heartbeat_now.set()  # the sidecar reports a new bundle at once
        current = self.round
        if current is not None:
            if not current.arrive(worker.id, etag, at, body):
                # A publish that timed out reaching this worker: late, not wrong.
                self.acc.counts["bundle.late_or_skipped"] += 1
        elif not first:
            self.unexpected.append((worker.id, etag))
        if first:
            self.holding += 1
            if self.holding == len(self.workers):
                self.first_bundle.set()

    async def sse_loop(self, worker: SimWorker) -> None:
        assert worker.sync is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=SSE_READ_TIMEOUT_S)
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                async with worker.sync.get("/v1/bundle/events", params={"worker": worker.id},
                                           headers={**self.auth, "Accept": "text/event-stream"},
                                           timeout=timeout) as resp:
                    self.acc.counts[f"sse.{resp.status}"] += 1
                    if resp.status != 200:
                        self.acc.error("sse", f"HTTP {resp.status} {(await resp.read())[:200]!r}")
                    else:
                        backoff.reset()
                        event, data = "", ""
                        async for raw in resp.content:
                            line = raw.decode("utf-8", "replace").rstrip("\r\n")
                            if not line:
                                if event == "bundle":
                                    self.acc.counts["sse.notices"] += 1
                                    with contextlib.suppress(ValueError, KeyError, TypeError):
                                        if normalize_etag(str(json.loads(data)["etag"])) != worker.etag:
                                            worker.wake.set()
                                event, data = "", ""
                            elif line.startswith("event:"):
                                event = line[6:].strip()
                            elif line.startswith("data:"):
                                data = line[5:].strip()
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.acc.error("sse", f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(backoff.next())

    async def heartbeat_loop(self, worker: SimWorker) -> None:
        assert worker.sync is not None
        while True:
            body = {"active_revision": worker.revision, "active_etag": worker.etag,
                    "in_flight": worker.rng.randint(0, 8)}
            try:
                async with worker.sync.post(f"/v1/workers/{worker.id}/heartbeat", json=body, headers=self.auth,
                                            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
                    await resp.read()
                    self.acc.counts[f"heartbeat.{resp.status}"] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.acc.error("heartbeat", f"{type(exc).__name__}: {exc}")
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns when the event is set in the same
            # turn as a cancel, swallowing it, and stop() then waited for ever on a loop that went on heartbeating.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.heartbeat_s):
                    await worker.heartbeat_now.wait()
            worker.heartbeat_now.clear()

    # --- telemetry (sidecar/telemetry.py)

    async def telemetry_loop(self, worker: SimWorker, phase: float) -> None:
        assert self.shape is not None
        assert worker.export is not None
        interval = self.telemetry_interval()
        rate = self.config.rps_per_worker
        await asyncio.sleep(phase)
        last = time.monotonic()
        owed = 0.0
        queue: list[OutgoingBatch] = []
        backoff = Backoff(TELEMETRY_RETRY_BASE_S, TELEMETRY_RETRY_MAX_S)
        next_at = last + interval
        while self.generating or queue or ((worker.running or worker.held) and not worker.final_flush):
            if not self.generating and not worker.final_flush:
                # The drain: deltas still running (held past a flush by --delta-flush-s) go now.
                worker.final_flush = True
                queue.extend(self.shape.batches(worker, 0, time.time()))
            if self.generating:
                # Requests arrive whether or not the last batch went out: a slow control plane makes
                # bigger (or more) batches, never fewer requests.
                now = time.monotonic()
                owed += rate * (now - last)
                last = now
                count = int(owed)
                owed -= count
                if count:
                    self.acc.counts["requests.generated"] += count
                    queue.extend(self.shape.batches(worker, count, time.time()))
            while queue:
                batch = queue[0]
                outcome = await self.post_batch(worker.export, worker.id, batch)
                if outcome == "retry":
                    await asyncio.sleep(backoff.next())
                    break
                backoff.reset()
                queue.pop(0)
            if self.generating:
                next_at += interval
                delay = next_at - time.monotonic()
                if delay < -interval:  # fell behind by more than a period: do not try to catch up in a burst
                    next_at = time.monotonic()
                await asyncio.sleep(max(0.0, delay))

    async def post_batch(self, session: aiohttp.ClientSession, worker_id: str, batch: OutgoingBatch) -> str:
        headers = {**self.auth, "Content-Type": "application/json", "Content-Encoding": "gzip",
                   "Idempotency-Key": batch.batch_id}
        started = time.monotonic()
        try:
            async with session.post(batch.path, data=batch.body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=TELEMETRY_TIMEOUT_S)) as resp:
                status, answer = resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.acc.error("telemetry", f"{type(exc).__name__}: {exc}")
            self.acc.counts["telemetry.retries"] += 1
            return "retry"
        ended = time.monotonic()
        self.acc.counts[f"telemetry.{status}"] += 1
        self.acc.batch_latencies.append((ended, ended - started))
        if 200 <= status < 300:
            ack = json.loads(answer)
            self.acc.counts["telemetry.batches_acked"] += 1
            self.acc.counts["telemetry.events_acked"] += batch.events
            self.acc.counts["telemetry.requests_acked"] += batch.requests
            self.acc.counts["telemetry.deltas_acked"] += batch.deltas
            self.acc.counts["telemetry.deltas_stored"] += int(ack.get("rollups_stored") or 0)
            self.acc.counts["telemetry.deltas_rejected"] += int(ack.get("rollups_rejected_count") or 0)
            self.acc.counts["telemetry.events_stored"] += int(ack.get("stored", 0))
            self.acc.counts["telemetry.events_rejected"] += int(ack.get("rejected_count", 0))
            self.acc.counts["telemetry.duplicate_batches"] += bool(ack.get("duplicate"))
            return "sent"
        if status >= 500 or status in RETRY_STATUSES:
            self.acc.counts["telemetry.retries"] += 1
            return "retry"
        self.acc.error("telemetry", f"{worker_id}: batch {batch.batch_id} refused: HTTP {status} {answer[:200]!r}")
        self.acc.counts["telemetry.events_dropped"] += batch.events
        self.acc.counts["telemetry.deltas_dropped"] += batch.deltas
        return "dropped"

    # --- publishes

    def all_armed(self, etag: str) -> bool:
        return all(w.etag == etag and w.polling_with == etag for w in self.workers)


# --- measuring the servers ------------------------------------------------------------------------


class Sampler:
    """CPU of the control plane and of this database's PostgreSQL backends, open files, table sizes.

    PostgreSQL runs a process per connection, and the control plane's pool closes connections beyond its
    size when they come back: the backends are sampled every ``SAMPLE_S`` and one that has gone keeps the
    CPU of its last sample (what it used after that is missed; ``pg_backends_gone`` says how often).
    """

    def __init__(self, url: str, cp_pid: int) -> None:
        self.engine: Engine = create_engine(url, pool_size=1, max_overflow=0)
        self.conn: Connection = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        self.cp_pid = cp_pid
        self.pg_cpu: dict[int, float] = {}
        self.pg_seen_live: set[int] = set()
        self.max_cp_fds = 0
        self.samples = 0
        # The periodic samples and the snapshots run in different threads; one connection serves both.
        self.lock = threading.RLock()

    def close(self) -> None:
        with self.lock:
            self.conn.close()
            self.engine.dispose()

    def sample(self) -> None:
        with self.lock:
            self._sample()

    def _sample(self) -> None:
        pids = list(self.conn.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'")).scalars())
        self.pg_seen_live = set(pids)
        for pid in pids:
            cpu = process_tree_cpu_s(pid)
            if cpu:
                self.pg_cpu[pid] = max(cpu, self.pg_cpu.get(pid, 0.0))
        with contextlib.suppress(OSError):
            self.max_cp_fds = max(self.max_cp_fds, len(os.listdir(f"/proc/{self.cp_pid}/fd")))
        self.samples += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        self._sample()
        # A partitioned table's own size is 0: its partitions hold the rows, so they are added (a plain table has
        # none).
        sizes = {table: int(self.conn.execute(text(
            "SELECT pg_total_relation_size(CAST(:t AS regclass)) + coalesce((SELECT sum(pg_total_relation_size(relid)) "
            "FROM pg_partition_tree(CAST(:t AS regclass)) WHERE relid <> CAST(:t AS regclass)), 0)"),
            {"t": table}).scalar_one()) for table in TELEMETRY_TABLES}
        events = int(self.conn.execute(text("SELECT count(*) FROM telemetry_events")).scalar_one())
        # Represented requests, whichever the mode: what the rollups count (raw: one per stored event).
        rolled_up = int(self.conn.execute(text("SELECT coalesce(sum(requests), 0) FROM telemetry_rollups"))
                        .scalar_one())
        wal = str(self.conn.execute(text("SELECT pg_current_wal_lsn()")).scalar_one())
        return {"at": time.monotonic(), "cp_cpu_s": process_tree_cpu_s(self.cp_pid),
                "pg_cpu": dict(self.pg_cpu), "sizes": sizes, "events": events, "rolled_up": rolled_up,
                "wal_lsn": wal,
                "sim_cpu_s": time.process_time(), "machine": machine_cpu(), "loadavg": loadavg()}

    def wal_bytes(self, start: str, end: str) -> int:
        with self.lock:
            return int(self.conn.execute(text("SELECT pg_wal_lsn_diff(CAST(:e AS pg_lsn), CAST(:s AS pg_lsn))"),
                                     {"e": end, "s": start}).scalar_one())

    def verify(self) -> dict[str, int]:
        with self.lock:
            row = self.conn.execute(text(
                "SELECT (SELECT count(*) FROM telemetry_events), (SELECT count(DISTINCT event_id) FROM "
                "telemetry_events), (SELECT coalesce(sum(requests), 0) FROM telemetry_rollups), "
                "(SELECT count(*) FROM telemetry_batches), (SELECT count(*) FROM telemetry_rollup_deltas), "
                "(SELECT count(*) FROM telemetry_events WHERE sample_weight IS NOT NULL)")).one()
        return {"events_in_db": int(row[0]), "distinct_event_ids": int(row[1]), "events_in_rollups": int(row[2]),
                "batch_records": int(row[3]), "delta_records": int(row[4]), "sampled_events_in_db": int(row[5])}


async def sample_forever(sampler: Sampler, acc: Accounting) -> None:
    while True:
        try:
            await asyncio.to_thread(sampler.sample)
        except Exception as exc:  # a sample lost is a gap, not a failed run
            acc.error("sampler", f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(SAMPLE_S)


async def report_progress(fleet: Fleet, every_s: float = 10.0) -> None:
    """A line on stderr now and then, so a long run shows where it is (and a stuck one, where it stuck)."""
    started = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        c = fleet.acc.counts
        print(f"  [{time.monotonic() - started:5.0f} s] registered {fleet.registered}, holding a bundle "
              f"{fleet.holding}, requests generated {c['requests.generated']:,} acknowledged "
              f"{c['telemetry.requests_acked']:,}, heartbeats {c['heartbeat.200']:,}, long-poll answers "
              f"{c['bundle.200'] + c['bundle.304']:,}, errors {sum(fleet.acc.errors.values()):,}, "
              f"loadavg {loadavg()}", file=sys.stderr, flush=True)


async def watch_loop_lag(acc: Accounting) -> None:
    """How late the simulator's event loop wakes: when it is late, arrivals are noted late too."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(LAG_TICK_S)
        acc.loop_lags.append((time.monotonic(), time.monotonic() - before - LAG_TICK_S))


# --- the run --------------------------------------------------------------------------------------


def next_state(index: int, state: tuple[str, bool], fixture: Fixture) -> tuple[str, str, str, dict[str, Any],
                                                                                 tuple[str, bool]]:
    """The ``index``-th publish as bench/propagation.py makes them: kill switch flips and A/B rollbacks."""
    if index % 2 == 0:
        new = (state[0], not state[1])
        return (f"killswitch {'on' if new[1] else 'off'}", "PUT", "/v1/killswitch",
                {"enabled": new[1], "reason": f"bench.fleet publish {index}"}, new)
    a, b = fixture.revisions[0], fixture.revisions[1]
    target = b if state[0] == a else a
    return (f"rollback to {'B' if target == b else 'A'}", "POST", f"/v1/policies/{POLICY}/rollback",
            {"revision": target, "reason": f"bench.fleet publish {index}"}, (target, state[1]))


async def publish_all(fleet: Fleet, operator: aiohttp.ClientSession, window_end: float,
                      server: Server) -> list[dict[str, Any]]:
    config, fixture = fleet.config, fleet.fixture
    state = (fixture.revisions[0], False)
    rounds: list[dict[str, Any]] = []
    spacing = config.seconds / max(1, config.publishes)
    start = time.monotonic()
    for index in range(config.publishes):
        # Spread over the window, each once the last one has settled (every worker long-polling on it).
        at = start + spacing * (index + 0.5)
        etag = fixture.etags[state]
        while time.monotonic() < at or not fleet.all_armed(etag):
            if time.monotonic() > window_end:
                return rounds
            await asyncio.sleep(0.02)
        action, method, path, payload, state = next_state(index, state, fixture)
        current = Round(index, "killswitch" if method == "PUT" else "rollback", action, fixture.etags[state],
                        config.workers)
        fleet.round = current
        current.t_sent = time.monotonic()
        error = None
        try:
            async with operator.request(method, path, json=payload) as resp:
                answer = await resp.read()
                if resp.status != 200:
                    error = f"HTTP {resp.status} {answer[:300]!r}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = f"no answer: {type(exc).__name__}: {exc}"
        current.t_returned = time.monotonic()
        if error is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(current.done.wait(), config.publish_timeout_s)
        if server.process.poll() is not None:
            raise BenchError(f"the control plane exited with {server.process.returncode}:\n{server.tail()}")
        fleet.round = None
        times = sorted(current.arrivals.values())
        if current.expected in current.bodies:
            check_bundle(current.bodies[current.expected], current.expected, state[0], state[1])
        rounds.append({
            "index": index, "action": action, "etag": current.expected, "error": error,
            "converged_workers": len(current.arrivals), "missing_workers": config.workers - len(current.arrivals),
            "all_s": times[-1] - current.t_sent if len(times) == config.workers else None,
            "first_s": times[0] - current.t_sent if times else None,
            "median_worker_s": percentile(times, 50) - current.t_sent if times else None,
            "publish_request_s": current.t_returned - current.t_sent,
        })
        if error is not None:
            # Whether the change was made is unknown, so what the workers should hold next is too: the window
            # goes on without further publishes.
            return rounds
    return rounds


async def edge(fleet: Fleet, sampler: Sampler) -> tuple[dict[str, Any], Counter[str], Counter[str]]:
    """A snapshot of the servers and the simulator's counters at one edge of the window.

    The snapshot's queries take a while on a busy machine (tens to hundreds of ms): the edge is the middle
    of that, and the counters are read there too, so that rates are not skewed by the time it took.
    """
    before = time.monotonic()
    task = asyncio.create_task(asyncio.to_thread(sampler.snapshot))
    await asyncio.sleep(0)
    counts, errors = Counter(fleet.acc.counts), Counter(fleet.acc.errors)
    snap = await task
    counts_after = Counter(fleet.acc.counts)
    snap["at"] = (before + time.monotonic()) / 2
    # Half of what happened while the snapshot ran belongs to each side of the edge.
    for key, value in counts_after.items():
        counts[key] += (value - counts[key]) // 2
    return snap, counts, errors


async def drive(server: Server, fixture: Fixture, policies: dict[str, CompiledPolicy], url: str,
                config: FleetConfig, progress: bool = False) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    shape: TelemetryShape | None = None
    if config.mode == "raw":
        shape = RawTelemetry(config.batch_size, run)
    elif config.mode == "deltas":
        shape = DeltaTelemetry(config.batch_size, run, policies, config.delta_flush_s)
    fleet = Fleet(server, fixture, config, shape)
    operator = aiohttp.ClientSession(server.url, headers={"Authorization": f"Bearer {fixture.operator_token}"},
                                     timeout=aiohttp.ClientTimeout(total=config.publish_timeout_s))
    sampler = await asyncio.to_thread(Sampler, url, server.process.pid)
    helpers = [asyncio.create_task(sample_forever(sampler, fleet.acc)), asyncio.create_task(watch_loop_lag(fleet.acc))]
    if progress:
        helpers.append(asyncio.create_task(report_progress(fleet)))
    try:
        setup_started = time.monotonic()
        before = await asyncio.to_thread(sampler.snapshot)
        try:
            await fleet.start()
        except SetupIncomplete as exc:
            return setup_report(fleet, str(exc), before, await asyncio.to_thread(sampler.snapshot), sampler)
        setup_s = time.monotonic() - setup_started
        fleet.start_telemetry()
        await asyncio.sleep(config.warmup_s)
        start, counts_start, errors_start = await edge(fleet, sampler)
        window_end = start["at"] + config.seconds
        publishes = asyncio.create_task(publish_all(fleet, operator, window_end, server))
        while time.monotonic() < window_end:
            if server.process.poll() is not None:
                raise BenchError(f"the control plane exited with {server.process.returncode}:\n{server.tail()}")
            if publishes.done():
                publishes.result()  # raises what failed
            await asyncio.sleep(0.1)
        end, counts_end, errors_end = await edge(fleet, sampler)
        rounds = await asyncio.wait_for(publishes, config.publish_timeout_s + 10)
        backlog = counts_end["requests.generated"] - counts_end["telemetry.requests_acked"]
        drain_started = time.monotonic()
        drained = await fleet.drain()
        drain_s = time.monotonic() - drain_started
        check = await asyncio.to_thread(sampler.verify)
        wal = await asyncio.to_thread(sampler.wal_bytes, start["wal_lsn"], end["wal_lsn"])
        return measure(fleet, config, rounds, start, end, counts_end - counts_start, errors_end - errors_start,
                       {"setup_s": setup_s, "drain_s": drain_s, "drained": drained, "backlog_at_window_end": backlog,
                        "wal_bytes": wal, "check": check, "pg_backends_seen": len(sampler.pg_cpu),
                        "max_cp_fds": sampler.max_cp_fds, "samples": sampler.samples})
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await fleet.stop()
        await operator.close()
        await asyncio.to_thread(sampler.close)


def setup_report(fleet: Fleet, reason: str, start: dict[str, Any], end: dict[str, Any],
                 sampler: Sampler) -> dict[str, Any]:
    """What a run that never got its fleet up saw while it tried: where the limit was hit."""
    wall = end["at"] - start["at"]
    return {"aborted": reason, "setup_s": wall,
            "setup": {"registered": fleet.registered, "holding_a_bundle": fleet.holding,
                      "requests": dict(sorted(fleet.acc.counts.items())), "errors": dict(fleet.acc.errors),
                      "error_examples": fleet.acc.error_examples,
                      "control_plane_cores": (end["cp_cpu_s"] - start["cp_cpu_s"]) / wall,
                      "postgres_cores": _pg_cpu(start["pg_cpu"], end["pg_cpu"]) / wall,
                      "simulator_cores": (end["sim_cpu_s"] - start["sim_cpu_s"]) / wall,
                      "max_control_plane_fds": sampler.max_cp_fds,
                      "loadavg": {"start": start["loadavg"], "end": end["loadavg"]}}}


def _pg_cpu(start: dict[int, float], end: dict[int, float]) -> float:
    return sum(cpu - start.get(pid, 0.0) for pid, cpu in end.items())


def _per(value: float, count: int, unit: float) -> float | None:
    return value / count * unit if count else None


def measure(fleet: Fleet, config: FleetConfig, rounds: list[dict[str, Any]], start: dict[str, Any],
            end: dict[str, Any], counts: Counter[str], errors: Counter[str], extra: dict[str, Any]) -> dict[str, Any]:
    wall = end["at"] - start["at"]
    cp_cpu = end["cp_cpu_s"] - start["cp_cpu_s"]
    pg_cpu = _pg_cpu(start["pg_cpu"], end["pg_cpu"])
    sim_cpu = end["sim_cpu_s"] - start["sim_cpu_s"]
    busy = (end["machine"][0] - start["machine"][0]) / max(1, end["machine"][1] - start["machine"][1])
    ncpu = os.cpu_count() or 1
    stored = end["events"] - start["events"]
    # What the rollups gained: raw, one request per stored event; deltas, the requests the deltas stand for.
    requests = end["rolled_up"] - start["rolled_up"]
    growth = {t: end["sizes"][t] - start["sizes"][t] for t in TELEMETRY_TABLES}
    in_window = [lat for at, lat in fleet.acc.batch_latencies if start["at"] <= at <= end["at"]]
    lags = [lag for at, lag in fleet.acc.loop_lags if start["at"] <= at <= end["at"]]
    offered = config.workers * config.rps_per_worker if config.mode != "off" else 0.0
    refusals = {}
    for key, value in counts.items():
        status = key.rpartition(".")[2]
        if status.isdigit() and (int(status) == 429 or int(status) >= 500):
            refusals[key] = value
    complete = [r["all_s"] for r in rounds if r["all_s"] is not None]
    check = extra["check"]
    acked_stored = fleet.acc.counts["telemetry.events_stored"]
    total = fleet.acc.counts
    # Exactness: every request a worker represented is counted once in the rollups, whichever the mode.
    represented = total["requests.generated"]
    if config.mode == "raw":
        events_ok = check["events_in_db"] == check["events_in_rollups"] and check["sampled_events_in_db"] == 0
    else:
        events_ok = (check["sampled_events_in_db"] == check["events_in_db"]
                     and total["telemetry.deltas_stored"] == total["telemetry.deltas_acked"]
                     == check["delta_records"] and total["telemetry.deltas_rejected"] == 0
                     and total["telemetry.deltas_dropped"] == 0)
    return {
        "window_s": wall,
        "setup_s": extra["setup_s"],
        "propagation": {
            "publishes": rounds,
            "requested": config.publishes,
            "completed": len(complete),
            "every_worker_every_publish": len(rounds) == config.publishes and all(
                r["missing_workers"] == 0 for r in rounds),
            "all_s": summarize(complete) if complete else None,
            "first_s": summarize([r["first_s"] for r in rounds if r["first_s"] is not None]) if rounds else None,
            "goal_p99_s": GOAL_P99_S,
            "goal_met": bool(complete) and len(complete) == config.publishes
            and percentile(complete, 99) < GOAL_P99_S,
            "unexpected_etags": len(fleet.unexpected),
        },
        "telemetry": {
            "mode": config.mode,
            "offered_requests_per_s": offered,
            "generated_requests_per_s": counts["requests.generated"] / wall,
            "acked_requests_per_s": counts["telemetry.requests_acked"] / wall,
            "stored_events_per_s": stored / wall,
            "represented_requests": requests,
            "represented_requests_per_s": requests / wall,
            "events_stored": stored,
            "raw_sample_rate": config.raw_sample_rate if config.mode == "deltas" else 1.0,
            "deltas_per_s": counts["telemetry.deltas_acked"] / wall,
            "deltas_per_request": counts["telemetry.deltas_acked"] / requests if requests else None,
            "batches_per_s": counts["telemetry.batches_acked"] / wall,
            "events_per_batch": (counts["telemetry.events_acked"] / counts["telemetry.batches_acked"]
                                 if counts["telemetry.batches_acked"] else None),
            "achieved_over_offered": counts["telemetry.requests_acked"] / (offered * wall) if offered else None,
            "batch_latency_s": summarize(in_window) if in_window else None,
            "retries": counts["telemetry.retries"],
            "backlog_at_window_end": extra["backlog_at_window_end"],
            "drained": extra["drained"],
            "drain_s": extra["drain_s"],
        },
        "cpu": {
            "control_plane_s": cp_cpu,
            "postgres_s": pg_cpu,
            "simulator_s": sim_cpu,
            "control_plane_cores": cp_cpu / wall,
            "postgres_cores": pg_cpu / wall,
            "simulator_cores": sim_cpu / wall,
            "machine_busy_cores": busy * ncpu,
            "others_cores": max(0.0, busy * ncpu - (cp_cpu + pg_cpu + sim_cpu) / wall),
            "per_1000_requests": {"control_plane_s": _per(cp_cpu, requests, 1000),
                                  "postgres_s": _per(pg_cpu, requests, 1000)},
            "requests_per_control_plane_cpu_s": requests / cp_cpu if cp_cpu > 0 else None,
            "pg_backends_seen": extra["pg_backends_seen"],
            "loadavg": {"start": start["loadavg"], "end": end["loadavg"]},
        },
        "storage": {
            "tables_bytes_end": end["sizes"],
            "growth_bytes": growth,
            "growth_bytes_total": sum(growth.values()),
            "bytes_per_million_requests": {t: _per(g, requests, 1e6) for t, g in
                                           {**growth, "total": sum(growth.values())}.items()},
            "wal_bytes_server_wide": extra["wal_bytes"],
            "wal_bytes_per_million_requests_server_wide": _per(extra["wal_bytes"], requests, 1e6),
        },
        "requests_in_window": {k: v for k, v in sorted(counts.items()) if not k.startswith("telemetry.events")},
        "errors_in_window": dict(errors),
        "refusals_in_window": refusals,
        "errors_total": dict(fleet.acc.errors),
        "error_examples": fleet.acc.error_examples,
        "client": {
            "loop_lag_s": summarize(lags) if lags else None,
            "max_control_plane_fds": extra["max_cp_fds"],
            "sampler_samples": extra["samples"],
        },
        "verify": {
            **check,
            "batches_acked": fleet.acc.counts["telemetry.batches_acked"],
            "events_acked_stored": acked_stored,
            "events_dropped": fleet.acc.counts["telemetry.events_dropped"],
            "requests_represented": represented,
            "requests_in_rollups": check["events_in_rollups"],
            "exact": check["events_in_rollups"] == represented,
            "deltas_acked": total["telemetry.deltas_acked"],
            "deltas_stored": total["telemetry.deltas_stored"],
            "deltas_rejected": total["telemetry.deltas_rejected"],
            "ok": (check["events_in_db"] == acked_stored == check["distinct_event_ids"] and events_ok
                   and check["events_in_rollups"] == represented
                   and fleet.acc.counts["telemetry.events_dropped"] == 0 and extra["drained"]
                   and fleet.acc.counts["telemetry.events_rejected"] == 0
                   and check["batch_records"] == fleet.acc.counts["telemetry.batches_acked"]),
        },
    }


def run(config: FleetConfig, postgres_url: str = DEFAULT_POSTGRES_URL, progress: bool = False,
        log_dir: Path | None = None) -> dict[str, Any]:
    """One run; ``log_dir`` keeps the control plane's log (a temporary folder otherwise)."""
    if config.mode not in MODES:
        raise ValueError(f"unknown mode {config.mode!r}; one of {MODES}")
    report: dict[str, Any] = {"config": asdict(config), "machine": {**machine_facts(), "loadavg_at_start": loadavg()},
                              "environment": environment()}
    with contextlib.ExitStack() as stack:
        logs = log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specgate-bench-fleet-")))
        logs.mkdir(parents=True, exist_ok=True)
        url = stack.enter_context(fresh_database("postgresql", postgres_url))
        report["database"] = make_url(url).database
        fixture, policies = seed(url, config.raw_sample_rate if config.mode == "deltas" else 1.0)
        with control_plane(url, logs) as server:
            if progress:
                print(f"control plane up at {server.url} (pid {server.process.pid}); starting {config.workers} "
                      f"workers", file=sys.stderr, flush=True)
            try:
                with asyncio.Runner(loop_factory=loop_factory()) as runner:
                    report.update(runner.run(drive(server, fixture, policies, url, config, progress)))
            except BenchError as exc:
                raise BenchError(f"{exc}\n--- control plane log (tail) ---\n{server.tail()}") from None
    return report


# --- the report -----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def render(report: dict[str, Any]) -> str:
    if "aborted" in report:
        u = report["setup"]
        return (f"{report['config']['workers']} workers: set-up did not complete ({report['aborted']}); in "
                f"{report['setup_s']:.0f} s the control plane used {u['control_plane_cores']:.2f} cores, PostgreSQL "
                f"{u['postgres_cores']:.2f}, the simulator {u['simulator_cores']:.2f}; control plane max open files "
                f"{u['max_control_plane_fds']}; load {u['loadavg']['start']} -> {u['loadavg']['end']}\n"
                f"requests {u['requests']}\nerrors {u['errors']}, e.g. {u['error_examples'][:3]}")
    c, p, t, cpu, s = report["config"], report["propagation"], report["telemetry"], report["cpu"], report["storage"]
    m = report["machine"]
    mode = c["mode"] + (f" (raw sample {c['raw_sample_rate']:g})" if c["mode"] == "deltas" else "")
    lines = [f"{c['workers']} workers, mode {mode}, {c['rps_per_worker']:g} requests/s each, SSE "
             f"{'on' if c['sse'] else 'off'}; window {report['window_s']:.1f} s after {report['setup_s']:.1f} s "
             f"of set-up; {m['cpu']} ({m['nproc']} CPUs), load {cpu['loadavg']['start']} -> {cpu['loadavg']['end']}"]
    a = p["all_s"]
    if not p["requested"]:
        lines.append("propagation: no publishes (--publishes 0)")
    else:
        lines.append(f"propagation: {p['completed']}/{p['requested']} publishes reached all workers; publish -> last "
                     f"worker p50 {_ms(a and a['p50'])} ms, p99 {_ms(a and a['p99'])} ms, max {_ms(a and a['max'])} "
                     f"ms (goal p99 < {p['goal_p99_s']:g} s: {'met' if p['goal_met'] else 'NOT met'})")
    for r in p["publishes"]:
        if r["error"]:
            lines.append(f"  publish {r['index']} ({r['action']}) FAILED: {r['error']}; no further publishes")
        elif r["missing_workers"]:
            lines.append(f"  publish {r['index']} ({r['action']}): {r['missing_workers']} workers missing after "
                         f"{c['publish_timeout_s']:g} s")
    if c["mode"] != "off":
        lat = t["batch_latency_s"] or {}
        lines.append(f"telemetry: offered {t['offered_requests_per_s']:,.0f} req/s, generated "
                     f"{t['generated_requests_per_s']:,.0f}, acknowledged {t['acked_requests_per_s']:,.0f} "
                     f"({(t['achieved_over_offered'] or 0) * 100:.0f} %), stored {t['stored_events_per_s']:,.0f} "
                     f"events/s in {t['batches_per_s']:,.0f} batches/s ({t['events_per_batch'] or 0:.1f} events "
                     f"each); batch latency p50 {_ms(lat.get('p50'))} ms p99 {_ms(lat.get('p99'))} ms; "
                     f"backlog at window end {t['backlog_at_window_end']:,}, retries {t['retries']:,}")
        lines.append(f"represented in the window: {t['represented_requests']:,} requests (rollups), "
                     f"{t['events_stored']:,} events stored, {t['deltas_per_s']:,.0f} deltas/s"
                     + (f" ({t['deltas_per_request']:.2f} a request)" if t["deltas_per_request"] else "")
                     + (f"; {cpu['requests_per_control_plane_cpu_s']:,.0f} requests per control-plane CPU-s"
                        if cpu["requests_per_control_plane_cpu_s"] else ""))
    per = cpu["per_1000_requests"]
    per_text = (f"; per 1,000 requests: control plane {per['control_plane_s']:.3f} CPU-s, PostgreSQL "
                f"{per['postgres_s']:.3f} CPU-s" if per["control_plane_s"] is not None else "")
    lines.append(f"CPU cores: control plane {cpu['control_plane_cores']:.2f}, PostgreSQL {cpu['postgres_cores']:.2f}, "
                 f"simulator {cpu['simulator_cores']:.2f}, others ~{cpu['others_cores']:.2f} (machine busy "
                 f"{cpu['machine_busy_cores']:.2f}){per_text}")
    if c["mode"] != "off":
        bpm = s["bytes_per_million_requests"]
        lines.append("storage per million requests: " + ", ".join(
            f"{k} {v / 1e6:,.0f} MB" for k, v in bpm.items() if v is not None)
            + f"; WAL (server-wide) {s['wal_bytes_server_wide'] / 1e6:,.0f} MB in the window")
    lag = report["client"]["loop_lag_s"] or {}
    lines.append(f"simulator loop lag p50 {_ms(lag.get('p50'))} ms p99 {_ms(lag.get('p99'))} ms max "
                 f"{_ms(lag.get('max'))} ms; control plane max open files {report['client']['max_control_plane_fds']}")
    lines.append(f"refusals (429/5xx) {report['refusals_in_window'] or 'none'}; client errors "
                 f"{report['errors_in_window'] or 'none'}")
    v = report["verify"]
    lines.append(f"verify: {v['events_in_db']:,} events stored, {v['events_acked_stored']:,} acknowledged as stored; "
                 f"{v['requests_represented']:,} requests represented, {v['requests_in_rollups']:,} in the rollups "
                 f"({'exact' if v['exact'] else 'NOT exact'}); {v['deltas_stored']:,} of {v['deltas_acked']:,} "
                 f"deltas stored, {v['deltas_rejected']} refused; {v['batch_records']:,} batch records: "
                 f"{'ok' if v['ok'] else 'MISMATCH'}")
    return "\n".join(lines)


def compare(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mode, summed over its runs: represented requests, events stored, CPU and growth per request; and
    the deltas mode against the raw one."""
    modes: dict[str, dict[str, Any]] = {}
    for report in reports:
        if "aborted" in report:
            continue
        mode = report["config"]["mode"]
        m = modes.setdefault(mode, {"runs": 0, "window_s": 0.0, "represented_requests": 0, "events_stored": 0,
                                    "control_plane_cpu_s": 0.0, "postgres_cpu_s": 0.0, "growth_bytes": 0,
                                    "wal_bytes_server_wide": 0, "verified": True,
                                    "loadavg": []})
        t, cpu, s = report["telemetry"], report["cpu"], report["storage"]
        m["runs"] += 1
        m["window_s"] += report["window_s"]
        m["represented_requests"] += t["represented_requests"]
        m["events_stored"] += t["events_stored"]
        m["control_plane_cpu_s"] += cpu["control_plane_s"]
        m["postgres_cpu_s"] += cpu["postgres_s"]
        m["growth_bytes"] += s["growth_bytes_total"]
        m["wal_bytes_server_wide"] += s["wal_bytes_server_wide"]
        m["verified"] = m["verified"] and report["verify"]["ok"] and report["verify"]["exact"]
        m["loadavg"].append([cpu["loadavg"]["start"][0], cpu["loadavg"]["end"][0]])
    for m in modes.values():
        n = m["represented_requests"]
        m["control_plane_cpu_s_per_1000"] = _per(m["control_plane_cpu_s"], n, 1000)
        m["postgres_cpu_s_per_1000"] = _per(m["postgres_cpu_s"], n, 1000)
        m["requests_per_control_plane_cpu_s"] = n / m["control_plane_cpu_s"] if m["control_plane_cpu_s"] else None
        m["growth_bytes_per_million"] = _per(m["growth_bytes"], n, 1e6)
        m["wal_bytes_per_million_server_wide"] = _per(m["wal_bytes_server_wide"], n, 1e6)
    out: dict[str, Any] = {"modes": modes}
    raw, deltas = modes.get("raw"), modes.get("deltas")
    if raw and deltas and raw["requests_per_control_plane_cpu_s"] and deltas["requests_per_control_plane_cpu_s"]:
        ratio = deltas["requests_per_control_plane_cpu_s"] / raw["requests_per_control_plane_cpu_s"]
        out["deltas_over_raw"] = {
            "requests_per_control_plane_cpu_s": ratio,
            "postgres_cpu_per_request": (deltas["postgres_cpu_s_per_1000"] / raw["postgres_cpu_s_per_1000"]
                                         if raw["postgres_cpu_s_per_1000"] else None),
            "growth_per_request": (deltas["growth_bytes_per_million"] / raw["growth_bytes_per_million"]
                                   if raw["growth_bytes_per_million"] else None),
            "goal": GOAL_DELTAS_OVER_RAW, "goal_met": ratio >= GOAL_DELTAS_OVER_RAW}
    return out


def render_comparison(comparison: dict[str, Any]) -> str:
    lines = ["mode    runs  represented  events stored  CP CPU-s/1k  PG CPU-s/1k  req per CP CPU-s  growth MB/M req"]
    for mode, m in comparison["modes"].items():
        def num(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)
        lines.append(f"{mode:<7} {m['runs']:>4}  {m['represented_requests']:>11,}  {m['events_stored']:>13,}  "
                     f"{num(m['control_plane_cpu_s_per_1000'], '.4f'):>11}  "
                     f"{num(m['postgres_cpu_s_per_1000'], '.4f'):>11}"
                     f"  {num(m['requests_per_control_plane_cpu_s'], ',.0f'):>16}  "
                     f"{num(m['growth_bytes_per_million'] and m['growth_bytes_per_million'] / 1e6, ',.1f'):>15}"
                     f"  {'exact' if m['verified'] else 'MISMATCH'}; load {m['loadavg']}")
    ratio = comparison.get("deltas_over_raw")
    if ratio:
        lines.append(f"deltas / raw: {ratio['requests_per_control_plane_cpu_s']:.1f}x represented requests per "
                     f"control-plane CPU-second (goal {ratio['goal']:g}x: "
                     f"{'met' if ratio['goal_met'] else 'NOT met'}); PostgreSQL CPU per request x"
                     f"{ratio['postgres_cpu_per_request'] or 0:.3f}; growth per request x"
                     f"{ratio['growth_per_request'] or 0:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    defaults = FleetConfig()
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="the measured window (default 60)")
    parser.add_argument("--publishes", type=int, default=defaults.publishes, help="publishes in the window")
    parser.add_argument("--rps-per-worker", type=float, default=defaults.rps_per_worker,
                        help="represented requests per second per worker (default 2)")
    parser.add_argument("--mode", default=defaults.mode,
                        help="raw: an event per request; deltas: pre-aggregated (rollup deltas plus sampled "
                        "events, the policy's telemetry.raw_sample_rate); off: no telemetry; several, comma-"
                        "separated (raw,deltas): run each in turn, a fresh database each, and compare")
    parser.add_argument("--raw-sample-rate", type=float, default=defaults.raw_sample_rate,
                        help="deltas mode: the share of requests also sent as raw events (default 0.01)")
    parser.add_argument("--delta-flush-s", type=float, default=defaults.delta_flush_s,
                        help="deltas mode: finish the running deltas (and send the held sample) every this many "
                        "seconds (default: the sidecar's telemetry_rollup_flush_s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with several modes: how many times to run the sequence (alternating)")
    parser.add_argument("--no-sse", action="store_true", help="workers do not hold the change stream open")
    parser.add_argument("--ramp", type=float, default=defaults.ramp_s,
                        help="seconds over which the workers start (default 0: all at once)")
    parser.add_argument("--warmup", type=float, default=defaults.warmup_s,
                        help="seconds of telemetry before the window starts")
    parser.add_argument("--flush-s", type=float, default=defaults.flush_s,
                        help="telemetry flush interval (the sidecar's default)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="events per batch at most (the sidecar's default)")
    parser.add_argument("--heartbeat-s", type=float, default=defaults.heartbeat_s)
    parser.add_argument("--publish-timeout", type=float, default=defaults.publish_timeout_s)
    parser.add_argument("--setup-timeout", type=float, default=defaults.setup_timeout_s)
    parser.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s)
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL,
                        help="server to create the throw-away database on (env SPECGATE_BENCH_POSTGRES_URL)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--log-dir", type=Path, help="keep the control plane's log here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.publishes < 0 or args.seconds <= 0:
        parser.error("--workers must be at least 1, --publishes at least 0, --seconds positive")
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--mode: one or more of {', '.join(MODES)}, comma-separated")
    if not 0.0 < args.raw_sample_rate < 1.0 and "deltas" in modes:
        parser.error("--raw-sample-rate must be above 0 and below 1 (1 is the raw mode)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    config = FleetConfig(workers=args.workers, seconds=args.seconds, publishes=args.publishes,
                         rps_per_worker=args.rps_per_worker, mode=modes[0], sse=not args.no_sse,
                         raw_sample_rate=args.raw_sample_rate, delta_flush_s=args.delta_flush_s,
                         warmup_s=args.warmup, ramp_s=args.ramp, heartbeat_s=args.heartbeat_s,
                         batch_size=args.batch_size,
                         flush_s=args.flush_s, publish_timeout_s=args.publish_timeout,
                         setup_timeout_s=args.setup_timeout, drain_timeout_s=args.drain_timeout, seed=args.seed)
    if args.ramp >= args.setup_timeout:
        parser.error("--ramp must be shorter than --setup-timeout")
    print(f"bench.fleet: at most {args.setup_timeout:g} s set-up + {args.warmup:g} s warm-up + {args.seconds:g} s "
          f"window + {args.drain_timeout:g} s drain", file=sys.stderr, flush=True)
    # SIGTERM (timeout(1), a CI's cancel) as Ctrl-C: the run unwinds, stopping the control plane it started and
    # dropping its database, instead of leaving both behind.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    reports = []
    try:
        for _ in range(args.rounds if len(modes) > 1 else 1):
            for mode in modes:
                print(f"bench.fleet: mode {mode}", file=sys.stderr, flush=True)
                reports.append(run(replace(config, mode=mode), args.postgres_url, progress=True,
                                   log_dir=args.log_dir))
                print(render(reports[-1]), flush=True)
    except BenchError as exc:
        print(f"fleet benchmark FAILED: {exc}", file=sys.stderr)
        return 1
    if len(reports) > 1:
        comparison = compare(reports)
        print(render_comparison(comparison))
        if args.out:
            args.out.write_text(json.dumps({"runs": reports, "comparison": comparison}, indent=2))
    elif args.out:
        args.out.write_text(json.dumps(reports[0], indent=2))
    if any("aborted" in r for r in reports):
        return 1
    return 0 if all(r["verify"]["ok"] and r["propagation"]["every_worker_every_publish"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
