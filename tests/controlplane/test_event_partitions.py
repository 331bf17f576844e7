"""Raw events partitioned by day on PostgreSQL (issue 20): partitions made ahead, on demand, dropped by retention.

SQLite keeps its one table: the same calls run there and change nothing but rows.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from controlplane.app import create_app
from controlplane.db import make_sessionmaker, unit_of_work
from controlplane.models import TelemetryEventRecord, event_partition_name, utcnow
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry import service
from controlplane.telemetry.repository import TelemetryRepository, day_start
from specgate.cli import app as cli_app
from tests.support.rollup_check import assert_rollups_equal_raw
from tests.support.telemetry_bodies import event
from wire.telemetry import TelemetryEvent


def pg(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


def ingest(engine: Engine, batch_id: str, events: list[dict[str, Any]]) -> service.IngestResult:
    parsed = service.ParsedBatch(batch_id, "w-1", len(events), [TelemetryEvent.model_validate(e) for e in events], [])
    with unit_of_work(make_sessionmaker(engine)) as session:
        return service.ingest(session, parsed, sent_by="test", received_at=utcnow())


def at(n: str, when: dt.datetime, **changes: Any) -> dict[str, Any]:
    return event(n, time=when.isoformat(), **changes)


def partitions(engine: Engine) -> dict[dt.date, str]:
    with unit_of_work(make_sessionmaker(engine)) as session:
        return TelemetryRepository(session).event_partitions()


def placed(engine: Engine) -> dict[str, str]:
    """Each event's partition (PostgreSQL)."""
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT event_id, tableoid::regclass::text FROM telemetry_events")).all())


def event_ids(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(select(TelemetryEventRecord.event_id)).scalars())


def test_ensure_partitions_creates_the_missing_days_once(db: Engine) -> None:
    far = utcnow().date() + dt.timedelta(days=100)
    days = [far + dt.timedelta(days=n) for n in range(-1, 3)]
    with unit_of_work(make_sessionmaker(db)) as session:
        created = TelemetryRepository(session).ensure_partitions(far, days_ahead=2, days_behind=1)
    if not pg(db):
        assert created == []
        assert partitions(db) == {}
        return
    assert created == [event_partition_name(d) for d in days]
    with unit_of_work(make_sessionmaker(db)) as session:
        # again, and overlapping: only what is missing
        assert TelemetryRepository(session).ensure_partitions(far, days_ahead=2, days_behind=1) == []
        assert TelemetryRepository(session).ensure_partitions(far, days_ahead=3) == [
            event_partition_name(far + dt.timedelta(days=3))]
    assert {d: event_partition_name(d) for d in days}.items() <= partitions(db).items()


def test_partitions_cover_the_window_ingest_accepts(migrated_url: str) -> None:
    settings = ControlPlaneSettings(database_url=migrated_url, telemetry_max_event_age_s=7 * 86400,
                                    telemetry_retention_days=30, telemetry_max_clock_skew_s=300,
                                    telemetry_partition_days_ahead=3)
    now = dt.datetime(2026, 12, 7, 23, 58, tzinfo=dt.UTC)
    window = service.EventWindow.from_settings(settings, now)
    first, last = service.partition_days(settings, now)
    assert first <= window.earliest.date()
    assert window.latest.date() <= last
    assert (first, last) == (dt.date(2026, 11, 30), dt.date(2026, 12, 10))
    # a skew past midnight needs tomorrow whatever the days ahead; a window of years is capped (on demand beyond)
    wide = settings.model_copy(update={"telemetry_max_event_age_s": 3650 * 86400, "telemetry_retention_days": 3650,
                                       "telemetry_partition_days_ahead": 1})
    assert service.partition_days(wide, now) == (now.date() - dt.timedelta(days=service.PARTITION_DAYS_BEHIND_MAX),
                                                 dt.date(2026, 12, 8))


def test_two_replicas_creating_partitions_at_once_create_each_once(db: Engine) -> None:
    if not pg(db):
        pytest.skip("partitions are PostgreSQL's")
    far = utcnow().date() + dt.timedelta(days=200)
    barrier = threading.Barrier(4)
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def create(hold_s: float) -> None:
        try:
            with unit_of_work(make_sessionmaker(db)) as session:
                barrier.wait()
                results.append(TelemetryRepository(session).ensure_partitions(far, days_ahead=5))
                time.sleep(hold_s)  # the winner keeps its transaction (and the lock) open a while
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(0.3 if n == 0 else 0.0,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    made = [name for created in results for name in created]
    assert sorted(made) == [event_partition_name(far + dt.timedelta(days=n)) for n in range(6)]


def test_events_of_today_and_tomorrow_land_in_their_day_and_duplicates_are_dropped(db: Engine) -> None:
    now = utcnow()
    tomorrow = day_start(now.date()) + dt.timedelta(days=1, hours=1)
    first = ingest(db, "b-1", [at("today", now), at("tomorrow", tomorrow)])
    assert (first.ack.stored, first.already_stored) == (2, 0)
    # the same events again in another batch (a resent event carries its time): stored once, counted as such
    again = ingest(db, "b-2", [at("today", now), at("tomorrow", tomorrow), at("new", now)])
    assert (again.ack.stored, again.already_stored, again.ack.duplicate) == (1, 2, False)
    # and the batch itself replayed
    assert ingest(db, "b-2", [at("today", now)]).ack.duplicate is True
    assert event_ids(db) == {"ev-today", "ev-tomorrow", "ev-new"}
    if pg(db):
        assert placed(db) == {"ev-today": event_partition_name(now.date()),
                              "ev-new": event_partition_name(now.date()),
                              "ev-tomorrow": event_partition_name(tomorrow.date())}
    assert_rollups_equal_raw(db)


def test_an_event_whose_day_has_no_partition_gets_one_on_demand(db: Engine) -> None:
    now = utcnow()
    old = now - dt.timedelta(days=200)
    assert old.date() not in partitions(db)
    result = ingest(db, "b-old", [at("old", old), at("now", now), at("old-2", old + dt.timedelta(minutes=1))])
    assert (result.ack.stored, result.already_stored) == (3, 0)
    assert event_ids(db) == {"ev-old", "ev-now", "ev-old-2"}
    if pg(db):
        assert partitions(db)[old.date()] == event_partition_name(old.date())
        assert placed(db)["ev-old"] == event_partition_name(old.date())
    # the batch claim made before the failed insert stayed: a replay answers the first counts
    replay = ingest(db, "b-old", [at("old", old)])
    assert (replay.ack.duplicate, replay.ack.stored) == (True, 3)
    # and dedup holds in a partition made on demand
    assert ingest(db, "b-old-again", [at("old", old)]).already_stored == 1
    assert_rollups_equal_raw(db)


def test_retention_drops_whole_old_days_on_postgresql_and_rows_on_sqlite(
        db: Engine, settings: ControlPlaneSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    now = utcnow()
    cutoff = service.purge_cutoff(now - dt.timedelta(days=30))
    edge = cutoff - dt.timedelta(minutes=1)  # before the cutoff; on PostgreSQL maybe in the cutoff's own day
    times = {"d40": now - dt.timedelta(days=40), "d35": now - dt.timedelta(days=35), "edge": edge,
             "d2": now - dt.timedelta(days=2), "now": now}
    assert ingest(db, "b", [at(name, when, route=name) for name, when in times.items()]).ack.stored == 5
    with unit_of_work(make_sessionmaker(db)) as session:
        counts = service.purge(session, now - dt.timedelta(days=30))
    if pg(db):
        midnight = day_start(cutoff.date())
        assert counts.events_before == midnight
        gone = {name for name, when in times.items() if when < midnight}
        assert counts.partitions == tuple(sorted({event_partition_name(times[name].date()) for name in gone}))
        assert all(day_start(day) >= midnight for day in partitions(db))
    else:
        assert counts.events_before == cutoff
        assert counts.partitions == ()
        gone = {"d40", "d35", "edge"}
    assert counts.events == len(gone)
    assert event_ids(db) == {f"ev-{name}" for name in times} - {f"ev-{name}" for name in gone}
    # rollups go with their events (cut at the same point), so they still equal the raw events' aggregate
    assert_rollups_equal_raw(db)
    # a late event of a dropped day is stored all the same (its partition made again)
    assert ingest(db, "b-late", [at("late", times["d35"] + dt.timedelta(minutes=5))]).ack.stored == 1

    monkeypatch.setenv("SPECGATE_DATABASE_URL", settings.database_url)
    result = CliRunner().invoke(cli_app, ["telemetry", "purge", "--older-than-days", "30"])
    assert result.exit_code == 0, result.output
    assert "1 events" in result.output
    if pg(db):
        assert "1 day partitions dropped (telemetry_events_p" in result.output
    assert "ev-late" not in event_ids(db)


def test_the_control_plane_creates_partitions_ahead_at_start_and_then_periodically(
        settings: ControlPlaneSettings, db: Engine) -> None:
    today = utcnow().date()
    app = create_app(settings.model_copy(update={"telemetry_partition_days_ahead": 10,
                                                 "telemetry_partition_interval_s": 0.05}))
    with TestClient(app):
        if not pg(db):
            assert partitions(db) == {}
            return
        assert today + dt.timedelta(days=10) in partitions(db)
        app.state.settings = app.state.settings.model_copy(update={"telemetry_partition_days_ahead": 12})
        deadline = time.monotonic() + 10
        while today + dt.timedelta(days=12) not in partitions(db) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert today + dt.timedelta(days=12) in partitions(db)


def test_the_executemany_path_keeps_dedup_and_on_demand_partitions(db: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pg_bulk = False`` (bench/ingest.py compares the two): the same key and the same recovery."""
    monkeypatch.setattr(TelemetryRepository, "pg_bulk", False)
    monkeypatch.setattr(TelemetryRepository, "sqlite_bulk", False)
    old = utcnow() - dt.timedelta(days=300)
    assert ingest(db, "b-1", [at("old", old), at("now", utcnow())]).ack.stored == 2
    assert ingest(db, "b-2", [at("old", old)]).already_stored == 1
    if pg(db):
        assert placed(db)["ev-old"] == event_partition_name(old.date())
    assert_rollups_equal_raw(db)
