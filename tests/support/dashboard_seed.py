"""A control plane with something to show: policies, workers, and an hour of plausible telemetry.

Everything goes through the REST API, as a sidecar and an operator would send it.
"""

from __future__ import annotations

import datetime as dt
import random
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support import paths

EXAMPLES = paths.EXAMPLES

# Mean inter-token latency (ms) of the plain engine at a batch size, and how much faster the
# speculative engine is there: a speedup that shrinks as the batch grows and turns into a slowdown.
ROUTES: dict[str, dict[str, Any]] = {
    # what the example "fleet" policy decides: speculate on `engine` up to batch `threshold`
    "chat": {"engine": "draft", "threshold": 4, "acceptance": 0.72, "share": 0.55},
    "extract": {"engine": "ngram", "threshold": 8, "acceptance": 0.83, "share": 0.3},
    "creative": {"engine": "draft", "threshold": 0, "acceptance": 0.38, "share": 0.15},
}
EXPLORATION = 0.2  # share of requests that get the other decision (the holdout the analysis compares)


def line_of(text: str, fragment: str) -> int:
    """The 1-based number of the first line of ``text`` that holds ``fragment``."""
    return next(n for n, line in enumerate(text.splitlines(), 1) if fragment in line)


def plain_itl(batch: int) -> float:
    return 11.0 + 0.85 * batch


def spec_factor(batch: int, acceptance: float) -> float:
    return (1.05 - 0.6 * acceptance) + 0.022 * batch


@dataclass
class Seeded:
    policy: str
    active: str
    draft: str
    workers: list[str]
    events: int


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def create_policy(url: str, admin: str, filename: str, pool: str | None, *, message: str) -> dict[str, Any]:
    text = (EXAMPLES / filename).read_text()
    import yaml

    name = yaml.safe_load(text)["name"]
    with _client(url, admin) as c:
        c.post("/v1/policies", json={"name": name, "pool": pool}).raise_for_status()
        r = c.post(f"/v1/policies/{name}/revisions", json={"document": text, "message": message})
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data


def add_revision(url: str, admin: str, policy: str, text: str, message: str) -> dict[str, Any]:
    with _client(url, admin) as c:
        head = c.get(f"/v1/policies/{policy}").json()["head_revision_id"]
        r = c.post(f"/v1/policies/{policy}/revisions", json={"document": text, "message": message},
                   headers={"If-Match": f'"{head}"'})
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data


def register_workers(url: str, worker_key: str, pool: str, n: int) -> list[str]:
    ids = []
    with _client(url, worker_key) as c:
        for i in range(n):
            wid = f"{pool}-gpu-{i}"
            c.post("/v1/workers/register", json={
                "id": wid, "pool": pool, "labels": {"zone": "a" if i % 2 == 0 else "b"},
                "engines": {"base": "http://127.0.0.1:9001", "draft": "http://127.0.0.1:9002",
                            "ngram": "http://127.0.0.1:9003"}, "sidecar_version": "0.1.0"}).raise_for_status()
            ids.append(wid)
    return ids


def heartbeat_all(url: str, worker_key: str, ids: list[str], *, converged: int, revision: str,
                  old_revision: str | None = None) -> None:
    """The first ``converged`` workers report their expected bundle; the others an old one."""
    with _client(url, worker_key) as c:
        for i, wid in enumerate(ids):
            ack = c.post(f"/v1/workers/{wid}/heartbeat", json={}).json()
            fresh = i < converged
            c.post(f"/v1/workers/{wid}/heartbeat", json={
                "active_etag": ack["expected_etag"] if fresh else "0" * 64,
                "active_revision": revision if fresh else old_revision}).raise_for_status()


def telemetry(url: str, worker_key: str, *, policy: str, revision: str, pool: str, workers: list[str],
              minutes: int = 60, per_minute: int = 30, seed: int = 7,
              now: dt.datetime | None = None) -> int:
    """Send ``minutes`` x ``per_minute`` events ending now; answers how many were stored."""
    rng = random.Random(seed)
    end = (now or dt.datetime.now(dt.UTC)).replace(second=0, microsecond=0)
    events: list[dict[str, Any]] = []
    for m in range(minutes, 0, -1):
        minute = end - dt.timedelta(minutes=m)
        load = 1.0 + 0.6 * (m % 20) / 20  # a slow wave of load
        for _ in range(per_minute):
            route = rng.choices(list(ROUTES), weights=[r["share"] for r in ROUTES.values()])[0]
            spec = ROUTES[route]
            batch = max(1, min(64, int(rng.lognormvariate(1.6, 0.8) * load)))
            explored = rng.random() < EXPLORATION
            speculate = (batch <= spec["threshold"]) != explored
            engine = spec["engine"] if speculate else "base"
            itl = plain_itl(batch) * (spec_factor(batch, spec["acceptance"]) if speculate else 1.0)
            itl *= rng.uniform(0.85, 1.2)
            completion = rng.randint(40, 400)
            structured = route == "extract" and rng.random() < 0.4
            event: dict[str, Any] = {
                "event_id": uuid.uuid4().hex, "request_id": uuid.uuid4().hex,
                "time": (minute + dt.timedelta(seconds=rng.uniform(0, 59))).isoformat(),
                "worker_id": rng.choice(workers), "pool": pool, "route": route, "model": "target-8b",
                "policy": policy, "revision": revision, "rule": f"{route}-rule" if speculate else "default",
                "engine": engine, "decided_engine": engine, "speculate": speculate,
                "num_speculative_tokens": 3 if speculate else 0, "explored": explored,
                "canary": False, "kill_switch": False, "batch_size": batch, "stream": True,
                "structured_output": structured, "tools": False, "max_tokens": 512,
                "prompt_tokens": rng.randint(50, 2000), "completion_tokens": completion,
                "ttft_ms": rng.uniform(40, 160) + 2 * batch, "itl_ms": itl,
                "e2e_ms": 100 + itl * completion, "status": "ok" if rng.random() > 0.01 else "error",
                "retries": 1 if rng.random() < 0.02 else 0, "fallback": rng.random() < 0.01,
                "structured_valid": (rng.random() > 0.03) if structured else None,
            }
            if speculate:
                drafted = completion
                event["spec_draft_tokens"] = drafted
                event["spec_accepted_tokens"] = int(drafted * min(1.0, max(0.0, rng.gauss(spec["acceptance"], 0.06))))
            events.append(event)
    stored = 0
    with _client(url, worker_key) as c:
        for i in range(0, len(events), 1000):
            r = c.post("/v1/telemetry/batches", json={"batch_id": uuid.uuid4().hex, "worker_id": workers[0],
                                                      "events": events[i:i + 1000]})
            r.raise_for_status()
            stored += r.json()["stored"]
    return stored


def seed_all(url: str, admin: str, worker_key: str, *, minutes: int = 60, per_minute: int = 30) -> Seeded:
    """The example policies (fleet on pool "fleet"), a draft, six workers, and telemetry."""
    create_policy(url, admin, "seed.yaml", None, message="example seed policy")
    fleet = create_policy(url, admin, "multi-route.yaml", "fleet", message="route-aware speculation")
    text = (EXAMPLES / "multi-route.yaml").read_text().replace("batch_size: {max: 4}", "batch_size: {max: 6}")
    draft = add_revision(url, admin, "fleet", text, "raise the chat threshold to 6")
    workers = register_workers(url, worker_key, "fleet", 6)
    heartbeat_all(url, worker_key, workers, converged=5, revision=fleet["id"], old_revision="0" * 64)
    events = telemetry(url, worker_key, policy="fleet", revision=fleet["id"], pool="fleet", workers=workers,
                       minutes=minutes, per_minute=per_minute)
    return Seeded("fleet", fleet["id"], draft["id"], workers, events)


# Always speculative; exploring whole one-minute windows on the plain engine, half of them.
SWITCHBACK_POLICY = """\
apiVersion: specgate/v1
name: windows
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
default: {engine: draft}
exploration: {rate: 0.5, speculative_engine: draft, window_s: 60}
"""


def switchback_telemetry(url: str, worker_key: str, *, revision: str, salt: str, worker: str, pool: str = "fleet",
                         minutes: int = 30, per_minute: int = 20, speculative_ms: float = 900.0,
                         plain_ms: float = 500.0, seed: int = 11) -> int:
    """``minutes`` of SWITCHBACK_POLICY's traffic ending now: its explored windows (by the sticky hash of the
    window index, salted with ``salt``) ran plain and answered in ``plain_ms``, the others in
    ``speculative_ms`` (lognormal around them)."""
    from policies import sticky_fraction

    rng = random.Random(seed)
    end = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    events: list[dict[str, Any]] = []
    for m in range(minutes, 0, -1):
        minute = end - dt.timedelta(minutes=m)
        explored = sticky_fraction(f"window:{int(minute.timestamp()) // 60}", salt) < 0.5
        for i in range(per_minute):
            e2e = (plain_ms if explored else speculative_ms) * rng.lognormvariate(0, 0.15)
            engine = "base" if explored else "draft"
            events.append({
                "event_id": uuid.uuid4().hex, "request_id": uuid.uuid4().hex,
                "time": (minute + dt.timedelta(seconds=(i + 0.5) * 60 / per_minute)).isoformat(),
                "worker_id": worker, "pool": pool, "route": "chat", "model": "target-8b", "policy": "windows",
                "revision": revision, "rule": "default", "engine": engine, "decided_engine": engine,
                "speculate": not explored, "num_speculative_tokens": 0 if explored else 3, "explored": explored,
                "canary": False, "kill_switch": False, "batch_size": 2, "stream": True,
                "structured_output": False, "tools": False, "max_tokens": 128, "prompt_tokens": 200,
                "completion_tokens": 48, "ttft_ms": 60.0, "itl_ms": (e2e - 60) / 47, "e2e_ms": e2e,
                "status": "ok", "retries": 0, "fallback": False, "structured_valid": None,
                **({} if explored else {"spec_draft_tokens": 48, "spec_accepted_tokens": 30}),
            })
    with _client(url, worker_key) as c:
        r = c.post("/v1/telemetry/batches", json={"batch_id": uuid.uuid4().hex, "worker_id": worker,
                                                  "events": events})
        r.raise_for_status()
        stored: int = r.json()["stored"]
    return stored


def shadow_telemetry(url: str, worker_key: str, seeded: Seeded, *, seed: int = 13) -> dict[tuple[str, str], int]:
    """Speculative requests of the fleet's active revision, two minutes ago, some of them compared with the plain
    engine's answer (shadow comparisons): on chat (draft) 40 compared, 38 matched; on extract (ngram) 20
    compared, 15 matched, the differing ones after 12 tokens, structured output valid 20 of 20 served and 18 of 20
    plain, and a quality check failed on 3 of 10. Answers ``{(route, engine): compared}``."""
    rng = random.Random(seed)
    when = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0) - dt.timedelta(minutes=2)
    events: list[dict[str, Any]] = []
    plan = {("chat", "draft"): (40, 38), ("extract", "ngram"): (20, 15)}
    for (route, engine), (compared, matched) in plan.items():
        for i in range(compared + 10):
            structured = route == "extract" and i < compared
            event: dict[str, Any] = {
                "event_id": uuid.uuid4().hex, "request_id": uuid.uuid4().hex,
                "time": (when + dt.timedelta(seconds=rng.uniform(0, 59))).isoformat(),
                "worker_id": seeded.workers[0], "pool": "fleet", "route": route, "model": "target-8b",
                "policy": seeded.policy, "revision": seeded.active, "rule": f"{route}-rule", "engine": engine,
                "decided_engine": engine, "speculate": True, "num_speculative_tokens": 3, "explored": False,
                "canary": False, "kill_switch": False, "batch_size": 2, "stream": False,
                "structured_output": structured, "tools": False, "max_tokens": 256, "prompt_tokens": 300,
                "completion_tokens": 60, "ttft_ms": 50.0, "itl_ms": 9.0, "e2e_ms": 600.0, "status": "ok",
                "retries": 0, "fallback": False, "structured_valid": True if structured else None,
            }
            if i < compared:
                event["shadow_match"] = i < matched
                event["shadow_first_diff"] = None if i < matched else 12
                if structured:
                    event["shadow_structured_valid"] = i >= 2
                    event["shadow_check_passed"] = None if i >= 10 else i >= 3
            events.append(event)
    with _client(url, worker_key) as c:
        r = c.post("/v1/telemetry/batches", json={"batch_id": uuid.uuid4().hex, "worker_id": seeded.workers[0],
                                                  "events": events})
        r.raise_for_status()
        assert r.json()["stored"] == len(events), r.text
    return {pair: compared for pair, (compared, _) in plan.items()}
