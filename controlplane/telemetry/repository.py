"""Every SQL statement of the telemetry store.

Writes are dialect-specific upserts (``INSERT ... ON CONFLICT``), the same
statements on SQLite and PostgreSQL. On PostgreSQL the rows of a batch travel
as ONE JSON parameter per statement, unpacked by the server
(``INSERT ... SELECT ... FROM json_populate_recordset(...)``): serializing a
batch is one call into pydantic-core or the C json encoder, where binding
tens of thousands of parameters row by row (SQLAlchemy's executemany) costs
more than the database's own work. ``TelemetryRepository.pg_bulk = False``
switches back to the executemany statements (bench/ingest.py compares them).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
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
    type_coerce,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from analysis.rollup import COUNTERS, FLOAT_COUNTERS, KEY_FIELDS, RollupKey
from controlplane.models import (
    Policy,
    TelemetryBatchRecord,
    TelemetryEventRecord,
    TelemetryRollup,
    TelemetryRollupHistogram,
)
from wire.telemetry import TelemetryEvent

BATCHES: Table = TelemetryBatchRecord.__table__  # type: ignore[assignment]
EVENTS: Table = TelemetryEventRecord.__table__  # type: ignore[assignment]
ROLLUPS: Table = TelemetryRollup.__table__  # type: ignore[assignment]
HISTOGRAMS: Table = TelemetryRollupHistogram.__table__  # type: ignore[assignment]

# The columns an event fills, in table order; batch_id and received_at are the batch's.
EVENT_COLUMNS: tuple[str, ...] = tuple(c.name for c in EVENTS.columns if c.name not in ("batch_id", "received_at"))


_row_of = attrgetter(*EVENT_COLUMNS)
_EVENTS_JSON = TypeAdapter(list[TelemetryEvent])


def _columns(names: Sequence[str], prefix: str = "") -> str:
    return ", ".join(f'{prefix}"{name}"' for name in names)


# Column names come from the models; every value is a parameter.
_PG_EVENT_INSERT = (
    f"INSERT INTO telemetry_events ({_columns(EVENT_COLUMNS)}, batch_id, received_at) "  # noqa: S608
    f"SELECT {_columns(EVENT_COLUMNS, 'r.')}, %s, %s "
    "FROM json_populate_recordset(NULL::telemetry_events, %s::json) AS r "
    "ON CONFLICT (event_id) DO NOTHING RETURNING event_id"
)
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


class TelemetryRepository:
    # PostgreSQL: each write is one statement with the batch's rows as one JSON parameter.
    # False uses the dialect-neutral executemany upserts there too (bench/ingest.py compares them).
    pg_bulk = True
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

    def set_batch_stored(self, batch_id: str, stored: int) -> None:
        self._conn.execute(BATCHES.update().where(BATCHES.c.batch_id == batch_id).values(stored=stored))

    def _pg_bulk(self) -> bool:
        return self.pg_bulk and self._conn.dialect.name == "postgresql"

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

        An event id already stored is skipped (``ON CONFLICT DO NOTHING``).
        Events with equal ids must not both be given. Times must be in UTC.
        """
        if not events:
            return set()
        if self._pg_bulk():
            payload = _EVENTS_JSON.dump_json(list(events)).decode()
            return {r[0] for r in self._raw_execute(_PG_EVENT_INSERT, [batch_id, received_at, payload])}
        if self.sqlite_bulk and self._conn.dialect.name == "sqlite":
            return self._sqlite_insert_events(events, batch_id=batch_id, received_at=received_at)
        params = [{**dict(zip(EVENT_COLUMNS, _row_of(e), strict=True)), "batch_id": batch_id,
                   "received_at": received_at} for e in events]
        stmt = (self._insert(EVENTS).on_conflict_do_nothing(index_elements=["event_id"])
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

    # -- retention -----------------------------------------------------------------------------------

    def purge(self, cutoff: dt.datetime) -> PurgeCounts:
        """Delete events with ``time < cutoff``, rollups with ``minute < cutoff`` (and their
        histograms), and batch records received before it."""
        conn = self._conn
        old_rollups = select(ROLLUPS.c.id).where(ROLLUPS.c.minute < cutoff)
        histogram_rows = conn.execute(delete(HISTOGRAMS).where(HISTOGRAMS.c.rollup_id.in_(old_rollups))).rowcount
        rollups = conn.execute(delete(ROLLUPS).where(ROLLUPS.c.minute < cutoff)).rowcount
        events = conn.execute(delete(EVENTS).where(EVENTS.c.time < cutoff)).rowcount
        batches = conn.execute(delete(BATCHES).where(BATCHES.c.received_at < cutoff)).rowcount
        return PurgeCounts(events=events, rollups=rollups, histogram_rows=histogram_rows, batches=batches)

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
