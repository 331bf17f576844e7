"""Wiring the sidecar together and running it.

:class:`Sidecar` builds the policy store, the bundle sync, the telemetry
exporter, the OpenTelemetry hook (only when an OTLP endpoint is configured)
and the request-path app (:func:`sidecar.proxy.build_app`). :func:`serve` runs
it under uvicorn (uvloop, httptools when installed): the sync and exporter
start before the server accepts requests, so the last-known-good bundle is in
place; on SIGTERM/SIGINT uvicorn stops accepting, finishes the requests in
flight, then the sync stops and the exporter flushes (or spools) what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp

from policies import PolicyStore
from sidecar.events import TelemetryEvent
from sidecar.otel import OTelRuntime, otel_from_env
from sidecar.settings import SidecarSettings
from sidecar.sync import PolicySync, sidecar_version
from sidecar.telemetry import TelemetryExporter

log = logging.getLogger("specgate.sidecar")

AppFactory = Callable[..., Any]
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})  # noqa: S104 - names, not a bind


def resolve_worker_id(settings: SidecarSettings) -> str:
    """The configured id, else HOST:PORT of ``listen`` (the machine's name when listening on every address)."""
    if settings.worker_id:
        return settings.worker_id
    host, _, port = settings.listen.rpartition(":")
    if host in WILDCARD_HOSTS:
        host = socket.gethostname()
    return f"{host.strip('[]')}:{port}"


def _default_app_factory() -> AppFactory:
    from sidecar.proxy import build_app

    return build_app


class Sidecar:
    """Everything one worker's sidecar runs, built from settings; ``start``/``stop`` in the serving loop."""

    def __init__(self, settings: SidecarSettings, *, app_factory: AppFactory | None = None,
                 otel: OTelRuntime | None = None, use_env_otel: bool = True) -> None:
        self.settings = settings.model_copy(update={"worker_id": resolve_worker_id(settings)})
        self.store = PolicyStore()
        self.session: aiohttp.ClientSession | None = None
        self.otel = otel if otel is not None or not use_env_otel else otel_from_env(
            worker_id=self.settings.worker_id, engines=self.settings.engines, version=sidecar_version())
        self.exporter = TelemetryExporter(self.settings)
        on_event: Callable[[TelemetryEvent], None] | None = self.otel.hook.on_event if self.otel else None
        self.app = (app_factory or _default_app_factory())(self.settings, self.store, self.exporter,
                                                            on_event=on_event)
        self.sync = PolicySync(self.settings, self.store, in_flight=self._in_flight)

    def _in_flight(self) -> int:
        inflight = getattr(self.app, "inflight", None)
        return int(getattr(inflight, "count", 0) or 0)

    async def start(self) -> None:
        await self.sync.start()
        await self.exporter.start()
        current = self.store.current
        log.info("sidecar %s: worker %s, pool %s, engines %s; policy %s", sidecar_version(),
                 self.settings.worker_id, self.settings.pool, ", ".join(self.settings.engines) or "none",
                 f"{current.etag[:12]} ({self.sync.source})" if current else "not loaded yet")

    async def stop(self, flush_timeout_s: float = 5.0) -> None:
        await self.sync.stop()
        await self.exporter.stop(flush=True, timeout=flush_timeout_s)
        if self.otel is not None:
            await asyncio.to_thread(self.otel.shutdown)
        log.info("sidecar stopped")


def _uvicorn_config(app: Any, settings: SidecarSettings, log_level: str) -> Any:
    import importlib.util

    import uvicorn

    host, _, port = settings.listen.rpartition(":")
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    # proxy_headers off: its middleware wraps every request to rewrite the client address from X-Forwarded-*,
    # which the sidecar never reads. The Date header stays (HTTP wants it; uvicorn formats it once a second).
    return uvicorn.Config(app, host=host.strip("[]"), port=int(port), http=http, loop="none", lifespan="on",
                          log_level=log_level, access_log=False, timeout_graceful_shutdown=30,
                          server_header=False, proxy_headers=False)


async def serve(settings: SidecarSettings, *, log_level: str = "info", app_factory: AppFactory | None = None) -> None:
    """Run the sidecar until SIGTERM/SIGINT, then shut it down gracefully."""
    import uvicorn

    sidecar = Sidecar(settings, app_factory=app_factory)
    await sidecar.start()
    server = uvicorn.Server(_uvicorn_config(sidecar.app, sidecar.settings, log_level))
    _freeze_startup_objects()
    with _signals_end_serving():
        try:
            await server.serve()
        finally:
            await sidecar.stop()


def _freeze_startup_objects() -> None:
    """Keep the cyclic garbage collector off what start-up built (modules, settings, the compiled policy).

    Those objects live as long as the process, yet every full (generation 2) collection walks them all. Under
    load the request path's objects (held across awaits, telemetry events waiting for their batch) survive the
    young generations fast enough to trigger a full collection about every half second, and walking the ~160k
    start-up objects took 70-110 ms, during which every request in flight stalled (bench/proxy.py at
    concurrency 64: p99 ~110 ms, ~16 ms with the freeze). Frozen objects are still freed by reference counting.
    """
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def _signals_end_serving() -> Iterator[None]:
    """Let a signal end ``server.serve()`` and nothing more, so the shutdown after it still runs.

    uvicorn handles SIGINT/SIGTERM while serving and afterwards re-raises the
    signal it caught to the handler that was there before; with the default
    handlers that would kill the process before the sync stops and the
    telemetry is flushed. The handlers here only swallow that re-raise.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    originals = {sig: signal.signal(sig, _swallow) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)


def _swallow(signum: int, frame: object) -> None:
    log.info("signal %d: shutting down", signum)


def run(settings: SidecarSettings, *, log_level: str = "info") -> None:
    """Blocking entry point: ``serve`` on uvloop when it is installed."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(settings, log_level=log_level))
    else:
        uvloop.run(serve(settings, log_level=log_level))
