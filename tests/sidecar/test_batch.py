"""The batch-size rule: max(in flight, scraped vllm:num_requests_running + 1), fresh scrapes only."""

from __future__ import annotations

import time

import httpx

from sidecar.batch import BatchEstimator, EngineScraper, InFlight, parse_running
from tests.sidecar.conftest import LoopThread, SidecarFactory, wait_for
from tests.sidecar.fake_upstream import FakeEngine, closed_port

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


def test_in_flight_counts_this_request_and_releases() -> None:
    estimator = BatchEstimator(InFlight(), None)
    assert [estimator.admit() for _ in range(3)] == [1, 2, 3]
    estimator.release()
    estimator.release()
    assert estimator.admit() == 2
    assert estimator.inflight.count == 2


def test_fresh_scrape_raises_the_batch_size_and_stale_one_does_not() -> None:
    scraper = EngineScraper({"draft": "http://a", "base": "http://b/", "alias": "http://b"}, 0.5)
    assert set(scraper.urls) == {"http://a", "http://b"}  # two names for one server: scraped once
    estimator = BatchEstimator(InFlight(), scraper)
    now = time.monotonic()
    scraper.running = {"draft": (2.0, now), "base": (4.0, now)}
    scraper._recompute()
    assert scraper.engines_running() == 6
    assert estimator.admit() == 7  # 6 running + this one
    estimator.release()
    # in flight wins when it sees more
    for _ in range(9):
        estimator.admit()
    assert estimator.admit() == 10
    for _ in range(10):
        estimator.release()
    # one engine's scrape went stale: only the fresh one counts
    scraper.running = {"draft": (2.0, now - 10), "base": (4.0, now)}
    scraper._recompute()
    assert estimator.admit() == 5
    estimator.release()
    scraper.running = {"draft": (2.0, now - 10)}
    scraper._recompute()
    assert estimator.admit() == 1


def test_scraper_reads_engines_and_drops_failing_ones(loop_thread: LoopThread, draft: FakeEngine,
                                                      base: FakeEngine) -> None:
    draft.running = 3
    base.running = 2
    scraper = EngineScraper({"draft": draft.url, "base": base.url, "gone": f"http://127.0.0.1:{closed_port()}"},
                            60.0)

    async def scrape() -> None:
        try:
            await scraper.scrape_once()
        finally:
            await scraper.stop()

    loop_thread.run(scrape())
    assert {name: value for name, (value, _at) in scraper.running.items()} == {"draft": 3.0, "base": 2.0}
    assert scraper.engines_running() == 5
    assert scraper.failures == 1


def test_busy_engines_send_a_lone_chat_request_to_base(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                        base: FakeEngine) -> None:
    base.running = 5  # e.g. traffic that bypasses the sidecar
    sidecar = make_sidecar(engine_metrics_s=0.05)
    wait_for(lambda: sidecar.app.scraper is not None and sidecar.app.scraper.engines_running() == 5)
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
    wait_for(lambda: sidecar.app.scraper is not None and sidecar.app.scraper.engines_running() == 0)
    response = httpx.post(sidecar.url + "/v1/chat/completions", headers={"X-Specgate-Route": "chat"},
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert response.headers["x-specgate-decision"].startswith("engine=draft;")
