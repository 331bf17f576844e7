"""``specgate dashboard``: run the Streamlit dashboard against a control plane."""

from __future__ import annotations

import subprocess
from typing import Annotated

import typer

from dashboard import launch
from dashboard.settings import DashboardSettings


def dashboard(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8501,
    api_url: Annotated[str | None, typer.Option(
        "--api-url", help="the control plane (default: SPECGATE_DASHBOARD_API_URL, else http://127.0.0.1:8080)",
    )] = None,
) -> None:
    """Run the dashboard (Streamlit). Settings: SPECGATE_DASHBOARD_* (API URL, optional API key)."""
    url = api_url or DashboardSettings().api_url
    typer.echo(f"dashboard on http://{host}:{port} for the control plane at {url} (Ctrl-C stops it)")
    try:
        code = subprocess.call(launch.command(host=host, port=port), env=launch.environment(url))  # noqa: S603
    except KeyboardInterrupt:
        code = 0
    raise typer.Exit(code)
