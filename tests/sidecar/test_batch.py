"""The batch-size rule in worker scope: in flight + what fresh scrapes of vllm:num_requests_running saw beyond our
own requests (sidecar/replicas.py)."""

from __future__ import annotations

import time

import httpx

from sidecar.replicas import InFlight, Pools, parse_engine_load, parse_running
from tests.support.fake_upstream import FakeEngine, closed_port
from tests.support.sidecars import LoopThread, SidecarFactory, wait_for

METRICS_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 3.0
vllm:num_requests_running{engine="1",model_name="a"} 2.0
vllm:num_requests_running_something_else 99
vllm:num_requests_waiting{model_name="a"} 40.0
"""


def test_parse_running_sums_label_sets_and_ignores_lookalikes() -> None:
    assert parse_running(METRICS_TEXT) == 5.0
    assert parse_running("vllm:num_requests_running 4\n") == 4.0
    assert parse_running("vllm:num_requests_waiting 4\n") is None
    assert parse_running("vllm:num_requests_running NaN\n") is None
    assert parse_running("") is None
    assert parse_engine_load(METRICS_TEXT) == (5.0, 40.0)
    assert parse_engine_load("vllm:num_requests_running 1\n") == (1.0, None)


class _Estimator:
    """Admission as the request path does it: count the request in, then the worker-scope batch."""

    def __init__(self, inflight: InFlight, pools: Pools | None) -> None:
        self.inflight = inflight
        self.pools = pools

    def admit(self) -> int:
        count = self.inflight.admit()
        return count if self.pools is None else self.pools.worker_batch(count, time.monotonic())

    def release(self) -> None:
        self.inflight.release()


def test_in_flight_counts_this_request_and_releases() -> None:
    estimator = _Estimator(InFlight(), None)
    assert [estimator.admit() for _ in range(3)] == [1, 2, 3]
    estimator.release()
    estimator.release()
    assert estimator.admit() == 2
    assert estimator.inflight.count == 2


def test_fresh_scrape_adds_traffic_that_bypasses_the_sidecar_and_stale_one_does_not() -> None:
    inflight = InFlight()
    scraper = Pools({"draft": ["http://a"], "base": ["http://b/"], "alias": ["http://b"]}, inflight=inflight)
    assert set(scraper.replicas) == {"http://a", "http://b"}  # two names for one server: scraped once
    assert scraper.pools["alias"] == scraper.pools["base"]
    estimator = _Estimator(inflight, scraper)
    now = time.monotonic()
    scraper.scraped = {"http://a": (2.0, now), "http://b": (4.0, now)}  # none of it ours (own_at_scrape 0)
    scraper._recompute()
    assert scraper.total == 6
    assert estimator.admit() == 7  # 6 running elsewhere + this one
    # our own requests add to what bypasses us
    assert [estimator.admit() for _ in range(3)] == [8, 9, 10]
    for _ in range(4):
        estimator.release()
    # one engine's scrape went stale: only the fresh one counts
    scraper.scraped = {"http://a": (2.0, now - 10), "http://b": (4.0, now)}
    scraper._recompute()
    assert estimator.admit() == 5
    estimator.release()
    scraper.scraped = {"http://a": (2.0, now - 10)}
    scraper._recompute()
    assert estimator.admit() == 1


def test_our_own_requests_in_a_scrape_are_not_counted_twice() -> None:
    inflight = InFlight()
    scraper = Pools({"draft": ["http://a"], "base": ["http://b"]}, inflight=inflight)
    estimator = _Estimator(inflight, scraper)
    now = time.monotonic()
    # The scrape answered while 3 of our requests ran; the engines ran 5: 2 came from elsewhere.
    scraper.scraped = {"http://a": (3.0, now), "http://b": (2.0, now)}
    scraper.own_at_scrape = 3
    scraper._recompute()
    assert scraper.total == 2
    assert estimator.admit() == 3  # our 1 (the 3 have finished since) + the 2 from elsewhere
    estimator.release()
    # All the engines ran was ours, and it has finished: a lone request is a batch of one, not of
    # (what the stale scrape saw) + 1.
    scraper.own_at_scrape = 5
    scraper._recompute()
    assert scraper.total == 0
    assert estimator.admit() == 1
    estimator.release()
    # a scrape that saw fewer than our own (requests between sidecar and engine) never goes negative
    scraper.own_at_scrape = 9
    scraper._recompute()
    assert scraper.total == 0


def test_scraper_reads_engines_and_drops_failing_ones(loop_thread: LoopThread, draft: FakeEngine,
                                                      base: FakeEngine) -> None:
    draft.running = 3
    base.running = 2
    gone = f"http://127.0.0.1:{closed_port()}"
    scraper = Pools({"draft": [draft.url], "base": [base.url], "gone": [gone]}, inflight=InFlight(), interval_s=60.0)

    async def scrape() -> None:
        try:
            await scraper.scrape_once()
        finally:
            await scraper.stop()

    loop_thread.run(scrape())
    assert {url: value for url, (value, _at) in scraper.scraped.items()} == {draft.url: 3.0, base.url: 2.0}
    assert scraper.total == 5
    assert scraper.scrape_failures == 1
    # a replica that cannot be reached counts a failure towards its ejection; the others are fine
    assert scraper.replicas[gone].failures == 1
    assert scraper.replicas[draft.url].failures == 0


def test_busy_engines_send_a_lone_chat_request_to_base(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                        base: FakeEngine) -> None:
    base.running = 5  # e.g. traffic that bypasses the sidecar
    sidecar = make_sidecar(engine_metrics_s=0.05)
    wait_for(lambda: sidecar.app.pools.total == 5)
    response = httpx.post(sidecar.url + "/v1/chat/completions", headers={"X-Specgate-Route": "chat"},
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    assert response.headers["x-specgate-decision"].startswith("engine=base; rule=default;")
    event = sidecar.exporter.one()
    assert event.batch_size == 6
    assert event.engine == "base"
    assert len(base.requests) == 1
    assert not draft.requests
    # the load goes away: the next scrape lets speculation back in
    base.running = 0
    wait_for(lambda: sidecar.app.pools.total == 0 and sidecar.app.pools.scrapes > 0)
    response = httpx.post(sidecar.url + "/v1/chat/completions", headers={"X-Specgate-Route": "chat"},
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert response.headers["x-specgate-decision"].startswith("engine=draft;")


def test_one_request_at_a_time_is_a_batch_of_one_while_scrapes_see_our_own(make_sidecar: SidecarFactory,
                                                                            draft: FakeEngine) -> None:
    # Scrapes every 100 ms land while our own request runs (300 ms before its first byte), so the last
    # scrape before the next admission nearly always saw a request of ours that has finished since. The
    # first rule, max(in_flight, running + 1), made such a next request a batch of 2.
    draft.first_byte_delay = 0.3
    sidecar = make_sidecar(engine_metrics_s=0.1)
    with httpx.Client(timeout=10) as client:  # keep-alive: the next request follows at once
        for _ in range(6):
            response = client.post(sidecar.url + "/v1/chat/completions", headers={"X-Specgate-Route": "chat"},
                                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 200
    assert draft.metrics_scrapes >= 6
    events = sidecar.exporter.wait(6)
    assert [e.batch_size for e in events] == [1] * 6
    assert {e.engine for e in events} == {"draft"}
