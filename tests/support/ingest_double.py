"""A test double of the control plane's telemetry ingestion endpoint, and the sidecar's exporter wired to it.

The double records batches, deduplicates them by ``batch_id`` as ``POST /v1/telemetry/batches`` does, and
can be told to fail, to lose its answers, or to go down and come back on the same port: failures the real
endpoint cannot be made to produce on demand.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gzip
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from sidecar.settings import SidecarSettings
from sidecar.telemetry import TelemetryExporter
from tests.support.live import free_port
from wire.telemetry import TelemetryBatch, TelemetryEvent

KEY = "sgk_test_worker"


class IngestDouble:
    """Test double of ``POST /v1/telemetry/batches`` (worker key, gzip JSON, idempotent by batch_id).

    ``mode``: ``ok``; ``unavailable`` (503, nothing recorded); ``answer_lost`` (records the batch, then
    answers 500, as if the answer never reached the sidecar); ``reject_odd`` (2xx listing the odd
    indexes as refused); ``invalid`` (422 for the whole batch); ``unauthorized`` (401); ``small`` (413
    for batches over 30 events); ``slow`` (answers after 0.3 s); ``hang`` (answers after 30 s).
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = "ok"
        self.batches: dict[str, list[str]] = {}  # batch_id -> event ids, first arrival only
        self.accepted: list[str] = []  # event ids accepted, in arrival order
        self.deltas: list[str] = []  # rollup delta ids of the batches, first arrival only
        self.posts = 0
        self.duplicates = 0
        self.gzipped = 0
        self._runner: web.AppRunner | None = None

    @property
    def up(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/telemetry/batches", self.handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def handle(self, request: web.Request) -> web.Response:
        self.posts += 1
        if request.headers.get("Content-Encoding") == "gzip":
            self.gzipped += 1
        if request.headers.get("Authorization") != f"Bearer {KEY}" or self.mode == "unauthorized":
            return web.json_response({"title": "unauthorized"}, status=401)
        if self.mode == "unavailable":
            return web.json_response({"title": "unavailable"}, status=503)
        if self.mode == "slow":
            await asyncio.sleep(0.3)
        if self.mode == "hang":
            await asyncio.sleep(30)
        body = await request.read()
        if body[:2] == b"\x1f\x8b":  # aiohttp's server may have decompressed it already
            body = gzip.decompress(body)
        batch = TelemetryBatch.model_validate_json(body)
        if self.mode == "invalid":
            return web.json_response({"title": "invalid batch"}, status=422)
        if self.mode == "small" and len(batch.events) > 30:
            return web.json_response({"title": "too large"}, status=413)
        refused = [i for i in range(len(batch.events)) if i % 2] if self.mode == "reject_odd" else []
        if batch.batch_id in self.batches:
            self.duplicates += 1
        else:
            kept = [e.event_id for i, e in enumerate(batch.events) if i not in refused]
            self.batches[batch.batch_id] = kept
            self.accepted.extend(kept)
            self.deltas.extend(d.delta_id for d in batch.rollups)
        if self.mode == "answer_lost":
            return web.json_response({"title": "lost"}, status=500)
        return web.json_response({"batch_id": batch.batch_id, "accepted": len(batch.events) - len(refused),
                                  "rejected": [{"index": i, "reason": "test"} for i in refused]}, status=202)


def event(i: int = 0) -> TelemetryEvent:
    return TelemetryEvent(
        event_id=uuid.uuid4().hex, request_id=f"req-{i}", time=dt.datetime.now(dt.UTC), worker_id="w1",
        pool="default", route="chat", model="llama", policy="seed", revision="r" * 64, rule="chat-low-batch",
        engine="draft", decided_engine="draft", speculate=True, num_speculative_tokens=3, explored=False,
        canary=False, kill_switch=False, batch_size=2, stream=False, structured_output=False, tools=False,
        max_tokens=64, prompt_tokens=20, completion_tokens=40, ttft_ms=30.0, itl_ms=8.0, e2e_ms=350.0,
        status="ok", http_status=200)


def settings(ingest: IngestDouble, state: Path, **overrides: Any) -> SidecarSettings:
    values: dict[str, Any] = {"control_plane": ingest.url, "key": KEY, "worker_id": "w1", "state_dir": state,
                              "telemetry_batch_size": 100, "telemetry_flush_s": 0.05, **overrides}
    return SidecarSettings(**values)


def exporter_for(ingest: IngestDouble, state: Path, **overrides: Any) -> TelemetryExporter:
    return TelemetryExporter(settings(ingest, state, **overrides), retry_base_s=0.05, retry_max_s=0.25)


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
