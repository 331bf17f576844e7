"""Local vLLM engine variants (CPU build): start, wait for health, record, stop exactly what was started.

Each engine runs in its own process group (vLLM spawns an engine core and a
worker), so stopping signals the group and nothing else. Engines started with
``die_with_parent`` (``specgate up``) also end, group and all, when the process
that started them dies (:mod:`testbed.lifeline`). The state file
records pid, process start time, port and log of each, so a later command
(``specgate testbed stop``) stops them, and a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from testbed import env, lifeline
from testbed.models import ModelPaths, Testbed, ensure
from testbed.paths import REPO_ROOT, cache_dir, file_lock

VARIANTS = ("base", "ngram", "draft")
MODEL_NAME = "specgate-tiny"
DEFAULT_BASE_PORT = 8100
NGRAM_K = 4
DRAFT_K = 3
ENGINE_STOP_GRACE_S = 20.0  # from SIGTERM to SIGKILL


def state_dir_default() -> Path:
    explicit = os.environ.get("SPECGATE_TESTBED_STATE")
    return Path(explicit) if explicit else REPO_ROOT / ".specgate" / "testbed"


MAX_REPLICAS = 3  # ports stay within base_port + 8: free_base_port steps by 10


def variant_of(instance: str) -> str:
    """The variant an engine instance runs: ``base`` for ``base`` and for ``base-2``, a second plain replica
    (replica pools run several instances of one variant, each a server of its own)."""
    variant, sep, number = instance.partition("-")
    if variant not in VARIANTS or (sep and not (number.isdigit() and 2 <= int(number) <= MAX_REPLICAS)):
        raise ValueError(f"unknown engine variant {instance!r}; known: {', '.join(VARIANTS)}, each optionally with a "
                         f"replica number -2 to -{MAX_REPLICAS} (e.g. base-2)")
    return variant


def replica_number(instance: str) -> int:
    """1 for ``base``, 2 for ``base-2``."""
    variant_of(instance)
    _, sep, number = instance.partition("-")
    return int(number) if sep else 1


def speculative_config(variant: str, models: ModelPaths) -> dict[str, Any] | None:
    variant = variant_of(variant)
    if variant == "base":
        return None
    if variant == "ngram":
        return {"method": "ngram", "num_speculative_tokens": NGRAM_K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if variant == "draft":
        return {"method": "draft_model", "model": str(models.draft), "num_speculative_tokens": DRAFT_K}
    raise ValueError(f"unknown engine variant {variant!r}; known: {', '.join(VARIANTS)}")


def server_args(variant: str, port: int, models: ModelPaths, *, host: str = "127.0.0.1",
                schedule: Sequence[Sequence[int]] | None = None) -> list[str]:
    """The vLLM server's arguments (after the interpreter) for one variant; ``schedule`` ([[lo, hi, K], ...],
    e.g. ``policies.render.batch_size_schedule``) makes a speculative variant draft by its running batch."""
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(models.target),
            "--served-model-name", MODEL_NAME, "--host", host, "--port", str(port),
            "--dtype", "float32", "--max-model-len", "1024", "--seed", "0", "--enable-per-request-metrics"]
    spec = speculative_config(variant, models)
    if schedule is not None:
        if spec is None:
            raise ValueError(f"engine variant {variant!r} does not speculate: a draft schedule means nothing to it")
        spec["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]
    if spec is not None:
        # Per-request speculative metrics make a server without speculation refuse to start.
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":")),
                 "--per-request-spec-decode-metrics", "summary"]
    return args


def ports_for(variants: Iterable[str], base_port: int) -> dict[str, int]:
    """A fixed port per engine instance: base_port + its variant's index in VARIANTS, plus len(VARIANTS) per
    replica after the first (base-2 is base_port + 3): the same instance, the same URL."""
    out = {}
    for name in variants:
        out[name] = base_port + VARIANTS.index(variant_of(name)) + len(VARIANTS) * (replica_number(name) - 1)
    return out


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``port`` as vLLM's does (SO_REUSEADDR: a TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_base_port(variants: Iterable[str], start: int, *, tries: int = 40) -> int:
    """The first base port from ``start`` (in steps of 10) at which every variant's port is free."""
    for base in range(start, start + 10 * tries, 10):
        if all(port_free(p) for p in ports_for(variants, base).values()):
            return base
    raise RuntimeError(f"no free ports for the engines {', '.join(variants)} from {start} on")


@dataclass
class EngineRecord:
    name: str
    pid: int
    start_ticks: int  # process start time (clock ticks since boot): tells our pid from a recycled one
    port: int
    url: str
    log: str
    started_at: float
    ready_s: float | None = None


class StateFile:
    """JSON map of variant name -> EngineRecord, read and written under a lock."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "engines.json"
        self.lock = directory / "engines.lock"

    def read(self) -> dict[str, EngineRecord]:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        records: dict[str, EngineRecord] = {}
        for name, entry in (raw.get("engines") or {}).items() if isinstance(raw, dict) else []:
            try:
                records[name] = EngineRecord(**entry)
            except TypeError:
                continue  # a record of another version: ignored, never signalled
        return records

    def write(self, records: Mapping[str, EngineRecord]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"engines": {n: asdict(r) for n, r in sorted(records.items())}}, indent=2) + "\n")
        tmp.replace(self.path)


# Engines started by this process: reaped here when stopped, so none lingers as a zombie.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat; None when the process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_alive(record: EngineRecord) -> bool:
    return process_start_ticks(record.pid) == record.start_ticks


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _log_tail(path: str, lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _signal_group(record: EngineRecord, sig: int) -> None:
    if not is_alive(record):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.pid, sig)  # the engine leads its own group (start_new_session)


def _terminate(record: EngineRecord, grace_s: float = ENGINE_STOP_GRACE_S) -> None:
    _signal_group(record, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while is_alive(record) and time.monotonic() < deadline:
        time.sleep(0.2)
    if is_alive(record):
        _signal_group(record, signal.SIGKILL)
    child = _CHILDREN.pop(record.pid, None)
    if child is not None:
        # A vLLM process the server left behind (a worker that ignored SIGTERM) is still in the group. Until
        # it is reaped, the leader's pid cannot be taken by another process, so the group is still ours.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)


def compile_cache(variant: str) -> dict[str, str]:
    """vLLM's compile cache, one per variant: engines started together never write one cache at once, and
    each variant's compiled graphs stay its own between runs."""
    return {"VLLM_CACHE_ROOT": str(cache_dir() / "vllm-compile" / variant)}


def cpu_binding(variant: str, cpus: Sequence[int] | None = None) -> dict[str, str]:
    """The cores vLLM binds a variant's model worker to: the plain engine on the first half of this process's
    CPUs, the speculative ones on the second half; a second replica of either on the other half.

    Left to itself every vLLM CPU engine binds its worker to the same first core (``core ids=[0]``), so two
    engines serving one worker's traffic take turns on one core while another idles (the recommender
    check's live schedule served 3-7x fewer requests that way). Side by side they still slow each other,
    the plain engine more (BENCHMARKS.md, "The recommender against the sweep").
    ``VLLM_CPU_OMP_THREADS_BIND`` in the environment still wins; one CPU means no binding.
    """
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    allowed = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(allowed) < 2:
        return {}
    half = len(allowed) // 2
    # Replicas of one variant alternate halves (base-2 on the second, draft-2 on the first), so that the two
    # servers of a pool do not take turns on the same cores.
    first = (variant_of(variant) == "base") == (replica_number(variant) % 2 == 1)
    chosen = allowed[:half] if first else allowed[half:]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in chosen)}


def start(variants: Iterable[str] = VARIANTS, base_port: int = DEFAULT_BASE_PORT, *,
          state_dir: Path | None = None, timeout_s: float = 300.0, extra_env: Mapping[str, str] | None = None,
          testbed: Testbed | None = None, quiet: bool = True, die_with_parent: bool = False,
          schedules: Mapping[str, Sequence[Sequence[int]]] | None = None) -> dict[str, str]:
    """Start the variants not already running (building environment and models if needed, unless ``testbed``
    names them); wait until all answer /health; return name -> base URL (``http://127.0.0.1:PORT``, OpenAI
    paths under ``/v1``, served model name ``MODEL_NAME``).

    On failure or timeout every engine this call started is stopped again, and the error names the log.
    ``schedules``: an instance name -> its draft schedule (:func:`server_args`), for instances this call starts
    (one already running keeps the arguments it was started with).
    ``die_with_parent``: the engines (vLLM's worker processes included) end when this process dies, for a
    caller that owns them for its lifetime; without it they outlive the caller (``specgate testbed start``).
    Call it from the main thread then: the kernel watches the thread that started them.
    """
    testbed = testbed or ensure(quiet=quiet)
    state = StateFile(state_dir or state_dir_default())
    ports = ports_for(variants, base_port)
    started: list[tuple[EngineRecord, subprocess.Popen[bytes]]] = []
    adopted: list[EngineRecord] = []  # alive already: maybe still starting, for another caller
    with file_lock(state.lock):
        records = {n: r for n, r in state.read().items() if is_alive(r)}
        for name, port in ports.items():
            if name in records:
                if records[name].port != port:
                    raise RuntimeError(f"engine {name} already runs on port {records[name].port}, not {port}")
                adopted.append(records[name])
                continue
            log = state.directory / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("ab") as out:
                out.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} start {name} on port {port}\n".encode())
                out.flush()
                cmd = [str(testbed.python), *server_args(name, port, testbed.models,
                                                         schedule=(schedules or {}).get(name))]
                proc = subprocess.Popen(  # noqa: S603
                    lifeline.wrap(cmd, grace_s=ENGINE_STOP_GRACE_S) if die_with_parent else cmd,
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env.engine_env({**compile_cache(name), **cpu_binding(name), **(extra_env or {})}),
                    start_new_session=True,
                    cwd=state.directory)
            _CHILDREN[proc.pid] = proc
            ticks = process_start_ticks(proc.pid)
            record = EngineRecord(name=name, pid=proc.pid, start_ticks=ticks or -1, port=port,
                                  url=f"http://127.0.0.1:{port}", log=str(log), started_at=time.time())
            records[name] = record
            started.append((record, proc))
        state.write(records)
    try:
        t0 = time.monotonic()
        pending: dict[str, tuple[EngineRecord, subprocess.Popen[bytes] | None]] = {
            **{rec.name: (rec, None) for rec in adopted}, **{rec.name: (rec, proc) for rec, proc in started}}
        while pending:
            for name, (rec, child) in list(pending.items()):
                if child.poll() is not None if child is not None else not is_alive(rec):
                    code = "" if child is None else f" with {child.returncode}"
                    raise RuntimeError(f"engine {name} exited{code} while starting; "
                                       f"log {rec.log}:\n{_log_tail(rec.log)}")
                if _healthy(rec.url):
                    if child is not None:
                        rec.ready_s = round(time.monotonic() - t0, 1)
                    del pending[name]
            if pending and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"engines {sorted(pending)} not healthy after {timeout_s:.0f} s; logs: "
                                   + ", ".join(rec.log for rec, _ in pending.values()))
            if pending:
                time.sleep(1.0)
    except BaseException:
        for rec, _ in started:
            _terminate(rec)
        with file_lock(state.lock):
            current = state.read()
            for rec, _ in started:
                current.pop(rec.name, None)
            state.write(current)
        raise
    with file_lock(state.lock):
        current = state.read()
        for rec, _ in started:
            current[rec.name] = rec
        state.write(current)
        return {name: current[name].url for name in ports}


def stop(variants: Iterable[str] | None = None, *, state_dir: Path | None = None) -> list[str]:
    """Stop the recorded engines (all, or the named ones); return the names stopped. Unknown names are ignored."""
    state = StateFile(state_dir or state_dir_default())
    with file_lock(state.lock):
        records = state.read()
        names = list(records) if variants is None else [n for n in variants if n in records]
        stopped = []
        for name in names:
            record = records.pop(name)
            if is_alive(record):
                _terminate(record)
                stopped.append(name)
        state.write(records)
    return stopped


def status(*, state_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """name -> record plus ``alive`` and ``healthy``, for every recorded engine."""
    state = StateFile(state_dir or state_dir_default())
    out = {}
    for name, record in state.read().items():
        alive = is_alive(record)
        out[name] = {**asdict(record), "alive": alive, "healthy": alive and _healthy(record.url)}
    return out
