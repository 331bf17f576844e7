"""A real uvicorn server in a thread, for streaming responses TestClient cannot follow."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.auth.service import create_key
from controlplane.settings import ControlPlaneSettings
from policies import SigningKey
from tests.support.fleet_rows import session_for


def ctrl_c_as_at_a_terminal() -> None:
    """``preexec_fn`` for a child that a test stops with SIGINT, as a person at a terminal would.

    A process started in the background by a non-interactive shell inherits SIGINT ignored, and Python then
    installs no KeyboardInterrupt handler; a suite run that way would see Ctrl-C tests hang. Here the child
    gets the default disposition whatever pytest inherited.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


WORKER_ID = "w-sync-1"


class ControlPlane:
    """The real control plane app, started and stopped on one port (so a sidecar sees it go and come back)."""

    def __init__(self, database_url: str, signing_key: SigningKey | None = None) -> None:
        self.database_url = database_url
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.signing_key = signing_key or SigningKey.generate()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        with session_for(database_url) as session:
            # Bound (issue 16) to the workers the sidecar tests run with this key: test_sync's, test_main's,
            # and test_telemetry's, which sends telemetry without registering.
            _, self.worker_token = create_key(session, name="sidecar", scope=Scope.worker, created_by="test",
                                              worker_ids=[WORKER_ID, "w-main", "w1"])
            _, self.admin_token = create_key(session, name="admin", scope=Scope.admin, created_by="test")

    def start(self, signing_key: SigningKey | None = None) -> None:
        settings = ControlPlaneSettings(database_url=self.database_url, worker_stale_after_s=30,
                                        long_poll_max_s=60, sse_keepalive_s=5,
                                        signing_key=(signing_key or self.signing_key).private_key_b64())
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on",
                                timeout_graceful_shutdown=0.3)  # type: ignore[arg-type]  # a float works
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="control-plane", daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive(), "the control plane did not start"
            assert time.monotonic() < deadline, "the control plane did not start in time"
            time.sleep(0.01)
        self._server, self._thread = server, thread

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)
            assert not self._thread.is_alive()
        self._server = self._thread = None

    async def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.base, timeout=10,
                                     headers={"Authorization": f"Bearer {self.admin_token}"}) as client:
            return await client.request(method, path, **kwargs)

    async def kill_switch(self, enabled: bool) -> None:
        r = await self.call("PUT", "/v1/killswitch", json={"enabled": enabled, "reason": "test"})
        assert r.status_code == 200, r.text
        assert r.json()["changed"] is True

    async def worker(self, worker_id: str = WORKER_ID) -> dict[str, Any] | None:
        r = await self.call("GET", "/v1/workers")
        assert r.status_code == 200, r.text
        return next((w for w in r.json()["items"] if w["id"] == worker_id), None)

    async def envelope(self) -> bytes:
        async with httpx.AsyncClient(base_url=self.base, timeout=10) as client:
            r = await client.get("/v1/bundle", params={"worker": WORKER_ID},
                                 headers={"Authorization": f"Bearer {self.worker_token}"})
        assert r.status_code == 200, r.text
        return r.content
