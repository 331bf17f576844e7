"""How busy the worker is: in-flight requests and the engines' own running counts.

The batch-size rule (what ``RequestShape.batch_size`` is):

    batch_size = in_flight + max(0, engines_running - in_flight_at_scrape)

* ``in_flight`` — requests admitted by this sidecar and not yet finished,
  counting the one being admitted (so a lone request has batch size 1). It is
  exact and instant, but blind to traffic that reaches the engines without
  passing through the sidecar.
* ``engines_running`` — the sum of ``vllm:num_requests_running`` (over all its
  label sets) scraped from ``GET /metrics`` of each distinct engine URL of this
  worker, every ``engine_metrics_s`` seconds. The engines share the worker's
  accelerator, so their running requests add up. An engine whose last scrape
  failed, or is older than ``max(3 * engine_metrics_s, 1 s)``, adds 0.
* ``in_flight_at_scrape`` — this sidecar's own in-flight count when the scrape
  answered: the part of ``engines_running`` that is this sidecar's own traffic.
  What is left is traffic that bypasses the sidecar, assumed steady until the
  next scrape, and added to the exact in-flight count.

Why not ``max(in_flight, engines_running + 1)``, the first rule: a scrape is up
to one interval old, and the requests it saw running are mostly this sidecar's
own, finished since. At concurrency 1 nearly every scrape lands on the one
request in flight, so each next request got batch size 2 (recorded with real
vLLM engines: at loadgen concurrency c the telemetry's buckets sat one bucket
above c), and a threshold learnt from such telemetry would be off by a bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

import aiohttp

RUNNING_METRIC = "vllm:num_requests_running"


class InFlight:
    """Requests admitted and not yet finished on this worker (single event loop, no lock)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def admit(self) -> int:
        self.count += 1
        return self.count

    def release(self) -> None:
        self.count -= 1


def parse_running(text: str) -> float | None:
    """The sum of every ``vllm:num_requests_running`` sample in Prometheus text, or None if absent."""
    total: float | None = None
    for line in text.splitlines():
        if not line.startswith(RUNNING_METRIC):
            continue
        rest = line[len(RUNNING_METRIC):]
        if rest and rest[0] not in "{ \t":
            continue  # another metric with this prefix
        if rest.startswith("{"):
            end = rest.rfind("}")
            if end < 0:
                continue
            rest = rest[end + 1:]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if value == value and value >= 0:  # not NaN
            total = value + (total or 0.0)
    return total


class EngineScraper:
    """Scrapes each engine's running-request count in the background."""

    def __init__(self, engines: Mapping[str, str], interval_s: float, *, timeout_s: float | None = None,
                 inflight: InFlight | None = None) -> None:
        # several engine names may point at one server: scrape (and count) it once
        self.urls: dict[str, str] = {}
        for name, base in engines.items():
            self.urls.setdefault(base.rstrip("/"), name)
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else min(max(interval_s, 0.2), 2.0)
        self.stale_after_s = max(3 * interval_s, 1.0)
        # engine name -> (running, monotonic time of the scrape)
        self.running: dict[str, tuple[float, float]] = {}
        self.scrapes = 0
        self.failures = 0
        self.inflight = inflight
        self.own_at_scrape = 0  # this sidecar's in-flight count when the last round of scrapes answered
        # the hot path reads only these two: the fresh running total that is not this sidecar's own
        # traffic, and until when it stays fresh
        self.total = 0
        self.fresh_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def engines_running(self, now: float | None = None) -> int:
        """The fresh running total less this sidecar's own requests at the scrape (0 when none is fresh)."""
        if (time.monotonic() if now is None else now) < self.fresh_until:
            return self.total
        return 0

    def _recompute(self) -> None:
        now = time.monotonic()
        fresh = [(value, at) for value, at in self.running.values() if now - at < self.stale_after_s]
        self.total = max(0, int(sum(value for value, _ in fresh)) - self.own_at_scrape)
        self.fresh_until = min(at for _, at in fresh) + self.stale_after_s if fresh else 0.0

    async def scrape_once(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), trust_env=False)
        own_before = self.inflight.count if self.inflight is not None else 0
        await asyncio.gather(*(self._scrape(base, name) for base, name in self.urls.items()))
        # The engines counted our requests at some moment between these two samples; the larger one
        # errs towards counting less traffic from elsewhere, never towards our own finished requests.
        self.own_at_scrape = max(own_before, self.inflight.count if self.inflight is not None else 0)
        self.scrapes += 1
        self._recompute()

    async def _scrape(self, base: str, name: str) -> None:
        assert self._session is not None
        try:
            async with self._session.get(base + "/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, ValueError):
            text = ""
        value = parse_running(text) if text else None
        if value is None:
            self.failures += 1
            self.running.pop(name, None)
        else:
            self.running[name] = (value, time.monotonic())

    async def _run(self) -> None:
        while True:
            # never let one bad scrape end the loop
            with contextlib.suppress(Exception):
                await self.scrape_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None and self.urls:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="specgate-engine-scraper")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        session, self._session = self._session, None
        if session is not None:
            await session.close()


class BatchEstimator:
    """Admission: counts the request in and returns its batch size (the module's rule)."""

    __slots__ = ("inflight", "scraper")

    def __init__(self, inflight: InFlight, scraper: EngineScraper | None) -> None:
        self.inflight = inflight
        self.scraper = scraper

    def admit(self) -> int:
        count = self.inflight.admit()
        scraper = self.scraper
        if scraper is not None and scraper.total and time.monotonic() < scraper.fresh_until:
            return count + scraper.total
        return count

    def release(self) -> None:
        self.inflight.release()
