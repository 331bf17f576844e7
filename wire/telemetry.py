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
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

EVENT_SCHEMA_VERSION = 1
MAX_LABELS_CHARS = 2048
MAX_INT = 2**31 - 1
MAX_FLOAT = 1e12
# Sums of a rollup delta: 64-bit columns, and room to add many deltas.
MAX_SUM = 2**53
MAX_SAMPLE_WEIGHT = 1e6
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
    # pre-aggregation (the policy's ``telemetry.raw_sample_rate`` below 1)
    sample_weight: float | None = Field(default=None, ge=1.0, le=MAX_SAMPLE_WEIGHT, allow_inf_nan=False,
                                        description="a sampled event of a pre-aggregated worker: the requests "
                                        "it stands for (1 / raw_sample_rate). Its request is counted in the "
                                        "worker's rollup deltas, so the control plane stores the event but "
                                        "adds nothing to the rollups from it; null: an event of its own, "
                                        "rolled up on arrival")

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


# The counters of a rollup row (``analysis.rollup`` defines each); a delta carries them under these names.
ROLLUP_INT_COUNTERS: tuple[str, ...] = (
    "requests", "ok", "errors", "client_disconnects", "fallbacks", "retries", "speculated", "structured_checked",
    "structured_valid", "spec_reported", "draft_tokens_sum", "accepted_tokens_sum", "spec_steps_sum",
    "spec_steps_count", "prompt_tokens_sum", "prompt_tokens_count", "completion_tokens_sum",
    "completion_tokens_count", "ttft_count", "itl_count", "itl_weighted_tokens", "shadow_compared",
    "shadow_matched", "shadow_first_diff_sum", "shadow_first_diff_count", "shadow_structured_checked",
    "shadow_structured_valid_served", "shadow_structured_valid_plain", "shadow_check_run", "shadow_check_failed",
)
ROLLUP_FLOAT_COUNTERS: tuple[str, ...] = ("e2e_ms_sum", "ttft_ms_sum", "itl_ms_sum", "itl_weighted_ms_sum")
# The latency histograms of a rollup row, each over the same fixed log buckets (``analysis.histogram``).
HISTOGRAM_METRICS: tuple[str, ...] = ("ttft", "itl", "e2e")
HISTOGRAM_BUCKETS = 48

Counter = Annotated[int, Field(ge=0, le=MAX_SUM)]
FloatSum = Annotated[float, Field(ge=0.0, le=float(MAX_SUM) * 1e3, allow_inf_nan=False)]
Bucket = Annotated[int, Field(ge=0, lt=HISTOGRAM_BUCKETS)]
BucketCounts = Annotated[dict[Bucket, Annotated[int, Field(ge=1, le=MAX_SUM)]], Field(max_length=HISTOGRAM_BUCKETS)]


class RollupDelta(BaseModel):
    """What a pre-aggregating worker adds to one rollup row: counters and histograms of its requests of one key.

    The key is the rollup row's (``analysis.rollup``): the UTC minute of the requests' admission, policy,
    revision, route, the engine they ran on, the batch-size bucket's lower bound, explored, k0; plus the
    worker's pool, held against its registration as an event's is. Deltas add: the same key may come in many
    deltas (a long request admitted in a minute already sent arrives in a later one). ``delta_id`` is the
    idempotency key (unique per worker process and sequence): a delta received twice, in one batch or two,
    is added once.
    """

    model_config = ConfigDict(extra="forbid")

    delta_id: str = Field(min_length=1, max_length=64, pattern=NO_NUL, description="unique per delta; dedup key")
    minute: dt.datetime = Field(description="the UTC minute of the requests' admission (seconds 0)")
    pool: str = Field(max_length=128, pattern=NO_NUL)
    policy: str = Field(max_length=63, pattern=NO_NUL)
    revision: str = Field(max_length=64, pattern=NO_NUL)
    route: str = Field(max_length=128, pattern=NO_NUL)
    engine: str = Field(max_length=63, pattern=NO_NUL)
    batch_bucket: int = Field(ge=0, le=MAX_INT)
    explored: bool
    k0: bool
    counters: dict[str, Counter | FloatSum] = Field(description="the rollup counters by name; a missing one is 0")
    histograms: dict[str, BucketCounts] = Field(default_factory=dict,
                                                description="latency histograms: {metric: {bucket: requests}}")

    @field_validator("minute")
    @classmethod
    def _whole_minute(cls, value: dt.datetime) -> dt.datetime:
        if value.second or value.microsecond:
            raise ValueError("must be a whole minute (seconds 0)")
        return value

    @field_validator("counters")
    @classmethod
    def _known_counters(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - _COUNTER_NAMES)
        if unknown:
            raise ValueError(f"unknown counters {unknown}; known: see ROLLUP_INT_COUNTERS and ROLLUP_FLOAT_COUNTERS")
        floats = [name for name in ROLLUP_INT_COUNTERS if type(value.get(name, 0)) is not int]
        if floats:
            raise ValueError(f"counters {floats} must be integers")
        if value.get("requests", 0) < 1:
            raise ValueError("requests must be at least 1")
        if value.get("ok", 0) + value.get("errors", 0) != value["requests"]:
            raise ValueError("ok + errors must equal requests")
        return value

    @field_validator("histograms")
    @classmethod
    def _known_metrics(cls, value: dict[str, dict[int, int]]) -> dict[str, dict[int, int]]:
        unknown = sorted(set(value) - set(HISTOGRAM_METRICS))
        if unknown:
            raise ValueError(f"unknown histograms {unknown}; known: {list(HISTOGRAM_METRICS)}")
        return value

    @model_validator(mode="after")
    def _histograms_match_counters(self) -> RollupDelta:
        # Each histogram counts the requests that have its latency: e2e every one, ttft and itl their counts.
        expected = {"e2e": self.counters["requests"], "ttft": self.counters.get("ttft_count", 0),
                    "itl": self.counters.get("itl_count", 0)}
        for metric, total in expected.items():
            counted = sum(self.histograms.get(metric, {}).values())
            if counted != total:
                raise ValueError(f"histograms.{metric} counts {counted} requests, its counter says {total}")
        return self


_COUNTER_NAMES = frozenset(ROLLUP_INT_COUNTERS + ROLLUP_FLOAT_COUNTERS)


class TelemetryBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_id: str = Field(min_length=1, max_length=64, description="idempotency key of this batch")
    worker_id: str = Field(min_length=1, max_length=128)
    schema_version: int = EVENT_SCHEMA_VERSION
    events: list[TelemetryEvent] = Field(max_length=10_000)
    rollups: list[RollupDelta] = Field(default_factory=list, max_length=10_000,
                                       description="rollup deltas of a pre-aggregating worker (the policy's "
                                                   "telemetry.raw_sample_rate below 1)")

    def to_json(self) -> bytes:
        """The bytes of ``model_dump_json()``, from orjson in a third of the time (~1 us an event).

        The two agree on every value of a field's type (floats, datetimes with ``Z`` for UTC, strings), which
        is what validated events and the proxy's events hold; where orjson refuses a value (an integer beyond
        64 bits, a lone surrogate), pydantic dumps the batch.
        """
        data = {"batch_id": self.batch_id, "worker_id": self.worker_id, "schema_version": self.schema_version,
                "events": [event.__dict__ for event in self.events],
                "rollups": [delta.model_dump(mode="json") for delta in self.rollups]}
        try:
            return orjson.dumps(data, option=orjson.OPT_UTC_Z)
        except TypeError:
            return self.model_dump_json().encode()
