"""Prometheus metrics of one control-plane process."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.distribution.hub import ChangeHub


class ControlPlaneMetrics:
    def __init__(self, hub: ChangeHub) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("specgate_http_requests", "HTTP requests handled",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("specgate_http_request_duration_seconds", "HTTP request latency",
                                 ["method", "route"], registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.telemetry_events = Counter("specgate_telemetry_events", "telemetry events received, by outcome: "
                                        "stored, already_stored (an event id seen before), rejected",
                                        ["outcome"], registry=self.registry)
        self.telemetry_batches = Counter("specgate_telemetry_batches", "telemetry batches received: new, or "
                                         "duplicate (a batch id seen before; nothing stored)",
                                         ["outcome"], registry=self.registry)
        self.telemetry_rollup_deltas = Counter(
            "specgate_telemetry_rollup_deltas", "rollup deltas of pre-aggregating workers received, by outcome: "
            "stored (added to the rollups), already_stored (a delta id seen before), rejected", ["outcome"],
            registry=self.registry)
        self.telemetry_represented_requests = Counter(
            "specgate_telemetry_represented_requests", "requests the stored telemetry stands for: events rolled "
            "up on arrival plus the requests of stored rollup deltas (sampled events are counted in their deltas)",
            registry=self.registry)
        for outcome in ("stored", "already_stored", "rejected"):
            self.telemetry_events.labels(outcome)
            self.telemetry_rollup_deltas.labels(outcome)
        for outcome in ("new", "duplicate"):
            self.telemetry_batches.labels(outcome)
        self.registry.register(_HubCollector(hub))
        waiters = Gauge("specgate_long_poll_waiters", "long-polls and SSE streams waiting for a change",
                        registry=self.registry)
        waiters.set_function(lambda: hub.waiters)
        self.leader = Gauge("specgate_leader", "1 while this process leads the role's background task among the "
                            "replicas sharing the database (autopilot, guardrails), 0 while another does; no "
                            "sample for a role whose task is off here", ["role"], registry=self.registry)


class _HubCollector(Collector):
    """Reads the hub's own counters at scrape time, so nothing else has to remember to count."""

    def __init__(self, hub: ChangeHub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("specgate_bundle_publishes", "changes committed here that can alter a bundle",
                                  value=self.hub.publishes)
        yield CounterMetricFamily("specgate_bundle_change_notices",
                                  "change notices received (local commits and other replicas)",
                                  value=self.hub.notices)
        yield GaugeMetricFamily("specgate_bundle_generation", "the distribution generation last seen",
                                value=self.hub.generation)
