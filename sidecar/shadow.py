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
(name and arguments of each, in order; their ids are random per answer;
arguments that parse as JSON compare as JSON values, since a streamed and a
whole answer may lay the same arguments out differently) and the finish
reason. Where they differ, the position of the first difference is counted in
tokens: both texts tokenized by the plain engine (``POST /tokenize``), the
index of the first token id that differs (null when the engine cannot
tokenize). For structured output both
answers are checked against the schema. A worker may add a check of its own
(``--quality-check module:function``, :func:`load_check`).

Only greedy requests are comparable (``temperature`` given as 0, one choice):
a sampled answer differs from another draw by design. Streamed requests are
compared too; the shadow itself is never streamed.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
        calls = [("".join(name), normal_arguments("".join(arguments)))
                 for _, (name, arguments) in sorted(self.tools.items())]
        return Answer("".join(self.parts), calls, self.finish_reason)


def normal_arguments(arguments: str) -> str:
    """Tool-call arguments in one layout when they are JSON (compact, keys sorted), else as they are."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


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
                calls.append((name if type(name) is str else "",
                              normal_arguments(arguments) if type(arguments) is str else ""))
    else:
        text = choice.get("text")
    reason = choice.get("finish_reason")
    return Answer(text if type(text) is str else "", calls, reason if type(reason) is str else None)


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The length of the longest common prefix of two strings or lists."""
    size = min(len(a), len(b))
    low, high = 0, size
    # Binary search on slices compares in C, not item by item in Python (answers run to thousands of tokens).
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


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
    """A reason as the event holds it: at most MAX_REASON_CHARS, printable (NULs and controls become spaces)."""
    text = text[:MAX_REASON_CHARS]
    return "".join(ch if ch.isprintable() else " " for ch in text)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _is_async(check: Any) -> bool:
    return inspect.iscoroutinefunction(check) or inspect.iscoroutinefunction(type(check).__call__)


class CheckRunner:
    """Runs a worker's quality check for each comparison, bounded in time and in threads; never raises.

    A coroutine function (or an object with ``async def __call__``) is awaited on the event loop. Anything else
    runs on threads of its own, at most ``max_threads`` at once, never on the loop's default executor: that
    one also serves the policy sync and name lookups, and a check that hangs must not stall them. On a timeout
    the thread runs on to its end (Python cannot stop it) and keeps its slot; a comparison that finds every
    slot taken is not checked (an error, counted), never queued. The check is called from several threads at
    once, so it must be thread-safe.
    """

    def __init__(self, check: QualityCheck, *, max_threads: int, timeout_s: float) -> None:
        self.check = check
        self.timeout_s = timeout_s
        self.max_threads = max_threads
        self._async = _is_async(check)
        self._slots = threading.BoundedSemaphore(max_threads)
        self._executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="quality-check")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, request: dict[str, Any], served: Answer, plain: Answer) -> CheckResult:
        try:
            if self._async:
                value = await asyncio.wait_for(self.check(request, served.as_dict(), plain.as_dict()),
                                               self.timeout_s)
            else:
                if not self._slots.acquire(blocking=False):
                    return CheckResult(None, f"error: not run: the check still runs on {self.max_threads} earlier "
                                             "comparisons")
                call = functools.partial(self._in_thread, request, served.as_dict(), plain.as_dict())
                try:
                    future = asyncio.get_running_loop().run_in_executor(self._executor, call)
                except BaseException:
                    self._slots.release()
                    raise
                # Shielded: a timeout must not cancel the job before a thread takes it (its slot would never
                # come back); the thread's late answer is then retrieved and dropped.
                future.add_done_callback(_retrieve)
                value = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
                if inspect.isawaitable(value):  # a plain function that returned a coroutine all the same
                    value = await asyncio.wait_for(value, self.timeout_s)
            return _verdict(value)
        except TimeoutError:
            return CheckResult(None, _clean(f"error: the check took longer than {self.timeout_s:g} s"))
        except Exception as exc:
            return CheckResult(None, _clean(f"error: {type(exc).__name__}: {exc}"))

    def _in_thread(self, request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> Any:
        try:
            return self.check(request, served, plain)
        finally:
            self._slots.release()
