"""Shipping telemetry events to the control plane, never blocking requests and never losing events quietly.

Requests hand events to :meth:`TelemetryExporter.submit`, which only appends
to an in-memory queue. One sender task turns the queue into batches
(``TelemetryBatch``, a fresh ``batch_id`` each) every ``telemetry_flush_s`` or
as soon as ``telemetry_batch_size`` events wait, and POSTs them gzip-compressed
to ``/v1/telemetry/batches``.

When the control plane cannot take a batch now (network error, timeout, 5xx,
408, 429, and 401/403/404, which describe the deployment rather than the
batch), the batch goes to the on-disk spool as it is, batch id included, so a
batch that did arrive before its answer was lost is deduplicated by the
control plane when it is sent again. While the control plane is failing,
new batches go straight to the spool; spooled batches are retried oldest first
with exponential backoff and jitter, and they survive a restart. The spool is
bounded by ``spool_max_events``: when full, its oldest batches are dropped.

A batch the control plane refuses as such (other 4xx) is dropped; one that is
too large (413) is split in two and each half sent. A 2xx answer may list
refused events (``{"rejected": [{"index": 3, ...}, ...]}`` or a list of
indexes); those count as dropped, the rest as sent.

Each event is encoded to JSON by ``submit`` (:func:`encode_event`), and a
batch is those bytes joined: an event that cannot be encoded (a lone UTF-16
surrogate in a string, which the request path refuses anyway) is dropped
alone, counted and logged, and can never cost the other events of its batch.

Under pre-aggregation (the policy's ``telemetry.raw_sample_rate`` below 1,
``submit(event, aggregate=True)``) each request is added to running rollup
deltas, finished every ``telemetry_rollup_flush_s`` and carried in the
batches' ``rollups`` through the same sending, spooling, splitting and
retrying; only sampled events are queued, and they wait for the deltas
(unless a batch's worth waits). See docs/sidecar-request-path.md.

Every event ends up counted exactly once: ``queued + recovered == sent +
dropped + queue_depth()`` at all times (``recovered``: events found in the
spool at start, left by an earlier run).
"""

from __future__ import annotations

import asyncio
import enum
import gzip
import hashlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from analysis.rollup import RollupDelta as Sums
from analysis.rollup import RollupKey
from analysis.rollup import aggregate as rollup_events
from analysis.rollup import to_wire as rollup_to_wire
from sidecar.settings import SidecarSettings
from sidecar.support import Backoff, fsync_dir, wait_event, write_atomic
from wire.telemetry import EVENT_SCHEMA_VERSION, TelemetryEvent

log = logging.getLogger("specgate.sidecar.telemetry")

SPOOL_DIR = "spool"
SPOOL_SUFFIX = ".json.gz"
BATCHES_PATH = "/v1/telemetry/batches"
# Statuses that say "not now" rather than "not this batch": the batch is kept and retried.
RETRY_STATUSES = frozenset({401, 403, 404, 408, 425, 429})
GZIP_LEVEL = 1


class _Outcome(enum.Enum):
    SENT = "sent"
    RETRY = "retry"
    REJECTED = "rejected"
    SPLIT = "split"


def encode_event(event: TelemetryEvent) -> bytes:
    """One event as the JSON of ``TelemetryBatch.to_json`` writes it (orjson, ``Z`` for UTC; pydantic where
    orjson refuses a value, e.g. an integer beyond 64 bits). Raises ValueError when no encoder can write it."""
    try:
        return orjson.dumps(event.__dict__, option=orjson.OPT_UTC_Z)
    except TypeError:
        pass
    try:
        return event.model_dump_json().encode()
    except (ValueError, UnicodeError) as exc:  # pydantic's serialisation error is a ValueError
        raise ValueError(f"telemetry event {event.event_id!r} cannot be encoded as JSON: {exc}") from None


@dataclass(slots=True)
class _Batch:
    batch_id: str
    count: int  # events
    body: bytes  # gzip-compressed JSON of a TelemetryBatch
    deltas: int = 0  # rollup deltas (a pre-aggregating worker's)
    deltas_rejected: int = 0  # of those, refused by the control plane (set from its answer)


def _spool_name(batch: _Batch, seq: int) -> str:
    # Sorting names sorts batches oldest first, also across restarts (the clock goes on).
    counts = f"{batch.count}+{batch.deltas}" if batch.deltas else str(batch.count)
    return f"{time.time_ns():020d}-{seq:06d}-{batch.batch_id}-{counts}{SPOOL_SUFFIX}"


def _parse_spool_name(name: str) -> tuple[str, int, int] | None:
    """``(batch_id, events, rollup deltas)`` of a spool file's name; None for a name that is not one."""
    if not name.endswith(SPOOL_SUFFIX) or name.startswith("."):
        return None
    parts = name[: -len(SPOOL_SUFFIX)].split("-")
    if len(parts) != 4 or not parts[2]:
        return None
    count, _, deltas = parts[3].partition("+")
    if not count.isdigit() or not (deltas.isdigit() or deltas == ""):
        return None
    return parts[2], int(count), int(deltas or 0)


def _rejected_deltas(answer: bytes, deltas: int) -> int:
    """How many rollup deltas a 2xx answer says were refused."""
    try:
        data = json.loads(answer)
    except ValueError:
        return 0
    total = data.get("rollups_rejected_count") if isinstance(data, dict) else None
    if isinstance(total, int) and not isinstance(total, bool):
        return max(0, min(total, deltas))
    return 0


def _rejected_count(answer: bytes, count: int) -> tuple[int, list[Any]]:
    """How many events a 2xx answer says were refused, and the first few reasons."""
    try:
        data = json.loads(answer)
    except ValueError:
        return 0, []
    if not isinstance(data, dict):
        return 0, []
    rejected = data.get("rejected")
    # The control plane lists only the first few refusals; its total is rejected_count.
    total = data.get("rejected_count")
    if isinstance(total, int) and not isinstance(total, bool):
        return max(0, min(total, count)), rejected[:3] if isinstance(rejected, list) else []
    if isinstance(rejected, int) and not isinstance(rejected, bool):
        return max(0, min(rejected, count)), []
    if not isinstance(rejected, list):
        return 0, []
    indexes: set[int] = set()
    for item in rejected:
        index = item.get("index") if isinstance(item, dict) else item
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < count:
            indexes.add(index)
    return len(indexes), rejected[:3]


class TelemetryExporter:
    """Batches, sends, spools and retries telemetry events (see the module docs).

    ``submit`` is meant to be called on the event loop the exporter runs on;
    calls from other threads are tolerated. ``start`` and ``stop`` are
    coroutines of that loop.
    """

    def __init__(self, settings: SidecarSettings, session: aiohttp.ClientSession | None = None, *,
                 memory_max_events: int | None = None, retry_base_s: float = 0.5, retry_max_s: float = 10.0,
                 request_timeout_s: float = 10.0) -> None:
        self.worker_id = settings.worker_id or settings.listen
        self._url = settings.control_plane.rstrip("/") + BATCHES_PATH
        self._auth = {"Authorization": f"Bearer {settings.key}"} if settings.key else {}
        self._batch_size = settings.telemetry_batch_size
        self._flush_s = settings.telemetry_flush_s
        self._rollup_flush_s = settings.telemetry_rollup_flush_s
        self._spool_dir = Path(settings.state_dir) / SPOOL_DIR
        self._spool_max = settings.spool_max_events
        self._memory_max = memory_max_events or max(10 * self._batch_size, 10_000)
        # Past this, events are dropped at submit: only reached when even the spool cannot keep up.
        self._hard_max = 4 * self._memory_max
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._session = session
        self._own_session = session is None
        self._backoff = Backoff(retry_base_s, retry_max_s)
        self._retry_at = 0.0
        self._memory: deque[bytes] = deque()  # events encoded, oldest first
        self._spool: deque[tuple[Path, int]] = deque()  # oldest first
        self._spool_events = 0
        self._spool_seq = 0
        self._spool_lock = asyncio.Lock()
        self._sending: Path | None = None
        self._in_flight = 0  # taken from memory, not yet sent, spooled or dropped
        self._shipping: _Batch | None = None  # the encoded batch _ship is delivering, until it is settled
        self._counters = {"queued": 0, "recovered": 0, "sent": 0, "spooled": 0, "retried": 0, "dropped": 0,
                          "batches_sent": 0, "batches_rejected": 0, "send_failures": 0,
                          "aggregated": 0, "rollups_made": 0, "rollups_sent": 0, "rollups_dropped": 0}
        # Pre-aggregation (the policy's telemetry.raw_sample_rate below 1): the running rollup deltas by pool,
        # and the finished ones, encoded, waiting for a batch. Delta ids: this process's id and a sequence.
        self._rollups: dict[str, dict[RollupKey, Sums]] = {}
        self._delta_memory: deque[bytes] = deque()
        self._delta_prefix = uuid.uuid4().hex[:20]
        self._delta_seq = 0
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._spill_task: asyncio.Task[None] | None = None
        self._post_task: asyncio.Task[tuple[_Outcome, int]] | None = None
        self._stopping = False
        self._offline = False  # set when stopping: no more network, everything left goes to the spool
        self._last_flush = self._last_rollup_flush = time.monotonic()
        # An event that is not part of a pre-aggregated sample waits in memory: it is sent at the next flush.
        # Without one, only the sample waits, and it goes with the deltas at the next rollup flush.
        self._urgent = False

    # --- the request path ----------------------------------------------------------------

    def submit(self, event: TelemetryEvent, *, aggregate: bool = False) -> None:
        """Queue one event; never blocks, never raises.

        With ``aggregate`` (a pre-aggregated policy) the request is added to this worker's rollup deltas, and
        the event itself is sent only when it is a sampled one (``sample_weight`` set by the caller).
        """
        try:
            if aggregate:
                self._aggregate(event)
                if event.sample_weight is None:
                    return
            elif not self._urgent:
                self._urgent = True
                self._signal(self._wake.set)  # the sender may be asleep until the next rollup flush
            self._counters["queued"] += 1
            if not isinstance(event, TelemetryEvent):
                self._counters["dropped"] += 1
                log.error("not a TelemetryEvent, dropped: %r", type(event))
                return
            try:
                encoded = encode_event(event)
            except ValueError as exc:
                self._counters["dropped"] += 1
                log.error("%s; dropped", exc)
                return
            self._memory.append(encoded)
            depth = len(self._memory)
            if depth >= self._batch_size:
                self._signal(self._wake.set)
            if depth > self._memory_max:
                self._signal(self._request_spill)
            while len(self._memory) > self._hard_max:
                self._memory.popleft()
                self._counters["dropped"] += 1
        except Exception:  # telemetry must never fail a request
            log.exception("telemetry event not queued")

    def _aggregate(self, event: TelemetryEvent) -> None:
        if not isinstance(event, TelemetryEvent):
            return
        pool = self._rollups.get(event.pool)
        if pool is None:
            pool = self._rollups[event.pool] = {}
        rollup_events((event,), into=pool)
        self._counters["aggregated"] += 1

    def _finish_rollups(self) -> None:
        """Turn the running deltas into finished ones, queued for the next batches.

        A delta is what this worker's requests added to a key since the last one: the control plane adds them
        up, so a key gets a delta per rollup flush while its minute has requests finishing (a minute that spans
        two flushes, or a long request admitted in it, makes a second one).
        """
        running, self._rollups = self._rollups, {}
        for pool, deltas in running.items():
            for key, sums in deltas.items():
                self._delta_seq += 1
                delta = rollup_to_wire(key, sums, delta_id=f"{self._delta_prefix}-{self._delta_seq}", pool=pool)
                self._delta_memory.append(orjson.dumps(delta, option=orjson.OPT_UTC_Z))
                self._counters["rollups_made"] += 1

    def _signal(self, callback: Any) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            callback()
        else:
            self._loop.call_soon_threadsafe(callback)

    # --- what it reports ---------------------------------------------------------------------

    def queue_depth(self) -> int:
        """Events not yet delivered nor dropped: in memory, being sent, or in the spool."""
        return len(self._memory) + self._in_flight + self._spool_events

    def counters(self) -> dict[str, int]:
        """Cumulative event counts (queued, recovered, sent, spooled, retried, dropped), batch counts, gauges."""
        return {**self._counters, "queue_depth": self.queue_depth(), "memory_events": len(self._memory),
                "spool_events": self._spool_events, "spool_batches": len(self._spool),
                "rollups_pending": len(self._delta_memory) + sum(len(d) for d in self._rollups.values())}

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._stopping = self._offline = False
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        if self._session is None:
            self._session = aiohttp.ClientSession()
        await self._load_spool()
        self._task = asyncio.create_task(self._run(), name="specgate-telemetry")
        if len(self._memory) >= self._batch_size:
            self._wake.set()

    async def stop(self, flush: bool = True, timeout: float = 5.0) -> None:
        """Deliver what is queued (``flush``) or spool it; whatever is left at ``timeout`` goes to the spool."""
        task = self._task
        if task is None:
            return
        self._stopping = True
        if not flush:
            self._offline = True
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            log.warning("telemetry flush did not finish in %.1f s; spooling the rest", timeout)
            self._offline = True
            if self._post_task is not None:
                self._post_task.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(task), max(timeout, 5.0))
            except TimeoutError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self._save_leftovers()
        if self._spill_task is not None:
            await asyncio.gather(self._spill_task, return_exceptions=True)
        self._task = None
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
        log.info("telemetry exporter stopped: %s", self.counters())

    def _save_leftovers(self) -> None:
        """Last resort when the sender could not be stopped in time: write what it held straight to the spool.

        Blocking on purpose: the loop is shutting down, and a few small files on
        disk are worth more than a prompt exit that loses events.
        """
        leftovers: list[_Batch] = []
        if self._shipping is not None:
            leftovers.append(self._shipping)
            self._shipping = None
        self._finish_rollups()
        if self._memory or self._delta_memory:
            events = list(self._memory)
            deltas = list(self._delta_memory)
            self._memory.clear()
            self._delta_memory.clear()
            self._in_flight += len(events)
            leftovers.append(self._join(events, deltas=deltas))
        for batch in leftovers:
            self._spool_seq += 1
            path = self._spool_dir / _spool_name(batch, self._spool_seq)
            self._in_flight -= batch.count
            try:
                write_atomic(path, batch.body)
            except OSError as exc:
                self._counters["dropped"] += batch.count
                self._counters["rollups_dropped"] += batch.deltas
                log.error("telemetry: cannot spool %d events (%s); dropped", batch.count, exc)
                continue
            self._spool.append((path, batch.count))
            self._spool_events += batch.count
            self._counters["spooled"] += batch.count
        if self._in_flight:
            log.error("telemetry exporter stopped with %d events unsaved", self._in_flight)

    # --- the sender --------------------------------------------------------------------------

    def _next_flush_at(self) -> float:
        at = self._last_rollup_flush + self._rollup_flush_s
        return min(at, self._last_flush + self._flush_s) if self._urgent else at

    async def _run(self) -> None:
        self._last_flush = self._last_rollup_flush = time.monotonic()
        while True:
            if not self._stopping:
                now = time.monotonic()
                retry_due = bool(self._spool) and not self._is_down(now)
                if len(self._memory) < self._batch_size and not retry_due:
                    wake_at = self._next_flush_at()
                    if self._spool:
                        wake_at = min(wake_at, self._retry_at)
                    await wait_event(self._wake, wake_at - now)
                self._wake.clear()
            final = self._stopping
            try:
                await self._pump(final)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("telemetry sender step failed")
                await asyncio.sleep(min(self._flush_s, 1.0))
            if final:
                return

    def _is_down(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self._retry_at

    async def _pump(self, final: bool) -> None:
        now = time.monotonic()
        rollups_due = final or now - self._last_rollup_flush >= self._rollup_flush_s
        flush_all = rollups_due or (self._urgent and now - self._last_flush >= self._flush_s)
        if self._spool and not final and not self._is_down(now):
            await self._drain_spool()
        if rollups_due:
            self._finish_rollups()
            self._last_rollup_flush = now
        while (self._memory or (flush_all and self._delta_memory)) and (
                flush_all or len(self._memory) >= self._batch_size):
            await self._ship(await self._take())
        if flush_all:
            self._last_flush = time.monotonic()
            self._urgent = False

    async def _take(self) -> _Batch:
        n = min(self._batch_size, len(self._memory))
        events = [self._memory.popleft() for _ in range(n)]
        # Deltas ride along with whatever events go: a batch of the batch size's worth at most.
        d = min(self._batch_size, len(self._delta_memory))
        deltas = [self._delta_memory.popleft() for _ in range(d)]
        self._in_flight += n
        try:
            return await asyncio.to_thread(self._join, events, deltas=deltas)
        except Exception:
            self._in_flight -= n
            self._counters["dropped"] += n
            self._counters["rollups_dropped"] += d
            raise

    def _join(self, events: list[bytes], batch_id: str | None = None, *, deltas: list[bytes] | None = None) -> _Batch:
        """A batch of encoded events (and rollup deltas): a ``TelemetryBatch``'s JSON, gzip-compressed."""
        batch_id = batch_id or uuid.uuid4().hex
        head = orjson.dumps({"batch_id": batch_id, "worker_id": self.worker_id,
                             "schema_version": EVENT_SCHEMA_VERSION})
        # the bytes of TelemetryBatch.to_json: rollups always there, empty without pre-aggregation
        parts = (head[:-1], b',"events":[', b",".join(events), b'],"rollups":[', b",".join(deltas or ()), b"]}")
        # Level 1: a third of level 6's CPU for ~25 % more bytes (200 events, ~190 KB of JSON: 14 KB against
        # 11.5 KB). Encoding was the sidecar's largest cost per JSON request after its HTTP stack, and a worker
        # thread does not make it free: it shares the cores with the requests. mtime=0: same events, same bytes.
        return _Batch(batch_id, len(events), gzip.compress(b"".join(parts), GZIP_LEVEL, mtime=0),
                      deltas=len(deltas or ()))

    def _split(self, batch: _Batch) -> list[_Batch]:
        # The halves carry the events as they were encoded, not validated again: an event the control plane
        # refuses (a value beyond the contract's limits) is refused there, by its index, as it would have
        # been in the whole batch, and cannot fail the split of the others here.
        data = json.loads(gzip.decompress(batch.body))
        events = data["events"]
        deltas = data.get("rollups", [])
        half, half_deltas = len(events) // 2, len(deltas) // 2
        out = []
        for i, (part, part_deltas) in enumerate(((events[:half], deltas[:half_deltas]),
                                                 (events[half:], deltas[half_deltas:]))):
            new_id = f"{batch.batch_id}.{i}"
            if len(new_id) > 64:
                new_id = hashlib.sha256(new_id.encode()).hexdigest()[:32]
            fields = {**data, "batch_id": new_id, "events": part}
            fields.pop("rollups", None)
            if part_deltas:
                fields["rollups"] = part_deltas
            body = json.dumps(fields, separators=(",", ":")).encode()
            out.append(_Batch(new_id, len(part), gzip.compress(body, GZIP_LEVEL, mtime=0), deltas=len(part_deltas)))
        return out

    async def _ship(self, batch: _Batch) -> None:
        """Deliver a batch counted in ``_in_flight``: send it, or spool it when the control plane cannot take it."""
        # Left set when the sender task is cancelled mid-delivery, so stop() can still spool the batch;
        # a duplicate spool file is harmless, the control plane deduplicates by batch id.
        self._shipping = batch
        await self._deliver(batch)
        self._shipping = None

    async def _deliver(self, batch: _Batch) -> None:
        if self._offline or self._is_down():
            await self._spool_write(batch)
            return
        outcome, rejected = await self._post(batch)
        if outcome is _Outcome.SPLIT:
            for half in await asyncio.to_thread(self._split, batch):
                await self._ship(half)
            return
        if outcome is _Outcome.RETRY:
            self._mark_down()
            await self._spool_write(batch)
            return
        self._in_flight -= batch.count
        self._settle(outcome, batch.count, rejected, batch)

    def _settle(self, outcome: _Outcome, count: int, rejected: int, batch: _Batch) -> None:
        if outcome is _Outcome.SENT:
            self._counters["sent"] += count - rejected
            self._counters["dropped"] += rejected
            self._counters["rollups_sent"] += batch.deltas - batch.deltas_rejected
            self._counters["rollups_dropped"] += batch.deltas_rejected
            self._counters["batches_sent"] += 1
            self._backoff.reset()
            self._retry_at = 0.0
        else:
            self._counters["dropped"] += count
            self._counters["rollups_dropped"] += batch.deltas
            self._counters["batches_rejected"] += 1

    def _mark_down(self) -> None:
        delay = self._backoff.next()
        self._retry_at = time.monotonic() + delay
        self._counters["send_failures"] += 1
        log.warning("telemetry: the control plane did not take a batch; spooling, next try in %.2f s", delay)

    async def _post(self, batch: _Batch) -> tuple[_Outcome, int]:
        if self._offline:
            return _Outcome.RETRY, 0
        self._post_task = asyncio.create_task(self._http_post(batch))
        try:
            return await self._post_task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            return _Outcome.RETRY, 0  # only the request was cancelled (stop ran out of time)
        finally:
            self._post_task = None

    async def _http_post(self, batch: _Batch) -> tuple[_Outcome, int]:
        assert self._session is not None
        headers = {**self._auth, "Content-Type": "application/json", "Content-Encoding": "gzip",
                   "Idempotency-Key": batch.batch_id}
        try:
            async with self._session.post(self._url, data=batch.body, headers=headers,
                                          timeout=self._timeout) as resp:
                status, answer = resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.debug("telemetry batch %s: %s", batch.batch_id, exc)
            return _Outcome.RETRY, 0
        except Exception:  # anything else is kept for a retry too, never lost
            log.exception("telemetry batch %s could not be sent", batch.batch_id)
            return _Outcome.RETRY, 0
        if 200 <= status < 300:
            rejected, reasons = _rejected_count(answer, batch.count)
            if rejected:
                log.warning("telemetry batch %s: %d of %d events refused, e.g. %s", batch.batch_id, rejected,
                            batch.count, reasons)
            if batch.deltas:
                batch.deltas_rejected = _rejected_deltas(answer, batch.deltas)
                if batch.deltas_rejected:
                    log.warning("telemetry batch %s: %d of %d rollup deltas refused: %s", batch.batch_id,
                                batch.deltas_rejected, batch.deltas, answer[:500].decode("utf-8", "replace"))
            return _Outcome.SENT, rejected
        if status >= 500 or status in RETRY_STATUSES:
            log.debug("telemetry batch %s: HTTP %d", batch.batch_id, status)
            return _Outcome.RETRY, 0
        if status == 413 and batch.count + batch.deltas > 1:
            return _Outcome.SPLIT, 0
        log.error("telemetry batch %s of %d events refused (HTTP %d): %s", batch.batch_id, batch.count, status,
                  answer[:500].decode("utf-8", "replace"))
        return _Outcome.REJECTED, 0

    # --- the spool -----------------------------------------------------------------------------

    async def _load_spool(self) -> None:
        def scan() -> list[tuple[Path, int]]:
            self._spool_dir.mkdir(parents=True, exist_ok=True)
            found = []
            for path in self._spool_dir.iterdir():
                if path.name.startswith(".") and path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)  # a write that a crash interrupted
                    continue
                parsed = _parse_spool_name(path.name)
                if parsed is not None:
                    found.append((path, parsed[1]))  # events: what the spool's bound and counters are in
            return sorted(found)

        async with self._spool_lock:
            found = await asyncio.to_thread(scan)
            known = {p for p, _ in self._spool}
            for path, count in found:
                if path not in known:
                    self._spool.append((path, count))
                    self._spool_events += count
                    self._counters["recovered"] += count
            await self._trim_spool()
        if found:
            log.info("telemetry spool holds %d events in %d batches from before; resending them",
                     self._spool_events, len(self._spool))

    async def _spool_write(self, batch: _Batch) -> None:
        """Move a batch counted in ``_in_flight`` into the spool (or count it dropped when the disk fails)."""
        async with self._spool_lock:
            self._spool_seq += 1
            path = self._spool_dir / _spool_name(batch, self._spool_seq)
            try:
                await asyncio.to_thread(write_atomic, path, batch.body)
            except OSError as exc:
                self._in_flight -= batch.count
                self._counters["dropped"] += batch.count
                self._counters["rollups_dropped"] += batch.deltas
                log.error("telemetry: cannot spool %d events (%s); dropped", batch.count, exc)
                return
            self._spool.append((path, batch.count))
            self._spool_events += batch.count
            self._in_flight -= batch.count
            self._counters["spooled"] += batch.count
            await self._trim_spool()

    async def _trim_spool(self) -> None:
        """Drop the oldest batches while the spool holds more than ``spool_max_events`` (lock held)."""
        victims = []
        for entry in list(self._spool):
            if self._spool_events <= self._spool_max:
                break
            if entry[0] == self._sending or not entry[1]:
                continue  # a file of deltas only frees no room, and its deltas stand for many requests
            self._spool.remove(entry)
            self._spool_events -= entry[1]
            self._counters["dropped"] += entry[1]
            parsed = _parse_spool_name(entry[0].name)
            self._counters["rollups_dropped"] += parsed[2] if parsed is not None else 0
            victims.append(entry)
        if victims:
            log.warning("telemetry spool full (%d events): dropped the %d oldest events", self._spool_max,
                        sum(n for _, n in victims))
            await asyncio.to_thread(_unlink_all, [p for p, _ in victims])

    async def _drain_spool(self) -> None:
        """Resend spooled batches oldest first until the spool is empty or the control plane fails again."""
        while self._spool and not self._offline:
            path, count = entry = self._spool[0]
            parsed = _parse_spool_name(path.name)
            self._sending = path
            try:
                body = await asyncio.to_thread(path.read_bytes)
            except OSError as exc:
                log.error("telemetry: spooled batch %s unreadable (%s); dropped", path.name, exc)
                body = None
            try:
                spooled = _Batch(parsed[0], count, body or b"", deltas=parsed[2]) if parsed is not None else None
                if body is None or spooled is None:
                    outcome, rejected = _Outcome.REJECTED, 0
                else:
                    self._counters["retried"] += count
                    outcome, rejected = await self._post(spooled)
                if outcome is _Outcome.RETRY:
                    self._mark_down()
                    return
                split = outcome is _Outcome.SPLIT and body is not None and parsed is not None
                async with self._spool_lock:
                    # Still there: the trim skips the batch being sent. The counters move in one step
                    # (no await in between), so queued == sent + dropped + queue_depth() at every await.
                    self._spool.remove(entry)
                    self._spool_events -= count
                    if split:
                        self._in_flight += count
                    else:
                        self._settle(outcome, count, rejected, spooled or _Batch("", count, b""))
                    await asyncio.to_thread(_unlink_all, [path])
            finally:
                self._sending = None
            if split and spooled is not None:
                for half in await asyncio.to_thread(self._split, spooled):
                    await self._ship(half)

    # --- the memory bound ------------------------------------------------------------------------

    def _request_spill(self) -> None:
        if self._task is None or self._offline:
            return
        if self._spill_task is None or self._spill_task.done():
            self._spill_task = asyncio.get_running_loop().create_task(self._spill(), name="specgate-telemetry-spill")

    async def _spill(self) -> None:
        """The sender is held up (a slow control plane) and memory fills: move the oldest events to disk."""
        spilled = 0
        while len(self._memory) > self._memory_max // 2:
            batch = await self._take()
            await self._spool_write(batch)
            spilled += batch.count
        if spilled:
            log.warning("telemetry queue over %d events in memory: spilled %d to the spool", self._memory_max, spilled)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
    if paths:
        fsync_dir(paths[0].parent)
