"""Two real control-plane processes on one PostgreSQL wake each other's long-polls.

PostgreSQL only: the embedded SQLite setup runs one process, and has no
cross-process notification (a documented limitation), so there is nothing to
test there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.rollout.service import canary_salt, fleet_cohort_secret
from controlplane.settings import ControlPlaneSettings
from policies import BundleVerifier, SigningKey
from tests.support import paths
from tests.support.factories import seed_policy, seed_text
from tests.support.fleet_rows import add_rollout, session_for, set_kill_switch
from tests.support.live import free_port

ROOT = paths.ROOT

pytestmark = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)


def _start(name: str, database_url: str, signing_key: str,
           logs: Path) -> tuple[str, subprocess.Popen[bytes], Path]:
    port = free_port()
    env = {**os.environ, "SPECGATE_DATABASE_URL": database_url, "SPECGATE_SIGNING_KEY": signing_key,
           "PYTHONPATH": str(ROOT)}
    log = logs / f"replica-{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "controlplane.app:create_app",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}", process, log


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"replica at {url} exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"replica at {url} was not ready in {timeout}s:\n{log.read_text()}")


@pytest.fixture
def replicas(migrated_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    key = SigningKey.generate().private_key_b64()
    started: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for name in ("a", "b"):
            started.append(_start(name, migrated_url, key, tmp_path))
        for url, process, log in started:
            _wait_ready(url, process, log)
        yield started[0][0], started[1][0]
    finally:
        for _, process, _ in started:
            process.terminate()
        for _, process, _ in started:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _waiters(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("specgate_long_poll_waiters "):
            return float(line.split()[1])
    raise AssertionError("no specgate_long_poll_waiters metric")


class LongPoll:
    """GET /v1/bundle with If-None-Match and wait on a thread, timed."""

    def __init__(self, url: str, key: dict[str, str], worker_id: str, etag: str, wait: float) -> None:
        self.result: dict[str, Any] = {}

        def run() -> None:
            with httpx.Client(timeout=wait + 10) as http:
                response = http.get(f"{url}/v1/bundle", params={"worker": worker_id, "wait": wait},
                                    headers={**key, "If-None-Match": f'"{etag}"'})
            self.result["done"] = time.monotonic()
            self.result["response"] = response

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        # Only a poll that is already waiting proves the wake-up came from the other replica.
        deadline = time.monotonic() + 10
        while _waiters(url) < 1:
            assert time.monotonic() < deadline, "the long-poll never started waiting"
            time.sleep(0.02)

    def finish(self) -> tuple[httpx.Response, float]:
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self.result["response"], self.result["done"]


def _register(url: str, key: dict[str, str], worker_id: str, labels: dict[str, str]) -> None:
    r = httpx.post(f"{url}/v1/workers/register", headers=key, timeout=10,
                   json={"id": worker_id, "pool": "pool-a", "labels": labels, "engines": {}})
    assert r.status_code in (200, 201), r.text


def test_kill_switch_flipped_on_one_replica_wakes_a_long_poll_on_the_other(
        replicas: tuple[str, str], settings: ControlPlaneSettings, worker_key: dict[str, str],
        operator: dict[str, str]) -> None:
    a, b = replicas
    seed_policy(settings.database_url)
    _register(a, worker_key, "w1", {})
    first = httpx.get(f"{a}/v1/bundle", params={"worker": "w1"}, headers=worker_key, timeout=10).json()
    # Replicas sharing the key serve the identical signed bundle.
    assert httpx.get(f"{b}/v1/bundle", params={"worker": "w1"}, headers=worker_key, timeout=10).json() == first

    poll = LongPoll(a, worker_key, "w1", first["etag"], wait=10)
    changed = time.monotonic()
    flip = httpx.put(f"{b}/v1/killswitch", json={"enabled": True, "reason": "replica test"}, headers=operator,
                     timeout=10)
    via = "PUT /v1/killswitch on B"
    if flip.status_code in (404, 405):
        # Without the kill-switch API, change the row as it would; bump_generation sends the NOTIFY.
        set_kill_switch(settings.database_url, True)
        via = "a direct database change"
    else:
        assert flip.status_code == 200, flip.text
    response, done = poll.finish()
    assert response.status_code == 200, response.text
    envelope = response.json()
    assert envelope["etag"] != first["etag"]
    public_key = httpx.get(f"{a}/v1/bundle/public-key", timeout=10).json()["public_key"]
    assert BundleVerifier([public_key]).verify(envelope).kill_switch is True
    print(f"cross-replica long-poll woke {(done - changed) * 1000:.0f} ms after {via}")
    assert done - changed < 3


def test_a_worker_relabelled_through_one_replica_gets_its_canary_on_the_other(
        replicas: tuple[str, str], settings: ControlPlaneSettings, worker_key: dict[str, str]) -> None:
    a, b = replicas
    policy_id, (_, draft) = seed_policy(settings.database_url, extra_revisions=(seed_text(threshold=6),))
    rollout_id, _ = add_rollout(settings.database_url, policy_id, draft, mode="traffic", percent=20,
                                target_labels={"canary": "yes"})
    _register(a, worker_key, "w1", {"canary": "no"})
    first = httpx.get(f"{a}/v1/bundle", params={"worker": "w1"}, headers=worker_key, timeout=10).json()
    assert first["payload"]["canary"] is None

    poll = LongPoll(a, worker_key, "w1", first["etag"], wait=10)
    changed = time.monotonic()
    _register(b, worker_key, "w1", {"canary": "yes"})
    response, done = poll.finish()
    assert response.status_code == 200, response.text
    canary = response.json()["payload"]["canary"]
    assert canary["revision"] == draft
    with session_for(settings.database_url) as session:
        assert canary["salt"] == canary_salt(rollout_id, cohort_secret=fleet_cohort_secret(session))
    assert done - changed < 3


def test_a_long_poll_with_no_change_anywhere_ends_with_304(
        replicas: tuple[str, str], settings: ControlPlaneSettings, worker_key: dict[str, str]) -> None:
    a, _ = replicas
    seed_policy(settings.database_url)
    _register(a, worker_key, "w1", {})
    etag = httpx.get(f"{a}/v1/bundle", params={"worker": "w1"}, headers=worker_key, timeout=10).json()["etag"]
    start = time.monotonic()
    response, done = LongPoll(a, worker_key, "w1", etag, wait=1).finish()
    assert response.status_code == 304
    assert 0.9 <= done - start < 4
