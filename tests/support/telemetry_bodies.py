"""Telemetry events as the sidecar sends them, JSON-ready, for tests of the control plane's ingestion."""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

T0 = dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC)


def event(n: int | str, **changes: Any) -> dict[str, Any]:
    """A valid event as the sidecar sends it (JSON-ready)."""
    body: dict[str, Any] = {
        "event_id": f"ev-{n}", "request_id": f"req-{n}", "time": "2026-12-02T10:00:30Z", "worker_id": "w-1",
        "pool": "a", "route": "chat", "model": "llama", "policy": "seed", "revision": "rev-1",
        "rule": "chat-low-batch", "engine": "draft", "decided_engine": "draft", "speculate": True,
        "num_speculative_tokens": 3, "explored": False, "canary": False, "kill_switch": False, "batch_size": 2,
        "stream": True, "structured_output": False, "tools": False, "max_tokens": 256, "prompt_tokens": 120,
        "completion_tokens": 40, "ttft_ms": 85.5, "itl_ms": 12.25, "e2e_ms": 650.0, "status": "ok",
        "http_status": 200, "retries": 0, "fallback": False, "fallback_reason": None, "structured_valid": None,
        "spec_draft_tokens": 36, "spec_accepted_tokens": 27, "spec_acceptance_rate": 0.75,
        "spec_mean_acceptance_length": 3.25, "spec_steps": 12, "engine_ttft_ms": 80.0, "engine_itl_ms": 11.5,
        "engine_queue_ms": 2.0,
    }
    body.update(changes)
    return body


def random_event(rng: random.Random, n: int, t0: dt.datetime = T0) -> dict[str, Any]:
    """A valid event of random values over ten minutes from ``t0``: every rollup key field and counter varies."""
    def maybe(value: Any, p: float = 0.15) -> Any:
        return None if rng.random() < p else value

    completion = maybe(rng.randint(0, 900))
    return event(
        n,
        time=(t0 + dt.timedelta(seconds=rng.uniform(0, 600))).isoformat(),
        policy=rng.choice(["seed", "other"]), revision=rng.choice(["rev-1", "rev-2", "rev-3"]),
        route=rng.choice(["chat", "code", "rag", "agent"]), engine=rng.choice(["base", "draft", "ngram"]),
        batch_size=rng.choice([0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 200]),
        explored=rng.random() < 0.1, speculate=rng.random() < 0.5,
        status=rng.choice(["ok"] * 8 + ["error", "client_disconnect", "upstream_error"]),
        retries=rng.choice([0, 0, 0, 1, 2]), fallback=rng.random() < 0.05,
        structured_valid=rng.choice([None, None, True, False]),
        prompt_tokens=maybe(rng.randint(1, 4000)), completion_tokens=completion,
        ttft_ms=maybe(rng.lognormvariate(4.5, 1.0)), itl_ms=maybe(rng.lognormvariate(2.5, 0.6)),
        e2e_ms=rng.choice([0.0, rng.lognormvariate(6.5, 1.0), rng.uniform(0, 0.2), 2e5]),
        # a quarter of the reported drafts are none at all, as in an in-engine schedule's K=0 band
        spec_draft_tokens=maybe(rng.choice([0, rng.randint(0, 400), rng.randint(0, 400), rng.randint(0, 400)]), 0.3),
        spec_accepted_tokens=maybe(rng.randint(0, 300), 0.1),
        spec_steps=maybe(rng.randint(0, 100), 0.3),
        **shadow_fields(rng),
    )


def shadow_fields(rng: random.Random) -> dict[str, Any]:
    """A shadow comparison for about a third of the events, as the sidecar reports one: each field may be
    missing on its own (an engine that cannot count tokens, no structured output, no quality check)."""
    if rng.random() < 0.65:
        return {}
    match = rng.random() < 0.8
    return {"shadow_match": match,
            "shadow_first_diff": None if match or rng.random() < 0.2 else rng.randint(0, 500),
            "shadow_structured_valid": rng.choice([None, None, True, False]),
            "shadow_check_passed": rng.choice([None, True, True, False]),
            "shadow_check_reason": rng.choice([None, "ok", "answers differ in meaning"])}
