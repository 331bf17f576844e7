"""Every SQL statement of the telemetry store.

Writes are dialect-specific upserts (``INSERT ... ON CONFLICT``), the same
statements on SQLite and PostgreSQL. On PostgreSQL the rows of a batch travel
as ONE JSON parameter per statement, unpacked by the server
(``INSERT ... SELECT ... FROM json_populate_recordset(...)``): serializing a
batch is one call into pydantic-core or the C json encoder, where binding
tens of thousands of parameters row by row (SQLAlchemy's executemany) costs
more than the database's own work. Raw events go by binary ``COPY`` instead
(see :meth:`TelemetryRepository.insert_events`): about half the database's
CPU per event of the JSON statement, which stays as the fallback and, with
``TelemetryRepository.pg_event_path = "json"``, as the comparison.
``TelemetryRepository.pg_bulk = False`` switches back to the executemany
statements (bench/ingest.py compares the three).

On PostgreSQL ``telemetry_events`` is partitioned by UTC day of ``time``
(migration ``20261207_0005``): its key is ``(event_id, time)``, so the event
upserts name both; partitions are created ahead (:meth:`TelemetryRepository.ensure_partitions`)
and retention drops them whole. SQLite keeps one table keyed by ``event_id``.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Integer,
    Table,
    cast,
    delete,
    func,
    or_,
    select,
    text,
    type_coerce,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from analysis.rollup import COUNTERS, FLOAT_COUNTERS, KEY_FIELDS, RollupKey
from controlplane.models import (
    EVENT_PARTITION_PREFIX,
    Policy,
    TelemetryBatchRecord,
    TelemetryDeltaRecord,
    TelemetryEventRecord,
    TelemetryRollup,
    TelemetryRollupHistogram,
    event_partition_name,
    is_event_partition,
)
from wire.telemetry import TelemetryEvent

BATCHES: Table = TelemetryBatchRecord.__table__  # type: ignore[assignment]
DELTAS: Table = TelemetryDeltaRecord.__table__  # type: ignore[assignment]
EVENTS: Table = TelemetryEventRecord.__table__  # type: ignore[assignment]
ROLLUPS: Table = TelemetryRollup.__table__  # type: ignore[assignment]
HISTOGRAMS: Table = TelemetryRollupHistogram.__table__  # type: ignore[assignment]

# The columns an event fills, in table order; batch_id and received_at are the batch's.
EVENT_COLUMNS: tuple[str, ...] = tuple(c.name for c in EVENTS.columns if c.name not in ("batch_id", "received_at"))


_row_of = attrgetter(*EVENT_COLUMNS)
# A validated event's fields are plain entries of its __dict__: a C itemgetter there costs a fraction of the
# attribute lookups (the COPY path builds ~500 rows of ~50 values per batch).
_values_of = itemgetter(*EVENT_COLUMNS)
_EVENTS_JSON = TypeAdapter(list[TelemetryEvent])


def _columns(names: Sequence[str], prefix: str = "") -> str:
    return ", ".join(f'{prefix}"{name}"' for name in names)


# Column names come from the models; every value is a parameter.
_PG_EVENT_INSERT = (
    f"INSERT INTO telemetry_events ({_columns(EVENT_COLUMNS)}, batch_id, received_at) "  # noqa: S608
    f"SELECT {_columns(EVENT_COLUMNS, 'r.')}, %s, %s "
    "FROM json_populate_recordset(NULL::telemetry_events, %s::json) AS r "
    # the partitioned table's key (see the module docstring): a resent event has the same time
    "ON CONFLICT (event_id, time) DO NOTHING RETURNING event_id"
)
_PG_EVENT_COPY = (
    f"COPY telemetry_events ({_columns(EVENT_COLUMNS)}, batch_id, received_at) FROM STDIN (FORMAT BINARY)"
)
_PG_COPY_TYPES = {"BOOLEAN": "bool", "INTEGER": "int4", "BIGINT": "int8", "FLOAT": "float8",
                  "DOUBLE PRECISION": "float8", "VARCHAR": "varchar", "TEXT": "text",
                  "TIMESTAMP WITH TIME ZONE": "timestamptz"}


def _pg_copy_types() -> list[str]:
    """The PostgreSQL type of each COPY column, for binary COPY (which sends no type names of its own)."""
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    names = (*EVENT_COLUMNS, "batch_id", "received_at")
    return [_PG_COPY_TYPES[EVENTS.c[name].type.compile(dialect=dialect).split("(")[0]] for name in names]


_PG_EVENT_COPY_TYPES = _pg_copy_types()
_PG_ROLLUP_UPSERT = (
    f"INSERT INTO telemetry_rollups ({_columns(KEY_FIELDS + COUNTERS)}) "  # noqa: S608
    f"SELECT {_columns(KEY_FIELDS + COUNTERS, 'r.')} "
    "FROM json_populate_recordset(NULL::telemetry_rollups, %s::json) AS r "
    f"ON CONFLICT ({_columns(KEY_FIELDS)}) DO UPDATE SET "
    + ", ".join(f'"{c}" = telemetry_rollups."{c}" + excluded."{c}"' for c in COUNTERS)
    + f" RETURNING id, {_columns(KEY_FIELDS)}"
)
_SQLITE_EVENT_INSERT = (
    f"INSERT INTO telemetry_events ({_columns(EVENT_COLUMNS)}, batch_id, received_at) "  # noqa: S608
    f"VALUES ({', '.join('?' * (len(EVENT_COLUMNS) + 2))}) ON CONFLICT (event_id) DO NOTHING"
)
_PG_HISTOGRAM_UPSERT = (
    "INSERT INTO telemetry_rollup_histograms (rollup_id, metric, bucket, count) "
    "SELECT (e->>0)::bigint, e->>1, (e->>2)::int, (e->>3)::bigint FROM json_array_elements(%s::json) AS e "
    "ON CONFLICT (rollup_id, metric, bucket) DO UPDATE "
    "SET count = telemetry_rollup_histograms.count + excluded.count"
)


@dataclass(frozen=True, slots=True)
class RollupFilter:
    """Which rollup rows a read covers: ``start <= minute < end`` and equal key fields."""

    policy: str | None = None
    revision: str | None = None
    route: str | None = None
    engine: str | None = None
    explored: bool | None = None
    k0: bool | None = None
    start: dt.datetime | None = None
    end: dt.datetime | None = None


@dataclass(frozen=True, slots=True)
class PurgeCounts:
    events: int
    rollups: int
    histogram_rows: int
    batches: int
    # Where events and rollups were cut: the cutoff asked for on SQLite, its day (UTC midnight) on PostgreSQL,
    # whose events go by whole day partitions. Batch records are always cut at the cutoff asked for.
    events_before: dt.datetime | None = None
    # PostgreSQL: the day partitions of telemetry_events dropped (their events are counted in ``events``).
    partitions: tuple[str, ...] = ()


# The transaction-level advisory lock that serialises creating event partitions (several control-plane
# replicas, and ingest creating a missing one on demand): the check of what exists is repeated under it.
PARTITION_LOCK_KEY = 0x53470002


def day_start(day: dt.date) -> dt.datetime:
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)


def _missing_partition(exc: BaseException) -> bool:
    """Whether a PostgreSQL error says a row's day has no partition (SQLSTATE 23514, check_violation)."""
    orig = getattr(exc, "orig", None) or exc
    return getattr(orig, "sqlstate", None) == "23514" and "no partition of relation" in str(orig)


def _copy_conflict(exc: BaseException) -> bool:
    """Whether COPY failed on an event id already stored (23505, unique_violation) or lost a deadlock on
    one against another batch's COPY (40P01): either way the ON CONFLICT statement decides."""
    orig = getattr(exc, "orig", None) or exc
    return getattr(orig, "sqlstate", None) in ("23505", "40P01")


class TelemetryRepository:
    # PostgreSQL: each write is one statement for the whole batch (raw events: see pg_event_path; rollups and
    # histograms: their rows as one JSON parameter). False uses the dialect-neutral executemany upserts there
    # too (bench/ingest.py compares them).
    pg_bulk = True
    # PostgreSQL, with pg_bulk: how raw events go in. "copy": binary COPY, falling back to the JSON statement
    # for a batch that resends a stored event; "json": the JSON statement always (bench/ingest.py compares).
    pg_event_path = "copy"
    # SQLite: driver executemany for raw events (see _sqlite_insert_events); False: SQLAlchemy's statement.
    sqlite_bulk = True

    def __init__(self, session: Session) -> None:
        self.session = session

    def policies_serving(self, pools: Collection[str]) -> dict[str | None, str]:
        """The policy of each of ``pools`` that has one, and the pool-less policy under None."""
        rows = self.session.execute(select(Policy.pool, Policy.name)
                                    .where(or_(Policy.pool.in_(list(pools)), Policy.pool.is_(None))))
        return {pool: name for pool, name in rows}

    @property
    def _conn(self) -> Connection:
        return self.session.connection()

    def _raw_cursor(self) -> Any:
        """A cursor of the driver connection, inside this session's transaction (the bulk paths)."""
        raw = self._conn.connection.dbapi_connection
        assert raw is not None
        return raw.cursor()

    def _insert(self, table: Table) -> Any:
        if self._conn.dialect.name == "postgresql":
            return pg_insert(table)
        return sqlite_insert(table)

    # -- ingest --------------------------------------------------------------------------------------

    def claim_batch(self, record: Mapping[str, Any]) -> bool:
        """Insert the batch's idempotency row; False when the batch id is already there.

        The first statement of the ingest transaction: on SQLite it takes the
        write lock before anything is read; on PostgreSQL a concurrent
        transaction with the same id waits here until this one ends.
        """
        stmt = (self._insert(BATCHES).values(**record)
                .on_conflict_do_nothing(index_elements=["batch_id"]).returning(BATCHES.c.batch_id))
        return self._conn.execute(stmt).first() is not None

    def batch(self, batch_id: str) -> TelemetryBatchRecord | None:
        return self.session.get(TelemetryBatchRecord, batch_id, populate_existing=True)

    def set_batch_stored(self, batch_id: str, stored: int, rollups_stored: int = 0) -> None:
        self._conn.execute(BATCHES.update().where(BATCHES.c.batch_id == batch_id)
                           .values(stored=stored, rollups_stored=rollups_stored))

    def record_deltas(self, worker_id: str, deltas: Sequence[tuple[str, dt.datetime]], *, batch_id: str,
                      received_at: dt.datetime) -> set[str]:
        """Record ``(delta_id, minute)`` of a worker's rollup deltas; returns the ids recorded now (the others
        were added before). Ids must be distinct and sorted (one lock order for concurrent ingests)."""
        if not deltas:
            return set()
        rows = [{"worker_id": worker_id, "delta_id": delta_id, "minute": minute, "batch_id": batch_id,
                 "received_at": received_at} for delta_id, minute in deltas]
        stmt = (self._insert(DELTAS).on_conflict_do_nothing(index_elements=["worker_id", "delta_id"])
                .returning(DELTAS.c.delta_id))
        return {r[0] for r in self._conn.execute(stmt, rows)}

    def _pg_bulk(self) -> bool:
        return self.pg_bulk and self._conn.dialect.name == "postgresql"

    def _partitioned(self) -> bool:
        """Whether telemetry_events is partitioned by day: on PostgreSQL, at migration head."""
        return self._conn.dialect.name == "postgresql"

    def _raw_execute(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Run on the driver connection, inside this session's transaction; the rows it returns."""
        cursor = self._raw_cursor()
        try:
            cursor.execute(sql, params)
            return list(cursor.fetchall()) if cursor.description is not None else []
        finally:
            cursor.close()

    def insert_events(self, events: Sequence[TelemetryEvent], *, batch_id: str,
                      received_at: dt.datetime) -> set[str]:
        """Insert events; returns the ids actually inserted.

        An event id already stored is skipped (``ON CONFLICT DO NOTHING``; on PostgreSQL the key is
        ``(event_id, time)``, and a resent event has its time). Events with equal ids must not both be
        given. Times must be in UTC.

        PostgreSQL: an event whose day has no partition (the control plane creates them ahead, so only
        when that failed, or a purge dropped a day that ingest still accepts) would fail the whole
        statement. The insert runs in a savepoint; on that error the missing days are created in this
        transaction (:meth:`ensure_partition_days`, under the partition lock) and the insert runs again,
        so no event is lost to a missing partition. A DEFAULT partition would catch such rows instead,
        but every later partition of a day it holds rows of could then not be created.

        PostgreSQL, ``pg_event_path = "copy"``: the events go in by binary COPY, optimistically (a batch
        rarely resends an event stored before): COPY has no ``ON CONFLICT``, so it stores every event or
        fails whole, and when it fails on a stored id (or on a deadlock with another batch's COPY of the
        same ids) the savepoint is rolled back and the batch goes through the JSON ``ON CONFLICT``
        statement instead. Either way the ids returned are exactly those this transaction inserted.
        """
        if not events:
            return set()
        if not self._partitioned():
            return self._insert_events(events, batch_id=batch_id, received_at=received_at)
        copy = self._pg_bulk() and self.pg_event_path == "copy"
        partitions_made = False
        while True:  # at most three tries: each failure handled switches one thing, once
            try:
                with self.session.begin_nested():
                    if copy:
                        return self._copy_events(events, batch_id=batch_id, received_at=received_at)
                    return self._insert_events(events, batch_id=batch_id, received_at=received_at)
            except Exception as exc:
                if not partitions_made and _missing_partition(exc):
                    self.ensure_partition_days({event.time.date() for event in events})
                    partitions_made = True
                elif copy and _copy_conflict(exc):
                    copy = False
                else:
                    raise

    def _copy_events(self, events: Sequence[TelemetryEvent], *, batch_id: str,
                     received_at: dt.datetime) -> set[str]:
        """PostgreSQL: binary COPY of every event (all stored, or an error); returns their ids.

        Rows, not JSON: the database parses no text, and psycopg's C formatter packs each value. Rows go
        in the order given (sorted by id), so concurrent batches meet on their common ids in one order.
        """
        cursor = self._raw_cursor()
        try:
            with cursor.copy(_PG_EVENT_COPY) as copy:
                copy.set_types(_PG_EVENT_COPY_TYPES)
                write = copy.write_row
                for event in events:
                    write((*_values_of(event.__dict__), batch_id, received_at))
        finally:
            cursor.close()
        return {event.event_id for event in events}

    def _insert_events(self, events: Sequence[TelemetryEvent], *, batch_id: str,
                       received_at: dt.datetime) -> set[str]:
        if self._pg_bulk():
            payload = _EVENTS_JSON.dump_json(list(events)).decode()
            return {r[0] for r in self._raw_execute(_PG_EVENT_INSERT, [batch_id, received_at, payload])}
        if self.sqlite_bulk and self._conn.dialect.name == "sqlite":
            return self._sqlite_insert_events(events, batch_id=batch_id, received_at=received_at)
        params = [{**dict(zip(EVENT_COLUMNS, _row_of(e), strict=True)), "batch_id": batch_id,
                   "received_at": received_at} for e in events]
        key = ["event_id", "time"] if self._partitioned() else ["event_id"]
        stmt = (self._insert(EVENTS).on_conflict_do_nothing(index_elements=key)
                .returning(EVENTS.c.event_id))
        return {r[0] for r in self._conn.execute(stmt, params)}

    def _sqlite_insert_events(self, events: Sequence[TelemetryEvent], *, batch_id: str,
                              received_at: dt.datetime) -> set[str]:
        """SQLite: the ids already stored are looked up, the rest inserted with the driver's executemany.

        Exact because this transaction holds SQLite's write lock (its first
        statement was the batch claim), so no other writer can insert an id
        between the lookup and the insert; ``ON CONFLICT DO NOTHING`` stays as
        a guard. sqlite3's executemany cannot return rows, and the RETURNING
        multi-row VALUES that SQLAlchemy builds instead costs several times
        the database's own work per row.
        """
        conn = self._conn
        ids = [e.event_id for e in events]
        known: set[str] = set()
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            known.update(conn.execute(select(EVENTS.c.event_id).where(EVENTS.c.event_id.in_(chunk))).scalars())
        fresh = [e for e in events if e.event_id not in known]
        if not fresh:
            return set()
        to_text = EVENTS.c.time.type.bind_processor(conn.dialect)  # UTCDateTime as SQLAlchemy stores it
        assert to_text is not None
        time_at = EVENT_COLUMNS.index("time")
        received = to_text(received_at)
        rows = []
        for event in fresh:
            row = list(_row_of(event))
            row[time_at] = to_text(row[time_at])
            rows.append((*row, batch_id, received))
        cursor = self._raw_cursor()
        try:
            cursor.executemany(_SQLITE_EVENT_INSERT, rows)
        finally:
            cursor.close()
        return {e.event_id for e in fresh}

    def upsert_rollups(self, rows: Sequence[Mapping[str, Any]]) -> dict[RollupKey, int]:
        """Add counters to their rows (creating missing ones); returns each key's row id.

        Rows must come sorted by key: concurrent ingests then lock rollup rows
        in one order and cannot deadlock.
        """
        if not rows:
            return {}
        if self._pg_bulk():
            payload = json.dumps([{**row, "minute": row["minute"].isoformat()} for row in rows])
            returned = self._raw_execute(_PG_ROLLUP_UPSERT, [payload])
        else:
            stmt = self._insert(ROLLUPS)
            stmt = stmt.on_conflict_do_update(
                index_elements=list(KEY_FIELDS),
                set_={name: ROLLUPS.c[name] + stmt.excluded[name] for name in COUNTERS},
            ).returning(ROLLUPS.c.id, *(ROLLUPS.c[name] for name in KEY_FIELDS))
            returned = [tuple(r) for r in self._conn.execute(stmt, list(rows))]
        ids: dict[RollupKey, int] = {}
        for rid, *key in returned:
            ids[tuple(key)] = rid
        return ids

    def upsert_histograms(self, rows: Sequence[tuple[int, str, int, int]]) -> None:
        """Add ``(rollup_id, metric, bucket, count)`` rows to the histograms; rows sorted, as above."""
        if not rows:
            return
        if self._pg_bulk():
            self._raw_execute(_PG_HISTOGRAM_UPSERT, [json.dumps(rows)])
            return
        stmt = self._insert(HISTOGRAMS)
        stmt = stmt.on_conflict_do_update(index_elements=["rollup_id", "metric", "bucket"],
                                          set_={"count": HISTOGRAMS.c.count + stmt.excluded.count})
        self._conn.execute(stmt, [{"rollup_id": r, "metric": m, "bucket": b, "count": c} for r, m, b, c in rows])

    # -- partitions (PostgreSQL) ------------------------------------------------------------------------

    def event_partitions(self) -> dict[dt.date, str]:
        """The day partitions attached to telemetry_events, by day (PostgreSQL; empty on SQLite)."""
        if not self._partitioned():
            return {}
        rows = self._conn.execute(text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'telemetry_events'::regclass"))
        out: dict[dt.date, str] = {}
        for (name,) in rows:
            if is_event_partition(name):
                out[dt.datetime.strptime(name[len(EVENT_PARTITION_PREFIX):], "%Y%m%d").date()] = name
        return out

    def ensure_partitions(self, today: dt.date, days_ahead: int, days_behind: int = 0) -> list[str]:
        """Create the partitions of the days from ``today - days_behind`` to ``today + days_ahead`` that are
        missing; returns the names created (none on SQLite). See :meth:`ensure_partition_days`."""
        return self.ensure_partition_days(today + dt.timedelta(days=n) for n in range(-days_behind, days_ahead + 1))

    def ensure_partition_days(self, days: Iterable[dt.date]) -> list[str]:
        """Create the missing partitions of ``days`` in this transaction; returns the names created.

        Idempotent, and safe with other control-plane replicas doing the same: when anything is missing,
        the transaction takes the advisory lock :data:`PARTITION_LOCK_KEY` (held to its end) and looks
        again, so two transactions never create one partition (``CREATE TABLE IF NOT EXISTS`` alone can
        still collide in the catalog). Nothing is locked when every day exists. A partition is created
        as a table of its own and then attached, which locks the parent table SHARE UPDATE EXCLUSIVE:
        ingest and reads go on meanwhile (``CREATE TABLE ... PARTITION OF`` would stop both).
        """
        if not self._partitioned():
            return []
        wanted = sorted(set(days))
        present = self.event_partitions()
        if all(day in present for day in wanted):
            return []
        conn = self._conn
        conn.execute(select(func.pg_advisory_xact_lock(PARTITION_LOCK_KEY)))
        existing = self.event_partitions()
        created = []
        for day in wanted:
            if day in existing:
                continue
            name = event_partition_name(day)  # from a date: nothing from outside reaches the SQL
            start = day_start(day)
            end = start + dt.timedelta(days=1)
            conn.exec_driver_sql(f"CREATE TABLE IF NOT EXISTS {name} (LIKE telemetry_events INCLUDING DEFAULTS)")
            conn.exec_driver_sql(f"ALTER TABLE telemetry_events ATTACH PARTITION {name} "
                                 f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')")
            created.append(name)
        return created

    # -- retention -----------------------------------------------------------------------------------

    def purge(self, cutoff: dt.datetime) -> PurgeCounts:
        """Delete events with ``time < cutoff``, rollups with ``minute < cutoff`` (and their
        histograms), and batch records received before it.

        PostgreSQL: events are never deleted row by row; the day partitions that end at or before the
        cutoff's day (its UTC midnight) are dropped whole, and rollups are cut at that midnight too, so
        that the rollups still equal the aggregate of the events that remain. Up to a day more is kept.
        """
        conn = self._conn
        partitioned = self._partitioned()
        events_before = day_start(cutoff.astimezone(dt.UTC).date()) if partitioned else cutoff
        old_rollups = select(ROLLUPS.c.id).where(ROLLUPS.c.minute < events_before)
        histogram_rows = conn.execute(delete(HISTOGRAMS).where(HISTOGRAMS.c.rollup_id.in_(old_rollups))).rowcount
        rollups = conn.execute(delete(ROLLUPS).where(ROLLUPS.c.minute < events_before)).rowcount
        batches = conn.execute(delete(BATCHES).where(BATCHES.c.received_at < cutoff)).rowcount
        # a delta's record goes with the rollups of its minute: a delta older than that is outside the window
        conn.execute(delete(DELTAS).where(DELTAS.c.minute < events_before))
        dropped: list[str] = []
        if partitioned:
            dropped = [name for day, name in sorted(self.event_partitions().items())
                       if day_start(day) + dt.timedelta(days=1) <= events_before]
            events = sum(conn.exec_driver_sql(f"SELECT count(*) FROM {name}").scalar_one()  # noqa: S608
                         for name in dropped)
            # Last: dropping a partition locks the whole table (ACCESS EXCLUSIVE) until this transaction ends.
            for name in dropped:
                conn.exec_driver_sql(f"DROP TABLE {name}")
        else:
            events = conn.execute(delete(EVENTS).where(EVENTS.c.time < cutoff)).rowcount
        return PurgeCounts(events=events, rollups=rollups, histogram_rows=histogram_rows, batches=batches,
                           events_before=events_before, partitions=tuple(dropped))

    # -- reads ---------------------------------------------------------------------------------------

    @staticmethod
    def _where(flt: RollupFilter) -> list[ColumnElement[bool]]:
        conds: list[ColumnElement[bool]] = []
        for name in ("policy", "revision", "route", "engine", "explored", "k0"):
            value = getattr(flt, name)
            if value is not None:
                conds.append(ROLLUPS.c[name] == value)
        if flt.start is not None:
            conds.append(ROLLUPS.c.minute >= flt.start)
        if flt.end is not None:
            conds.append(ROLLUPS.c.minute < flt.end)
        return conds

    def _groups(self, group_by: Sequence[str], window_s: int | None) -> list[ColumnElement[Any]]:
        """The group columns; with ``window_s``, ``minute`` is truncated to windows of that many seconds."""
        out: list[ColumnElement[Any]] = []
        for name in group_by:
            column: ColumnElement[Any] = ROLLUPS.c[name]
            if name == "minute" and window_s is not None and window_s != 60:
                column = type_coerce(self._window(window_s), ROLLUPS.c.minute.type).label("minute")
            out.append(column)
        return out

    def _window(self, window_s: int) -> ColumnElement[Any]:
        """The start of the ``window_s`` window of ``minute`` (hours and days: cheap truncations)."""
        minute = ROLLUPS.c.minute
        if self._conn.dialect.name == "postgresql":
            if window_s in (3600, 86400):
                # in UTC whatever the session's TimeZone: a naive UTC timestamp, read back as UTC
                return func.date_trunc("hour" if window_s == 3600 else "day", func.timezone("UTC", minute))
            epoch = func.floor(func.extract("epoch", minute) / window_s) * window_s
            return func.to_timestamp(epoch)
        # SQLite keeps UTC as text, "YYYY-MM-DD HH:MM:SS.ffffff": cut it, in the same layout.
        if window_s == 3600:
            return func.substr(minute, 1, 13).concat(":00:00.000000")
        if window_s == 86400:
            return func.substr(minute, 1, 10).concat(" 00:00:00.000000")
        epoch = cast(func.strftime("%s", minute), Integer) / window_s * window_s
        return func.strftime("%Y-%m-%d %H:%M:%S.000000", epoch, "unixepoch")

    def rollup_totals(self, flt: RollupFilter, group_by: Sequence[str],
                      limit: int | None = None, window_s: int | None = None) -> list[dict[str, Any]]:
        """Merged counters per group (``group_by`` fields of :data:`KEY_FIELDS`), ordered by the group.

        With ``window_s``, a ``minute`` group means the start of its window of that many seconds.
        """
        groups = self._groups(group_by, window_s)
        sums = [cast(func.sum(ROLLUPS.c[name]), Float if name in FLOAT_COUNTERS else BigInteger).label(name)
                for name in COUNTERS]
        query = select(*groups, *sums).where(*self._where(flt)).group_by(*groups).order_by(*groups)
        if limit is not None:
            query = query.limit(limit)
        rows = [dict(row._mapping) for row in self._conn.execute(query)]
        # Without groups, SUM over no rows is one row of NULLs: no group at all.
        return [row for row in rows if row["requests"] is not None]

    def rollup_histograms(self, flt: RollupFilter, group_by: Sequence[str], window_s: int | None = None,
                          metrics: Sequence[str] | None = None) -> list[tuple[tuple[Any, ...], str, int, int]]:
        """Merged histogram counts: ``(group values, metric, bucket, count)``; only ``metrics`` if given."""
        groups = self._groups(group_by, window_s)
        conds = self._where(flt)
        if metrics is not None:
            conds.append(HISTOGRAMS.c.metric.in_(list(metrics)))
        query = (select(*groups, HISTOGRAMS.c.metric, HISTOGRAMS.c.bucket,
                        cast(func.sum(HISTOGRAMS.c.count), BigInteger))
                 .select_from(HISTOGRAMS.join(ROLLUPS, ROLLUPS.c.id == HISTOGRAMS.c.rollup_id))
                 .where(*conds)
                 .group_by(*groups, HISTOGRAMS.c.metric, HISTOGRAMS.c.bucket))
        n = len(groups)
        return [(tuple(row[:n]), row[n], row[n + 1], row[n + 2]) for row in self._conn.execute(query)]
