"""The sidecar's request path: a raw ASGI app in front of one worker's engine variants (or, as a gateway, in
front of pools of replicas of them).

``build_app(settings, store, exporter, on_event=None)`` returns the app. Per
OpenAI request (``POST /v1/chat/completions``, ``POST /v1/completions``) it

1. reads and parses the body once, classifies it (:mod:`sidecar.classify`)
   with the batch size of :mod:`sidecar.replicas` (per worker, or per engine:
   the batch on the replica the request would join), and decides with
   ``store.current.decide(shape)`` (503 problem+json before the first policy;
   400 naming the field for what :class:`sidecar.classify.RequestError`
   refuses and for labels or an output schema over the settings' limits);
2. forwards it to a healthy replica of ``decision.engine`` (least loaded, or
   the one ``X-Specgate-Affinity`` sticks to) over its pool of keep-alive
   connections (:mod:`sidecar.upstream`); an engine the worker does not have,
   or whose replicas are all ejected or full, is replaced by the policy's
   fallback (plain) engine, recorded as ``fallback_reason``
   ``engine_not_configured``, ``pool_unavailable`` or ``pool_saturated``; no
   healthy replica of the fallback either is a 503 with ``Retry-After``;
3. if a replica fails before the client got a byte (connection refused,
   connect timeout, broken connection, 5xx), retries on another replica of
   the same engine, else, for a speculative decision, on the fallback pool
   (``retries``, ``fallback=True``, the ``fallback_reason`` of
   ``wire.telemetry.FallbackReason`` or ``upstream_5NN``), three attempts at
   most;
4. relays the answer: JSON whole, streams event by event as they arrive;
5. after the response is complete, builds one ``TelemetryEvent`` and hands it
   to ``exporter.submit`` and the ``on_event`` hook, on a later loop turn; a
   request the policy's ``quality`` samples is first answered again by the
   plain engine and compared (:mod:`sidecar.shadow`), off the client's path.

Per-request engine metrics: the engines run with ``--enable-per-request-metrics``
(speculative ones also with ``--per-request-spec-decode-metrics summary``), so
vLLM adds a top-level ``metrics`` object to JSON answers and to the final usage
chunk of streams, which exists only with ``stream_options.include_usage``. The
client keeps the semantics it asked for, as if the engines ran without those
flags:

* streams: the sidecar sets ``include_usage`` when the client did not, and then
  drops the usage-only chunk (and strips ``usage``/``metrics`` from any other
  chunk); when the client asked for usage it gets the usage chunk, minus
  ``metrics``;
* JSON answers: ``metrics`` is removed.

``build_app(..., expose_engine_metrics=True)`` (or the setting of that name,
``SPECGATE_EXPOSE_ENGINE_METRICS=true``) keeps ``metrics`` wherever the client
would get the carrying object anyway.

Every other path (``GET /v1/models`` included) is passed through unchanged to
the fallback engine of the current policy; the sidecar's own paths are
``GET /metrics`` (Prometheus), ``GET /healthz`` (alive) and ``GET /readyz``
(200 once a policy is loaded, else 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import aiohttp
from yarl import URL

from policies import CompiledBundle, CompiledPolicy, Decision, PolicyStore, RequestShape
from sidecar.classify import JSON_OBJECT, RequestError, check_text, classify, output_schema_at
from sidecar.metrics import SidecarMetrics
from sidecar.output_schema import compile_output_schema
from sidecar.replicas import POOL_SATURATED, InFlight, Pools, Replica, retry_after_s
from sidecar.server import MAX_BODY_BYTES
from sidecar.settings import SidecarSettings
from sidecar.shadow import (
    CheckRunner,
    StreamCapture,
    answer_of,
    common_prefix_length,
    comparable,
    load_check,
    shadow_body,
)
from sidecar.upstream import Headers, Response, Upstream, UpstreamError
from wire.problems import PROBLEM_MEDIA_TYPE, problem_bytes
from wire.telemetry import (
    MAX_FLOAT,
    MAX_INT,
    EventStatus,
    FallbackReason,
    TelemetryEvent,
    encode_labels,
    upstream_status_reason,
)

try:  # orjson is several times faster than the stdlib; both give the same values here
    import orjson

    def _loads(data: bytes) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:  # e.g. integers beyond 64 bits: let the stdlib decide
            return json.loads(data)

    def _dumps(value: Any) -> bytes:
        try:
            return orjson.dumps(value)
        except TypeError:  # an integer beyond 64 bits, a lone surrogate
            return _stdlib_dumps(value)

    def _schema_key(schema: Any) -> bytes:
        """A schema's compact JSON; RecursionError beyond orjson's depth (255 levels).

        The stdlib encoder's depth follows the interpreter's recursion limit, which any imported library
        may raise: whether a deep schema is refused must not depend on what else the process loaded.
        """
        try:
            return orjson.dumps(schema)
        except TypeError as exc:
            if "Recursion limit" in str(exc):
                raise RecursionError(str(exc)) from None
            return _stdlib_dumps(schema)

except ImportError:  # pragma: no cover - orjson is optional
    def _loads(data: bytes) -> Any:
        return json.loads(data)

    def _dumps(value: Any) -> bytes:
        return _stdlib_dumps(value)

    def _schema_key(schema: Any) -> bytes:
        return _stdlib_dumps(schema)


def _stdlib_dumps(value: Any) -> bytes:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # A lone surrogate the client sent as an escape (the stdlib parser accepts it): escaped again, the
        # engine gets the very text the client sent, where UTF-8 cannot hold it.
        return json.dumps(value, separators=(",", ":")).encode()


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Exporter(Protocol):
    # aggregate: the request goes into the worker's rollup deltas; the event is sent only when sampled
    def submit(self, event: TelemetryEvent, *, aggregate: bool = ...) -> None: ...


API_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

# request headers never forwarded (hop-by-hop, or set by the client library)
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                  b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"})
_API_DROP = _HOP | {b"accept-encoding"}
# engine endpoints that generate text: passing them through would bypass the policy and telemetry
_UNDECIDED = frozenset({"/invocations"})
# upstream response headers not relayed (hop-by-hop; date/server come from our server)
_RESP_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server",
                        b"x-request-id", b"proxy-authenticate", b"trailer", b"upgrade", b"te"})
_START = "http.response.start"
_BODY = "http.response.body"
_H_DECISION = b"x-specgate-decision"
_REPLICA = b"; replica="
_H_RETRY_AFTER = b"retry-after"
# Attempts of one request, first included: another replica of its engine, then the fallback pool.
MAX_ATTEMPTS = 3
# An affinity key is hashed per replica of every engine: a conversation id fits, a body does not.
MAX_AFFINITY_CHARS = 256
# The answers that say the server, not the request, is failing: only these (and connections that fail) count
# towards a replica's ejection. A 500 may be the request's own doing; any client could eject a pool with it.
_SERVER_FAILING = frozenset({502, 503, 504})
_H_REQUEST_ID = b"x-request-id"
_H_FALLBACK = b"x-specgate-fallback"
_H_CONTENT_TYPE = b"content-type"
_H_CONTENT_LENGTH = b"content-length"
_PROBLEM_TYPE = PROBLEM_MEDIA_TYPE.encode()
# Looking up an enum member costs ~70 ns on Python 3.11, a module global a tenth of that; every request reads this.
_OK = EventStatus.ok
_STREAM_BROKEN = (b'data: {"error":{"message":"the engine connection broke mid-stream",'
                  b'"type":"upstream_error","code":502}}\n\n')


def _failure_reason(exc: BaseException) -> FallbackReason:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return FallbackReason.connect_timeout
    if isinstance(exc, aiohttp.ClientConnectorError):
        return FallbackReason.connect_error
    if isinstance(exc, TimeoutError):
        return FallbackReason.read_timeout
    return FallbackReason.upstream_disconnected


_UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError)
_MISSING: Any = object()


class _SchemaCache:
    """Compiled output schemas by their compact JSON, bounded by the bytes of those keys, least recently used
    out first; a schema not compiled yet is compiled once, off the loop, however many requests carry it.

    Compilations run one at a time on a thread of their own (``check_schema`` of a large schema takes
    seconds of pure Python, which on the loop would stall every request and ``/healthz``), so that a flood
    of new schemas cannot take the threads the telemetry exporter encodes on; past ``max_pending`` schemas
    waiting, a new one gets no verdict rather than a place in the queue. The validators match patterns with
    RE2 and fetch no remote reference (sidecar/output_schema.py): checking an answer stays on the loop.
    """

    __slots__ = ("max_bytes", "max_pending", "size", "entries", "pending", "_executor")

    def __init__(self, max_bytes: int, max_pending: int = 32) -> None:
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self.size = 0
        self.entries: OrderedDict[bytes, Any] = OrderedDict()
        self.pending: dict[bytes, asyncio.Future[Any]] = {}
        self._executor: ThreadPoolExecutor | None = None

    def lookup(self, key: bytes, schema: Any) -> Any:
        """The validator (None: no verdict), or a future of it while it compiles."""
        validator = self.entries.get(key, _MISSING)
        if validator is not _MISSING:
            self.entries.move_to_end(key)
            return validator
        future = self.pending.get(key)
        if future is None:
            if len(self.pending) >= self.max_pending:
                return None
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="specgate-schema")
            future = asyncio.get_running_loop().run_in_executor(self._executor, compile_output_schema, schema)
            self.pending[key] = future
            future.add_done_callback(lambda done: self._compiled(key, done))
        return future

    def _compiled(self, key: bytes, future: asyncio.Future[Any]) -> None:
        self.pending.pop(key, None)
        if not future.cancelled():
            self.put(key, None if future.exception() is not None else future.result())

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def put(self, key: bytes, validator: Any) -> None:
        if len(key) > self.max_bytes or key in self.entries:
            return
        self.entries[key] = validator
        self.size += len(key)
        while self.size > self.max_bytes:
            old, _ = self.entries.popitem(last=False)
            self.size -= len(old)


def _num(value: Any, *, integer: bool = False, at_most: float | None = None) -> Any:
    """A non-negative finite number from engine JSON within the event's bounds, else None (events must stay
    valid: the control plane refuses an event beyond them)."""
    # Exact type checks: JSON gives exactly int, float or bool (bool must not pass as an int), and ten of
    # these run per request.
    kind = type(value)
    if integer:
        return value if kind is int and 0 <= value <= MAX_INT else None
    if kind is int:
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            return None
    elif kind is not float:
        return None
    if not 0 <= value <= MAX_FLOAT:
        return None
    return value if at_most is None or value <= at_most else at_most


class _Watched:
    """What a client-disconnect watcher needs: the task to cancel and whether the answer is done.

    Under :mod:`sidecar.server` the server calls back when the client goes away (its ``specgate.disconnect``
    extension); under another ASGI server a task waits on ``receive()`` for ``http.disconnect``.
    """

    __slots__ = ("task", "disconnected", "done", "hook")

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.disconnected = False
        self.done = False
        self.hook: Any = None

    def on_disconnect(self) -> None:
        """The client went away before we finished: cancel the request task (and with it the engine's request)."""
        if self.done:
            return
        self.disconnected = True
        if self.task is not None:
            self.task.cancel()

    def on_receive(self, fut: asyncio.Future[Message]) -> None:
        """The watcher task's callback."""
        if self.done or fut.cancelled() or fut.exception() is not None:
            return
        if fut.result().get("type") == "http.disconnect":
            self.on_disconnect()

    def watch(self, scope: Scope, receive: Receive) -> asyncio.Future[Message] | None:
        """Starts watching for the client's disconnect (the request body has been read)."""
        self.task = asyncio.current_task()
        extensions = scope.get("extensions")
        hook = extensions.get("specgate.disconnect") if extensions else None
        if hook is not None:
            hook.on_disconnect = self.on_disconnect
            self.hook = hook
            return None
        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(self.on_receive)
        return watcher

    def unwatch(self, watcher: asyncio.Future[Message] | None) -> None:
        self.done = True
        # Let go of the task and the hook: a task that ended in an exception keeps its traceback, whose frames
        # hold this call (and the request body), a cycle only a full garbage collection would free.
        self.task = None
        if watcher is None:
            if self.hook is not None:
                self.hook.on_disconnect = None
                self.hook = None
        elif not watcher.done():
            watcher.remove_done_callback(self.on_receive)
            watcher.cancel()


class _Call(_Watched):
    """The state of one proxied request, from admission to its telemetry event."""

    __slots__ = (
        "t0", "wall", "request_id", "path", "shape", "decision", "bundle", "canary", "engine",
        "stream", "added_usage", "schema", "validator", "retries", "fallback", "fallback_reason", "status",
        "http_status", "first_token", "last_token", "n_chunks", "parts", "output", "usage", "metrics", "t_end",
        "started", "decided", "done_seen", "delivered", "replica", "affinity", "batch", "tried", "shadow",
        "capture",
    )

    def __init__(self, t0: float, wall: float, request_id: str, path: str) -> None:
        super().__init__()
        self.shape: RequestShape
        self.decision: Decision
        self.bundle: CompiledBundle
        self.decided = False
        self.canary = False
        self.t0 = t0
        self.wall = wall
        self.request_id = request_id
        self.path = path
        self.engine = ""
        self.stream = False
        self.added_usage = False
        self.schema: Any = None
        self.validator: Any = None  # of ``schema``: a validator, None (no verdict), or a future while compiling
        self.retries = 0
        self.fallback = False
        self.fallback_reason: str | None = None  # a FallbackReason, or upstream_status_reason(status)
        self.status: EventStatus = _OK
        self.http_status: int | None = None
        self.first_token: float | None = None
        self.last_token = 0.0
        self.n_chunks = 0
        self.parts: list[str] | None = None
        self.output: Any = None
        self.usage: Any = None
        self.metrics: Any = None
        self.t_end = 0.0
        self.started = False
        self.done_seen = False  # the engine's `data: [DONE]` has been scanned
        self.delivered = False  # ...and handed to the client: a disconnect after it is no failure
        self.replica: Replica | None = None  # the replica it runs on now (counted in its in_flight)
        self.affinity: str | None = None  # X-Specgate-Affinity
        self.batch = 0  # the batch it joined there, as the decision saw it
        self.tried: list[Replica] | None = None  # replicas that failed it, after a retry
        self.shadow: _Shadow | None = None  # sampled for a shadow comparison (policy quality)
        self.capture: StreamCapture | None = None  # ...and streamed: its answer as it goes by


class _Shadow:
    """What a shadow comparison needs of its request: the client's body and headers, the plain engine."""

    __slots__ = ("data", "headers", "plain_engine")

    def __init__(self, data: dict[str, Any], headers: Headers, plain_engine: str) -> None:
        self.data = data
        self.headers = headers
        self.plain_engine = plain_engine


class SidecarApp:
    """The ASGI app (see the module docs). Build it with :func:`build_app`."""

    def __init__(self, settings: SidecarSettings, store: PolicyStore, exporter: Exporter, *,
                 on_event: Callable[[TelemetryEvent], None] | None = None,
                 expose_engine_metrics: bool = False, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.settings = settings
        self.store = store
        self.exporter = exporter
        self.on_event = on_event
        self.expose_engine_metrics = expose_engine_metrics or settings.expose_engine_metrics
        self.max_body_bytes = max_body_bytes
        self.max_labels = settings.max_labels
        self.max_labels_bytes = settings.max_labels_bytes
        self.max_schema_bytes = settings.max_schema_bytes
        self.worker_id = settings.worker_id or settings.listen
        self.routes: Mapping[str, str] = dict(settings.routes)
        self._headers: dict[int, tuple[Decision, bytes]] = {}
        self._schemas = _SchemaCache(settings.schema_cache_bytes)
        self.inflight = InFlight()
        queue_depth = getattr(exporter, "queue_depth", None)
        self.pools = Pools(settings.engines, inflight=self.inflight, replica_scope=settings.replica_scope,
                           interval_s=settings.engine_metrics_s, eject_after=settings.eject_after,
                           probe_initial_s=settings.probe_initial_s, probe_max_s=settings.probe_max_s,
                           max_queue=settings.max_queue, affinity_slack=settings.affinity_slack)
        telemetry_counters = getattr(exporter, "counters", None)
        self.metrics = SidecarMetrics(store, self.inflight, self.pools,
                                      queue_depth if callable(queue_depth) else None,
                                      telemetry_counters if callable(telemetry_counters) else None)
        self.replica_scope = self.pools.replica_scope
        self.quality_check = CheckRunner(load_check(settings.quality_check),
                                         max_threads=settings.shadow_max_in_flight,
                                         timeout_s=settings.quality_check_timeout_s) if settings.quality_check else None
        # each shadow under way, with the event it hands on when it ends (_shadow_done)
        self._shadows: dict[asyncio.Task[dict[str, Any] | None], tuple[TelemetryEvent, bool]] = {}
        self._started = False

    # --- lifecycle -----------------------------------------------------------------

    async def startup(self) -> None:
        """Open the connection pools to each engine and start the engine scraper (idempotent)."""
        if self._started:
            return
        self._started = True
        timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.upstream_connect_timeout_s,
                                        sock_read=self.settings.upstream_read_timeout_s)
        for replica in self.pools.replicas.values():
            replica.upstream = Upstream(replica.url, connect_timeout_s=self.settings.upstream_connect_timeout_s,
                                        read_timeout_s=self.settings.upstream_read_timeout_s)
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0,
                                             ttl_dns_cache=300)
            replica.session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False, trust_env=False,
                skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar())
        self.pools.start()

    async def shutdown(self) -> None:
        if not self._started:
            return
        self._started = False
        # Shadows are cancelled, not awaited: each one's event is handed on, uncompared, as its task ends (a
        # task cancelled before its first step too: the hand-off is its done callback's).
        shadows = list(self._shadows)
        for task in shadows:
            task.cancel()
        if shadows:
            await asyncio.gather(*shadows, return_exceptions=True)
        if self.quality_check is not None:
            self.quality_check.close()
        await self.pools.stop()
        for replica in self.pools.replicas.values():
            upstream, replica.upstream = replica.upstream, None
            session, replica.session = replica.session, None
            if upstream is not None:
                await upstream.close()
            if session is not None:
                await session.close()
        self._schemas.close()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            kind = message["type"]
            if kind == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif kind == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- dispatch --------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if not self._started:  # used without a lifespan (e.g. an in-process test client)
                await self.startup()
            path = scope["path"]
            method = scope["method"]
            if method == "POST" and path in API_PATHS:
                await self._api(scope, receive, send)
            elif path == "/metrics" and method == "GET":
                body, ctype = self.metrics.render()
                await _respond(send, 200, body, ctype.encode())
            elif path == "/healthz":
                await _respond(send, 200, b'{"status":"ok"}', b"application/json")
            elif path == "/readyz":
                if self.store.current is None:
                    await _respond(send, 503, b'{"status":"no policy loaded yet"}', b"application/json")
                else:
                    await _respond(send, 200, b'{"status":"ready"}', b"application/json")
            elif path in _UNDECIDED:
                await _problem(send, 404, "not-found", "Not served here",
                               f"{path} generates text without a policy decision; use /v1/chat/completions "
                               "or /v1/completions")
            else:
                await self._passthrough(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # --- the OpenAI request path ---------------------------------------------------------

    async def _api(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        wall = time.time()
        body = await self._read_body(receive, send)
        if body is None:
            return
        route_header = labels_header = request_id = affinity = None
        headers: Headers = []
        for name, value in scope["headers"]:
            if name in _API_DROP:
                continue
            if name.startswith(b"x-specgate-"):
                if name == b"x-specgate-route":
                    route_header = value.decode("latin-1").strip()
                elif name == b"x-specgate-labels":
                    labels_header = value.decode("latin-1")
                elif name == b"x-specgate-affinity":
                    affinity = value.decode("latin-1").strip()
                continue
            if name == _H_REQUEST_ID:
                request_id = value.decode("latin-1").strip()
                continue
            headers.append((name, value))
        try:
            data = _loads(body)
        except ValueError:
            data = None
        except RecursionError:  # orjson stops at 1024 levels, the stdlib fallback at the interpreter's stack
            self.metrics.reject("bad_body")
            await _problem(send, 400, "bad-request", "Bad request",
                           "the request body is nested too deeply (JSON arrays and objects at most 1024 levels)")
            return
        if type(data) is not dict:
            self.metrics.reject("bad_body")
            await _problem(send, 400, "bad-request", "Bad request", "the request body must be a JSON object")
            return
        bundle = self.store.current
        if bundle is None:
            self.metrics.reject("no_policy")
            await _problem(send, 503, "no-policy", "No policy", "no policy loaded yet")
            return
        if not request_id:
            request_id = os.urandom(16).hex()  # uuid4().hex's format (32 hex digits) at a quarter of its cost
        headers.append((b"x-request-id", request_id.encode("latin-1", "replace")))
        headers.append((b"accept-encoding", b"identity"))
        call = _Call(t0, wall, request_id, scope["path"])
        call.affinity = affinity or None
        # In worker scope every engine sees this batch; in replica scope _decide gives each engine its own.
        batch_size = self.pools.worker_batch(self.inflight.admit(), time.monotonic())
        try:
            try:
                check_text(request_id, "X-Request-Id", "header")
                if affinity is not None and len(affinity) > MAX_AFFINITY_CHARS:
                    raise RequestError("X-Specgate-Affinity", "header", f"is {len(affinity)} characters, over the "
                                       f"{MAX_AFFINITY_CHARS} allowed", "too_long")
                call.shape = classify(data, path=call.path, route_header=route_header,
                                      labels_header=labels_header, routes=self.routes, batch_size=batch_size,
                                      request_id=request_id, arrival_time=wall, max_labels=self.max_labels,
                                      max_labels_bytes=self.max_labels_bytes)
                if call.shape.structured_output:
                    self._note_schema(call, data)
            except RequestError as exc:
                self.metrics.reject("bad_" + exc.where)
                await _problem(send, 400, "bad-request", "Bad request", str(exc),
                               errors=[{"path": exc.field, "in": exc.where, "code": exc.code,
                                        "message": exc.message}])
                return
            await self._serve(call, bundle, data, body, headers, scope, receive, send)
        finally:
            self.inflight.release()
            replica = call.replica
            if replica is not None:
                replica.in_flight -= 1
            call.t_end = time.perf_counter()
            if call.decided:  # a decision was made: one telemetry event, off the hot path
                asyncio.get_running_loop().call_soon(self._finish, call)

    async def _serve(self, call: _Call, bundle: CompiledBundle, data: dict[str, Any], body: bytes,
                     headers: Headers, scope: Scope, receive: Receive, send: Send) -> None:
        fallback = self._decide(call, bundle)
        if call.engine not in self.pools.pools:
            call.status = EventStatus.error
            call.http_status = 502
            await _problem(send, 502, "engine-not-configured", "Engine not configured",
                           f"neither engine {call.decision.engine!r} nor the fallback {fallback!r} is configured "
                           "on this worker", self._our_headers(call))
            return
        if call.replica is None:
            # Every replica of the engine it must run on is ejected: an answer now, never a hang. It may come
            # back when a replica of either the decided engine or the fallback does.
            call.status = EventStatus.upstream_error
            call.http_status = 503
            now = time.monotonic()
            waits = [w for w in (self.pools.next_probe_s(call.engine, now),
                                 self.pools.next_probe_s(call.decision.engine, now)) if w is not None]
            wait = retry_after_s(min(waits) if waits else None)
            self.metrics.reject("no_replica")
            await _problem(send, 503, "no-replica", "No engine replica available",
                           f"every replica of engine {call.engine!r} is ejected after failing; the next health "
                           f"probe is in about {wait} s",
                           [*self._our_headers(call), (_H_RETRY_AFTER, b"%d" % wait)])
            return
        if call.engine == call.decision.engine and call.decision.speculate:
            self._sample_shadow(call, bundle, data, headers)
        body = self._engine_body(call, data, body)
        query = scope.get("query_string")
        target = call.path.encode() + b"?" + query if query else call.path.encode()  # one of API_PATHS: ASCII
        # a disconnect of the client cancels this task, and with it the upstream request
        watcher = call.watch(scope, receive)
        # The forwarding stays in this coroutine (not a method of its own): it runs per request, and another
        # coroutine would be another object made and awaited for each.
        try:
            while True:
                replica = call.replica
                assert replica is not None
                # A retry only while nothing has reached the client (after the first byte it would garble the
                # answer): on another replica of the same engine, else, for a speculative decision, on the
                # fallback (plain) pool. A plain decision with no other replica gets the failure, a 502.
                reason = await self._attempt(call, replica, body, headers, target, send, fallback)
                if reason is None:
                    break
                self.metrics.upstream_error(call.engine)
                target_replica = self._retry_target(call, fallback, time.monotonic())
                if target_replica is not None:
                    self._retry(call, target_replica, fallback, reason)
                    continue
                call.status = EventStatus.upstream_error
                call.http_status = 502
                await _problem(send, 502, "upstream-unavailable", "Engine unavailable",
                               f"engine {call.engine!r} failed before answering ({reason})", self._our_headers(call))
                break
        except asyncio.CancelledError:
            if not call.disconnected:  # the server is shutting down: not the client's doing
                call.status = EventStatus.error
                raise
            _uncancel()
            # Many clients close as soon as they read `data: [DONE]`, before our final empty body frame: the
            # answer was complete, so that is a delivery, not a disconnect.
            if not call.delivered:
                call.status = EventStatus.client_disconnect
        except BaseException:
            call.status = EventStatus.error
            raise
        finally:
            call.unwatch(watcher)

    def _decide(self, call: _Call, bundle: CompiledBundle) -> str:
        """Decides the request and picks the engine and replica it runs on; returns the policy's fallback
        engine.

        A decided engine this worker does not run is replaced by the fallback at once: a request served
        plain is better than one refused, and the event records why (``engine_not_configured``). So is one
        whose replicas are all ejected (``pool_unavailable``) or all full (``pool_saturated``). In replica
        scope each engine's rules see the batch on the replica the request would join there
        (sidecar/replicas.py); that replica is the one it then goes to.
        """
        shape = call.shape
        pools = self.pools
        policy = bundle.active if bundle.canary is None else bundle.policy_for(call.request_id)
        fallback = policy.fallback_engine
        now = time.monotonic()
        choices = None
        if self.replica_scope:
            choices = {engine: pools.choose(engine, now, call.affinity) for engine in pools.pools}
            shape.engine_batch = {engine: c.batch for engine, c in choices.items() if c.replica is not None}
            plain = choices.get(fallback)
            if plain is not None and plain.replica is not None:
                shape.batch_size = plain.batch
        decision = bundle.decide(shape)
        call.decision = decision
        call.bundle = bundle
        call.canary = policy is bundle.canary
        call.decided = True
        engine = decision.engine
        reason: str | None = None
        choice = None
        if engine not in pools.pools:
            reason = FallbackReason.engine_not_configured
        else:
            choice = choices[engine] if choices is not None else pools.choose(engine, now, call.affinity)
            if choice.reason is not None and engine != fallback and fallback in pools.pools:
                reason = choice.reason
        plain = None
        if reason is not None and fallback in pools.pools:
            plain = choices[fallback] if choices is not None else pools.choose(fallback, now, call.affinity)
            if reason == POOL_SATURATED and plain.replica is None:
                # The plain pool is down and the decided one only full: a full replica is better than none.
                reason = None
        if reason is not None:
            call.fallback = True
            call.fallback_reason = reason
            self.metrics.fallback(reason)
            engine = fallback
            choice = plain
        call.engine = engine
        if choice is not None and choice.replica is not None:
            call.batch = choice.batch if choices is not None else shape.batch_size
            call.replica = choice.replica
            choice.replica.in_flight += 1
        return fallback

    def _sample_shadow(self, call: _Call, bundle: CompiledBundle, data: dict[str, Any], headers: Headers) -> None:
        """Notes a request the policy samples for a shadow comparison, when its answer can be compared."""
        policy = bundle.canary if call.canary and bundle.canary is not None else bundle.active
        if not policy.shadow_rate or not policy.shadowed(call.shape, call.decision):
            return
        if not comparable(data):
            self.metrics.shadow("not_greedy")
            return
        # The body before _engine_body adds stream_options for a stream (the shadow is not streamed)
        call.shadow = _Shadow(dict(data), list(headers), policy.fallback_engine)
        if call.shape.stream:
            call.capture = StreamCapture()

    def _retry_target(self, call: _Call, fallback: str, now: float) -> Replica | None:
        """Where a request whose replica failed goes next: another healthy replica of its engine, else (for a
        decision on another engine) one of the fallback pool's; None: nowhere (or no attempt left)."""
        if call.retries >= MAX_ATTEMPTS - 1:
            return None
        pools = self.pools
        tried: list[Replica] = [*(call.tried or ()), *((call.replica,) if call.replica is not None else ())]
        choice = pools.choose(call.engine, now, None, exclude=tried)
        if choice.replica is not None:
            return choice.replica
        # Any engine but the fallback's: an in-engine schedule's decision without drafts (speculate false) runs
        # on a speculative engine too, and the plain pool serves it as well.
        if call.engine != fallback and fallback in pools.pools:
            return pools.choose(fallback, now, None, exclude=tried).replica
        return None

    def _retry(self, call: _Call, replica: Replica, fallback: str, reason: str) -> None:
        """Moves a request whose replica failed unseen to ``replica``: a retry, recorded; on the fallback
        engine also a fallback, with the failure as its reason."""
        old = call.replica
        if old is not None:
            old.in_flight -= 1
            if call.tried is None:
                call.tried = [old]
            elif old not in call.tried:
                call.tried.append(old)
        call.retries += 1
        if call.engine not in replica.engines:
            call.fallback = True
            call.fallback_reason = reason
            self.metrics.fallback(reason)
            call.engine = fallback
        call.replica = replica
        call.batch = replica.load(time.monotonic()) + 1 if self.replica_scope else call.batch
        replica.in_flight += 1

    def _engine_body(self, call: _Call, data: dict[str, Any], body: bytes) -> bytes:
        """The body the engine gets: a stream asks for usage, the chunk the engine's own numbers come in.

        Also notes the output schema of a structured request, so that the answer can be checked against it.
        """
        shape = call.shape
        if shape.stream:
            call.stream = True
            options = data.get("stream_options")
            if type(options) is not dict or options.get("include_usage") is not True:
                options = {**options, "include_usage": True} if type(options) is dict else {"include_usage": True}
                data["stream_options"] = options
                try:
                    body = _dumps(data)
                except RecursionError:
                    # Nested deeper than the encoders go (orjson: 255 levels): the client's bytes with the key
                    # appended, which the engines' JSON parsers take over an earlier one of the same name.
                    body = body[:body.rstrip().rfind(b"}")] + b',"stream_options":' + _dumps(options) + b"}"
                call.added_usage = True
        if call.schema is not None and shape.stream:
            call.parts = []
        return body

    def _note_schema(self, call: _Call, data: dict[str, Any]) -> None:
        """Notes the output schema of a structured request and starts compiling it (off the loop), so that the
        answer can be checked against it once it is complete."""
        schema, field = output_schema_at(data)
        call.schema = schema
        if schema is None or schema is JSON_OBJECT:
            return
        try:
            key = _schema_key(schema)
        except RecursionError:
            raise RequestError(field, "body", "is nested too deeply to check against", "too_deep") from None
        if len(key) > self.max_schema_bytes:
            raise RequestError(field, "body", f"is {len(key)} bytes as compact JSON, over the "
                               f"{self.max_schema_bytes} allowed", "too_long")
        call.validator = self._schemas.lookup(key, schema)

    def _our_headers(self, call: _Call) -> list[tuple[bytes, bytes]]:
        """X-Request-Id, X-Specgate-Decision (prebuilt per decision, with the replica that serves appended)
        and, after a fallback, X-Specgate-Fallback."""
        decision = call.decision
        cached = self._headers.get(id(decision))
        if cached is None or cached[0] is not decision:
            if len(self._headers) > 4096:
                self._headers.clear()
            cached = self._headers[id(decision)] = (decision, decision.to_header().encode())
        replica = call.replica
        value = cached[1] if replica is None else cached[1] + _REPLICA + replica.name_bytes
        out = [(_H_REQUEST_ID, call.request_id.encode("latin-1", "replace")), (_H_DECISION, value)]
        if call.fallback:
            out.append((_H_FALLBACK, f"engine={call.engine}; reason={call.fallback_reason}".encode()))
        return out

    async def _attempt(self, call: _Call, replica: Replica, body: bytes, headers: Headers,
                       target: bytes, send: Send, fallback: str) -> str | None:
        """One upstream try. Returns a failure reason if it failed with nothing sent to the client; a 5xx
        answer is such a failure only when the request has somewhere to go next, else it is relayed.

        A refused or broken connection, a timeout and a 5xx count towards the replica's ejection; any other
        answer resets the count.
        """
        replica.requests += 1
        try:
            resp = await replica.upstream.request(b"POST", target, headers, body)
        except UpstreamError as exc:
            self._replica_failed(replica, exc.reason)
            return exc.reason
        complete = False
        counted = False
        try:
            status = resp.status
            if status >= 500:
                # Past 599 is no status HTTP defines (the parser takes up to 999): a broken answer, retried as one.
                reason = upstream_status_reason(status) if status <= 599 else FallbackReason.upstream_disconnected
                if status in _SERVER_FAILING or status > 599:
                    self._replica_failed(replica, reason)
                    counted = True
                if self._retry_target(call, fallback, time.monotonic()) is not None:
                    return reason
            else:
                self.pools.succeeded(replica)
            if call.stream and status == 200 and (resp.header(b"content-type") or b"").startswith(
                    b"text/event-stream"):
                broken = await self._relay_stream(call, resp, send)
                complete = broken is None
                return broken
            try:
                raw = await resp.read()
            except UpstreamError as exc:
                if not counted:
                    self._replica_failed(replica, exc.reason)
                return exc.reason
            complete = True
            await self._deliver(call, resp, raw, send)
            return None
        finally:
            if complete:
                resp.release()
            else:
                resp.close()

    def _replica_failed(self, replica: Replica, reason: str) -> None:
        """Counts a failure towards the replica's ejection, unless the sidecar itself is shutting down (its
        closed connections are no fault of the replica's)."""
        if self._started:
            self.pools.failed(replica, reason)

    def _relay_headers(self, resp: Response, call: _Call) -> list[tuple[bytes, bytes]]:
        out = [(name, value) for name, value in resp.headers if name not in _RESP_DROP]
        out.extend(self._our_headers(call))
        return out

    async def _deliver(self, call: _Call, resp: Response, raw: bytes, send: Send) -> None:
        """A whole (non-stream) answer: read engine numbers, strip ``metrics``, send."""
        status = resp.status
        call.http_status = status
        if status >= 500:
            call.status = EventStatus.upstream_error
            self.metrics.upstream_error(call.engine)
        elif status >= 400:
            call.status = EventStatus.error
        if status == 200 and raw[:1] == b"{":
            try:
                obj = _loads(raw)
            except ValueError:
                obj = None
            if type(obj) is dict:
                call.output = obj
                call.usage = obj.get("usage")
                if "metrics" in obj:
                    call.metrics = obj["metrics"]
                    if not self.expose_engine_metrics:
                        del obj["metrics"]
                        raw = _dumps(obj)
        headers = self._relay_headers(resp, call)
        headers.append((_H_CONTENT_LENGTH, b"%d" % len(raw)))
        call.started = True
        await send({"type": _START, "status": status, "headers": headers})
        await send({"type": _BODY, "body": raw})

    async def _relay_stream(self, call: _Call, resp: Response, send: Send) -> str | None:
        """Relays SSE events as they arrive (whole events only, never the whole stream)."""
        pending = b""
        try:
            while True:
                data = await resp.next_chunk()
                if not data:
                    break
                if pending:
                    data = pending + data
                cut = data.rfind(b"\n\n")
                if cut < 0:
                    pending = data
                    continue
                cut += 2
                if cut < len(data):
                    pending = data[cut:]
                    data = data[:cut]
                else:
                    pending = b""
                out = self._scan(call, data)
                if not call.started:
                    call.started = True
                    call.http_status = resp.status
                    await send({"type": _START, "status": resp.status, "headers": self._relay_headers(resp, call)})
                if out:
                    await send({"type": _BODY, "body": out, "more_body": True})
                    call.delivered = call.done_seen
        except UpstreamError as exc:
            replica = call.replica
            if replica is not None:
                self._replica_failed(replica, exc.reason)
            if not call.started:
                return exc.reason
            # after the first byte there is no retry: tell the client in the stream, then end it
            self.metrics.upstream_error(call.engine)
            call.status = EventStatus.upstream_error
            await send({"type": _BODY, "body": _STREAM_BROKEN, "more_body": False})
            return None
        tail = self._scan(call, pending) if pending else b""
        if not call.started:
            call.started = True
            call.http_status = resp.status
            await send({"type": _START, "status": resp.status, "headers": self._relay_headers(resp, call)})
        await send({"type": _BODY, "body": tail, "more_body": False})
        call.delivered = call.done_seen
        return None

    def _scan(self, call: _Call, data: bytes) -> bytes:
        """Looks at each event in ``data``; returns ``data`` itself unless an event was dropped or rewritten."""
        now = time.perf_counter()
        kept: list[bytes] | None = None
        start = 0
        size = len(data)
        while start < size:
            end = data.find(b"\n\n", start)
            end = size if end < 0 else end + 2
            replacement = self._event(call, data, start, end, now)
            if replacement is not None:
                if kept is None:
                    kept = [data[:start]]
                kept.append(replacement)
            elif kept is not None:
                kept.append(data[start:end])
            start = end
        return data if kept is None else b"".join(kept)

    def _event(self, call: _Call, data: bytes, start: int, end: int, now: float) -> bytes | None:
        """One SSE event: timestamps content, catches usage/metrics. None keeps it as is."""
        if not data.startswith(b"data:", start):
            return None
        payload = data[start + 5:end].strip()
        if payload[:1] != b"{":
            if payload == b"[DONE]":
                call.done_seen = True
            return None
        try:
            obj = _loads(payload)
        except ValueError:
            return None
        if type(obj) is not dict:
            return None
        choices = obj.get("choices")
        if choices and type(choices) is list:
            choice = choices[0]
            if type(choice) is dict:
                if call.capture is not None:
                    call.capture.choice(choice)
                delta = choice.get("delta")
                if type(delta) is dict:
                    text = delta.get("content")
                    content = text or delta.get("tool_calls") or delta.get("reasoning_content")
                else:
                    text = choice.get("text")
                    content = text
                if content:
                    if call.first_token is None:
                        call.first_token = now
                    call.last_token = now
                    call.n_chunks += 1
                    if call.parts is not None and type(text) is str:
                        call.parts.append(text)
        elif "error" in obj:
            call.status = EventStatus.upstream_error
        usage = obj.get("usage")
        metrics = obj.get("metrics")
        if usage is not None:
            call.usage = usage
        if metrics is not None:
            call.metrics = metrics
        if call.added_usage:
            if usage is not None and not choices:
                return b""  # the usage-only chunk the client did not ask for
            if "usage" in obj or "metrics" in obj:
                obj.pop("usage", None)
                obj.pop("metrics", None)
                return b"data: " + _dumps(obj) + b"\n\n"
        elif metrics is not None and not self.expose_engine_metrics:
            del obj["metrics"]
            return b"data: " + _dumps(obj) + b"\n\n"
        return None

    # --- telemetry (after the response) -----------------------------------------------

    def _finish(self, call: _Call) -> None:
        """After the response: the request's telemetry event, its metrics, and the event handed on."""
        validator = call.validator
        if isinstance(validator, asyncio.Future):
            if call.status is not _OK:
                call.validator = None  # no verdict is asked for: nothing to wait for
            elif not validator.done():
                validator.add_done_callback(lambda _: self._finish(call))  # its schema still compiles
                return
            else:
                call.validator = None if validator.cancelled() or validator.exception() else validator.result()
        e2e = call.t_end - call.t0
        policy = call.bundle.canary if call.canary and call.bundle.canary is not None else call.bundle.active
        aggregate = policy.raw_sample_rate < 1.0
        event = self._telemetry_event(call, e2e * 1000.0, policy)
        self.metrics.decision(call.decision.engine, call.decision.rule)
        self.metrics.finished(call.engine, event.status, e2e)
        if call.shadow is not None:
            if not (event.status is _OK and call.http_status == 200 and call.engine == call.decision.engine
                    and self._started):
                self.metrics.shadow("not_served")  # failed, fell back, or the sidecar is stopping
            elif len(self._shadows) >= self.settings.shadow_max_in_flight:
                self.metrics.shadow("dropped_load")
            else:
                # The event waits for the comparison it carries; the client has its answer already.
                task = asyncio.get_running_loop().create_task(self._shadow(call))
                self._shadows[task] = (event, aggregate)
                self.metrics.shadows_in_flight = len(self._shadows)
                task.add_done_callback(self._shadow_done)
                return
        self._hand_off(event, aggregate)

    def _shadow_done(self, task: asyncio.Task[dict[str, Any] | None]) -> None:
        """Hands a shadowed request's event on, with the comparison when there is one: exactly once, however
        the shadow ended."""
        event, aggregate = self._shadows.pop(task)
        self.metrics.shadows_in_flight = len(self._shadows)
        fields = None
        if task.cancelled():
            self.metrics.shadow("cancelled")
        elif task.exception() is not None:  # _shadow catches its own errors: a bug, still never the event
            self.metrics.shadow("failed")
        else:
            fields = task.result()
        self._hand_off(event if fields is None else event.model_copy(update=fields), aggregate)

    async def _shadow(self, call: _Call) -> dict[str, Any] | None:
        """The comparison's event fields, or None (counted) when none could be made."""
        try:
            return await asyncio.wait_for(self._compare(call), self.settings.shadow_timeout_s)
        except TimeoutError:
            self.metrics.shadow("failed")
        except Exception:  # a bug here must cost the comparison, never the event
            self.metrics.shadow("failed")
        return None

    async def _compare(self, call: _Call) -> dict[str, Any] | None:
        """The shadow request and the comparison; the event's shadow fields, or None (counted) when the
        comparison could not be made."""
        shadow = call.shadow
        assert shadow is not None
        served = call.capture.answer() if call.capture is not None else answer_of(call.output)
        if served is None:
            self.metrics.shadow("failed")
            return None
        choice = self.pools.choose(shadow.plain_engine, time.monotonic())
        replica = choice.replica
        if replica is None or replica.upstream is None:
            self.metrics.shadow("no_replica")
            return None
        if choice.reason is not None:  # every replica queues beyond max_queue: it has real work to do
            self.metrics.shadow("dropped_load")
            return None
        headers = [(name, value) for name, value in shadow.headers if name != _H_REQUEST_ID]
        headers.append((_H_REQUEST_ID, call.request_id.encode("latin-1", "replace") + b"-shadow"))
        # Real load on the plain engine: counted where the decisions of other requests read its batch.
        replica.in_flight += 1
        try:
            raw = await self._post(replica, call.path.encode(), headers, shadow_body(shadow.data))
        finally:
            replica.in_flight -= 1
        try:
            plain = answer_of(_loads(raw)) if raw is not None and raw[:1] == b"{" else None
        except ValueError:
            plain = None
        if plain is None:
            self.metrics.shadow("failed")
            return None
        match = served == plain
        first_diff = None
        if not match:
            first_diff = await self._first_difference(replica, headers, shadow.data.get("model"), served.text,
                                                      plain.text)
        plain_valid = None
        if call.schema is not None:
            plain_valid = self._text_valid(plain.text, call.schema, call.validator)
        passed = reason = None
        if self.quality_check is not None:
            result = await self.quality_check.run(shadow.data, served, plain)
            passed, reason = result.passed, result.reason
            if passed is None:
                self.metrics.quality_check_errors += 1
        self.metrics.shadow("matched" if match else "differed")
        return {"shadow_match": match, "shadow_first_diff": first_diff, "shadow_structured_valid": plain_valid,
                "shadow_check_passed": passed, "shadow_check_reason": reason}

    async def _post(self, replica: Replica, target: bytes, headers: Headers, body: bytes) -> bytes | None:
        """A whole POST answer of 200 from the replica; None for any other answer or a failure."""
        upstream = replica.upstream
        if upstream is None:
            return None
        try:
            resp = await upstream.request(b"POST", target, headers, body)
        except UpstreamError:
            return None
        try:
            if resp.status != 200:
                resp.close()  # its body unread: the connection cannot serve another request
                return None
            raw: bytes = await resp.read()
        except UpstreamError:
            resp.close()
            return None
        except BaseException:
            resp.close()
            raise
        resp.release()
        return raw

    async def _first_difference(self, replica: Replica, headers: Headers, model: Any, served: str,
                                plain: str) -> int | None:
        """The index of the first output token where two answers differ, both texts tokenized by the engine
        (vLLM's ``POST /tokenize``); None when the engine cannot say. Token ids, not a character prefix: a
        prefix that ends inside a token would tokenize into pieces the answers never had."""
        ids: list[list[Any]] = []
        for text in (served, plain):
            if not text:
                ids.append([])
                continue
            body = {"prompt": text, "add_special_tokens": False}
            if type(model) is str:
                body["model"] = model
            raw = await self._post(replica, b"/tokenize", headers, _dumps(body))
            try:
                answer = _loads(raw) if raw is not None else None
            except ValueError:
                return None
            tokens = answer.get("tokens") if type(answer) is dict else None
            if type(tokens) is not list:
                return None
            ids.append(tokens)
        return min(common_prefix_length(ids[0], ids[1]), MAX_INT)

    def _telemetry_event(self, call: _Call, e2e_ms: float, policy: CompiledPolicy) -> TelemetryEvent:
        """The event of a finished request: the decision, the request's shape, its timing and outcome, and the
        engine's own numbers when it reported them. Under a pre-aggregated ``policy`` (the one that decided)
        a sampled request's event carries its weight."""
        decision = call.decision
        shape = call.shape
        usage = call.usage if type(call.usage) is dict else {}
        metrics = call.metrics if type(call.metrics) is dict else {}
        spec = metrics.get("speculative_decoding")
        if type(spec) is not dict:
            spec = {}
        engine_itl = _num(metrics.get("mean_itl_ms"))
        status = call.status
        http_status = call.http_status
        if http_status is not None and not 100 <= http_status <= 599:
            http_status = None
        return TelemetryEvent.trusted(  # every field, in field order; the values are valid by construction
            event_id=os.urandom(16).hex(),
            request_id=call.request_id[:128],
            time=_utc(call.wall),
            worker_id=self.worker_id,
            pool=self.settings.pool,
            route=shape.route,
            model=shape.model[:256],
            policy=decision.policy,
            revision=decision.revision,
            rule=decision.rule,
            engine=call.engine,
            decided_engine=decision.engine,
            replica=call.replica.name if call.replica is not None else None,
            speculate=decision.speculate,
            num_speculative_tokens=decision.num_speculative_tokens,
            explored=decision.explored,
            canary=call.canary,
            kill_switch=call.bundle.kill_switch,
            batch_size=call.batch if self.replica_scope and call.replica is not None else shape.batch_size,
            stream=shape.stream,
            structured_output=shape.structured_output,
            tools=shape.tools,
            # The client's numbers go to the engine as sent; the event holds what the store can (a 32-bit column).
            max_tokens=shape.max_tokens if shape.max_tokens is None or shape.max_tokens <= MAX_INT else MAX_INT,
            shape_prompt_tokens=min(shape.prompt_tokens, MAX_INT),
            labels=encode_labels(shape.labels),
            prompt_tokens=_num(usage.get("prompt_tokens"), integer=True),
            completion_tokens=_num(usage.get("completion_tokens"), integer=True),
            ttft_ms=_ttft_ms(call),
            itl_ms=_itl_ms(call, engine_itl),
            e2e_ms=e2e_ms,
            status=status,
            http_status=http_status,
            retries=call.retries,
            fallback=call.fallback,
            fallback_reason=call.fallback_reason,
            structured_valid=self._structured_valid(call) if call.schema is not None and status is _OK else None,
            spec_draft_tokens=_num(spec.get("num_draft_tokens"), integer=True),
            spec_accepted_tokens=_num(spec.get("num_accepted_draft_tokens"), integer=True),
            spec_acceptance_rate=_num(spec.get("draft_acceptance_rate"), at_most=1.0),
            spec_mean_acceptance_length=_num(spec.get("mean_acceptance_length")),
            spec_steps=_num(spec.get("num_spec_steps"), integer=True),
            engine_ttft_ms=_num(metrics.get("time_to_first_token_ms")),
            engine_itl_ms=engine_itl,
            engine_queue_ms=_num(metrics.get("queue_time_ms")),
            shadow_match=None,
            shadow_first_diff=None,
            shadow_structured_valid=None,
            shadow_check_passed=None,
            shadow_check_reason=None,
            sample_weight=(1.0 / policy.raw_sample_rate
                           if policy.raw_sample_rate < 1.0 and policy.raw_sampled(call.request_id) else None),
        )

    def _hand_off(self, event: TelemetryEvent, aggregate: bool) -> None:
        """To the exporter and the on_event hook; neither may fail the loop turn that finishes requests."""
        with contextlib.suppress(Exception):  # the exporter promises not to raise; be sure
            if aggregate:
                self.exporter.submit(event, aggregate=True)
            else:
                self.exporter.submit(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                self.metrics.hook_errors += 1

    def _structured_valid(self, call: _Call) -> bool | None:
        if call.parts is not None:
            text: Any = "".join(call.parts)
        else:
            text = None
            output = call.output
            if type(output) is dict:
                choices = output.get("choices")
                if choices and type(choices) is list and type(choices[0]) is dict:
                    message = choices[0].get("message")
                    text = message.get("content") if type(message) is dict else choices[0].get("text")
        return self._text_valid(text, call.schema, call.validator)

    @staticmethod
    def _text_valid(text: Any, schema: Any, validator: Any) -> bool | None:
        """Whether an answer's text is JSON that the request's output schema accepts; None: no verdict."""
        if type(text) is not str:
            return False
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if schema is JSON_OBJECT:
            return type(value) is dict
        if validator is None:
            return None
        try:
            return bool(validator.is_valid(value))
        except Exception:  # an unresolvable $ref, an unknown format type: no verdict
            return None

    # --- everything else: passed through to the plain engine -------------------------------

    def _plain_engine(self) -> str | None:
        pools = self.pools.pools
        bundle = self.store.current
        if bundle is not None and bundle.active.fallback_engine in pools:
            return bundle.active.fallback_engine
        if "base" in pools:
            return "base"
        return next(iter(pools), None)

    async def _passthrough(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._read_body(receive, send)
        if body is None:
            return
        engine = self._plain_engine()
        if engine is None:
            await _problem(send, 502, "engine-not-configured", "Engine not configured",
                           "this worker has no engine configured")
            return
        now = time.monotonic()
        replica = self.pools.choose(engine, now).replica
        session = replica.session if replica is not None else None
        if replica is not None and session is None:
            await _problem(send, 503, "shutting-down", "Shutting down", "the sidecar is shutting down",
                           [(_H_RETRY_AFTER, b"1")])
            return
        if replica is None or session is None:
            wait = retry_after_s(self.pools.next_probe_s(engine, now))
            await _problem(send, 503, "no-replica", "No engine replica available",
                           f"every replica of engine {engine!r} is ejected after failing; the next health probe "
                           f"is in about {wait} s", [(_H_RETRY_AFTER, b"%d" % wait)])
            return
        headers = [(name.decode("latin-1"), value.decode("latin-1"))
                   for name, value in scope["headers"]
                   if name not in _HOP and not name.startswith(b"x-specgate-")]  # ours, never the engine's
        path = scope.get("raw_path") or scope["path"].encode()
        url = URL(replica.url + path.decode("latin-1") + (
            "?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else ""), encoded=True)
        try:
            # a redirect is the client's to follow (aiohttp would follow it here, by default)
            resp = await session.request(scope["method"], url, data=body or None, headers=headers,
                                         allow_redirects=False)
        except _UPSTREAM_ERRORS as exc:
            self.metrics.upstream_error(engine)
            self.pools.failed(replica, _failure_reason(exc))
            await _problem(send, 502, "upstream-unavailable", "Engine unavailable",
                           f"engine {engine!r} failed before answering ({_failure_reason(exc)})")
            return
        watched = _Watched()
        watcher = watched.watch(scope, receive)
        try:
            out = [(name.lower(), value) for name, value in resp.raw_headers
                   if name.lower() not in _RESP_DROP or name.lower() in (b"content-length", b"x-request-id")]
            await send({"type": _START, "status": resp.status, "headers": out})
            while True:
                chunk = await resp.content.readany()
                if not chunk:
                    break
                await send({"type": _BODY, "body": chunk, "more_body": True})
            await send({"type": _BODY, "body": b""})
        except _UPSTREAM_ERRORS:
            # the response has started: nothing to retry; end it unfinished so the client sees the break
            self.metrics.upstream_error(engine)
            resp.close()
        except asyncio.CancelledError:
            resp.close()
            if not watched.disconnected:
                raise
            _uncancel()
        finally:
            watched.unwatch(watcher)
            resp.release()

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        message = await receive()
        body = message.get("body", b"")
        if not message.get("more_body"):
            return body if message["type"] == "http.request" else None
        chunks = [body]
        size = len(body)
        while message.get("more_body"):
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                self.metrics.reject("too_large")
                await _problem(send, 413, "too-large", "Request body too large",
                               f"the request body exceeds {self.max_body_bytes} bytes")
                return None
            chunks.append(chunk)
        return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes, content_type: bytes,
                   extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(_H_CONTENT_TYPE, content_type), (_H_CONTENT_LENGTH, b"%d" % len(body))]
    if extra:
        headers.extend(extra)
    await send({"type": _START, "status": status, "headers": headers})
    await send({"type": _BODY, "body": body})


async def _problem(send: Send, status: int, slug: str, title: str, detail: str,
                   extra: list[tuple[bytes, bytes]] | None = None,
                   errors: list[dict[str, Any]] | None = None) -> None:
    await _respond(send, status, problem_bytes(status, slug, title, detail, errors=errors), _PROBLEM_TYPE, extra)


def _uncancel() -> None:
    """Undo the cancel our own disconnect watcher requested, so the task can finish normally."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _utc(wall: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(wall, dt.UTC)


def _ttft_ms(call: _Call) -> float | None:
    """Streams only: admission to the first content chunk relayed."""
    first = call.first_token
    return None if first is None else (first - call.t0) * 1000.0


def _itl_ms(call: _Call, engine_itl: float | None) -> float | None:
    """The mean gap between the content chunks of a stream; for a JSON answer, the engine's own mean."""
    if call.first_token is not None and call.n_chunks > 1:
        return (call.last_token - call.first_token) * 1000.0 / (call.n_chunks - 1)
    if call.shape.stream:
        return None
    # A JSON answer reaches the client whole, so no gap between its tokens can be seen here: its time per
    # output token is the engine's own mean, without which the speculative-vs-plain ITL comparison would rest
    # on streams alone.
    return engine_itl


def build_app(settings: SidecarSettings, store: PolicyStore, exporter: Exporter, *,
              on_event: Callable[[TelemetryEvent], None] | None = None,
              expose_engine_metrics: bool = False) -> SidecarApp:
    """The sidecar's ASGI app; its lifespan opens the engine sessions and starts the engine scraper."""
    return SidecarApp(settings, store, exporter, on_event=on_event, expose_engine_metrics=expose_engine_metrics)


__all__ = ["SidecarApp", "build_app"]
