"""The sidecar's HTTP/1.1 server: an ASGI server on asyncio protocols, parsed by httptools.

Why not uvicorn: on the sidecar's request path uvicorn and its client-disconnect
handling cost about a sixth of the sidecar's CPU per request (BENCHMARKS.md,
"Sidecar proxy overhead"), and finding out that a client went away needed a
task per request waiting on ``receive()``. This server is what the sidecar
needs and no more:

* HTTP/1.1 and 1.0, keep-alive, pipelined requests answered in order; no
  upgrades (WebSocket, h2c: 400), no TLS (the sidecar listens beside its
  engines; put a TLS terminator in front if clients come from afar);
* a request's body is read whole before the app runs, at most
  ``max_body_bytes`` (else 413 problem+json and the connection closes); an
  ``Expect: 100-continue`` is answered at once;
* ASGI 3 ``http`` scopes: the first ``receive()`` gives the whole body, the
  next one waits for the client to disconnect (or the response to end);
  responses without ``content-length`` go out chunked; ``HEAD`` answers carry
  no body; writes wait while the client's socket is full;
* the extension ``specgate.disconnect``: an object whose ``on_disconnect``
  the app may set to a callable, called once if the client disconnects before
  its response is complete (the sidecar cancels its upstream request there,
  without a task per request waiting on ``receive()``);
* connections close after ``keepalive_s`` without a byte while no request is
  being answered (idle keep-alive, or a request stalled half-sent); :meth:`HttpServer.shutdown`
  stops accepting, lets requests in flight finish for up to a timeout, then
  cancels what is left.

The app's own ``startup()``/``shutdown()`` (when it has them) run in
:meth:`HttpServer.start`/:meth:`HttpServer.shutdown`, in place of the ASGI lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast
from urllib.parse import unquote

import httptools

from sidecar.support import wake
from wire.problems import PROBLEM_MEDIA_TYPE, problem_bytes

log = logging.getLogger("specgate.sidecar.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

MAX_BODY_BYTES = 64 * 1024 * 1024
_MAX_PIPELINED = 16  # requests queued behind the one being answered before reading pauses
_DISCONNECT: Message = {"type": "http.disconnect"}
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_NO_BODY_STATUS = frozenset({204, 304})
_PROBLEM_TYPE = PROBLEM_MEDIA_TYPE.encode()


class _Date:
    """The ``date`` header line, formatted once a second."""

    __slots__ = ("second", "line")

    def __init__(self) -> None:
        self.second = -1
        self.line = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = b"date: " + time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)).encode() + b"\r\n"
        return self.line


_date = _Date()


def _problem(status: int, slug: str, title: str, detail: str) -> bytes:
    """A whole HTTP response carrying a problem, for the server's own refusals; the connection closes after it."""
    body = problem_bytes(status, slug, title, detail)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%sconnection: close"
            b"\r\n\r\n%s" % (status, _REASONS.get(status, b""), _PROBLEM_TYPE, len(body), _date.get(), body))


class _Cycle:
    """One request and its response; also its ``specgate.disconnect`` extension (``on_disconnect``)."""

    __slots__ = ("conn", "scope", "body", "keep_alive", "head_only", "started", "complete", "chunked",
                 "disconnected", "body_read", "waiter", "head", "on_disconnect")

    def __init__(self, conn: _Connection, scope: Scope, body: bytes, keep_alive: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.body = body
        self.keep_alive = keep_alive
        self.head_only = scope["method"] == "HEAD"
        self.started = False
        self.complete = False
        self.chunked = False
        self.disconnected = False
        self.body_read = False
        self.waiter: asyncio.Future[None] | None = None
        self.head = b""
        self.on_disconnect: Callable[[], None] | None = None

    async def receive(self) -> Message:
        if not self.body_read:
            self.body_read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if not (self.disconnected or self.complete):
            waiter = self.waiter = self.conn.loop.create_future()
            await waiter
        return _DISCONNECT

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        wake(waiter)

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if not self.started:
                raise RuntimeError("http.response.body before http.response.start")
            if self.complete:
                raise RuntimeError("http.response.body after the response ended")
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if self.head_only:
                body = b""
            if self.chunked:
                data = self.head + (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (
                    b"" if more else b"0\r\n\r\n")
            elif self.head:
                data = self.head + body
            else:
                data = body
            self.head = b""
            conn = self.conn
            if data and not self.disconnected and conn.transport is not None:
                conn.transport.write(data)
            if not more:
                self.complete = True
                self._wake()
                conn.finished(self)
            elif conn.write_paused and not self.disconnected:
                await conn.drain()
        elif kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            status = message["status"]
            lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
            has_length = False
            for name, value in message.get("headers", ()):
                name = name.lower()
                if name == b"content-length":
                    has_length = True
                elif name in (b"transfer-encoding", b"connection", b"date"):
                    continue  # this server's to say
                lines.append(b"%s: %s\r\n" % (name, value))
            if not has_length and not self.head_only and status not in _NO_BODY_STATUS and status >= 200:
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
            lines.append(_date.get())
            if not self.keep_alive:
                lines.append(b"connection: close\r\n")
            lines.append(b"\r\n")
            self.head = b"".join(lines)  # written with the first body message: one write for small answers
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def lost(self) -> None:
        """The client went away."""
        if self.disconnected:
            return
        self.disconnected = True
        self._wake()
        if not self.complete:
            hook = self.on_disconnect
            if hook is not None:
                self.on_disconnect = None
                hook()


class _Connection(asyncio.Protocol):
    """One client connection; httptools calls its ``on_*`` methods while it parses requests."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.too_large = False
        self.cycle: _Cycle | None = None
        self.pending: deque[_Cycle] = deque()
        self.closing = False
        self.rejected = False
        self.upgrade = False
        self.read_paused = False
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.idle_since = self.loop.time()
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None

    # --- asyncio's side ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        self.local = (str(local[0]), int(local[1])) if isinstance(local, tuple) else None
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)
        if self.cycle is not None:
            self.cycle.lost()
        self.pending.clear()
        waiter, self.drain_waiter = self.drain_waiter, None
        wake(waiter)

    def data_received(self, data: bytes) -> None:
        if self.cycle is None:  # a request coming in slowly is not idle; one stalled keepalive_s is
            self.idle_since = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.reject(400, "bad-request", "Bad request", "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self.reject(400, "bad-request", "Bad request", f"malformed HTTP request: {exc}")

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter, self.drain_waiter = self.drain_waiter, None
        wake(waiter)

    async def drain(self) -> None:
        if self.write_paused and self.transport is not None:
            waiter = self.drain_waiter = self.loop.create_future()
            await waiter

    # --- httptools' side --------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.chunks = []
        self.size = 0
        self.too_large = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.upgrade = self.parser.should_upgrade()
        limit = self.server.max_body_bytes
        for name, value in self.headers:
            if name == b"content-length":
                with contextlib.suppress(ValueError):
                    if int(value) > limit:
                        self.too_large = True
            elif name == b"expect" and value.lower() == b"100-continue" and self.transport is not None:
                if not self.too_large:
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.too_large:
            return
        self.size += len(body)
        if self.size > self.server.max_body_bytes:
            self.too_large = True
            self.chunks = []
        else:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.transport is None or self.closing:
            return
        if self.upgrade:  # WebSocket, h2c: httptools would hand over the raw stream, which nothing here speaks
            self.reject(400, "bad-request", "Bad request", "protocol upgrades are not supported")
            return
        if self.too_large:
            limit = self.server.max_body_bytes
            self.reject(413, "too-large", "Request body too large", f"the request body exceeds {limit} bytes")
            return
        parser = self.parser
        parsed = httptools.parse_url(self.url)
        raw_path = parsed.path
        path = raw_path.decode("ascii", "replace")
        if "%" in path:
            path = unquote(path)
        chunks = self.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": parser.get_http_version(), "method": parser.get_method().decode("ascii"),
            "scheme": "http", "path": path, "raw_path": raw_path, "query_string": parsed.query or b"",
            "root_path": "", "headers": self.headers, "client": self.client, "server": self.local,
        }
        cycle = _Cycle(self, scope, body, parser.should_keep_alive() and not self.server.stopping)
        scope["extensions"] = {"specgate.disconnect": cycle}
        if self.cycle is None:
            self.run(cycle)
        else:
            self.pending.append(cycle)
            if len(self.pending) >= _MAX_PIPELINED and not self.read_paused and self.transport is not None:
                self.read_paused = True
                self.transport.pause_reading()

    # --- running the app ----------------------------------------------------------------
    def run(self, cycle: _Cycle) -> None:
        self.cycle = cycle
        task = self.loop.create_task(self.server.run_app(cycle))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    def finished(self, cycle: _Cycle) -> None:
        """The response is complete: the next pipelined request, or close, or wait idle."""
        if cycle is not self.cycle:
            return
        self.cycle = None
        self.idle_since = self.loop.time()
        if self.transport is None:
            return
        if not cycle.keep_alive or self.closing:
            self.transport.close()
            return
        if self.pending:
            self.run(self.pending.popleft())
            if self.read_paused and len(self.pending) < _MAX_PIPELINED // 2:
                self.read_paused = False
                self.transport.resume_reading()

    def reject(self, status: int, slug: str, title: str, detail: str) -> None:
        """Answers a request the app never sees, then closes the connection."""
        if self.rejected:
            return
        self.rejected = True
        self.closing = True
        self.pending.clear()
        if self.transport is not None:
            if self.cycle is None:  # else the answer in progress must not be interleaved: just close
                self.transport.write(_problem(status, slug, title, detail))
            self.transport.close()

    def close_if_idle(self) -> None:
        if self.cycle is None and self.transport is not None:
            self.transport.close()


class HttpServer:
    """Serves one ASGI app (see the module docs)."""

    def __init__(self, app: App, *, max_body_bytes: int = MAX_BODY_BYTES, keepalive_s: float = 5.0) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.listener: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None) -> None:
        startup = getattr(self.app, "startup", None)
        if startup is not None:
            await startup()
        if sock is not None:
            self.listener = await self.loop.create_server(lambda: _Connection(self), sock=sock, backlog=2048)
        else:
            self.listener = await self.loop.create_server(lambda: _Connection(self), host, port, backlog=2048,
                                                          reuse_address=True)
        self._sweeper = self.loop.call_later(1.0, self._sweep)

    @property
    def port(self) -> int:
        sockets = getattr(self.listener, "sockets", None) or ()
        if not sockets:
            raise RuntimeError("the server is not listening")
        return int(sockets[0].getsockname()[1])

    async def run_app(self, cycle: _Cycle) -> None:
        failure = b""
        try:
            await self.app(cycle.scope, cycle.receive, cycle.send)
        except asyncio.CancelledError:
            if not self.stopping and not cycle.disconnected:
                raise
            # cancelled by shutdown() after its grace period (or after the client left: then nobody reads it)
            failure = _problem(503, "shutting-down", "Shutting down",
                               "the sidecar stopped before this request was answered")
        except Exception:
            log.exception("the app failed on %s %s", cycle.scope["method"], cycle.scope["path"])
            failure = _problem(500, "internal", "Internal error", "the sidecar failed on this request")
        if not cycle.complete:  # the app ended without ending its response: the client must not wait for more
            cycle.complete = True
            conn = cycle.conn
            if conn.transport is not None:
                if not cycle.started and not cycle.disconnected:
                    conn.transport.write(failure or _problem(500, "internal", "Internal error",
                                                             "no response was produced"))
                conn.transport.close()
            conn.finished(cycle)

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            if conn.cycle is None and now - conn.idle_since > self.keepalive_s:
                conn.close_if_idle()
        self._sweeper = self.loop.call_later(1.0, self._sweep)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops accepting; requests in flight get ``timeout_s`` to finish, then are cancelled; then the app stops."""
        self.stopping = True
        if self.listener is not None:
            self.listener.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            conn.closing = True
            conn.pending.clear()
            conn.close_if_idle()
        if self.tasks:
            _, running = await asyncio.wait(set(self.tasks), timeout=timeout_s)
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running, timeout=5)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self.listener is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.listener.wait_closed(), 5)
        shutdown = getattr(self.app, "shutdown", None)
        if shutdown is not None:
            await shutdown()


__all__ = ["MAX_BODY_BYTES", "HttpServer"]
