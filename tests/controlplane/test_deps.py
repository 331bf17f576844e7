"""SessionDep and Announce: the commit (and the hub's wake-up) happen before the client sees any response.

A client that got a 2xx must read its write at once from any connection, and a
long-poll woken by the hub must find the new state. TestClient returns only
after the whole ASGI call, so looking afterwards proves nothing: these tests
look from inside ``send``, at the moment the response starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.app import create_app
from controlplane.audit.service import record
from controlplane.db import make_engine, make_sessionmaker
from controlplane.deps import Announce, SessionDep
from controlplane.distribution.hub import ChangeHub
from controlplane.errors import Conflict, install_error_handlers
from controlplane.models import AuditEvent, FleetState, Policy
from controlplane.settings import ControlPlaneSettings

Headers = dict[str, str]

# These tests count how many times an action bumped the generation.
pytestmark = pytest.mark.usefixtures("generations_count_changes")


class AtResponseStart:
    """Runs ``look`` when the app starts its response, before the client can have any of it."""

    def __init__(self, app: ASGIApp, look: Callable[[], Any]) -> None:
        self.app = app
        self.look = look
        self.seen: list[tuple[int, Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def spy(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.seen.append((message["status"], self.look()))
            await send(message)

        await self.app(scope, receive, spy)


class OtherConnection:
    """Reads the database on a connection of its own, as another client would."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)

    def audit_reasons(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.scalars(select(AuditEvent.reason).where(AuditEvent.action == "test.write")))

    def policy_names(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.scalars(select(Policy.name)))

    def generation(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.scalar(select(FleetState.generation).where(FleetState.id == 1)) or 0)


@pytest.fixture
def reader(migrated_url: str) -> Iterator[OtherConnection]:
    r = OtherConnection(migrated_url)
    yield r
    r.engine.dispose()


def _write(session: Any, reason: str) -> None:
    record(session, actor="test", action="test.write", target_type="test", target_id="1", reason=reason)


@pytest.fixture
def small_app(migrated_url: str) -> Iterator[FastAPI]:
    """Endpoints that use the dependencies and nothing else, on the migrated test database."""
    app = FastAPI()
    engine = make_engine(migrated_url)
    app.state.sessions = make_sessionmaker(engine)
    app.state.hub = ChangeHub()
    install_error_handlers(app)

    @app.post("/write")
    def write(session: SessionDep) -> dict[str, str]:
        _write(session, "kept")
        return {"ok": "yes"}

    @app.post("/write-then-fail")
    def write_then_fail(session: SessionDep) -> dict[str, str]:
        _write(session, "undone")
        raise Conflict("refused after writing")

    @app.post("/announce")
    def announce_change(session: SessionDep, announce: Announce) -> dict[str, str]:
        _write(session, "announced")
        announce(41)
        announce(None)  # "nothing changed" is not an announcement
        return {"ok": "yes"}

    @app.post("/announce-then-fail")
    def announce_then_fail(session: SessionDep, announce: Announce) -> dict[str, str]:
        _write(session, "never announced")
        announce(99)
        raise Conflict("refused after announcing")

    @app.post("/announce-without-session")
    def announce_alone(announce: Announce) -> dict[str, str]:
        announce(7)
        return {"ok": "yes"}

    yield app
    engine.dispose()


def test_the_write_is_committed_before_the_response_starts(small_app: FastAPI, reader: OtherConnection) -> None:
    spied = AtResponseStart(small_app, reader.audit_reasons)
    with TestClient(spied) as client:
        assert client.post("/write").status_code == 200
    assert spied.seen == [(200, ["kept"])]


def test_an_error_rolls_the_write_back(small_app: FastAPI, reader: OtherConnection) -> None:
    with TestClient(small_app, raise_server_exceptions=False) as client:
        r = client.post("/write-then-fail")
    assert r.status_code == 409
    assert r.headers["content-type"].startswith("application/problem+json")
    assert reader.audit_reasons() == []


def test_announce_tells_the_hub_after_the_commit_and_before_the_response(small_app: FastAPI,
                                                                         reader: OtherConnection) -> None:
    hub: ChangeHub = small_app.state.hub

    def look() -> tuple[int, int, list[str]]:
        return hub.publishes, hub.generation, reader.audit_reasons()

    spied = AtResponseStart(small_app, look)
    with TestClient(spied, raise_server_exceptions=False) as client:
        assert client.post("/announce").status_code == 200
        assert client.post("/announce-then-fail").status_code == 409
    # one publish (None is skipped), of the generation given, with the write already visible
    assert spied.seen == [(200, (1, 41, ["announced"])), (409, (1, 41, ["announced"]))]


def test_announce_without_a_session_fails_instead_of_waking_no_one(small_app: FastAPI) -> None:
    with TestClient(small_app, raise_server_exceptions=False) as client:
        r = client.post("/announce-without-session")
    assert r.status_code == 500
    assert small_app.state.hub.publishes == 0


def test_a_created_policy_is_readable_and_announced_when_the_201_starts(
        settings: ControlPlaneSettings, admin: Headers, reader: OtherConnection) -> None:
    app = create_app(settings)
    before = reader.generation()

    def look() -> tuple[list[str], int, int]:
        return reader.policy_names(), reader.generation(), app.state.hub.publishes

    spied = AtResponseStart(app, look)
    with TestClient(spied) as client:
        r = client.post("/v1/policies", json={"name": "seed"}, headers=admin)
    assert r.status_code == 201, r.text
    # through the real middleware: committed, and the hub told, before the client has the 201
    assert spied.seen == [(201, (["seed"], before + 1, 1))]
