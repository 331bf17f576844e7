"""A stand-in control plane for the proxy benchmark: the sidecar's side of the protocol, nothing stored.

The sidecar under benchmark gets its policy from a signed last-known-good
bundle in its state dir (no control plane needed for decisions), but it still
registers, heartbeats, long-polls for bundles and ships telemetry. Pointing it
at a closed port would make it spool every telemetry batch to disk, which is
not what a healthy worker pays; a full control plane (database, ingestion)
would take CPU from the 2-core machine the benchmark runs on. This process
answers like a healthy control plane whose bundle never changes:

* ``POST /v1/workers/register`` 201, ``POST /v1/workers/{id}/heartbeat`` 200;
* ``GET /v1/bundle`` with ``If-None-Match``: held for ``wait`` seconds, then 304;
* ``GET /v1/bundle/events``: an SSE stream held open (a comment every 15 s);
* ``POST /v1/telemetry/batches``: gunzipped, parsed, events counted, acknowledged
  as ``BatchAck`` (all accepted, none rejected);
* ``GET /stats``: ``{"batches": N, "events": N, "registrations": N, "heartbeats": N}``.

Run: ``python -m bench.cp_sink --port 8002`` (prints ``READY PORT``).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import signal

from aiohttp import web

try:
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover
    _loads = json.loads


class Sink:
    def __init__(self) -> None:
        self.stats = {"batches": 0, "events": 0, "registrations": 0, "heartbeats": 0, "bundle_polls": 0}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/workers/register", self.register)
        app.router.add_post("/v1/workers/{worker}/heartbeat", self.heartbeat)
        app.router.add_get("/v1/bundle", self.bundle)
        app.router.add_get("/v1/bundle/events", self.events)
        app.router.add_post("/v1/telemetry/batches", self.batches)
        app.router.add_get("/stats", self.get_stats)
        return app

    async def register(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.stats["registrations"] += 1
        return web.json_response({"id": body.get("id"), "pool": body.get("pool")}, status=201)

    async def heartbeat(self, request: web.Request) -> web.Response:
        await request.read()
        self.stats["heartbeats"] += 1
        return web.json_response({"expected_etag": None})

    async def bundle(self, request: web.Request) -> web.Response:
        self.stats["bundle_polls"] += 1
        if not request.headers.get("If-None-Match"):
            return web.json_response({"type": "about:blank", "title": "no bundle here", "status": 404},
                                     status=404, content_type="application/problem+json")
        try:
            wait = min(float(request.query.get("wait", "30")), 300.0)
        except ValueError:
            wait = 30.0
        await asyncio.sleep(wait)
        return web.Response(status=304)

    async def events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        while True:
            await resp.write(b": keepalive\n\n")
            await asyncio.sleep(15)

    async def batches(self, request: web.Request) -> web.Response:
        raw = await request.read()  # aiohttp inflates a gzip Content-Encoding itself
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        data = _loads(raw)
        count = len(data.get("events") or [])
        self.stats["batches"] += 1
        self.stats["events"] += count
        return web.json_response({"batch_id": data.get("batch_id", ""), "accepted": count, "stored": count,
                                  "rejected": [], "duplicate": False})

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats)


async def serve(host: str, port: int) -> None:
    sink = Sink()
    runner = web.AppRunner(sink.app(), access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
