"""A tiny TCP load balancer for tests: round-robin per connection over backends, bytes piped both ways.

It stands where nginx or a cloud balancer would in front of control-plane
replicas: it reads no HTTP, so a client's keep-alive connection stays on the
backend it first landed on, as it would behind a layer-4 balancer. Its asyncio
loop runs in a thread of its own, so that the test using it may block.

Per backend it counts the connections it sent there (``connections``) and the
ones it could not open (``refused``). A backend taken out (:meth:`remove`)
gets no new connection; one that refuses a connection is skipped for that
connection, as a balancer's passive health check would, and the next one in
turn is tried.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence

Backend = tuple[str, int]

_CHUNK = 65536


class Balancer:
    def __init__(self, backends: Sequence[Backend], host: str = "127.0.0.1") -> None:
        self.host = host
        self.backends: list[Backend] = list(backends)
        self.connections: dict[Backend, int] = dict.fromkeys(self.backends, 0)
        self.refused: dict[Backend, int] = dict.fromkeys(self.backends, 0)
        self.port = 0
        self._out: set[Backend] = set()
        self._next = 0
        self._lock = threading.Lock()  # the counters and the turn, read from the test's thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="balancer", daemon=True)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Balancer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, self.host, 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        """Stop listening, cut every open connection, and end the thread."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> Balancer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def remove(self, backend: Backend) -> None:
        """Take ``backend`` out: no new connection goes there (open ones stay until either side closes)."""
        with self._lock:
            self._out.add(backend)

    def add(self, backend: Backend) -> None:
        """Put ``backend`` (back) in turn."""
        with self._lock:
            if backend not in self.connections:
                self.backends.append(backend)
                self.connections[backend] = 0
                self.refused[backend] = 0
            self._out.discard(backend)

    def counts(self) -> dict[Backend, int]:
        with self._lock:
            return dict(self.connections)

    def _turn(self) -> list[Backend]:
        """The backends in, starting with the next in turn; the turn moves on by one per connection."""
        with self._lock:
            live = [b for b in self.backends if b not in self._out]
            if not live:
                return []
            start = self._next % len(live)
            self._next += 1
            return live[start:] + live[:start]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._open):
            task.cancel()
        await asyncio.gather(*self._open, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()  # since Python 3.12 it waits for the connections cut above

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._open.add(task)
        try:
            await self._serve(client_reader, client_writer)
        except asyncio.CancelledError:
            pass  # cut by stop(); asyncio's streams would log a cancelled connection task as an error
        finally:
            self._open.discard(task)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        backend_writer: asyncio.StreamWriter | None = None
        try:
            for backend in self._turn():
                try:
                    backend_reader, backend_writer = await asyncio.open_connection(*backend)
                except OSError:
                    with self._lock:
                        self.refused[backend] += 1
                    continue
                with self._lock:
                    self.connections[backend] += 1
                break
            else:
                return  # nothing to send it to: the client sees its connection closed
            pipes = [asyncio.create_task(_pipe(client_reader, backend_writer)),
                     asyncio.create_task(_pipe(backend_reader, client_writer))]
            try:
                # Both ways run until their ends close; a reset on either side ends the connection at once.
                await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            for writer in (client_writer, backend_writer):
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(OSError, asyncio.CancelledError):
                        await writer.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(_CHUNK):
        writer.write(data)
        await writer.drain()
    # Pass the half-close on: the other way may still have a response to deliver.
    if writer.can_write_eof() and not writer.is_closing():
        with contextlib.suppress(OSError):
            writer.write_eof()


def backend_of(url: str) -> Backend:
    """``http://host:port`` -> (host, port)."""
    host, _, port = url.split("://", 1)[-1].rstrip("/").rpartition(":")
    return host, int(port)
