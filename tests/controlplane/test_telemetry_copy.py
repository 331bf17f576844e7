"""Raw events by COPY on PostgreSQL (issue 20): stored once, the ids returned exact, partitions on demand.

COPY has no ``ON CONFLICT``: it stores a whole batch or fails, and a batch that resends a stored event goes
through the JSON ``ON CONFLICT`` statement instead. These tests hold the COPY path (the default) and the JSON
path it replaced (``pg_event_path = "json"``, bench/ingest.py's comparison) to the same results; SQLite has
its own bulk path, and every test runs there too.
"""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import Engine

from bench.ingest_server import use_ingest_path
from controlplane.db import make_sessionmaker, unit_of_work
from controlplane.models import TelemetryEventRecord, event_partition_name, utcnow
from controlplane.telemetry import service
from controlplane.telemetry.repository import EVENT_COLUMNS, TelemetryRepository
from tests.support.rollup_check import assert_rollups_equal_raw
from tests.support.telemetry_bodies import event, random_event
from wire.telemetry import TelemetryEvent


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often each raw-event insert ran: ``copy`` (binary COPY) and ``statement`` (any other), and how
    often a COPY failed."""
    counts = {"copy": 0, "copy_failed": 0, "statement": 0}
    copy, statement = TelemetryRepository._copy_events, TelemetryRepository._insert_events

    def counted_copy(self: TelemetryRepository, *args: Any, **kwargs: Any) -> set[str]:
        counts["copy"] += 1
        try:
            return copy(self, *args, **kwargs)
        except Exception:
            counts["copy_failed"] += 1
            raise

    def counted_statement(self: TelemetryRepository, *args: Any, **kwargs: Any) -> set[str]:
        counts["statement"] += 1
        return statement(self, *args, **kwargs)

    monkeypatch.setattr(TelemetryRepository, "_copy_events", counted_copy)
    monkeypatch.setattr(TelemetryRepository, "_insert_events", counted_statement)
    return counts


def pg(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


def parsed(batch_id: str, events: list[dict[str, Any]]) -> service.ParsedBatch:
    return service.ParsedBatch(batch_id, "w-1", len(events), [TelemetryEvent.model_validate(e) for e in events], [])


def ingest(engine: Engine, batch_id: str, events: list[dict[str, Any]]) -> service.IngestResult:
    with unit_of_work(make_sessionmaker(engine)) as session:
        return service.ingest(session, parsed(batch_id, events), sent_by="test", received_at=utcnow())


def insert(engine: Engine, batch_id: str, events: list[dict[str, Any]]) -> set[str]:
    """``insert_events`` itself, in a transaction of its own: the ids it says it inserted."""
    valid = sorted((TelemetryEvent.model_validate(e) for e in events), key=lambda e: e.event_id)
    with unit_of_work(make_sessionmaker(engine)) as session:
        return TelemetryRepository(session).insert_events(valid, batch_id=batch_id, received_at=utcnow())


def stored(engine: Engine) -> dict[str, str]:
    """Each stored event's batch."""
    with engine.connect() as conn:
        return dict(conn.execute(select(TelemetryEventRecord.event_id, TelemetryEventRecord.batch_id)).all())


# One time for every event of a test run: a resent event carries its time (the key is (event_id, time)).
NOW = utcnow() - dt.timedelta(minutes=1)


def now_event(n: int | str, **changes: Any) -> dict[str, Any]:
    return event(n, time=NOW.isoformat(), **changes)


def test_copy_is_the_default_and_stores_every_field_as_sent(db: Engine, calls: dict[str, int]) -> None:
    assert TelemetryRepository.pg_event_path == "copy"
    when = utcnow().replace(microsecond=250_000)
    offset = event("offset", time=when.astimezone(dt.timezone(dt.timedelta(hours=2))).isoformat(),
                   structured_valid=True, fallback_reason="read_timeout", ttft_ms=None, spec_draft_tokens=None,
                   status="client_disconnect", http_status=None, max_tokens=None, replica="r-1",
                   labels='{"tenant":"ä"}', shadow_match=False, shadow_first_diff=17, shadow_structured_valid=False,
                   shadow_check_passed=False, shadow_check_reason="a tab\there, a newline\nthere, é" * 3)
    assert ingest(db, "b-1", [offset, now_event("plain")]).ack.stored == 2
    # COPY on PostgreSQL, once, and nothing else; SQLite's own path there
    assert calls == ({"copy": 1, "copy_failed": 0, "statement": 0} if pg(db)
                     else {"copy": 0, "copy_failed": 0, "statement": 1})
    with db.connect() as conn:
        row = conn.execute(select(TelemetryEventRecord.__table__)
                           .where(TelemetryEventRecord.event_id == "ev-offset")).mappings().one()
    expected = TelemetryEvent.model_validate(offset).model_dump()
    for name in EVENT_COLUMNS:
        if name != "time":
            assert row[name] == expected[name], name
    assert row["time"] == when
    assert row["batch_id"] == "b-1"
    assert_rollups_equal_raw(db)


def test_an_event_sent_again_in_another_batch_is_stored_once_through_the_fallback(
        db: Engine, calls: dict[str, int]) -> None:
    first = ingest(db, "b-1", [now_event(1), now_event(2)])
    assert (first.ack.stored, first.already_stored) == (2, 0)
    second = ingest(db, "b-2", [now_event(2), now_event(3), now_event(3), now_event(4)])
    assert (second.ack.accepted, second.ack.stored, second.already_stored) == (4, 2, 2)
    assert stored(db) == {"ev-1": "b-1", "ev-2": "b-1", "ev-3": "b-2", "ev-4": "b-2"}
    if pg(db):  # the second COPY met ev-2, rolled back to its savepoint, and the statement decided
        assert calls == {"copy": 2, "copy_failed": 1, "statement": 1}
    # a batch of nothing but stored events stores nothing
    assert ingest(db, "b-3", [now_event(1), now_event(4)]).ack.stored == 0
    assert_rollups_equal_raw(db)


def test_the_ids_returned_are_exactly_those_inserted(db: Engine) -> None:
    assert insert(db, "b-1", [now_event(n) for n in (1, 2, 3)]) == {"ev-1", "ev-2", "ev-3"}
    assert insert(db, "b-2", [now_event(n) for n in (3, 4, 1, 5)]) == {"ev-4", "ev-5"}
    assert insert(db, "b-3", [now_event(n) for n in (5, 4)]) == set()
    assert insert(db, "b-4", [now_event(6)]) == {"ev-6"}
    assert stored(db) == {"ev-1": "b-1", "ev-2": "b-1", "ev-3": "b-1", "ev-4": "b-2", "ev-5": "b-2", "ev-6": "b-4"}


def test_a_missing_partition_is_made_on_demand_on_the_copy_path(db: Engine, calls: dict[str, int]) -> None:
    old = utcnow() - dt.timedelta(days=200)
    result = ingest(db, "b-old", [event("old", time=old.isoformat()), now_event("now")])
    assert (result.ack.stored, result.already_stored) == (2, 0)
    if pg(db):  # the first COPY found no partition for the old day; the second, after it was made, went in
        assert calls == {"copy": 2, "copy_failed": 1, "statement": 0}
        with db.connect() as conn:
            where = conn.execute(text("SELECT tableoid::regclass::text FROM telemetry_events "
                                      "WHERE event_id = 'ev-old'")).scalar_one()
        assert where == event_partition_name(old.date())
    # a missing partition and a stored event in one batch: both handled, each event once
    older = utcnow() - dt.timedelta(days=300)
    mixed = ingest(db, "b-mixed", [now_event("now"), event("older", time=older.isoformat()), now_event("new")])
    assert (mixed.ack.stored, mixed.already_stored) == (2, 1)
    assert set(stored(db)) == {"ev-old", "ev-now", "ev-older", "ev-new"}
    assert_rollups_equal_raw(db)


@pytest.mark.parametrize("path", ["copy", "json", "generic"])
def test_rollups_equal_the_raw_events_on_each_path(db: Engine, path: str, monkeypatch: pytest.MonkeyPatch,
                                                   calls: dict[str, int]) -> None:
    """Overlapping batches (the fallback on every other one), batches replayed: on each path the switch
    selects, the rollups equal the raw events and each answer counts exactly what it stored."""
    for name in ("pg_bulk", "sqlite_bulk", "pg_event_path"):
        monkeypatch.setattr(TelemetryRepository, name, getattr(TelemetryRepository, name))  # restored after
    use_ingest_path(path)
    rng = random.Random(20)
    pool = [random_event(rng, n, utcnow() - dt.timedelta(minutes=30)) for n in range(600)]
    seen: set[str] = set()
    for k in range(0, 600, 60):
        batch = pool[k:k + 60] + (rng.sample(pool[:k], 5) if k and rng.random() < 0.5 else [])
        result = ingest(db, f"b-{k}", batch)
        ids = {e["event_id"] for e in batch}
        assert result.ack.stored == len(ids - seen)
        seen |= ids
        assert ingest(db, f"b-{k}", batch).ack.duplicate is True
    assert set(stored(db)) == {e["event_id"] for e in pool}
    assert_rollups_equal_raw(db)
    if pg(db):
        assert (calls["copy"] > 0) == (path == "copy")
        assert (calls["copy_failed"] > 0) == (path == "copy")
