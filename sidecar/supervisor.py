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
import re
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

from pairs import TokenizerUnreadable, check_pair
from policies import PolicyDocument
from policies.model import Identifier
from policies.render import DEFAULT_MAX_NUM_SEQS, RenderError, vllm_serve_args

log = logging.getLogger("specgate.sidecar.supervisor")

_PR_SET_PDEATHSIG = 1
_HEALTH_POLL_S = 0.5
PLAIN_ARGS = "--enable-per-request-metrics"  # policies.render.vllm_serve_args of a plain engine
# Arguments that did not come up are not tried again for this long, whatever bundles arrive meanwhile.
RETRY_REFUSED_AFTER_S = 600.0
MAX_REPORTED_ERROR = 2048
# What the control plane takes of a tokenizer check (controlplane.worker.schemas.TokenizerCheckReport).
MAX_REPORTED_DIFFERENCES, MAX_REPORTED_DIFFERENCE, MAX_REPORTED_PATH = 8, 512, 1024
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_ANY_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# libc's prctl, looked up here: the child between fork and exec must not load libraries.
try:
    _PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _PRCTL = None


class SuperviseError(ValueError):
    """The supervise file cannot be used; the message names the file and the field."""


# A host name or an IP address as vLLM's --host takes it (an IPv6 address without brackets).
HostName = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.:-]+$")]
EnvName = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class EngineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: Annotated[str, Field(min_length=1, max_length=4096)]  # the target model's local path
    port: Annotated[int, Field(ge=1, le=65535)]
    host: HostName = "127.0.0.1"
    env: dict[EnvName, str] = {}  # e.g. CUDA_VISIBLE_DEVICES, VLLM_CPU_OMP_THREADS_BIND
    args: list[str] = []  # vLLM arguments of this worker (dtype, memory share, lengths), never speculative ones
    # A draft model whose tokenizer differs from the target's is refused (pairs.tokenizers), unless this says
    # the engine's build and method map a draft's vocabulary onto the target's; the check is reported anyway.
    heterogeneous_vocabulary: bool = False

    def max_num_seqs(self) -> int:
        """vLLM's --max-num-seqs from ``args`` (its default without): how far an in-engine schedule reaches."""
        for i, arg in enumerate(self.args):
            value = arg.split("=", 1)[1] if arg.startswith("--max-num-seqs=") else (
                self.args[i + 1] if arg == "--max-num-seqs" and i + 1 < len(self.args) else None)
            if value is not None and value.isdigit() and int(value) > 0:
                return int(value)
        return DEFAULT_MAX_NUM_SEQS


class SuperviseConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    command: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    engines: Annotated[dict[Identifier, EngineSpec], Field(min_length=1, max_length=64)]
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
        return argv + _local_models(vllm_serve_args(doc, name, max_num_seqs=spec.max_num_seqs()), config.models)
    # What a plain engine gets from a policy too: the first policy does not restart a plain engine.
    return [*argv, PLAIN_ARGS]


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


def draft_model_of(argv: list[str]) -> str | None:
    """The draft model's path in an engine's ``--speculative-config``, for a method that drafts with a model
    of its own tokenizer (``draft_model``); None otherwise (EAGLE and MTP heads read the target's tokens)."""
    with contextlib.suppress(ValueError, IndexError, json.JSONDecodeError):
        config = json.loads(argv[argv.index("--speculative-config") + 1])
        if isinstance(config, dict) and config.get("method") == "draft_model" and isinstance(config.get("model"), str):
            return str(config["model"])
    return None


def tokenizer_check(target: str, draft: str) -> dict[str, Any]:
    """The heartbeat's ``tokenizer`` report of a target/draft pair: aligned true/false, or null when a
    directory cannot be read (a hub name, a SentencePiece-only directory): then it is not refused."""
    try:
        report = check_pair(target, draft)
    except TokenizerUnreadable as exc:
        return {"aligned": None, "draft": draft, "differences": [f"not checked: {exc}"], "notes": []}
    except Exception as exc:  # the check must never take supervision down with it
        return {"aligned": None, "draft": draft, "differences": [f"not checked: {type(exc).__name__}: {exc}"],
                "notes": []}
    return {"aligned": report.aligned, "draft": draft, "differences": report.differences, "notes": report.notes}


_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "added_tokens.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "config.json")


def _files_stamp(directory: str) -> tuple[int, ...]:
    """When the files the check reads last changed: a draft replaced in place is checked again."""
    stamps = []
    for name in _TOKENIZER_FILES:
        try:
            stamps.append(os.stat(os.path.join(directory, name)).st_mtime_ns)
        except OSError:
            stamps.append(0)
    return tuple(stamps)


def config_hash(argv: list[str]) -> str:
    return hashlib.sha256(json.dumps(argv).encode()).hexdigest()[:16]


def _die_with(parent: int) -> Callable[[], None]:
    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        # The kernel sends SIGTERM to the engine when the thread that started it (the sidecar's loop thread)
        # ends, however it ends; vLLM's server then stops its own worker processes. A command that wraps the
        # server (a shell, a launcher) passes the signal on only if it does so itself.
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the sidecar died before the signal was set up
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


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
                env={**os.environ, **self.env}, start_new_session=True, preexec_fn=_die_with(os.getpid()))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM to the whole process group (the server's worker processes too, even when the server itself
        has already exited), SIGKILL after ``timeout_s``."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
            await asyncio.sleep(0.05)
        if proc.poll() is None or _group_alive(proc.pid):
            log.warning("engine %s did not stop within %.0f s: killed", self.name, timeout_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@dataclass
class EngineState:
    """What the supervisor knows of one engine; ``report`` is what /metrics carries."""

    name: str
    url: str
    argv: list[str] = field(default_factory=list)
    state: str = "stopped"  # starting, serving, draining, restarting, failed, stopped (also: not started yet)
    # the policy revision whose arguments ``argv`` are (None: no policy's); what the control plane compares
    # with the revision the worker runs to tell whether its engines caught up
    revision: str | None = None
    process: EngineProcess | None = None
    restarts: int = 0
    failed_restarts: int = 0
    crashes: int = 0
    last_error: str | None = None
    # the revision whose arguments last_error is about: a restart refused or failed, a crash of what ran. The
    # control plane fails a canary only on an error about its own revision, never on one left from before.
    error_revision: str | None = None
    # why the latest policy was not applied at all (it cannot be rendered here); reported before last_error
    policy_error: str | None = None
    policy_revision: str | None = None
    # config hash -> when arguments with it last failed to come up: not tried again before RETRY_REFUSED_AFTER_S
    refused: dict[str, float] = field(default_factory=dict)
    # the tokenizer check of the draft model in the arguments it runs or was last asked to run (None: no draft)
    tokenizer: dict[str, Any] | None = None

    def report(self) -> dict[str, Any]:
        """What /metrics and the heartbeat carry (controlplane.worker.schemas.SupervisedEngineReport)."""
        error = self.policy_error or self.last_error
        if error is not None:  # what the control plane takes: no control characters but newlines and tabs
            error = _CONTROL.sub("?", error)
            if len(error) > MAX_REPORTED_ERROR:
                error = error[:MAX_REPORTED_ERROR - 3] + "..."
        error_revision = self.policy_revision if self.policy_error else self.error_revision
        return {"engine": self.name, "state": self.state, "config_hash": config_hash(self.argv) if self.argv else None,
                "revision": self.revision, "pid": self.process.pid if self.process is not None else None,
                "restarts": self.restarts, "failed_restarts": self.failed_restarts, "crashes": self.crashes,
                "last_error": error, "error_revision": error_revision if error is not None else None,
                "tokenizer": self._tokenizer_report()}

    def _tokenizer_report(self) -> dict[str, Any] | None:
        if self.tokenizer is None:
            return None
        def clean(texts: list[str]) -> list[str]:  # one line each: the control plane takes no control character
            return [_ANY_CONTROL.sub("?", t)[:MAX_REPORTED_DIFFERENCE] for t in texts][:MAX_REPORTED_DIFFERENCES]

        return {"aligned": self.tokenizer["aligned"],
                "draft": _ANY_CONTROL.sub("?", self.tokenizer["draft"])[:MAX_REPORTED_PATH],
                "differences": clean(self.tokenizer["differences"]), "notes": clean(self.tokenizer["notes"])}


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
        # (target, draft) -> (the files' stamps when checked, the check)
        self._pairs: dict[tuple[str, str], tuple[tuple[int, ...], dict[str, Any]]] = {}

    # --- what the sidecar calls --------------------------------------------------------------------

    def hold_all(self) -> None:
        """Every engine out of routing until it serves (the sidecar serves before the engines are started)."""
        for state in self.engines.values():
            self.pools.hold(state.url)

    def start(self, doc: PolicyDocument | None, revision: str | None = None) -> None:
        """Starts every engine for ``doc`` (of ``revision``) and returns; each is routed to once its /health
        answers. A policy applied meanwhile waits until every engine is up or failed (the same lock)."""
        for state in self.engines.values():
            self.pools.hold(state.url)
            argv = engine_argv(self.config, state.name, doc)
            refusal = self._misaligned(state, argv, revision)
            if refusal is not None:  # held and failed: its requests go to the fallback engine
                state.state, state.last_error, state.revision = "failed", refusal, revision
                state.error_revision = revision
                state.refused[config_hash(argv)] = time.monotonic()
                log.error("engine %s: %s", state.name, refusal)
                self._changed()
                continue
            self._launch(state, argv, revision)
        self._tasks.append(asyncio.create_task(self._first_health(), name="engines-up"))

    def watch(self, current: Callable[[], Any], every_s: float = 0.25) -> None:
        """Applies the policy ``current()`` returns (a compiled bundle) whenever it is a new one, and starts
        again an engine whose process ended while it served."""
        self._seen = current()
        self._tasks.append(asyncio.create_task(self._watch(current, every_s), name="engine-supervisor"))

    async def apply(self, doc: PolicyDocument | None, revision: str | None = None) -> None:
        """Restarts, one at a time, every engine whose arguments ``doc`` (of ``revision``) changes (or that is
        down). Every engine's arguments are rendered first: a policy that cannot be rendered changes nothing,
        and each engine says why it stays on its revision (``last_error``, reported at once)."""
        try:
            wanted = {name: engine_argv(self.config, name, doc) for name in self.engines}
        except RenderError as exc:
            for state in self.engines.values():
                state.policy_revision = revision
                state.policy_error = (f"revision {revision} cannot be rendered for this worker: {exc}; "
                                      "the engines keep their arguments")
            self._changed()
            raise
        if any(state.policy_error for state in self.engines.values()):
            for state in self.engines.values():
                state.policy_error = None
            self._changed()
        await self._prefetch_pair_checks(wanted)
        async with self._lock:
            for state in self.engines.values():
                argv = wanted[state.name]
                if argv == state.argv and state.state != "failed":
                    # the check of what it runs (a refusal since may have left another pair's there)
                    self._misaligned(state, argv, revision)
                    if state.revision != revision:  # the same arguments are now this revision's too
                        state.revision = revision
                        self._changed()
                    continue
                refused_at = state.refused.get(config_hash(argv))
                if refused_at is not None and time.monotonic() - refused_at < RETRY_REFUSED_AFTER_S:
                    log.info("engine %s: arguments %s did not come up %.0f s ago; not tried again yet",
                             state.name, config_hash(argv), time.monotonic() - refused_at)
                    continue
                refusal = self._misaligned(state, argv, revision)
                if refusal is not None:
                    # Refused without a try, as a restart whose arguments did not come up: the engine keeps its
                    # arguments and revision, and the control plane sees a failed restart (a canary rolls back).
                    state.failed_restarts += 1
                    state.refused[config_hash(argv)] = time.monotonic()
                    state.last_error = refusal + ("; the engine keeps its previous arguments" if state.argv else "")
                    state.error_revision = revision
                    log.error("engine %s: %s", state.name, state.last_error)
                    self._changed()
                    continue
                await self._restart(state, argv, revision)

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

    def _pair_check(self, target: str, draft: str) -> dict[str, Any]:
        stamp = _files_stamp(target) + _files_stamp(draft)
        cached = self._pairs.get((target, draft))
        if cached is None or cached[0] != stamp:
            cached = self._pairs[(target, draft)] = (stamp, tokenizer_check(target, draft))
        return cached[1]

    async def _prefetch_pair_checks(self, wanted: Mapping[str, list[str]]) -> None:
        """Reads the pairs a policy brings in a thread: a large vocabulary takes a second to read and compare,
        which the loop that proxies requests must not spend."""
        for name, argv in wanted.items():
            draft = draft_model_of(argv)
            if draft is not None:
                await asyncio.to_thread(self._pair_check, self.config.engines[name].model, draft)

    def _misaligned(self, state: EngineState, argv: list[str], revision: str | None) -> str | None:
        """Checks the tokenizers of ``argv``'s draft model and the engine's target (once per pair of paths) and
        records the check; why the arguments are refused, or None."""
        draft = draft_model_of(argv)
        if draft is None:
            state.tokenizer = None
            return None
        spec = self.config.engines[state.name]
        state.tokenizer = self._pair_check(spec.model, draft)
        if state.tokenizer["aligned"] is not False or spec.heterogeneous_vocabulary:
            return None
        return (f"revision {revision}'s draft model {draft} has another tokenizer than the target {spec.model}: "
                f"{'; '.join(state.tokenizer['differences'])}; refused (the supervise file's "
                "heterogeneous_vocabulary: true allows it)")

    def _launch(self, state: EngineState, argv: list[str], revision: str | None) -> bool:
        """Starts ``argv`` (of ``revision``) for the engine; False (the engine ``failed``, held) when the process
        cannot start."""
        process = EngineProcess(state.name, argv, self.config.engines[state.name].env,
                                self.log_dir / f"{state.name}.log")
        try:
            process.start()
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            state.state, state.last_error = "failed", f"cannot start {argv[0]!r}: {exc}"
            state.error_revision = revision
            log.error("engine %s: %s", state.name, state.last_error)
            return False
        state.argv, state.revision, state.process, state.state = argv, revision, process, "starting"
        log.info("engine %s starting (pid %s, config %s)", state.name, process.pid, config_hash(argv))
        self._changed()
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def _first_health(self) -> None:
        async with self._lock:
            await asyncio.gather(*(self._up(state) for state in self.engines.values()))

    async def _up(self, state: EngineState) -> None:
        if state.state == "failed":
            return
        error = await self._healthy(state)
        if error is None:
            state.state = "serving"
            self.pools.release(state.url)
        else:
            state.state, state.last_error, state.error_revision = "failed", error, state.revision
            log.error("engine %s did not come up: %s", state.name, error)
        self._changed()

    async def _watch(self, current: Callable[[], Any], every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self._revive_crashed()
                bundle = current()
                if bundle is self._seen:
                    continue
                self._seen = bundle
                # The active revision's engines: a traffic canary that changes engine arguments runs on the
                # baseline's engines until it is promoted (workers-mode rollouts give the canary its own bundle).
                await self.apply(bundle.active.document if bundle is not None else None,
                                 bundle.active.revision if bundle is not None else None)
            except RenderError as exc:  # a policy this worker cannot render keeps the engines as they are
                log.error("engine arguments not rendered for the new policy: %s", exc)
            except Exception:  # supervision must outlive any one failure
                log.exception("engine supervision step failed; it goes on")

    async def _revive_crashed(self) -> None:
        """An engine whose process ended while it served is held and started again with the same arguments."""
        for state in self.engines.values():
            code = state.process.exit_code() if state.process is not None else None
            if state.state != "serving" or code is None:
                continue
            async with self._lock:
                state.state = "restarting"
                state.crashes += 1
                state.last_error = f"exited with {code} while serving (log {self.log_dir / (state.name + '.log')})"
                state.error_revision = state.revision
                log.error("engine %s %s: starting it again", state.name, state.last_error)
                self.pools.hold(state.url)
                self._changed()
                assert state.process is not None
                await state.process.stop(self.config.stop_timeout_s)  # what is left of its group
                if self._launch(state, state.argv, state.revision):
                    await self._up(state)

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

    async def _restart(self, state: EngineState, argv: list[str], revision: str | None) -> None:
        old, old_revision = state.argv, state.revision
        log.info("engine %s: new arguments (config %s -> %s): draining", state.name, config_hash(old),
                 config_hash(argv))
        await self._drain(state)
        state.state = "restarting"
        self._changed()
        if state.process is not None:
            await state.process.stop(self.config.stop_timeout_s)
        error = await self._healthy(state) if self._launch(state, argv, revision) else state.last_error
        if error is None:
            state.restarts += 1
            state.state, state.last_error, state.error_revision = "serving", None, None
            self.pools.release(state.url)
            log.info("engine %s serving with config %s", state.name, config_hash(argv))
            self._changed()
            return
        state.failed_restarts += 1
        state.refused[config_hash(argv)] = time.monotonic()
        state.last_error = f"the new arguments did not come up: {error}; back on the previous ones"
        state.error_revision = revision
        log.error("engine %s: %s", state.name, state.last_error)
        if state.process is not None:
            await state.process.stop(self.config.stop_timeout_s)
        back = (await self._healthy(state) if old and self._launch(state, old, old_revision)
                else "no previous arguments")
        if back is None:
            state.state = "serving"
            self.pools.release(state.url)
            log.info("engine %s serving again with its previous config %s", state.name, config_hash(old))
        else:
            state.state = "failed"
            state.last_error += f"; the previous arguments did not come up either: {back}"
            log.error("engine %s is down: %s", state.name, back)
        self._changed()
