"""How long does a change take to reach every worker? Policy propagation over real HTTP.

Run ``python -m bench.propagation`` (``--help`` for the knobs). For each
database (SQLite, PostgreSQL or both) and each repetition it:

1. makes a fresh database (a SQLite file in a temporary directory, or a
   throw-away PostgreSQL database that is dropped afterwards), migrates it,
   seeds one pool-less policy with two revisions (A active, B a draft; with
   ``--fresh``, one draft per rollback) and creates a worker key and an
   operator key directly in the database;
2. starts the control plane as its own process
   (``python -m uvicorn --factory controlplane.app:create_app``) on a free
   127.0.0.1 port, with a fixed ``SPECGATE_SIGNING_KEY``;
3. registers ``--workers`` workers and runs, for each, an asyncio long-poll
   loop on one shared aiohttp connection pool: ``GET /v1/bundle?worker=ID&wait=S``
   with ``If-None-Match``, noting ``time.monotonic()`` when a response with a
   new ETag has been read in full;
4. publishes ``--publishes`` changes, alternating a kill-switch flip
   (``PUT /v1/killswitch``) and a rollback between A and B
   (``POST /v1/policies/{name}/rollback``; with ``--fresh``, to a new draft
   each time, so that every publish makes a bundle never served before).
   Before each, it waits until the
   server holds every worker's long-poll (its ``specgate_long_poll_waiters``
   gauge) and pauses ``--pause`` seconds; then it sends the change and waits
   until every worker holds the ETag that the new state implies (computed
   locally from the revision documents), or fails after ``--timeout``.

Per publish it reports the time from the moment the publish request was sent
(and from the moment its response had returned) to the first worker and to
the last worker holding the new ETag, and the control plane's CPU time
(``/proc/PID/stat``) from just before the publish until every worker's
long-poll is parked again (so waking, answering and the re-polls are all
in). Publishes are also reported as cold (the bundle is new to the server)
and warm (the server served it before). The bundle every worker ended on is
checked: its signature verifies, its ETag is the sha256 of its payload, and
the payload carries the expected revision and kill switch.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml
from sqlalchemy import create_engine, text, update
from sqlalchemy.engine import make_url

from controlplane.auth.local import mint_keys
from controlplane.auth.schemas import Scope
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.migrations_state import upgrade
from controlplane.models import FleetState
from controlplane.policy import service as policy_service
from policies import BundlePayload, BundleVerifier, Revision, SigningKey, load_policy

ROOT = Path(__file__).resolve().parents[1]
POLICY = "propagation"
POOL = "bench"
# Fixed, so every run signs with the same key (and the key is obviously not a secret).
SIGNING_KEY_B64 = base64.b64encode(hashlib.sha256(b"specgate bench.propagation signing key").digest()).decode()
DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
GOAL_P99_S = 1.0
# How the tools that specgate is usually compared with pick up a change by default: context, not a race.
ANCHORS: list[dict[str, Any]] = [
    {"system": "Unleash server-side SDKs", "mechanism": "poll", "default_interval_s": 15.0},
    {"system": "flagd (HTTP sync)", "mechanism": "poll", "default_interval_s": 5.0},
    {"system": "OPA bundles", "mechanism": "poll", "default_interval_s": "60-120 (min_delay/max_delay)"},
]


class BenchError(RuntimeError):
    """The run cannot go on (a worker never converged, the server died, ...): fail loudly."""


# --- statistics ----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(values: Sequence[float]) -> dict[str, float | int]:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values),
            "min": min(values), "mean": statistics.fmean(values)}


# --- the machine ---------------------------------------------------------------------------


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    # After the command's closing parenthesis: state is field 3, utime 14, stime 15 (1-based, man proc).
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return total - idle, total


def loadavg() -> list[float]:
    with open("/proc/loadavg") as handle:
        return [float(v) for v in handle.read().split()[:3]]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# --- database and server -------------------------------------------------------------------


@contextlib.contextmanager
def fresh_database(kind: str, postgres_url: str) -> Iterator[str]:
    """A migrated, empty database of ``kind``; removed afterwards."""
    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="specgate-bench-") as tmp:
            url = f"sqlite:///{Path(tmp) / 'specgate.db'}"
            upgrade(url)
            yield url
        return
    if kind != "postgresql":
        raise ValueError(f"unknown database {kind!r}")
    name = f"specgate_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        admin.dispose()
        raise BenchError(f"cannot create a PostgreSQL database through {postgres_url}: {exc}") from exc
    try:
        url = make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


SEED_EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "examples" / "seed.yaml"


def policy_text(threshold: int) -> str:
    """The seed example under this benchmark's name, speculating up to batch size ``threshold``."""
    document = yaml.safe_load(SEED_EXAMPLE.read_text())
    document["name"] = POLICY
    document["rules"][0]["when"]["batch_size"]["max"] = threshold
    return yaml.safe_dump(document, sort_keys=False)


def seed_policy(url: str, texts: Sequence[str]) -> list[str]:
    """The policy with ``texts`` as its revisions, through the policy service: the first one active."""
    engine = make_engine(url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            policy_service.create_policy(session, name=POLICY, description=None, pool=None, actor="bench:seed")
            return [policy_service.create_revision(
                session, policy_name=POLICY, submission=policy_service.Submission(text=text),
                if_match=policy_service.parse_if_match("*"), actor="bench:seed").revision.id for text in texts]
    finally:
        engine.dispose()


@dataclass
class Fixture:
    """What the database holds before the server starts."""

    worker_token: str
    operator_token: str
    revisions: list[str]
    # ETag of the bundle every worker must end on, by (revision id, kill switch).
    etags: dict[tuple[str, bool], str]


def seed(url: str, extra_revisions: int = 1) -> Fixture:
    """Revision A (active) and ``extra_revisions`` drafts (B, then C, D, ... for --fresh), keys, ETags."""
    texts = [policy_text(threshold=4 + i) for i in range(1 + extra_revisions)]
    revisions = seed_policy(url, texts)
    keys = mint_keys(url, {"bench-workers": Scope.worker, "bench-operator": Scope.operator}, created_by="bench",
                     pools={"bench-workers": POOL})
    worker_token, operator_token = keys["bench-workers"], keys["bench-operator"]
    # The bundle's content carries the fleet's cohort secret; set here so the expected ETags are known
    # before the server starts (it generates one only where none is stored).
    cohort_secret = secrets.token_hex(32)
    engine = make_engine(url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            session.execute(update(FleetState).where(FleetState.id == 1).values(cohort_secret=cohort_secret))
    finally:
        engine.dispose()
    etags = {}
    for rid, source in zip(revisions, texts, strict=True):
        revision = Revision.of(load_policy(source))
        if revision.id != rid:
            raise BenchError(f"revision {rid} was stored, the document hashes to {revision.id}")
        for kill_switch in (False, True):
            etags[(rid, kill_switch)] = BundlePayload(revision, None, kill_switch, cohort_secret).etag
    return Fixture(worker_token, operator_token, revisions, etags)


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def control_plane(database_url: str, log_dir: Path, *, ready_timeout: float = 60.0) -> Iterator[Server]:
    """The control plane as its own process: ``python -m uvicorn --factory controlplane.app:create_app``."""
    port = free_port()
    env = {**os.environ, "SPECGATE_DATABASE_URL": database_url, "SPECGATE_SIGNING_KEY": SIGNING_KEY_B64,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = log_dir / f"control-plane-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "controlplane.app:create_app",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log",
             "--timeout-keep-alive", "20"],  # as `specgate serve` runs it (controlplane/cli.py, KEEP_ALIVE_S)
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise BenchError(f"the control plane exited with {process.returncode}:\n{server.tail()}")
            try:
                if httpx.get(f"{server.url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"the control plane was not ready in {ready_timeout:.0f}s:\n{server.tail()}")
            time.sleep(0.05)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- workers and publishes -----------------------------------------------------------------


@dataclass
class Round:
    """One publish: who has its ETag, and since when."""

    index: int
    kind: str
    action: str
    expected: str
    workers: int
    t_sent: float = 0.0
    t_returned: float = 0.0
    arrivals: dict[str, float] = field(default_factory=dict)
    bodies: dict[str, bytes] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def arrive(self, worker: str, etag: str, at: float, body: bytes) -> bool:
        if etag != self.expected:
            return False
        if worker not in self.arrivals:
            self.arrivals[worker] = at
            self.bodies.setdefault(etag, body)
            if len(self.arrivals) == self.workers:
                self.done.set()
        return True


class Fleet:
    """``n`` simulated workers long-polling one control plane."""

    def __init__(self, base_url: str, token: str, n: int, wait_s: float) -> None:
        self.base_url = base_url
        self.ids = [f"bench-{i:04d}" for i in range(n)]
        self.headers = {"Authorization": f"Bearer {token}"}
        self.wait_s = wait_s
        self.etags: dict[str, str] = {}
        self.round: Round | None = None
        self.unexpected: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.responses = {200: 0, 304: 0}
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._initial = asyncio.Event()

    async def start(self, setup_timeout: float) -> None:
        # One pool with a connection per worker (and a few spare): no long-poll ever waits for a socket.
        connector = aiohttp.TCPConnector(limit=len(self.ids) + 16, limit_per_host=0, force_close=False)
        self._session = aiohttp.ClientSession(
            self.base_url, connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.wait_s + 30, sock_connect=10))
        # Register a few at a time: writes on SQLite serialise anyway.
        gate = asyncio.Semaphore(16)

        async def register(worker: str) -> None:
            async with gate:
                assert self._session is not None
                async with self._session.post("/v1/workers/register", headers=self.headers, json={
                        "id": worker, "pool": POOL, "labels": {"bench": "propagation"},
                        "engines": {"base": "none", "draft": "draft_model"},
                        "sidecar_version": "bench"}) as resp:
                    if resp.status not in (200, 201):
                        raise BenchError(f"registering {worker}: HTTP {resp.status} {await resp.text()}")

        await asyncio.wait_for(asyncio.gather(*(register(w) for w in self.ids)), setup_timeout)
        self._tasks = [asyncio.create_task(self._poll(w), name=f"poll-{w}") for w in self.ids]
        try:
            await asyncio.wait_for(self._initial.wait(), setup_timeout)
        except TimeoutError:
            raise BenchError(f"only {len(self.etags)} of {len(self.ids)} workers got a first bundle in "
                             f"{setup_timeout:.0f}s; errors: {self.errors[-5:]}") from None

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _poll(self, worker: str) -> None:
        assert self._session is not None
        session = self._session
        etag: str | None = None
        while True:
            headers = dict(self.headers)
            params = {"worker": worker}
            if etag is not None:
                headers["If-None-Match"] = f'"{etag}"'
                params["wait"] = f"{self.wait_s:g}"
            try:
                async with session.get("/v1/bundle", params=params, headers=headers) as resp:
                    if resp.status == 304:
                        self.responses[304] += 1
                        continue
                    body = await resp.read()
                    at = time.monotonic()
                    if resp.status != 200:
                        self.errors.append(f"{worker}: HTTP {resp.status} {body[:200]!r}")
                        await asyncio.sleep(0.5)
                        continue
                    new = resp.headers.get("ETag", "").strip('"')
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.errors.append(f"{worker}: {type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)
                continue
            self.responses[200] += 1
            if new == etag:
                continue
            etag = new
            self.etags[worker] = new
            current = self.round
            if current is None:
                # Between publishes nothing may change; before the first one, this is the first bundle.
                if self._initial.is_set():
                    self.unexpected.append((worker, new))
            elif not current.arrive(worker, new, at, body):
                self.unexpected.append((worker, new))
            if len(self.etags) == len(self.ids):
                self._initial.set()


async def long_poll_waiters(client: aiohttp.ClientSession) -> int:
    async with client.get("/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("specgate_long_poll_waiters "):
                return int(float(line.split()[1]))
    raise BenchError("/metrics has no specgate_long_poll_waiters")


async def wait_parked(client: aiohttp.ClientSession, n: int, timeout: float, server: Server) -> float:
    """Until the server holds ``n`` long-polls; returns how long that took."""
    start = time.monotonic()
    while True:
        if server.process.poll() is not None:
            raise BenchError(f"the control plane exited with {server.process.returncode}:\n{server.tail()}")
        waiting = await long_poll_waiters(client)
        if waiting >= n:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise BenchError(f"only {waiting} of {n} long-polls were parked after {timeout:.0f}s")
        await asyncio.sleep(0.01)


def check_bundle(body: bytes, expected_etag: str, revision: str, kill_switch: bool) -> None:
    """The bundle the workers converged to is signed, self-consistent and the intended one."""
    envelope = json.loads(body)
    public = SigningKey.from_b64(SIGNING_KEY_B64).public_key_b64
    payload = BundleVerifier([public]).verify(envelope)
    if payload.etag != expected_etag or envelope["etag"] != expected_etag:
        raise BenchError(f"bundle ETag {payload.etag} / {envelope['etag']} is not {expected_etag}")
    if payload.policy.id != revision or payload.kill_switch != kill_switch:
        raise BenchError(f"bundle has revision {payload.policy.id} kill_switch {payload.kill_switch}; "
                         f"expected {revision} {kill_switch}")


@dataclass
class Config:
    workers: int = 200
    publishes: int = 20
    pause_s: float = 0.2
    wait_s: float = 30.0
    timeout_s: float = 30.0
    setup_timeout_s: float = 120.0
    # Rollbacks go to a new revision each time (every publish makes a bundle never served before)
    # instead of alternating between A and B.
    fresh: bool = False

    def extra_revisions(self) -> int:
        return self.publishes // 2 if self.fresh else 1


def _revision_name(index: int) -> str:
    return chr(ord("A") + index) if index < 26 else f"R{index}"


async def drive(server: Server, fixture: Fixture, config: Config) -> dict[str, Any]:
    """Register the fleet, run the publishes, and return the raw measurements."""
    fleet = Fleet(server.url, fixture.worker_token, config.workers, config.wait_s)
    operator = aiohttp.ClientSession(server.url, headers={"Authorization": f"Bearer {fixture.operator_token}"},
                                     timeout=aiohttp.ClientTimeout(total=60))
    pid = server.process.pid
    names = {rid: _revision_name(i) for i, rid in enumerate(fixture.revisions)}
    state = (fixture.revisions[0], False)
    served = {state}
    rollbacks = 0
    rounds: list[dict[str, Any]] = []
    try:
        await fleet.start(config.setup_timeout_s)
        initial = fixture.etags[state]
        wrong = {w: e for w, e in fleet.etags.items() if e != initial}
        if wrong:
            raise BenchError(f"{len(wrong)} workers started on an unexpected ETag, e.g. {next(iter(wrong.items()))}")
        await wait_parked(operator, config.workers, config.setup_timeout_s, server)
        cpu_start, client_cpu_start = process_cpu_s(pid), time.process_time()
        machine_start, wall_start, load_start = machine_cpu(), time.monotonic(), loadavg()
        for index in range(config.publishes):
            kind = "killswitch" if index % 2 == 0 else "rollback"
            if kind == "killswitch":
                state = (state[0], not state[1])
                action = f"killswitch {'on' if state[1] else 'off'}"
                method, path = "PUT", "/v1/killswitch"
                payload: dict[str, Any] = {"enabled": state[1], "reason": f"bench publish {index}"}
            else:
                rollbacks += 1
                # --fresh: always to a revision no worker was ever served, so nothing about the bundle is cached.
                target = fixture.revisions[rollbacks if config.fresh else rollbacks % 2]
                state = (target, state[1])
                action = f"rollback to {names[target]}"
                method, path = "POST", f"/v1/policies/{POLICY}/rollback"
                payload = {"revision": state[0], "reason": f"bench publish {index}"}
            current = Round(index, kind, action, fixture.etags[state], config.workers)
            # Cold: the first time this bundle is served by this server, so nothing about it is cached yet.
            cold = state not in served
            served.add(state)
            await wait_parked(operator, config.workers, config.timeout_s, server)
            await asyncio.sleep(config.pause_s)
            cpu_before = process_cpu_s(pid)
            fleet.round = current
            current.t_sent = time.monotonic()
            async with operator.request(method, path, json=payload) as resp:
                answer = await resp.read()
                current.t_returned = time.monotonic()
                if resp.status != 200:
                    raise BenchError(f"publish {index} ({action}): HTTP {resp.status} {answer[:300]!r}")
            try:
                await asyncio.wait_for(current.done.wait(), config.timeout_s)
            except TimeoutError:
                missing = sorted(set(fleet.ids) - set(current.arrivals))
                raise BenchError(
                    f"publish {index} ({action}): only {len(current.arrivals)} of {config.workers} workers "
                    f"held ETag {current.expected[:12]} after {config.timeout_s:g}s; missing e.g. "
                    f"{missing[:5]}; last errors: {fleet.errors[-3:]}") from None
            reparked = await wait_parked(operator, config.workers, config.timeout_s, server)
            cpu_after = process_cpu_s(pid)
            fleet.round = None
            check_bundle(current.bodies[current.expected], current.expected, state[0], state[1])
            times = sorted(current.arrivals.values())
            rounds.append({
                "index": index, "kind": kind, "action": action, "etag": current.expected, "cold": cold,
                "converged_workers": len(current.arrivals),
                "all_s": times[-1] - current.t_sent, "first_s": times[0] - current.t_sent,
                "median_worker_s": percentile(times, 50) - current.t_sent,
                "all_after_response_s": times[-1] - current.t_returned,
                "publish_request_s": current.t_returned - current.t_sent,
                "reparked_after_all_s": reparked,
                "server_cpu_s": cpu_after - cpu_before,
            })
        wall = time.monotonic() - wall_start
        busy_end, total_end = machine_cpu()
        server_cpu = process_cpu_s(pid) - cpu_start
        client_cpu = time.process_time() - client_cpu_start
        if fleet.unexpected:
            raise BenchError(f"workers received ETags no publish announced: {fleet.unexpected[:5]}")
        ncpu = os.cpu_count() or 1
        machine_busy_cores = (busy_end - machine_start[0]) / max(1, total_end - machine_start[1]) * ncpu
        return {
            "rounds": rounds,
            "wall_s": wall,
            "server_cpu_s": server_cpu,
            "client_cpu_s": client_cpu,
            "machine_busy_cores": machine_busy_cores,
            "others_busy_cores": max(0.0, machine_busy_cores - (server_cpu + client_cpu) / wall),
            "loadavg_start": load_start,
            "loadavg_end": loadavg(),
            "responses": dict(fleet.responses),
            "poll_errors": len(fleet.errors),
            "poll_error_examples": fleet.errors[:5],
        }
    finally:
        await fleet.stop()
        await operator.close()


def _loop_factory() -> Any:
    """uvloop for the simulated fleet when installed: the client shares the CPUs with the server."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_once(database: str, config: Config, postgres_url: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="specgate-bench-logs-") as logs, \
            fresh_database(database, postgres_url) as url:
        fixture = seed(url, config.extra_revisions())
        with control_plane(url, Path(logs)) as server:
            try:
                with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                    return runner.run(drive(server, fixture, config))
            except BenchError as exc:
                raise BenchError(f"{exc}\n--- control plane log (tail) ---\n{server.tail()}") from None


# --- report --------------------------------------------------------------------------------

# Groups of publishes reported apart: by kind, all, and cold (the new bundle was never served before
# by this server, so its payload, envelope and signature are computed then) against warm.
KINDS = ("killswitch", "rollback", "combined", "cold", "warm")
METRICS = ("all_s", "all_after_response_s", "first_s")


def _by_kind(rounds: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    if kind in ("cold", "warm"):
        return [r for r in rounds if r["cold"] == (kind == "cold")]
    return [r for r in rounds if kind == "combined" or r["kind"] == kind]


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        rounds = _by_kind(run["rounds"], kind)
        if not rounds:
            continue
        out[kind] = {metric: summarize([r[metric] for r in rounds]) for metric in METRICS}
        out[kind]["server_cpu_s"] = summarize([r["server_cpu_s"] for r in rounds])
    return out


def summarize_database(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: the median over runs of each run's p50/p99/max, their range, and all publishes pooled."""
    per_run = [summarize_run(run) for run in runs]
    out: dict[str, Any] = {}
    for kind in KINDS:
        if not any(kind in summary for summary in per_run):
            continue
        out[kind] = {}
        for metric in (*METRICS, "server_cpu_s"):
            stats = [summary[kind][metric] for summary in per_run if kind in summary]
            pooled = [r[metric] for run in runs for r in _by_kind(run["rounds"], kind)]
            out[kind][metric] = {
                "median_of_runs": {s: statistics.median(x[s] for x in stats) for s in ("p50", "p99", "max")},
                "range_of_runs": {s: [min(x[s] for x in stats), max(x[s] for x in stats)]
                                  for s in ("p50", "p99", "max")},
                "pooled": summarize(pooled),
            }
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def render(report: dict[str, Any]) -> str:
    lines = []
    for database, result in report["databases"].items():
        summary = result["summary"]
        runs = result["runs"]
        mode = "every rollback to a new revision" if report["config"]["fresh"] else "rollbacks between A and B"
        lines.append(f"\n{database}: {len(runs)} run(s) x {report['config']['publishes']} publishes, "
                     f"{report['config']['workers']} workers, {mode}")
        lines.append("time from publish sent to EVERY worker holding the new ETag, ms "
                     "(median of runs, [min-max over runs]); pooled over all publishes")
        lines.append(f"{'publishes':<11} {'p50':>16} {'p99':>16} {'max':>16} | {'n':>3} {'pooled p50':>10} "
                     f"{'p99':>6} "
                     f"{'max':>6} | {'from resp p50/p99':>17} | {'first p50':>9} | {'CPU ms p50':>10}")
        for kind in (k for k in KINDS if k in summary):
            s = summary[kind]["all_s"]
            cells = []
            for stat in ("p50", "p99", "max"):
                low, high = s["range_of_runs"][stat]
                cells.append(f"{_ms(s['median_of_runs'][stat])} [{_ms(low)}-{_ms(high)}]")
            pooled = s["pooled"]
            after = summary[kind]["all_after_response_s"]["pooled"]
            first = summary[kind]["first_s"]["pooled"]
            cpu = summary[kind]["server_cpu_s"]["pooled"]
            lines.append(f"{kind:<11} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} | {pooled['n']:>3} "
                         f"{_ms(pooled['p50']):>10} {_ms(pooled['p99']):>6} {_ms(pooled['max']):>6} | "
                         f"{_ms(after['p50']) + '/' + _ms(after['p99']):>17} | {_ms(first['p50']):>9} | "
                         f"{_ms(cpu['p50']):>10}")
        for i, run in enumerate(runs):
            lines.append(f"  run {i + 1}: wall {run['wall_s']:.1f}s, server CPU {run['server_cpu_s']:.2f}s, "
                         f"client CPU {run['client_cpu_s']:.2f}s, machine busy {run['machine_busy_cores']:.2f} "
                         f"cores (others ~{run['others_busy_cores']:.2f}), loadavg {run['loadavg_start']} -> "
                         f"{run['loadavg_end']}, poll errors {run['poll_errors']}")
        pooled_p99 = summary["combined"]["all_s"]["pooled"]["p99"]
        verdict = "met" if pooled_p99 < GOAL_P99_S else "MISSED"
        lines.append(f"  goal p99 < {GOAL_P99_S:g} s: {verdict} (pooled combined p99 {_ms(pooled_p99)} ms)")
    lines.append("\ncontext, default change pick-up of comparable systems: " + "; ".join(
        f"{a['system']} {a['mechanism']} every {a['default_interval_s']} s" for a in ANCHORS))
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "nproc": os.cpu_count(),
        "client_loop": "uvloop" if _loop_factory() else "asyncio",
        "packages": {name: _version(name) for name in
                     ("uvicorn", "uvloop", "httptools", "fastapi", "starlette", "sqlalchemy", "psycopg",
                      "aiohttp")},
    }


def run(config: Config, databases: Sequence[str], repeat: int = 1, postgres_url: str = DEFAULT_POSTGRES_URL,
        progress: bool = False, report: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every run of every database; fills ``report`` as it goes, so a caller keeps what a failure left."""
    report = {} if report is None else report
    report.update({"config": vars(config) | {"repeat": repeat}, "environment": environment(),
                   "anchors": ANCHORS, "goal_p99_s": GOAL_P99_S, "databases": {}})
    for database in databases:
        runs: list[dict[str, Any]] = []
        report["databases"][database] = {"runs": runs}
        for attempt in range(repeat):
            if progress:
                print(f"{database}: run {attempt + 1}/{repeat} (loadavg {loadavg()})", file=sys.stderr,
                      flush=True)
            runs.append(run_once(database, config, postgres_url))
        report["databases"][database]["summary"] = summarize_database(runs)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.propagation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=200, help="simulated workers (default 200)")
    parser.add_argument("--publishes", type=int, default=20, help="publishes per run (default 20)")
    parser.add_argument("--database", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--repeat", type=int, default=1, help="runs per database, each on a fresh server and "
                        "database (default 1)")
    parser.add_argument("--pause", type=float, default=0.2,
                        help="seconds between every worker being parked again and the next publish")
    parser.add_argument("--wait", type=float, default=30.0, help="long-poll wait= in seconds (default 30)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds a publish may take to reach every worker before the run fails")
    parser.add_argument("--postgres-url", default=os.environ.get("SPECGATE_BENCH_POSTGRES_URL", DEFAULT_POSTGRES_URL),
                        help="server to create the throw-away database on (env SPECGATE_BENCH_POSTGRES_URL)")
    parser.add_argument("--fresh", action="store_true",
                        help="roll back to a new revision each time, so that every publish makes a bundle never "
                        "served before (default: alternate between revisions A and B)")
    parser.add_argument("--json", type=Path, help="write the full report (every publish) here")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.publishes < 1 or args.repeat < 1:
        parser.error("--workers, --publishes and --repeat must be at least 1")
    databases = ("sqlite", "postgresql") if args.database == "both" else (args.database,)
    config = Config(workers=args.workers, publishes=args.publishes, pause_s=args.pause, wait_s=args.wait,
                    timeout_s=args.timeout, fresh=args.fresh)
    report: dict[str, Any] = {}
    try:
        run(config, databases, args.repeat, args.postgres_url, progress=True, report=report)
    except Exception as exc:
        # Loudly, but keep the runs that completed for whoever investigates.
        print(f"propagation benchmark FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        if args.json:
            report["error"] = f"{type(exc).__name__}: {exc}"
            args.json.write_text(json.dumps(report, indent=2))
            print(f"partial report written to {args.json}", file=sys.stderr)
        return 1
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
