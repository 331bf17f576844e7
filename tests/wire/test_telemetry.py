"""The event contract: its store limits and closed code sets, and its fast paths (``TelemetryEvent.trusted``,
``TelemetryBatch.to_json``) against pydantic's own."""

from __future__ import annotations

import copy
import datetime as dt
import pickle
import re
import zoneinfo
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.support import paths
from wire.telemetry import (
    FALLBACK_REASON_PATTERN,
    MAX_FLOAT,
    MAX_INT,
    EventStatus,
    FallbackReason,
    TelemetryBatch,
    TelemetryEvent,
    is_fallback_reason,
    upstream_status_reason,
)

FIELDS = list(TelemetryEvent.model_fields)


def values(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        event_id="e" * 32, request_id="r-1", time=dt.datetime(2026, 12, 3, 13, 35, 6, 123456, dt.UTC),
        worker_id="127.0.0.1:9000", pool="default", route="chat", model="m", policy="seed", revision="a" * 64,
        rule="chat-low-batch", engine="draft", decided_engine="draft", replica="10.0.0.5:8000", speculate=True,
        num_speculative_tokens=3,
        explored=False, canary=False, kill_switch=False, batch_size=2, stream=False, structured_output=False,
        tools=False, max_tokens=16, shape_prompt_tokens=12, labels='{"team":"a"}', prompt_tokens=12,
        completion_tokens=16, ttft_ms=None, itl_ms=None, e2e_ms=0.3123456789, status=EventStatus.ok, http_status=200,
        retries=0, fallback=False, fallback_reason=None, structured_valid=None, spec_draft_tokens=20,
        spec_accepted_tokens=13, spec_acceptance_rate=0.65, spec_mean_acceptance_length=2.6, spec_steps=5,
        engine_ttft_ms=1.25, engine_itl_ms=0.5, engine_queue_ms=0.01, shadow_match=False, shadow_first_diff=7,
        shadow_structured_valid=None, shadow_check_passed=True, shadow_check_reason="same meaning", sample_weight=None)
    assert list(base) == FIELDS  # trusted() wants every field in field order
    base.update(overrides)
    return base


def test_trusted_builds_what_model_construct_builds() -> None:
    fast = TelemetryEvent.trusted(**values())
    slow = TelemetryEvent.model_construct(_fields_set=set(FIELDS), **values())
    assert fast == slow
    assert list(fast.__dict__.items()) == list(slow.__dict__.items())
    assert fast.model_fields_set == slow.model_fields_set == set(FIELDS)
    assert (fast.__pydantic_extra__, fast.__pydantic_private__) == (slow.__pydantic_extra__, slow.__pydantic_private__)
    assert fast.model_dump_json() == slow.model_dump_json()
    assert TelemetryEvent.model_validate_json(fast.model_dump_json()) == fast  # valid by the schema
    assert pickle.loads(pickle.dumps(fast)) == fast
    assert copy.deepcopy(fast) == fast
    assert fast.model_copy(update={"status": "error"}).status == "error"
    fast.retries = 1  # each event owns its fields set: assignment works and touches no other event
    other = TelemetryEvent.trusted(**values())
    assert (fast.retries, other.retries) == (1, 0)
    assert other.model_fields_set is not fast.model_fields_set


def test_to_json_gives_the_bytes_of_model_dump_json() -> None:
    events = [TelemetryEvent.trusted(**values(request_id=f"r-{i}", e2e_ms=0.1 * i)) for i in range(3)]
    # the largest latency the contract accepts; larger ones (1e21, trusted) are in the property test below
    events.append(TelemetryEvent(**values(ttft_ms=1e-7, itl_ms=MAX_FLOAT, model="é €😀 \u2028 \"\\</", labels="{}")))
    batch = TelemetryBatch(batch_id="b" * 32, worker_id="w1", events=events)
    assert batch.to_json() == batch.model_dump_json().encode()
    assert TelemetryBatch.model_validate_json(batch.to_json()) == batch


def test_to_json_leaves_what_orjson_refuses_to_pydantic() -> None:
    event = TelemetryEvent.trusted(**values(batch_size=2**64))  # beyond orjson's integers
    batch = TelemetryBatch(batch_id="b", worker_id="w1", events=[event])
    assert batch.to_json() == batch.model_dump_json().encode()
    assert b'"batch_size":18446744073709551616' in batch.to_json()


ZONES = [dt.UTC, dt.timezone(dt.timedelta(0)), dt.timezone(dt.timedelta(hours=2)),
         dt.timezone(dt.timedelta(hours=-5, minutes=-30)), zoneinfo.ZoneInfo("Europe/Paris"), None]


# Values of each field's type, as validation leaves them and the proxy builds them (pydantic writes an int held
# by a float field as 350.0, orjson as 350: both valid, not the same bytes).
@settings(max_examples=300, deadline=None)
@given(e2e=st.floats(), rate=st.none() | st.floats(),
       text=st.text(st.characters(exclude_categories=["Cs"]), max_size=20),
       when=st.datetimes(timezones=st.sampled_from(ZONES)), count=st.none() | st.integers(-(2**63), 2**63 - 1))
def test_to_json_agrees_with_pydantic_on_any_value(e2e: float, rate: float | None, text: str, when: dt.datetime,
                                                   count: int | None) -> None:
    event = TelemetryEvent.trusted(**values(e2e_ms=e2e, spec_acceptance_rate=rate, model=text, fallback_reason=text,
                                            time=when, prompt_tokens=count))
    batch = TelemetryBatch(batch_id="b", worker_id="w1", events=[event])
    assert batch.to_json() == batch.model_dump_json(warnings=False).encode()


# --- the contract's limits and closed sets ----------------------------------------------------------------

def refusals(**overrides: Any) -> list[tuple[tuple[int | str, ...], str]]:
    """Where and why TelemetryEvent refuses the valid event with ``overrides``; [] when it accepts it."""
    try:
        TelemetryEvent.model_validate(values(**overrides))
    except ValidationError as exc:
        return [(e["loc"], e["type"]) for e in exc.errors()]
    return []


@pytest.mark.parametrize(("field", "value"), [
    ("batch_size", 2**31), ("prompt_tokens", 2**31), ("retries", 2**31),
    ("e2e_ms", float("nan")), ("itl_ms", float("inf")), ("spec_acceptance_rate", float("nan")),
    ("ttft_ms", 1e13), ("engine_queue_ms", 1e13),
    ("route", "ch\x00at"), ("model", "\x00"), ("labels", '{"a":"\x00"}'),
])
def test_the_store_limits_are_part_of_the_contract(field: str, value: Any) -> None:
    assert [loc for loc, _ in refusals(**{field: value})] == [(field,)]


def test_the_limits_themselves_are_accepted() -> None:
    assert refusals(batch_size=MAX_INT, prompt_tokens=MAX_INT, e2e_ms=MAX_FLOAT, ttft_ms=MAX_FLOAT,
                    route="ch\tat", model="é") == []


def test_every_field_has_a_store_limit() -> None:
    """Integers bounded by 2**31 - 1, numbers by 1e12 and finite, strings patterned or enumerated."""
    schema = TelemetryEvent.model_json_schema()
    for name, prop in schema["properties"].items():
        kinds = [v for v in prop.get("anyOf", [prop]) if v.get("type") != "null"]
        assert len(kinds) == 1, name
        kind = kinds[0]
        if kind["type"] == "integer":
            assert kind["maximum"] <= MAX_INT, name
        elif kind["type"] == "number":
            assert kind["maximum"] <= MAX_FLOAT, name
            assert refusals(**{name: float("inf")}) == [((name,), "finite_number")], name
        elif kind["type"] == "string" and kind.get("format") != "date-time":
            assert "pattern" in kind or "enum" in kind, name
            assert "$ref" not in str(prop), name  # the schema is embedded elsewhere: no references
        else:
            assert kind["type"] in ("boolean", "string"), name


def test_status_is_one_of_the_event_statuses() -> None:
    for status in EventStatus:
        assert refusals(status=status.value) == []
    assert refusals(status="meh") == [(("status",), "enum")]
    assert TelemetryEvent.model_validate(values(status="client_disconnect")).status is EventStatus.client_disconnect
    assert TelemetryEvent.model_json_schema()["properties"]["status"]["enum"] == [s.value for s in EventStatus]


def test_fallback_reasons_are_a_closed_set() -> None:
    upstream = [upstream_status_reason(status) for status in range(500, 600)]
    assert (upstream[0], upstream[-1]) == ("upstream_500", "upstream_599")
    for reason in [*FallbackReason, *upstream, None]:
        assert refusals(fallback=True, fallback_reason=reason) == [], reason
        assert reason is None or is_fallback_reason(reason)
    for bad in ("timeout", "upstream_499", "upstream_600", "upstream_5000", "upstream_50", "upstream_", "",
                "upstream_503\n", "connect_error ", "upstream_५०३"):
        assert refusals(fallback=True, fallback_reason=bad) == [(("fallback_reason",), "string_pattern_mismatch")], bad
        assert not is_fallback_reason(bad), bad
    with pytest.raises(ValueError, match="404"):
        upstream_status_reason(404)
    shown = TelemetryEvent.model_json_schema()["properties"]["fallback_reason"]["anyOf"][0]
    assert shown == {"type": "string", "pattern": FALLBACK_REASON_PATTERN}


@settings(max_examples=300, deadline=None)
@given(text=st.from_regex(r"upstream_[0-9]{1,4}|[a-z_]{0,24}", fullmatch=True) | st.text(max_size=16))
def test_the_model_and_is_fallback_reason_agree(text: str) -> None:
    assert (refusals(fallback_reason=text) == []) == is_fallback_reason(text) == bool(
        re.fullmatch(r"(engine_not_configured|connect_error|connect_timeout|read_timeout|upstream_disconnected"
                     r"|upstream_5[0-9]{2})", text, re.ASCII))


def test_the_request_path_document_explains_every_status_and_fallback_reason() -> None:
    text = (paths.ROOT / "docs" / "sidecar-request-path.md").read_text()
    first_cells = {m for line in text.splitlines() if line.lstrip().startswith("| `")
                   for m in re.findall(r"`(\w+)`", line.strip().split("|")[1])}
    assert {s.value for s in EventStatus} <= first_cells
    assert {r.value for r in FallbackReason} | {"upstream_5NN"} <= first_cells
