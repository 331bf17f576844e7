"""Classification of request bodies into policies.RequestShape (pure unit tests)."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.classify import (
    JSON_OBJECT,
    classify,
    estimate_prompt_tokens,
    is_structured_output,
    max_tokens_of,
    output_schema,
    parse_labels,
    route_for,
)

CHAT = "/v1/chat/completions"
TABLE = {CHAT: "by-path", "/v1/completions": "", "llama": "by-model"}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "llama", "messages": [{"role": "user", "content": "hello"}], **extra}


# --- route precedence: header > metadata.route > table (path, then model) > default ---------------

def test_header_wins_over_everything() -> None:
    assert route_for(chat(metadata={"route": "meta"}), CHAT, "hdr", TABLE) == "hdr"


def test_metadata_wins_over_the_table() -> None:
    assert route_for(chat(metadata={"route": "meta"}), CHAT, None, TABLE) == "meta"


def test_table_by_path_then_by_model() -> None:
    assert route_for(chat(), CHAT, None, TABLE) == "by-path"
    # the completions path maps to "", which counts as absent: the model entry decides
    assert route_for({"model": "llama", "prompt": "x"}, "/v1/completions", None, TABLE) == "by-model"


def test_default_when_nothing_names_a_route() -> None:
    assert route_for(chat(model="other"), "/v1/completions", None, {}) == "default"
    assert route_for(chat(model="other"), "/v1/completions", None, {"llama": "x"}) == "default"


@pytest.mark.parametrize("metadata", [{"route": ""}, {"route": 7}, "chat", None, {"other": "chat"}])
def test_bad_or_empty_metadata_route_falls_through(metadata: Any) -> None:
    assert route_for(chat(metadata=metadata), CHAT, "", TABLE) == "by-path"


def test_long_routes_are_cut() -> None:
    assert route_for(chat(), CHAT, "r" * 500, {}) == "r" * 128


# --- structured output: each variant -------------------------------------------------------------

@pytest.mark.parametrize("body", [
    chat(response_format={"type": "json_object"}),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    chat(response_format={"type": "structural_tag", "structures": [], "triggers": []}),
    chat(structured_outputs={"json": {"type": "object"}}),
    chat(structured_outputs={"regex": "[a-z]+"}),
    chat(structured_outputs={"choice": ["yes", "no"]}),
    chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
    chat(tools=[{"type": "function", "function": {"name": "f"}}],
         tool_choice={"type": "function", "function": {"name": "f"}}),
], ids=["json_object", "json_schema", "structural_tag", "so-json", "so-regex", "so-choice",
        "tools-required", "tools-named"])
def test_structured_output_variants(body: dict[str, Any]) -> None:
    assert is_structured_output(body) is True
    assert classify(body, path=CHAT).structured_output is True


@pytest.mark.parametrize("body", [
    chat(),
    chat(response_format={"type": "text"}),
    chat(structured_outputs={}),
    chat(structured_outputs={"json": None}),
    chat(tools=[{"type": "function", "function": {"name": "f"}}]),
    chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto"),
    chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none"),
    chat(tools=[], tool_choice="required"),
], ids=["plain", "text", "so-empty", "so-null", "tools-default", "tools-auto", "tools-none", "no-tools-required"])
def test_not_structured_output(body: dict[str, Any]) -> None:
    assert is_structured_output(body) is False


def test_output_schema_sources() -> None:
    schema = {"type": "object", "required": ["a"]}
    assert output_schema(chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}})) == schema
    assert output_schema(chat(structured_outputs={"json": schema})) == schema
    assert output_schema(chat(structured_outputs={"json": '{"type": "array"}'})) == {"type": "array"}
    assert output_schema(chat(response_format={"type": "json_object"})) is JSON_OBJECT
    assert output_schema(chat(structured_outputs={"regex": "x"})) is None
    assert output_schema(chat(structured_outputs={"json": "{not json"})) is None
    assert output_schema(chat()) is None


# --- the other fields ------------------------------------------------------------------------------

def test_max_tokens_prefers_max_completion_tokens() -> None:
    assert max_tokens_of({"max_tokens": 10, "max_completion_tokens": 20}) == 20
    assert max_tokens_of({"max_tokens": 10}) == 10
    assert max_tokens_of({"max_tokens": True}) is None
    assert max_tokens_of({"max_tokens": -1}) is None
    assert max_tokens_of({}) is None


def test_prompt_token_estimate_is_chars_over_four() -> None:
    assert estimate_prompt_tokens({"messages": [{"content": "a" * 8}, {"content": "b" * 5}]}) == 4  # 13 chars
    parts = [{"type": "text", "text": "x" * 12}, {"type": "image_url", "image_url": {"url": "u" * 400}}]
    assert estimate_prompt_tokens({"messages": [{"content": parts}]}) == 3
    assert estimate_prompt_tokens({"prompt": "y" * 9}) == 3
    assert estimate_prompt_tokens({"prompt": ["y" * 4, "z" * 4]}) == 2
    assert estimate_prompt_tokens({"prompt": [1, 2, 3, 4, 5]}) == 5
    assert estimate_prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_prompt_tokens({}) == 0


def test_labels_header() -> None:
    assert dict(parse_labels("tenant=acme, tier = gold,broken,=x,tenant=beta")) == {"tenant": "beta", "tier": "gold"}
    assert dict(parse_labels("")) == {}
    assert dict(parse_labels(None)) == {}


def test_classify_fills_every_field() -> None:
    body = chat(stream=True, max_tokens=64, tools=[{"type": "function", "function": {"name": "f"}}],
                metadata={"route": "chat"})
    shape = classify(body, path=CHAT, labels_header="tenant=acme", batch_size=3, request_id="r1",
                     arrival_time=1_796_000_000.25)
    assert shape.to_dict() == {
        "route": "chat", "model": "llama", "batch_size": 3, "structured_output": False, "tools": True,
        "stream": True, "max_tokens": 64, "prompt_tokens": 2, "labels": {"tenant": "acme"}, "request_id": "r1",
        "arrival_time": 1_796_000_000.25,
    }
    assert classify({}, path=CHAT).arrival_time is None
    assert classify({"model": 5, "stream": "yes", "tools": {}}, path=CHAT).to_dict()["model"] == ""
    assert classify({"stream": "yes"}, path=CHAT).stream is False
