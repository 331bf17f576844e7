"""The sidecar's Prometheus metrics (``GET /metrics`` of the sidecar).

The request path only bumps plain dict counters (no locks, no label-child
look-ups: the app runs on one event loop); a custom collector turns them into
metric families when Prometheus scrapes. Gauges that describe state (in
flight, telemetry queue depth, active revision, engine running counts) are read
at scrape time from their owners.

Exposed (all prefixed ``specgate_sidecar_``):

* ``decisions_total{engine,rule}`` — decisions made, by decided engine and rule
* ``requests_total{engine,status}`` — finished requests, by the engine that served
  them and telemetry status (``wire.telemetry.EventStatus``)
* ``fallbacks_total{reason}`` — requests moved to the fallback engine, by fallback reason
  (``wire.telemetry.FallbackReason``, or ``upstream_5NN``)
* ``upstream_errors_total{engine}`` — failed upstream attempts (connect, 5xx, broken stream)
* ``rejected_total{reason}`` — requests answered by the sidecar itself (no policy, bad body)
* ``bundle_refused_total{reason}`` — policy bundles the sync refused (stale_generation, other_worker, expired, invalid)
* ``hook_errors_total`` — exceptions raised by the on_event hook
* ``shadow_comparisons_total{outcome}`` — requests sampled for a shadow comparison (policy ``quality``): matched,
  differed, not_greedy (not comparable), not_served (failed or fell back), dropped_load (over
  ``shadow_max_in_flight``, or the plain replicas queue beyond ``max_queue``), no_replica, failed, cancelled (the
  sidecar stopped first)
* ``shadow_in_flight`` — shadow requests running on the plain engine now
* ``quality_check_errors_total`` — runs of ``--quality-check`` that raised, timed out or answered badly
* ``request_duration_seconds{engine}`` — histogram of end-to-end latency seen by the sidecar
* ``in_flight`` — requests in flight now
* ``telemetry_queue_depth`` — events waiting in the exporter (when it reports ``queue_depth()``)
* ``telemetry_aggregated_requests_total`` — requests added to this worker's rollup deltas (a pre-aggregated
  policy, ``telemetry.raw_sample_rate`` below 1); ``telemetry_rollup_deltas_total{outcome}``: deltas made, sent,
  dropped (refused, or lost with a batch the spool could not keep)
* ``active_revision{policy,revision,role}`` — 1 for the revision(s) in use (role active|canary)
* ``kill_switch`` — 1 when the bundle's kill switch is on
* ``engine_running{engine}`` — last scraped ``vllm:num_requests_running`` per engine, over its replicas
* ``replica_healthy{engine,replica}`` — 1 while the replica takes requests, 0 while it is ejected
* ``replica_in_flight{engine,replica}`` — this sidecar's requests on the replica now
* ``replica_running{engine,replica}``, ``replica_waiting{engine,replica}`` — the engine's own counts at the
  last fresh scrape (absent without one)
* ``replica_ejections_total{engine,replica}``, ``replica_returns_total{engine,replica}`` — ejections, and
  returns after a probe answered
* ``replica_requests_total{engine,replica}`` — attempts sent to the replica
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from policies import PolicyStore
from sidecar.replicas import InFlight, Pools
from wire.telemetry import EventStatus

PREFIX = "specgate_sidecar_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _Histogram:
    __slots__ = ("counts", "total", "n")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, value)] += 1
        self.total += value
        self.n += 1


class SidecarMetrics(Collector):
    def __init__(self, store: PolicyStore, inflight: InFlight, pools: Pools | None = None,
                 queue_depth: Callable[[], int] | None = None,
                 telemetry_counters: Callable[[], dict[str, int]] | None = None) -> None:
        self.store = store
        self.inflight = inflight
        self.pools = pools
        self.queue_depth = queue_depth
        self.telemetry_counters = telemetry_counters
        self.decisions: dict[tuple[str, str], int] = {}
        self.requests: dict[tuple[str, EventStatus], int] = {}
        self.fallbacks: dict[str, int] = {}
        self.upstream_errors: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        # Filled by PolicySync (its ``refused``): bundles refused by reason.
        self.bundle_refused: dict[str, int] = {}
        self.hook_errors = 0
        # Shadow comparisons (sidecar/shadow.py) by outcome, and the worker's quality check failing to run.
        self.shadows: dict[str, int] = {}
        self.shadows_in_flight = 0
        self.quality_check_errors = 0
        self.latency: dict[str, _Histogram] = {}
        # Set by the sidecar when it supervises its engines (sidecar/supervisor.py): its report() per engine.
        self.supervisor: Any = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # --- recording (request path; cheap) -----------------------------------------

    def decision(self, engine: str, rule: str) -> None:
        key = (engine, rule)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def finished(self, engine: str, status: EventStatus, seconds: float) -> None:
        key = (engine, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        hist = self.latency.get(engine)
        if hist is None:
            hist = self.latency[engine] = _Histogram()
        hist.observe(seconds)

    def fallback(self, reason: str) -> None:
        """``reason``: a ``FallbackReason``, or ``upstream_status_reason(status)``."""
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def upstream_error(self, engine: str) -> None:
        self.upstream_errors[engine] = self.upstream_errors.get(engine, 0) + 1

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def shadow(self, outcome: str) -> None:
        self.shadows[outcome] = self.shadows.get(outcome, 0) + 1

    # --- exposition --------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def collect(self) -> Iterator[Metric]:
        family: Any = CounterMetricFamily(PREFIX + "decisions", "Decisions by decided engine and rule",
                                          labels=["engine", "rule"])
        for (engine, rule), n in list(self.decisions.items()):
            family.add_metric([engine, rule], n)
        yield family
        family = CounterMetricFamily(PREFIX + "requests", "Finished requests by serving engine and status",
                                     labels=["engine", "status"])
        for (engine, status), n in list(self.requests.items()):
            family.add_metric([engine, status], n)
        yield family
        family = CounterMetricFamily(PREFIX + "fallbacks", "Requests moved to the fallback engine",
                                     labels=["reason"])
        for reason, n in list(self.fallbacks.items()):
            family.add_metric([reason], n)
        yield family
        family = CounterMetricFamily(PREFIX + "upstream_errors", "Failed upstream attempts by engine",
                                     labels=["engine"])
        for engine, n in list(self.upstream_errors.items()):
            family.add_metric([engine], n)
        yield family
        family = CounterMetricFamily(PREFIX + "rejected", "Requests answered by the sidecar itself",
                                     labels=["reason"])
        for reason, n in list(self.rejected.items()):
            family.add_metric([reason], n)
        yield family
        family = CounterMetricFamily(PREFIX + "bundle_refused", "Policy bundles refused by the sync, by reason "
                                     "(stale_generation, other_worker, expired, invalid)", labels=["reason"])
        for reason, n in list(self.bundle_refused.items()):
            family.add_metric([reason], n)
        yield family
        yield CounterMetricFamily(PREFIX + "hook_errors", "Exceptions raised by the on_event hook",
                                  value=self.hook_errors)
        family = CounterMetricFamily(PREFIX + "shadow_comparisons", "Requests sampled for a shadow comparison "
                                     "(policy quality), by outcome: matched, differed, not_greedy, not_served, "
                                     "dropped_load, no_replica, failed, cancelled", labels=["outcome"])
        for outcome, n in list(self.shadows.items()):
            family.add_metric([outcome], n)
        yield family
        yield GaugeMetricFamily(PREFIX + "shadow_in_flight", "Shadow requests running on the plain engine",
                                value=self.shadows_in_flight)
        yield CounterMetricFamily(PREFIX + "quality_check_errors", "Runs of the worker's quality check "
                                  "(--quality-check) that raised, timed out or answered neither a bool nor "
                                  "(bool, str)", value=self.quality_check_errors)
        family = HistogramMetricFamily(PREFIX + "request_duration_seconds",
                                       "End-to-end request latency seen by the sidecar", labels=["engine"])
        for engine, hist in list(self.latency.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*LATENCY_BUCKETS, float("inf")), hist.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([engine], buckets, hist.total)
        yield family
        yield GaugeMetricFamily(PREFIX + "in_flight", "Requests in flight on this sidecar",
                                value=self.inflight.count)
        if self.queue_depth is not None:
            try:
                depth = float(self.queue_depth())
            except Exception:  # a broken exporter must not break /metrics
                depth = float("nan")
            yield GaugeMetricFamily(PREFIX + "telemetry_queue_depth", "Telemetry events waiting to be exported",
                                    value=depth)
        if self.telemetry_counters is not None:
            try:
                counted = self.telemetry_counters()
            except Exception:  # a broken exporter must not break /metrics
                counted = {}
            yield CounterMetricFamily(PREFIX + "telemetry_aggregated_requests", "Requests added to this worker's "
                                      "rollup deltas (pre-aggregation)", value=counted.get("aggregated", 0))
            family = CounterMetricFamily(PREFIX + "telemetry_rollup_deltas", "Rollup deltas by outcome: made, "
                                         "sent, dropped", labels=["outcome"])
            for outcome in ("made", "sent", "dropped"):
                family.add_metric([outcome], counted.get(f"rollups_{outcome}", 0))
            yield family
        bundle = self.store.current
        family = GaugeMetricFamily(PREFIX + "active_revision", "1 for each policy revision in use",
                                   labels=["policy", "revision", "role"])
        if bundle is not None:
            family.add_metric([bundle.active.name, bundle.active.revision, "active"], 1)
            if bundle.canary is not None:
                family.add_metric([bundle.canary.name, bundle.canary.revision, "canary"], 1)
        yield family
        yield GaugeMetricFamily(PREFIX + "kill_switch", "1 when the kill switch is on",
                                value=1 if bundle is not None and bundle.kill_switch else 0)
        if self.pools is not None:
            yield from self._replica_families(self.pools)
        if self.supervisor is not None:
            yield from self._engine_families(self.supervisor.report())

    @staticmethod
    def _engine_families(reports: list[dict[str, Any]]) -> Iterator[Metric]:
        serving = GaugeMetricFamily(PREFIX + "engine_serving", "1 while a supervised engine serves with its "
                                    "arguments, 0 while it starts, drains, restarts or is down",
                                    labels=["engine", "config_hash"])
        restarts = CounterMetricFamily(PREFIX + "engine_restarts", "Restarts of a supervised engine with new "
                                       "arguments, by outcome (ok; failed: back on the previous arguments)",
                                       labels=["engine", "outcome"])
        aligned = GaugeMetricFamily(PREFIX + "engine_tokenizer_aligned", "1 when a supervised engine's draft model "
                                    "has its target's tokenizer, 0 when it differs (pairs.tokenizers); absent "
                                    "without a draft model or when it could not be checked", labels=["engine"])
        for report in reports:
            serving.add_metric([report["engine"], report["config_hash"] or ""], 1 if report["state"] == "serving"
                               else 0)
            restarts.add_metric([report["engine"], "ok"], report["restarts"])
            restarts.add_metric([report["engine"], "failed"], report["failed_restarts"])
            check = report.get("tokenizer")
            if check is not None and check["aligned"] is not None:
                aligned.add_metric([report["engine"]], 1 if check["aligned"] else 0)
        yield serving
        yield restarts
        yield aligned

    def _replica_families(self, pools: Pools) -> Iterator[Metric]:
        now = time.monotonic()
        running = GaugeMetricFamily(PREFIX + "engine_running",
                                    "Last scraped vllm:num_requests_running per engine, over its replicas",
                                    labels=["engine"])
        labels = ["engine", "replica"]
        healthy = GaugeMetricFamily(PREFIX + "replica_healthy", "1 while the replica takes requests, 0 while "
                                    "ejected", labels=labels)
        in_flight = GaugeMetricFamily(PREFIX + "replica_in_flight", "This sidecar's requests on the replica",
                                      labels=labels)
        replica_running = GaugeMetricFamily(PREFIX + "replica_running", "vllm:num_requests_running at the last "
                                            "fresh scrape", labels=labels)
        waiting = GaugeMetricFamily(PREFIX + "replica_waiting", "vllm:num_requests_waiting at the last fresh "
                                    "scrape", labels=labels)
        ejections = CounterMetricFamily(PREFIX + "replica_ejections", "Replica ejections after failures in a row",
                                        labels=labels)
        returns = CounterMetricFamily(PREFIX + "replica_returns", "Ejected replicas returned after a probe",
                                      labels=labels)
        requests = CounterMetricFamily(PREFIX + "replica_requests", "Attempts sent to the replica", labels=labels)
        for engine, pool in pools.pools.items():
            total: float | None = None
            for replica in pool:
                key = [engine, replica.name]
                fresh = now < replica.fresh_until
                healthy.add_metric(key, 1 if replica.healthy else 0)
                in_flight.add_metric(key, replica.in_flight)
                if fresh and replica.running is not None:
                    replica_running.add_metric(key, replica.running)
                    total = replica.running + (total or 0.0)
                if fresh and replica.waiting is not None:
                    waiting.add_metric(key, replica.waiting)
                ejections.add_metric(key, replica.ejections)
                returns.add_metric(key, replica.returns)
                requests.add_metric(key, replica.requests)
            if total is not None:
                running.add_metric([engine], total)
        yield from (running, healthy, in_flight, replica_running, waiting, ejections, returns, requests)
