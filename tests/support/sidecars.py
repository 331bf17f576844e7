"""A sidecar app on a loop thread in front of fake engines, and what the sidecar tests share."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvicorn
import uvloop

import policies
from sidecar.proxy import SidecarApp
from sidecar.server import HttpServer
from tests.support import paths
from wire.telemetry import TelemetryEvent

T = TypeVar("T")


SEED = paths.EXAMPLES / "seed.yaml"


def seed_bundle(*, kill_switch: bool = False) -> policies.CompiledBundle:
    revision = policies.Revision.of(policies.load_policy(SEED.read_text()))
    return policies.CompiledBundle(policies.BundlePayload(revision, kill_switch=kill_switch))


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


class LoopThread:
    """A uvloop event loop in a daemon thread; servers live there, tests talk to them over TCP."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class RecordingExporter:
    """The exporter interface (``submit``, optional ``queue_depth``), recording into a list."""

    def __init__(self) -> None:
        self.events: list[TelemetryEvent] = []
        self.aggregated: list[TelemetryEvent] = []  # submitted with aggregate=True (sampled or not)

    def submit(self, event: TelemetryEvent, *, aggregate: bool = False) -> None:
        if aggregate:
            self.aggregated.append(event)
            if event.sample_weight is None:
                return
        self.events.append(event)

    def queue_depth(self) -> int:
        return 7

    def wait(self, count: int, timeout: float = 5.0) -> list[TelemetryEvent]:
        wait_for(lambda: len(self.events) >= count, timeout)
        return self.events

    def one(self) -> TelemetryEvent:
        self.wait(1)
        time.sleep(0.02)  # a second event would be a bug: give it the chance to show
        assert len(self.events) == 1, self.events
        return self.events[0]


class Sidecar:
    def __init__(self, loop: LoopThread, app: SidecarApp, store: policies.PolicyStore,
                 exporter: RecordingExporter, hooked: list[TelemetryEvent], server: str = "specgate") -> None:
        self.loop = loop
        self.app = app
        self.store = store
        self.exporter = exporter
        self.hooked = hooked
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server_kind = server
        if server == "uvicorn":  # the app is plain ASGI: it must also work without sidecar.server's extension
            config = uvicorn.Config(app, lifespan="on", http="httptools", access_log=False, log_level="critical")
            self.uvicorn = uvicorn.Server(config)
            self.future = asyncio.run_coroutine_threadsafe(self.uvicorn.serve(sockets=[sock]), loop.loop)
            wait_for(lambda: self.uvicorn.started or self.future.done())
            assert self.uvicorn.started
        else:
            async def start() -> HttpServer:
                server = HttpServer(app)
                sock.listen(128)
                await server.start(sock=sock)
                return server

            self.server = loop.run(start())

    def stop(self) -> None:
        if self.server_kind == "uvicorn":
            self.uvicorn.should_exit = True
            self.future.result(10)
        else:
            self.loop.run(self.server.shutdown(5.0))


SidecarFactory = Callable[..., Sidecar]
