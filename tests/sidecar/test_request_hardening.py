"""Hardening of the OpenAI request path (issue 16, findings 1, 12 and 14): what one request may make the sidecar
hold or compute, and what it may put into a telemetry event.

Every refusal here is a 400 problem+json naming the field, answered before a decision, so no engine sees the
request and no event is made for it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sidecar.proxy as proxy
import wire.telemetry as wire_telemetry
from sidecar.classify import MAX_LABELS, MAX_LABELS_BYTES, RequestError, parse_labels
from sidecar.telemetry import TelemetryExporter, encode_event
from tests.support.fake_upstream import FakeEngine
from tests.support.ingest_double import IngestDouble, exporter_for, until
from tests.support.ingest_double import event as good_event
from tests.support.sidecars import LoopThread, Sidecar, SidecarFactory, wait_for
from wire.telemetry import MAX_INT, MAX_LABELS_CHARS, TelemetryBatch, TelemetryEvent, encode_labels

CHAT = "/v1/chat/completions"


def _post(sidecar: Sidecar, payload: dict[str, Any] | None = None, *, headers: dict[str, str] | None = None,
          timeout: float = 10.0) -> httpx.Response:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if payload is None else payload
    content = json.dumps(payload).encode()  # ensure_ascii: a lone surrogate goes as its escape, as clients send it
    # header values as bytes: latin-1, which is how the sidecar reads them
    sent = {name: value.encode("latin-1") for name, value in (headers or {}).items()}
    return httpx.post(sidecar.url + CHAT, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **sent})


def _refused(response: httpx.Response, field: str, where: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem = response.json()
    assert field in problem["detail"]
    assert [(e["path"], e["in"]) for e in problem["errors"]] == [(field, where)]
    return problem


def _nothing_reached_an_engine(sidecar: Sidecar, *engines: FakeEngine) -> None:
    assert [r for engine in engines for r in engine.requests] == []
    assert sidecar.exporter.events == []


# --- X-Specgate-Labels --------------------------------------------------------------------------------------

def _labels(count: int, width: int) -> str:
    return ",".join(f"k{i:03d}={'v' * width}" for i in range(count))


def test_labels_over_the_byte_limit_are_refused(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                base: FakeEngine) -> None:
    sidecar = make_sidecar()
    header = _labels(40, 120)
    assert len(header) > MAX_LABELS_BYTES
    problem = _refused(_post(sidecar, headers={"X-Specgate-Labels": header}), "X-Specgate-Labels", "header")
    assert problem["errors"][0]["code"] == "too_long"
    _nothing_reached_an_engine(sidecar, draft, base)


def test_labels_over_the_pair_limit_are_refused(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                base: FakeEngine) -> None:
    sidecar = make_sidecar()
    header = _labels(MAX_LABELS + 1, 1)
    assert len(header) <= MAX_LABELS_BYTES
    _refused(_post(sidecar, headers={"X-Specgate-Labels": header}), "X-Specgate-Labels", "header")
    _nothing_reached_an_engine(sidecar, draft, base)


def test_the_largest_allowed_labels_are_served_and_the_limits_are_settings(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar()
    header = _labels(MAX_LABELS, (MAX_LABELS_BYTES // MAX_LABELS) - 7)
    assert len(header) <= MAX_LABELS_BYTES
    assert _post(sidecar, headers={"X-Specgate-Labels": header}).status_code == 200
    labels = json.loads(sidecar.exporter.one().labels)
    assert list(labels) == sorted(labels)
    assert 0 < len(labels) < MAX_LABELS

    strict = make_sidecar(max_labels=2, max_labels_bytes=64)
    assert _post(strict, headers={"X-Specgate-Labels": "a=1,b=2"}).status_code == 200
    _refused(_post(strict, headers={"X-Specgate-Labels": "a=1,b=2,c=3"}), "X-Specgate-Labels", "header")


def test_parse_labels_limits() -> None:
    assert dict(parse_labels("a=1,b=2", max_pairs=2, max_bytes=7)) == {"a": "1", "b": "2"}
    with pytest.raises(RequestError, match="8 bytes"):
        parse_labels("a=1,b=22", max_pairs=2, max_bytes=7)
    with pytest.raises(RequestError, match="3 labels"):
        parse_labels("a=1,b=2,c=3", max_pairs=2)
    # a repeated key is one label
    assert dict(parse_labels("a=1,a=2,a=3", max_pairs=1)) == {"a": "3"}


def _longest_prefix_that_fits(labels: dict[str, str]) -> str:
    """The contract, computed the slow way: the longest prefix of the sorted labels that fits."""
    items = sorted(labels.items())
    for n in range(len(items), -1, -1):
        text = json.dumps(dict(items[:n]), separators=(",", ":"), ensure_ascii=False)
        if len(text) <= MAX_LABELS_CHARS:
            return text
    raise AssertionError


@pytest.mark.parametrize(("count", "width"), [(MAX_LABELS, 56), (MAX_LABELS, 3), (8000, 2), (5, 1000)])
def test_label_encoding_serialises_each_label_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch,
                                                                        count: int, width: int) -> None:
    labels = {f"k{i:04d}": "é" * width for i in range(count)}
    expected = _longest_prefix_that_fits(labels)
    serialised: list[int] = []
    real_dumps = json.dumps

    def counting(value: Any, **kwargs: Any) -> str:
        text = real_dumps(value, **kwargs)
        serialised.append(len(text))
        return text

    monkeypatch.setattr(wire_telemetry.json, "dumps", counting)
    assert encode_labels(labels) == expected
    whole = len(real_dumps(labels, separators=(",", ":"), ensure_ascii=False))
    # Linear: the labels are serialised at most about twice in all (once whole, once pair by pair). Dropping
    # one label at a time and serialising the rest again wrote ~MAX_LABELS_CHARS per dropped label.
    assert sum(serialised) <= 2 * whole + 2 * count + 2


# --- output JSON schemas ------------------------------------------------------------------------------------

def _schema(size: int, tag: str = "") -> dict[str, Any]:
    """A valid schema of about ``size`` bytes as compact JSON."""
    names = max(1, size // 40)
    return {"type": "object", "description": tag,
            "properties": {f"p{tag}{i:06d}": {"type": "integer", "minimum": 0} for i in range(names)}}


@pytest.mark.parametrize("where", ["response_format", "structured_outputs", "structured_outputs_string"])
def test_a_schema_over_the_limit_is_refused_naming_its_field(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                             base: FakeEngine, where: str) -> None:
    sidecar = make_sidecar()
    schema = _schema(80 * 1024)
    extra, field = {
        "response_format": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": schema}}},
                            "response_format.json_schema.schema"),
        "structured_outputs": ({"structured_outputs": {"json": schema}}, "structured_outputs.json"),
        "structured_outputs_string": ({"structured_outputs": {"json": json.dumps(schema)}}, "structured_outputs.json"),
    }[where]
    response = _post(sidecar, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})
    problem = _refused(response, field, "body")
    assert "65536" in problem["detail"]
    _nothing_reached_an_engine(sidecar, draft, base)


def test_the_schema_cache_stays_within_its_bytes_and_evicts_the_least_recently_used(
        make_sidecar: SidecarFactory, base: FakeEngine) -> None:
    bound = 64 * 1024
    sidecar = make_sidecar(schema_cache_bytes=bound, max_schema_bytes=16 * 1024)
    cache = sidecar.app._schemas
    base.content = '{"a": 1}'
    first = _schema(12 * 1024, "first")

    def ask(schema: dict[str, Any]) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        assert _post(sidecar, {"model": "m", "messages": [], "response_format": fmt}).status_code == 200

    for i in range(12):
        ask(first)  # kept in use: never the least recently used
        ask(_schema(12 * 1024, str(i)))
        wait_for(lambda: not cache.pending)
        assert cache.size == sum(len(key) for key in cache.entries) <= bound
        assert proxy._dumps(first) in cache.entries
    assert len(cache.entries) < 12  # schemas were evicted
    assert all(event.structured_valid is True for event in sidecar.exporter.wait(24))


def test_a_schema_compiles_off_the_loop_while_other_requests_are_served(
        make_sidecar: SidecarFactory, base: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    compiles: list[Any] = []
    real_compile = proxy.compile_output_schema

    def slow_compile(schema: Any) -> Any:
        compiles.append(schema)
        assert release.wait(20), "never released"
        return real_compile(schema)

    monkeypatch.setattr(proxy, "compile_output_schema", slow_compile)
    sidecar = make_sidecar()
    base.content = '{"p000000": 3}'
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema(4096)}}
    structured = {"model": "m", "messages": [], "response_format": fmt}
    try:
        # Two requests carrying the schema while it compiles: one compilation, both answered at once.
        for rid in ("schema-1", "schema-2"):
            assert _post(sidecar, structured, headers={"X-Request-Id": rid}, timeout=5).status_code == 200
        # The loop is free: health checks and other requests are served, and their events made.
        assert httpx.get(sidecar.url + "/healthz", timeout=5).status_code == 200
        assert _post(sidecar, headers={"X-Request-Id": "plain-1"}, timeout=5).status_code == 200
        wait_for(lambda: [e.request_id for e in sidecar.exporter.events] == ["plain-1"])
        assert len(compiles) == 1
    finally:
        release.set()
    events = sidecar.exporter.wait(3)
    assert {e.request_id: e.structured_valid for e in events} == {"plain-1": None, "schema-1": True,
                                                                  "schema-2": True}


# --- strings and numbers that reach the telemetry event ----------------------------------------------------

@pytest.mark.parametrize(("payload", "headers", "field", "where"), [
    ({"metadata": {"route": "chat\ud800"}}, {}, "metadata.route", "body"),
    ({"metadata": {"route": "a\x00b"}}, {}, "metadata.route", "body"),
    ({"metadata": {"route": "a\x1fb"}}, {}, "metadata.route", "body"),
    ({"metadata": {"route": "a\x7fb"}}, {}, "metadata.route", "body"),
    ({}, {"X-Specgate-Route": "a\tb"}, "X-Specgate-Route", "header"),
    ({"model": "m\udfff"}, {}, "model", "body"),
    ({"model": "m\x00"}, {}, "model", "body"),
    ({}, {"X-Request-Id": "id\twith-tab"}, "X-Request-Id", "header"),
], ids=["route-surrogate", "route-nul", "route-c0", "route-del", "route-header-tab", "model-surrogate",
        "model-nul", "request-id-tab"])
def test_strings_no_event_can_carry_are_refused(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                base: FakeEngine, payload: dict[str, Any],
                                                headers: dict[str, str], field: str, where: str) -> None:
    sidecar = make_sidecar()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **payload}
    _refused(_post(sidecar, body, headers=headers), field, where)
    _nothing_reached_an_engine(sidecar, draft, base)


def test_a_lone_surrogate_in_the_prompt_is_forwarded_as_the_client_sent_it(make_sidecar: SidecarFactory,
                                                                           draft: FakeEngine,
                                                                           base: FakeEngine) -> None:
    # Not the event's: the engine judges it. A stream's body is serialised again, which must not fail on it.
    sidecar = make_sidecar()
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x\ud800y"}]}
    assert _post(sidecar, body, headers={"X-Specgate-Route": "chat"}).status_code == 200
    assert [r["body"]["messages"][0]["content"] for r in draft.requests + base.requests] == ["x\ud800y"]


def test_client_numbers_beyond_the_store_are_clamped_in_the_event_only(make_sidecar: SidecarFactory,
                                                                       draft: FakeEngine, base: FakeEngine) -> None:
    sidecar = make_sidecar()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2**40,
            "max_tokens": 2**70}
    assert _post(sidecar, body, headers={"X-Specgate-Route": "chat"}).status_code == 200
    event = sidecar.exporter.one()
    assert event.max_tokens == MAX_INT
    TelemetryEvent.model_validate_json(encode_event(event))
    sent = [r["body"] for r in draft.requests + base.requests]
    assert [(b["max_completion_tokens"], b["max_tokens"]) for b in sent] == [(2**40, 2**70)]


def test_engine_numbers_beyond_the_store_are_left_out() -> None:
    assert proxy._num(2**31 - 1, integer=True) == 2**31 - 1
    assert proxy._num(2**31, integer=True) is None
    assert proxy._num(1e300) is None
    assert proxy._num(float("nan")) is None
    assert proxy._num(5.0, at_most=1.0) == 1.0


_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)  # surrogates and controls too
_number = st.one_of(st.none(), st.integers(min_value=-(2**70), max_value=2**70), st.booleans(),
                    st.floats(allow_nan=False, allow_infinity=False))
# what an HTTP client can send: visible latin-1, spaces and tabs inside (the HTTP parsers refuse the rest)
_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f")
                       | st.just("\t"), max_size=60).map(lambda value: value.strip(" \t"))


@st.composite
def _requests(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, str]]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": draw(_text)}]}
    if draw(st.booleans()):
        body["model"] = draw(st.one_of(_text, st.integers(), st.none()))
    if draw(st.booleans()):
        body["metadata"] = {"route": draw(st.one_of(_text, st.integers()))}
    for name in ("max_tokens", "max_completion_tokens"):
        if draw(st.booleans()):
            body[name] = draw(_number)
    if draw(st.booleans()):
        body["prompt"] = draw(st.lists(st.integers(min_value=0, max_value=2**40), max_size=5))
    headers = {}
    if draw(st.booleans()):
        headers["X-Specgate-Route"] = draw(_header_text)
    if draw(st.booleans()):
        headers["X-Specgate-Labels"] = draw(_header_text)
    if draw(st.booleans()):
        headers["X-Request-Id"] = draw(_header_text)
    return body, headers


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=_requests())
def test_any_request_the_sidecar_accepts_yields_an_event_the_wire_model_validates(
        make_sidecar: SidecarFactory, request: tuple[dict[str, Any], dict[str, str]]) -> None:
    body, headers = request
    sidecar = _one_sidecar(make_sidecar)
    before = len(sidecar.exporter.events)
    response = _post(sidecar, body, headers=headers)
    assert response.status_code < 500, response.text
    if response.status_code == 400:
        assert response.json()["errors"][0]["path"]
        return
    assert response.status_code == 200, response.text
    event = sidecar.exporter.wait(before + 1)[before]
    # as the control plane reads it: the exporter's bytes, parsed and validated by the wire model
    TelemetryEvent.model_validate_json(encode_event(event))


_sidecars: dict[int, Sidecar] = {}


def _one_sidecar(make_sidecar: SidecarFactory) -> Sidecar:
    """One sidecar for all of hypothesis's examples within one test run (the fixture is per test)."""
    key = id(make_sidecar)
    if key not in _sidecars:
        _sidecars.clear()
        _sidecars[key] = make_sidecar()
    return _sidecars[key]


# --- one event can never cost the others (finding 12) --------------------------------------------------------

def test_an_event_that_cannot_be_encoded_is_dropped_alone(tmp_path: Path) -> None:
    async def scenario() -> None:
        ingest = IngestDouble()
        await ingest.start()
        exporter = exporter_for(ingest, tmp_path)
        await exporter.start()
        events = [good_event(i) for i in range(40)]
        events[17] = TelemetryEvent.trusted(**{**events[17].__dict__, "route": "chat\ud800"})
        for event in events:
            exporter.submit(event)
        await until(lambda: len(ingest.accepted) == 39)
        assert sorted(ingest.accepted) == sorted(e.event_id for i, e in enumerate(events) if i != 17)
        counters = exporter.counters()
        assert (counters["sent"], counters["dropped"]) == (39, 1)
        await exporter.stop()
        await ingest.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_surrogate_route_is_refused_and_concurrent_requests_events_all_arrive(
        make_sidecar: SidecarFactory, loop_thread: LoopThread, tmp_path: Path) -> None:
    ingest = IngestDouble()
    loop_thread.run(ingest.start())
    exporter = exporter_for(ingest, tmp_path, telemetry_batch_size=1000, telemetry_flush_s=0.2)
    loop_thread.run(exporter.start())
    try:
        sidecar = make_sidecar(on_event=exporter.submit)

        def one(i: int) -> int:
            route = "chat\ud800" if i == 19 else "chat"
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": {"route": route}}
            return _post(sidecar, body, headers={"X-Request-Id": f"r{i}"}).status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(one, range(40)))
        assert statuses.count(200) == 39
        assert statuses[19] == 400
        wait_for(lambda: len(ingest.accepted) == 39, timeout=10)
        assert exporter.counters()["dropped"] == 0
    finally:
        loop_thread.run(exporter.stop())
        loop_thread.run(ingest.stop())


def test_batches_of_encoded_events_are_what_the_contract_reads(tmp_path: Path) -> None:
    exporter: TelemetryExporter = exporter_for(IngestDouble(), tmp_path)
    events = [good_event(i) for i in range(3)]
    batch = exporter._join([encode_event(e) for e in events], "b1")
    decoded = TelemetryBatch.model_validate_json(gzip.decompress(batch.body))
    assert (decoded.batch_id, decoded.worker_id, decoded.events) == ("b1", "w1", events)
    assert gzip.decompress(batch.body) == TelemetryBatch(batch_id="b1", worker_id="w1", events=events).to_json()


def test_a_stream_nested_deeper_than_the_encoders_go_is_forwarded(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                                  base: FakeEngine) -> None:
    # The sidecar adds stream_options.include_usage to a stream's body; serialising it again must not 500.
    sidecar = make_sidecar()
    deep: Any = "leaf"
    for _ in range(600):
        deep = [deep]
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}],
            "stream_options": {"continuous_usage_stats": False}, "metadata": {"deep": deep}}
    assert _post(sidecar, body, headers={"X-Specgate-Route": "chat"}).status_code == 200
    [sent] = [r["body"] for r in draft.requests + base.requests]
    assert sent["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert sent["metadata"] == {"deep": deep}
    assert sidecar.exporter.one().status == "ok"


def test_a_schema_nested_deeper_than_the_encoders_go_is_refused(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar()
    # 1010 levels: within what a body may nest (1024), beyond what orjson writes (255). The stdlib encoder
    # would go as deep as the recursion limit lets it, which an imported library may have raised: the
    # refusal must not depend on that.
    schema = '{"type":"object","properties":{"x":' * 505 + '{"type":"object"}' + "}}" * 505
    raw = '{"model":"m","messages":[],"response_format":{"type":"json_schema","json_schema":{"schema":' + schema + "}}}"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        response = httpx.post(sidecar.url + CHAT, content=raw.encode(), headers={"Content-Type": "application/json"})
    finally:
        sys.setrecursionlimit(limit)
    assert _refused(response, "response_format.json_schema.schema", "body")["errors"][0]["code"] == "too_deep"


def test_schemas_waiting_to_compile_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real_compile = proxy.compile_output_schema
    monkeypatch.setattr(proxy, "compile_output_schema", lambda schema: release.wait(20) and real_compile(schema))

    async def scenario() -> None:
        cache = proxy._SchemaCache(1 << 20, max_pending=2)
        first = cache.lookup(b'{"a":1}', {"type": "object"})
        assert isinstance(first, asyncio.Future)
        assert cache.lookup(b'{"a":1}', {"type": "object"}) is first  # one compilation per schema
        assert isinstance(cache.lookup(b'{"b":1}', {"type": "array"}), asyncio.Future)
        assert cache.lookup(b'{"c":1}', {"type": "string"}) is None  # the queue is full: no verdict
        release.set()
        validator = await first
        assert validator.is_valid({})
        assert not validator.is_valid([])
        await asyncio.sleep(0)
        assert cache.lookup(b'{"a":1}', {"type": "object"}) is validator
        assert b'{"a":1}' not in cache.pending
        cache.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
