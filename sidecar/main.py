"""Wiring the sidecar together and running it.

:class:`Sidecar` builds the policy store, the bundle sync, the telemetry
exporter, the OpenTelemetry hook (only when an OTLP endpoint is configured)
and the request-path app (:func:`sidecar.proxy.build_app`). :func:`serve` runs
it under :class:`sidecar.server.HttpServer` (on uvloop when installed): the
sync and exporter start before the server accepts requests, so the
last-known-good bundle is in place; on SIGTERM/SIGINT the server stops
accepting, finishes the requests in flight (30 s at most), then the sync stops
and the exporter flushes (or spools) what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import aiohttp

from policies import PolicyStore
from sidecar.otel import OTelRuntime, otel_from_env
from sidecar.server import MAX_BODY_BYTES, HttpServer, ServerLimits
from sidecar.settings import SidecarSettings
from sidecar.sync import PolicySync, sidecar_version
from sidecar.telemetry import TelemetryExporter

if TYPE_CHECKING:
    from sidecar.supervisor import EngineSupervisor
from wire.telemetry import TelemetryEvent

log = logging.getLogger("specgate.sidecar")

AppFactory = Callable[..., Any]
# How long a supervising sidecar without a last-known-good bundle waits for the control plane's first one
# before it starts its engines.
FIRST_POLICY_WAIT_S = 15.0
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
        metrics = getattr(self.app, "metrics", None)
        pools = getattr(self.app, "pools", None)
        self.sync = PolicySync(self.settings, self.store, in_flight=self._in_flight,
                               refused=getattr(metrics, "bundle_refused", None),
                               replicas=pools.report if pools is not None else None)
        if pools is not None:
            pools.on_change = self.sync.report_soon
        self.supervisor: EngineSupervisor | None = None
        self.first_policy_wait_s = FIRST_POLICY_WAIT_S
        self._engines_starting: asyncio.Task[None] | None = None
        if self.settings.supervise is not None:
            from sidecar.supervisor import EngineSupervisor, load_supervise_file

            self.supervisor = EngineSupervisor(load_supervise_file(self.settings.supervise), pools,
                                               self.settings.state_dir, on_change=self.sync.report_soon)
            self.sync.supervised = self.supervisor.report
            if metrics is not None:
                metrics.supervisor = self.supervisor

    async def _first_policy(self, timeout_s: float) -> None:
        """Without a last-known-good bundle, waits a little for the control plane's: engines started without
        the policy would restart as soon as it arrives, and an engine start costs a minute or more. Not past
        an answer without a bundle (no policy for this worker, a refused key): the engines then start plain.
        A control plane that does not answer yet (still starting beside the worker) is waited for until
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.store.current is None and time.monotonic() < deadline:
            if self.sync.last_error is not None and self.sync.connected:
                return
            await asyncio.sleep(0.05)

    async def _start_engines(self) -> None:
        assert self.supervisor is not None
        await self._first_policy(self.first_policy_wait_s)
        bundle = self.store.current
        self.supervisor.start(bundle.active.document if bundle is not None else None,
                              bundle.active.revision if bundle is not None else None)
        self.supervisor.watch(lambda: self.store.current)

    def _in_flight(self) -> int:
        inflight = getattr(self.app, "inflight", None)
        return int(getattr(inflight, "count", 0) or 0)

    async def start(self) -> None:
        await self.sync.start()
        await self.exporter.start()
        if self.supervisor is not None:
            # Held from now (requests go to the fallback engine, or get 503), started in the background: the
            # sidecar serves /healthz and handles signals meanwhile. With a last-known-good bundle the engines
            # start with its arguments at once, then follow the policy.
            self.supervisor.hold_all()
            self._engines_starting = asyncio.create_task(self._start_engines(), name="engines-start")
        current = self.store.current
        settings = self.settings
        engines = ", ".join(f"{name} ({len(urls)} replica{'s' if len(urls) != 1 else ''})"
                            for name, urls in settings.engines.items())
        log.info("sidecar %s: %s %s, pool %s, engines %s, batch per %s; policy %s", sidecar_version(),
                 settings.kind, settings.worker_id, settings.pool, engines or "none",
                 "replica" if settings.replica_scope else "worker",
                 f"{current.etag[:12]} ({self.sync.source})" if current else "not loaded yet")

    async def stop(self, flush_timeout_s: float = 5.0) -> None:
        if self._engines_starting is not None and not self._engines_starting.done():
            self._engines_starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engines_starting
        await self.sync.stop()
        await self.exporter.stop(flush=True, timeout=flush_timeout_s)
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.otel is not None:
            await asyncio.to_thread(self.otel.shutdown)
        log.info("sidecar stopped")


async def serve(settings: SidecarSettings, *, app_factory: AppFactory | None = None,
                shutdown_timeout_s: float = 30.0) -> None:
    """Run the sidecar until SIGTERM/SIGINT, then shut it down gracefully."""
    sidecar = Sidecar(settings, app_factory=app_factory)
    await sidecar.start()
    host, _, port = sidecar.settings.listen.rpartition(":")
    server = HttpServer(sidecar.app, max_body_bytes=getattr(sidecar.app, "max_body_bytes", MAX_BODY_BYTES),
                        limits=ServerLimits.from_settings(sidecar.settings))
    stop = asyncio.Event()
    try:
        await server.start(host.strip("[]"), int(port))
        log.info("listening on %s", sidecar.settings.listen)
        _freeze_startup_objects()
        with _signals_set(stop):
            await stop.wait()
    finally:
        # also when cancelled: stop accepting, let the requests in flight finish, then the sync stops and the
        # exporter flushes
        await server.shutdown(shutdown_timeout_s)
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
def _signals_set(stop: asyncio.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop``; only in the main thread (elsewhere the sidecar serves until cancelled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run(settings: SidecarSettings, *, log_level: str = "info") -> None:
    """Blocking entry point: ``serve`` on uvloop when it is installed."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(settings))
    else:
        uvloop.run(serve(settings))
