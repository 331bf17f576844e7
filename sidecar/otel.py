"""OpenTelemetry for the sidecar: one span and a few histograms per request, GenAI semantic conventions.

The proxy calls one hook, :meth:`OTelHook.on_event`, with the finished
request's ``TelemetryEvent``; the span is created after the fact with the
request's own start and end times. Names follow the OpenTelemetry GenAI
conventions (``gen_ai.*``, span ``"{operation} {model}"``, kind CLIENT: the
sidecar is the client of the inference engine); what speculative decoding
adds is under ``specgate.``.

Export is OTLP over HTTP and only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the
traces/metrics specific variant) is set: :func:`otel_from_env` returns None
otherwise and the proxy gets no hook at all, so a sidecar without a collector
pays nothing. The exporters read the standard ``OTEL_*`` variables (headers,
timeouts, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider

from wire.telemetry import EventStatus, TelemetryEvent

log = logging.getLogger("specgate.sidecar.otel")

INSTRUMENTATION = "specgate.sidecar"
# Requests the route table calls a completion are text completions; everything else is chat.
COMPLETION_ROUTES = frozenset({"completion", "completions", "text_completion"})
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                      "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")

# Bucket boundaries the GenAI semantic conventions advise for these histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


def operation_of(event: TelemetryEvent) -> str:
    return "text_completion" if event.route in COMPLETION_ROUTES else "chat"


def _ns(moment: dt.datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return int(moment.timestamp() * 1_000_000_000)


def error_type(event: TelemetryEvent) -> str | None:
    """``error.type`` of a failed request: the HTTP status when there is one, else the outcome."""
    if event.status == EventStatus.ok:
        return None
    if event.http_status is not None and event.http_status >= 400:
        return str(event.http_status)
    return event.status


class OTelHook:
    """Turns telemetry events into spans and GenAI metrics on the given providers.

    ``engines`` (name -> base URL, or the URLs of its replicas) gives each span
    its ``server.address`` and ``server.port``: those of the replica the event
    names, else of the engine's first URL. :meth:`on_event` never raises.
    """

    def __init__(self, tracer_provider: TracerProvider, meter_provider: MeterProvider, *,
                 engines: Mapping[str, str | Sequence[str]] | None = None, version: str | None = None) -> None:
        self._tracer = tracer_provider.get_tracer(INSTRUMENTATION, version)
        meter = meter_provider.get_meter(INSTRUMENTATION, version)
        self._ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", description="Time to generate the first token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self._tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token after the first (mean inter-token latency)",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self._duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s", description="Generative AI request duration",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self._tokens = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}", description="Input and output tokens used",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self._servers: dict[str, tuple[str, int | None]] = {}
        for name, urls in (engines or {}).items():
            url = urls if isinstance(urls, str) else next(iter(urls), "")
            parts = urlsplit(url)
            if parts.hostname:
                try:
                    port = parts.port
                except ValueError:
                    port = None
                self._servers[name] = (parts.hostname, port)

    def on_event(self, event: TelemetryEvent, operation: str | None = None) -> None:
        try:
            self._record(event, operation or operation_of(event))
        except Exception:  # observability must never fail a request
            log.exception("OpenTelemetry recording failed")

    def _record(self, event: TelemetryEvent, operation: str) -> None:
        failure = error_type(event)
        server = _replica_server(event.replica) if event.replica else self._servers.get(event.engine)
        common: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.request.model": event.model}
        if server is not None:
            common["server.address"] = server[0]
            if server[1] is not None:
                common["server.port"] = server[1]
        attributes: dict[str, Any] = {
            **common,
            "specgate.engine": event.engine,
            "specgate.decided_engine": event.decided_engine,
            "specgate.rule": event.rule,
            "specgate.policy": event.policy,
            "specgate.revision": event.revision,
            "specgate.route": event.route,
            "specgate.explored": event.explored,
            "specgate.canary": event.canary,
            "specgate.kill_switch": event.kill_switch,
            "specgate.speculate": event.speculate,
            "specgate.num_speculative_tokens": event.num_speculative_tokens,
            "specgate.batch_size": event.batch_size,
            "specgate.fallback": event.fallback,
            "specgate.retries": event.retries,
            "specgate.request_id": event.request_id,
            "gen_ai.request.stream": event.stream,
        }
        optional = {
            "gen_ai.request.max_tokens": event.max_tokens,
            "gen_ai.usage.input_tokens": event.prompt_tokens,
            "gen_ai.usage.output_tokens": event.completion_tokens,
            "http.response.status_code": event.http_status,
            "specgate.fallback_reason": event.fallback_reason,
            "specgate.structured_valid": event.structured_valid,
            "specgate.spec.acceptance_rate": event.spec_acceptance_rate,
            "specgate.spec.draft_tokens": event.spec_draft_tokens,
            "specgate.spec.accepted_tokens": event.spec_accepted_tokens,
            "specgate.spec.mean_acceptance_length": event.spec_mean_acceptance_length,
            "specgate.shadow.match": event.shadow_match,
            "specgate.shadow.first_diff": event.shadow_first_diff,
            "specgate.shadow.structured_valid": event.shadow_structured_valid,
            "specgate.shadow.check_passed": event.shadow_check_passed,
            "specgate.shadow.check_reason": event.shadow_check_reason,
            "error.type": failure,
        }
        attributes.update({k: v for k, v in optional.items() if v is not None})
        start = _ns(event.time)
        end = start + int(event.e2e_ms * 1_000_000)
        span = self._tracer.start_span(f"{operation} {event.model}".strip(), kind=SpanKind.CLIENT,
                                       attributes=attributes, start_time=start)
        if failure is not None:
            span.set_status(Status(StatusCode.ERROR, event.fallback_reason or event.status))
        span.end(end_time=end)

        measured = {**common, "specgate.engine": event.engine, "specgate.speculate": event.speculate}
        if failure is not None:
            measured["error.type"] = failure
        self._duration.record(event.e2e_ms / 1000.0, measured)
        if event.ttft_ms is not None:
            self._ttft.record(event.ttft_ms / 1000.0, measured)
        if event.itl_ms is not None:
            self._tpot.record(event.itl_ms / 1000.0, measured)
        if event.prompt_tokens is not None:
            self._tokens.record(event.prompt_tokens, {**measured, "gen_ai.token.type": "input"})
        if event.completion_tokens is not None:
            self._tokens.record(event.completion_tokens, {**measured, "gen_ai.token.type": "output"})


class OTelRuntime:
    """An :class:`OTelHook` with the SDK providers and OTLP/HTTP exporters behind it; ``shutdown`` flushes."""

    def __init__(self, hook: OTelHook, shutdown: list[Any]) -> None:
        self.hook = hook
        self._providers = shutdown

    def shutdown(self) -> None:
        for provider in self._providers:
            try:
                provider.shutdown()
            except Exception:
                log.exception("OpenTelemetry shutdown failed")


def otel_enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def _replica_server(name: str) -> tuple[str, int | None] | None:
    """HOST and PORT of a replica's name (sidecar.replicas.replica_name: HOST:PORT[/PREFIX])."""
    parts = urlsplit("//" + name)
    try:
        port = parts.port
    except ValueError:
        port = None
    return (parts.hostname, port) if parts.hostname else None


def otel_from_env(*, worker_id: str, engines: Mapping[str, str | Sequence[str]] | None = None,
                  version: str | None = None,
                  environ: Mapping[str, str] | None = None) -> OTelRuntime | None:
    """OTLP/HTTP export of spans and metrics when an OTLP endpoint is configured, else None (no cost)."""
    if not otel_enabled(environ):
        return None
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    env = os.environ if environ is None else environ
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or "specgate-sidecar",
                                "service.instance.id": worker_id,
                                **({"service.version": version} if version else {})})
    tracer_provider = SdkTracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    meter_provider = SdkMeterProvider(resource=resource,
                                      metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])
    hook = OTelHook(tracer_provider, meter_provider, engines=engines, version=version)
    log.info("OpenTelemetry: exporting spans and metrics over OTLP/HTTP")
    return OTelRuntime(hook, [tracer_provider, meter_provider])
