from __future__ import annotations

import datetime as dt
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from unittest import mock

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sidecar.otel import OTelHook, otel_enabled, otel_from_env
from wire.telemetry import TelemetryEvent

START = dt.datetime(2026, 1, 2, 3, 4, 5, 250000, tzinfo=dt.UTC)


def event(**overrides: Any) -> TelemetryEvent:
    values: dict[str, Any] = {
        "event_id": "e1", "request_id": "req-1", "time": START, "worker_id": "w1", "pool": "default",
        "route": "chat", "model": "llama", "policy": "seed", "revision": "a" * 64, "rule": "chat-low-batch",
        "engine": "draft", "decided_engine": "draft", "speculate": True, "num_speculative_tokens": 3,
        "explored": True, "canary": False, "kill_switch": False, "batch_size": 2, "stream": True,
        "structured_output": False, "tools": False, "max_tokens": 256, "prompt_tokens": 120,
        "completion_tokens": 80, "ttft_ms": 45.0, "itl_ms": 12.5, "e2e_ms": 1045.0, "status": "ok",
        "http_status": 200, "spec_draft_tokens": 90, "spec_accepted_tokens": 63, "spec_acceptance_rate": 0.7,
        "shadow_match": False, "shadow_first_diff": 12, "shadow_check_passed": True, **overrides}
    return TelemetryEvent(**values)


class Harness:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.hook = OTelHook(tracer_provider, MeterProvider(metric_readers=[self.reader]),
                             engines={"draft": "http://10.0.0.7:8001/v1", "base": "http://engine-base:8000"})

    def points(self, name: str) -> list[HistogramDataPoint]:
        data = self.reader.get_metrics_data()
        assert data is not None
        out: list[HistogramDataPoint] = []
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        out.extend(p for p in metric.data.data_points if isinstance(p, HistogramDataPoint))
        return out

    def unit(self, name: str) -> str | None:
        data = self.reader.get_metrics_data()
        assert data is not None
        return next(m.unit for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics
                    if m.name == name)


@pytest.fixture
def otel() -> Harness:
    return Harness()


def test_a_request_becomes_a_genai_client_span_with_its_own_times(otel: Harness) -> None:
    otel.hook.on_event(event())
    (span,) = otel.spans.get_finished_spans()
    assert span.name == "chat llama"
    assert span.kind is SpanKind.CLIENT
    start_ns = int(START.timestamp() * 1e9)
    assert span.start_time == start_ns
    assert span.end_time == start_ns + 1_045_000_000
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "llama"
    assert attrs["gen_ai.request.max_tokens"] == 256
    assert attrs["gen_ai.usage.input_tokens"] == 120
    assert attrs["gen_ai.usage.output_tokens"] == 80
    assert attrs["server.address"] == "10.0.0.7"
    assert attrs["server.port"] == 8001
    assert attrs["specgate.engine"] == "draft"
    assert attrs["specgate.rule"] == "chat-low-batch"
    assert attrs["specgate.revision"] == "a" * 64
    assert attrs["specgate.policy"] == "seed"
    assert attrs["specgate.explored"] is True
    assert attrs["specgate.speculate"] is True
    assert attrs["specgate.spec.acceptance_rate"] == 0.7
    assert attrs["specgate.spec.draft_tokens"] == 90
    assert attrs["specgate.spec.accepted_tokens"] == 63
    assert attrs["specgate.fallback"] is False
    # the shadow comparison it carries; what was not compared is left out
    assert (attrs["specgate.shadow.match"], attrs["specgate.shadow.first_diff"]) == (False, 12)
    assert attrs["specgate.shadow.check_passed"] is True
    assert "specgate.shadow.structured_valid" not in attrs
    assert "error.type" not in attrs
    assert span.status.status_code is StatusCode.UNSET


def test_a_failed_request_carries_error_type_and_fallback(otel: Harness) -> None:
    otel.hook.on_event(event(engine="base", status="upstream_error", http_status=502, fallback=True,
                             fallback_reason="connect_error", retries=1, route="completions",
                             spec_acceptance_rate=None, completion_tokens=None))
    otel.hook.on_event(event(event_id="e2", status="client_disconnect", http_status=None))
    failed, gone = otel.spans.get_finished_spans()
    assert failed.name == "text_completion llama"
    attrs = dict(failed.attributes or {})
    assert attrs["error.type"] == "502"
    assert attrs["specgate.fallback"] is True
    assert attrs["server.address"] == "engine-base"
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert "specgate.spec.acceptance_rate" not in attrs
    assert "gen_ai.usage.output_tokens" not in attrs
    assert failed.status.status_code is StatusCode.ERROR
    assert dict(gone.attributes or {})["error.type"] == "client_disconnect"
    # An explicit operation wins over the route's guess.
    otel.hook.on_event(event(event_id="e3", route="completions"), operation="chat")
    assert otel.spans.get_finished_spans()[-1].name == "chat llama"


def test_genai_histograms_in_seconds_and_tokens_by_type(otel: Harness) -> None:
    otel.hook.on_event(event())
    otel.hook.on_event(event(event_id="e2", ttft_ms=55.0, itl_ms=7.5, e2e_ms=955.0, prompt_tokens=30,
                             completion_tokens=10))
    (duration,) = otel.points("gen_ai.server.request.duration")
    assert duration.count == 2
    assert duration.sum == pytest.approx(2.0)
    assert otel.unit("gen_ai.server.request.duration") == "s"
    assert dict(duration.attributes or {}) == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "llama", "server.address": "10.0.0.7",
        "server.port": 8001, "specgate.engine": "draft", "specgate.speculate": True}
    (ttft,) = otel.points("gen_ai.server.time_to_first_token")
    assert ttft.count == 2
    assert ttft.sum == pytest.approx(0.1)
    assert ttft.explicit_bounds[0] == 0.001  # the conventions' advised buckets
    (tpot,) = otel.points("gen_ai.server.time_per_output_token")
    assert tpot.sum == pytest.approx(0.02)
    tokens = {dict(p.attributes or {})["gen_ai.token.type"]: p for p in otel.points("gen_ai.client.token.usage")}
    assert tokens["input"].sum == 150
    assert tokens["input"].count == 2
    assert tokens["output"].sum == 90
    assert otel.unit("gen_ai.client.token.usage") == "{token}"


def test_the_hook_never_raises(otel: Harness) -> None:
    otel.hook.on_event(None)  # type: ignore[arg-type]
    assert otel.spans.get_finished_spans() == ()


class _Collector(BaseHTTPRequestHandler):
    """Test double of an OTLP/HTTP collector: records which signal paths got data."""

    received: ClassVar[list[tuple[str, int]]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self.received.append((self.path, len(self.rfile.read(length))))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_export_is_on_only_with_an_otlp_endpoint_and_then_sends_otlp_http() -> None:
    assert not otel_enabled({})
    assert otel_from_env(worker_id="w1", environ={}) is None
    assert not otel_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})

    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
        with mock.patch.dict(os.environ, {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}):
            runtime = otel_from_env(worker_id="w1", engines={"draft": "http://10.0.0.7:8001"})
            assert runtime is not None
            runtime.hook.on_event(event())
            runtime.shutdown()  # flushes spans and metrics
    finally:
        collector.shutdown()
        thread.join(5)
    paths = {path for path, size in _Collector.received if size > 0}
    assert paths == {"/v1/traces", "/v1/metrics"}
