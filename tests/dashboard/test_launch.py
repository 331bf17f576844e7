"""`specgate up` starts the dashboard beside the control plane, signed in, and stops it on Ctrl-C."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.cli import line_queue, specgate_command
from tests.support.live import ctrl_c_as_at_a_terminal, free_port


def test_up_starts_the_dashboard_and_stops_it(tmp_path: Path) -> None:
    port, dashboard_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([*specgate_command(), "up", "--no-engines", "--data-dir", str(tmp_path / "data"),
                             "--port", str(port), "--dashboard-port", str(dashboard_port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=ctrl_c_as_at_a_terminal)
    assert proc.stdout is not None
    try:
        out = line_queue(proc.stdout)
        banner = ""
        deadline = time.monotonic() + 90
        while "admin key" not in banner:
            assert proc.poll() is None, f"specgate up exited early ({proc.returncode})"
            assert time.monotonic() < deadline, banner
            try:
                banner += out.get(timeout=0.5)
            except queue.Empty:
                continue
        line = re.search(r"dashboard +(\S+)", banner)
        assert line, banner
        assert line.group(1) == f"http://127.0.0.1:{dashboard_port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{line.group(1)}/_stcore/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the dashboard did not answer"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        assert proc.returncode == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{line.group(1)}/_stcore/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
