"""The telemetry event: one per request, the contract between sidecar and control plane.

The event says exactly what the control plane accepts, the store's limits
included, so that a producer can check an event with this model alone:

- integers at most :data:`MAX_INT` (the store's columns are 32-bit; its sums
  64-bit) where a field has no smaller bound of its own;
- numbers finite, and at most :data:`MAX_FLOAT` where a field has no smaller
  bound (one latency of infinity, NaN or 1e300 would poison every sum it joins);
- strings without NUL characters (PostgreSQL text cannot hold them) where a
  field has no pattern of its own;
- ``status`` one of :class:`EventStatus`; ``fallback_reason`` one of
  :class:`FallbackReason` or ``upstream_5NN`` (:func:`upstream_status_reason`).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

EVENT_SCHEMA_VERSION = 1
MAX_LABELS_CHARS = 2048
MAX_INT = 2**31 - 1
MAX_FLOAT = 1e12
NO_NUL = r"^[^\x00]*$"
_set = object.__setattr__


class EventStatus(StrEnum):
    """How a request ended, as the sidecar saw it."""

    ok = "ok"  # answered below 400
    error = "error"  # a 4xx from the engine, no engine configured, or the sidecar failed or shut down under it
    client_disconnect = "client_disconnect"  # the client went away before the answer was complete
    upstream_error = "upstream_error"  # a 5xx, no answer from any engine tried, or a stream that broke or said error


class FallbackReason(StrEnum):
    """Why a request ran on the policy's fallback engine instead of the decided one.

    Besides these, an engine that answers a 5xx before the client got a byte
    is the reason ``upstream_<status>`` (:func:`upstream_status_reason`).
    """

    engine_not_configured = "engine_not_configured"  # the decided engine is not one of this worker's
    connect_error = "connect_error"  # refused, unreachable
    connect_timeout = "connect_timeout"
    read_timeout = "read_timeout"  # no byte from the engine for the read timeout
    upstream_disconnected = "upstream_disconnected"  # closed early, or not HTTP
    # every replica of the decided engine's pool is ejected, or queues beyond the sidecar's bound
    pool_unavailable = "pool_unavailable"
    pool_saturated = "pool_saturated"


_UPSTREAM_STATUS = "upstream_5[0-9][0-9]"
FALLBACK_REASON_PATTERN = f"^({'|'.join(FallbackReason)}|{_UPSTREAM_STATUS})$"
_FALLBACK_REASON = re.compile(FALLBACK_REASON_PATTERN)


def upstream_status_reason(status: int) -> str:
    """The fallback reason of an engine that answered ``status``, a 5xx, before the client got a byte."""
    if not 500 <= status <= 599:
        raise ValueError(f"only a 5xx answer is a fallback reason, not {status}")
    return f"upstream_{status}"


def is_fallback_reason(value: str) -> bool:
    """Whether ``value`` is one of the closed set of fallback reasons (the fixed ones or ``upstream_5NN``)."""
    return _FALLBACK_REASON.fullmatch(value) is not None


# An enum inline, not as a $ref: the event's schema is embedded in other documents (the OpenAPI document's
# request body) where a reference to the event's own $defs would not resolve.
_STATUS_SCHEMA = WithJsonSchema({"type": "string", "enum": [s.value for s in EventStatus],
                                 "description": "how the request ended"})


class TelemetryEvent(BaseModel):
    """One decided request as the sidecar saw it; every limit here is one the control plane enforces."""

    model_config = ConfigDict(extra="forbid")

    event_id: str = Field(min_length=1, max_length=64, pattern=NO_NUL, description="unique per event; dedup key")
    request_id: str = Field(min_length=1, max_length=128, pattern=NO_NUL)
    time: dt.datetime = Field(description="request admission, UTC")
    worker_id: str = Field(min_length=1, max_length=128, pattern=NO_NUL)
    pool: str = Field(max_length=128, pattern=NO_NUL)
    route: str = Field(max_length=128, pattern=NO_NUL)
    model: str = Field(max_length=256, pattern=NO_NUL)
    # the decision
    policy: str = Field(max_length=63, pattern=NO_NUL)
    revision: str = Field(max_length=64, pattern=NO_NUL)
    rule: str = Field(max_length=63, pattern=NO_NUL)
    engine: str = Field(max_length=63, pattern=NO_NUL, description="engine the request finally ran on")
    decided_engine: str = Field(max_length=63, pattern=NO_NUL, description="engine the decision chose")
    replica: str | None = Field(default=None, max_length=255, pattern=NO_NUL,
                                description="the replica of ``engine`` that served it (HOST:PORT[/PREFIX]); "
                                "null from sidecars before replica pools, or when no replica was tried")
    speculate: bool
    num_speculative_tokens: int = Field(ge=0, le=16)
    explored: bool
    canary: bool = Field(description="decided by a traffic-rollout canary revision")
    kill_switch: bool
    # the request
    batch_size: int = Field(ge=0, le=MAX_INT)
    stream: bool
    structured_output: bool
    tools: bool
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    # what else the decision saw, so that a recorded request can be decided again (what-if replays)
    shape_prompt_tokens: int | None = Field(default=None, ge=0, le=MAX_INT,
                                            description="prompt tokens as the decision estimated them")
    labels: str = Field(default="{}", max_length=MAX_LABELS_CHARS, pattern=NO_NUL,
                        description="the request's labels: a JSON object of strings, keys sorted, compact")
    prompt_tokens: int | None = Field(default=None, ge=0, le=MAX_INT, description="as the engine counted them")
    completion_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    # timing as the sidecar saw it, milliseconds
    ttft_ms: float | None = Field(default=None, ge=0, le=MAX_FLOAT, allow_inf_nan=False,
                                  description="streams only: to the first content chunk")
    itl_ms: float | None = Field(default=None, ge=0, le=MAX_FLOAT, allow_inf_nan=False,
                                 description="mean inter-token latency: between the relayed chunks of a stream; "
                                 "for a JSON answer the engine's own mean")
    e2e_ms: float = Field(ge=0, le=MAX_FLOAT, allow_inf_nan=False)
    # outcome
    status: Annotated[EventStatus, _STATUS_SCHEMA]
    http_status: int | None = Field(default=None, ge=100, le=599)
    retries: int = Field(default=0, ge=0, le=MAX_INT)
    fallback: bool = False
    fallback_reason: str | None = Field(default=None, pattern=FALLBACK_REASON_PATTERN,
                                        description="why the request ran on the fallback engine")
    structured_valid: bool | None = Field(default=None, description="output parsed and matched the schema")
    # the engine's own per-request numbers (vLLM per-request metrics), when it reported them
    spec_draft_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    spec_accepted_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    spec_acceptance_rate: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    spec_mean_acceptance_length: float | None = Field(default=None, ge=0, le=MAX_FLOAT, allow_inf_nan=False)
    spec_steps: int | None = Field(default=None, ge=0, le=MAX_INT)
    engine_ttft_ms: float | None = Field(default=None, ge=0, le=MAX_FLOAT, allow_inf_nan=False)
    engine_itl_ms: float | None = Field(default=None, ge=0, le=MAX_FLOAT, allow_inf_nan=False)
    engine_queue_ms: float | None = Field(default=None, ge=0, le=MAX_FLOAT, allow_inf_nan=False)
    # a shadow comparison (the policy's ``quality``): the same greedy request sent again to the plain engine,
    # off the client's path, and the two answers compared; all null when the request was not compared
    shadow_match: bool | None = Field(default=None, description="the plain engine's answer has the same output "
                                      "(text, tool calls, finish reason) as the one the client got")
    shadow_first_diff: int | None = Field(default=None, ge=0, le=MAX_INT,
                                          description="the index of the first output token that differs, both "
                                          "answers' texts tokenized by the plain engine (re-tokenized text: "
                                          "it can differ from the ids generated); null when the answers match "
                                          "or the engine cannot tokenize")
    shadow_structured_valid: bool | None = Field(default=None, description="structured output: the plain "
                                                 "engine's answer parsed and matched the schema "
                                                 "(``structured_valid`` is the served answer's)")
    shadow_check_passed: bool | None = Field(default=None, description="the worker's own quality check "
                                             "(--quality-check) on the two answers; null when none ran or it "
                                             "failed to run")
    shadow_check_reason: str | None = Field(default=None, max_length=256, pattern=NO_NUL,
                                            description="what the quality check said")

    @field_validator("labels")
    @classmethod
    def _labels_object(cls, value: str) -> str:
        if value == "{}":
            return value
        try:
            data = json.loads(value)
        except ValueError:
            raise ValueError("labels must be a JSON object of strings") from None
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError("labels must be a JSON object of strings")
        return value

    @classmethod
    def trusted(cls, **values: Any) -> TelemetryEvent:
        """An event from values its builder vouches for, every field given in field order; nothing is checked.

        What ``model_construct(_fields_set=<all fields>, **values)`` builds, without its per-field walk over
        aliases and defaults, which costs ~13 us for this model, against ~3 us here: it runs once per request
        on the sidecar's event loop. ``tests/wire/test_telemetry.py`` checks the two agree.
        """
        event = cls.__new__(cls)
        _set(event, "__dict__", values)
        _set(event, "__pydantic_fields_set__", set(values))
        _set(event, "__pydantic_extra__", None)
        _set(event, "__pydantic_private__", None)
        return event


def encode_labels(labels: Mapping[str, str]) -> str:
    """The ``labels`` field of an event: keys sorted, compact, so equal label sets are equal strings.

    Labels that would not fit in MAX_LABELS_CHARS are left out (the last keys first).
    """
    if not labels:
        return "{}"
    kept = dict(sorted(labels.items()))
    text = json.dumps(kept, separators=(",", ":"), ensure_ascii=False)
    if len(text) <= MAX_LABELS_CHARS:
        return text
    # Too long: keep the longest prefix of the sorted pairs that fits, each pair serialised once (dropping one
    # label at a time and serialising the rest again was quadratic in the number of labels).
    pairs: list[str] = []
    size = 2  # the braces
    for key, value in kept.items():
        pair = json.dumps(key, ensure_ascii=False) + ":" + json.dumps(value, ensure_ascii=False)
        size += len(pair) + (1 if pairs else 0)
        if size > MAX_LABELS_CHARS:
            break
        pairs.append(pair)
    return "{" + ",".join(pairs) + "}"


class TelemetryBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_id: str = Field(min_length=1, max_length=64, description="idempotency key of this batch")
    worker_id: str = Field(min_length=1, max_length=128)
    schema_version: int = EVENT_SCHEMA_VERSION
    events: list[TelemetryEvent] = Field(max_length=10_000)

    def to_json(self) -> bytes:
        """The bytes of ``model_dump_json()``, from orjson in a third of the time (~1 us an event).

        The two agree on every value of a field's type (floats, datetimes with ``Z`` for UTC, strings), which
        is what validated events and the proxy's events hold; where orjson refuses a value (an integer beyond
        64 bits, a lone surrogate), pydantic dumps the batch.
        """
        try:
            return orjson.dumps({"batch_id": self.batch_id, "worker_id": self.worker_id,
                                 "schema_version": self.schema_version,
                                 "events": [event.__dict__ for event in self.events]}, option=orjson.OPT_UTC_Z)
        except TypeError:
            return self.model_dump_json().encode()
