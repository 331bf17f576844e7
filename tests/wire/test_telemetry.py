"""The event's fast paths: ``TelemetryEvent.trusted`` and ``TelemetryBatch.to_json`` against pydantic's own."""

from __future__ import annotations

import copy
import datetime as dt
import pickle
import zoneinfo
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from wire.telemetry import TelemetryBatch, TelemetryEvent

FIELDS = list(TelemetryEvent.model_fields)


def values(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        event_id="e" * 32, request_id="r-1", time=dt.datetime(2026, 12, 3, 13, 35, 6, 123456, dt.UTC),
        worker_id="127.0.0.1:9000", pool="default", route="chat", model="m", policy="seed", revision="a" * 64,
        rule="chat-low-batch", engine="draft", decided_engine="draft", speculate=True, num_speculative_tokens=3,
        explored=False, canary=False, kill_switch=False, batch_size=2, stream=False, structured_output=False,
        tools=False, max_tokens=16, shape_prompt_tokens=12, labels='{"team":"a"}', prompt_tokens=12,
        completion_tokens=16, ttft_ms=None, itl_ms=None, e2e_ms=0.3123456789, status="ok", http_status=200,
        retries=0, fallback=False, fallback_reason=None, structured_valid=None, spec_draft_tokens=20,
        spec_accepted_tokens=13, spec_acceptance_rate=0.65, spec_mean_acceptance_length=2.6, spec_steps=5,
        engine_ttft_ms=1.25, engine_itl_ms=0.5, engine_queue_ms=0.01)
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
    events.append(TelemetryEvent(**values(ttft_ms=1e-7, itl_ms=1e21, model="é €😀 \u2028 \"\\</", labels="{}")))
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
