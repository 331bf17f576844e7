"""A TCP proxy for the soak (``bench/soak.py``) that can stall: a network that stops delivering, then recovers.

The sidecars reach the control plane through it. While stalled it accepts
connections and reads what arrives but forwards nothing in either direction,
like a link that black-holes packets without resetting connections: a sidecar's
telemetry POST, long-poll and heartbeat hang until their own timeouts, which
is the path a closed port (refused at once) never exercises. When the stall
ends, what was held back is delivered in order. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib

CHUNK = 65536


class StallProxy:
    """``127.0.0.1:port`` -> ``127.0.0.1:upstream_port``; :meth:`stall` pauses forwarding for a while."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections = 0
        self.stalls = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def pause(self) -> None:
        self.stalls += 1
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def stall(self, seconds: float) -> None:
        self.pause()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.resume()

    @property
    def stalled(self) -> bool:
        return not self._open.is_set()

    async def close(self) -> None:
        self._open.set()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            # Held before connecting too: a stalled link does not complete a request on a new connection either.
            await self._open.wait()
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            except OSError:
                return  # the control plane is down: the client sees its connection closed
            pumps = [asyncio.ensure_future(self._pump(reader, upstream_writer)),
                     asyncio.ensure_future(self._pump(upstream_reader, writer))]
            # HTTP never half-closes: when one direction ends the connection is over, both ways.
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except asyncio.CancelledError:
            pass  # closing: asyncio's stream callback would log a cancelled connection task as an error
        finally:
            for w in (writer, upstream_writer):
                if w is not None:
                    w.close()
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                await self._open.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
