"""Shadow comparisons (the policy's ``quality``): the served answer against the plain engine's.

Speculative decoding is lossless in the algorithm: the target model verifies
every drafted token, so a greedy answer is the one the target alone would give.
In practice floating-point and batch-size effects (a different kernel, a
different reduction order in a verification pass of K+1 tokens) can change an
exact output. A shadow comparison measures how often that happens on real
traffic: a sampled greedy request that a speculative engine served is sent
again, after the client has its answer, to the plain engine, and the two
answers are compared.

What is compared: the text (content, or a completion's text), the tool calls
(name and arguments of each, in order; their ids are random per answer) and
the finish reason. Where they differ, the position of the first difference is
counted in tokens: the common prefix of the two texts, tokenized by the plain
engine (``POST /tokenize``; null when it cannot). For structured output both
answers are checked against the schema. A worker may add a check of its own
(``--quality-check module:function``, :func:`load_check`).

Only greedy requests are comparable (``temperature`` given as 0, one choice):
a sampled answer differs from another draw by design. Streamed requests are
compared too; the shadow itself is never streamed.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

# What a quality check's reason may hold in the telemetry event (wire.telemetry: shadow_check_reason).
MAX_REASON_CHARS = 256


class QualityCheckError(Exception):
    """A ``--quality-check`` that cannot be loaded; the message names the option and what is wrong."""


def comparable(data: dict[str, Any]) -> bool:
    """Whether a request's answer is deterministic enough to compare: greedy and one choice.

    ``temperature`` must be given, as 0: an engine's default comes from the model's generation config, which
    the sidecar cannot see. Beam search and ``best_of`` choose among several sequences; ``n`` above 1 returns
    several.
    """
    temperature = data.get("temperature")
    if type(temperature) not in (int, float) or temperature != 0:
        return False
    for name in ("n", "best_of"):
        value = data.get(name)
        if value is not None and value != 1:
            return False
    return data.get("use_beam_search") is not True


def shadow_body(data: dict[str, Any]) -> bytes:
    """The request the plain engine gets: the client's, whole (not streamed)."""
    body = {key: value for key, value in data.items() if key not in ("stream", "stream_options")}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(slots=True)
class Answer:
    """What two answers are compared on."""

    text: str
    tool_calls: list[tuple[str, str]]  # (name, arguments) per call, in index order
    finish_reason: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tool_calls": [{"name": n, "arguments": a} for n, a in self.tool_calls],
                "finish_reason": self.finish_reason}


@dataclass(slots=True)
class StreamCapture:
    """An answer as its stream goes by: the text parts, the tool-call deltas and the finish reason."""

    parts: list[str] = field(default_factory=list)
    tools: dict[int, list[list[str]]] = field(default_factory=dict)  # index -> [name parts, argument parts]
    finish_reason: str | None = None

    def choice(self, choice: dict[str, Any]) -> None:
        """Notes one streamed choice (chat ``delta`` or completion ``text``)."""
        delta = choice.get("delta")
        if type(delta) is dict:
            text = delta.get("content")
            calls = delta.get("tool_calls")
            if type(calls) is list:
                for position, call in enumerate(calls):
                    self._tool_delta(position, call)
        else:
            text = choice.get("text")
        if type(text) is str:
            self.parts.append(text)
        reason = choice.get("finish_reason")
        if type(reason) is str:
            self.finish_reason = reason

    def _tool_delta(self, position: int, call: Any) -> None:
        if type(call) is not dict:
            return
        index = call.get("index", position)
        if type(index) is not int:
            return
        name_parts, argument_parts = self.tools.setdefault(index, [[], []])
        function = call.get("function")
        if type(function) is dict:
            if type(function.get("name")) is str:
                name_parts.append(function["name"])
            if type(function.get("arguments")) is str:
                argument_parts.append(function["arguments"])

    def answer(self) -> Answer:
        calls = [("".join(name), "".join(arguments)) for _, (name, arguments) in sorted(self.tools.items())]
        return Answer("".join(self.parts), calls, self.finish_reason)


def answer_of(output: Any) -> Answer | None:
    """The first choice of a whole (non-stream) chat or completion answer; None when it has none."""
    if type(output) is not dict:
        return None
    choices = output.get("choices")
    if not choices or type(choices) is not list or type(choices[0]) is not dict:
        return None
    choice = choices[0]
    message = choice.get("message")
    calls: list[tuple[str, str]] = []
    if type(message) is dict:
        text = message.get("content")
        for call in message.get("tool_calls") or ():
            function = call.get("function") if type(call) is dict else None
            if type(function) is dict:
                name, arguments = function.get("name"), function.get("arguments")
                calls.append((name if type(name) is str else "", arguments if type(arguments) is str else ""))
    else:
        text = choice.get("text")
    reason = choice.get("finish_reason")
    return Answer(text if type(text) is str else "", calls, reason if type(reason) is str else None)


def common_prefix(a: str, b: str) -> str:
    """The longest common prefix of two strings."""
    size = min(len(a), len(b))
    low, high = 0, size
    # Binary search on slices compares in C, not character by character in Python (answers run to thousands).
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return a[:low]


@dataclass(frozen=True, slots=True)
class CheckResult:
    passed: bool | None  # None: the check failed to run
    reason: str | None


QualityCheck = Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], Any]


def load_check(spec: str) -> QualityCheck:
    """The function named ``module:function`` (``module.sub:object.method`` works too), importable from the
    worker's Python path. Called as ``check(request, served, plain)``: the client's request body and the two
    answers as ``{"text", "tool_calls": [{"name", "arguments"}], "finish_reason"}``; it returns whether the
    served answer passes, as a bool or ``(passed, reason)``. It may be a coroutine function."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise QualityCheckError(f"--quality-check must be MODULE:FUNCTION, got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import error, or anything the module raises as it loads
        raise QualityCheckError(f"--quality-check {spec!r}: cannot import {module_name!r}: "
                                f"{type(exc).__name__}: {exc}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise QualityCheckError(f"--quality-check {spec!r}: {module_name!r} has no {attribute!r}") from None
    if not callable(target):
        raise QualityCheckError(f"--quality-check {spec!r}: {attribute!r} is not callable")
    return target  # type: ignore[no-any-return]


def _verdict(value: Any) -> CheckResult:
    """A check's return value as a verdict; anything but a bool or ``(bool, str)`` is the check's error."""
    if type(value) is bool:
        return CheckResult(value, None)
    if isinstance(value, tuple) and len(value) == 2 and type(value[0]) is bool and (
            value[1] is None or isinstance(value[1], str)):
        reason = value[1]
        return CheckResult(value[0], None if reason is None else _clean(reason))
    raise TypeError(f"returned {type(value).__name__}, not a bool or (bool, str)")


def _clean(text: str) -> str:
    """A reason as the event holds it: printable, NULs out, at most MAX_REASON_CHARS."""
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text[:MAX_REASON_CHARS]


async def run_check(check: QualityCheck, request: dict[str, Any], served: Answer, plain: Answer, *,
                    timeout_s: float) -> CheckResult:
    """Runs a check off the event loop (a coroutine function on it), bounded in time; never raises: a check that
    fails to run or to answer is a result with ``passed`` None and the error as its reason."""
    try:
        if inspect.iscoroutinefunction(check):
            awaitable: Awaitable[Any] = check(request, served.as_dict(), plain.as_dict())
        else:
            # A thread, so a slow validator does not stall the requests the event loop serves. On a timeout the
            # thread runs on to its end; its answer is dropped.
            awaitable = asyncio.to_thread(check, request, served.as_dict(), plain.as_dict())
        return _verdict(await asyncio.wait_for(awaitable, timeout_s))
    except TimeoutError:
        return CheckResult(None, _clean(f"error: the check took longer than {timeout_s:g} s"))
    except Exception as exc:
        return CheckResult(None, _clean(f"error: {type(exc).__name__}: {exc}"))
