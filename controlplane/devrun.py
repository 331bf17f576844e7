"""``specgate up``: the whole product on one machine, on embedded defaults.

What ``make run`` calls: the control plane and the dashboard. Later parts (sidecar, engines) join here.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import typer
import uvicorn

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.auth.service import create_key
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.migrations_state import upgrade
from controlplane.settings import ControlPlaneSettings

EXAMPLES = Path(__file__).resolve().parent.parent / "policies" / "examples"
# (file, pool): the seed policy serves every pool without a policy of its own.
EXAMPLE_POLICIES = (("seed.yaml", None), ("multi-route.yaml", "fleet"), ("conservative.yaml", "batch"))


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _load_examples(base_url: str, token: str) -> list[str]:
    loaded = []
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        for filename, pool in EXAMPLE_POLICIES:
            text = (EXAMPLES / filename).read_text()
            import yaml

            name = yaml.safe_load(text)["name"]
            found = client.get(f"/v1/policies/{name}")
            if found.status_code == 404:
                client.post("/v1/policies", json={"name": name, "pool": pool}).raise_for_status()
                response = client.post(f"/v1/policies/{name}/revisions", content=text.encode(),
                                       headers={"Content-Type": "application/yaml"},
                                       params={"message": f"example {filename}"})
                response.raise_for_status()
            loaded.append(f"{name} (pool {pool or 'any'})")
    return loaded


def _start_dashboard(host: str, port: int, api_url: str, token: str) -> tuple[subprocess.Popen[bytes] | None, str]:
    """The dashboard beside the control plane, signed in with the admin key; (process, banner line)."""
    if port == 0:
        return None, "off (--dashboard-port 0)"
    if importlib.util.find_spec("streamlit") is None:
        return None, "not installed (pip install streamlit)"
    if not _port_free(host, port):
        return None, f"not started: {host}:{port} is in use (pass --dashboard-port)"
    from dashboard import launch

    process = launch.start(host=host, port=port, api_url=api_url, api_key=token)
    return process, f"http://{host}:{port}  (signed in with the admin key)"


def up(data_dir: Path = typer.Option(Path(".specgate"), help="where the SQLite database lives"),
       host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8080),
       dashboard_port: int = typer.Option(8501, help="port of the dashboard; 0 does not start it")) -> None:
    """Bring the control plane up on SQLite with the example policies loaded, and the dashboard."""
    data_dir.mkdir(parents=True, exist_ok=True)
    url = os.environ.get("SPECGATE_DATABASE_URL") or f"sqlite:///{(data_dir / 'specgate.db').resolve()}"
    settings = ControlPlaneSettings(database_url=url)
    if not _port_free(host, port):
        typer.secho(f"error: {host}:{port} is in use; pass --port", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    upgrade(url)
    engine = make_engine(url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            _, token = create_key(session, name=f"make-run-{int(time.time())}", scope=Scope.admin,
                                  created_by="cli:make-run")
    finally:
        engine.dispose()

    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="control-plane", daemon=True)
    thread.start()
    base = f"http://{host}:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        typer.secho("error: the control plane did not become ready in 30 s", err=True, fg=typer.colors.RED)
        server.should_exit = True
        raise typer.Exit(1)
    loaded = _load_examples(base, token)
    dashboard, dashboard_line = _start_dashboard(host, dashboard_port, base, token)
    typer.echo(
        "\nspecgate is up\n"
        f"  control plane   {base}\n"
        f"  API docs        {base}/docs\n"
        f"  dashboard       {dashboard_line}\n"
        f"  database        {url}\n"
        f"  policies        {', '.join(loaded)}\n"
        f"  admin key       {token}\n\n"
        f"  try: SPECGATE_URL={base} SPECGATE_KEY={token} .venv/bin/specgate workers\n"
        "Ctrl-C stops everything this command started.\n"
    )
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        typer.echo("stopping...")
    finally:
        if dashboard is not None:
            dashboard.terminate()
            try:
                dashboard.wait(5)
            except subprocess.TimeoutExpired:
                dashboard.kill()
        server.should_exit = True
        thread.join(10)
