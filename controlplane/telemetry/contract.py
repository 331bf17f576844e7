"""The event contract as the store validates it: ``wire.telemetry.TelemetryEvent`` plus the store's limits.

:class:`StoredEvent` is derived from the contract field by field, so it keeps
every constraint of ``TelemetryEvent`` (and follows it when it changes) and
adds only what the database needs:

- integers at most 2**31 - 1 (32-bit columns; sums are 64-bit), where the
  contract sets no upper bound of its own;
- floats finite, and at most 1e12 where the contract sets no upper bound (a
  latency of infinity, NaN or 1e300 would poison every sum it joins);
- strings without NUL characters (PostgreSQL text cannot hold them), where
  the contract has no pattern of its own.

Deriving one model instead of checking afterwards keeps validation in
pydantic-core: an event costs one pass, and every refusal has the same shape
(``loc``, ``type``, ``msg``) whichever rule refused it.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types
from pydantic import AllowInfNan, Field, create_model
from pydantic.fields import FieldInfo

from controlplane.telemetry.schemas import MAX_EVENTS, BatchEnvelope
from wire.telemetry import TelemetryEvent

MAX_INT = 2**31 - 1
MAX_FLOAT = 1e12
NO_NUL = r"^[^\x00]*$"


def field_kind(annotation: Any) -> type:
    """``int`` for ``int`` and ``int | None``, and so on."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unexpected telemetry field type {annotation!r}")
        annotation = args[0]
    kind: type = annotation
    return kind


def _store_limits(info: FieldInfo) -> list[Any]:
    kind = field_kind(info.annotation)
    bounded = any(isinstance(m, (annotated_types.Le, annotated_types.Lt)) for m in info.metadata)
    patterned = any(getattr(m, "pattern", None) for m in info.metadata)
    if kind is int and not bounded:
        return [annotated_types.Le(MAX_INT)]
    if kind is float:
        return [AllowInfNan(False), *([] if bounded else [annotated_types.Le(MAX_FLOAT)])]
    if kind is str and not patterned:
        return [Field(pattern=NO_NUL)]
    return []


# Annotated built from a tuple at run time; typed Any so the checker does not read it as a type.
_ANNOTATED: Any = Annotated


def _derived_fields() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in TelemetryEvent.model_fields.items():
        limits = _store_limits(info)
        if limits:
            annotated = _ANNOTATED[(info.annotation, *info.metadata, *limits)]
            out[name] = (annotated, Field(default=info.default, description=info.description))
    return out


StoredEvent: type[TelemetryEvent] = create_model(
    "StoredEvent", __base__=TelemetryEvent, __doc__="TelemetryEvent with the store's limits.",
    **_derived_fields())


class StoredBatch(BatchEnvelope):
    """The strict envelope with StoredEvents: the one-pass check of a batch with no bad event."""

    events: list[StoredEvent] = Field(max_length=MAX_EVENTS)
