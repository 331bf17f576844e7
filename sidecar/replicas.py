"""Engines as pools of replicas: how busy each replica is, which one serves a request, which are ejected.

An engine name maps to one or more replica URLs (``SidecarSettings.engines``).
Several engine names may name one server: it is one replica, counted once.

The batch a rule sees (``RequestShape.batch_size`` / ``engine_batch``) is the
batch the request would join, and what shares it depends on the hardware:

* ``worker`` scope (a worker beside its engines, which share its accelerator:
  twin engines; the rule before replica pools, unchanged)::

      batch = in_flight + max(0, engines_running - in_flight_at_scrape)

  ``in_flight``: requests admitted by this sidecar and not finished, this one
  included (exact, instant, blind to traffic that bypasses the sidecar);
  ``engines_running``: the sum of ``vllm:num_requests_running`` scraped from
  each distinct replica every ``engine_metrics_s`` (a replica whose last scrape
  failed or is older than ``max(3 * engine_metrics_s, 1 s)`` adds 0);
  ``in_flight_at_scrape``: this sidecar's in-flight count when the scrapes
  answered, the part of ``engines_running`` that is its own traffic. Every
  engine sees this one number (``engine_batch`` is None).

* ``replica`` scope (a gateway in front of replicas with accelerators of their
  own): each replica's batch is the same rule over that replica alone, and an
  engine's batch is that of the replica the request would join: the
  least-loaded healthy one, or the one ``X-Specgate-Affinity`` sticks to. So
  ``speculate when batch_size <= 4`` means "if a speculative replica has room";
  otherwise the rule does not match and the load spills to later rules (the
  plain pool). Several gateways in front of one pool see each other's requests
  only through the scrapes, up to one interval late; between two scrapes a
  gateway counts its own new requests exactly and the others' as they were.

Why not ``max(in_flight, engines_running + 1)``, the first rule: a scrape is up
to one interval old, and the requests it saw running are mostly this sidecar's
own, finished since. At concurrency 1 nearly every scrape lands on the one
request in flight, so each next request got batch size 2 (recorded with real
vLLM engines: at loadgen concurrency c the telemetry's buckets sat one bucket
above c), and a threshold learnt from such telemetry would be off by a bucket.

Choosing a replica of an engine: among the healthy ones, the one with the
least load (its requests through this sidecar plus those the scrape saw from
elsewhere), ties broken at random. With an affinity key the replica that
rendezvous hashing gives the key (stable across gateways and across the
ejection of other replicas) is kept unless its load exceeds the least-loaded
one's by more than ``affinity_slack``, or it is full. A replica is *full* when
``max_queue`` is set and its estimated queue (``vllm:num_requests_waiting`` at
the scrape, plus this sidecar's requests to it since, less those finished)
exceeds it.

Ejection: a replica that fails ``eject_after`` times in a row is ejected: a
request whose connection is refused, times out or breaks, or that is answered
502, 503 or 504 (a 500 may be the request's own doing: counting it would let
any client eject a pool), or a scrape that cannot connect. Only a request
answered below 500 resets the count; a scrape that answers does not (a vLLM
whose engine core died still serves ``/metrics``). An ejected replica is
probed on ``GET /health`` after ``probe_initial_s``, the wait doubling up to
``probe_max_s`` while probes fail, except while one of its engines has no
healthy replica left (every request to it fails meanwhile): then every
``probe_initial_s``. The first answer below 500 returns it. Both are logged and
counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp

log = logging.getLogger("specgate.sidecar.replicas")

RUNNING_METRIC = "vllm:num_requests_running"
WAITING_METRIC = "vllm:num_requests_waiting"

MAX_REPLICA_NAME = 255  # wire.telemetry.TelemetryEvent.replica, and the control plane's heartbeat field
POOL_UNAVAILABLE = "pool_unavailable"
POOL_SATURATED = "pool_saturated"


class InFlight:
    """Requests admitted and not yet finished on this sidecar (single event loop, no lock)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def admit(self) -> int:
        self.count += 1
        return self.count

    def release(self) -> None:
        self.count -= 1


def _sample(line: str, metric: str) -> float | None:
    rest = line[len(metric):]
    if rest and rest[0] not in "{ \t":
        return None  # another metric with this prefix
    if rest.startswith("{"):
        end = rest.rfind("}")
        if end < 0:
            return None
        rest = rest[end + 1:]
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None  # not NaN, not infinite, not negative


def parse_engine_load(text: str) -> tuple[float | None, float | None]:
    """The sums of every ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` sample in Prometheus
    text (over all label sets); None for a metric that is absent."""
    running: float | None = None
    waiting: float | None = None
    for line in text.splitlines():
        if line.startswith(RUNNING_METRIC):
            value = _sample(line, RUNNING_METRIC)
            if value is not None:
                running = value + (running or 0.0)
        elif line.startswith(WAITING_METRIC):
            value = _sample(line, WAITING_METRIC)
            if value is not None:
                waiting = value + (waiting or 0.0)
    return running, waiting


def parse_running(text: str) -> float | None:
    """The sum of every ``vllm:num_requests_running`` sample in Prometheus text, or None if absent."""
    return parse_engine_load(text)[0]


def replica_name(url: str) -> str:
    """How telemetry, headers and heartbeats name a replica: HOST:PORT[/PREFIX] of its URL (no credentials)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}{parts.path.rstrip('/')}"


def _affinity_score(key: str, name: str) -> int:
    # Rendezvous hashing with a hash every process computes alike (Python's own str hash is salted per
    # process), so that gateways behind one load balancer send a conversation to the same replica.
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{name}".encode(errors="surrogatepass"),
                                          digest_size=8).digest(), "big")


class Replica:
    """One server of one or more engine names: its load, its health, and what the request path holds of it."""

    __slots__ = ("url", "name", "name_bytes", "engines", "upstream", "session", "in_flight", "running", "waiting",
                 "own_at_scrape", "external", "fresh_until", "healthy", "failures", "ejections", "returns",
                 "probe_at", "backoff_s", "requests", "held")

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = replica_name(url)
        self.name_bytes = self.name.encode("latin-1", "replace")
        self.engines: list[str] = []
        self.upstream: Any = None  # sidecar.upstream.Upstream, opened by the app
        self.session: aiohttp.ClientSession | None = None  # for pass-through requests
        self.in_flight = 0  # requests through this sidecar on this replica now
        self.running: float | None = None  # at the last scrape that answered
        self.waiting: float | None = None
        self.own_at_scrape = 0
        self.external = 0  # fresh running less our own at the scrape
        self.fresh_until = 0.0
        self.healthy = True
        self.failures = 0  # in a row
        self.ejections = 0
        self.returns = 0
        self.probe_at = 0.0
        self.backoff_s = 0.0
        self.requests = 0  # sent to it by this sidecar (attempts)
        # Taken out of routing by the engine supervisor (starting, draining, restarting): not healthy, and not
        # probed back: the supervisor returns it once its own health check passed (sidecar/supervisor.py).
        self.held = False

    def load(self, now: float) -> int:
        """The requests this replica is estimated to be running: ours now, and others' at the last scrape."""
        if now < self.fresh_until:
            return self.in_flight + self.external
        return self.in_flight

    def queue(self, now: float) -> int | None:
        """Its estimated queue: the engine's waiting count at the scrape, moved by our requests since; None
        without a fresh scrape of it."""
        if self.waiting is None or now >= self.fresh_until:
            return None
        return max(0, int(self.waiting) + self.in_flight - self.own_at_scrape)

    def report(self, now: float) -> dict[str, Any]:
        """What the heartbeat says of it (one entry per engine name it serves)."""
        fresh = now < self.fresh_until
        state = "held" if self.held else "healthy" if self.healthy else "ejected"
        return {"replica": self.name, "state": state,
                "in_flight": max(0, self.in_flight),
                "running": self.running if fresh else None, "waiting": self.waiting if fresh else None,
                "consecutive_failures": self.failures, "ejections": self.ejections, "returns": self.returns,
                "next_probe_in_s": None if self.healthy or self.held else round(max(0.0, self.probe_at - now), 3)}


class Choice:
    """Which replica would serve a request for one engine, and the batch the request would join there."""

    __slots__ = ("replica", "batch", "reason")

    def __init__(self, replica: Replica | None, batch: int, reason: str | None) -> None:
        self.replica = replica
        self.batch = batch
        self.reason = reason  # POOL_UNAVAILABLE (no healthy replica) or POOL_SATURATED (every one full)


class Pools:
    """Every engine's replicas, their scrapes and probes, and the choice of a replica per request."""

    def __init__(self, engines: Mapping[str, Iterable[str]], *, inflight: InFlight, replica_scope: bool = False,
                 interval_s: float = 0.5, timeout_s: float | None = None, eject_after: int = 3,
                 probe_initial_s: float = 1.0, probe_max_s: float = 30.0, max_queue: int | None = None,
                 affinity_slack: int = 4) -> None:
        self.replicas: dict[str, Replica] = {}  # by URL (the first one given for its name)
        self.pools: dict[str, tuple[Replica, ...]] = {}
        by_name: dict[str, Replica] = {}
        for engine, urls in engines.items():
            pool: list[Replica] = []
            for url in urls:
                base = url.rstrip("/")
                # one server, however its URL is spelt (http://H, http://h:80): one replica, scraped once
                replica = by_name.get(replica_name(base))
                if replica is None:
                    replica = self.replicas[base] = by_name[replica_name(base)] = Replica(base)
                if engine not in replica.engines:
                    replica.engines.append(engine)
                    pool.append(replica)
            self.pools[engine] = tuple(pool)
        self.inflight = inflight
        self.replica_scope = replica_scope
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else min(max(interval_s, 0.2), 2.0)
        self.stale_after_s = max(3 * interval_s, 1.0)
        self.eject_after = eject_after
        self.probe_initial_s = probe_initial_s
        self.probe_max_s = probe_max_s
        self.max_queue = max_queue
        self.affinity_slack = affinity_slack
        # called when a replica is ejected or returns (the sidecar heartbeats at once, so the control plane and
        # the dashboard see it within a round trip, not a heartbeat interval later)
        self.on_change: Callable[[], None] | None = None
        # worker scope: the fresh running total of every replica that is not this sidecar's own traffic, and
        # until when it stays fresh; the hot path reads only these two
        self.total = 0
        self.fresh_until = 0.0
        self.own_at_scrape = 0
        self.scraped: dict[str, tuple[float, float]] = {}  # URL -> (running, monotonic time of the scrape)
        self.scrapes = 0
        self.scrape_failures = 0
        self._task: asyncio.Task[None] | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._probe_wake: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None

    # --- the request path ---------------------------------------------------------------------

    def worker_batch(self, count: int, now: float) -> int:
        """Worker scope: the batch every engine sees, given the in-flight count with this request admitted."""
        if self.total and now < self.fresh_until:
            return count + self.total
        return count

    def choose(self, engine: str, now: float, affinity: str | None = None,
               exclude: Iterable[Replica] = ()) -> Choice:
        """The replica of ``engine`` a request would go to (never None while a healthy one is left, even a
        full one: ``reason`` says it is full), and its batch in replica scope (load + 1)."""
        pool = self.pools.get(engine, ())
        best: Replica | None = None
        best_load = 0
        count = len(pool)
        if count == 1:
            only = pool[0]
            if only.healthy and only not in exclude:
                best, best_load = only, only.load(now)
        elif count:
            start = random.randrange(count)  # noqa: S311 - not a secret; ties go to whichever comes first from a random start
            for i in range(count):
                replica = pool[(start + i) % count]
                if not replica.healthy or replica in exclude:
                    continue
                load = replica.load(now)
                if best is None or load < best_load:
                    best, best_load = replica, load
        if best is None:
            return Choice(None, 0, POOL_UNAVAILABLE)
        if affinity and count > 1:
            sticky = max((r for r in pool if r.healthy and r not in exclude),
                         key=lambda r: _affinity_score(affinity, r.name))
            if sticky is not best:
                load = sticky.load(now)
                if load <= best_load + self.affinity_slack and not self._full(sticky, now):
                    best, best_load = sticky, load
        reason = None
        if self.max_queue is not None and self._full(best, now):
            # the least-loaded is full: another replica with a shorter queue may not be
            others = [r for r in pool if r.healthy and r not in exclude and not self._full(r, now)]
            if others:
                best = min(others, key=lambda r: r.load(now))
                best_load = best.load(now)
            else:
                reason = POOL_SATURATED
        return Choice(best, best_load + 1, reason)

    def _full(self, replica: Replica, now: float) -> bool:
        if self.max_queue is None:
            return False
        queue = replica.queue(now)
        return queue is not None and queue > self.max_queue

    def next_probe_s(self, engine: str, now: float) -> float | None:
        """Seconds until the earliest probe of ``engine``'s ejected replicas (None: it has none)."""
        waits = [r.probe_at - now for r in self.pools.get(engine, ()) if not r.healthy and not r.held]
        return max(0.0, min(waits)) if waits else None

    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0

    def hold(self, url: str) -> None:
        """Takes a replica out of routing until :meth:`release` (the engine supervisor's start and restarts)."""
        replica = self.replicas[url]
        replica.held, replica.healthy = True, False
        self._changed()

    def release(self, url: str) -> None:
        replica = self.replicas[url]
        replica.held, replica.healthy, replica.failures, replica.backoff_s = False, True, 0, 0.0
        self._changed()

    def in_flight(self, url: str) -> int:
        return max(0, self.replicas[url].in_flight)

    def failed(self, replica: Replica, why: str) -> None:
        """A request or scrape that could not reach the replica, or a 5xx answer."""
        replica.failures += 1
        if replica.healthy and replica.failures >= self.eject_after:
            replica.healthy = False
            replica.ejections += 1
            replica.backoff_s = self.probe_initial_s
            replica.probe_at = time.monotonic() + replica.backoff_s
            log.warning("replica %s (%s) ejected after %d failures in a row (last: %s); probing /health in %.1f s",
                        replica.name, ", ".join(replica.engines), replica.failures, why, replica.backoff_s)
            self.wake_prober()
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # a listener must not fail the request that ejected the replica
                log.exception("replica change listener failed")

    def report(self, now: float | None = None) -> list[dict[str, Any]]:
        """Per engine and replica, for heartbeats and ``/metrics``."""
        now = time.monotonic() if now is None else now
        return [{"engine": engine, **replica.report(now)} for engine, pool in self.pools.items() for replica in pool]

    # --- scrapes and probes (background) ---------------------------------------------------------

    def _recompute(self) -> None:
        now = time.monotonic()
        fresh = [(value, at) for value, at in self.scraped.values() if now - at < self.stale_after_s]
        self.total = max(0, int(sum(value for value, _ in fresh)) - self.own_at_scrape)
        self.fresh_until = min(at for _, at in fresh) + self.stale_after_s if fresh else 0.0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  trust_env=False)
        return self._session

    async def scrape_once(self) -> None:
        replicas = [r for r in self.replicas.values() if r.healthy]
        own_before = self.inflight.count
        before = [r.in_flight for r in replicas]
        await asyncio.gather(*(self._scrape(r) for r in replicas))
        # The engines counted our requests at some moment between these two samples; the larger one errs
        # towards counting less traffic from elsewhere, never towards our own finished requests.
        self.own_at_scrape = max(own_before, self.inflight.count)
        now = time.monotonic()
        for replica, own in zip(replicas, before, strict=True):
            scraped = self.scraped.get(replica.url)
            if scraped is None or now - scraped[1] >= self.stale_after_s:
                replica.fresh_until = 0.0
                continue
            replica.own_at_scrape = max(own, replica.in_flight)
            replica.external = max(0, int(scraped[0]) - replica.own_at_scrape)
            replica.fresh_until = scraped[1] + self.stale_after_s
        self.scrapes += 1
        self._recompute()

    async def _scrape(self, replica: Replica) -> None:
        unreachable: str | None = None
        try:
            async with self._client().get(replica.url + "/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            text = ""
            unreachable = type(exc).__name__
        except (aiohttp.ClientError, TimeoutError, ValueError):
            text = ""
        running, waiting = parse_engine_load(text) if text else (None, None)
        if running is None:
            self.scrape_failures += 1
            self.scraped.pop(replica.url, None)
            replica.running = replica.waiting = None
        else:
            self.scraped[replica.url] = (running, time.monotonic())
            replica.running = running
            replica.waiting = waiting
        # A scrape that cannot connect counts towards ejection; one that answers proves nothing about requests
        # (a vLLM whose engine core died still serves /metrics), so it resets nothing.
        if unreachable:
            self.failed(replica, f"metrics scrape: {unreachable}")

    async def probe_due(self) -> None:
        """Probes every ejected replica whose wait is over; returns those that answer."""
        now = time.monotonic()
        due = [r for r in self.replicas.values() if not r.healthy and not r.held and r.probe_at <= now]
        await asyncio.gather(*(self._probe(r) for r in due))

    async def _probe(self, replica: Replica) -> None:
        try:
            async with self._client().get(replica.url + "/health") as resp:
                # vLLM answers 200, or 503 while its engine is dead; a server without the route answers 404,
                # and is up all the same
                ok = resp.status < 500
                await resp.read()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            ok = False
        if ok and not replica.held:  # held while the probe was out: the supervisor decides when it serves
            replica.healthy = True
            replica.failures = 0
            replica.returns += 1
            replica.backoff_s = 0.0
            log.warning("replica %s (%s) is back: /health answered", replica.name, ", ".join(replica.engines))
            self._changed()
        else:
            # While one of its engines has no healthy replica left, every request to that engine fails or is
            # refused: finding it back soon matters more than sparing it probes, so the wait does not grow.
            stranded = any(not any(r.healthy for r in self.pools[engine]) for engine in replica.engines)
            replica.backoff_s = self.probe_initial_s if stranded else min(
                replica.backoff_s * 2 or self.probe_initial_s, self.probe_max_s)
            replica.probe_at = time.monotonic() + replica.backoff_s

    def wake_prober(self) -> None:
        if self._probe_wake is not None:
            self._probe_wake.set()

    async def _scrape_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # never let one bad scrape end the loop
                await self.scrape_once()
            await asyncio.sleep(self.interval_s)

    async def _probe_loop(self) -> None:
        assert self._probe_wake is not None
        while True:
            with contextlib.suppress(Exception):
                await self.probe_due()
            now = time.monotonic()
            waits = [r.probe_at - now for r in self.replicas.values() if not r.healthy and not r.held]
            self._probe_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._probe_wake.wait(),
                                       timeout=max(0.05, min(waits)) if waits else None)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None and self.replicas:
            self._task = loop.create_task(self._scrape_loop(), name="specgate-replica-scraper")
        if self._probe_task is None and self.replicas:
            self._probe_wake = asyncio.Event()
            self._probe_task = loop.create_task(self._probe_loop(), name="specgate-replica-prober")

    async def stop(self) -> None:
        for attr in ("_task", "_probe_task"):
            task = getattr(self, attr)
            setattr(self, attr, None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def retry_after_s(wait_s: float | None) -> int:
    """A Retry-After value in whole seconds (at least 1) for a wait that may be unknown."""
    if wait_s is None or not math.isfinite(wait_s):
        return 1
    return max(1, math.ceil(wait_s))
