"""PolicySync against the real control plane (uvicorn in a thread), on a fixed port so it can go down and come back."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from sqlalchemy import delete

from controlplane.migrations_state import upgrade
from controlplane.models import Worker
from policies import BundlePayload, Delivery, PolicyStore, SigningKey
from sidecar.settings import SidecarSettings
from sidecar.sync import PolicySync, _problem
from tests.support.factories import seed_policy
from tests.support.fleet_rows import session_for
from tests.support.live import WORKER_ID, ControlPlane, free_port
from wire.problems import problem_bytes


def _control_plane(database_url: str) -> ControlPlane:
    upgrade(database_url)
    seed_policy(database_url)
    return ControlPlane(database_url)


@pytest.fixture
def control_plane(tmp_path: Path) -> Iterator[ControlPlane]:
    """SQLite; the control plane's own tests cover both databases."""
    cp = _control_plane(f"sqlite:///{tmp_path / 'cp.db'}")
    yield cp
    cp.stop()


@pytest.fixture
def any_control_plane(database_url: str) -> Iterator[ControlPlane]:
    cp = _control_plane(database_url)
    yield cp
    cp.stop()


def settings_for(cp: ControlPlane, state_dir: Path, **overrides: Any) -> SidecarSettings:
    values: dict[str, Any] = {
        "control_plane": cp.base, "key": cp.worker_token, "worker_id": WORKER_ID, "pool": "default",
        "labels": {"zone": "a"}, "engines": {"base": "http://127.0.0.1:9/plain", "draft": "http://127.0.0.1:9/spec"},
        "state_dir": state_dir, "long_poll_s": 20, "heartbeat_s": 0.2, **overrides}
    return SidecarSettings(**values)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> float:
    """Seconds until ``predicate`` held (polled every 2 ms); fails the test at ``timeout``."""
    t0 = time.perf_counter()
    while not predicate():
        if time.perf_counter() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)
    return time.perf_counter() - t0


async def until_async(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def run(scenario: Awaitable[None]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario, 40)

    asyncio.run(bounded())


def lkg_etag(state: Path) -> str | None:
    try:
        return str(json.loads((state / "bundle.json").read_bytes())["etag"])
    except FileNotFoundError:
        return None


def etag_of(store: PolicyStore) -> str | None:
    return None if store.current is None else store.current.etag


def kill_switch_of(store: PolicyStore) -> bool | None:
    return None if store.current is None else store.current.kill_switch


# --- the tests --------------------------------------------------------------------------------

def test_first_sync_then_a_change_lands_within_a_second_and_heartbeats_converge(
        any_control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = any_control_plane
    cp.start()
    state = tmp_path / "state"

    async def scenario() -> None:
        store = PolicyStore()
        sync = PolicySync(settings_for(cp, state), store, in_flight=lambda: 3)
        await sync.start()
        try:
            await until(lambda: store.current is not None)
            assert store.current is not None
            envelope = await cp.envelope()
            assert store.current.etag == json.loads(envelope)["etag"]
            assert store.current.kill_switch is False
            # Trust on first use: the key is pinned; the accepted bundle is the last-known-good one.
            key = (await cp.call("GET", "/v1/bundle/public-key")).json()["public_key"]
            assert (state / "public_key").read_text().strip() == key
            await until(lambda: lkg_etag(state) == etag_of(store))  # written right after the swap
            assert (state / "bundle.json").read_bytes() == envelope

            first = store.current.etag
            await until(lambda: sync.sse_connected)
            t0 = time.perf_counter()
            await cp.kill_switch(True)
            await until(lambda: kill_switch_of(store) is True, timeout=1.0)
            latency = time.perf_counter() - t0
            print(f"\nkill switch -> store: {latency * 1000:.1f} ms")
            assert latency < 1.0
            assert store.current.etag != first
            await until(lambda: lkg_etag(state) == etag_of(store))

            async def converged() -> bool:
                worker = await cp.worker()
                return worker is not None and worker["active_etag"] == etag_of(store) and worker["converged"]

            await until_async(converged, timeout=3)
            worker = await cp.worker()
            assert worker is not None
            assert worker["active_revision"] == store.current.active.revision
            assert worker["labels"] == {"zone": "a"}
            assert set(worker["engines"]) == {"base", "draft"}
            status = sync.status()
            assert status["etag"] == store.current.etag
            assert status["kill_switch"] is True
            assert status["connected"]
            assert status["registered"]
            assert status["source"] == "control-plane"
            assert status["rejected_bundles"] == 0
            assert status["updates"] == 2
            assert status["last_sync"] is not None
        finally:
            await sync.stop()

    run(scenario())


class LosingProxy:
    """Test double in front of the control plane: forwards everything, except that it never answers the
    next ``swallow`` long-polls (``/v1/bundle`` with ``wait``), like a connection that died silently."""

    def __init__(self, upstream: str, swallow: int) -> None:
        self.upstream = upstream
        self.swallow = swallow
        self.swallowed = 0
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self._session = aiohttp.ClientSession()

    async def stop(self) -> None:
        assert self._runner is not None
        assert self._session is not None
        await self._session.close()
        await self._runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/bundle" and "wait" in request.query and self.swallow > 0:
            self.swallow -= 1
            self.swallowed += 1
            await asyncio.Event().wait()  # until the client gives up on it
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "if-none-match", "content-type", "accept")}
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                         data=await request.read(),
                                         timeout=aiohttp.ClientTimeout(total=None)) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "etag", "cache-control")})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def test_a_change_notice_revives_a_long_poll_whose_connection_was_lost(control_plane: ControlPlane,
                                                                      tmp_path: Path) -> None:
    cp = control_plane
    cp.start()

    async def scenario() -> None:
        proxy = LosingProxy(cp.base, swallow=1)
        await proxy.start()
        store = PolicyStore()
        # A 30 s long-poll (+15 s grace): without the SSE wake-up, the change would wait for it.
        sync = PolicySync(settings_for(cp, tmp_path / "state", control_plane=proxy.base, long_poll_s=30), store)
        await sync.start()
        try:
            await until(lambda: store.current is not None and sync.sse_connected and proxy.swallowed == 1)
            t0 = time.perf_counter()
            await cp.kill_switch(True)
            await until(lambda: kill_switch_of(store) is True, timeout=1.0)
            latency = time.perf_counter() - t0
            print(f"\nkill switch -> store with the long-poll lost: {latency * 1000:.1f} ms")
            assert latency < 1.0
        finally:
            await sync.stop()
            await proxy.stop()

    run(scenario())


def test_starts_from_the_last_known_good_bundle_with_the_control_plane_down_then_reconnects(
        control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = control_plane
    cp.start()
    state = tmp_path / "state"

    async def scenario() -> None:
        first_store = PolicyStore()
        first = PolicySync(settings_for(cp, state), first_store)
        await first.start()
        await until(lambda: first_store.current is not None and lkg_etag(state) == first_store.current.etag)
        assert first_store.current is not None
        etag = first_store.current.etag
        await first.stop()
        await asyncio.to_thread(cp.stop)

        store = PolicyStore()
        sync = PolicySync(settings_for(cp, state), store, backoff_cap_s=0.3)
        await sync.start()
        try:
            # Serving at once, from disk, verified with the pinned key (the control plane cannot be asked).
            assert store.current is not None
            assert store.current.etag == etag
            assert sync.status()["source"] == "last-known-good"
            await until(lambda: sync.last_error is not None)
            assert sync.status()["connected"] is False
            assert sync.status()["registered"] is False
            assert store.current.etag == etag

            # The control plane comes back: the sidecar registers and follows changes again.
            await asyncio.to_thread(cp.start)
            await until(lambda: sync.status()["registered"] and sync.sse_connected, timeout=5)
            # In sync with the same bundle (the long-poll is held): the change stream and heartbeats confirm it.
            await until(lambda: sync.status()["last_sync"] is not None, timeout=2)
            assert sync.status()["connected"] is True
            await cp.kill_switch(True)
            await until(lambda: kill_switch_of(store) is True, timeout=1.0)
            assert sync.status()["source"] == "control-plane"
        finally:
            await sync.stop()

    run(scenario())


def test_a_tampered_or_foreign_last_known_good_file_is_refused(control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = control_plane
    cp.start()
    state = tmp_path / "state"
    lkg = state / "bundle.json"

    async def scenario() -> None:
        first_store = PolicyStore()
        first = PolicySync(settings_for(cp, state), first_store)
        await first.start()
        await until(lambda: first_store.current is not None and lkg_etag(state) == first_store.current.etag)
        await first.stop()
        await asyncio.to_thread(cp.stop)
        good = lkg.read_bytes()

        envelope = json.loads(good)
        envelope["payload"]["kill_switch"] = True  # signature left as it was
        tampered = json.dumps(envelope).encode()
        delivery = Delivery.from_dict(envelope["payload"])
        content = {k: v for k, v in envelope["payload"].items() if k not in delivery.to_dict()}
        foreign = json.dumps(SigningKey.generate().sign(BundlePayload.from_dict(content), delivery)).encode()
        for bad, why in ((tampered, "does not match"), (foreign, "unknown key")):
            lkg.write_bytes(bad)
            store = PolicyStore()
            sync = PolicySync(settings_for(cp, state), store)
            await sync.start()
            try:
                assert store.current is None
                assert sync.rejected_bundles == 1
                assert sync.last_error is not None
                assert why in sync.last_error
            finally:
                await sync.stop()

        # With the control plane back, the sidecar gets a good bundle and replaces the bad file.
        await asyncio.to_thread(cp.start)
        store = PolicyStore()
        sync = PolicySync(settings_for(cp, state), store)
        await sync.start()
        try:
            await until(lambda: store.current is not None)
            assert store.current is not None
            assert store.current.kill_switch is False
            await until(lambda: lkg.read_bytes() == good)
        finally:
            await sync.stop()

    run(scenario())


def test_a_bundle_signed_by_another_key_is_rejected_and_the_previous_one_stays(control_plane: ControlPlane,
                                                                               tmp_path: Path) -> None:
    cp = control_plane
    trusted, other = cp.signing_key, SigningKey.generate()
    cp.start()

    async def scenario() -> None:
        store = PolicyStore()
        # Configured keys (the production setup), and short long-polls so the retry of a rejected ETag shows.
        sync = PolicySync(settings_for(cp, tmp_path / "state", public_keys=[trusted.public_key_b64], long_poll_s=1),
                          store, backoff_cap_s=0.3)
        await sync.start()
        try:
            await until(lambda: store.current is not None)
            assert store.current is not None
            good = store.current.etag
            assert not (tmp_path / "state" / "public_key").exists()  # configured keys are not pinned

            await asyncio.to_thread(cp.stop)
            await asyncio.to_thread(cp.start, other)  # same database and port, another signing key
            await cp.kill_switch(True)
            await until(lambda: sync.rejected_bundles >= 1)
            assert sync.last_error is not None
            assert "unknown key" in sync.last_error
            assert store.current.etag == good
            assert store.current.kill_switch is False
            assert json.loads((tmp_path / "state" / "bundle.json").read_bytes())["etag"] == good
            # The refused ETag is not fetched again and again: the long-poll waits past it.
            await asyncio.sleep(1.5)
            assert sync.rejected_bundles == 1
            assert sync.status()["connected"] is True

            # The loop goes on: once the key is right again, the same change is accepted.
            await asyncio.to_thread(cp.stop)
            sync.rejected_retry_s = 0.0
            await asyncio.to_thread(cp.start, trusted)
            await until(lambda: kill_switch_of(store) is True, timeout=5)
            assert sync.rejected_bundles == 1
        finally:
            await sync.stop()

    run(scenario())


def test_heartbeats_carry_the_supervised_engines_and_convergence_waits_for_them(
        control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = control_plane
    cp.start()

    async def scenario() -> None:
        store = PolicyStore()
        sync = PolicySync(settings_for(cp, tmp_path / "state"), store)
        reports: list[dict[str, Any]] = []
        sync.supervised = lambda: reports
        await sync.start()
        try:
            await until(lambda: store.current is not None)
            assert store.current is not None
            revision = store.current.active.revision
            # what EngineSupervisor.report() returns: the pid stays on the worker
            reports[:] = [{"engine": "draft", "state": "restarting", "config_hash": "00aa", "revision": "before",
                           "pid": 4242, "restarts": 0, "failed_restarts": 0, "crashes": 0, "last_error": None}]
            sync.report_soon()

            async def reported(state: str, converged: bool) -> bool:
                worker = await cp.worker()
                engines = [] if worker is None else worker["supervised_engines"]
                return bool(engines) and engines[0]["state"] == state and worker is not None and \
                    worker["converged"] is converged

            await until_async(lambda: reported("restarting", False), timeout=5)
            worker = await cp.worker()
            assert worker is not None
            assert worker["active_etag"] == store.current.etag  # the bundle is there; its engine is not yet
            assert worker["engines_converged"] is False
            assert "pid" not in worker["supervised_engines"][0]
            reports[0] = {**reports[0], "state": "serving", "revision": revision, "restarts": 1}
            sync.report_soon()
            await until_async(lambda: reported("serving", True), timeout=5)
        finally:
            await sync.stop()

    run(scenario())


def test_a_worker_the_control_plane_forgot_registers_again(control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = control_plane
    cp.start()

    async def scenario() -> None:
        store = PolicyStore()
        sync = PolicySync(settings_for(cp, tmp_path / "state"), store)
        await sync.start()
        try:
            await until(lambda: store.current is not None)
            await until_async(lambda: _reports(cp, store))
            with session_for(cp.database_url) as session:
                session.execute(delete(Worker).where(Worker.id == WORKER_ID))
            assert await cp.worker() is None
            # The next heartbeat gets worker-not-found, registers again and reports the bundle again.
            await until_async(lambda: _reports(cp, store), timeout=3)
        finally:
            await sync.stop()

    run(scenario())


async def _reports(cp: ControlPlane, store: PolicyStore) -> bool:
    worker = await cp.worker()
    return worker is not None and store.current is not None and worker["active_etag"] == store.current.etag


def test_control_plane_answers_are_read_as_problems() -> None:
    wait = _problem(422, problem_bytes(422, "validation", "The request did not validate", "1 field did not validate",
                                       errors=[{"path": "wait", "in": "query", "code": "out_of_range",
                                                "message": "Input should be less than or equal to 30"}]))
    assert (wait.status, str(wait)) == (422, "HTTP 422: 1 field did not validate")
    assert wait.names("wait")
    assert not wait.names("worker")
    assert not wait.worker_not_found
    gone = _problem(404, problem_bytes(404, "worker-not-found", "Worker not found", "no worker w1"))
    assert gone.worker_not_found
    assert not _problem(404, problem_bytes(404, "not-found", "Not found", "no such thing")).worker_not_found
    proxy = _problem(502, b"<html>bad gateway</html>\n")  # not a problem: its text still says what happened
    assert str(proxy) == "HTTP 502: <html>bad gateway</html>"
    assert not proxy.names("wait")
