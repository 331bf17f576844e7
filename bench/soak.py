"""Soak and chaos: does every request and every telemetry event survive crashes, stalls and operator actions?

Run ``python -m bench.soak --minutes N`` (default 30) from the repository root,
``--fake-engines`` for the FAKE OpenAI engine of ``bench/fake_openai.py``
instead of the testbed's real vLLM engines (every output says which), ``--json
PATH`` for the report as JSON. Everything listens on 127.0.0.1; every process
is stopped at the end, on failure and on Ctrl-C (and dies with the soak if the
soak is killed: ``testbed.lifeline``).

What runs, each a process of its own:

* a private PostgreSQL cluster (``initdb`` into a temporary directory, trust
  auth, a free port; binaries from ``pg_config --bindir`` or PATH), so the soak
  may SIGKILL it; without PostgreSQL binaries, SQLite, and the report says so;
* the control plane (``specgate serve``), with a signing key fixed for the run;
* two engines, ``base`` and ``draft`` (the seed policy's), real or fake;
* two sidecars (``specgate sidecar``) in front of both engines, reaching the
  control plane through a TCP proxy in this process that can stall
  (``bench/soak_stall.py``).

Traffic is open-loop at ``--rate`` requests/s, spread over the sidecars that
are up: plain JSON, streams (read to ``data: [DONE]``, then the connection is
dropped, as many clients do) and structured output (a small ``json_schema``);
and every ``--hostile-every`` seconds one hostile request in turn: an 8,000-pair
labels header (52 KB), a 1 MB ``json_schema``, 5,000-deep JSON, a lone-surrogate
route, a NUL in a route, ``max_completion_tokens`` 2^31.

Faults, in turn, evenly spaced (at least the first round of every fault runs):
SIGKILL and restart of a sidecar (the two in turn); a stall of the
control-plane link (``--stall`` seconds, past the sidecars' 10 s telemetry POST
timeout); the kill switch on and off (REST, operator key); SIGKILL and restart
of the control plane; SIGKILL and restart of an engine (``draft``, then
``base``); a rollback (REST, to the other revision); SIGKILL and restart of
PostgreSQL. The time from one fault to the next is a phase. A sidecar kill
never follows the stall: a stall fills the sidecars' memory queues, and the
loss per kill would then measure the stall.

Accounting, after the telemetry has drained:

* every request is ``ok`` (2xx, complete), a ``clear error`` (a status with a
  problem type, or an error event in the stream with its type), a transport
  failure of a sidecar while the soak had it killed, or **unaccounted**
  (anything else: a hang, a 5xx without a problem type, a hostile request
  answered 5xx other than ``upstream-unavailable`` while the soak had an
  engine killed, a truncated answer, a connection failure outside a kill);
* every request a sidecar decided and answered (it carries
  ``X-Specgate-Decision``) has exactly one stored telemetry event (by request
  id; no duplicates, no events of unknown requests), with status ``ok`` when
  the client got a complete 2xx, except the events of requests a sidecar had
  answered shortly before it was SIGKILLed (the loss window, see
  :data:`LOSS_WINDOW_NOTE`): counted per kill, and each must lie in the window.

Also reported: p50/p99 latency per phase; memory (RSS and PSS) of every
process group sampled over time, with a least-squares slope per part (restarts
start a new incarnation; the slope is fitted within incarnations, after the
first 10 s of each), held against :data:`MEMORY_SLOPE_BOUND_MIB_PER_MIN` on runs
of :data:`MEMORY_JUDGED_MIN` minutes or more. Neither latency nor memory is part of
the accounting's verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import aiohttp

from bench.loadgen import percentile
from bench.machine import machine_facts
from bench.soak_procs import (
    Part,
    Postgres,
    SoakError,
    clean_env,
    free_port,
    group_memory,
    http_status,
    postgres_bindir,
    process_memory,
)
from bench.soak_stall import StallProxy

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "policies" / "examples" / "seed.yaml"
POLICY = "seed"
POOL = "soak"
SIDECARS = 2
ENGINES = ("base", "draft")
FAULTS = ("sidecar_kill", "stall", "kill_switch", "control_plane_kill", "engine_kill", "rollback", "postgres_kill")
HOSTILE = ("labels_header_8000_pairs", "json_schema_1mb", "json_5000_deep", "lone_surrogate_route", "nul_in_route",
           "max_completion_tokens_2_31")
# The exporter's POST timeout (sidecar.telemetry.TelemetryExporter's request_timeout_s), and slack for the
# encoding thread and the loop turn between an answer and its event.
TELEMETRY_POST_TIMEOUT_S = 10.0
WINDOW_SLACK_S = 1.0
LOSS_WINDOW_NOTE = (
    "sidecar/telemetry.py keeps an event in memory from the answer until its batch is committed by the control "
    "plane or written to the spool (write_atomic: fsync of the file and of the directory). Batches form every "
    "telemetry_flush_s (or at telemetry_batch_size events) and are then encoded and POSTed with a "
    f"{TELEMETRY_POST_TIMEOUT_S:g} s timeout; a failed or timed-out POST goes to the spool. So a SIGKILL loses "
    "the events of requests answered in the last telemetry_flush_s + POST time before it (at most "
    f"telemetry_flush_s + {TELEMETRY_POST_TIMEOUT_S:g} s, when the control plane hangs), and nothing older; "
    "spooled batches survive and are resent after the restart (deduplicated by batch id and event id).")

# Memory growth a part may show over a long run, fitted after its start-up; judged only on runs of at least
# MEMORY_JUDGED_MIN minutes (a shorter one mostly sees caches and pools filling).
MEMORY_SLOPE_BOUND_MIB_PER_MIN = 1.0
MEMORY_JUDGED_MIN = 10.0

T = TypeVar("T")


# --- configuration ------------------------------------------------------------------------------


@dataclass
class Config:
    minutes: float = 30.0
    fake_engines: bool = False
    rate: float | None = None  # requests/s; None: 25 with fake engines, 4 with real ones
    hostile_every_s: float = 5.0
    database: str = "postgresql"
    stall_s: float = 11.0
    down_s: float = 2.0
    telemetry_flush_s: float = 1.0
    max_in_flight: int = 64
    request_timeout_s: float | None = None  # None: 60 s fake, 300 s real
    sample_every_s: float | None = None  # None: 2 s up to 5 minutes, 5 s beyond
    drain_timeout_s: float = 120.0
    seed: int = 20261205
    keep: Path | None = None  # keep logs and state here

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def request_rate(self) -> float:
        return self.rate if self.rate is not None else (25.0 if self.fake_engines else 4.0)

    @property
    def timeout_s(self) -> float:
        return self.request_timeout_s or (60.0 if self.fake_engines else 300.0)

    @property
    def sample_s(self) -> float:
        return self.sample_every_s or (2.0 if self.minutes <= 5 else 5.0)

    @property
    def spacing_s(self) -> float:
        return min(90.0, self.duration_s / (len(FAULTS) + 1))

    @property
    def loss_window_s(self) -> float:
        return self.telemetry_flush_s + TELEMETRY_POST_TIMEOUT_S + WINDOW_SLACK_S

    @property
    def engines_label(self) -> str:
        return "FAKE engines (bench/fake_openai.py)" if self.fake_engines else "testbed vLLM engines (CPU)"


# --- the main thread runs every process ---------------------------------------------------------


class MainThread:
    """Runs calls on the main thread for the soak's event loop, which runs in another thread.

    Children get their parent-death signal from the thread that started them (testbed.lifeline), and the main
    thread lives as long as the soak; the loop also never blocks on a start that takes a minute (an engine).
    """

    def __init__(self) -> None:
        self._calls: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]] = \
            queue.Queue()
        self.closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.closed:
            future.set_exception(SoakError("the soak is stopping"))
        else:
            self._calls.put((fn, args, future))
        return future

    def serve(self, thread: threading.Thread) -> None:
        while thread.is_alive():
            try:
                fn, args, future = self._calls.get(timeout=0.1)
            except queue.Empty:
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except Exception as exc:
                future.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        while True:
            try:
                _, _, future = self._calls.get_nowait()
            except queue.Empty:
                return
            future.cancel()


def _answers(url: str) -> Callable[[], bool]:
    """Ready when ``url`` answers 200."""
    return lambda: http_status(url) == 200


# --- engines ------------------------------------------------------------------------------------


class FakeEngines:
    """``bench/fake_openai.py`` per engine name: FAKE, no model; a small delay per stream event."""

    def __init__(self, work: Path, token_delay_ms: float = 2.0) -> None:
        self.parts: dict[str, Part] = {}
        self.urls: dict[str, str] = {}
        for name in ENGINES:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            self.urls[name] = url
            self.parts[name] = Part(
                f"engine-{name}", work / "logs" / f"engine-{name}.log",
                [sys.executable, "-m", "bench.fake_openai", "--port", str(port), "--tokens", "16",
                 "--stream-tokens", "32", "--token-delay-ms", f"{token_delay_ms:g}"], clean_env(),
                ready=_answers(url + "/health"), ready_timeout_s=30, grace_s=5)

    def start_all(self) -> None:
        for part in self.parts.values():
            part.start()

    def kill(self, name: str) -> None:
        self.parts[name].kill()

    def start(self, name: str) -> float:
        return self.parts[name].start()

    def pgids(self) -> dict[str, int | None]:
        return {f"engine-{n}": p.pgid for n, p in self.parts.items()}

    def stop_all(self) -> None:
        for part in self.parts.values():
            part.stop()


class TestbedEngines:
    """The testbed's real vLLM engines (``testbed.engines``), tied to the soak's life."""

    def __init__(self, work: Path) -> None:
        from testbed import engines

        self.engines = engines
        self.state_dir = work / "engines"
        self.base_port = engines.free_base_port(ENGINES, 18700)
        self.urls = {n: f"http://127.0.0.1:{p}" for n, p in engines.ports_for(ENGINES, self.base_port).items()}
        self.testbed: Any = None

    def start_all(self) -> None:
        from testbed.models import ensure

        self.testbed = ensure(quiet=True)
        self.engines.start(ENGINES, self.base_port, state_dir=self.state_dir, testbed=self.testbed,
                           timeout_s=900, die_with_parent=True)

    def kill(self, name: str) -> None:
        record = self.engines.StateFile(self.state_dir).read()[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(record.pid, 0)
        self.engines.stop([name], state_dir=self.state_dir)  # forgets the record; nothing left to signal

    def start(self, name: str) -> float:
        t0 = time.monotonic()
        self.engines.start([name], self.base_port, state_dir=self.state_dir, testbed=self.testbed,
                           timeout_s=900, die_with_parent=True)
        return time.monotonic() - t0

    def pgids(self) -> dict[str, int | None]:
        records = self.engines.StateFile(self.state_dir).read()
        return {f"engine-{n}": (records[n].pid if n in records and self.engines.is_alive(records[n]) else None)
                for n in ENGINES}

    def stop_all(self) -> None:
        self.engines.stop(state_dir=self.state_dir)


# --- the parts together --------------------------------------------------------------------------


@dataclass
class Keys:
    admin: str
    operator: str
    workers: list[str]


class Stack:
    """Database, control plane, engines and sidecars; started, killed and restarted on the main thread."""

    def __init__(self, config: Config, work: Path) -> None:
        self.config = config
        self.work = work
        self.postgres: Postgres | None = None
        self.database = "sqlite"
        self.database_note = ""
        self.database_url = ""
        self.control_plane: Part | None = None
        self.cp_port = free_port()
        self.cp_url = f"http://127.0.0.1:{self.cp_port}"
        self.engines: FakeEngines | TestbedEngines | None = None
        self.sidecars: list[Part] = []
        self.sidecar_urls: list[str] = []
        self.worker_ids = [f"soak-sidecar-{i + 1}" for i in range(SIDECARS)]
        self.keys: Keys | None = None
        self.revisions: list[str] = []
        self.public_key = ""
        self._signing_key = ""

    # database, policy, keys, control plane
    def start_database(self) -> None:
        bindir = postgres_bindir() if self.config.database == "postgresql" else None
        why = "no PostgreSQL binaries found (pg_config --bindir, PATH)"
        if bindir is not None:
            try:
                self.postgres = Postgres(bindir, self.work)
                self.postgres.init()
            except SoakError as exc:
                # a machine where PostgreSQL cannot run privately (no user to run it as, initdb fails)
                if self.postgres is not None:
                    self.postgres.remove()
                    self.postgres = None
                why = f"a private PostgreSQL did not start: {str(exc)[:300]}"
            else:
                self.database, self.database_url = "postgresql", self.postgres.url
                return
        self.database_url = f"sqlite:///{self.work / 'specgate.db'}"
        self.database_note = (f"SQLite: {why}" if self.config.database == "postgresql"
                              else "SQLite, as asked (--database sqlite)")

    def seed(self) -> None:
        from controlplane.auth.local import mint_keys
        from controlplane.auth.schemas import Scope
        from controlplane.migrations_state import upgrade
        from policies import SigningKey

        upgrade(self.database_url)
        wanted = {"soak-admin": Scope.admin, "soak-operator": Scope.operator}
        wanted.update({worker: Scope.worker for worker in self.worker_ids})
        tokens = mint_keys(self.database_url, wanted, created_by="bench:soak",
                           worker_ids={worker: [worker] for worker in self.worker_ids})
        self.keys = Keys(tokens["soak-admin"], tokens["soak-operator"], [tokens[w] for w in self.worker_ids])
        key = SigningKey.generate()
        self._signing_key, self.public_key = key.private_key_b64(), key.public_key_b64
        self.control_plane = Part(
            "control-plane", self.work / "logs" / "control-plane.log",
            [sys.executable, "-m", "specgate", "serve", "--host", "127.0.0.1", "--port", str(self.cp_port)],
            clean_env(SPECGATE_DATABASE_URL=self.database_url, SPECGATE_SIGNING_KEY=self._signing_key),
            ready=_answers(self.cp_url + "/readyz"), ready_timeout_s=90, grace_s=10)

    def load_policy(self) -> None:
        """Revision A (the seed example, active) and B (speculating up to batch 8, a draft) of policy ``seed``."""
        import yaml

        from apiclient import ApiClient, calls

        assert self.keys is not None
        text_a = SEED.read_text()
        document = yaml.safe_load(text_a)
        document["rules"][0]["when"]["batch_size"]["max"] = 8
        text_b = yaml.safe_dump(document, sort_keys=False)
        with ApiClient(self.cp_url, self.keys.admin, timeout_s=30) as api:
            api.send(calls.create_policy(POLICY, description="bench.soak"))
            first = api.send(calls.create_revision(POLICY, text_a, message="soak A", if_match="*")).data.id
            second = api.send(calls.create_revision(POLICY, text_b, message="soak B",
                                                    if_match=f'"{first}"')).data.id
        self.revisions = [first, second]

    def start_control_plane(self) -> float:
        assert self.control_plane is not None
        return self.control_plane.start()

    # engines
    def start_engines(self) -> None:
        self.engines = FakeEngines(self.work) if self.config.fake_engines else TestbedEngines(self.work)
        self.engines.start_all()

    # sidecars
    def make_sidecars(self, control_plane_url: str) -> None:
        assert self.keys is not None
        assert self.engines is not None
        for i, worker in enumerate(self.worker_ids):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "specgate", "sidecar", "--control-plane", control_plane_url,
                   "--listen", f"127.0.0.1:{port}", "--pool", POOL, "--worker-id", worker,
                   "--state-dir", str(self.work / worker), "--public-key", self.public_key, "--log-level", "warning"]
            for name, engine_url in self.engines.urls.items():
                cmd += ["--engine", f"{name}={engine_url}"]
            # The key in the environment: a command line is readable by everyone.
            env = clean_env(SPECGATE_KEY=self.keys.workers[i],
                            SPECGATE_TELEMETRY_FLUSH_S=f"{self.config.telemetry_flush_s:g}")
            self.sidecars.append(Part(worker, self.work / "logs" / f"{worker}.log", cmd, env,
                                      ready=_answers(url + "/readyz"), ready_timeout_s=60,
                                      grace_s=20))
            self.sidecar_urls.append(url)

    def start_sidecars(self) -> None:
        for part in self.sidecars:
            part.start()

    def pgids(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        if self.postgres is not None:
            out["postgres"] = self.postgres.part.pgid
        if self.control_plane is not None:
            out["control-plane"] = self.control_plane.pgid
        if self.engines is not None:
            out.update(self.engines.pgids())
        for part in self.sidecars:
            out[part.name] = part.pgid
        return out

    def incarnations(self) -> dict[str, int]:
        out = {p.name: p.incarnation for p in self.sidecars}
        if self.control_plane is not None:
            out["control-plane"] = self.control_plane.incarnation
        if self.postgres is not None:
            out["postgres"] = self.postgres.part.incarnation
        if isinstance(self.engines, FakeEngines):
            out.update({p.name: p.incarnation for p in self.engines.parts.values()})
        return out

    def stop_all(self) -> None:
        """Sidecars first (they flush telemetry to a control plane still up), then the rest; never raises."""
        steps: list[Callable[[], None]] = [p.stop for p in self.sidecars]
        if self.control_plane is not None:
            steps.append(self.control_plane.stop)
        if self.engines is not None:
            steps.append(self.engines.stop_all)
        if self.postgres is not None:
            steps.append(self.postgres.remove)
        for step in steps:
            try:
                step()
            except Exception as exc:  # one part that cannot be stopped must not spare the others
                print(f"soak: could not stop a part: {exc}", file=sys.stderr)


# --- requests -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    rid: str
    sidecar: int
    kind: str  # json, stream, structured, or hostile:<name>
    route: str
    start: float
    end: float = 0.0
    status: int | None = None
    outcome: str = "pending"  # ok, error, transport, timeout, bad
    detail: str = ""
    decided: bool = False
    rule: str | None = None
    revision: str | None = None
    ttft: float | None = None
    error_type: str | None = None  # the problem type (or engine error type) of an error answer

    @property
    def hostile(self) -> bool:
        return self.kind.startswith("hostile:")


def _decision(value: str | None) -> dict[str, str]:
    out = {}
    for part in (value or "").split(";"):
        key, sep, val = part.strip().partition("=")
        if sep:
            out[key] = val
    return out


def _error_type(raw: bytes, content_type: str) -> str | None:
    """The problem type of an error answer (problem+json), or the type of an OpenAI-style engine error."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if "problem+json" in content_type and isinstance(data.get("type"), str):
        return str(data["type"])
    error = data.get("error")
    if isinstance(error, dict):
        return f"engine:{error.get('type') or error.get('code') or 'error'}"
    return None


class Bodies:
    """What the traffic sends: prompts for fake or real engines, and the hostile inputs."""

    def __init__(self, fake: bool, seed: int) -> None:
        self.fake = fake
        self.schema: dict[str, Any] = {"type": "object", "properties": {"name": {"type": "string"}},
                                       "required": ["name"]}
        self.routes: tuple[str, ...]
        self.rng = random.Random(seed)
        if fake:
            self.model = "fake-model"
            self.routes = ("chat", "chat", "extract", "classify")
            self.prompts: dict[str, list[str]] = {r: [f"{r} request {i}: say something" for i in range(32)]
                                                  for r in set(self.routes)}
            self.max_tokens = 16
        else:
            from testbed import corpus, engines
            from testbed.recipe import RECIPE

            self.model = engines.MODEL_NAME
            self.routes = ("chat", "chat", "extract", "classify", "creative")
            self.prompts = {r: [ex.prompt for ex in corpus.requests(r, 64, int(RECIPE["seed"]))]
                            for r in set(self.routes)}
            self.schema = {"type": "object", "properties": {k: {"type": "string"} for k in corpus.TEMPLATE_FIELDS},
                           "required": list(corpus.TEMPLATE_FIELDS)}
            self.max_tokens = 24
        self._hostile_cache: dict[str, tuple[dict[str, str], bytes]] = {}

    def pick(self) -> tuple[str, str]:
        roll = self.rng.random()
        kind = "json" if roll < 0.45 else ("stream" if roll < 0.8 else "structured")
        return kind, self.rng.choice(self.routes)

    def body(self, kind: str, route: str) -> dict[str, Any]:
        prompt = self.rng.choice(self.prompts[route])
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0,
                                "messages": [{"role": "user", "content": prompt}]}
        if kind == "stream":
            body["stream"] = True
        elif kind == "structured":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "record", "schema": self.schema}}
        return body

    def hostile(self, name: str) -> tuple[dict[str, str], bytes]:
        """(extra headers, body) of a hostile request; built once each."""
        if name in self._hostile_cache:
            return self._hostile_cache[name]
        base = self.body("json", "chat")
        headers: dict[str, str] = {}
        if name == "labels_header_8000_pairs":
            # ~52 KB: under the sidecar's header-block cap, so that the pairs reach the label parser
            headers["X-Specgate-Labels"] = ",".join(f"{i:x}=1" for i in range(8000))
            raw = json.dumps(base).encode()
        elif name == "json_schema_1mb":
            props: dict[str, Any] = {}
            size = 0
            while size < 1_000_000:
                key = f"p{len(props)}"
                props[key] = {"type": "string", "description": "x" * 40}
                size += len(key) + 70
            base["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "huge", "schema": {"type": "object", "properties": props}}}
            raw = json.dumps(base).encode()
        elif name == "json_5000_deep":
            head = json.dumps({k: v for k, v in base.items()})[:-1]
            raw = (head + ', "metadata": {"deep": ' + "[" * 5000 + "]" * 5000 + "}}").encode()
        elif name == "lone_surrogate_route":
            base["metadata"] = {"route": "\ud800"}
            raw = json.dumps(base).encode()  # ensure_ascii: the surrogate travels as the escape \ud800
        elif name == "nul_in_route":
            base["metadata"] = {"route": "chat\u0000x"}
            raw = json.dumps(base).encode()
        elif name == "max_completion_tokens_2_31":
            base.pop("max_tokens")
            base["max_completion_tokens"] = 2**31
            raw = json.dumps(base).encode()
        else:
            raise ValueError(name)
        self._hostile_cache[name] = (headers, raw)
        return headers, raw


# --- the soak ------------------------------------------------------------------------------------


@dataclass
class FaultRecord:
    name: str
    at: float  # monotonic, from the soak's start
    target: str = ""
    done: float = 0.0
    skipped: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


class Soak:
    """Runs in its own thread with its own event loop: traffic, faults, memory samples, then the accounting."""

    def __init__(self, config: Config, stack: Stack, main: MainThread) -> None:
        self.config = config
        self.stack = stack
        self.main = main
        self.bodies = Bodies(config.fake_engines, config.seed)
        self.run_id = uuid.uuid4().hex[:8]
        self.t0 = 0.0
        self.load_start: list[float] = []
        self.requests: list[Request] = []
        self.in_flight: set[asyncio.Task[None]] = set()
        self.skipped = 0
        self.up = [True] * SIDECARS
        self.rr = 0
        self.faults: list[FaultRecord] = []
        self.kills: list[dict[str, Any]] = []  # sidecar kills: index, t_kill, t_up
        self.memory: dict[str, list[tuple[float, int, float, float]]] = defaultdict(list)
        self.proxy: StallProxy | None = None
        self.session: aiohttp.ClientSession | None = None
        self.stopping = False
        self.report: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.switches: list[dict[str, Any]] = []  # kill switch windows and rollbacks, for the checks

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def on_main(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.main.submit(fn, *args))

    # the thread
    def run_thread(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self.error = exc

    def cancel(self) -> None:
        if self.loop is not None and self._task is not None:
            self.loop.call_soon_threadsafe(self._task.cancel)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self.proxy = StallProxy(self.stack.cp_port)
        await self.proxy.start()
        try:
            self.stack.make_sidecars(f"http://127.0.0.1:{self.proxy.port}")
            await self.on_main(self.stack.start_sidecars)
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(connector=connector, auto_decompress=True) as session:
                self.session = session
                await self._soak()
        finally:
            await self.proxy.close()

    async def _soak(self) -> None:
        self.t0 = time.monotonic()
        self.load_start = list(os.getloadavg())
        background = [asyncio.create_task(self._traffic()), asyncio.create_task(self._hostile()),
                      asyncio.create_task(self._sample_memory())]
        try:
            await self._schedule()
        finally:
            self.stopping = True
            for task in background[:2]:
                task.cancel()
            await asyncio.gather(*background[:2], return_exceptions=True)
            if self.in_flight:
                await asyncio.wait(self.in_flight, timeout=self.config.timeout_s + 10)
            background[2].cancel()
            await asyncio.gather(background[2], return_exceptions=True)
        end = self.now()
        drained = await self._drain()
        events = await asyncio.to_thread(read_events, self.stack.database_url)
        self.report = build_report(self, events, drained, end)

    # --- traffic ---

    def _pick_sidecar(self) -> int:
        up = [i for i in range(SIDECARS) if self.up[i]] or list(range(SIDECARS))
        self.rr += 1
        return up[self.rr % len(up)]

    async def _traffic(self) -> None:
        interval = 1.0 / self.config.request_rate
        next_at = time.monotonic()
        while not self.stopping:
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -1.0:
                next_at = time.monotonic()  # the loop fell behind: do not burst to catch up
            if len(self.in_flight) >= self.config.max_in_flight:
                self.skipped += 1
                continue
            kind, route = self.bodies.pick()
            self._launch(kind, route, {}, json.dumps(self.bodies.body(kind, route)).encode(), stream=kind == "stream")

    async def _hostile(self) -> None:
        i = 0
        while not self.stopping:
            await asyncio.sleep(self.config.hostile_every_s)
            name = HOSTILE[i % len(HOSTILE)]
            i += 1
            headers, raw = self.bodies.hostile(name)
            self._launch(f"hostile:{name}", "chat", headers, raw, stream=False)

    def _launch(self, kind: str, route: str, headers: dict[str, str], raw: bytes, *, stream: bool) -> None:
        request = Request(f"soak-{self.run_id}-{len(self.requests)}", self._pick_sidecar(), kind, route, self.now())
        self.requests.append(request)
        task = asyncio.create_task(self._send(request, headers, raw, stream))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    async def _send(self, r: Request, extra: dict[str, str], raw: bytes, stream: bool) -> None:
        assert self.session is not None
        url = self.stack.sidecar_urls[r.sidecar] + "/v1/chat/completions"
        headers = {"Content-Type": "application/json", "X-Request-Id": r.rid, **extra}
        if not r.hostile:
            headers["X-Specgate-Route"] = r.route
        try:
            async with asyncio.timeout(self.config.timeout_s):
                async with self.session.post(url, data=raw, headers=headers) as resp:
                    r.status = resp.status
                    decision = resp.headers.get("X-Specgate-Decision")
                    if decision is not None:
                        r.decided = True
                        parsed = _decision(decision)
                        r.rule, r.revision = parsed.get("rule"), parsed.get("revision")
                    ctype = resp.headers.get("Content-Type", "")
                    if resp.status == 200 and stream and ctype.startswith("text/event-stream"):
                        await self._read_stream(r, resp)
                    else:
                        body = await resp.read()
                        self._judge(r, body, ctype)
        except TimeoutError:
            r.outcome, r.detail = "timeout", f"no complete answer within {self.config.timeout_s:g} s"
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            r.outcome, r.detail = "transport", f"{type(exc).__name__}: {str(exc)[:200]}"
        r.end = self.now()

    async def _read_stream(self, r: Request, resp: aiohttp.ClientResponse) -> None:
        done = False
        error = None
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break  # and drop the connection, as clients that stop at [DONE] do
            try:
                chunk = json.loads(payload)
            except ValueError:
                continue
            if isinstance(chunk, dict) and "error" in chunk:
                err = chunk["error"]
                error = str(err.get("type") or "error") if isinstance(err, dict) else "error"
            elif r.ttft is None and isinstance(chunk, dict):
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        r.ttft = self.now() - r.start
                        break
        if error is not None:
            r.outcome, r.detail = "error", f"stream error event: {error}"
        elif done:
            r.outcome = "ok"
        else:
            r.outcome, r.detail = "bad", "the stream ended without [DONE]"

    @staticmethod
    def _judge(r: Request, body: bytes, ctype: str) -> None:
        status = r.status or 0
        if 200 <= status < 300:
            try:
                data = json.loads(body)
                ok = isinstance(data, dict) and bool(data.get("choices"))
            except ValueError:
                ok = False
            r.outcome, r.detail = ("ok", "") if ok else ("bad", f"HTTP {status} without choices: {body[:120]!r}")
            return
        kind = r.error_type = _error_type(body, ctype)
        if status >= 400 and kind is not None and not (status >= 500 and r.hostile):
            r.outcome, r.detail = "error", f"HTTP {status} {kind}"
        else:
            r.outcome, r.detail = "bad", f"HTTP {status} ({ctype or 'no content type'}): {body[:160]!r}"

    # --- faults ---

    async def _schedule(self) -> None:
        spacing = self.config.spacing_s
        plan = [FAULTS[k % len(FAULTS)] for k in range(max(len(FAULTS), int(self.config.duration_s // spacing) - 1))]
        counts: Counter[str] = Counter()
        for k, name in enumerate(plan):
            at = spacing * (k + 1)
            if k >= len(FAULTS) and at > self.config.duration_s - spacing / 2:
                break
            await asyncio.sleep(max(0.0, at - self.now()))
            record = FaultRecord(name, self.now())
            self.faults.append(record)
            await getattr(self, f"_fault_{name}")(record, counts[name])
            counts[name] += 1
            record.done = self.now()
        # the last phase: steady traffic up to the end, and at least a few seconds after the last recovery
        tail = max(self.config.duration_s - self.now(), min(10.0, spacing / 2))
        await asyncio.sleep(tail)

    async def _fault_stall(self, record: FaultRecord, nth: int) -> None:
        assert self.proxy is not None
        record.target = "sidecars -> control plane link"
        record.detail["seconds"] = self.config.stall_s
        await self.proxy.stall(self.config.stall_s)

    async def _fault_sidecar_kill(self, record: FaultRecord, nth: int) -> None:
        index = nth % SIDECARS
        part = self.stack.sidecars[index]
        record.target = part.name
        self.up[index] = False
        kill = {"sidecar": index, "t_kill": self.now()}
        await self.on_main(part.kill)
        kill["t_dead"] = self.now()
        await asyncio.sleep(self.config.down_s)
        record.detail["restart_s"] = round(await self.on_main(part.start), 2)
        kill["t_up"] = self.now()
        self.up[index] = True
        self.kills.append(kill)

    async def _fault_control_plane_kill(self, record: FaultRecord, nth: int) -> None:
        part = self.stack.control_plane
        assert part is not None
        record.target = "control plane"
        await self.on_main(part.kill)
        await asyncio.sleep(self.config.down_s)
        record.detail["restart_s"] = round(await self.on_main(part.start), 2)

    async def _fault_postgres_kill(self, record: FaultRecord, nth: int) -> None:
        if self.stack.postgres is None:
            record.skipped = "no PostgreSQL (SQLite)"
            return
        part = self.stack.postgres.part
        record.target = "postgresql"
        await self.on_main(part.kill)
        await asyncio.sleep(self.config.down_s)
        record.detail["restart_s"] = round(await self.on_main(part.start), 2)
        # the control plane's pool reconnects on its own; wait until it says the database answers again
        t0 = time.monotonic()
        while http_status(self.stack.cp_url + "/readyz") != 200 and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.2)
        record.detail["control_plane_ready_s"] = round(time.monotonic() - t0, 2)

    async def _fault_engine_kill(self, record: FaultRecord, nth: int) -> None:
        assert self.stack.engines is not None
        name = ("draft", "base")[nth % 2]
        record.target = f"engine {name}"
        await self.on_main(self.stack.engines.kill, name)
        await asyncio.sleep(self.config.down_s)
        record.detail["restart_s"] = round(await self.on_main(self.stack.engines.start, name), 2)

    async def _operator(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        assert self.session is not None
        assert self.stack.keys is not None
        headers = {"Authorization": f"Bearer {self.stack.keys.operator}"}
        async with self.session.request(method, self.stack.cp_url + path, json=body, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text

    async def _fault_kill_switch(self, record: FaultRecord, nth: int) -> None:
        record.target = "kill switch"
        hold = min(10.0, self.config.spacing_s / 2)
        t_on = self.now()
        status_on, _ = await self._operator("PUT", "/v1/killswitch", {"enabled": True, "reason": "bench.soak"})
        await asyncio.sleep(hold)
        t_off = self.now()
        status_off, _ = await self._operator("PUT", "/v1/killswitch", {"enabled": False, "reason": "bench.soak"})
        record.detail.update(on_status=status_on, off_status=status_off, held_s=hold)
        self.switches.append({"kind": "kill_switch", "t_on": t_on, "t_off": t_off,
                              "ok": status_on == status_off == 200})

    async def _fault_rollback(self, record: FaultRecord, nth: int) -> None:
        target = self.stack.revisions[(nth + 1) % 2]
        record.target = f"rollback to {target[:12]}"
        t = self.now()
        status, answer = await self._operator("POST", f"/v1/policies/{POLICY}/rollback",
                                              {"revision": target, "reason": "bench.soak"})
        record.detail.update(status=status, revision=target)
        if status != 200:
            record.detail["answer"] = str(answer)[:300]
        self.switches.append({"kind": "rollback", "t": t, "revision": target, "ok": status == 200})

    # --- memory ---

    async def _sample_memory(self) -> None:
        me = os.getpid()
        while True:
            pgids = self.stack.pgids()
            incarnations = self.stack.incarnations()
            t = self.now()
            sample = await asyncio.to_thread(group_memory, pgids)
            for name, (rss, pss, _) in sample.items():
                self.memory[name].append((t, incarnations.get(name, 1), rss, pss))
            own = await asyncio.to_thread(process_memory, me)
            if own is not None:
                self.memory["soak (load generator, stall proxy)"].append((t, 1, own[0], own[1]))
            await asyncio.sleep(self.config.sample_s)

    # --- drain ---

    async def _queue_depth(self, url: str) -> float | None:
        assert self.session is not None
        try:
            async with self.session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        for line in text.splitlines():
            if line.startswith("specgate_sidecar_telemetry_queue_depth"):
                return float(line.split()[-1])
        return None

    async def _drain(self) -> dict[str, Any]:
        """Until both sidecars hold no telemetry (memory, in flight, spool) and the store stops growing."""
        t0 = time.monotonic()
        last = -1
        stable_since = time.monotonic()
        depths: list[float | None] = []
        while time.monotonic() - t0 < self.config.drain_timeout_s:
            depths = [await self._queue_depth(url) for url in self.stack.sidecar_urls]
            count = await asyncio.to_thread(count_events, self.stack.database_url)
            if count != last:
                last, stable_since = count, time.monotonic()
            if all(d == 0 for d in depths) and time.monotonic() - stable_since >= 2 * self.config.telemetry_flush_s:
                return {"drained": True, "seconds": round(time.monotonic() - t0, 1), "queue_depths": depths}
            await asyncio.sleep(0.5)
        return {"drained": False, "seconds": round(time.monotonic() - t0, 1), "queue_depths": depths}


# --- the database -----------------------------------------------------------------------------------


def count_events(url: str) -> int:
    from sqlalchemy import func, select

    from controlplane.db import make_engine
    from controlplane.models import TelemetryEventRecord

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(TelemetryEventRecord)).scalar_one())
    except Exception:
        return -1
    finally:
        engine.dispose()


def read_events(url: str) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from controlplane.db import make_engine
    from controlplane.models import TelemetryEventRecord as E

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(E.event_id, E.request_id, E.worker_id, E.status, E.kill_switch, E.rule,
                                       E.revision, E.route, E.max_tokens)).all()
    finally:
        engine.dispose()
    return [dict(row._mapping) for row in rows]


# --- the report -----------------------------------------------------------------------------------------


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def slope_per_min(samples: list[tuple[float, int, float, float]], column: int, skip_s: float) -> float | None:
    """Least-squares MiB/min within incarnations (each centred on its own mean), after ``skip_s`` of start-up."""
    by_incarnation: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for sample in samples:
        by_incarnation[sample[1]].append((sample[0], sample[column]))
    sxx = sxy = 0.0
    for points in by_incarnation.values():
        start = points[0][0]
        points = [p for p in points if p[0] - start >= skip_s]
        if len(points) < 3:
            continue
        mt = statistics.fmean(p[0] for p in points)
        mv = statistics.fmean(p[1] for p in points)
        sxx += sum((p[0] - mt) ** 2 for p in points)
        sxy += sum((p[0] - mt) * (p[1] - mv) for p in points)
    return None if sxx == 0 else round(sxy / sxx * 60.0, 3)


def rss_by_minute(samples: list[tuple[float, int, float, float]]) -> list[list[float]]:
    """[minute, incarnation, RSS MiB] of the last sample in each minute of each incarnation."""
    last: dict[tuple[int, int], float] = {}
    for at, incarnation, rss, _pss in samples:
        last[(int(at // 60), incarnation)] = rss
    return [[minute, incarnation, round(rss, 1)] for (minute, incarnation), rss in sorted(last.items())]


def _phases(soak: Soak, end: float) -> list[dict[str, Any]]:
    bounds = [("steady", 0.0, "")] + [(f.name, f.at, f.target) for f in soak.faults if not f.skipped]
    hostile: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in soak.requests:
        if r.hostile:
            hostile[r.sidecar].append((r.start, r.end))

    def beside_hostile(r: Request) -> bool:
        return any(start <= r.end and r.start <= end for start, end in hostile[r.sidecar])

    out = []
    for i, (name, start, target) in enumerate(bounds):
        stop = bounds[i + 1][1] if i + 1 < len(bounds) else end
        rs = [r for r in soak.requests if start <= r.start < stop and not r.hostile]
        ok = [r for r in rs if r.outcome == "ok"]
        e2e = [r.end - r.start for r in ok]
        # the same without the requests that shared their sidecar with a hostile one in flight: what the faults
        # alone did to latency, and how much the hostile requests add beside it
        clean = [r.end - r.start for r in ok if not beside_hostile(r)]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        out.append({"phase": i, "after": name, "target": target, "from_s": round(start, 1), "to_s": round(stop, 1),
                    "requests": len(rs), "ok": len(ok), "errors": sum(r.outcome == "error" for r in rs),
                    "other": sum(r.outcome not in ("ok", "error") for r in rs),
                    "p50_ms": _ms(percentile(e2e, 50)), "p99_ms": _ms(percentile(e2e, 99)),
                    "p99_ms_no_hostile_in_flight": _ms(percentile(clean, 99)),
                    "stream_ttft_p50_ms": _ms(percentile(ttft, 50)), "stream_ttft_p99_ms": _ms(percentile(ttft, 99))})
    return out


def _example(r: Request, **extra: Any) -> dict[str, Any]:
    out = {"request_id": r.rid, "kind": r.kind, "sidecar": r.sidecar + 1, "start_s": round(r.start, 2),
           "end_s": round(r.end, 2), "status": r.status, "outcome": r.outcome, "detail": r.detail,
           "decided": r.decided}
    out.update(extra)
    return out


def build_report(soak: Soak, events: list[dict[str, Any]], drained: dict[str, Any], end: float) -> dict[str, Any]:
    config = soak.config
    window = config.loss_window_s
    by_request: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        by_request[event["request_id"]].append(event)
    known = {r.rid for r in soak.requests}

    def killed_window(r: Request) -> dict[str, Any] | None:
        """The kill of this request's sidecar that explains a transport failure of it."""
        for kill in soak.kills:
            if kill["sidecar"] == r.sidecar and r.end >= kill["t_kill"] - 0.5 and r.start <= kill["t_up"] + 0.5:
                return kill
        return None

    def engine_was_down(r: Request) -> bool:
        """Whether the soak had an engine killed (until it was back, plus a second) while ``r`` ran."""
        return any(f.name == "engine_kill" and f.done and r.start <= f.done + 1.0 and r.end >= f.at - 0.5
                   for f in soak.faults)

    outcomes: Counter[str] = Counter()
    unaccounted: list[dict[str, Any]] = []
    hostile: dict[str, Counter[str]] = defaultdict(Counter)
    for r in soak.requests:
        if r.outcome == "transport" and killed_window(r) is not None:
            category = "failed: sidecar killed"
        elif r.outcome == "ok":
            category = "ok"
        elif r.outcome == "error":
            category = "clear error"
        elif (r.outcome == "bad" and r.hostile and (r.error_type or "").endswith("/upstream-unavailable")
              and engine_was_down(r)):
            # A hostile request the engine would have answered, caught by the engine kill like any other:
            # the 5xx is the outage's, not the input's (an input that takes an engine down does so outside
            # the kill's window and stays unaccounted).
            r.outcome, r.detail = "error", f"{r.detail} (an engine the soak had killed)"
            category = "clear error"
        else:
            category = "unaccounted"
            unaccounted.append(_example(r))
        outcomes[category] += 1
        if r.hostile:
            hostile[r.kind.split(":", 1)[1]][f"{r.status} {r.outcome}" if r.status else r.outcome] += 1

    # events
    expected = [r for r in soak.requests if r.decided and r.outcome in ("ok", "error")]
    duplicates = {rid: len(evs) for rid, evs in by_request.items() if len(evs) > 1}
    stray = [rid for rid in by_request if rid not in known]
    missing = [r for r in expected if r.rid not in by_request]
    status_mismatch = []
    for r in expected:
        evs = by_request.get(r.rid)
        if evs and ((r.outcome == "ok") != (evs[0]["status"] == "ok")):
            status_mismatch.append(_example(r, event_status=evs[0]["status"]))
    undecided_with_event = [r for r in soak.requests if not r.decided and r.rid in by_request]

    kills = []
    lost_in_window: set[str] = set()
    for kill in soak.kills:
        answered_before = [r for r in expected if r.sidecar == kill["sidecar"] and r.end <= kill["t_kill"]]
        lost = [r for r in answered_before if r.rid not in by_request and kill["t_kill"] - r.end <= window]
        lost_in_window.update(r.rid for r in lost)
        recent = [r for r in answered_before if kill["t_kill"] - r.end <= window]
        kills.append({"sidecar": kill["sidecar"] + 1, "at_s": round(kill["t_kill"], 2),
                      "down_s": round(kill["t_up"] - kill["t_kill"], 2), "events_lost": len(lost),
                      "answered_in_window_before": len(recent),
                      "oldest_lost_age_s": round(max((kill["t_kill"] - r.end for r in lost), default=0.0), 3),
                      "lost_ages_s": sorted(round(kill["t_kill"] - r.end, 2) for r in lost),
                      "lost_kinds": dict(Counter(r.kind for r in lost)),
                      "in_flight_cut": sum(1 for r in soak.requests if r.sidecar == kill["sidecar"]
                                           and r.outcome == "transport" and r.start < kill["t_kill"] <= r.end)})
    missing_outside = [_example(r) for r in missing if r.rid not in lost_in_window]
    # A lost batch takes every event that shared it: unexplained losses come in runs of one sidecar's answers a
    # batch interval long. Each run is listed with the decided hostile requests of that sidecar answered within
    # a batch interval of it, as a lead to the cause.
    decided_hostile = [r for r in soak.requests if r.hostile and r.decided]
    runs: list[dict[str, Any]] = []
    reach = config.telemetry_flush_s + 1.0
    for example in sorted(missing_outside, key=lambda e: (e["sidecar"], e["end_s"])):
        last = runs[-1] if runs else None
        if last is not None and last["sidecar"] == example["sidecar"] and example["end_s"] - last["to_s"] <= reach:
            last["to_s"] = example["end_s"]
            last["events"] += 1
        else:
            runs.append({"sidecar": example["sidecar"], "from_s": example["end_s"], "to_s": example["end_s"],
                         "events": 1})
    near: Counter[str] = Counter()
    for run_ in runs:
        run_["hostile_nearby"] = sorted({h.kind.split(":", 1)[1] for h in decided_hostile
                                         if h.sidecar + 1 == run_["sidecar"]
                                         and run_["from_s"] - reach <= h.end <= run_["to_s"] + reach})
        near["+".join(run_["hostile_nearby"]) or "no hostile request nearby"] += run_["events"]

    # kill switch and rollbacks, as the answers' decision headers show them
    switch_checks = []
    for change in soak.switches:
        if change["kind"] == "kill_switch":
            # what the answers show once the change had time to reach the sidecars (a long-poll answer: well
            # under a second on loopback), and up to the switch going off again
            grace = min(5.0, (change["t_off"] - change["t_on"]) / 3)
            during = [r for r in soak.requests if r.decided and change["t_on"] + grace <= r.start
                      and r.end <= change["t_off"]]
            wrong = [r for r in during if r.rule != "kill-switch"]
            first = {}
            for i in range(SIDECARS):
                hits = [r.start for r in soak.requests if r.sidecar == i and r.rule == "kill-switch"
                        and r.start >= change["t_on"]]
                first[f"sidecar-{i + 1}"] = round(min(hits) - change["t_on"], 2) if hits else None
            switch_checks.append({"kind": "kill_switch", "api_ok": change["ok"], "checked": len(during),
                                  "not_honoured": len(wrong), "first_kill_switch_answer_after_s": first})
        else:
            grace = 5.0
            following = [f.at for f in soak.faults if f.at > change["t"]]
            until = min(following) if following else end
            during = [r for r in soak.requests if r.decided and change["t"] + grace <= r.start and r.end <= until
                      and r.rule != "kill-switch"]
            wrong = [r for r in during if not (r.revision and change["revision"].startswith(r.revision))]
            switch_checks.append({"kind": "rollback", "api_ok": change["ok"], "revision": change["revision"][:12],
                                  "checked": len(during), "old_revision_after_grace": len(wrong)})

    memory = {}
    for name, samples in sorted(soak.memory.items()):
        if not samples:
            continue
        rss = [s[2] for s in samples]
        memory[name] = {"samples": len(samples), "incarnations": len({s[1] for s in samples}),
                        "rss_first_mib": round(rss[0], 1), "rss_last_mib": round(rss[-1], 1),
                        "rss_max_mib": round(max(rss), 1),
                        "rss_slope_mib_per_min": slope_per_min(samples, 2, skip_s=10.0),
                        "pss_last_mib": round(samples[-1][3], 1),
                        "pss_slope_mib_per_min": slope_per_min(samples, 3, skip_s=10.0),
                        # The curve, to tell filling caches (flattening) from a leak (a straight line).
                        "rss_by_minute": rss_by_minute(samples)}

    judged = config.minutes >= MEMORY_JUDGED_MIN
    growing = sorted(name for name, m in memory.items()
                     if (m["rss_slope_mib_per_min"] or 0.0) > MEMORY_SLOPE_BOUND_MIB_PER_MIN)
    failures = []
    if outcomes["unaccounted"]:
        failures.append(f"{outcomes['unaccounted']} unaccounted requests")
    if duplicates:
        failures.append(f"{len(duplicates)} requests stored more than once")
    if stray:
        failures.append(f"{len(stray)} events of requests the soak never sent")
    if missing_outside:
        failures.append(f"{len(missing_outside)} answered requests without an event, outside the SIGKILL window")
    if status_mismatch:
        failures.append(f"{len(status_mismatch)} complete 2xx answers stored with another status (or the reverse)")
    if not drained["drained"]:
        failures.append(f"telemetry did not drain in {config.drain_timeout_s:g} s (queue depths "
                        f"{drained['queue_depths']})")
    checks = [c for c in switch_checks if not c["api_ok"] or c.get("not_honoured") or c.get("old_revision_after_grace")]

    return {
        "benchmark": "soak",
        "engines": config.engines_label,
        "database": soak.stack.database if not soak.stack.database_note else soak.stack.database_note,
        "machine": machine_facts(),
        "load_average": {"start": soak.load_start, "end": list(os.getloadavg())},
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
                   "rate_per_s": config.request_rate, "fault_spacing_s": round(config.spacing_s, 1),
                   "loss_window_s": window},
        "duration_s": round(end, 1),
        "requests": {"sent": len(soak.requests), "not_sent_client_cap": soak.skipped, **dict(outcomes),
                     "by_kind": dict(Counter(r.kind.split(":")[0] for r in soak.requests)),
                     "clear_error_types": dict(Counter(r.detail for r in soak.requests if r.outcome == "error")
                                               .most_common(12)),
                     "unaccounted_examples": unaccounted[:20]},
        "hostile": {k: dict(v) for k, v in hostile.items()},
        "events": {"stored": len(events), "expected": len(expected), "matched": len(expected) - len(missing),
                   "duplicates": len(duplicates), "duplicate_examples": dict(list(duplicates.items())[:10]),
                   "stray": len(stray), "stray_examples": stray[:10],
                   "lost_in_sigkill_window": len(lost_in_window), "missing_outside_window": len(missing_outside),
                   "missing_examples": missing_outside[:20], "missing_near_hostile": dict(near),
                   "missing_runs": runs[:50],
                   "status_mismatch": len(status_mismatch),
                   "status_mismatch_by_status": dict(Counter(m["event_status"] for m in status_mismatch)),
                   "status_mismatch_examples": status_mismatch[:10],
                   "events_of_undecided_requests": len(undecided_with_event), "drain": drained},
        "loss_window": {"stated_s": window, "how": LOSS_WINDOW_NOTE},
        "sidecar_kills": kills,
        "faults": [{"fault": f.name, "at_s": round(f.at, 1), "took_s": round(f.done - f.at, 1), "target": f.target,
                    **({"skipped": f.skipped} if f.skipped else {}), **f.detail} for f in soak.faults],
        "policy_changes": switch_checks,
        "phases": _phases(soak, end),
        "memory": memory,
        "memory_verdict": {"bound_mib_per_min": MEMORY_SLOPE_BOUND_MIB_PER_MIN, "judged": judged,
                           "over_bound": growing if judged else [],
                           "note": "" if judged else f"runs under {MEMORY_JUDGED_MIN:g} minutes are not judged"},
        "stall_proxy": {"connections": soak.proxy.connections if soak.proxy else 0},
        "accounting_passed": not failures,
        "failures": failures,
        "policy_change_failures": len(checks),
    }


def render(report: dict[str, Any]) -> str:
    req, ev = report["requests"], report["events"]
    lines = [f"soak: {report['engines']}; database {report['database']}; {report['duration_s']} s; "
             f"{report['config']['rate_per_s']:g} requests/s",
             f"requests: {req['sent']} sent: {req.get('ok', 0)} ok, {req.get('clear error', 0)} clear errors, "
             f"{req.get('failed: sidecar killed', 0)} failed while their sidecar was killed, "
             f"{req.get('unaccounted', 0)} UNACCOUNTED ({req['not_sent_client_cap']} not sent: client cap)",
             f"events: {ev['stored']} stored for {ev['expected']} decided answers; {ev['matched']} matched, "
             f"{ev['lost_in_sigkill_window']} lost in the SIGKILL window, {ev['missing_outside_window']} missing "
             f"outside it, {ev['duplicates']} duplicated, {ev['stray']} stray, {ev['status_mismatch']} with the "
             f"wrong status; drained: {ev['drain']}",
             f"load average: {report['load_average']}"]
    if ev["missing_near_hostile"]:
        lines.append(f"  missing events by the closest hostile request of their sidecar: {ev['missing_near_hostile']}")
    for kill in report["sidecar_kills"]:
        lines.append(f"  SIGKILL sidecar-{kill['sidecar']} at {kill['at_s']} s: {kill['events_lost']} events lost "
                     f"(of {kill['answered_in_window_before']} answered in the {report['loss_window']['stated_s']:g} s "
                     f"before; oldest {kill['oldest_lost_age_s']} s), {kill['in_flight_cut']} requests cut")
    lines.append("hostile: " + "; ".join(f"{k}: {dict(v)}" for k, v in report["hostile"].items()))
    lines.append("faults: " + "; ".join(f"{f['fault']}@{f['at_s']}s" + (f" skipped ({f['skipped']})"
                                                                         if "skipped" in f else "")
                                        for f in report["faults"]))
    for check in report["policy_changes"]:
        lines.append(f"  {check}")
    lines.append(f"{'phase':>5} {'after':<20} {'from':>6} {'to':>6} {'req':>6} {'ok':>6} {'err':>5} {'other':>5} "
                 f"{'p50 ms':>8} {'p99 ms':>8} {'ttft p99':>8} {'p99 w/o hostile':>15}")
    for p in report["phases"]:
        lines.append(f"{p['phase']:>5} {p['after']:<20} {p['from_s']:>6} {p['to_s']:>6} {p['requests']:>6} "
                     f"{p['ok']:>6} {p['errors']:>5} {p['other']:>5} {p['p50_ms']!s:>8} {p['p99_ms']!s:>8} "
                     f"{p['stream_ttft_p99_ms']!s:>8} {p['p99_ms_no_hostile_in_flight']!s:>15}")
    lines.append(f"{'memory':<36} {'samples':>7} {'inc':>4} {'RSS first':>10} {'last':>8} {'max':>8} "
                 f"{'MiB/min':>8} {'PSS MiB/min':>12}")
    for name, m in report["memory"].items():
        lines.append(f"{name:<36} {m['samples']:>7} {m['incarnations']:>4} {m['rss_first_mib']:>10} "
                     f"{m['rss_last_mib']:>8} {m['rss_max_mib']:>8} {m['rss_slope_mib_per_min']!s:>8} "
                     f"{m['pss_slope_mib_per_min']!s:>12}")
    mv = report["memory_verdict"]
    lines.append(f"memory: bound {mv['bound_mib_per_min']:g} MiB/min of RSS per part; " + (
        f"over it: {mv['over_bound'] or 'none'}" if mv["judged"] else mv["note"]))
    verdict = "PASSED" if report["accounting_passed"] else "FAILED: " + "; ".join(report["failures"])
    lines.append(f"accounting {verdict}")
    for key in ("unaccounted_examples",):
        for example in req[key][:5]:
            lines.append(f"  unaccounted: {example}")
    for example in ev["missing_examples"][:5]:
        lines.append(f"  missing event: {example}")
    for example in ev["status_mismatch_examples"][:5]:
        lines.append(f"  wrong status: {example}")
    return "\n".join(lines)


# --- running it -------------------------------------------------------------------------------------------


class _Stop(KeyboardInterrupt):
    """SIGTERM: handled like Ctrl-C, so every process is stopped."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(config: Config) -> dict[str, Any]:
    """The whole soak; returns the report. Every process it started is stopped before it returns or raises."""
    work = Path(tempfile.mkdtemp(prefix="specgate-soak-"))
    stack = Stack(config, work)
    main = MainThread()
    soak: Soak | None = None
    failed = True
    interrupted = False
    try:
        with _sigterm_as_interrupt():
            stack.start_database()
            stack.seed()
            stack.start_control_plane()
            stack.load_policy()
            stack.start_engines()
            soak = Soak(config, stack, main)
            thread = threading.Thread(target=soak.run_thread, name="soak-loop", daemon=True)
            thread.start()
            try:
                main.serve(thread)
            except KeyboardInterrupt:
                main.close()
                soak.cancel()
                thread.join(30)
                raise
            if soak.error is not None:
                raise soak.error
        failed = False
        return soak.report
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        main.close()
        stack.stop_all()
        if config.keep is not None:
            shutil.copytree(work, config.keep, dirs_exist_ok=True)
        # the logs of a run that failed stay for a look; an interrupted one was wanted gone
        if failed and not interrupted and config.keep is None:
            print(f"soak: logs of the parts in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def parse_args(argv: list[str] | None) -> tuple[Config, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="traffic time (default 30)")
    parser.add_argument("--fake-engines", action="store_true",
                        help="FAKE OpenAI engines (bench/fake_openai.py) instead of the testbed's vLLM engines")
    parser.add_argument("--rate", type=float, default=None, help="requests/s (default 25 fake, 4 real)")
    parser.add_argument("--hostile-every", type=float, default=5.0, help="seconds between hostile requests")
    parser.add_argument("--database", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument("--stall", type=float, default=11.0, help="seconds the control-plane link stalls")
    parser.add_argument("--telemetry-flush-s", type=float, default=1.0, help="the sidecars' telemetry_flush_s")
    parser.add_argument("--seed", type=int, default=20261205)
    parser.add_argument("--keep", type=Path, default=None, help="copy logs and state here at the end")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60:
        parser.error("--minutes must be in (0, 1440]")
    config = Config(minutes=args.minutes, fake_engines=args.fake_engines, rate=args.rate,
                    hostile_every_s=args.hostile_every, database=args.database, stall_s=args.stall,
                    telemetry_flush_s=args.telemetry_flush_s, seed=args.seed, keep=args.keep)
    return config, args.json


def main(argv: list[str] | None = None) -> int:
    config, json_path = parse_args(argv)
    print(f"soak: {config.minutes:g} min with {config.engines_label}, loopback only", flush=True)
    try:
        report = run(config)
    except KeyboardInterrupt:
        print("soak: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    print(render(report), flush=True)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["accounting_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
