"""Keeping the worker's policy bundle current.

What runs, once :meth:`PolicySync.start` is called:

- the last-known-good bundle (``state_dir/bundle.json``, the exact signed
  envelope last accepted) is verified and put into the store first, so the
  sidecar decides requests at once, control plane up or not;
- a registration (``POST /v1/workers/register``), retried with backoff while
  the control plane is unreachable, and repeated whenever the control plane
  answers ``worker-not-found`` (its database was reset, the row was removed);
- a long-poll loop on ``GET /v1/bundle`` with ``If-None-Match`` and ``wait``:
  every 200 is verified (Ed25519 signature, ETag, document), checked against
  replay (its signed generation is not older than the last accepted one, its
  pool is this worker's, it has not expired), compiled, swapped into the store
  and written to disk atomically; anything wrong with a bundle refuses it,
  counts it (``specgate_bundle_refused_total{reason}``), and leaves the previous
  bundle active. The last-known-good bundle carries the high-water generation,
  so a restart does not forget it; it keeps being served after it expires (a
  control-plane outage must not stop serving), only a newly fetched expired
  bundle is refused;
- an SSE listener on ``/v1/bundle/events`` whose notices wake the long-poll at
  once, so a change lands even when the long-poll's connection silently died;
- heartbeats reporting the active revision and ETag (sent at once after each
  change, so the fleet view converges without waiting a period).

Trust: production deployments should configure the control plane's public
key(s) (``SPECGATE_PUBLIC_KEYS`` / ``--public-key``). Without one, the sidecar
trusts on first use: it fetches ``GET /v1/bundle/public-key`` once, pins it to
``state_dir/public_key`` and verifies everything after that, including later
starts, against the pinned key. That protects against a control plane (or a
man in the middle) changing keys later, not against one present at the very
first contact.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp

from policies import BundleVerifier, CompiledBundle, PolicyStore, SignedBundle
from sidecar.settings import SidecarSettings
from sidecar.support import Backoff, wait_event, write_atomic
from wire.problems import Problem, read_problem

log = logging.getLogger("specgate.sidecar.sync")

LKG_FILE = "bundle.json"
PINNED_KEY_FILE = "public_key"
# A rejected ETag is not asked for again for this long (the server holds the long-poll instead of
# resending the same bad bundle); afterwards it is fetched once more, in case the damage was in transit
# or the key configuration was fixed.
REJECTED_RETRY_S = 30.0
# An SSE stream that says nothing (not even a keepalive comment) for this long is considered dead.
SSE_READ_TIMEOUT_S = 90.0
# Extra time a long-poll may take beyond its `wait` before the sidecar gives up on it.
LONG_POLL_GRACE_S = 15.0
REQUEST_TIMEOUT_S = 10.0


def sidecar_version() -> str:
    try:
        return metadata.version("specgate")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def normalize_etag(value: str) -> str:
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')


class ControlPlaneError(Exception):
    """The control plane answered, but not with what the sidecar needed."""

    def __init__(self, status: int, detail: str, problem: Problem | None = None) -> None:
        super().__init__(f"HTTP {status}: {detail}" if status else detail)
        self.status = status
        self.problem = problem

    @property
    def worker_not_found(self) -> bool:
        """The control plane no longer knows this worker (its database was reset, the row was removed)."""
        return self.status == 404 and self.problem is not None and _worker_not_found(self.problem)

    def names(self, path: str) -> bool:
        """Whether the problem has an error at ``path`` (a field or parameter of the request)."""
        return self.problem is not None and any(e.path == path for e in self.problem.errors)


class _Reregister(Exception):
    """The control plane no longer knows this worker."""


class _Rejected(Exception):
    """A bundle was refused (already counted and logged); back off before asking again."""


class BundleRefused(Exception):
    """A correctly signed bundle this worker must not accept (a replay, or another pool's)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _problem(status: int, body: bytes) -> ControlPlaneError:
    problem = read_problem(status, body)
    return ControlPlaneError(status, problem.detail or problem.title, problem)


def _worker_not_found(problem: Problem) -> bool:
    return problem.type.endswith("/worker-not-found")


def _utc(ts: float | None) -> str | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).isoformat()


class PolicySync:
    """Keeps ``store`` on the bundle the control plane wants this worker to run.

    ``in_flight`` (optional) returns the number of requests in flight, and
    ``replicas`` (optional) the state of each engine's replicas
    (``sidecar.replicas.Pools.report``), both reported in heartbeats; so is
    ``supervised`` when set: the engines the sidecar runs itself
    (``sidecar.supervisor.EngineSupervisor.report``).
    ``session`` may be shared; one is created (and closed) here otherwise.
    Call :meth:`start` inside the event loop that will run it.
    """

    def __init__(self, settings: SidecarSettings, store: PolicyStore, session: aiohttp.ClientSession | None = None,
                 *, in_flight: Callable[[], int] | None = None, backoff_cap_s: float = 5.0,
                 refused: dict[str, int] | None = None,
                 replicas: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.settings = settings
        self.store = store
        self.worker_id = settings.worker_id or settings.listen
        self._base = settings.control_plane.rstrip("/")
        self._auth = {"Authorization": f"Bearer {settings.key}"} if settings.key else {}
        self._session = session
        self._own_session = session is None
        self._in_flight = in_flight
        self._replicas = replicas
        self.supervised: Callable[[], list[dict[str, Any]]] | None = None
        self._backoff_cap = backoff_cap_s
        self._state_dir = Path(settings.state_dir)
        self._wait = settings.long_poll_s
        self._verifier: BundleVerifier | None = None
        self._wake = asyncio.Event()
        self._heartbeat_now = asyncio.Event()
        self._registered = asyncio.Event()
        self._register_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._rejected: tuple[str, float] | None = None
        self.rejected_retry_s = REJECTED_RETRY_S
        # what status() reports
        self.connected = False
        self.sse_connected = False
        self.source: str | None = None
        self.last_sync: float | None = None
        self.last_change: float | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.rejected_bundles = 0
        # Refused bundles by reason; shared with the metrics when given (specgate_bundle_refused_total).
        self.refused: dict[str, int] = {} if refused is None else refused
        # The generation of the last accepted bundle: an older one is a replay.
        self.high_water: int | None = None
        self._persisted_generation = -1
        self.updates = 0
        self.expected_etag: str | None = None

    @property
    def lkg_path(self) -> Path:
        return self._state_dir / LKG_FILE

    @property
    def pinned_key_path(self) -> Path:
        return self._state_dir / PINNED_KEY_FILE

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Load the last-known-good bundle and start the background loops; does not wait for the network."""
        if self._tasks:
            return
        await asyncio.to_thread(self._state_dir.mkdir, parents=True, exist_ok=True)
        self._verifier = await asyncio.to_thread(self._local_verifier)
        if self._verifier is not None:
            await self._load_lkg()
        if self._session is None:
            self._session = aiohttp.ClientSession()
        self._tasks = [
            asyncio.create_task(self._poll_loop(), name="specgate-sync-poll"),
            asyncio.create_task(self._sse_loop(), name="specgate-sync-sse"),
            asyncio.create_task(self._heartbeat_loop(), name="specgate-sync-heartbeat"),
        ]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
        self.connected = self.sse_connected = False

    def status(self) -> dict[str, Any]:
        """For /readyz and metrics: what runs, since when, and how the link to the control plane is."""
        current = self.store.current
        return {
            "worker_id": self.worker_id,
            "ready": current is not None,
            "etag": current.etag if current else None,
            "revision": current.active.revision if current else None,
            "canary_revision": current.canary.revision if current and current.canary else None,
            "kill_switch": current.kill_switch if current else None,
            "source": self.source,
            "expected_etag": self.expected_etag,
            "last_sync": _utc(self.last_sync),
            "last_sync_age_s": None if self.last_sync is None else max(0.0, time.time() - self.last_sync),
            "last_change": _utc(self.last_change),
            "last_error": self.last_error,
            "last_error_at": _utc(self.last_error_at),
            "rejected_bundles": self.rejected_bundles,
            "refused_bundles": dict(self.refused),
            "generation": self.high_water,
            "updates": self.updates,
            "connected": self.connected,
            "sse_connected": self.sse_connected,
            "registered": self._registered.is_set(),
        }

    # --- trust and the last-known-good bundle -------------------------------------------------

    def _local_verifier(self) -> BundleVerifier | None:
        if self.settings.public_keys:
            return BundleVerifier(self.settings.public_keys)
        try:
            pinned = self.pinned_key_path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise RuntimeError(f"cannot read the pinned bundle key {self.pinned_key_path}: {exc}; delete it "
                               "to trust the control plane's key again, or configure public keys") from exc
        return BundleVerifier([pinned])

    def _compile(self, raw: bytes, *, fetched: bool = True) -> tuple[CompiledBundle, SignedBundle]:
        """Verify and compile ``raw``; BundleRefused when it is signed but not for this worker now.

        ``fetched`` is False for the last-known-good bundle, which may have expired: it was accepted when it
        was current, and serving it beats serving nothing while the control plane is away.
        """
        if self._verifier is None:
            raise RuntimeError("no bundle key to verify with yet")
        signed = self._verifier.verify_envelope(json.loads(raw))
        delivery = signed.delivery
        if delivery.pool != self.settings.pool:
            raise BundleRefused("other_worker", f"bundle was signed for pool {delivery.pool!r}, "
                                f"this worker is in pool {self.settings.pool!r}")
        if delivery.worker_id and delivery.worker_id != self.worker_id:
            # Workers of one pool may run different revisions during a rollout: another's is not ours.
            raise BundleRefused("other_worker", f"bundle was signed for worker {delivery.worker_id!r}, "
                                f"this worker is {self.worker_id!r}")
        if fetched and delivery.expires_at < time.time():
            raise BundleRefused("expired", f"bundle expired at {_utc(delivery.expires_at)}")
        if self.high_water is not None and delivery.generation < self.high_water:
            current = self.store.current
            if not (current is not None and current.etag == signed.etag):
                raise BundleRefused("stale_generation", f"bundle generation {delivery.generation} is older "
                                    f"than the accepted generation {self.high_water} (a replay)")
        return CompiledBundle(signed.payload), signed

    def _refused(self, exc: BaseException) -> str:
        reason = exc.reason if isinstance(exc, BundleRefused) else "invalid"
        self.refused[reason] = self.refused.get(reason, 0) + 1
        self.rejected_bundles += 1
        return reason

    async def _load_lkg(self) -> None:
        if self.store.current is not None:
            return
        try:
            raw = await asyncio.to_thread(self.lkg_path.read_bytes)
        except FileNotFoundError:
            return
        except OSError as exc:
            self._error(f"cannot read the last-known-good bundle: {exc}")
            return
        try:
            compiled, signed = await asyncio.to_thread(self._compile, raw, fetched=False)
        except Exception as exc:
            reason = self._refused(exc)
            self._error(f"last-known-good bundle {self.lkg_path} refused ({reason}): {exc}")
            log.error("%s", self.last_error)
            return
        self.high_water = self._persisted_generation = signed.delivery.generation
        update = self.store.update(compiled)
        self.source = "last-known-good"
        self.last_change = time.time()
        log.info("serving the last-known-good bundle from %s: %s", self.lkg_path, update.summary())

    async def _ensure_verifier(self) -> None:
        if self._verifier is not None:
            return
        assert self._session is not None
        async with self._session.get(f"{self._base}/v1/bundle/public-key", headers=self._auth,
                                     timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise _problem(resp.status, body)
        try:
            key = str(json.loads(body)["public_key"])
            verifier = BundleVerifier([key])
        except Exception as exc:
            raise ControlPlaneError(200, f"unusable public key answer: {exc}") from None
        await asyncio.to_thread(write_atomic, self.pinned_key_path, (key + "\n").encode("ascii"))
        self._verifier = verifier
        log.warning("trusting the control plane's bundle key on first use and pinning it to %s; configure "
                    "public keys (SPECGATE_PUBLIC_KEYS / --public-key) in production", self.pinned_key_path)
        await self._load_lkg()

    # --- registration -------------------------------------------------------------------------

    async def _ensure_registered(self) -> None:
        if self._registered.is_set():
            return
        async with self._register_lock:
            if self._registered.is_set():
                return
            assert self._session is not None
            body = {"id": self.worker_id, "pool": self.settings.pool, "labels": self.settings.labels,
                    "kind": self.settings.kind, "engines": registered_engines(self.settings.engines),
                    "sidecar_version": sidecar_version()[:64]}
            async with self._session.post(f"{self._base}/v1/workers/register", json=body, headers=self._auth,
                                          timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
                answer = await resp.read()
                if resp.status not in (200, 201):
                    raise _problem(resp.status, answer)
            self._registered.set()
            self.connected = True
            log.info("registered as worker %s (pool %s)", self.worker_id, self.settings.pool)

    def _forget_registration(self) -> None:
        if self._registered.is_set():
            log.warning("the control plane does not know worker %s any more; registering again", self.worker_id)
        self._registered.clear()

    # --- the long-poll loop ---------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        backoff = Backoff(0.1, self._backoff_cap)
        while True:
            try:
                await self._ensure_verifier()
                await self._ensure_registered()
                await self._poll_once()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except _Reregister:
                self._forget_registration()
                await self._sleep(backoff.next())
            except _Rejected:
                await self._sleep(backoff.next())
            except Exception as exc:
                # Connected means the control plane answers, even if what it answers is a refusal.
                self.connected = isinstance(exc, ControlPlaneError) and 0 < exc.status < 500
                self._error(_describe(exc))
                # Loud on the first failure of a streak, quiet while the control plane stays away.
                log.log(logging.WARNING if backoff.attempts == 0 else logging.DEBUG,
                        "bundle sync: %s (keeping %s, retrying)", self.last_error,
                        self.store.current.etag[:12] if self.store.current else "no bundle")
                await self._sleep(backoff.next())

    async def _sleep(self, seconds: float) -> None:
        """Back off, but come back at once when an SSE notice says there is something new."""
        self._wake.clear()
        await wait_event(self._wake, seconds)

    def _known_etags(self) -> list[str]:
        tags = []
        if self.store.current is not None:
            tags.append(self.store.current.etag)
        if self._rejected is not None and time.monotonic() - self._rejected[1] < self.rejected_retry_s:
            tags.append(self._rejected[0])
        return tags

    def _wants(self, etag: str) -> bool:
        """Whether a notice about ``etag`` is news: not what runs, not what was just rejected."""
        return etag not in self._known_etags()

    async def _poll_once(self) -> None:
        assert self._session is not None
        self._wake.clear()
        tags = self._known_etags()
        headers = dict(self._auth)
        params: dict[str, str] = {"worker": self.worker_id}
        if tags:
            headers["If-None-Match"] = ", ".join(f'"{t}"' for t in tags)
            params["wait"] = f"{self._wait:g}"
        timeout = aiohttp.ClientTimeout(total=self._wait + LONG_POLL_GRACE_S, sock_connect=REQUEST_TIMEOUT_S)

        async def fetch() -> tuple[int, str, bytes]:
            assert self._session is not None
            async with self._session.get(f"{self._base}/v1/bundle", params=params, headers=headers,
                                         timeout=timeout) as resp:
                return resp.status, normalize_etag(resp.headers.get("ETag", "")), await resp.read()

        request = asyncio.create_task(fetch())
        woken = asyncio.create_task(self._wake.wait())
        try:
            await asyncio.wait({request, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            if not request.done():
                # An SSE notice (or heartbeat) says the bundle changed while this long-poll still waits:
                # its connection may be dead, so ask again now instead of trusting it.
                request.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await request
        if request.cancelled():
            log.debug("long-poll superseded by a change notice")
            return
        status, etag, body = request.result()
        if status == 304:
            self._synced()
            return
        if status == 200:
            await self._apply(body, etag)
            return
        problem = _problem(status, body)
        if problem.worker_not_found:
            raise _Reregister
        if status == 422 and problem.names("wait") and self._wait > 1:
            self._wait = max(1.0, self._wait / 2)
            log.warning("the control plane refused wait; long-polling with wait=%g s from now on", self._wait)
        raise problem

    def _synced(self) -> None:
        self.connected = True
        self.last_sync = time.time()

    async def _apply(self, raw: bytes, etag: str) -> None:
        self._synced()
        try:
            compiled, signed = await asyncio.to_thread(self._compile, raw)
        except Exception as exc:
            reason = self._refused(exc)
            if etag:
                self._rejected = (etag, time.monotonic())
            self._error(f"bundle {etag[:12] or '?'} refused ({reason}): {_describe(exc)}")
            log.error("%s; keeping %s", self.last_error,
                      self.store.current.etag[:12] if self.store.current else "no bundle")
            raise _Rejected from exc
        self.high_water = max(self.high_water or 0, signed.delivery.generation)
        update = self.store.update(compiled)
        self.source = "control-plane"
        self._rejected = None
        if not update.changed:
            # Same content: still keep the newer envelope, so the persisted high-water moves on.
            if signed.delivery.generation > self._persisted_generation:
                await self._persist(raw, signed.delivery.generation)
            return
        self.updates += 1
        self.last_change = time.time()
        self._heartbeat_now.set()
        log.info("policy bundle updated: %s", update.summary())
        await self._persist(raw, signed.delivery.generation)

    async def _persist(self, raw: bytes, generation: int) -> None:
        try:
            await asyncio.to_thread(write_atomic, self.lkg_path, raw)
        except OSError as exc:
            self._error(f"cannot write the last-known-good bundle {self.lkg_path}: {exc}")
            log.error("%s", self.last_error)
            return
        self._persisted_generation = generation

    def _error(self, message: str) -> None:
        self.last_error = message
        self.last_error_at = time.time()

    # --- change notices over SSE ----------------------------------------------------------------

    async def _sse_loop(self) -> None:
        backoff = Backoff(0.2, self._backoff_cap)
        while True:
            await self._registered.wait()
            try:
                await self._listen(backoff)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("change stream: %s", _describe(exc))
                if isinstance(exc, _Reregister):
                    self._forget_registration()
                    self._wake.set()
            finally:
                self.sse_connected = False
            await asyncio.sleep(backoff.next())

    async def _listen(self, backoff: Backoff) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=SSE_READ_TIMEOUT_S)
        async with self._session.get(f"{self._base}/v1/bundle/events", params={"worker": self.worker_id},
                                     headers={**self._auth, "Accept": "text/event-stream"},
                                     timeout=timeout) as resp:
            if resp.status != 200:
                problem = _problem(resp.status, await resp.read())
                if problem.worker_not_found:
                    raise _Reregister
                raise problem
            self.sse_connected = True
            backoff.reset()
            event = ""
            data: list[str] = []
            async for raw_line in resp.content:
                line = raw_line.decode("utf-8", "replace").rstrip("\r\n")
                if not line:
                    self._on_notice(event or "message", "\n".join(data))
                    event, data = "", []
                    continue
                if line.startswith(":"):
                    continue
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    event = value
                elif field == "data":
                    data.append(value)

    def _on_notice(self, event: str, data: str) -> None:
        if event == "error":
            log.warning("change stream ended by the control plane: %s", data[:300])
            if _worker_not_found(read_problem(0, data)):
                self._forget_registration()
            self._wake.set()
            return
        if event != "bundle":
            return
        try:
            etag = normalize_etag(str(json.loads(data)["etag"]))
        except (ValueError, KeyError, TypeError):
            log.debug("ignoring a malformed change notice: %r", data[:200])
            return
        if self._wants(etag):
            log.debug("change notice: %s", etag[:12])
            self._wake.set()
        elif self.store.current is not None and etag == self.store.current.etag:
            self._synced()  # the control plane confirms the bundle that runs is current

    # --- heartbeats -----------------------------------------------------------------------------

    def report_soon(self) -> None:
        """Heartbeat now rather than at the next interval (a replica was ejected or came back)."""
        self._heartbeat_now.set()

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._registered.wait()
            try:
                await self._heartbeat_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("heartbeat: %s", _describe(exc))
            await wait_event(self._heartbeat_now, self.settings.heartbeat_s)
            self._heartbeat_now.clear()

    async def _heartbeat_once(self) -> None:
        assert self._session is not None
        current = self.store.current
        body: dict[str, Any] = {"active_revision": current.active.revision if current else None,
                                "active_etag": current.etag if current else None}
        if self._in_flight is not None:
            with contextlib.suppress(Exception):
                body["in_flight"] = max(0, int(self._in_flight()))
        if self._replicas is not None:
            with contextlib.suppress(Exception):
                body["replicas"] = self._replicas()[:MAX_REPORTED_REPLICAS]
        if self.supervised is not None:
            with contextlib.suppress(Exception):
                body["supervised_engines"] = [
                    {key: value for key, value in report.items() if key in SUPERVISED_REPORT_FIELDS}
                    for report in self.supervised()]
        for _ in (1, 2):
            async with self._session.post(f"{self._base}/v1/workers/{self.worker_id}/heartbeat", json=body,
                                          headers=self._auth,
                                          timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
                answer = await resp.read()
                status = resp.status
            if _problem(status, answer).worker_not_found:
                self._forget_registration()
                await self._ensure_registered()
                continue
            if status != 200:
                raise _problem(status, answer)
            with contextlib.suppress(ValueError, AttributeError):
                expected = json.loads(answer).get("expected_etag")
                self.expected_etag = expected
                if expected and self._wants(normalize_etag(expected)):
                    # The control plane expects another bundle than the one running: a missed change.
                    self._wake.set()
                elif expected and current is not None and normalize_etag(expected) == current.etag:
                    self._synced()
            return


# What the control plane accepts (controlplane/worker/schemas.py): replicas per heartbeat, characters of an
# engine's description at registration.
MAX_REPORTED_REPLICAS = 256
# What a supervised engine's heartbeat report holds (the pid stays local: /metrics and the log have it).
SUPERVISED_REPORT_FIELDS = frozenset({"engine", "state", "config_hash", "revision", "restarts", "failed_restarts",
                                      "crashes", "last_error", "error_revision", "tokenizer"})
MAX_ENGINE_DESCRIPTION = 2048


def registered_engines(engines: dict[str, list[str]]) -> dict[str, str]:
    """Each engine's replicas as registration describes them: "URL1,URL2", or a count and the first URLs
    when the whole list would not fit."""
    out: dict[str, str] = {}
    for name, urls in engines.items():
        text = ",".join(urls)
        if len(text) > MAX_ENGINE_DESCRIPTION:
            head = f"{len(urls)} replicas: "
            kept: list[str] = []
            for url in urls:
                if len(head) + len(",".join([*kept, url])) + 4 > MAX_ENGINE_DESCRIPTION:
                    break
                kept.append(url)
            text = head + ",".join(kept) + ",..."
        out[name] = text
    return out


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
