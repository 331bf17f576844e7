"""One autopilot leader across control-plane processes sharing a database; a killed leader is replaced."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controlplane.migrations_state import upgrade
from tests.support.e2e import ControlPlaneProcess, wait_until
from tests.support.factories import empty_postgres_schema, seed_policy

INTERVAL_S = 0.5
SETTING = {"enabled": True, "hold_s": 60, "min_samples": 40}


def _process(url: str, directory: Path) -> ControlPlaneProcess:
    cp = ControlPlaneProcess(url, directory)
    cp.env["SPECGATE_AUTOPILOT_INTERVAL_S"] = str(INTERVAL_S)
    return cp


def _state(cp: ControlPlaneProcess) -> dict[str, object]:
    response = httpx.get(f"{cp.base}/v1/policies/seed/autopilot", headers={"Authorization": f"Bearer {cp.admin_token}"},
                         timeout=5)
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    return body


@pytest.fixture
def two_processes(postgres_database: str, tmp_path: Path) -> Iterator[tuple[ControlPlaneProcess, ControlPlaneProcess]]:
    url = empty_postgres_schema(postgres_database)
    upgrade(url)
    seed_policy(url)
    first, second = _process(url, tmp_path / "a"), _process(url, tmp_path / "b")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        first.start()
        second.start()
        yield first, second
    finally:
        for cp in (first, second):
            if cp.proc is not None and cp.proc.poll() is None:
                cp.proc.kill()
                cp.proc.wait(10)


def test_one_leader_on_postgresql_and_a_killed_leader_is_replaced_within_a_bound(
        two_processes: tuple[ControlPlaneProcess, ControlPlaneProcess]) -> None:
    first, second = two_processes
    put = httpx.put(f"{first.base}/v1/policies/seed/autopilot", json=SETTING,
                    headers={"Authorization": f"Bearer {first.admin_token}"}, timeout=5)
    assert put.status_code == 200, put.text

    def one_leader() -> bool:
        return [_state(first)["leader"], _state(second)["leader"]].count(True) == 1

    wait_until(one_leader, 15, "exactly one autopilot leader")
    # It stays one: looked at over several rounds, never two leaders and never none.
    for _ in range(6):
        assert one_leader()
        time.sleep(INTERVAL_S)
    leader, follower = (first, second) if _state(first)["leader"] else (second, first)
    looked = _state(follower)["last_look_at"]
    assert looked is not None  # the leader has looked at the enabled autopilot
    assert leader.proc is not None
    leader.proc.kill()  # no graceful stop: the lock goes with the leader's database connection
    leader.proc.wait(10)
    killed_at = time.monotonic()
    wait_until(lambda: _state(follower)["leader"] is True, 10, "the follower takes over")
    took_over_s = time.monotonic() - killed_at
    assert took_over_s < 10
    wait_until(lambda: _state(follower)["last_look_at"] != looked, 10, "the new leader looks")


def test_the_only_process_on_sqlite_leads(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'specgate.db'}"
    upgrade(url)
    seed_policy(url)
    cp = _process(url, tmp_path)
    try:
        cp.start()
        wait_until(lambda: _state(cp)["leader"] is True, 10, "the process leads")
    finally:
        cp.stop()
