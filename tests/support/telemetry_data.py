"""Recorded telemetry for the analysis tests: a policy with holdout, events by cohort, stored through the service."""

from __future__ import annotations

import datetime as dt
import itertools
import math
import random
import uuid
from typing import Any

from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.models import Policy, utcnow
from controlplane.telemetry.service import ParsedBatch, ingest
from tests.support.factories import add_revision
from wire.telemetry import TelemetryEvent

T0 = dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC)


POLICY = """\
apiVersion: specgate/v1
name: seed
engines:
  base: {{method: none}}
  draft: {{method: draft_model, model: models/draft, num_speculative_tokens: 3}}
rules:
  - name: no-structured
    when: {{structured_output: true}}
    then: {{engine: base}}
  - name: chat-low-batch
    when: {{route: [chat, summarize], batch_size: {{max: {threshold}}}}}
    then: {{engine: draft}}
default: {{engine: base}}
exploration: {{rate: 0.1, speculative_engine: draft}}
guardrails: {{max_p95_itl_regression: 0.1, max_retry_rate_increase: 0.02, min_samples: {min_samples}}}
"""


def policy_text(threshold: int = 4, min_samples: int = 200) -> str:
    return POLICY.format(threshold=threshold, min_samples=min_samples)


def seed(url: str, *texts: str) -> list[str]:
    """The policy `seed` with its first revision active and the others as drafts; their ids."""
    engine = make_engine(url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            policy = Policy(name="seed", created_by="admin:test")
            session.add(policy)
            session.flush()
            return [add_revision(session, policy, text, activate=i == 0).id for i, text in enumerate(texts)]
    finally:
        engine.dispose()


def event(*, revision: str, route: str = "chat", batch: int = 1, speculate: bool = True, explored: bool = False,
          itl: float = 20.0, time: dt.datetime = T0, retries: int = 0, worker: str = "w-1",
          structured: bool | None = None, accepted: int | None = 60, labels: str = "{}") -> dict[str, Any]:
    n = next(_ids)
    engine = "draft" if speculate else "base"
    return {
        "event_id": f"ev-{n}-{uuid.uuid4().hex[:8]}", "request_id": f"req-{n}", "time": time, "worker_id": worker,
        "pool": "a", "route": route, "model": "llama", "policy": "seed", "revision": revision,
        "rule": "chat-low-batch", "engine": engine, "decided_engine": engine, "speculate": speculate,
        "num_speculative_tokens": 3 if speculate else 0, "explored": explored, "canary": False,
        "kill_switch": False, "batch_size": batch, "stream": True, "structured_output": structured is not None,
        "tools": False, "max_tokens": 256, "prompt_tokens": 100, "shape_prompt_tokens": 100, "labels": labels,
        "completion_tokens": 101, "ttft_ms": 50.0, "itl_ms": itl, "e2e_ms": 50.0 + 100 * itl, "status": "ok",
        "http_status": 200, "retries": retries, "fallback": False, "structured_valid": structured,
        "spec_draft_tokens": 90 if speculate else None,
        "spec_accepted_tokens": accepted if speculate else None, "spec_steps": 30 if speculate else None,
    }


def store(url: str, events: list[dict[str, Any]]) -> None:
    engine = make_engine(url)
    try:
        for start in range(0, len(events), 5000):
            chunk = [TelemetryEvent.model_validate(e) for e in events[start:start + 5000]]
            with unit_of_work(make_sessionmaker(engine)) as session:
                ingest(session, ParsedBatch(uuid.uuid4().hex, "w-1", len(chunk), chunk, []), sent_by="test",
                       received_at=utcnow())
    finally:
        engine.dispose()


def lognormal(rng: random.Random, median: float, sigma: float = 0.25) -> float:
    return median * math.exp(rng.gauss(0, sigma))


def holdout_traffic(rid: str, rng: random.Random, route: str, batch: int, spec_itl: float, plain_itl: float,
                    n: int = 300, time: dt.datetime = T0, **kw: Any) -> list[dict[str, Any]]:
    """The policy's own decisions (speculative where batch <= 4) and explored requests of the other kind."""
    native_spec = batch <= 4
    out = []
    for i in range(n):
        explored = i % 3 == 0
        spec = native_spec != explored
        out.append(event(revision=rid, route=route, batch=batch, speculate=spec, explored=explored,
                         itl=lognormal(rng, spec_itl if spec else plain_itl), time=time, **kw))
    return out


def recorded_window(url: str, rid: str) -> None:
    rng = random.Random(42)
    events: list[dict[str, Any]] = []
    # chat: speculation wins up to 5-8 and loses from 9-16 on
    for batch, spec_itl in ((1, 12.0), (2, 12.0), (3, 13.0), (6, 15.0), (12, 26.0)):
        events += holdout_traffic(rid, rng, "chat", batch, spec_itl, 20.0, n=450)
    # summarize: speculation loses everywhere it runs
    for batch in (1, 2, 3):
        events += holdout_traffic(rid, rng, "summarize", batch, 26.0, 20.0, n=450)
    # thin: one bucket with a handful of requests
    events += holdout_traffic(rid, rng, "chat", 20, 10.0, 20.0, n=6)
    store(url, events)


_ids = itertools.count()
