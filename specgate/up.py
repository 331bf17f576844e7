"""``specgate up``: the whole product on one machine, on embedded defaults (what ``make run`` calls).

In order: the control plane on SQLite (``DATA_DIR/specgate.db``) with the example policies; the
testbed's engine environment and trained models (built once, then cached); real vLLM engines
(CPU build) for as many variants as memory allows; the ``testbed`` policy fitted to those
engines; a sidecar in front of them (pool ``testbed``, a fresh worker key); a looping traffic
generator over the testbed's routes; the dashboard. Every URL and the admin key are printed;
Ctrl-C (or SIGTERM) stops everything this command started, and only that, also when start-up
fails half way and when its output can no longer be written (``make run | tee run.log``: the Ctrl-C
ends ``tee`` too); killed outright, it takes what it started with it (:mod:`testbed.lifeline`).
``--no-engines`` brings up only the control plane and the dashboard.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx
import typer
import uvicorn
import yaml

from apiclient import ApiClient, ApiError, calls
from apiclient.models import Policy
from controlplane.app import create_app
from controlplane.auth.local import mint_keys
from controlplane.auth.schemas import Scope
from controlplane.migrations_state import upgrade
from controlplane.settings import ControlPlaneSettings
from specgate import stack as devstack
from testbed.engines import ports_for

EXAMPLES = Path(__file__).resolve().parent.parent / "policies" / "examples"
# (file, pool): the seed policy serves every pool without a policy of its own.
EXAMPLE_POLICIES = (("seed.yaml", None), ("multi-route.yaml", "fleet"), ("conservative.yaml", "batch"))
TESTBED_POLICY = "testbed.yaml"


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _write(text: str, *, err: bool = False, color: str | None = None) -> None:
    """Print, or nothing once the output is gone: a closed pipe must never cut the stop short."""
    try:
        typer.secho(text, err=err, fg=color)
    except (OSError, ValueError):  # EPIPE, or a stream already closed
        _silence_output()


def _silence_output() -> None:
    """Send the rest of this process's output (prints, logs, the flush at exit) to /dev/null, so that
    nothing written later fails again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


def _say(line: str) -> None:
    _write(f"[{time.strftime('%H:%M:%S')}] {line}")


def _policy_or_none(api: ApiClient, name: str) -> Policy | None:
    try:
        return api.send(calls.policy(name)).data
    except ApiError as exc:
        if exc.status != 404:
            raise
        return None


def _load_examples(base_url: str, token: str) -> list[str]:
    loaded = []
    with ApiClient(base_url, token, timeout_s=30) as api:
        for filename, pool in EXAMPLE_POLICIES:
            text = (EXAMPLES / filename).read_text()
            name = yaml.safe_load(text)["name"]
            if _policy_or_none(api, name) is None:
                api.send(calls.create_policy(name, pool=pool))
                api.send(calls.create_revision(name, text, message=f"example {filename}"))
            loaded.append(f"{name} (pool {pool or 'any'})")
    return loaded


def _load_testbed_policy(base_url: str, token: str, engines: list[str]) -> str:
    """The testbed policy, fitted to the running engines, made the active revision of pool ``testbed``."""
    document = devstack.fit_policy(yaml.safe_load((EXAMPLES / TESTBED_POLICY).read_text()), engines)
    name = document["name"]
    with ApiClient(base_url, token, timeout_s=30) as api:
        found = _policy_or_none(api, name)
        if found is None:
            api.send(calls.create_policy(name, pool=devstack.TESTBED_POOL, description=document.get("description")))
        head = found.head_revision_id if found is not None else None
        revision = api.send(calls.create_revision(
            name, yaml.safe_dump(document, sort_keys=False),
            message=f"{TESTBED_POLICY} for engines {', '.join(engines)}",
            if_match=f'"{head}"' if head else None)).data.id
        if api.send(calls.policy(name)).data.active_revision_id != revision:
            # a later revision is a draft until activated: this one is what runs now
            api.send(calls.rollback(name, revision, reason=f"specgate up: engines {', '.join(engines)}"))
    return f"{name} (pool {devstack.TESTBED_POOL}, engines {', '.join(engines)})"


def _start_dashboard(host: str, port: int, api_url: str, token: str,
                     log: Path | None = None) -> tuple[devstack.Child | None, str]:
    """The dashboard beside the control plane, signed in with the admin key; (process, banner line)."""
    if port == 0:
        return None, "off (--dashboard-port 0)"
    if importlib.util.find_spec("streamlit") is None:
        return None, "not installed (pip install streamlit)"
    if not _port_free(host, port):
        return None, f"not started: {host}:{port} is in use (pass --dashboard-port)"
    from dashboard import launch

    child = devstack.spawn("dashboard", launch.command(host=host, port=port), log,
                           env=launch.environment(api_url, token))
    return child, f"http://{host}:{port}  (signed in with the admin key)"


class _Stop(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) asked us to stop: handled as a Ctrl-C."""


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end ``up`` the way Ctrl-C does, so every part it started is stopped."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop()

    # A write to a closed pipe must fail with EPIPE, which the stop survives, and never kill this process
    # half way through stopping (SIGPIPE). Python's default, made sure of here.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGPIPE] = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """While stopping: a second Ctrl-C must not cut the stop short and leave processes behind."""
    def later(signum: int, frame: FrameType | None) -> None:
        _write("still stopping (processes this command started are being stopped)...")

    previous = {sig: signal.signal(sig, later) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _free_or_exit(host: str, port: int, what: str, option: str) -> None:
    if not _port_free(host, port):
        typer.secho(f"error: {host}:{port} is in use ({what}); pass {option}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)


def up(data_dir: Path = typer.Option(Path(".specgate"), help="where the SQLite database, logs and state live"),
       host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8080),
       dashboard_port: int = typer.Option(8501, help="port of the dashboard; 0 does not start it"),
       engines: str = typer.Option("auto", help="engine variants to start: auto (as many of base, draft, "
                                   "ngram as memory allows, ~3 GiB each) or a list such as base,draft"),
       no_engines: bool = typer.Option(False, "--no-engines", help="light mode: only the control plane and "
                                       "the dashboard (no engines, sidecar or traffic)"),
       engine_port: int = typer.Option(8100, help="port of the base engine; ngram +1, draft +2; a second "
                                       "replica (base-2) +3"),
       shape: str = typer.Option("twin", help="twin: one worker sidecar in front of its engines (twin copies "
                                 "of the weights); pools: a gateway in front of replica pools (a speculative "
                                 "replica and plain ones, one copy of the weights each)"),
       sidecar_port: int = typer.Option(9000, help="port of the sidecar (OpenAI-compatible endpoint)"),
       traffic: bool = typer.Option(True, help="run the traffic generator against the sidecar"),
       engine_starter: str = typer.Option("", hidden=True, help="MODULE:FACTORY of a stand-in engine starter "
                                          "(tests)")) -> None:
    """Bring the product up: control plane, engines, sidecar, traffic and dashboard (Ctrl-C stops all)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    url = os.environ.get("SPECGATE_DATABASE_URL") or f"sqlite:///{(data_dir / 'specgate.db').resolve()}"
    settings = ControlPlaneSettings(database_url=url)
    if shape not in ("twin", "pools"):
        typer.secho(f"error: --shape must be twin or pools, got {shape!r}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    _free_or_exit(host, port, "control plane", "--port")
    variants, why = ([], "") if no_engines else _choose_engines_or_exit(engines, engine_port, host, sidecar_port,
                                                                          shape)
    plan = _Plan(data_dir=data_dir, database_url=url, host=host, dashboard_port=dashboard_port, shape=shape,
                 with_engines=not no_engines, variants=variants, why=why, engine_port=engine_port,
                 sidecar_port=sidecar_port, traffic=traffic, engine_starter=engine_starter,
                 base=f"http://{host}:{port}")
    stack = devstack.Stack(data_dir=data_dir.resolve(), say=_say)
    leftovers = stack.reap_leftovers()
    if leftovers:
        _say(f"stopped what an earlier `specgate up` left running: {', '.join(leftovers)}")
    upgrade(url)
    token, worker_token = _mint_keys(url, with_worker=plan.with_engines)

    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="control-plane", daemon=True)
    exit_code = 0
    with _stop_signals():
        try:
            thread.start()
            _wait_ready(plan.base)
            _write(_start_parts(plan, stack, token, worker_token))
            _watch(thread, stack)
        except KeyboardInterrupt:
            _write("stopping...")
        except (devstack.StartupError, RuntimeError, TimeoutError, OSError, httpx.HTTPError, ApiError) as exc:
            _write(f"error: {exc}", err=True, color=typer.colors.RED)
            _write("stopping what was started...")
            exit_code = 1
        finally:
            _stop(stack, server, thread)
    if exit_code:
        raise typer.Exit(exit_code)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What ``up`` starts after the control plane, decided (and its ports checked) before anything starts."""

    data_dir: Path  # as given; the testbed's parts get it resolved
    database_url: str
    host: str
    dashboard_port: int
    shape: str  # twin or pools
    with_engines: bool
    variants: list[str]  # engine variants to start (none without engines)
    why: str  # why these variants
    engine_port: int
    sidecar_port: int
    traffic: bool
    engine_starter: str
    base: str  # the control plane's URL


# --- start-up steps -----------------------------------------------------------------------------------

def _choose_engines_or_exit(engines: str, engine_port: int, host: str, sidecar_port: int,
                            shape: str = "twin") -> tuple[list[str], str]:
    """The engine instances to start and why; exits (2) on an unknown one or a port already in use."""
    choose = devstack.choose_pool_engines if shape == "pools" else devstack.choose_engines
    try:
        variants, why = choose(engines, devstack.mem_available_gib())
    except ValueError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None
    for name, engine_port_ in ports_for(variants, engine_port).items():
        _free_or_exit("127.0.0.1", engine_port_, f"engine {name}", "--engine-port")
    _free_or_exit(host, sidecar_port, "sidecar", "--sidecar-port")
    return variants, why


def _mint_keys(url: str, *, with_worker: bool) -> tuple[str, str | None]:
    """A fresh admin key, and a worker key for the sidecar when there is one to start."""
    stamp = int(time.time())
    wanted = {f"make-run-{stamp}": Scope.admin}
    if with_worker:
        wanted[f"make-run-sidecar-{stamp}"] = Scope.worker
    # The sidecar's key may act only as workers of the stack's pool.
    keys = mint_keys(url, wanted, created_by="cli:make-run",
                     pools={f"make-run-sidecar-{stamp}": devstack.TESTBED_POOL})
    return keys[f"make-run-{stamp}"], keys.get(f"make-run-sidecar-{stamp}")


def _wait_ready(base: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise devstack.StartupError("the control plane did not become ready in 30 s")


def _start_parts(plan: _Plan, stack: devstack.Stack, token: str, worker_token: str | None) -> str:
    """Everything after the control plane: example policies, the testbed, the dashboard; the banner to print."""
    loaded = _load_examples(plan.base, token)
    lines: list[tuple[str, str]] = []
    if plan.with_engines:
        assert worker_token is not None
        _say(f"the control plane answers at {plan.base} (admin key {token}); engines: {', '.join(plan.variants)} "
             f"({plan.why})")
        lines, testbed_line = _start_testbed(plan, stack, token, worker_token)
        loaded.append(testbed_line)
    dashboard, dashboard_line = _start_dashboard(plan.host, plan.dashboard_port, plan.base, token,
                                                 log=plan.data_dir / "dashboard.log" if plan.with_engines else None)
    if dashboard is not None:
        stack.add(dashboard)
    return _banner(plan.base, dashboard_line, plan.database_url, loaded, token, lines)


def _start_testbed(plan: _Plan, stack: devstack.Stack, token: str,
                   worker_token: str) -> tuple[list[tuple[str, str]], str]:
    """Engines, the fitted testbed policy, the sidecar and the traffic; (banner lines, policy line)."""
    data_dir, base = plan.data_dir.resolve(), plan.base
    logs = data_dir / "logs"
    starter = devstack.load_engine_starter(plan.engine_starter, data_dir / "engines")
    t0 = time.monotonic()
    urls = stack.start_engines(starter, plan.variants, plan.engine_port)
    policy_line = _load_testbed_policy(base, token, list(devstack.engine_pools(urls)))
    listen = f"{plan.host}:{plan.sidecar_port}"
    sidecar_url = f"http://{listen}"
    kind = "gateway" if plan.shape == "pools" else "worker"
    child = stack.add(devstack.spawn("sidecar", devstack.sidecar_command(
        api_url=base, engine_urls=urls, listen=listen, pool=devstack.TESTBED_POOL,
        state_dir=data_dir / "sidecar", bundle_key=devstack.public_key(base), kind=kind), logs / "sidecar.log",
        env=devstack.sidecar_env(worker_token)))
    devstack.wait_sidecar(child, sidecar_url, base, token, worker_id=listen)
    what = "gateway" if kind == "gateway" else "sidecar"
    _say(f"{what} {sidecar_url} registered with the control plane (pool {devstack.TESTBED_POOL})")
    lines = [(f"engine {name}", url) for name, url in urls.items()]
    lines.append((what, f"{sidecar_url}/v1  (OpenAI-compatible; {kind} {listen}, pool "
                        f"{devstack.TESTBED_POOL})"))
    if plan.traffic:
        stack.add(devstack.spawn("loadgen", devstack.loadgen_command(
            sidecar_url, corpus_seed=devstack.corpus_seed(), seed=int(time.time()) % 100_000),
            logs / "loadgen.log"))
        lines.append(("traffic", f"specgate loadgen --loop ({devstack.TRAFFIC_ROUTES}; concurrency "
                                 f"{devstack.TRAFFIC_SCHEDULE}); log {logs / 'loadgen.log'}"))
    else:
        lines.append(("traffic", "off (--no-traffic)"))
    lines.append(("logs", f"{logs}, engines in {data_dir / 'engines'}"))
    _say(f"engines, policy and sidecar ready after {time.monotonic() - t0:.0f} s")
    return lines, policy_line


def _banner(base: str, dashboard_line: str, url: str, loaded: list[str], token: str,
            extra: list[tuple[str, str]]) -> str:
    rows = [("control plane", base), ("API docs", f"{base}/docs"), ("dashboard", dashboard_line), *extra,
            ("database", url), ("policies", ", ".join(loaded)), ("admin key", token)]
    text = "\nspecgate is up\n" + "".join(f"  {name:<15} {value}\n" for name, value in rows)
    text += f"\n  try: SPECGATE_URL={base} SPECGATE_KEY={token} .venv/bin/specgate workers\n"
    if extra:
        text += (f"       curl -s '{base}/v1/analysis/summary?group_by=route,engine' -H 'Authorization: Bearer "
                 f"{token}'\n")
    return text + "Ctrl-C stops everything this command started.\n"


# --- running, and the shutdown ------------------------------------------------------------------------

def _watch(thread: threading.Thread, stack: devstack.Stack) -> None:
    """Until Ctrl-C: keep serving; say once when a part dies on its own."""
    reported: set[str] = set()
    while thread.is_alive():
        thread.join(0.5)
        for child in stack.children:
            if child.name not in reported and not child.alive():
                reported.add(child.name)
                where = f"; log {child.log}" if child.log else ""
                _say(f"warning: {child.name} exited with {child.process.returncode}{where}")


def _stop(stack: devstack.Stack, server: uvicorn.Server, thread: threading.Thread) -> None:
    """Every part this command started, then the control plane; a second Ctrl-C waits for it."""
    with _signals_deferred():
        stack.stop()
        server.should_exit = True
        if thread.is_alive():
            thread.join(10)
