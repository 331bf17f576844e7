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
  ``max_body_bytes`` (else 413 problem+json, sent as soon as the limit is
  passed, and the connection closes); an
  ``Expect: 100-continue`` is answered at once;
* limits against clients that hold a connection or memory (:class:`ServerLimits`):
  a request's header block (request line and headers) is at most
  ``max_header_bytes`` and ``max_header_count`` lines (else 431), must arrive
  within ``header_timeout_s`` of its first byte and its body within
  ``body_timeout_s`` of the headers (else 408); while a request is being
  answered, reading stops once ``max_buffered_bytes`` (or 16 requests) are
  buffered behind it; after any refusal the server stops sending and drops
  what the client still sends for up to 2 s, then closes;
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote

import httptools

from sidecar.support import wake
from wire.problems import PROBLEM_MEDIA_TYPE, problem_bytes

if TYPE_CHECKING:
    from sidecar.settings import SidecarSettings

log = logging.getLogger("specgate.sidecar.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_COUNT = 128
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
MAX_BUFFERED_BYTES = 1024 * 1024
_MAX_PIPELINED = 16  # requests queued behind the one being answered before reading pauses
_LINGER_S = 2.0  # how long a refused client may go on sending before the connection closes
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


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one client may hold: bytes of a request's head, time to send it, bytes read ahead (module docs)."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_header_count: int = MAX_HEADER_COUNT
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_buffered_bytes: int = MAX_BUFFERED_BYTES

    @classmethod
    def from_settings(cls, settings: SidecarSettings) -> ServerLimits:
        return cls(max_header_bytes=settings.max_header_bytes, max_header_count=settings.max_header_count,
                   header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
                   max_buffered_bytes=settings.max_buffered_bytes)


def _problem(status: int, slug: str, title: str, detail: str) -> bytes:
    """A whole HTTP response carrying a problem, for the server's own refusals; the connection closes after it."""
    body = problem_bytes(status, slug, title, detail)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%sconnection: close"
            b"\r\n\r\n%s" % (status, _REASONS.get(status, b""), _PROBLEM_TYPE, len(body), _date.get(), body))


class DisconnectHook:
    """The ``specgate.disconnect`` extension: the app sets ``on_disconnect``.

    An object of its own rather than the cycle itself: the scope holds it, so a cycle that held its scope
    and was its scope's extension would be a reference cycle, freed only by the garbage collector; a big
    request body parsed into many objects gets promoted to the oldest generation on the way, where it
    stayed for minutes (1 MB requests grew a sidecar by 1.1 MiB each until a full collection).
    """

    __slots__ = ("on_disconnect",)

    def __init__(self) -> None:
        self.on_disconnect: Callable[[], None] | None = None


class _Cycle:
    """One request and its response."""

    __slots__ = ("conn", "scope", "body", "keep_alive", "head_only", "started", "complete", "chunked",
                 "disconnected", "body_read", "waiter", "head", "hook")

    def __init__(self, conn: _Connection, scope: Scope, body: bytes, keep_alive: bool) -> None:
        self.conn = conn
        self.hook = DisconnectHook()
        scope["extensions"] = {"specgate.disconnect": self.hook}
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

    async def receive(self) -> Message:
        if not self.body_read:
            self.body_read = True
            # Handed over: the app holds the body for as long as it needs it, the cycle no longer.
            body, self.body = self.body, b""
            return {"type": "http.request", "body": body, "more_body": False}
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
            callback = self.hook.on_disconnect
            if callback is not None:
                self.hook.on_disconnect = None
                callback()


class _Connection(asyncio.Protocol):
    """One client connection; httptools calls its ``on_*`` methods while it parses requests."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.cycle: _Cycle | None = None
        self.pending: deque[_Cycle] = deque()
        self.pending_bytes = 0  # bodies of the requests in ``pending``
        self.closing = False
        self.rejected = False
        self.refusal = b""  # a refusal waiting for the answer in progress (and those queued before it) to end
        self.linger_until = 0.0  # a refusal was sent: what still comes is read and dropped until then, then close
        self.upgrade = False
        self.read_paused = False
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.idle_since = self.loop.time()
        self.in_head = False
        self.head_fresh = False
        self.head_more = 0  # bytes read for the current head after the read it began in
        self.reading = 0  # bytes of the read being parsed
        self.head_first = 0  # bytes of the read the current head began in
        self.deadline = 0.0  # when the current request's head (or body) must be in; 0: no request coming in
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
        self.pending_bytes = 0
        waiter, self.drain_waiter = self.drain_waiter, None
        wake(waiter)

    def data_received(self, data: bytes) -> None:
        if self.rejected:  # refused: nothing more is parsed, what still comes is dropped (see _send_refusal)
            return
        if self.cycle is None:  # a request coming in slowly is not idle; one stalled keepalive_s is
            self.idle_since = self.loop.time()
        self.reading = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.reject(400, "bad-request", "Bad request", "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self.reject(400, "bad-request", "Bad request", f"malformed HTTP request: {exc}")
        if self.in_head and not self.rejected:
            # httptools keeps a header until it is complete, so a huge one must be cut off while it arrives.
            # The read a head began in may also hold the end of the request before it: counting only the reads
            # after it never counts a byte of another request, and bounds what is held to one read more.
            if self.head_fresh:
                self.head_fresh = False
            else:
                self.head_more += len(data)
                if self.head_more > self.limits.max_header_bytes:
                    self._too_many_header_bytes(None)

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
        self.in_head = True
        self.head_fresh = True
        self.head_more = 0
        self.head_first = self.reading
        self.deadline = self.loop.time() + self.limits.header_timeout_s

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_header_count:
            if not self.rejected:
                self.reject(431, "header-fields-too-large", "Request header fields too large",
                            f"the request has more than {self.limits.max_header_count} header lines")
            return
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        if self.rejected:
            return
        self.deadline = self.loop.time() + self.limits.body_timeout_s
        # A head that fits in the reads it came in fits the limit: only a longer one is measured, as sent but
        # for optional whitespace around values ("METHOD URL HTTP/x.y", "name: value").
        limit = self.limits.max_header_bytes
        most = self.reading if self.head_fresh else self.head_first + self.head_more + self.reading
        if most > limit and (
                len(self.url) + 15 + sum(len(name) + len(value) + 4 for name, value in self.headers) > limit):
            largest = max(self.headers, key=lambda header: len(header[0]) + len(header[1]), default=None)
            self._too_many_header_bytes(largest[0] if largest is not None else None)
            return
        self.upgrade = self.parser.should_upgrade()
        limit = self.server.max_body_bytes
        expect = False
        for name, value in self.headers:
            if name == b"content-length":
                with contextlib.suppress(ValueError):
                    if int(value) > limit:
                        self._too_large()  # now, not once the body is in: the client need not send it
                        return
            elif name == b"expect" and value.lower() == b"100-continue":
                expect = True
        if expect and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.rejected:
            return
        self.size += len(body)
        if self.size > self.server.max_body_bytes:
            self.chunks = []
            self._too_large()
            return
        self.chunks.append(body)
        if (self.cycle is not None and not self.read_paused
                and self.pending_bytes + self.size > self.limits.max_buffered_bytes):
            self._pause_reading()

    def on_message_complete(self) -> None:
        self.deadline = 0.0
        if self.transport is None or self.closing:
            return
        if self.upgrade:  # WebSocket, h2c: httptools would hand over the raw stream, which nothing here speaks
            self.reject(400, "bad-request", "Bad request", "protocol upgrades are not supported")
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
        self.chunks = []
        self.size = 0
        if self.cycle is None:
            self.run(cycle)
        else:
            self.pending.append(cycle)
            self.pending_bytes += len(body)
            if not self.read_paused and (len(self.pending) >= _MAX_PIPELINED
                                         or self.pending_bytes > self.limits.max_buffered_bytes):
                self._pause_reading()

    def _too_many_header_bytes(self, largest: bytes | None) -> None:
        limit = self.limits.max_header_bytes
        detail = f"the request's header block (request line and headers) exceeds {limit} bytes"
        if largest is not None:
            detail += f"; its largest header is {largest.decode('latin-1')!r}"
        self.reject(431, "header-fields-too-large", "Request header fields too large", detail)

    def _too_large(self) -> None:
        limit = self.server.max_body_bytes
        self.reject(413, "too-large", "Request body too large", f"the request body exceeds {limit} bytes")

    # --- flow control -----------------------------------------------------------------
    def _pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.read_paused and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
            if self.deadline:  # the client could not send while reading was paused: its clock starts again
                timeout = self.limits.header_timeout_s if self.in_head else self.limits.body_timeout_s
                self.deadline = self.loop.time() + timeout

    def expire(self, now: float) -> None:
        """On every sweep: a refused connection stops lingering, a request too slow to arrive gets 408."""
        if self.linger_until:
            if now > self.linger_until and self.transport is not None:
                self.transport.close()
        elif self.deadline and now > self.deadline and not self.read_paused and not self.rejected:
            if self.in_head:
                what, limit = "header block", self.limits.header_timeout_s
            else:
                what, limit = "body", self.limits.body_timeout_s
            self.reject(408, "request-timeout", "Request timeout",
                        f"the request's {what} did not arrive within {limit:g} s")

    # --- running the app ----------------------------------------------------------------
    def run(self, cycle: _Cycle) -> None:
        self.cycle = cycle
        task = self.loop.create_task(self.server.run_app(cycle))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    def finished(self, cycle: _Cycle) -> None:
        """The response is complete: the next pipelined request, or a refusal, or close, or wait idle."""
        if cycle is not self.cycle:
            return
        self.cycle = None
        self.idle_since = self.loop.time()
        if self.transport is None:
            return
        if not cycle.keep_alive:
            self.transport.close()
            return
        if self.pending:
            nxt = self.pending.popleft()
            self.pending_bytes -= len(nxt.body)
            self.run(nxt)
            if (self.read_paused and not self.rejected and len(self.pending) < _MAX_PIPELINED // 2
                    and self.pending_bytes + self.size <= self.limits.max_buffered_bytes):
                self._resume_reading()
            return
        if self.refusal:
            self._send_refusal()
        elif self.closing:
            self.transport.close()
        elif self.read_paused:
            self._resume_reading()

    def reject(self, status: int, slug: str, title: str, detail: str) -> None:
        """Answers a request the app never sees, after the answers to the requests before it, then closes."""
        if self.rejected:
            return
        self.rejected = True
        self.closing = True
        self.deadline = 0.0
        self.refusal = _problem(status, slug, title, detail)
        if self.transport is None:
            return
        if self.cycle is None:
            self._send_refusal()
        else:  # the answer in progress must not be interleaved: this one waits its turn, and reading stops
            self._pause_reading()

    def _send_refusal(self) -> None:
        """Writes the refusal and ends the connection's sending side, then lingers; see :meth:`expire`.

        Closing at once while the client is still sending (a body over the limit, a huge head) would make the
        kernel answer its data with a reset, which can destroy the refusal before the client reads it.
        """
        transport = self.transport
        refusal, self.refusal = self.refusal, b""
        self.pending.clear()
        self.pending_bytes = 0
        if transport is None:
            return
        transport.write(refusal)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.linger_until = self.loop.time() + _LINGER_S
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()

    def close_if_idle(self) -> None:
        if self.cycle is None and self.transport is not None:
            self.transport.close()


class HttpServer:
    """Serves one ASGI app (see the module docs)."""

    def __init__(self, app: App, *, max_body_bytes: int = MAX_BODY_BYTES, keepalive_s: float = 5.0,
                 limits: ServerLimits | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        self.limits = limits or ServerLimits()
        # the sweep is what enforces the timeouts, so it runs often enough for the shortest of them
        self.sweep_s = min(1.0, keepalive_s / 4, self.limits.header_timeout_s / 4, self.limits.body_timeout_s / 4)
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
        self._sweeper = self.loop.call_later(self.sweep_s, self._sweep)

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
            else:
                conn.expire(now)
        self._sweeper = self.loop.call_later(self.sweep_s, self._sweep)

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
            conn.pending_bytes = 0
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


__all__ = ["MAX_BODY_BYTES", "HttpServer", "ServerLimits"]
