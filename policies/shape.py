"""What a decision sees (the request shape) and what it returns (the Decision)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from policies.errors import ErrorCode, FieldError, RequestShapeError

_EMPTY_LABELS: Mapping[str, str] = MappingProxyType({})


@dataclass(slots=True)
class RequestShape:
    """The facts about one request that rules may test.

    ``batch_size`` counts the requests in flight on the worker when this one is
    admitted, this one included. ``engine_batch``, when set, is the batch the
    request would join on each engine it names (in replica pools: on that
    engine's least-loaded healthy replica); a rule's batch predicate reads the
    entry of the engine that rule decides for, and ``batch_size`` when there is
    none. ``max_tokens`` is None when the client did not
    set it; a range predicate on an unknown value does not match.
    ``arrival_time`` (seconds since the Unix epoch) is read only by exploration
    in time windows; without it such a policy explores nothing.
    """

    route: str = "default"
    model: str = ""
    batch_size: int = 1
    structured_output: bool = False
    tools: bool = False
    stream: bool = False
    max_tokens: int | None = None
    prompt_tokens: int = 0
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY_LABELS)
    request_id: str | None = None
    arrival_time: float | None = None
    engine_batch: Mapping[str, int] | None = None

    def batch_for(self, engine: str) -> int:
        """The batch a rule that decides for ``engine`` sees."""
        engine_batch = self.engine_batch
        if engine_batch is None:
            return self.batch_size
        return engine_batch.get(engine, self.batch_size)

    @classmethod
    def from_dict(cls, data: Any) -> RequestShape:
        """Build a shape from JSON-like data, naming every bad field."""
        if not isinstance(data, Mapping):
            raise RequestShapeError([FieldError("", ErrorCode.wrong_type, "a request shape is a mapping")])
        errors: list[FieldError] = []
        known = {f for f in cls.__dataclass_fields__}
        for key in data:
            if key not in known:
                errors.append(FieldError(str(key), ErrorCode.unknown_field, f"unknown field '{key}'"))

        def want(name: str, kinds: tuple[type, ...], label: str, optional: bool = False) -> None:
            if name not in data:
                return
            value = data[name]
            if value is None and optional:
                return
            if isinstance(value, bool) and bool not in kinds:
                errors.append(FieldError(name, ErrorCode.wrong_type, f"expected {label}, got a boolean"))
            elif not isinstance(value, kinds):
                errors.append(FieldError(name, ErrorCode.wrong_type, f"expected {label}, got {type(value).__name__}"))
            elif isinstance(value, int) and not isinstance(value, bool) and value < 0:
                errors.append(FieldError(name, ErrorCode.out_of_range, f"{value} is negative"))

        want("route", (str,), "a string")
        want("model", (str,), "a string")
        want("batch_size", (int,), "an integer")
        want("structured_output", (bool,), "true or false")
        want("tools", (bool,), "true or false")
        want("stream", (bool,), "true or false")
        want("max_tokens", (int,), "an integer", optional=True)
        want("prompt_tokens", (int,), "an integer")
        want("request_id", (str,), "a string", optional=True)
        arrival = data.get("arrival_time")
        if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, (int, float))
                                    or not math.isfinite(arrival)):
            errors.append(FieldError("arrival_time", ErrorCode.wrong_type,
                                     "expected a finite number of seconds since the Unix epoch"))
        engine_batch = data.get("engine_batch")
        if engine_batch is not None:
            if not isinstance(engine_batch, Mapping):
                errors.append(FieldError("engine_batch", ErrorCode.wrong_type,
                                         "expected a mapping of engine names to batch sizes"))
            else:
                for name, size in engine_batch.items():
                    path = f"engine_batch.{name}"
                    if not isinstance(name, str):
                        errors.append(FieldError("engine_batch", ErrorCode.wrong_type,
                                                 "expected engine names (strings) as keys"))
                    elif isinstance(size, bool) or not isinstance(size, int):
                        errors.append(FieldError(path, ErrorCode.wrong_type,
                                                 f"expected an integer, got {type(size).__name__}"))
                    elif size < 0:
                        errors.append(FieldError(path, ErrorCode.out_of_range, f"{size} is negative"))
        labels = data.get("labels", {})
        if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            errors.append(FieldError("labels", ErrorCode.wrong_type, "expected a mapping of strings to strings"))
        if errors:
            raise RequestShapeError(errors)
        values = {k: v for k, v in data.items() if k != "labels"}
        if values.get("arrival_time") is not None:
            values["arrival_time"] = float(values["arrival_time"])
        if engine_batch is not None:
            values["engine_batch"] = MappingProxyType(dict(engine_batch))
        return cls(labels=MappingProxyType(dict(labels)), **values)

    def to_dict(self) -> dict[str, Any]:
        """The shape as ``from_dict`` reads it; ``engine_batch`` only when set (a worker's shapes lack it)."""
        out = {
            "route": self.route, "model": self.model, "batch_size": self.batch_size,
            "structured_output": self.structured_output, "tools": self.tools, "stream": self.stream,
            "max_tokens": self.max_tokens, "prompt_tokens": self.prompt_tokens,
            "labels": dict(self.labels), "request_id": self.request_id, "arrival_time": self.arrival_time,
        }
        if self.engine_batch is not None:
            out["engine_batch"] = dict(self.engine_batch)
        return out


@dataclass(frozen=True, slots=True)
class Decision:
    engine: str
    speculate: bool
    num_speculative_tokens: int
    rule: str
    policy: str
    revision: str
    explored: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine, "speculate": self.speculate,
            "num_speculative_tokens": self.num_speculative_tokens, "rule": self.rule,
            "policy": self.policy, "revision": self.revision, "explored": self.explored,
        }

    def to_header(self) -> str:
        """The value of the sidecar's ``X-Specgate-Decision`` response header."""
        return (f"engine={self.engine}; rule={self.rule}; policy={self.policy}; "
                f"revision={self.revision}; explored={'true' if self.explored else 'false'}")


def sticky_fraction(key: str, salt: str) -> float:
    """A uniform number in [0, 1) fixed by (salt, key).

    The sidecar and control plane both bucket requests with this (exploration
    holdouts, traffic-percentage rollouts), so it is part of the wire contract:
    the first 8 bytes, big-endian, of BLAKE2b-64 over ``salt + "\\x00" + key``
    (UTF-8), divided by 2**64. Different salts give independent splits.
    """
    digest = hashlib.blake2b(f"{salt}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 18446744073709551616.0
