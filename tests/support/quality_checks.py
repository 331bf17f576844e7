"""Quality checks that sidecar tests load by import path (``--quality-check tests.support.quality_checks:NAME``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

calls: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = []


def same_words(request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> tuple[bool, str]:
    """Passes when the two texts have the same words, whatever the spacing."""
    calls.append((request, served, plain))
    if served["text"].split() == plain["text"].split():
        return True, "same words"
    return False, f"served {len(served['text'].split())} words, plain {len(plain['text'].split())}"


def always_true(request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> bool:
    return True


async def async_same_length(request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> tuple[bool, str]:
    await asyncio.sleep(0)
    return len(served["text"]) == len(plain["text"]), "lengths"


def raises(request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> bool:
    raise ValueError("validator exploded")


def wrong_type(request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> Any:
    return {"passed": True}


def slow(request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> bool:
    time.sleep(0.5)
    return True


def long_reason(request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> tuple[bool, str]:
    return False, "x\x00" * 400


def json_equal(request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> tuple[bool, str]:
    """A check a team might reuse: both answers parse as JSON and are equal as values."""
    try:
        return json.loads(served["text"]) == json.loads(plain["text"]), "compared as JSON"
    except ValueError as exc:
        return False, f"not JSON: {exc}"


not_callable = 42


# What ``hangs`` waits for: set it to let the stuck threads go.
released = threading.Event()


def hangs(request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> bool:
    """Never answers in time (a validator stuck on a lock, say): until ``released`` is set, at most 30 s."""
    released.wait(30)
    return True


class AsyncCallable:
    """A check object whose __call__ is a coroutine function."""

    async def __call__(self, request: dict[str, Any], served: dict[str, Any], plain: dict[str, Any]) -> bool:
        await asyncio.sleep(0)
        return served["finish_reason"] == plain["finish_reason"]


async_callable = AsyncCallable()
