"""Telemetry events as the sidecar sends them, JSON-ready, for tests of the control plane's ingestion."""

from __future__ import annotations

from typing import Any


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
