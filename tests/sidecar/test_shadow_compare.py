"""sidecar/shadow.py on its own: what two answers are compared on, and who is comparable."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.shadow import Answer, StreamCapture, answer_of, common_prefix_length, comparable, shadow_body


@pytest.mark.parametrize(("extra", "expected"), [
    ({"temperature": 0}, True),
    ({"temperature": 0.0, "n": 1, "best_of": 1}, True),
    ({"temperature": 0, "top_p": 0.5, "seed": 3}, True),  # nothing left to sample with temperature 0
    ({}, False),  # the engine's default temperature comes from the model's generation config
    ({"temperature": 0.2}, False),
    ({"temperature": "0"}, False),
    ({"temperature": False}, False),  # a bool is no temperature
    ({"temperature": 0, "n": 3}, False),
    ({"temperature": 0, "best_of": 2}, False),
    ({"temperature": 0, "use_beam_search": True}, False),
])
def test_comparable_means_greedy_with_one_choice(extra: dict[str, Any], expected: bool) -> None:
    assert comparable({"model": "m", **extra}) is expected


def test_the_shadow_body_is_the_request_whole() -> None:
    data = {"model": "m", "prompt": "é", "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0}
    assert json.loads(shadow_body(data)) == {"model": "m", "prompt": "é", "temperature": 0}
    assert data["stream"] is True  # the client's request is not changed


def chat_answer(content: str | None, calls: list[tuple[str, str]] = (), reason: str = "stop") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call-{i}", "type": "function",
                                  "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]
    return {"choices": [{"index": 0, "message": message, "finish_reason": reason}]}


def test_a_stream_of_tool_call_deltas_equals_the_whole_answer() -> None:
    capture = StreamCapture()
    # vLLM streams a tool call's name first, then its arguments in pieces; ids differ between answers
    for delta in ({"role": "assistant", "content": ""},
                  {"tool_calls": [{"index": 0, "id": "x1", "type": "function", "function": {"name": "get"}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
                  {"tool_calls": [{"index": 1, "id": "x2", "function": {"name": "put", "arguments": "{}"}}]}):
        capture.choice({"index": 0, "delta": delta})
    capture.choice({"index": 0, "delta": {}, "finish_reason": "tool_calls"})
    streamed = capture.answer()
    whole = answer_of(chat_answer(None, [("get", '{"city": "Oslo"}'), ("put", "{}")], "tool_calls"))
    assert streamed == whole
    assert whole == Answer("", [("get", '{"city":"Oslo"}'), ("put", "{}")], "tool_calls")  # JSON, compact
    other = answer_of(chat_answer(None, [("get", '{"city": "Bergen"}'), ("put", "{}")], "tool_calls"))
    assert streamed != other


def test_answers_differ_by_text_tool_calls_or_finish_reason() -> None:
    base = answer_of(chat_answer("the same"))
    assert base == answer_of(chat_answer("the same"))
    assert base != answer_of(chat_answer("the same", reason="length"))
    assert base != answer_of(chat_answer("the sane"))
    assert base != answer_of(chat_answer("the same", [("f", "{}")]))


def test_completions_and_answers_without_a_choice() -> None:
    assert answer_of({"choices": [{"index": 0, "text": "abc", "finish_reason": "length"}]}) == Answer(
        "abc", [], "length")
    capture = StreamCapture()
    for piece in ("a", "b", "c"):
        capture.choice({"index": 0, "text": piece})
    capture.choice({"index": 0, "text": "", "finish_reason": "length"})
    assert capture.answer() == Answer("abc", [], "length")
    for broken in (None, [], {}, {"choices": []}, {"choices": ["x"]}, {"error": {"message": "boom"}}):
        assert answer_of(broken) is None


@given(st.text(max_size=60), st.text(max_size=60))
def test_common_prefix_is_the_longest(a: str, b: str) -> None:
    n = common_prefix_length(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]
    assert common_prefix_length(list(a), list(b)) == n  # token id lists alike


def test_tool_call_arguments_compare_as_json_values() -> None:
    # a streamed answer's arguments may come with other spacing or key order than a whole one's
    capture = StreamCapture()
    capture.choice({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}})
    capture.choice({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"b": 1,'}}]}})
    capture.choice({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ' "a": [2]}'}}]}})
    capture.choice({"index": 0, "delta": {}, "finish_reason": "tool_calls"})
    whole = answer_of(chat_answer(None, [("f", '{"a":[2],"b":1}')], "tool_calls"))
    assert capture.answer() == whole
    assert whole != answer_of(chat_answer(None, [("f", '{"a":[2],"b":2}')], "tool_calls"))
    # arguments that are not JSON compare as text
    assert answer_of(chat_answer(None, [("f", "{oops")])) != answer_of(chat_answer(None, [("f", "{oops ")]))
