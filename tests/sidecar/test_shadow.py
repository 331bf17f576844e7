"""Shadow comparisons on the request path: a real sidecar between a client and fake vLLM engines.

The engines are fakes (tests/support/fake_upstream.py) so that each answer can be set: the point here is what
the sidecar does with two answers. tests/e2e/test_shadow_vllm.py runs the same path on real vLLM engines.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import httpx
import pytest

import policies
from policies.evaluate import shadow_salt
from policies.shape import sticky_fraction
from sidecar.shadow import QualityCheckError
from tests.support import quality_checks
from tests.support.fake_upstream import FakeEngine
from tests.support.sidecars import Sidecar, SidecarFactory, wait_for
from wire.telemetry import EventStatus, TelemetryEvent

CHAT = "/v1/chat/completions"
POLICY = """
apiVersion: specgate/v1
name: quality
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
rules:
  - {name: chat-draft, when: {route: [chat]}, then: {engine: draft}}
  - {name: extract-draft, when: {route: [extract]}, then: {engine: draft}}
default: {engine: base}
quality: {shadow_rate: 0.05, routes: [chat]}
"""
SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}


def bundle(text: str = POLICY) -> policies.CompiledBundle:
    return policies.CompiledBundle(policies.BundlePayload(policies.Revision.of(policies.load_policy(text))))


def _ids(sampled: bool) -> itertools.islice[str]:
    salt = shadow_salt("quality")
    ids = (f"req-{i}" for i in itertools.count())
    return itertools.islice((i for i in ids if (sticky_fraction(i, salt) < 0.05) == sampled), 50)


SAMPLED = list(_ids(True))
NOT_SAMPLED = list(_ids(False))


def post(sidecar: Sidecar, request_id: str, *, route: str = "chat", **extra: Any) -> httpx.Response:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "temperature": 0, **extra}
    return httpx.post(sidecar.url + CHAT, json=payload, timeout=10.0,
                      headers={"X-Specgate-Route": route, "X-Request-Id": request_id})


def shadow_fields(event: TelemetryEvent) -> tuple[Any, ...]:
    return (event.shadow_match, event.shadow_first_diff, event.shadow_structured_valid, event.shadow_check_passed,
            event.shadow_check_reason)


def metric(sidecar: Sidecar, name: str) -> str:
    text = httpx.get(sidecar.url + "/metrics", timeout=5).text
    return "\n".join(line for line in text.splitlines() if line.startswith("specgate_sidecar_" + name))


@pytest.fixture
def sidecar(make_sidecar: SidecarFactory) -> Sidecar:
    return make_sidecar(bundle=bundle())


def test_a_sampled_greedy_request_is_compared_with_the_plain_engine(sidecar: Sidecar, draft: FakeEngine,
                                                                     base: FakeEngine) -> None:
    rid = SAMPLED[0]
    response = post(sidecar, rid, max_tokens=8)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 tok4 "
    event = sidecar.exporter.one()
    assert (event.engine, event.speculate, event.status) == ("draft", True, EventStatus.ok)
    assert shadow_fields(event) == (True, None, None, None, None)
    # the plain engine got the client's request again, under its own request id
    assert len(base.requests) == 1
    shadow = base.requests[0]
    assert shadow["headers"]["x-request-id"] == rid + "-shadow"
    assert shadow["body"] == {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
                              "temperature": 0, "max_tokens": 8}
    assert base.tokenized == []  # nothing differs: no position to count
    assert 'specgate_sidecar_shadow_comparisons_total{outcome="matched"} 1.0' in metric(sidecar, "shadow")


def test_differing_answers_record_where_they_part(sidecar: Sidecar, draft: FakeEngine, base: FakeEngine) -> None:
    draft.content = "alpha beta gamma delta"
    base.content = "alpha beta gamut delta"
    post(sidecar, SAMPLED[0])
    event = sidecar.exporter.one()
    assert event.shadow_match is False
    # both answers tokenized (the fake's tokens are words): they part at the third
    assert base.tokenized == ["alpha beta gamma delta", "alpha beta gamut delta"]
    assert event.shadow_first_diff == 2
    assert 'outcome="differed"} 1.0' in metric(sidecar, "shadow_comparisons")


def test_without_a_tokenizer_the_position_is_unknown(sidecar: Sidecar, draft: FakeEngine, base: FakeEngine) -> None:
    draft.content, base.content = "one two", "one three"
    base.tokenize_status = 404
    post(sidecar, SAMPLED[0])
    event = sidecar.exporter.one()
    assert (event.shadow_match, event.shadow_first_diff) == (False, None)


def test_a_streamed_answer_is_compared_with_a_whole_shadow(sidecar: Sidecar, draft: FakeEngine,
                                                           base: FakeEngine) -> None:
    draft.content, base.content = "x y z w", "x y z q"
    response = post(sidecar, SAMPLED[1], stream=True)
    assert response.status_code == 200
    assert "data: [DONE]" in response.text
    event = sidecar.exporter.one()
    assert (event.stream, event.shadow_match, event.shadow_first_diff) == (True, False, 3)
    # the shadow is never streamed: neither stream nor the stream_options the sidecar adds for the client's
    body = base.requests[0]["body"]
    assert "stream" not in body
    assert "stream_options" not in body


def test_structured_output_validity_of_both_answers(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                    base: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=bundle(POLICY.replace("routes: [chat]", "routes: [extract]")))
    draft.content, base.content = '{"a": 1}', '{"a": "one"}'
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    salt = shadow_salt("quality")
    rid = next(i for i in (f"x-{n}" for n in itertools.count()) if sticky_fraction(i, salt) < 0.05)
    post(sidecar, rid, route="extract", response_format=fmt)
    event = sidecar.exporter.one()
    assert (event.structured_output, event.structured_valid) == (True, True)
    assert (event.shadow_match, event.shadow_structured_valid) == (False, False)


@pytest.mark.parametrize(("extra", "route", "rid"), [
    ({"temperature": 0.7}, "chat", SAMPLED[0]),  # sampled, not greedy
    ({"temperature": None}, "chat", SAMPLED[0]),  # the engine's default temperature: not known to be greedy
    ({"n": 2}, "chat", SAMPLED[0]),
    ({}, "chat", NOT_SAMPLED[0]),  # greedy, not in the sample
    ({}, "extract", SAMPLED[0]),  # not one of quality.routes
    ({}, "other", SAMPLED[0]),  # decided plain: nothing to compare with
])
def test_requests_that_are_not_compared(sidecar: Sidecar, base: FakeEngine, draft: FakeEngine,
                                        extra: dict[str, Any], route: str, rid: str) -> None:
    post(sidecar, rid, route=route, **extra)
    event = sidecar.exporter.one()
    assert shadow_fields(event) == (None, None, None, None, None)
    shadows = [r for r in base.requests if r["headers"]["x-request-id"].endswith("-shadow")]
    assert shadows == []
    not_greedy = "outcome=\"not_greedy\"} 1.0" in metric(sidecar, "shadow_comparisons")
    assert not_greedy == (rid == SAMPLED[0] and route == "chat")


def test_a_failed_shadow_costs_the_comparison_not_the_event(sidecar: Sidecar, draft: FakeEngine,
                                                            base: FakeEngine) -> None:
    base.fail_status = 500
    response = post(sidecar, SAMPLED[0])
    assert response.status_code == 200  # the client's answer came from the speculative engine
    event = sidecar.exporter.one()
    assert event.status is EventStatus.ok
    assert shadow_fields(event) == (None, None, None, None, None)
    assert 'outcome="failed"} 1.0' in metric(sidecar, "shadow_comparisons")


def test_shadows_beyond_the_bound_are_dropped_and_the_client_never_waits(make_sidecar: SidecarFactory,
                                                                         draft: FakeEngine,
                                                                         base: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=bundle(), shadow_max_in_flight=1)
    base.first_byte_delay = 3.0
    t0 = time.monotonic()
    first = post(sidecar, SAMPLED[0])
    second = post(sidecar, SAMPLED[1])
    elapsed = time.monotonic() - t0
    assert first.status_code == second.status_code == 200
    assert elapsed < 3.0, elapsed  # neither client waited for the slow shadow
    # the second's event is handed on at once, uncompared; the first's when its shadow answers
    events = sidecar.exporter.wait(2, timeout=10)
    by_id = {e.request_id: e for e in events}
    assert by_id[SAMPLED[1]].shadow_match is None
    assert by_id[SAMPLED[0]].shadow_match is True
    assert events[0].request_id == SAMPLED[1]
    text = metric(sidecar, "shadow_comparisons")
    assert 'outcome="dropped_load"} 1.0' in text
    assert 'outcome="matched"} 1.0' in text
    assert [r["headers"]["x-request-id"] for r in base.requests] == [SAMPLED[0] + "-shadow"]


def test_a_shadow_under_way_at_shutdown_still_hands_its_event_on(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                                 base: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=bundle())
    base.first_byte_delay = 5.0
    post(sidecar, SAMPLED[0])
    wait_for(lambda: sidecar.app.metrics.shadows_in_flight == 1)
    assert sidecar.exporter.events == []
    sidecar.loop.run(sidecar.app.shutdown())
    event = sidecar.exporter.one()
    assert event.request_id == SAMPLED[0]
    assert event.shadow_match is None
    assert sidecar.app.metrics.shadows["cancelled"] == 1


def test_a_shadow_runs_against_the_canary_revisions_quality(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                            base: FakeEngine) -> None:
    # the active revision compares nothing; the canary (all traffic) compares on every route
    active = policies.Revision.of(policies.load_policy(POLICY.replace("quality: {shadow_rate: 0.05, routes: [chat]}",
                                                                      "")))
    canary = policies.Revision.of(policies.load_policy(POLICY.replace(", routes: [chat]", "")))
    payload = policies.BundlePayload(active, policies.Canary(canary, 100.0, "salt"))
    sidecar = make_sidecar(bundle=policies.CompiledBundle(payload))
    post(sidecar, SAMPLED[0], route="extract")
    event = sidecar.exporter.one()
    assert (event.canary, event.shadow_match) == (True, True)


# --- the worker's own quality check -------------------------------------------------------------------------


@pytest.mark.parametrize(("check", "passed", "reason"), [
    ("same_words", False, "served 2 words, plain 3"),
    ("always_true", True, None),
    ("async_same_length", False, "lengths"),
    ("json_equal", False, "not JSON: Expecting value: line 1 column 1 (char 0)"),
])
def test_a_quality_check_judges_the_two_answers(make_sidecar: SidecarFactory, draft: FakeEngine, base: FakeEngine,
                                                check: str, passed: bool, reason: str | None) -> None:
    sidecar = make_sidecar(bundle=bundle(), quality_check=f"tests.support.quality_checks:{check}")
    draft.content, base.content = "one two", "one two three"
    quality_checks.calls.clear()
    post(sidecar, SAMPLED[0], max_tokens=5)
    event = sidecar.exporter.one()
    assert (event.shadow_match, event.shadow_check_passed, event.shadow_check_reason) == (False, passed, reason)
    if check == "same_words":
        request, served, plain = quality_checks.calls[0]
        assert request["max_tokens"] == 5
        assert request["temperature"] == 0
        assert served == {"text": "one two", "tool_calls": [], "finish_reason": "stop"}
        assert plain["text"] == "one two three"


@pytest.mark.parametrize(("check", "reason"), [
    ("raises", "error: ValueError: validator exploded"),
    ("wrong_type", "error: TypeError: returned dict, not a bool or (bool, str)"),
    ("slow", "error: the check took longer than 0.1 s"),
])
def test_errors_in_a_quality_check_are_counted_never_fail_the_request(make_sidecar: SidecarFactory,
                                                                      draft: FakeEngine, base: FakeEngine,
                                                                      check: str, reason: str) -> None:
    sidecar = make_sidecar(bundle=bundle(), quality_check=f"tests.support.quality_checks:{check}",
                           quality_check_timeout_s=0.1)
    response = post(sidecar, SAMPLED[0])
    assert response.status_code == 200
    event = sidecar.exporter.one()
    assert (event.status, event.shadow_match) == (EventStatus.ok, True)
    assert (event.shadow_check_passed, event.shadow_check_reason) == (None, reason)
    assert "specgate_sidecar_quality_check_errors_total 1.0" in metric(sidecar, "quality_check_errors")


def test_a_check_reason_is_cut_to_what_the_event_holds(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                       base: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=bundle(), quality_check="tests.support.quality_checks:long_reason")
    post(sidecar, SAMPLED[0])
    event = sidecar.exporter.one()
    assert event.shadow_check_reason is not None
    assert len(event.shadow_check_reason) == 256
    assert "\x00" not in event.shadow_check_reason
    TelemetryEvent.model_validate(json.loads(event.model_dump_json()))  # the control plane accepts it


@pytest.mark.parametrize(("spec", "message"), [
    ("no_colon", "must be MODULE:FUNCTION"),
    ("tests.support.nowhere:f", "cannot import 'tests.support.nowhere': ModuleNotFoundError"),
    ("tests.support.quality_checks:missing", "has no 'missing'"),
    ("tests.support.quality_checks:not_callable", "'not_callable' is not callable"),
])
def test_a_check_that_cannot_be_loaded_stops_the_sidecar_with_the_reason(make_sidecar: SidecarFactory,
                                                                         spec: str, message: str) -> None:
    with pytest.raises(QualityCheckError, match="--quality-check") as error:
        make_sidecar(bundle=bundle(), quality_check=spec)
    assert message in str(error.value)


def test_the_cli_refuses_a_check_it_cannot_load(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from specgate.cli import app

    key = tmp_path / "key"
    key.write_text("sgk_x")
    result = CliRunner().invoke(app, ["sidecar", "--engine", "base=http://127.0.0.1:1", "--key-file", str(key),
                                      "--quality-check", "tests.support.quality_checks:missing"])
    assert result.exit_code == 2
    assert "--quality-check 'tests.support.quality_checks:missing'" in result.output


def test_shadow_comparisons_do_not_hold_the_event_loop(sidecar: Sidecar, draft: FakeEngine,
                                                       base: FakeEngine) -> None:
    # several sampled requests at once, each shadow slow: all clients answered, all events compared
    base.first_byte_delay = 0.3

    async def burst() -> list[int]:
        async with httpx.AsyncClient() as client:
            payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
            responses = await asyncio.gather(*(client.post(
                sidecar.url + CHAT, json=payload, timeout=10,
                headers={"X-Specgate-Route": "chat", "X-Request-Id": rid}) for rid in SAMPLED[:4]))
            return [r.status_code for r in responses]

    assert asyncio.run(burst()) == [200] * 4
    events = sidecar.exporter.wait(4, timeout=5)
    assert sorted(e.request_id for e in events) == sorted(SAMPLED[:4])
    assert all(e.shadow_match is True for e in events)


# --- what a shadow must never do: leak, lose an event, stall the loop ---------------------------------------


def _open_busy_connections(sidecar: Sidecar, engine: FakeEngine) -> int:
    """Connections to the engine taken by a request and still open (a closed one leaves the set at the next sweep)."""
    upstream = sidecar.app.pools.replicas[engine.url].upstream
    assert upstream is not None
    return sum(1 for conn in list(upstream.busy) if conn.transport is not None)


@pytest.mark.parametrize("failure", ["shadow_5xx", "no_tokenizer"])
def test_a_failed_shadow_or_tokenize_call_releases_its_connection(sidecar: Sidecar, draft: FakeEngine,
                                                                  base: FakeEngine, failure: str) -> None:
    if failure == "shadow_5xx":
        base.fail_status = 503
    else:
        draft.content, base.content = "one two", "one three"
        base.tokenize_status = 404
    for rid in SAMPLED[:3]:
        post(sidecar, rid)
    events = sidecar.exporter.wait(3)
    assert all(e.shadow_first_diff is None for e in events)
    # an answer left unread would hold its connection (and a socket on each side) until the read timeout
    assert _open_busy_connections(sidecar, base) == 0


def test_a_shadow_cancelled_before_it_started_still_hands_its_event_on(make_sidecar: SidecarFactory,
                                                                       draft: FakeEngine, base: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=bundle())
    app = sidecar.app
    held: list[Any] = []
    finish = app._finish
    app._finish = held.append  # type: ignore[method-assign]  # keep the finished call instead of finishing it
    post(sidecar, SAMPLED[0])
    wait_for(lambda: len(held) == 1)

    async def finish_then_stop() -> None:
        finish(held[0])  # the shadow task is created ...
        await app.shutdown()  # ... and cancelled in the same loop turn, before its first step

    sidecar.loop.run(finish_then_stop())
    event = sidecar.exporter.one()
    assert (event.request_id, event.shadow_match) == (SAMPLED[0], None)
    assert app.metrics.shadows == {"cancelled": 1}


def test_a_check_that_hangs_never_stalls_the_loops_threads(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                           base: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=bundle(), quality_check="tests.support.quality_checks:hangs",
                           quality_check_timeout_s=0.1, shadow_max_in_flight=2)
    quality_checks.released.clear()
    try:
        for n, rid in enumerate(SAMPLED[:5], 1):
            post(sidecar, rid)
            sidecar.exporter.wait(n)  # one comparison at a time: none is dropped for the shadow bound
        events = sidecar.exporter.events
        reasons = [e.shadow_check_reason for e in events]
        # two threads hang (the bound), the later comparisons are not checked rather than queued behind them
        assert reasons == ["error: the check took longer than 0.1 s"] * 2 + [
            "error: not run: the check still runs on 2 earlier comparisons"] * 3
        assert all(e.shadow_match is True and e.shadow_check_passed is None for e in events)

        async def default_executor_round_trip() -> None:
            await asyncio.to_thread(lambda: None)  # what the policy sync and name lookups use

        sidecar.loop.run(default_executor_round_trip(), timeout=5.0)  # not behind the stuck checks
    finally:
        quality_checks.released.set()


def test_an_object_with_an_async_call_is_awaited(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                 base: FakeEngine) -> None:
    sidecar = make_sidecar(bundle=bundle(), quality_check="tests.support.quality_checks:async_callable")
    post(sidecar, SAMPLED[0])
    event = sidecar.exporter.one()
    assert (event.shadow_check_passed, event.shadow_check_reason) == (True, None)


def test_a_plain_engine_queueing_beyond_its_bound_gets_no_shadow(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                                 base: FakeEngine) -> None:
    base.waiting = 9
    sidecar = make_sidecar(bundle=bundle(), kind="gateway", max_queue=4, engine_metrics_s=0.05)
    wait_for(lambda: sidecar.app.pools.replicas[base.url].waiting == 9)
    post(sidecar, SAMPLED[0])
    assert sidecar.exporter.one().shadow_match is None
    assert base.requests == []
    assert sidecar.app.metrics.shadows == {"dropped_load": 1}


def test_a_sampled_request_that_fell_back_is_counted_not_compared(make_sidecar: SidecarFactory,
                                                                  base: FakeEngine) -> None:
    from tests.support.fake_upstream import closed_port

    sidecar = make_sidecar(bundle=bundle(), engines={"draft": f"http://127.0.0.1:{closed_port()}",
                                                     "base": base.url})
    response = post(sidecar, SAMPLED[0])
    assert response.headers["x-specgate-fallback"].startswith("engine=base")
    event = sidecar.exporter.one()
    assert (event.fallback, event.shadow_match) == (True, None)
    assert sidecar.app.metrics.shadows == {"not_served": 1}
    assert [r["headers"]["x-request-id"] for r in base.requests] == [SAMPLED[0]]  # the fallback itself only
