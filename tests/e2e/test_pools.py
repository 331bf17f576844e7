"""Replica pools on the testbed: real vLLM CPU engines (two plain replicas, base and base-2, and one speculative
replica, draft), the real control plane, and ``specgate sidecar --kind gateway`` processes in front of them.

The seed policy speculates on chat while the batch is at most 4. In a gateway that batch is the one on the
least-loaded speculative replica, so concurrent chat beyond 4 spills to the plain pool.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.replicas import replica_name
from tests.support.e2e import (
    VARIANTS,
    Answer,
    Ask,
    Fleet,
    Load,
    SidecarProcess,
    StackBuilder,
    prom_samples,
    prom_sum,
    wait_until,
)

pytestmark = pytest.mark.engines

POOL = (*VARIANTS, "base-2")
SUCCESS = "vllm:request_success_total"


def pool_engines(fleet: Fleet) -> dict[str, list[str]]:
    return {"draft": [fleet.urls["draft"]], "base": [fleet.urls["base"], fleet.urls["base-2"]]}


def names(fleet: Fleet) -> dict[str, str]:
    """Engine instance -> the replica name headers and telemetry use."""
    return {instance: replica_name(fleet.urls[instance]) for instance in POOL}


class MetricsWatch:
    """Polls gateways' /metrics while a load runs: the most requests each replica held at once."""

    def __init__(self, gateways: list[SidecarProcess]) -> None:
        self.gateways = gateways
        self.peak: Counter[str] = Counter()  # replica -> most in flight at once, summed over the gateways
        self.peak_each: Counter[tuple[str, str]] = Counter()  # (gateway, replica) -> the same per gateway
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                total: Counter[str] = Counter()
                for gateway in self.gateways:
                    try:
                        text = client.get(gateway.url + "/metrics").text
                    except httpx.HTTPError:
                        continue
                    for labels, value in prom_samples(text, "specgate_sidecar_replica_in_flight"):
                        total[labels["replica"]] += int(value)
                        key = (gateway.worker_id, labels["replica"])
                        self.peak_each[key] = max(self.peak_each[key], int(value))
                for replica, value in total.items():
                    self.peak[replica] = max(self.peak[replica], value)
                time.sleep(0.02)

    def __enter__(self) -> MetricsWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def gateways(build_stack: StackBuilder, fleet: Fleet, tmp_path: Path) -> Iterator[tuple[Any, list[SidecarProcess]]]:
    """A stack (control plane on SQLite, the seed policy) and two gateways, not started, in front of the pools."""
    fleet.require(POOL)
    stack = build_stack(f"sqlite:///{tmp_path / 'pools.db'}")
    made = [SidecarProcess(stack.cp, pool_engines(fleet), tmp_path, worker_id=f"gateway-{i}", kind="gateway",
                           log_name=f"gateway-{i}.log") for i in (1, 2)]
    try:
        yield stack, made
    finally:
        for gateway in made:
            log = gateway.stop() if gateway.proc is not None else ""
            if "Traceback" in log:
                print(f"\n{gateway.worker_id} logged a traceback:\n{log[-4000:]}")


def successes(fleet: Fleet) -> dict[str, float]:
    return {instance: prom_sum(fleet.metrics(instance), SUCCESS) for instance in POOL}


def assert_answered(answers: list[Answer]) -> None:
    assert [(a.request_id, a.status, a.error) for a in answers if not (a.ok and a.text)] == []


def test_load_spills_to_the_plain_pool_at_the_threshold_and_telemetry_names_each_replica(
        gateways: tuple[Any, list[SidecarProcess]], fleet: Fleet) -> None:
    stack, (gateway, _) = gateways
    gateway.start()
    replica = names(fleet)
    before = successes(fleet)
    with MetricsWatch([gateway]) as watch, Load(gateway.url, 8, lambda i: Ask("chat", i, max_tokens=32),
                                                per_worker=3, tag="spill") as load:
        answers = load.join()
    assert_answered(answers)
    served = Counter((a.decision["engine"], a.decision["replica"]) for a in answers)
    # Eight at once against a threshold of 4: the speculative replica never held more than 4 of them, and the
    # rest went to the plain pool, over both of its replicas.
    assert watch.peak[replica["draft"]] <= 4, watch.peak
    assert watch.peak[replica["draft"]] >= 2, watch.peak
    assert served[("draft", replica["draft"])] >= 3, served
    assert served[("base", replica["base"])] >= 1, served
    assert served[("base", replica["base-2"])] >= 1, served
    assert set(served) <= {("draft", replica["draft"]), ("base", replica["base"]), ("base", replica["base-2"])}

    rows = stack.rows_by_request(len(answers))
    for a in answers:
        row = rows[a.request_id]
        assert (row["decided_engine"], row["engine"], row["replica"], row["fallback"]) == (
            a.decision["engine"], a.decision["engine"], a.decision["replica"], False), a.request_id
        assert row["worker_id"] == gateway.worker_id
        if row["engine"] == "draft":
            assert row["batch_size"] <= 4, row
            assert row["spec_draft_tokens"], row  # the speculative replica's own numbers
    # Telemetry per replica matches the engines' own count of finished requests.
    after = successes(fleet)
    per_replica = Counter(row["replica"] for row in rows.values())
    assert {instance: per_replica[replica[instance]] for instance in POOL} == \
        {instance: round(after[instance] - before[instance]) for instance in POOL}
    # The control plane lists the gateway as one, with its replicas as its heartbeats report them.
    workers = httpx.get(stack.cp.base + "/v1/workers", params={"kind": "gateway"},
                        headers={"Authorization": f"Bearer {stack.cp.admin_token}"}, timeout=10).json()["items"]
    (listed,) = [w for w in workers if w["id"] == gateway.worker_id]
    assert listed["kind"] == "gateway"
    wait_until(lambda: _reported(stack, gateway.worker_id) == {(e, replica[i]) for e, i in
                                                              (("draft", "draft"), ("base", "base"),
                                                               ("base", "base-2"))}, 10, "replicas reported")
    print(f"\nspill-over: served {dict(served)}; peak in flight per replica {dict(watch.peak)}")


def _reported(stack: Any, worker_id: str) -> set[tuple[str, str]]:
    workers = httpx.get(stack.cp.base + "/v1/workers", params={"kind": "gateway"},
                        headers={"Authorization": f"Bearer {stack.cp.admin_token}"}, timeout=10).json()["items"]
    (worker,) = [w for w in workers if w["id"] == worker_id]
    return {(r["engine"], r["replica"]) for r in worker["replicas"] if r["state"] == "healthy"}


def test_a_plain_replica_killed_mid_load_loses_no_request_and_is_used_again_once_back(
        gateways: tuple[Any, list[SidecarProcess]], fleet: Fleet) -> None:
    stack, (gateway, _) = gateways
    gateway.start()
    replica = names(fleet)
    workers = 4
    # Non-streaming plain requests (classify goes to base by the seed policy's default): an answer is read
    # whole before the client gets a byte, so a replica that dies under a request leaves it retryable.
    with Load(gateway.url, workers, lambda i: Ask("classify", i, max_tokens=16), tag="kill") as load:
        load.wait_for(8)
        killed = fleet.kill("base-2")
        load.wait_for_sent_after(killed, 12)
        wait_until(lambda: prom_sum(gateway.metrics(), "specgate_sidecar_replica_healthy", engine="base",
                                    replica=replica["base-2"]) == 0, 30, "base-2 ejected")
        answers = load.stop()
    # Brought back (without load meanwhile: a vLLM CPU server starting beside a saturated one can take
    # minutes), the gateway's probe finds it, and new requests reach it again.
    fleet.up(["base-2"])
    back = time.time()
    wait_until(lambda: prom_sum(gateway.metrics(), "specgate_sidecar_replica_healthy", engine="base",
                                replica=replica["base-2"]) == 1, 60, "base-2 returned")
    with Load(gateway.url, workers, lambda i: Ask("classify", i, max_tokens=16), per_worker=4,
              tag="back") as again:
        answers += again.join()
    assert_answered(answers)  # none lost
    after_kill = [a for a in answers if killed < a.sent_at < back]
    assert after_kill
    assert {a.decision["replica"] for a in after_kill} == {replica["base"]}
    returned = Counter(a.decision["replica"] for a in answers if a.sent_at > back)
    assert returned[replica["base-2"]] >= 1, returned  # used again
    metrics = gateway.metrics()
    assert prom_sum(metrics, "specgate_sidecar_replica_ejections_total", replica=replica["base-2"]) == 1
    assert prom_sum(metrics, "specgate_sidecar_replica_returns_total", replica=replica["base-2"]) == 1
    rows = stack.rows_by_request(len(answers))
    retried = [row for row in rows.values() if row["retries"]]
    # a request that failed on the dying replica was retried on the other plain one: not a fallback
    assert all((row["engine"], row["replica"], row["fallback"]) == ("base", replica["base"], False)
               for row in retried), retried
    print(f"\nkill: {len(answers)} answered, {len(retried)} retried on the other replica, "
          f"after the return {dict(returned)}")


def test_two_gateways_in_front_of_the_same_pools_lose_nothing_and_stay_within_the_documented_error(
        gateways: tuple[Any, list[SidecarProcess]], fleet: Fleet) -> None:
    stack, pair = gateways
    for gateway in pair:
        gateway.start()
    replica = names(fleet)
    loads = [Load(gateway.url, 4, lambda i: Ask("chat", i, max_tokens=32), per_worker=3, tag=gateway.worker_id)
             for gateway in pair]
    with MetricsWatch(pair) as watch:
        for load in loads:
            load.__enter__()
        answers = [a for load in loads for a in load.join()]
    assert_answered(answers)
    # Each gateway keeps its own share within the threshold exactly; together they may exceed it by what the
    # other sent since its last scrape (docs/sidecar-request-path.md): at most 4 each.
    for gateway in pair:
        assert watch.peak_each[(gateway.worker_id, replica["draft"])] <= 4, watch.peak_each
    assert watch.peak[replica["draft"]] <= 8, watch.peak
    rows = stack.rows_by_request(len(answers))
    assert {row["worker_id"] for row in rows.values()} == {g.worker_id for g in pair}
    assert all(row["batch_size"] <= 4 for row in rows.values() if row["engine"] == "draft")
    print(f"\ntwo gateways: {len(answers)} answered; peak on the speculative replica {watch.peak[replica['draft']]} "
          f"(each: {[watch.peak_each[(g.worker_id, replica['draft'])] for g in pair]})")
