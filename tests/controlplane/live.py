"""A real uvicorn server in a thread, for streaming responses TestClient cannot follow."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI


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
