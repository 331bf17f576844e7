"""Control-plane replicas as real processes on one database, and long-polls timed against them.

Shared by tests/controlplane/test_replicas.py (two replicas side by side)
and test_replicas_balanced.py (the same behind a load balancer).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import paths
from tests.support.live import free_port


@dataclass
class Replica:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_replica(name: str, database_url: str, signing_key: str, logs: Path,
                  env: Mapping[str, str] | None = None) -> Replica:
    """``uvicorn --factory controlplane.app:create_app`` on a free port, its output in ``logs/replica-NAME.log``."""
    port = free_port()
    environment = {**os.environ, "SPECGATE_DATABASE_URL": database_url, "SPECGATE_SIGNING_KEY": signing_key,
                   "PYTHONPATH": str(paths.ROOT), **(env or {})}
    log = logs / f"replica-{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "controlplane.app:create_app",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            cwd=paths.ROOT, env=environment, stdout=out, stderr=subprocess.STDOUT)
    return Replica(name, f"http://127.0.0.1:{port}", process, log)


def wait_ready(replica: Replica, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replica.process.poll() is not None:
            pytest.fail(f"replica at {replica.url} exited with {replica.process.returncode}:\n{replica.log_text()}")
        try:
            if httpx.get(f"{replica.url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"replica at {replica.url} was not ready in {timeout}s:\n{replica.log_text()}")


def metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of a metric on ``url``'s /metrics: exact name, and labels in the order the metric declares
    them; None when there is none."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == want:
            return float(value)
    return None


def long_poll_waiters(url: str) -> float:
    value = metric(url, "specgate_long_poll_waiters")
    if value is None:
        raise AssertionError("no specgate_long_poll_waiters metric")
    return value


class LongPoll:
    """GET /v1/bundle with If-None-Match and wait on a thread, timed.

    With ``parked`` (the default) the constructor returns once ``url`` shows one more waiting long-poll than
    before; behind a balancer, where the poll lands on a replica the test does not choose, the caller waits
    for the replicas' waiters itself.
    """

    def __init__(self, url: str, key: dict[str, str], worker_id: str, etag: str, wait: float, *,
                 parked: bool = True) -> None:
        self.result: dict[str, Any] = {}

        def run() -> None:
            try:
                with httpx.Client(timeout=wait + 10) as http:
                    response = http.get(f"{url}/v1/bundle", params={"worker": worker_id, "wait": wait},
                                        headers={**key, "If-None-Match": f'"{etag}"'})
                self.result["response"] = response
            except httpx.HTTPError as exc:
                self.result["error"] = exc
            self.result["done"] = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True)
        before = long_poll_waiters(url) if parked else 0.0
        self.thread.start()
        if parked:
            # Only a poll that is already waiting proves the wake-up came from the change, not a first answer.
            deadline = time.monotonic() + 10
            while long_poll_waiters(url) < before + 1:
                assert time.monotonic() < deadline, "the long-poll never started waiting"
                time.sleep(0.02)

    def finish(self, timeout: float = 30) -> tuple[httpx.Response, float]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the long-poll did not return"
        if "error" in self.result:
            raise AssertionError(f"the long-poll failed: {self.result['error']!r}")
        return self.result["response"], self.result["done"]


def register_worker(url: str, key: dict[str, str], worker_id: str, labels: dict[str, str],
                    pool: str = "pool-a") -> None:
    r = httpx.post(f"{url}/v1/workers/register", headers=key, timeout=10,
                   json={"id": worker_id, "pool": pool, "labels": labels, "engines": {}})
    assert r.status_code in (200, 201), r.text
