"""Hardening of the control plane (issue 16): private SQLite files, the cohort secret, the event time window,
413 for a chunked body over the limit, 503 while the database is down, generations that survive a reset."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from controlplane.app import _load_cohort_secret, create_app
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.distribution.publish import bump_generation
from controlplane.migrations_state import upgrade
from controlplane.models import FleetState
from controlplane.rollout.service import canary_salt, worker_in_canary
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry.service import EventWindow, parse_batch
from policies import RequestShape, compile_policy, load_policy
from tests.support.factories import seed_policy
from tests.support.fleet_rows import session_for
from tests.support.live import serve
from tests.support.telemetry_bodies import event
from tests.support.telemetry_data import policy_text, seed
from wire.problems import PROBLEM_MEDIA_TYPE

Headers = dict[str, str]
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _settings(url: str, **changes: Any) -> ControlPlaneSettings:
    # The suite widens the event window through the environment (tests/conftest.py); these tests set theirs.
    values: dict[str, Any] = {"database_url": url, "guardrail_interval_s": 0,
                              "telemetry_max_event_age_s": 7 * 86400, "telemetry_max_clock_skew_s": 300,
                              "telemetry_retention_days": 30}
    values.update(changes)
    return ControlPlaneSettings(**values)


def _stored_secret(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            state = session.get(FleetState, 1)
            assert state is not None
            return state.cohort_secret
    finally:
        engine.dispose()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- database files 0600 -----------------------------------------------------------------------------

@pytest.fixture
def open_umask() -> Iterator[None]:
    """The usual umask (022), under which SQLite on its own creates a world-readable database."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_a_new_sqlite_database_and_its_wal_files_are_readable_by_the_owner_only(
        tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "fresh.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    with TestClient(create_app(_settings(url)), raise_server_exceptions=False) as client:
        assert client.get("/v1/fleet").status_code == 401  # the app is up and has used the database
        siblings = [Path(f"{path}{suffix}") for suffix in ("-wal", "-shm")]
        assert all(s.exists() for s in siblings), "WAL mode keeps -wal and -shm files while the app runs"
        for file in (path, *siblings):
            assert _mode(file) == 0o600, (file.name, oct(_mode(file)))


def test_an_existing_database_keeps_its_mode_and_stale_siblings_are_tightened(
        tmp_path: Path, open_umask: None) -> None:
    existing = tmp_path / "shared.db"
    upgrade(f"sqlite:///{existing}")
    existing.chmod(0o640)  # an operator's choice (a backup group, say): not changed, and never loosened
    make_engine(f"sqlite:///{existing}").dispose()
    assert _mode(existing) == 0o640

    fresh = tmp_path / "new.db"
    stale = Path(f"{fresh}-journal")
    stale.write_bytes(b"")
    stale.chmod(0o644)
    make_engine(f"sqlite:///{fresh}").dispose()
    assert _mode(fresh) == 0o600
    assert _mode(stale) == 0o600


# --- the cohort secret -----------------------------------------------------------------------------

def test_the_canary_salt_is_keyed_by_the_cohort_secret() -> None:
    a, b = "a" * 64, "b" * 64
    assert canary_salt("r1", cohort_secret=a) == canary_salt("r1", cohort_secret=a)
    assert canary_salt("r1", cohort_secret=a) != canary_salt("r1", cohort_secret=b)
    assert canary_salt("r1", cohort_secret=a) != canary_salt("r2", cohort_secret=a)
    assert HEX64.match(canary_salt("r1", cohort_secret=a))
    assert "r1" not in canary_salt("r1", cohort_secret=a)  # nothing public a client could recompute
    workers = [f"w-{i}" for i in range(400)]
    with_a = {w for w in workers if worker_in_canary(w, "r1", 50, cohort_secret=a)}
    with_b = {w for w in workers if worker_in_canary(w, "r1", 50, cohort_secret=b)}
    assert with_a != with_b
    assert with_a == {w for w in workers if worker_in_canary(w, "r1", 50, cohort_secret=a)}


def test_the_cohort_secret_is_generated_once_and_survives_a_restart(
        migrated_url: str, admin: Headers, viewer: Headers, worker_key: Headers) -> None:
    assert _stored_secret(migrated_url) is None
    with TestClient(create_app(_settings(migrated_url)), raise_server_exceptions=False) as client:
        secret = client.app.state.cohort_secret  # type: ignore[attr-defined]
        answers = [client.get(url, headers=viewer).text
                   for url in ("/v1/killswitch", "/v1/fleet", "/v1/audit", "/v1/workers", "/v1/policies")]
        answers.append(client.get("/v1/bundle", headers=worker_key).text)
        answers.append(client.get("/openapi.json").text)
    assert HEX64.match(secret)
    assert _stored_secret(migrated_url) == secret
    assert not any(secret in text for text in answers), "the secret never leaves the control plane"
    with TestClient(create_app(_settings(migrated_url)), raise_server_exceptions=False) as client:
        assert client.app.state.cohort_secret == secret  # type: ignore[attr-defined]


def test_two_processes_starting_on_one_database_agree_on_the_secret(migrated_url: str) -> None:
    apps = [create_app(_settings(migrated_url)) for _ in range(4)]
    barrier = threading.Barrier(len(apps))
    got: list[str] = []

    def start(app: Any) -> None:
        barrier.wait()
        got.append(_load_cohort_secret(app))

    threads = [threading.Thread(target=start, args=(app,)) for app in apps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for app in apps:
        app.state.engine.dispose()
    assert len(got) == len(apps)
    assert len(set(got)) == 1
    assert _stored_secret(migrated_url) == got[0]


def test_dry_runs_decide_exploration_with_the_fleets_secret(client: TestClient, viewer: Headers,
                                                             settings: ControlPlaneSettings) -> None:
    (rid,) = seed(settings.database_url, policy_text())
    secret = client.app.state.cohort_secret  # type: ignore[attr-defined]
    doc = load_policy(policy_text())
    with_secret = compile_policy(doc, rid, cohort_secret=secret)
    public = compile_policy(doc, rid)
    shapes = [{"route": "code", "batch_size": 8, "request_id": f"req-{i}"} for i in range(400)]
    expected = [with_secret.decide(RequestShape.from_dict(s)).explored for s in shapes]
    assert expected != [public.decide(RequestShape.from_dict(s)).explored for s in shapes]
    r = client.post(f"/v1/revisions/{rid}/evaluate", json={"shapes": shapes}, headers=viewer)
    assert r.status_code == 200, r.text
    assert [x["decision"]["explored"] for x in r.json()] == expected


# --- the event time window ---------------------------------------------------------------------------

def _event(n: int, time: dt.datetime) -> dict[str, Any]:
    return event(n, event_id=f"win-{n}", time=time.isoformat())


def _post_batch(client: TestClient, headers: Headers, batch_id: str, events: list[Any]) -> httpx.Response:
    body = {"batch_id": batch_id, "worker_id": "w-1", "schema_version": 1, "events": events}
    return client.post("/v1/telemetry/batches", content=gzip.compress(json.dumps(body).encode()),
                       headers={**headers, "Content-Type": "application/json", "Content-Encoding": "gzip"})


@pytest.mark.parametrize("with_a_malformed_event", [False, True], ids=["one-pass", "event-by-event"])
def test_events_dated_outside_the_window_are_refused_one_by_one(
        migrated_url: str, worker_key: Headers, with_a_malformed_event: bool) -> None:
    now = dt.datetime.now(dt.UTC)
    events: list[Any] = [
        _event(0, now - dt.timedelta(minutes=1)),
        _event(1, now - dt.timedelta(days=8)),         # older than the 7 days
        _event(2, now + dt.timedelta(days=365)),       # far in the future: retention would never purge it
        _event(3, now + dt.timedelta(minutes=1)),      # within the 5 minutes of clock skew
        _event(4, now - dt.timedelta(days=6)),
        _event(5, now + dt.timedelta(minutes=10)),     # past the skew
    ]
    if with_a_malformed_event:
        events.append({"event_id": "broken"})
    seed_policy(migrated_url)  # the policy the events name
    with TestClient(create_app(_settings(migrated_url)), raise_server_exceptions=False) as client:
        r = _post_batch(client, worker_key, f"window-{with_a_malformed_event}", events)
    assert r.status_code == 200, r.text
    ack = r.json()
    assert (ack["accepted"], ack["stored"]) == (3, 3)
    by_index = {x["index"]: x["errors"] for x in ack["rejected"]}
    assert ack["rejected_count"] == len(by_index) == 3 + with_a_malformed_event
    for index in (1, 2, 5):
        assert [(e["path"], e["code"]) for e in by_index[index]] == [("time", "out_of_range")]
    assert "SPECGATE_TELEMETRY_MAX_EVENT_AGE_S" in by_index[1][0]["message"]
    assert "SPECGATE_TELEMETRY_MAX_CLOCK_SKEW_S" in by_index[5][0]["message"]


def test_the_window_never_reaches_past_retention() -> None:
    received = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.UTC)
    window = EventWindow.around(received, max_age_s=7 * 86400, max_skew_s=300, retention_days=2)
    assert window.earliest == received - dt.timedelta(days=2)
    assert window.latest == received + dt.timedelta(minutes=5)
    three_days_old = json.dumps({"batch_id": "b", "worker_id": "w-1", "events": [
        _event(0, received - dt.timedelta(days=3)), _event(1, received - dt.timedelta(days=1))]}).encode()
    parsed = parse_batch(three_days_old, window)
    assert [e.event_id for e in parsed.events] == ["win-1"]
    assert [(r.index, r.errors[0].path) for r in parsed.rejected] == [(0, "time")]
    defaults = ControlPlaneSettings(_env_file=None, telemetry_max_event_age_s=7 * 86400,  # type: ignore[call-arg]
                                    telemetry_max_clock_skew_s=300, telemetry_retention_days=30)
    assert EventWindow.from_settings(defaults, received).earliest == received - dt.timedelta(days=7)


def test_the_window_defaults_are_a_week_back_and_five_minutes_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SPECGATE_TELEMETRY_MAX_EVENT_AGE_S", "SPECGATE_TELEMETRY_MAX_CLOCK_SKEW_S",
                 "SPECGATE_TELEMETRY_RETENTION_DAYS"):
        monkeypatch.delenv(name, raising=False)
    settings = ControlPlaneSettings()
    assert (settings.telemetry_max_event_age_s, settings.telemetry_max_clock_skew_s) == (7 * 86400, 300)
    assert settings.telemetry_max_event_age_s <= settings.telemetry_retention_days * 86400
    monkeypatch.setenv("SPECGATE_TELEMETRY_MAX_CLOCK_SKEW_S", "-1")
    with pytest.raises(ValueError, match="telemetry_max_clock_skew_s"):
        ControlPlaneSettings()


# --- a chunked body over the limit ---------------------------------------------------------------------

def _chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        sent += n
        yield b" " * n


def _assert_413(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    assert r.headers["content-type"].startswith(PROBLEM_MEDIA_TYPE)
    problem = r.json()
    assert problem["status"] == 413
    assert problem["type"].endswith("payload-too-large")


@pytest.mark.parametrize("url", ["/v1/policies", "/v1/telemetry/batches"])
def test_a_chunked_body_over_the_limit_is_413(client: TestClient, admin: Headers, worker_key: Headers,
                                              url: str) -> None:
    headers = {**(worker_key if "telemetry" in url else admin), "Content-Type": "application/json"}
    r = client.post(url, content=_chunks(2 * 1024 * 1024), headers=headers)
    assert "content-length" not in {k.lower() for k in r.request.headers}
    _assert_413(r)
    # Within the limit, the same chunked upload is read and judged on its content.
    small = client.post(url, content=_chunks(1000), headers=headers)
    assert small.status_code == 422, small.text


def test_a_chunked_body_over_the_limit_is_413_from_a_real_server(settings: ControlPlaneSettings,
                                                                  admin: Headers) -> None:
    with serve(create_app(settings)) as base, httpx.Client(base_url=base, timeout=30) as http:
        r = http.post("/v1/policies", content=_chunks(2 * 1024 * 1024),
                      headers={**admin, "Content-Type": "application/json"})
    _assert_413(r)


# --- the database down -----------------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith(PROBLEM_MEDIA_TYPE)
    assert int(r.headers["retry-after"]) > 0
    problem = r.json()
    assert problem["status"] == 503
    assert problem["type"].endswith("database-unavailable")
    assert "Traceback" not in r.text


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
def test_an_unreachable_database_answers_503_problem(kind: str, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    admin = {"Authorization": "Bearer sgk_" + "0" * 40}  # looking the key up needs the database
    url = (f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/test?connect_timeout=2" if kind == "postgresql"
           else f"sqlite:///{tmp_path / 'no-such-dir' / 'specgate.db'}")
    # No lifespan: a control plane that started, then lost its database.
    client = TestClient(create_app(_settings(url)), raise_server_exceptions=True)
    with caplog.at_level("ERROR", logger="specgate.controlplane"):
        for _ in range(3):
            _assert_503(client.get("/v1/policies", headers=admin))
        _assert_503(client.post("/v1/telemetry/batches", json={}, headers=admin))
    logged = [r for r in caplog.records if "database is unavailable" in r.getMessage()]
    assert len(logged) <= 1, "one line per outage, not one per request"


def test_losing_the_database_while_running_answers_503_and_recovers(migrated_url: str, admin: Headers) -> None:
    app = create_app(_settings(migrated_url))
    with TestClient(app, raise_server_exceptions=True) as client:
        assert client.get("/v1/policies", headers=admin).status_code == 200
        working = app.state.sessions
        dead = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/test?connect_timeout=2")
        try:
            app.state.sessions = make_sessionmaker(dead)
            _assert_503(client.get("/v1/policies", headers=admin))
        finally:
            app.state.sessions = working
            dead.dispose()
        assert client.get("/v1/policies", headers=admin).status_code == 200


def test_the_kill_switch_row_is_untouched_by_the_secret(migrated_url: str) -> None:
    # The secret is written by a conditional UPDATE of its column alone: a kill switch set before the first
    # start stays set.
    engine = make_engine(migrated_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            session.execute(update(FleetState).where(FleetState.id == 1).values(kill_switch=True, generation=41))
        with TestClient(create_app(_settings(migrated_url)), raise_server_exceptions=False):
            pass
        with engine.connect() as conn:
            row = conn.execute(select(FleetState.kill_switch, FleetState.generation)).one()
    finally:
        engine.dispose()
    assert tuple(row) == (True, 41)


def test_keyed_operations_declare_the_503(tmp_path: Path) -> None:
    openapi = create_app(_settings(f"sqlite:///{tmp_path / 'unused.db'}")).openapi()
    for path, method in (("/v1/policies", "get"), ("/v1/telemetry/batches", "post"), ("/v1/bundle", "get")):
        declared = openapi["paths"][path][method]["responses"]
        assert "503" in declared, (path, method)
        assert PROBLEM_MEDIA_TYPE in declared["503"]["content"]



# -- generations keep increasing across a database reset --------------------------------------------

def test_a_new_database_starts_its_generations_at_the_clock(database_url: str) -> None:
    # Sidecars refuse generations below the last they accepted: a reset database must not start at 0.
    before_ms = time.time_ns() // 1_000_000
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            first = int(session.scalar(select(FleetState.generation).where(FleetState.id == 1)) or 0)
            assert first >= before_ms
            after_ms = time.time_ns() // 1_000_000
            bumped = bump_generation(session)
            # one step up, or the clock if that is further: never back, never below the clock
            assert bumped >= max(first + 1, after_ms)
            assert bumped <= max(first + 1, time.time_ns() // 1_000_000)
    finally:
        engine.dispose()


def _generation(url: str) -> int:
    with session_for(url) as session:
        return int(session.scalar(select(FleetState.generation)) or 0)


def _restore_generation(url: str, value: int) -> None:
    with session_for(url) as session:
        session.execute(update(FleetState).where(FleetState.id == 1).values(generation=value))


def test_a_database_restored_from_a_backup_issues_generations_above_what_sidecars_accepted(
        client: TestClient, operator: dict[str, str], migrated_url: str) -> None:
    # What sidecars accepted before the restore: the generation of a change made now.
    r = client.put("/v1/killswitch", headers=operator, json={"enabled": True, "reason": "before the backup"})
    assert r.status_code == 200, r.text
    high_water = _generation(migrated_url)
    _restore_generation(migrated_url, 41)  # the backup's generation, from long ago
    r = client.put("/v1/killswitch", headers=operator, json={"enabled": False, "reason": "after the restore"})
    assert r.status_code == 200, r.text
    # Before the fix the restored database went on from 41: every sidecar refused the change as a replay.
    assert _generation(migrated_url) > high_water


def test_generation_raise_moves_past_a_sidecars_high_water_and_is_audited(migrated_url: str) -> None:
    from typer.testing import CliRunner

    from controlplane.models import AuditEvent
    from specgate.cli import app as cli_app

    env = {"SPECGATE_DATABASE_URL": migrated_url}
    # A sidecar reports a high-water mark from a clock that ran ahead: the floor alone would not pass it.
    ahead = time.time_ns() // 1_000_000 + 3_600_000
    result = CliRunner().invoke(cli_app, ["generation", "raise", "--at-least", str(ahead), "--reason", "restore"],
                                env=env)
    assert result.exit_code == 0, result.output
    assert _generation(migrated_url) == ahead
    assert f"-> {ahead}" in result.output
    shown = CliRunner().invoke(cli_app, ["generation", "show"], env=env)
    assert shown.exit_code == 0
    assert shown.output.strip() == str(ahead)
    # again: one more, never the same generation twice
    assert CliRunner().invoke(cli_app, ["generation", "raise"], env=env).exit_code == 0
    assert _generation(migrated_url) == ahead + 1
    engine = make_engine(migrated_url)
    try:
        with make_sessionmaker(engine)() as session:
            audits = session.scalars(select(AuditEvent).where(AuditEvent.action == "generation.raise")
                                     .order_by(AuditEvent.id)).all()
    finally:
        engine.dispose()
    assert [(a.actor, a.after, a.reason) for a in audits] == [
        ("cli:local", {"generation": ahead}, "restore"), ("cli:local", {"generation": ahead + 1}, "")]
    refused = CliRunner().invoke(cli_app, ["generation", "raise", "--at-least", "-1"], env=env)
    assert refused.exit_code == 2
    assert "at-least" in refused.output
