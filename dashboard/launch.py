"""Starting the dashboard as its own process (``specgate dashboard``, ``specgate up``, the browser tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

APP = Path(__file__).resolve().parent / "app.py"


def command(*, host: str = "127.0.0.1", port: int = 8501) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(APP),
            "--server.headless=true", f"--server.address={host}", f"--server.port={port}",
            "--browser.gatherUsageStats=false", "--server.fileWatcherType=none",
            "--client.toolbarMode=minimal", "--theme.base=light"]


def environment(api_url: str | None = None, api_key: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if api_url:
        env["SPECGATE_DASHBOARD_API_URL"] = api_url
    if api_key:
        env["SPECGATE_DASHBOARD_API_KEY"] = api_key
    return env


def start(*, host: str = "127.0.0.1", port: int = 8501, api_url: str | None = None,
          api_key: str | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    """The dashboard in a process of its own; its output goes to ``log`` (else nowhere)."""
    cmd, env = command(host=host, port=port), environment(api_url, api_key)
    if log is None:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # noqa: S603
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)  # noqa: S603


def wait_ready(url: str, process: subprocess.Popen[bytes] | None = None, timeout_s: float = 60.0) -> bool:
    """Whether the dashboard at ``url`` answered its health check within the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/_stcore/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False
