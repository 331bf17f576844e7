"""Classifying one OpenAI-compatible request into a :class:`policies.RequestShape`.

Pure functions over the parsed JSON body and a few header values; the proxy
calls :func:`classify` once per request, on the latency-critical path, so
everything here is a handful of dict look-ups.

The rules (docs/sidecar-request-path.md has them too):

* **route** — the ``X-Specgate-Route`` header, else the body's
  ``metadata.route``, else the settings route table looked up first by request
  path (``/v1/chat/completions``) and then by model name, else ``"default"``.
  Empty values count as absent; routes are cut to 128 characters. A route
  from the request with a control character (C0 or DEL) or a lone UTF-16
  surrogate is refused (:class:`RequestError`), as is such a ``model``.
* **structured_output** — ``response_format.type`` is ``json_object``,
  ``json_schema`` or ``structural_tag``; or a ``structured_outputs`` object
  with at least one constraint set; or non-empty ``tools`` with
  ``tool_choice`` ``"required"`` or a named function.
* **tools** — ``tools`` is a non-empty list.
* **max_tokens** — ``max_completion_tokens``, else ``max_tokens`` (vLLM's own
  precedence); None when neither is a non-negative integer.
* **prompt_tokens** — an estimate, not a tokenizer: characters of text / 4,
  rounded up, over the chat messages' string contents (and ``text`` parts of
  multi-part contents) or the completion prompt(s); a prompt given as token
  ids counts its ids. Tool definitions and images are not counted.
* **labels** — the ``X-Specgate-Labels`` header, ``k=v,k2=v2``: pairs split on
  ``,`` then on the first ``=``, whitespace trimmed, pairs without ``=`` or
  with an empty key ignored, a repeated key keeps its last value. A header over
  ``max_bytes`` or with more than ``max_pairs`` labels is refused.

What is refused raises :class:`RequestError`, which names the field; the
proxy answers it with a 400 before any decision. The telemetry event carries
these strings, and the control plane refuses an event holding a NUL, and
cannot even decode one holding a lone surrogate (which the stdlib's JSON
parser accepts from a client, and orjson does not).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from policies import RequestShape

MAX_ROUTE_CHARS: Final = 128
MAX_LABELS: Final = 64
MAX_LABELS_BYTES: Final = 4096
# C0 controls, DEL, and UTF-16 surrogates (only ever lone ones in a Python str)
_UNFIT: Final = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")
STRUCTURED_RESPONSE_FORMATS: Final = frozenset({"json_object", "json_schema", "structural_tag"})
_EMPTY_LABELS: Final[Mapping[str, str]] = MappingProxyType({})


class _JsonObject:
    """Marker: the output must be a JSON object, no schema given (``json_object``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "JSON_OBJECT"


JSON_OBJECT: Final = _JsonObject()
"""What :func:`output_schema` returns for ``response_format: {type: json_object}``."""


class RequestError(ValueError):
    """A request the sidecar refuses (400) before deciding it: ``field`` names what is wrong, ``where`` is
    ``header`` or ``body``."""

    def __init__(self, field: str, where: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.where = where
        self.message = message
        self.code = code


def check_text(value: str, field: str, where: str) -> str:
    """``value``, unless it holds what no telemetry event may carry (C0, DEL, a lone surrogate)."""
    if value.isascii() and value.isprintable():  # an ASCII string's unprintables are exactly C0 and DEL
        return value
    match = _UNFIT.search(value)
    if match is not None:
        char = match.group()
        what = "a lone UTF-16 surrogate" if "\ud800" <= char <= "\udfff" else "a control character"
        raise RequestError(field, where, f"holds {what} ({char!r} at offset {match.start()})")
    return value


def route_for(body: Mapping[str, Any], path: str, route_header: str | None,
              routes: Mapping[str, str]) -> str:
    if route_header:
        return check_text(route_header, "X-Specgate-Route", "header")[:MAX_ROUTE_CHARS]
    metadata = body.get("metadata")
    if type(metadata) is dict:
        route = metadata.get("route")
        if type(route) is str and route:
            return check_text(route, "metadata.route", "body")[:MAX_ROUTE_CHARS]
    if routes:
        route = routes.get(path)
        if route:
            return route[:MAX_ROUTE_CHARS]
        model = body.get("model")
        if type(model) is str:
            route = routes.get(model)
            if route:
                return route[:MAX_ROUTE_CHARS]
    return "default"


def _forced_tools(body: Mapping[str, Any]) -> bool:
    tools = body.get("tools")
    if not tools or type(tools) is not list:
        return False
    choice = body.get("tool_choice")
    if choice == "required":
        return True
    # a named tool: {"type": "function", "function": {"name": "..."}}
    if type(choice) is dict:
        function = choice.get("function")
        return type(function) is dict and bool(function.get("name"))
    return False


def is_structured_output(body: Mapping[str, Any]) -> bool:
    response_format = body.get("response_format")
    if type(response_format) is dict and response_format.get("type") in STRUCTURED_RESPONSE_FORMATS:
        return True
    structured = body.get("structured_outputs")
    if type(structured) is dict and any(v is not None and v is not False for v in structured.values()):
        return True
    return _forced_tools(body)


SCHEMA_FIELD: Final = "response_format.json_schema.schema"
STRUCTURED_JSON_FIELD: Final = "structured_outputs.json"


def output_schema(body: Mapping[str, Any]) -> dict[str, Any] | bool | _JsonObject | None:
    """The JSON schema the output must match, :data:`JSON_OBJECT`, or None (nothing to check).

    ``response_format: {type: json_schema, json_schema: {schema: ...}}`` and
    ``structured_outputs: {json: ...}`` (an object, or a JSON string as vLLM
    also accepts) give a schema; ``json_object`` gives :data:`JSON_OBJECT`. A
    schema that is not a JSON object or boolean gives None.
    """
    return output_schema_at(body)[0]


def output_schema_at(body: Mapping[str, Any]) -> tuple[dict[str, Any] | bool | _JsonObject | None, str]:
    """:func:`output_schema` and the field it came from (``""`` when none)."""
    response_format = body.get("response_format")
    if type(response_format) is dict:
        kind = response_format.get("type")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if type(spec) is dict else None
            return (schema, SCHEMA_FIELD) if isinstance(schema, dict | bool) else (None, "")
        if kind == "json_object":
            return JSON_OBJECT, ""
    structured = body.get("structured_outputs")
    if type(structured) is dict:
        schema = structured.get("json")
        if type(schema) is str:
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):
                return None, ""
        if isinstance(schema, dict | bool):
            return schema, STRUCTURED_JSON_FIELD
        if structured.get("json_object") is True:
            return JSON_OBJECT, ""
    return None, ""


def max_tokens_of(body: Mapping[str, Any]) -> int | None:
    value = body.get("max_completion_tokens")
    if type(value) is not int or value < 0:
        value = body.get("max_tokens")
        if type(value) is not int or value < 0:
            return None
    return value


def _content_chars(content: Any) -> int:
    if type(content) is str:
        return len(content)
    chars = 0
    if type(content) is list:
        for part in content:
            if type(part) is dict:
                text = part.get("text")
                if type(text) is str:
                    chars += len(text)
            elif type(part) is str:
                chars += len(part)
    return chars


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Characters / 4, rounded up (see the module docs for what counts)."""
    chars = 0
    messages = body.get("messages")
    if type(messages) is list:
        for message in messages:
            if type(message) is dict:
                chars += _content_chars(message.get("content"))
        return (chars + 3) // 4
    prompt = body.get("prompt")
    if type(prompt) is str:
        return (len(prompt) + 3) // 4
    if type(prompt) is list and prompt:
        first = prompt[0]
        if type(first) is int:  # one prompt as token ids
            return len(prompt)
        tokens = 0
        for item in prompt:
            if type(item) is str:
                tokens += (len(item) + 3) // 4
            elif type(item) is list:  # a batch of token-id prompts
                tokens += len(item)
        return tokens
    return 0


def parse_labels(header: str | None, *, max_pairs: int = MAX_LABELS,
                 max_bytes: int = MAX_LABELS_BYTES) -> Mapping[str, str]:
    """``k=v,k2=v2`` -> {"k": "v", "k2": "v2"} (see the module docs for the edge cases).

    ``header`` is the header's bytes decoded as latin-1, so its length is its size in bytes.
    """
    if not header:
        return _EMPTY_LABELS
    if len(header) > max_bytes:
        raise RequestError("X-Specgate-Labels", "header", f"is {len(header)} bytes, over the {max_bytes} allowed",
                           "too_long")
    labels: dict[str, str] = {}
    for pair in header.split(","):
        key, sep, value = pair.partition("=")
        key = key.strip()
        if sep and key:
            labels[key] = value.strip()
    if len(labels) > max_pairs:
        raise RequestError("X-Specgate-Labels", "header", f"has {len(labels)} labels, over the {max_pairs} allowed",
                           "too_long")
    return MappingProxyType(labels) if labels else _EMPTY_LABELS


def classify(body: Mapping[str, Any], *, path: str, route_header: str | None = None,
             labels_header: str | None = None, routes: Mapping[str, str] | None = None,
             batch_size: int = 1, request_id: str | None = None,
             arrival_time: float | None = None, max_labels: int = MAX_LABELS,
             max_labels_bytes: int = MAX_LABELS_BYTES) -> RequestShape:
    """The request shape of one parsed request body (a JSON object); raises :class:`RequestError`."""
    model = body.get("model")
    tools = body.get("tools")
    return RequestShape(
        route=route_for(body, path, route_header, routes or _EMPTY_LABELS),
        model=check_text(model, "model", "body") if type(model) is str else "",
        batch_size=batch_size,
        structured_output=is_structured_output(body),
        tools=bool(tools) and type(tools) is list,
        stream=body.get("stream") is True,
        max_tokens=max_tokens_of(body),
        prompt_tokens=estimate_prompt_tokens(body),
        labels=parse_labels(labels_header, max_pairs=max_labels, max_bytes=max_labels_bytes),
        request_id=request_id,
        arrival_time=arrival_time,
    )
