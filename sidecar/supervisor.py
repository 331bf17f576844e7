"""Engine supervision: the sidecar runs its engines with the arguments its policy renders.

``specgate sidecar --supervise FILE`` reads a worker-local YAML (:class:`SuperviseConfig`): the command that
starts a vLLM server, and per engine variant the target model's path, the port, the environment (GPU or CPU
binding) and extra arguments. The policy's ``engines`` stay the source of the speculative settings: each
engine's arguments are the file's plus ``policies.render.vllm_serve_args`` of the policy the worker runs
(with an in-engine schedule where the policy says so), the draft model's name mapped to a local path by the
file's ``models``.

The supervisor starts every engine, and the sidecar routes to one only once its ``/health`` answers. When a
new bundle changes an engine's arguments it drains that engine (no new requests: they go to the fallback
engine; those in flight may finish, up to ``drain_timeout_s``), stops it, starts it with the new arguments
and waits for ``/health``; if the new engine does not come up it starts the old arguments again and records
the failure (log, ``/metrics``, the heartbeat's engine report) rather than serve nothing. Engines restart one
at a time, so a worker's other engine serves meanwhile. Each engine's output goes to its own log file; an
engine gets a parent-death signal, so it ends with the sidecar however the sidecar ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies import PolicyDocument
from policies.render import RenderError, vllm_serve_args

log = logging.getLogger("specgate.sidecar.supervisor")

_PR_SET_PDEATHSIG = 1
_HEALTH_POLL_S = 0.5


class SuperviseError(ValueError):
    """The supervise file cannot be used; the message names the file and the field."""


class EngineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: Annotated[str, Field(min_length=1, max_length=4096)]  # the target model's local path
    port: Annotated[int, Field(ge=1, le=65535)]
    host: Annotated[str, Field(min_length=1, max_length=255)] = "127.0.0.1"
    env: dict[str, str] = {}  # e.g. CUDA_VISIBLE_DEVICES, VLLM_CPU_OMP_THREADS_BIND
    args: list[str] = []  # vLLM arguments of this worker (dtype, memory share, lengths), never speculative ones


class SuperviseConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    command: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    engines: Annotated[dict[str, EngineSpec], Field(min_length=1, max_length=64)]
    # the policy's model names (a draft model's, an EAGLE head's) -> this worker's local paths
    models: dict[str, str] = {}
    drain_timeout_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    start_timeout_s: Annotated[float, Field(gt=0, le=7200)] = 600.0
    stop_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    log_dir: str | None = None  # default: the sidecar's state directory / engines

    def url(self, name: str) -> str:
        spec = self.engines[name]
        host = f"[{spec.host}]" if ":" in spec.host else spec.host
        return f"http://{host}:{spec.port}"


def load_supervise_file(path: Path) -> SuperviseConfig:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SuperviseError(f"--supervise {path}: cannot read it: {exc}") from None
    try:
        config = SuperviseConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}"
                             for e in exc.errors())
        raise SuperviseError(f"--supervise {path}: {problems}") from None
    ports = [(spec.host, spec.port) for spec in config.engines.values()]
    if len(set(ports)) != len(ports):
        raise SuperviseError(f"--supervise {path}: engines: two engines on one host and port")
    return config


def engine_argv(config: SuperviseConfig, name: str, doc: PolicyDocument | None) -> list[str]:
    """The whole command line of one engine for the policy ``doc`` (None: no policy yet, no speculation)."""
    spec = config.engines[name]
    argv = [*config.command, "--model", spec.model, "--host", spec.host, "--port", str(spec.port), *spec.args]
    if doc is not None and name in doc.engines:
        argv += _local_models(vllm_serve_args(doc, name), config.models)
    return argv


def _local_models(args: list[str], models: Mapping[str, str]) -> list[str]:
    """``--speculative-config`` with the policy's model name replaced by this worker's path for it."""
    out = list(args)
    with contextlib.suppress(ValueError):
        i = out.index("--speculative-config")
        config = json.loads(out[i + 1])
        if isinstance(config.get("model"), str) and config["model"] in models:
            config["model"] = models[config["model"]]
            out[i + 1] = json.dumps(config, separators=(",", ":"), sort_keys=True)
    return out


def config_hash(argv: list[str]) -> str:
    return hashlib.sha256(json.dumps(argv).encode()).hexdigest()[:16]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # The kernel sends SIGTERM to the engine when the thread that started it (the sidecar's loop thread) ends,
    # however it ends; vLLM's server then stops its own worker processes.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineProcess:
    """One engine server process, in a session of its own; started from the event loop's thread."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, dict(env), log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} start {self.name}: {' '.join(self.argv)}\n"
                      .encode())
            out.flush()
            self.proc = subprocess.Popen(  # noqa: S603 - the worker's own configured command
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    async def stop(self, timeout_s: float) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine %s did not stop within %.0f s: killed", self.name, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)


@dataclass
class EngineState:
    """What the supervisor knows of one engine; ``report`` is what the heartbeat and /metrics carry."""

    name: str
    url: str
    argv: list[str] = field(default_factory=list)
    state: str = "stopped"  # starting, serving, draining, restarting, failed, stopped
    process: EngineProcess | None = None
    restarts: int = 0
    failed_restarts: int = 0
    last_error: str | None = None

    def report(self) -> dict[str, Any]:
        return {"engine": self.name, "state": self.state, "config_hash": config_hash(self.argv) if self.argv else None,
                "pid": self.process.pid if self.process is not None else None, "restarts": self.restarts,
                "failed_restarts": self.failed_restarts, "last_error": self.last_error}


class EngineSupervisor:
    """Starts the engines, keeps their arguments equal to what the current policy renders, reports them."""

    def __init__(self, config: SuperviseConfig, pools: Any, state_dir: Path,
                 on_change: Callable[[], None] | None = None) -> None:
        self.config = config
        self.pools = pools  # sidecar.replicas.Pools: hold() and release() a replica while it is not serving
        self.log_dir = Path(config.log_dir) if config.log_dir else state_dir / "engines"
        self.on_change = on_change
        self.engines = {name: EngineState(name, config.url(name)) for name in config.engines}
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._seen: object = None

    # --- what the sidecar calls --------------------------------------------------------------------

    def start(self, doc: PolicyDocument | None) -> None:
        """Starts every engine for ``doc`` and returns; each is routed to once its /health answers. A policy
        applied meanwhile waits until every engine is up or failed (the same lock)."""
        for state in self.engines.values():
            self.pools.hold(state.url)
            self._launch(state, engine_argv(self.config, state.name, doc))
        self._tasks.append(asyncio.create_task(self._first_health(), name="engines-up"))

    def watch(self, current: Callable[[], Any], every_s: float = 0.25) -> None:
        """Applies the policy ``current()`` returns (a compiled bundle) whenever it is a new one."""
        self._seen = current()
        self._tasks.append(asyncio.create_task(self._watch(current, every_s), name="engine-supervisor"))

    async def apply(self, doc: PolicyDocument | None) -> None:
        """Restarts, one at a time, every engine whose arguments ``doc`` changes."""
        async with self._lock:
            for state in self.engines.values():
                wanted = engine_argv(self.config, state.name, doc)
                if wanted != state.argv:
                    await self._restart(state, wanted)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.gather(*(s.process.stop(self.config.stop_timeout_s) for s in self.engines.values()
                               if s.process is not None))
        for state in self.engines.values():
            state.state = "stopped"
        if self._session is not None:
            await self._session.close()

    def report(self) -> list[dict[str, Any]]:
        return [state.report() for state in self.engines.values()]

    # --- inside --------------------------------------------------------------------------------------

    def _launch(self, state: EngineState, argv: list[str]) -> None:
        state.argv = argv
        state.state = "starting"
        state.process = EngineProcess(state.name, argv, self.config.engines[state.name].env,
                                      self.log_dir / f"{state.name}.log")
        state.process.start()
        log.info("engine %s starting (pid %s, config %s)", state.name, state.process.pid, config_hash(argv))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def _first_health(self) -> None:
        async with self._lock:
            await asyncio.gather(*(self._up(state) for state in self.engines.values()))

    async def _up(self, state: EngineState) -> None:
        error = await self._healthy(state)
        if error is None:
            state.state = "serving"
            self.pools.release(state.url)
        else:
            state.state, state.last_error = "failed", error
            log.error("engine %s did not come up: %s", state.name, error)
        self._changed()

    async def _watch(self, current: Callable[[], Any], every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            bundle = current()
            if bundle is self._seen:
                continue
            self._seen = bundle
            try:
                await self.apply(bundle.active.document if bundle is not None else None)
            except RenderError as exc:  # a policy this worker cannot render keeps the engines as they are
                log.error("engine arguments not rendered for the new policy: %s", exc)

    async def _healthy(self, state: EngineState) -> str | None:
        """None once the engine's /health answers 200; else why not (exited, or not within start_timeout_s)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        deadline = time.monotonic() + self.config.start_timeout_s
        assert state.process is not None
        while time.monotonic() < deadline:
            code = state.process.exit_code()
            if code is not None:
                return f"it exited with {code} (log {state.process.log_path})"
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with self._session.get(state.url + "/health") as resp:
                    if resp.status == 200:
                        return None
            await asyncio.sleep(_HEALTH_POLL_S)
        return f"/health did not answer within {self.config.start_timeout_s:g} s (log {state.process.log_path})"

    async def _drain(self, state: EngineState) -> None:
        state.state = "draining"
        self.pools.hold(state.url)
        self._changed()
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.pools.in_flight(state.url) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.pools.in_flight(state.url)
        if left:
            log.warning("engine %s: %d requests still in flight after %.0f s of draining; restarting anyway",
                        state.name, left, self.config.drain_timeout_s)

    async def _restart(self, state: EngineState, argv: list[str]) -> None:
        old = state.argv
        log.info("engine %s: new arguments (config %s -> %s): draining", state.name, config_hash(old),
                 config_hash(argv))
        await self._drain(state)
        state.state = "restarting"
        if state.process is not None:
            await state.process.stop(self.config.stop_timeout_s)
        self._launch(state, argv)
        error = await self._healthy(state)
        if error is None:
            state.restarts += 1
            state.state, state.last_error = "serving", None
            self.pools.release(state.url)
            log.info("engine %s serving with config %s", state.name, config_hash(argv))
            self._changed()
            return
        state.failed_restarts += 1
        state.last_error = f"the new arguments did not come up: {error}; back on the previous ones"
        log.error("engine %s: %s", state.name, state.last_error)
        assert state.process is not None
        await state.process.stop(self.config.stop_timeout_s)
        self._launch(state, old)
        back = await self._healthy(state)
        if back is None:
            state.state = "serving"
            self.pools.release(state.url)
        else:
            state.state = "failed"
            state.last_error += f"; the previous arguments did not come up either: {back}"
            log.error("engine %s is down: %s", state.name, back)
        self._changed()
