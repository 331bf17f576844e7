"""Two real control-plane processes on one PostgreSQL wake each other's long-polls.

PostgreSQL only: the embedded SQLite setup runs one process, and has no
cross-process notification (a documented limitation), so there is nothing to
test there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controlplane.rollout.service import canary_salt, fleet_cohort_secret
from controlplane.settings import ControlPlaneSettings
from policies import BundleVerifier, SigningKey
from tests.support.factories import seed_policy, seed_text
from tests.support.fleet_rows import add_rollout, session_for, set_kill_switch
from tests.support.replicas import LongPoll, Replica, register_worker, start_replica, wait_ready

pytestmark = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)


@pytest.fixture
def replicas(migrated_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    key = SigningKey.generate().private_key_b64()
    started: list[Replica] = []
    try:
        for name in ("a", "b"):
            started.append(start_replica(name, migrated_url, key, tmp_path))
        for replica in started:
            wait_ready(replica)
        yield started[0].url, started[1].url
    finally:
        for replica in started:
            replica.process.terminate()
        for replica in started:
            replica.stop()


def test_kill_switch_flipped_on_one_replica_wakes_a_long_poll_on_the_other(
        replicas: tuple[str, str], settings: ControlPlaneSettings, worker_key: dict[str, str],
        operator: dict[str, str]) -> None:
    a, b = replicas
    seed_policy(settings.database_url)
    register_worker(a, worker_key, "w1", {})
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
    register_worker(a, worker_key, "w1", {"canary": "no"})
    first = httpx.get(f"{a}/v1/bundle", params={"worker": "w1"}, headers=worker_key, timeout=10).json()
    assert first["payload"]["canary"] is None

    poll = LongPoll(a, worker_key, "w1", first["etag"], wait=10)
    changed = time.monotonic()
    register_worker(b, worker_key, "w1", {"canary": "yes"})
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
    register_worker(a, worker_key, "w1", {})
    etag = httpx.get(f"{a}/v1/bundle", params={"worker": "w1"}, headers=worker_key, timeout=10).json()["etag"]
    start = time.monotonic()
    response, done = LongPoll(a, worker_key, "w1", etag, wait=1).finish()
    assert response.status_code == 304
    assert 0.9 <= done - start < 4
