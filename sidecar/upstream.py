"""The sidecar's HTTP/1.1 client to its engines: keep-alive connections on asyncio protocols, parsed by httptools.

Why not aiohttp here: on the OpenAI request path its client cost about 40 % of
the sidecar's CPU per request (BENCHMARKS.md, "Sidecar proxy overhead"), for
features the path never uses (redirects, cookies, decompression, proxies,
multipart, tracing hooks). This client does what the path needs and nothing
else: one request at a time per connection, no pipelining, a pool of idle
keep-alive connections per engine, whole bodies or bodies chunk by chunk, the
response headers as raw bytes. It is used for the OpenAI ``POST`` requests
only; pass-through requests (any method, redirects left to the client, ``HEAD``)
keep aiohttp.

Failures are :class:`UpstreamError` with a ``reason`` the telemetry records
(a ``wire.telemetry.FallbackReason``): ``connect_error`` (refused,
unreachable), ``connect_timeout``, ``read_timeout`` (no byte for
``read_timeout_s``; checked about once a second, so it fires up to a second
late) and ``upstream_disconnected`` (closed early, or not HTTP).

A connection goes back to the pool only when its response was read to the end
and the engine allows keep-alive; anything else closes it, so the engine sees
the client go away (vLLM aborts a generation whose connection closes).

An idle connection is reused for 4 s at most: vLLM's server (uvicorn) closes
idle keep-alive connections after 5 s, and a request written just as the
engine closes its connection is lost. Should that race happen anyway (a
clock, a busy engine), a request whose reused connection closed within
``_RACE_S`` of the write and before a single byte of answer goes once more on
a new connection: a close that late cannot be the engine having run it (a
generation takes longer, and vLLM aborts one whose connection closes). A
later close, or a new connection that closes unanswered, is the engine's
failure (``upstream_disconnected``), never sent twice.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from sidecar.support import wake
from wire.telemetry import FallbackReason

Headers = list[tuple[bytes, bytes]]

# A streaming reader that falls this far behind stops reading from the engine until it catches up.
_HIGH_WATER = 1 << 20
# Below uvicorn's 5 s keep-alive (vLLM's default): the engine never closes a connection we are about to reuse.
_IDLE_KEEPALIVE_S = 4.0
# A reused connection that closes this soon after the request was written, unanswered, lost the keep-alive race.
_RACE_S = 0.25


class UpstreamError(Exception):
    """The engine could not be reached, or failed before its response was complete."""

    def __init__(self, reason: FallbackReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class _Connection(asyncio.Protocol):
    """One keep-alive connection; httptools calls its ``on_*`` methods while it parses a response."""

    __slots__ = ("pool", "transport", "parser", "response", "last_io", "paused")

    def __init__(self, pool: Upstream) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser: Any = None
        self.response: Response | None = None
        self.last_io = 0.0
        self.paused = False

    # asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.complete:
            # bytes nobody asked for: an engine talking out of turn cannot be trusted with the next request
            self.abort()
            return
        self.last_io = self.pool.loop.time()
        response.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.abort()
            response._fail(UpstreamError(FallbackReason.upstream_disconnected, f"not HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None  # None from here on: closed
        response = self.response
        if response is not None and not response.complete:
            response._fail(UpstreamError(FallbackReason.upstream_disconnected, "the engine closed the connection"))

    def pause_writing(self) -> None:
        # The request is one bytes object already in memory; what the socket cannot take yet waits in the
        # transport's buffer, which grows by at most that one request.
        pass

    def resume_writing(self) -> None:
        pass

    # httptools' side
    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        if response is not None:
            response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is not None:
            response.status = self.parser.get_status_code()
            response._headers_done()

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:
            response._body(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None:
            response.keep_alive = self.parser.should_keep_alive()
            response._complete()

    # the pool's side
    def send(self, response: Response, data: bytes) -> None:
        self.response = response
        if self.parser is None:  # one parser per connection: llhttp starts over after each complete message
            self.parser = httptools.HttpResponseParser(self)
        self.last_io = self.pool.loop.time()
        if self.transport is None:  # lost between the pool and here
            response._fail(UpstreamError(FallbackReason.upstream_disconnected, "the engine closed the connection"))
            return
        self.transport.write(data)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
            self.transport = None


class Response:
    """An engine's response: ``status`` and ``headers`` (lower-case names) once :meth:`Upstream.request` returns.

    Read the body with :meth:`read` (whole) or :meth:`next_chunk` (as it arrives), then call :meth:`release`;
    :meth:`close` instead drops the connection (the engine sees the client go away).
    """

    __slots__ = ("conn", "status", "headers", "chunks", "buffered", "complete", "keep_alive", "error", "waiter",
                 "headers_ready", "done", "whole", "answered", "sent_at")

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.status = 0
        self.headers: Headers = []
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.headers_ready = False
        self.done = False
        self.whole = False
        self.answered = False  # a byte of the response arrived
        self.sent_at = 0.0

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    # --- fed by the connection ---------------------------------------------------------
    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        wake(waiter)

    def _headers_done(self) -> None:
        self.headers_ready = True
        self._wake()

    def _body(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        conn = self.conn
        if self.buffered > _HIGH_WATER and not self.whole and not conn.paused and conn.transport is not None:
            conn.paused = True
            conn.transport.pause_reading()
        self._wake()

    def _complete(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self._wake()

    async def _wait(self) -> None:
        if self.error is not None:
            self.close()
            raise self.error
        waiter = self.waiter = self.conn.pool.loop.create_future()
        try:
            await waiter
        except BaseException:  # cancelled (the client went away): the engine must see it too
            self.close()
            raise

    def _take(self) -> bytes:
        chunks = self.chunks
        self.chunks = []
        self.buffered = 0
        if self.conn.paused:
            self._resume()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _resume(self) -> None:
        self.conn.paused = False
        if self.conn.transport is not None:
            self.conn.transport.resume_reading()

    # --- read by the request path -----------------------------------------------------
    async def read(self) -> bytes:
        """The whole body (raises :class:`UpstreamError` if the engine fails before its end)."""
        self.whole = True  # no pausing at the high-water mark: nobody would read until the end
        if self.conn.paused:
            self._resume()
        while not self.complete:
            await self._wait()
        return self._take()

    async def next_chunk(self) -> bytes:
        """What arrived since the last call (waits for something); ``b""`` once the body is complete."""
        while not self.chunks:
            if self.complete:
                return b""
            await self._wait()
        return self._take()

    def release(self) -> None:
        """Done with this response: its connection goes back to the pool if it may be reused, else is closed."""
        conn = self.conn
        if self.done or not (self.complete and self.keep_alive and conn.transport is not None and not self.chunks):
            self.close()
            return
        self.done = True
        conn.response = None
        conn.pool._put(conn)

    def close(self) -> None:
        """Done with this response, unread or not: its connection is closed."""
        if self.done:
            return
        self.done = True
        self.conn.response = None
        self.conn.abort()


class Upstream:
    """Keep-alive connections to one engine's ``http(s)://host:port`` (opened when needed, kept while in use)."""

    def __init__(self, base_url: str, *, connect_timeout_s: float, read_timeout_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL must be http://HOST[:PORT][/PREFIX] (or https://), got {base_url!r}")
        self.host = parts.hostname
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/").encode()
        netloc = parts.netloc.rpartition("@")[2]
        self.host_header = netloc.encode("idna") if not netloc.isascii() else netloc.encode()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.loop = asyncio.get_running_loop()
        self.idle: deque[tuple[float, _Connection]] = deque()
        self.busy: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    async def request(self, method: bytes, target: bytes, headers: Headers, body: bytes) -> Response:
        """Sends one request; returns once the response's status and headers are in.

        ``target`` is the path and query (the engine URL's own path is put before it); ``headers`` must not
        hold Host, Content-Length, Connection or Transfer-Encoding, which this client writes.
        """
        if self._closed:
            raise UpstreamError(FallbackReason.connect_error, "the client is closed")
        parts = [method, b" ", self.prefix, target, b" HTTP/1.1\r\nhost: ", self.host_header,
                 b"\r\ncontent-length: %d\r\n" % len(body)]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"\r\n", body)
        data = b"".join(parts)
        conn = self._take_idle()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        response = self._send(conn, data)
        try:
            while not response.headers_ready:
                await response._wait()
        except UpstreamError as exc:
            # The engine closed an idle connection as the request left: nothing was answered, so it goes again,
            # once, on a new connection (see the module doc).
            if (not reused or response.answered or exc.reason != FallbackReason.upstream_disconnected
                    or self.loop.time() - response.sent_at > _RACE_S):
                raise
            response = self._send(await self._connect(), data)
            while not response.headers_ready:
                await response._wait()
        return response

    def _send(self, conn: _Connection, data: bytes) -> Response:
        self.busy.add(conn)
        if self._sweeper is None:
            self._arm_sweeper()
        response = Response(conn)
        response.sent_at = self.loop.time()
        conn.send(response, data)
        return response

    def _take_idle(self) -> _Connection | None:
        idle = self.idle
        now = self.loop.time()
        while idle:
            since, conn = idle.pop()  # the most recently used: the likeliest still open, and warm
            if conn.transport is not None and now - since <= _IDLE_KEEPALIVE_S:
                return conn
            conn.abort()
        return None

    async def _connect(self) -> _Connection:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.tls),
                self.connect_timeout_s)
        except TimeoutError as exc:
            raise UpstreamError(FallbackReason.connect_timeout, f"no connection to {self.host}:{self.port} "
                                f"within {self.connect_timeout_s} s") from exc
        except OSError as exc:
            raise UpstreamError(FallbackReason.connect_error,
                                f"{self.host}:{self.port}: {exc.strerror or exc}") from exc
        return conn

    def _put(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        if self._closed:
            conn.abort()
            return
        self.idle.append((self.loop.time(), conn))

    def _arm_sweeper(self) -> None:
        self._sweeper = self.loop.call_later(min(1.0, self.read_timeout_s / 4), self._sweep)

    def _sweep(self) -> None:
        """Read timeouts of busy connections, idle connections past their keep-alive; re-arms while any exist."""
        self._sweeper = None
        now = self.loop.time()
        for conn in list(self.busy):
            response = conn.response
            if conn.transport is None or response is None:
                self.busy.discard(conn)
            elif not response.complete and not conn.paused and now - conn.last_io > self.read_timeout_s:
                self.busy.discard(conn)
                conn.abort()
                response._fail(UpstreamError(FallbackReason.read_timeout,
                                             f"no data from the engine for {self.read_timeout_s} s"))
        idle = self.idle
        while idle and (idle[0][1].transport is None or now - idle[0][0] > _IDLE_KEEPALIVE_S):
            idle.popleft()[1].abort()
        if (self.busy or idle) and not self._closed:
            self._arm_sweeper()

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        while self.idle:
            self.idle.pop()[1].abort()
        for conn in list(self.busy):
            conn.abort()
        self.busy.clear()


__all__ = ["Response", "Upstream", "UpstreamError"]
