"""Classifying one OpenAI-compatible request into a :class:`policies.RequestShape`.

Pure functions over the parsed JSON body and a few header values; the proxy
calls :func:`classify` once per request, on the latency-critical path, so
everything here is a handful of dict look-ups.

The rules (docs/sidecar-request-path.md has them too):

* **route** — the ``X-Specgate-Route`` header, else the body's
  ``metadata.route``, else the settings route table looked up first by request
  path (``/v1/chat/completions``) and then by model name, else ``"default"``.
  Empty values count as absent; routes are cut to 128 characters.
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
  with an empty key ignored, a repeated key keeps its last value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from policies import RequestShape

MAX_ROUTE_CHARS: Final = 128
STRUCTURED_RESPONSE_FORMATS: Final = frozenset({"json_object", "json_schema", "structural_tag"})
_EMPTY_LABELS: Final[Mapping[str, str]] = MappingProxyType({})


class _JsonObject:
    """Marker: the output must be a JSON object, no schema given (``json_object``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "JSON_OBJECT"


JSON_OBJECT: Final = _JsonObject()
"""What :func:`output_schema` returns for ``response_format: {type: json_object}``."""


def route_for(body: Mapping[str, Any], path: str, route_header: str | None,
              routes: Mapping[str, str]) -> str:
    if route_header:
        return route_header[:MAX_ROUTE_CHARS]
    metadata = body.get("metadata")
    if type(metadata) is dict:
        route = metadata.get("route")
        if type(route) is str and route:
            return route[:MAX_ROUTE_CHARS]
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


def output_schema(body: Mapping[str, Any]) -> dict[str, Any] | bool | _JsonObject | None:
    """The JSON schema the output must match, :data:`JSON_OBJECT`, or None (nothing to check).

    ``response_format: {type: json_schema, json_schema: {schema: ...}}`` and
    ``structured_outputs: {json: ...}`` (an object, or a JSON string as vLLM
    also accepts) give a schema; ``json_object`` gives :data:`JSON_OBJECT`. A
    schema that is not a JSON object or boolean gives None.
    """
    response_format = body.get("response_format")
    if type(response_format) is dict:
        kind = response_format.get("type")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if type(spec) is dict else None
            return schema if isinstance(schema, dict | bool) else None
        if kind == "json_object":
            return JSON_OBJECT
    structured = body.get("structured_outputs")
    if type(structured) is dict:
        schema = structured.get("json")
        if type(schema) is str:
            try:
                schema = json.loads(schema)
            except ValueError:
                return None
        if isinstance(schema, dict | bool):
            return schema
        if structured.get("json_object") is True:
            return JSON_OBJECT
    return None


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


def parse_labels(header: str | None) -> Mapping[str, str]:
    """``k=v,k2=v2`` -> {"k": "v", "k2": "v2"} (see the module docs for the edge cases)."""
    if not header:
        return _EMPTY_LABELS
    labels: dict[str, str] = {}
    for pair in header.split(","):
        key, sep, value = pair.partition("=")
        key = key.strip()
        if sep and key:
            labels[key] = value.strip()
    return MappingProxyType(labels) if labels else _EMPTY_LABELS


def classify(body: Mapping[str, Any], *, path: str, route_header: str | None = None,
             labels_header: str | None = None, routes: Mapping[str, str] | None = None,
             batch_size: int = 1, request_id: str | None = None,
             arrival_time: float | None = None) -> RequestShape:
    """The request shape of one parsed request body (a JSON object)."""
    model = body.get("model")
    tools = body.get("tools")
    return RequestShape(
        route=route_for(body, path, route_header, routes or _EMPTY_LABELS),
        model=model if type(model) is str else "",
        batch_size=batch_size,
        structured_output=is_structured_output(body),
        tools=bool(tools) and type(tools) is list,
        stream=body.get("stream") is True,
        max_tokens=max_tokens_of(body),
        prompt_tokens=estimate_prompt_tokens(body),
        labels=parse_labels(labels_header),
        request_id=request_id,
        arrival_time=arrival_time,
    )
