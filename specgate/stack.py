"""What ``specgate up`` starts beside the control plane: engines, a sidecar, a traffic generator.

Each part is a process of its own, started in its own session (a Ctrl-C in the
terminal reaches ``specgate up`` alone, which then stops the parts in order:
traffic first, then the sidecar, which flushes its telemetry to the control
plane that is still up, then the dashboard, then the engines). Every process
is recorded (pid and start time) in ``DATA_DIR/run.json``; a later ``up``
stops what an earlier one left behind, and never signals a recycled pid. Each
part also dies with ``specgate up`` itself, process tree included, when that is
killed outright (:mod:`testbed.lifeline`), and stopping goes on to the end when
what ``up`` says can no longer be written (``make run | tee`` and a Ctrl-C
that ends ``tee`` too).

The engines come from an :class:`EngineStarter`. :class:`TestbedEngines` is the
real one (vLLM's CPU build with the testbed's trained models); the tests use
a fake that serves the same OpenAI paths.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import httpx

from testbed import lifeline
from testbed.engines import process_start_ticks, variant_of

Say = Callable[[str], None]

# The testbed's variants, in the order they join when memory is short: the plain engine is the
# fallback and kill-switch target, the draft model pays on most routes, n-gram on extraction.
ENGINE_ORDER = ("base", "draft", "ngram")
SPECULATIVE_PREFERENCE = ("draft", "ngram")
ENGINE_RSS_GIB = 3.0  # one vLLM CPU server with a 1 GiB KV cache (see the testbed notes)
HEADROOM_GIB = 2.0  # left for the control plane, the sidecar, the dashboard and everyone else
TESTBED_POOL = "testbed"

# The traffic ``make run`` sends: every testbed route, a gentle concurrency schedule that loops,
# some structured output (never speculated by the policy) and some streaming.
TRAFFIC_ROUTES = "extract=3,classify=2,chat=3,creative=2"
TRAFFIC_SCHEDULE = "1:60s,2:60s,4:45s,2:45s"
TRAFFIC_STRUCTURED_SHARE = 0.15
TRAFFIC_STREAM_SHARE = 0.3
TRAFFIC_MAX_TOKENS = 48
# Greedy: vLLM's CPU build accepts no draft token when it samples (measured: 0 of ~700 drafted tokens at
# temperature 0.3 and 1.0, against 0.96 greedy on chat), and the dashboard would show speculation losing
# everywhere for that reason alone.
TRAFFIC_TEMPERATURE = 0.0


class StartupError(RuntimeError):
    """A part did not come up; the message says which and where its log is."""


# --- choosing engines and fitting the policy to them -----------------------------------------

def mem_available_gib() -> float | None:
    """``MemAvailable`` of /proc/meminfo in GiB; None where there is no such file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1024 * 1024)
    except (OSError, ValueError, IndexError):
        return None
    return None


def choose_engines(spec: str, available_gib: float | None) -> tuple[list[str], str]:
    """The engine variants to start, and a line saying why.

    ``auto``: as many of base, draft, ngram as the available memory holds (base always);
    otherwise a comma-separated list of variants, which must include ``base``.
    """
    spec = spec.strip().lower()
    if spec == "auto":
        if available_gib is None:
            return list(ENGINE_ORDER), "all variants (available memory unknown)"
        fit = int((available_gib - HEADROOM_GIB) // ENGINE_RSS_GIB)
        chosen = list(ENGINE_ORDER[:max(1, min(len(ENGINE_ORDER), fit))])
        return chosen, (f"{available_gib:.1f} GiB available, about {ENGINE_RSS_GIB:g} GiB per engine"
                        + ("" if fit >= 1 else "; tight, starting base anyway"))
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINE_ORDER]
    if unknown or not names:
        raise ValueError(f"--engines: unknown variant(s) {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(ENGINE_ORDER)}, or auto")
    if "base" not in names:
        raise ValueError("--engines must include base (the plain engine: fallback and kill-switch target)")
    ordered = [n for n in ENGINE_ORDER if n in names]
    return ordered, "as asked"


# The pool shape on one machine: the speculative engine with the most to gain, and two plain replicas beside it
# when memory allows (the testbed: three engines, about 9 GiB).
POOL_ORDER = ("base", "draft", "base-2")


def choose_pool_engines(spec: str, available_gib: float | None) -> tuple[list[str], str]:
    """The engine instances of the pool shape (``specgate up --shape pools``), and a line saying why.

    ``auto``: base and draft, and a second plain replica (base-2) when memory holds three engines; otherwise
    a comma-separated list of instances (variants, or replicas of one such as base-2), with a plain one and
    a speculative one.
    """
    spec = spec.strip().lower()
    if spec == "auto":
        if available_gib is None:
            return list(POOL_ORDER), "a speculative replica and two plain ones (available memory unknown)"
        fit = int((available_gib - HEADROOM_GIB) // ENGINE_RSS_GIB)
        chosen = list(POOL_ORDER[:max(2, min(len(POOL_ORDER), fit))])
        return chosen, (f"{available_gib:.1f} GiB available, about {ENGINE_RSS_GIB:g} GiB per engine"
                        + ("" if fit >= 2 else "; tight, starting one of each anyway"))
    names = list(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    try:
        variants = [variant_of(name) for name in names]
    except ValueError as exc:
        raise ValueError(f"--engines: {exc}") from None
    if "base" not in variants or all(v == "base" for v in variants):
        raise ValueError("--engines of the pool shape needs a plain replica (base, base-2, ...) and a speculative "
                         "one (draft, ngram, ...)")
    return names, "as asked"


def engine_pools(urls: Mapping[str, str]) -> dict[str, list[str]]:
    """Engine instances' URLs grouped by variant: the engines a sidecar or gateway routes to."""
    pools: dict[str, list[str]] = {}
    for instance, url in urls.items():
        pools.setdefault(variant_of(instance), []).append(url)
    return pools


def fit_policy(data: Mapping[str, Any], running: Collection[str]) -> dict[str, Any]:
    """The policy document with only the engines that run: a decision for a missing speculative engine
    goes to the preferred speculative engine that runs (else to the plain one), and exploration is
    dropped when nothing speculative runs. ``data`` is the parsed YAML; it is not changed."""
    doc: dict[str, Any] = copy.deepcopy(dict(data))
    engines: dict[str, Any] = doc["engines"]
    plain = [n for n, e in engines.items() if e.get("method") == "none" and n in running]
    if not plain:
        raise ValueError("the policy's plain engine is not among the running engines")
    speculative = [n for n in SPECULATIVE_PREFERENCE if n in running and n in engines]
    speculative += [n for n, e in engines.items() if n in running and e.get("method") != "none"
                    and n not in speculative]
    substitute = speculative[0] if speculative else plain[0]

    def refit(then: dict[str, Any]) -> None:
        if then.get("engine") not in running:
            then["engine"] = substitute
            then.pop("num_speculative_tokens", None)  # it belonged to the missing engine

    for rule in doc.get("rules") or []:
        refit(rule["then"])
    refit(doc["default"])
    doc["engines"] = {n: e for n, e in engines.items() if n in running}
    if doc.get("plain_engine") not in (None, *doc["engines"]):
        doc["plain_engine"] = plain[0]
    exploration = doc.get("exploration")
    if exploration:
        if not speculative:
            doc.pop("exploration")
        elif exploration.get("speculative_engine") not in (None, *speculative):
            exploration["speculative_engine"] = speculative[0]
    return doc


# --- engines -------------------------------------------------------------------------------

class EngineStarter(Protocol):
    """Starts engine variants (name -> OpenAI-compatible base URL) and stops what it started."""

    def start(self, variants: Sequence[str], base_port: int, say: Say) -> dict[str, str]: ...

    def stop(self) -> list[str]: ...


class TestbedEngines:
    """Real vLLM engines (CPU build) with the testbed's trained models, built or reused from the cache.

    Its engines are recorded in a state directory of their own (``DATA_DIR/engines``), apart from
    ``specgate testbed start``'s, so stopping them stops exactly what ``specgate up`` started.
    """

    def __init__(self, state_dir: Path, *, timeout_s: float = 600.0) -> None:
        self.state_dir = state_dir
        self.timeout_s = timeout_s

    def start(self, variants: Sequence[str], base_port: int, say: Say) -> dict[str, str]:
        from testbed import engines, env, models

        t0 = time.monotonic()
        if env.is_ready():
            say("engine environment: cached")
        else:
            say("engine environment: creating it (vLLM CPU build; first time only, a few minutes)")
        python = env.ensure_env(quiet=False)
        if models.is_ready():
            say("models: cached")
        else:
            say("models: training the tiny target and draft (first time only, a few minutes)")
        paths = models.ensure_models(python, quiet=False)
        say(f"environment and models ready after {time.monotonic() - t0:.0f} s")
        ports = engines.ports_for(variants, base_port)
        say(f"starting engines {', '.join(f'{n} :{p}' for n, p in ports.items())} "
            f"(about a minute each on 2 cores; logs in {self.state_dir})")
        t1 = time.monotonic()
        urls = engines.start(variants, base_port, state_dir=self.state_dir, timeout_s=self.timeout_s,
                             testbed=models.Testbed(python=python, models=paths), quiet=False,
                             die_with_parent=True)
        say(f"engines healthy after {time.monotonic() - t1:.0f} s")
        return urls

    def stop(self) -> list[str]:
        from testbed import engines

        return engines.stop(None, state_dir=self.state_dir)


def load_engine_starter(spec: str, state_dir: Path) -> EngineStarter:
    """``""``: :class:`TestbedEngines`; ``MODULE:FACTORY``: ``FACTORY(state_dir)`` (how tests put in a fake)."""
    if not spec:
        return TestbedEngines(state_dir)
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr or "engine_starter")
    starter: EngineStarter = factory(state_dir)
    return starter


# --- processes -----------------------------------------------------------------------------

@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path | None
    own_group: bool  # started in a session of its own: signal the whole group
    start_ticks: int | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: int) -> None:
        if not self.alive():  # not reaped yet means the pid is still ours
            return
        with contextlib.suppress(ProcessLookupError):
            if self.own_group:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)

    def stop(self, grace_s: float) -> int | None:
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
        return self.process.returncode


def spawn(name: str, cmd: Sequence[str], log: Path | None, *, env: Mapping[str, str] | None = None) -> Child:
    """``cmd`` in a session of its own, tied to this process (it dies with it, see :mod:`testbed.lifeline`);
    output to ``log`` (else nowhere). Secrets go in ``env``: a command line is readable by every user."""
    grace_s = Stack.GRACE_S.get(name, 10.0)
    with contextlib.ExitStack() as files:
        out: Any = subprocess.DEVNULL
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = files.enter_context(log.open("ab"))
            out.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {name}: {' '.join(cmd)}\n".encode())
            out.flush()
        process = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
            lifeline.wrap(cmd, grace_s=grace_s), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None, start_new_session=True)
    return Child(name, process, log, own_group=True, start_ticks=process_start_ticks(process.pid))


def log_tail(path: Path | None, lines: int = 20) -> str:
    if path is None:
        return ""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Stack:
    """The processes ``specgate up`` started beside the control plane, stopped in reverse order of need."""

    data_dir: Path
    say: Say
    children: list[Child] = field(default_factory=list)
    engines: EngineStarter | None = None
    engine_urls: dict[str, str] = field(default_factory=dict)

    # Stop order: traffic, then the sidecar (it flushes telemetry to the running control plane), the rest.
    STOP_ORDER: ClassVar[tuple[str, ...]] = ("loadgen", "sidecar", "dashboard")
    GRACE_S: ClassVar[Mapping[str, float]] = {"loadgen": 10.0, "sidecar": 20.0, "dashboard": 5.0}

    @property
    def run_file(self) -> Path:
        return self.data_dir / "run.json"

    def record(self) -> None:
        entries = {c.name: {"pid": c.process.pid, "start_ticks": c.start_ticks, "own_group": c.own_group,
                            "log": str(c.log) if c.log else None} for c in self.children}
        self.run_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.run_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "children": entries}, indent=2) + "\n")
        tmp.replace(self.run_file)

    def add(self, child: Child) -> Child:
        self.children.append(child)
        self.record()
        return child

    def reap_leftovers(self) -> list[str]:
        """Stop the processes an earlier ``up`` on this data directory recorded and left running."""
        try:
            previous = json.loads(self.run_file.read_text())
        except (OSError, ValueError):
            return []
        stopped = []
        for name, entry in (previous.get("children") or {}).items():
            pid, ticks = entry.get("pid"), entry.get("start_ticks")
            if not isinstance(pid, int) or ticks is None or process_start_ticks(pid) != ticks:
                continue  # gone, or the pid now belongs to someone else
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if entry.get("own_group"):
                    os.killpg(pid, signal.SIGTERM)
                else:
                    os.kill(pid, signal.SIGTERM)
            stopped.append(name)
        self.run_file.unlink(missing_ok=True)
        return stopped

    def start_engines(self, starter: EngineStarter, variants: Sequence[str], base_port: int) -> dict[str, str]:
        self.engines = starter  # set first: a start that fails half way is still stopped
        self.engine_urls = starter.start(variants, base_port, self.say)
        return self.engine_urls

    def _tell(self, line: str) -> None:
        # Stopping must reach the last child even when nothing can be written any more (a closed pipe).
        with contextlib.suppress(Exception):
            self.say(line)

    def stop(self) -> None:
        rank = {name: i for i, name in enumerate(self.STOP_ORDER)}
        for child in sorted(self.children, key=lambda c: rank.get(c.name, len(rank))):
            if child.alive():
                self._tell(f"stopping {child.name}")
            try:
                child.stop(self.GRACE_S.get(child.name, 10.0))
            except Exception as exc:  # one child that cannot be stopped must not spare the rest
                self._tell(f"could not stop {child.name}: {exc}")
        if self.engines is not None:
            self._tell("stopping engines")
            with contextlib.suppress(Exception):
                self.engines.stop()
            self.engines = None
        self.children = [c for c in self.children if c.alive()]
        if not self.children:
            self.run_file.unlink(missing_ok=True)


# --- the sidecar and the traffic -----------------------------------------------------------

def cli_command() -> list[str]:
    """This interpreter running the ``specgate`` command line."""
    return [sys.executable, "-m", "specgate"]


def public_key(api_url: str) -> str:
    answer = httpx.get(f"{api_url}/v1/bundle/public-key", timeout=10)
    answer.raise_for_status()
    return str(answer.json()["public_key"])


def sidecar_command(*, api_url: str, engine_urls: Mapping[str, str], listen: str, pool: str,
                    state_dir: Path, bundle_key: str, kind: str = "worker") -> list[str]:
    """The sidecar's command line (``kind`` gateway: in front of replica pools); ``engine_urls`` by engine
    instance, replicas of one variant (base, base-2) forming its pool. Its worker key goes in its
    environment (:func:`sidecar_env`)."""
    cmd = [*cli_command(), "sidecar", "--control-plane", api_url, "--listen", listen, "--kind", kind,
           "--pool", pool, "--state-dir", str(state_dir), "--public-key", bundle_key, "--log-level", "warning"]
    for name, urls in engine_pools(engine_urls).items():
        cmd += ["--engine", f"{name}={','.join(urls)}"]
    return cmd


def sidecar_env(worker_key: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The sidecar's environment: the worker key in ``SPECGATE_KEY``, where ``ps`` does not show it (a
    process's environment is readable by its own user only, its command line by everyone)."""
    env = dict(os.environ if base is None else base)
    env.pop("SPECGATE_KEY_FILE", None)  # the key given here is the one to use
    env["SPECGATE_KEY"] = worker_key
    return env


def wait_sidecar(child: Child, url: str, api_url: str, admin_key: str, worker_id: str,
                 timeout_s: float = 60.0) -> None:
    """Until the sidecar answers /readyz and the control plane lists it as a converged worker."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {admin_key}"}
    while time.monotonic() < deadline:
        if not child.alive():
            raise StartupError(f"the sidecar exited with {child.process.returncode}; log {child.log}:\n"
                               f"{log_tail(child.log)}")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                workers = httpx.get(f"{api_url}/v1/workers", params={"pool": TESTBED_POOL}, headers=headers,
                                    timeout=5).json()["items"]
                if any(w["id"] == worker_id and w.get("converged") for w in workers):
                    return
        time.sleep(0.5)
    raise StartupError(f"the sidecar was not ready and registered within {timeout_s:.0f} s; log {child.log}:\n"
                       f"{log_tail(child.log)}")


def loadgen_command(sidecar_url: str, *, corpus_seed: int | None, seed: int) -> list[str]:
    cmd = [*cli_command(), "loadgen", "--url", sidecar_url, "--loop", "--routes", TRAFFIC_ROUTES,
           "--schedule", TRAFFIC_SCHEDULE, "--structured-share", str(TRAFFIC_STRUCTURED_SHARE),
           "--stream-share", str(TRAFFIC_STREAM_SHARE), "--max-tokens", str(TRAFFIC_MAX_TOKENS),
           "--temperature", str(TRAFFIC_TEMPERATURE),
           "--seed", str(seed), "--report-every", "30", "--timeout", "300"]
    if corpus_seed is not None:  # the very language the models were trained on
        cmd += ["--prompts", "testbed.corpus", "--corpus-seed", str(corpus_seed)]
    return cmd


def corpus_seed() -> int | None:
    """The seed of the testbed's training corpus, so that the traffic speaks the models' language."""
    try:
        from testbed.recipe import RECIPE
    except ImportError:
        return None
    seed = RECIPE.get("seed")
    return seed if isinstance(seed, int) else None
