"""``specgate testbed recommend-check``: the recommender against the testbed's sweep, on recorded or live telemetry.

The check itself (ground truth from the sweep, the comparison, the report) is
``testbed.reccheck``; recording live telemetry needs the whole product (a
control plane, engines, a sidecar, traffic), so it lives here, in the root.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from apiclient import ApiClient, ApiError, calls
from specgate import stack as devstack
from testbed import reccheck
from testbed.reccheck import (
    CHECK_POLICY,
    LIVE_MAX_TOKENS,
    LIVE_ROUTES,
    LIVE_SCHEDULE,
    POOL,
    check_policy,
    route_engines,
)


def record_live(out: Path, *, say: Callable[[str], None], schedule: str = LIVE_SCHEDULE,
                max_tokens: int = LIVE_MAX_TOKENS, engine_port: int = 18600, api_port: int = 18680,
                sidecar_port: int = 18690, seed: int = 1) -> dict[str, Any]:
    """Engines, a control plane on a fresh SQLite database, a sidecar with :data:`CHECK_POLICY` and the load
    generator; then the cells of the recorded window, written to ``out`` with what produced them."""
    import httpx
    import uvicorn

    from controlplane.app import create_app
    from controlplane.auth.local import mint_keys
    from controlplane.auth.schemas import Scope
    from controlplane.migrations_state import upgrade
    from controlplane.settings import ControlPlaneSettings
    from testbed import engines
    from testbed.models import ensure_models
    from testbed.recipe import RECIPE

    work = Path(tempfile.mkdtemp(prefix="specgate-recommend-check-"))
    url = f"sqlite:///{work / 'specgate.db'}"
    upgrade(url)
    keys = mint_keys(url, {"recommend-check": Scope.admin, "recommend-check-sidecar": Scope.worker},
                     created_by="cli:recommend-check")
    admin, worker = keys["recommend-check"], keys["recommend-check-sidecar"]
    server = uvicorn.Server(uvicorn.Config(create_app(ControlPlaneSettings(database_url=url)), host="127.0.0.1",
                                           port=api_port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="control-plane", daemon=True)
    thread.start()
    api = f"http://127.0.0.1:{api_port}"
    variants = sorted(set(route_engines(check_policy()).values()) | {"base"})
    already = {n for n, s in engines.status().items() if s.get("alive")}
    stack = devstack.Stack(data_dir=work, say=say)
    try:
        _wait(lambda: httpx.get(f"{api}/readyz", timeout=1).status_code == 200, 30, "the control plane")
        say(f"starting engines {', '.join(variants)} (already running: {', '.join(sorted(already)) or 'none'})")
        urls = engines.start(variants, engine_port, quiet=False)
        say(f"engines healthy: {', '.join(f'{n} {u}' for n, u in urls.items())}")
        with ApiClient(api, admin, timeout_s=30) as client:
            client.send(calls.create_policy("recommend-check", pool=POOL))
            client.send(calls.create_revision("recommend-check", CHECK_POLICY, message="recommend-check"))
        listen = f"127.0.0.1:{sidecar_port}"
        sidecar = stack.add(devstack.spawn("sidecar", devstack.sidecar_command(
            api_url=api, engine_urls=urls, listen=listen, pool=POOL,
            state_dir=work / "sidecar", bundle_key=devstack.public_key(api)), work / "sidecar.log",
            env=devstack.sidecar_env(worker)))
        devstack.wait_sidecar(sidecar, f"http://{listen}", api, admin, worker_id=listen)
        started = dt.datetime.now(dt.UTC)
        say(f"sidecar ready; load generator: one route at a time ({', '.join(LIVE_ROUTES)}), schedule "
            f"{schedule} each, max_tokens {max_tokens}")
        traffic = {}
        for index, route in enumerate(LIVE_ROUTES):
            loadgen = subprocess.run(  # noqa: S603 - our own interpreter and arguments
                [*devstack.cli_command(), "loadgen", "--url", f"http://{listen}", "--routes", f"{route}=1",
                 "--schedule", schedule, "--model", engines.MODEL_NAME, "--temperature", "0",
                 "--structured-share", "0", "--stream-share", "0", "--max-tokens", str(max_tokens),
                 "--seed", str(seed + index), "--prompts", "testbed.corpus", "--corpus-seed",
                 str(RECIPE["seed"]), "--report-every", "30", "--timeout", "300", "--json"],
                capture_output=True, text=True, check=False)
            if loadgen.returncode != 0:
                raise RuntimeError(f"the load generator failed on route {route} ({loadgen.returncode}):\n"
                                   f"{loadgen.stderr[-3000:]}")
            traffic[route] = json.loads(loadgen.stdout)
            overall = traffic[route]["overall"]
            say(f"route {route}: {overall['requests']} requests, {overall['errors']} errors, "
                f"{overall['speculated_share']:.0%} speculated")
        say("traffic done; stopping the sidecar (it flushes its telemetry)")
        sidecar.stop(30)
        with ApiClient(api, admin, timeout_s=60) as client:
            cells = client.send(calls.cells("recommend-check", since=started)).json
        machine = {"cpus": os.cpu_count(), "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                   "python": sys.version.split()[0]}
        data = {"recorded_at": started.strftime("%Y-%m-%dT%H:%M:%SZ"), "schedule": schedule,
                "models": ensure_models(quiet=True).fingerprint(),
                "routes": list(LIVE_ROUTES), "max_tokens": max_tokens,
                "requests": sum(t["overall"]["requests"] for t in traffic.values()),
                "errors": sum(t["overall"]["errors"] for t in traffic.values()), "machine": machine,
                "policy_document": CHECK_POLICY, "traffic": traffic, **cells}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, default=str) + "\n")
        say(f"{len(cells['cells'])} cells written to {out}")
        return data
    finally:
        stack.stop()
        stopped = engines.stop([v for v in variants if v not in already])
        if stopped:
            say(f"stopped engines {', '.join(stopped)}")
        server.should_exit = True
        thread.join(10)


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # not up yet, whatever the error says
            if predicate():
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not come up within {timeout_s:.0f} s")




def recommend_check_cmd(
    live: Annotated[bool, typer.Option("--live", help="record new telemetry first (engines, control plane, "
                                                      "sidecar and traffic; about 15 minutes)")] = False,
    sweep_file: Annotated[Path, typer.Option("--sweep", help="the sweep's sweep.json (ground truth)")] = (
        reccheck.SWEEP_FILE),
    cells_file: Annotated[Path, typer.Option("--cells", help="recorded cells (written by --live)")] = (
        reccheck.CELLS_FILE),
    report_file: Annotated[Path | None, typer.Option("--report", help="write the markdown report here")] = None,
    schedule: Annotated[str, typer.Option(help="with --live: the load generator's concurrency schedule")] = (
        reccheck.LIVE_SCHEDULE),
    min_samples: Annotated[int, typer.Option(min=2, help="requests per cohort before a bucket is evidence")] = 100,
) -> None:
    """Does the recommender, fed with sidecar telemetry, find the crossovers the sweep measured? Exit 1 if not."""
    from analysis.recommend import RecommendConfig

    def say(line: str) -> None:
        typer.echo(f"[{time.strftime('%H:%M:%S')}] {line}", err=True)

    try:
        if live:
            record_live(cells_file, say=say, schedule=schedule)
        sweep_data, cells = reccheck.load_json(sweep_file), reccheck.load_json(cells_file)
        result = reccheck.run_check(sweep_data, cells, RecommendConfig(min_samples=min_samples))
    except (OSError, ValueError, KeyError, RuntimeError, TimeoutError, ApiError) as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from exc
    text = reccheck.report(result, sweep_path=sweep_file, cells_path=cells_file, meta=cells)
    if report_file is not None:
        report_file.write_text(text)
    typer.echo(text)
    if not result.passed:
        raise typer.Exit(1)
