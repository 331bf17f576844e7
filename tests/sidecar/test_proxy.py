"""The request path end to end: a real sidecar (uvicorn) between a client and fake vLLM engines."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

import policies
from sidecar.proxy import build_app
from sidecar.settings import SidecarSettings
from tests.support.fake_upstream import SPEC_METRICS, Blackhole, FakeEngine, closed_port, engine_metrics
from tests.support.sidecars import SEED, RecordingExporter, Sidecar, SidecarFactory, seed_bundle, wait_for
from wire.telemetry import EventStatus, FallbackReason, TelemetryBatch, TelemetryEvent, is_fallback_reason

CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello there"}], **extra}


def post(sidecar: Sidecar, *, route: str | None = "chat", path: str = CHAT, headers: dict[str, str] | None = None,
         timeout: float = 10.0, **extra: Any) -> httpx.Response:
    all_headers = {"X-Specgate-Route": route} if route else {}
    all_headers.update(headers or {})
    payload = body(**extra) if path == CHAT else {"model": "m", "prompt": "hello there", **extra}
    return httpx.post(sidecar.url + path, json=payload, headers=all_headers, timeout=timeout)


def sse(text: str) -> list[Any]:
    """The data payloads of an SSE body ([DONE] as the string)."""
    out: list[Any] = []
    for event in text.split("\n\n"):
        if event.startswith("data: "):
            data = event[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def decision_fields(header: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in header.split("; "))


# --- decisions -----------------------------------------------------------------------------------

def test_decision_header_matches_the_store_and_request_id_round_trips(make_sidecar: SidecarFactory,
                                                                      draft: FakeEngine) -> None:
    sidecar = make_sidecar()
    response = post(sidecar, headers={"X-Request-Id": "client-id-1"}, max_tokens=32)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-id-1"
    assert sidecar.store.current is not None
    expected = sidecar.store.current.decide(policies.RequestShape(
        route="chat", model="m", batch_size=1, max_tokens=32, prompt_tokens=3, request_id="client-id-1"))
    # the decision, and the replica that served it
    assert response.headers["x-specgate-decision"] == expected.to_header() + "; replica=" + draft.url[7:]
    assert expected.engine == "draft"
    # the engine saw the same request id, and the body the client sent
    assert draft.request_ids() == ["client-id-1"]
    assert draft.requests[0]["body"] == body(max_tokens=32)
    event = sidecar.exporter.one()
    assert (event.request_id, event.rule, event.revision, event.policy) == (
        "client-id-1", "chat-low-batch", expected.revision, "seed")
    assert (event.worker_id, event.pool, event.route, event.model, event.max_tokens) == ("w1", "gpu-a", "chat", "m", 32)
    assert sidecar.hooked == [event]  # the OTel hook sees the same event


def test_generated_request_id(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar()
    response = post(sidecar)
    rid = response.headers["x-request-id"]
    assert re.fullmatch("[0-9a-f]{32}", rid), rid  # uuid4().hex's format
    assert sidecar.exporter.one().request_id == rid


@pytest.mark.parametrize(("route", "extra", "engine", "rule"), [
    ("chat", {}, "draft", "chat-low-batch"),
    ("chat", {"response_format": {"type": "json_object"}}, "base", "default"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "base", "default"),
    ("summarize", {}, "base", "default"),
    (None, {}, "base", "default"),
])
def test_routing_by_policy(make_sidecar: SidecarFactory, draft: FakeEngine, base: FakeEngine, route: str | None,
                           extra: dict[str, Any], engine: str, rule: str) -> None:
    sidecar = make_sidecar()
    response = post(sidecar, route=route, **extra)
    assert response.status_code == 200
    assert decision_fields(response.headers["x-specgate-decision"])["engine"] == engine
    served = draft if engine == "draft" else base
    other = base if engine == "draft" else draft
    assert len(served.requests) == 1
    assert not other.requests
    event = sidecar.exporter.one()
    assert (event.engine, event.decided_engine, event.rule, event.speculate) == (engine, engine, rule,
                                                                               engine == "draft")


def test_route_from_metadata_and_route_table(make_sidecar: SidecarFactory, draft: FakeEngine) -> None:
    sidecar = make_sidecar(routes={"chat-model": "chat"})
    post(sidecar, route=None, metadata={"route": "chat"})
    post(sidecar, route=None, model="chat-model")
    events = sidecar.exporter.wait(2)
    assert [e.route for e in events] == ["chat", "chat"]
    assert len(draft.requests) == 2


def test_kill_switch_sends_everything_to_base(make_sidecar: SidecarFactory, draft: FakeEngine,
                                              base: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=seed_bundle(kill_switch=True))
    response = post(sidecar)
    assert decision_fields(response.headers["x-specgate-decision"])["rule"] == "kill-switch"
    assert len(base.requests) == 1
    assert not draft.requests
    event = sidecar.exporter.one()
    assert (event.engine, event.kill_switch, event.speculate) == ("base", True, False)
    # and back: a new bundle takes effect on the next request
    sidecar.store.update(seed_bundle())
    assert post(sidecar).headers["x-specgate-decision"].startswith("engine=draft;")


def test_canary_revision_decides_its_share(make_sidecar: SidecarFactory, draft: FakeEngine) -> None:
    stricter = policies.load_policy(SEED.read_text().replace("max: 4", "max: 0"))
    active = policies.Revision.of(policies.load_policy(SEED.read_text()))
    canary = policies.Canary(policies.Revision.of(stricter), 100.0, "rollout:r1")
    sidecar = make_sidecar(bundle=policies.CompiledBundle(policies.BundlePayload(active, canary)))
    response = post(sidecar)
    fields = decision_fields(response.headers["x-specgate-decision"])
    assert fields["revision"] == canary.revision.id
    assert fields["engine"] == "base"  # batch 1 > max 0
    event = sidecar.exporter.one()
    assert event.canary is True
    assert event.revision == canary.revision.id
    assert not draft.requests


def test_exploration_by_time_window_switches_whole_windows(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                          base: FakeEngine) -> None:
    """A switchback: every request of a window gets the same variant, and the window's hash says which."""
    switchback = policies.load_policy(SEED.read_text() + "exploration: {rate: 0.5, speculative_engine: draft, "
                                      "window_s: 1}\n")
    bundle = policies.CompiledBundle(policies.BundlePayload(policies.Revision.of(switchback)))
    sidecar = make_sidecar(bundle=bundle)
    salt = "explore:" + switchback.name
    engines_by_window: dict[int, set[str]] = {}
    deadline = time.monotonic() + 30
    sent = 0
    # until both kinds of window were seen, with several requests in each
    while time.monotonic() < deadline:
        response = post(sidecar)
        assert response.status_code == 200
        sent += 1
        event = sidecar.exporter.wait(sent)[-1]
        window = int(event.time.timestamp() // 1)
        explored = policies.sticky_fraction(f"window:{window}", salt) < 0.5
        assert event.explored is explored
        assert event.engine == ("base" if explored else "draft")  # chat at batch 1 speculates unless explored
        assert decision_fields(response.headers["x-specgate-decision"])["explored"] == str(explored).lower()
        engines_by_window.setdefault(window, set()).add(event.engine)
        kinds = {next(iter(e)) for e in engines_by_window.values() if len(e) == 1}
        if kinds == {"base", "draft"} and sent >= 20:
            break
        time.sleep(0.05)
    assert all(len(engines) == 1 for engines in engines_by_window.values()), engines_by_window
    assert {next(iter(e)) for e in engines_by_window.values()} == {"base", "draft"}
    assert len(draft.requests) + len(base.requests) == sent


def test_no_policy_yet_is_503_and_not_ready(make_sidecar: SidecarFactory, base: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=None)
    response = post(sidecar)
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["detail"] == "no policy loaded yet"
    assert httpx.get(sidecar.url + "/readyz").status_code == 503
    assert httpx.get(sidecar.url + "/healthz").status_code == 200
    assert not base.requests
    sidecar.store.update(seed_bundle())
    assert httpx.get(sidecar.url + "/readyz").status_code == 200
    assert post(sidecar).status_code == 200


def test_bad_body_is_400_without_an_event(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar()
    for content in (b"{not json", b"[1, 2]"):
        response = httpx.post(sidecar.url + CHAT, content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == 400
        assert response.headers["content-type"] == "application/problem+json"
    time.sleep(0.05)
    assert sidecar.exporter.events == []


# --- per-request engine metrics -----------------------------------------------------------------------

def test_json_answer_loses_metrics_and_the_event_gets_them(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar()
    answer = post(sidecar).json()
    assert "metrics" not in answer
    assert answer["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
    assert answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 tok4 "
    event = sidecar.exporter.one()
    expected = engine_metrics(True)
    assert (event.spec_draft_tokens, event.spec_accepted_tokens, event.spec_acceptance_rate,
            event.spec_mean_acceptance_length, event.spec_steps) == (
        SPEC_METRICS["num_draft_tokens"], SPEC_METRICS["num_accepted_draft_tokens"],
        SPEC_METRICS["draft_acceptance_rate"], SPEC_METRICS["mean_acceptance_length"], SPEC_METRICS["num_spec_steps"])
    assert (event.engine_ttft_ms, event.engine_itl_ms, event.engine_queue_ms) == (
        expected["time_to_first_token_ms"], expected["mean_itl_ms"], expected["queue_time_ms"])
    assert (event.prompt_tokens, event.completion_tokens, event.status, event.http_status) == (11, 5, "ok", 200)
    assert event.ttft_ms is None  # no chunk reached the client before the whole answer
    assert event.itl_ms == expected["mean_itl_ms"]  # the time per output token the engine measured
    assert event.e2e_ms > 0
    # the event is valid by its own schema, holds every field in field order (TelemetryEvent.trusted), and
    # its batch's fast JSON is pydantic's to the byte
    TelemetryEvent.model_validate(event.model_dump())
    assert list(event.__dict__) == list(TelemetryEvent.model_fields)
    assert event.model_fields_set == set(TelemetryEvent.model_fields)
    batch = TelemetryBatch(batch_id="b", worker_id="w", events=[event])
    assert batch.to_json() == batch.model_dump_json().encode()


def test_plain_engine_has_no_speculative_numbers(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar()
    post(sidecar, route="other")
    event = sidecar.exporter.one()
    assert event.engine == "base"
    assert event.spec_draft_tokens is None
    assert event.spec_acceptance_rate is None
    assert event.engine_itl_ms == engine_metrics(False)["mean_itl_ms"]


def test_expose_engine_metrics_keeps_them(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar(expose_engine_metrics=True)
    assert post(sidecar).json()["metrics"] == engine_metrics(True)


def test_the_expose_engine_metrics_setting_turns_it_on_for_a_deployed_sidecar() -> None:
    on = build_app(SidecarSettings(expose_engine_metrics=True), policies.PolicyStore(), RecordingExporter())
    off = build_app(SidecarSettings(), policies.PolicyStore(), RecordingExporter())
    assert (on.expose_engine_metrics, off.expose_engine_metrics) == (True, False)


# --- streaming ---------------------------------------------------------------------------------------

def test_stream_usage_chunk_is_added_for_us_and_stripped(make_sidecar: SidecarFactory, draft: FakeEngine) -> None:
    sidecar = make_sidecar()
    response = post(sidecar, stream=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse(response.text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e and "metrics" not in e for e in events[:-1])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "tok0 tok1 tok2 tok3 tok4 "
    assert draft.requests[0]["body"]["stream_options"] == {"include_usage": True}
    event = sidecar.exporter.one()
    assert (event.stream, event.completion_tokens, event.spec_draft_tokens) == (True, 5, 12)
    assert event.ttft_ms is not None
    assert event.ttft_ms <= event.e2e_ms


def test_stream_usage_chunk_kept_when_the_client_asked(make_sidecar: SidecarFactory, draft: FakeEngine) -> None:
    sidecar = make_sidecar()
    options = {"include_usage": True, "continuous_usage_stats": False}
    events = sse(post(sidecar, stream=True, stream_options=options).text)
    usage_chunks = [e for e in events[:-1] if e["choices"] == []]
    assert len(usage_chunks) == 1
    assert usage_chunks[0]["usage"]["completion_tokens"] == 5
    assert "metrics" not in usage_chunks[0]
    assert draft.requests[0]["body"]["stream_options"] == options
    assert sidecar.exporter.one().spec_accepted_tokens == 7


def test_completions_stream_with_explicit_no_usage(make_sidecar: SidecarFactory, base: FakeEngine) -> None:
    sidecar = make_sidecar()
    response = post(sidecar, path="/v1/completions", route=None, stream=True,
                    stream_options={"include_usage": False})
    events = sse(response.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "tok0 tok1 tok2 tok3 tok4 "
    assert all(e["choices"] for e in events[:-1])
    assert base.requests[0]["body"]["stream_options"] == {"include_usage": True}
    assert sidecar.exporter.one().completion_tokens == 5


def test_stream_is_relayed_as_it_arrives(make_sidecar: SidecarFactory, draft: FakeEngine) -> None:
    draft.tokens = 6
    draft.token_delay = 0.1
    sidecar = make_sidecar()
    first_content_at = None
    received = b""
    with httpx.stream("POST", sidecar.url + CHAT, json=body(stream=True),
                      headers={"X-Specgate-Route": "chat", "X-Request-Id": "slow-1"}) as response:
        for chunk in response.iter_raw():
            received += chunk
            if first_content_at is None and b"tok0" in received:
                first_content_at = time.monotonic()
    assert first_content_at is not None
    # the client had the first token before the engine even sent its last one: nothing was buffered
    assert first_content_at < draft.last_sent["slow-1"] - 0.3
    event = sidecar.exporter.one()
    assert event.ttft_ms is not None
    assert event.ttft_ms < 100
    assert event.itl_ms is not None
    assert 70 < event.itl_ms < 300
    assert event.e2e_ms > 450


# --- fallback ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["refused", "5xx", "status_600", "slow_connect", "closed_before_answer"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_failing_speculative_engine_falls_back_to_base(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                       base: FakeEngine, fault: str, stream: bool) -> None:
    blackhole = Blackhole() if fault == "slow_connect" else None
    try:
        draft_url = draft.url
        if fault == "refused":
            draft_url = f"http://127.0.0.1:{closed_port()}"
        elif blackhole is not None:
            draft_url = blackhole.url
        elif fault == "5xx":
            draft.fail_status = 503
        elif fault == "status_600":
            draft.fail_status = 600
        else:
            draft.drop_after = 0
        sidecar = make_sidecar(engines={"draft": draft_url, "base": base.url}, upstream_connect_timeout_s=0.3)
        response = post(sidecar, stream=stream)
    finally:
        if blackhole is not None:
            blackhole.close()
    assert response.status_code == 200
    if stream:
        assert sse(response.text)[-1] == "[DONE]"
    else:
        assert response.json()["choices"][0]["message"]["content"].startswith("tok0")
    assert response.headers["x-specgate-decision"].startswith("engine=draft;")
    reason = {"refused": "connect_error", "5xx": "upstream_503", "status_600": "upstream_disconnected",
              "slow_connect": "connect_timeout", "closed_before_answer": "upstream_disconnected"}[fault]
    assert response.headers["x-specgate-fallback"] == f"engine=base; reason={reason}"
    assert len(base.requests) == 1
    event = sidecar.exporter.one()
    assert (event.engine, event.decided_engine, event.retries, event.fallback, event.fallback_reason,
            event.status) == ("base", "draft", 1, True, reason, "ok")
    # the closed sets, as the proxy builds them: valid by the contract the control plane checks
    assert type(event.status) is EventStatus
    assert event.fallback_reason is not None
    assert is_fallback_reason(event.fallback_reason)
    assert TelemetryEvent.model_validate_json(event.model_dump_json()) == event
    assert event.spec_draft_tokens is None  # the plain engine served it


def test_plain_engine_5xx_passes_through_without_retry(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                       base: FakeEngine) -> None:
    base.fail_status = 500
    sidecar = make_sidecar()
    response = post(sidecar, route="other")
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "injected failure"
    assert len(base.requests) == 1
    assert not draft.requests
    event = sidecar.exporter.one()
    assert (event.status, event.http_status, event.retries, event.fallback) == ("upstream_error", 500, 0, False)


def test_both_engines_down_is_502(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar(engines={"draft": f"http://127.0.0.1:{closed_port()}",
                                    "base": f"http://127.0.0.1:{closed_port()}"})
    response = post(sidecar)
    assert response.status_code == 502
    assert response.headers["content-type"] == "application/problem+json"
    assert "x-specgate-decision" in response.headers
    event = sidecar.exporter.one()
    assert (event.status, event.http_status, event.retries, event.engine) == ("upstream_error", 502, 1, "base")


def test_engine_not_configured_uses_the_fallback(make_sidecar: SidecarFactory, base: FakeEngine) -> None:
    sidecar = make_sidecar(engines={"base": base.url})
    response = post(sidecar)
    assert response.status_code == 200
    assert response.headers["x-specgate-decision"].startswith("engine=draft;")
    assert len(base.requests) == 1
    event = sidecar.exporter.one()
    assert (event.engine, event.decided_engine, event.fallback, event.fallback_reason, event.retries) == (
        "base", "draft", True, "engine_not_configured", 0)
    assert event.fallback_reason is FallbackReason.engine_not_configured
    assert sidecar.app.metrics.fallbacks == {"engine_not_configured": 1}


def test_mid_stream_break_is_not_retried(make_sidecar: SidecarFactory, draft: FakeEngine,
                                         base: FakeEngine) -> None:
    draft.tokens = 6
    draft.drop_after = 2
    sidecar = make_sidecar()
    events = sse(post(sidecar, stream=True).text)
    contents = [e["choices"][0]["delta"].get("content") for e in events if isinstance(e, dict) and e.get("choices")]
    assert contents == ["", "tok0 ", "tok1 "]
    assert events[-1]["error"]["type"] == "upstream_error"
    assert "[DONE]" not in events
    assert not base.requests
    event = sidecar.exporter.one()
    assert (event.status, event.retries, event.fallback, event.engine) == ("upstream_error", 0, False, "draft")


def test_an_api_request_reaches_the_engine_with_its_query_string_on_the_retry_too(
        make_sidecar: SidecarFactory, draft: FakeEngine, base: FakeEngine) -> None:
    draft.fail_status = 503
    sidecar = make_sidecar()
    response = httpx.post(sidecar.url + CHAT + "?api-version=2&x=%2F", json=body(),
                          headers={"X-Specgate-Route": "chat"}, timeout=10)
    assert response.status_code == 200
    assert response.headers["x-specgate-fallback"] == "engine=base; reason=upstream_503"
    assert [(r["path"], r["query"]) for r in draft.requests + base.requests] == [
        (CHAT, "api-version=2&x=%2F"), (CHAT, "api-version=2&x=%2F")]


# --- client disconnects ------------------------------------------------------------------------------

# The sidecar's own server tells the app of a disconnect by a callback; under any other ASGI server (uvicorn
# here) the app learns it from receive(). Both must cancel the engine's request.
SERVERS = pytest.mark.parametrize("server", ["specgate", "uvicorn"])


@SERVERS
def test_client_disconnect_mid_stream_cancels_the_upstream(make_sidecar: SidecarFactory,
                                                           draft: FakeEngine, server: str) -> None:
    draft.tokens = 50
    draft.token_delay = 0.05
    sidecar = make_sidecar(server=server)
    with httpx.stream("POST", sidecar.url + CHAT, json=body(stream=True),
                      headers={"X-Specgate-Route": "chat", "X-Request-Id": "gone-1"}) as response:
        for chunk in response.iter_raw():
            if b"tok0" in chunk:
                break
    wait_for(lambda: "gone-1" in draft.disconnects, timeout=3)
    event = sidecar.exporter.one()
    assert (event.status, event.request_id) == ("client_disconnect", "gone-1")
    assert event.e2e_ms < 2000
    assert sidecar.app.inflight.count == 0


@SERVERS
def test_client_disconnect_while_waiting_for_a_json_answer(make_sidecar: SidecarFactory,
                                                           draft: FakeEngine, server: str) -> None:
    draft.first_byte_delay = 5.0
    sidecar = make_sidecar(server=server)
    with pytest.raises(httpx.ReadTimeout):
        post(sidecar, headers={"X-Request-Id": "gone-2"}, timeout=0.3)
    wait_for(lambda: "gone-2" in draft.disconnects, timeout=3)
    assert sidecar.exporter.one().status == "client_disconnect"


# --- structured output ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("fmt", "content", "valid"), [
    ("schema", '{"a": 1}', True),
    ("schema", '{"a": "x"}', False),
    ("schema", "not json", False),
    ("so_json", '{"a": 2}', True),
    ("so_json", '{"b": 2}', False),
    ("object", '{"b": 2}', True),
    ("object", "[1, 2]", False),
    ("regex", "abc", None),
])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_structured_output_validity(make_sidecar: SidecarFactory, base: FakeEngine, fmt: str, content: str,
                                    valid: bool | None, stream: bool) -> None:
    base.content = content
    formats: dict[str, dict[str, Any]] = {
        "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
        "so_json": {"structured_outputs": {"json": SCHEMA}},
        "object": {"response_format": {"type": "json_object"}},
        "regex": {"structured_outputs": {"regex": "[a-z]+"}},
    }
    extra = formats[fmt]
    sidecar = make_sidecar()
    response = post(sidecar, stream=stream, **extra)
    assert response.status_code == 200
    event = sidecar.exporter.one()
    assert (event.engine, event.structured_output, event.structured_valid) == ("base", True, valid)


def test_no_schema_no_verdict(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar()
    post(sidecar)
    assert sidecar.exporter.one().structured_valid is None


# --- other paths, /metrics, the hook ---------------------------------------------------------------------

def test_other_paths_pass_through_to_the_plain_engine(make_sidecar: SidecarFactory, draft: FakeEngine) -> None:
    sidecar = make_sidecar()
    models = httpx.get(sidecar.url + "/v1/models")
    assert models.json()["data"][0]["owned_by"] == "base"
    echo = httpx.post(sidecar.url + "/detokenize?x=1&y=2", content=b"raw body", headers={"X-Custom": "yes"})
    assert echo.json() == {"engine": "base", "method": "POST", "path": "/detokenize", "query": "x=1&y=2",
                           "body": "raw body", "x_custom": "yes"}
    assert httpx.delete(sidecar.url + "/status207").status_code == 207
    moved = httpx.post(sidecar.url + "/moved", content=b"{}")
    assert (moved.status_code, moved.headers["location"], moved.headers["x-fake-engine"]) == (
        307, "/v1/models", "base")
    assert not draft.requests
    time.sleep(0.05)
    assert sidecar.exporter.events == []


def test_metrics_endpoint_counts(make_sidecar: SidecarFactory, base: FakeEngine) -> None:
    sidecar = make_sidecar(engines={"draft": f"http://127.0.0.1:{closed_port()}", "base": base.url})
    post(sidecar)  # draft refused -> fallback to base
    post(sidecar, route="other")
    sidecar.exporter.wait(2)
    wait_for(lambda: sum(sidecar.app.metrics.requests.values()) == 2)
    text = httpx.get(sidecar.url + "/metrics").text
    assert sidecar.store.current is not None
    revision = sidecar.store.current.active.revision
    for line in (
        'specgate_sidecar_decisions_total{engine="draft",rule="chat-low-batch"} 1.0',
        'specgate_sidecar_decisions_total{engine="base",rule="default"} 1.0',
        'specgate_sidecar_requests_total{engine="base",status="ok"} 2.0',
        'specgate_sidecar_fallbacks_total{reason="connect_error"} 1.0',
        'specgate_sidecar_upstream_errors_total{engine="draft"} 1.0',
        "specgate_sidecar_in_flight 0.0",
        "specgate_sidecar_telemetry_queue_depth 7.0",
        f'specgate_sidecar_active_revision{{policy="seed",revision="{revision}",role="active"}} 1.0',
        "specgate_sidecar_kill_switch 0.0",
        'specgate_sidecar_request_duration_seconds_count{engine="base"} 2.0',
    ):
        assert line in text, line


def test_a_failing_hook_changes_nothing_for_the_client(make_sidecar: SidecarFactory) -> None:
    def explode(event: TelemetryEvent) -> None:
        raise RuntimeError("otel is down")

    sidecar = make_sidecar(on_event=explode)
    assert post(sidecar).status_code == 200
    assert post(sidecar).status_code == 200
    sidecar.exporter.wait(2)
    wait_for(lambda: sidecar.app.metrics.hook_errors == 2)
    assert "specgate_sidecar_hook_errors_total 2.0" in httpx.get(sidecar.url + "/metrics").text


def test_labels_header_reaches_the_policy(make_sidecar: SidecarFactory, draft: FakeEngine, base: FakeEngine) -> None:
    document = policies.load_policy(
        "apiVersion: specgate/v1\nname: tenants\n"
        "engines: {base: {method: none}, draft: {method: draft_model, model: m, num_speculative_tokens: 2}}\n"
        "rules:\n  - name: gold\n    when: {labels: {tier: [gold]}}\n    then: {engine: draft}\n"
        "default: {engine: base}\n")
    sidecar = make_sidecar(bundle=policies.CompiledBundle(policies.BundlePayload(policies.Revision.of(document))))
    gold = post(sidecar, route=None, headers={"X-Specgate-Labels": "tenant=acme, tier=gold"})
    plain = post(sidecar, route=None, headers={"X-Specgate-Labels": "tier=silver"})
    assert decision_fields(gold.headers["x-specgate-decision"])["rule"] == "gold"
    assert decision_fields(plain.headers["x-specgate-decision"])["rule"] == "default"
    assert len(draft.requests) == 1
    assert len(base.requests) == 1
    # the sidecar's own headers are not forwarded to the engine
    assert not any(name.startswith("x-specgate-") for name in draft.requests[0]["headers"])


def test_engine_4xx_passes_through_as_an_error(make_sidecar: SidecarFactory, base: FakeEngine) -> None:
    base.fail_status = 400
    sidecar = make_sidecar()
    response = post(sidecar, route="other")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == 400
    event = sidecar.exporter.one()
    assert (event.status, event.http_status, event.retries) == ("error", 400, 0)
