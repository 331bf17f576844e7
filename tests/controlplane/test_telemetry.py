"""Telemetry store: ingest (idempotent, event by event), rollups that equal the raw events, retention, reads."""

from __future__ import annotations

import datetime as dt
import gzip
import itertools
import json
import math
import random
import threading
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from analysis.buckets import BATCH_BUCKETS, batch_bucket, batch_bucket_label
from analysis.histogram import EDGES, NUM_BUCKETS, bucket_bounds, bucket_index, quantile
from analysis.rollup import COUNTERS
from controlplane.db import make_sessionmaker, unit_of_work
from controlplane.models import (
    TelemetryBatchRecord,
    TelemetryEventRecord,
    TelemetryRollup,
    TelemetryRollupHistogram,
)
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry.repository import EVENT_COLUMNS, TelemetryRepository
from controlplane.telemetry.schemas import MAX_EVENTS, REJECTED_KEPT
from controlplane.telemetry.service import purge
from specgate.cli import app as cli_app
from tests.support.factories import seed_policy
from tests.support.live import serve
from tests.support.rollup_check import assert_rollups_equal_raw, expected_bucket
from tests.support.telemetry_bodies import event, random_event
from wire.problems import ProblemCode
from wire.telemetry import TelemetryEvent

URL = "/v1/telemetry/batches"
ROLLUPS = "/v1/telemetry/rollups"
T0 = dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC)


# --- helpers --------------------------------------------------------------------------------------

def batch(batch_id: str, events: list[Any], worker_id: str = "w-1") -> dict[str, Any]:
    return {"batch_id": batch_id, "worker_id": worker_id, "schema_version": 1, "events": events}


def post(client: TestClient, headers: dict[str, str], body: Any, *, compress: bool = True) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    extra = {"Content-Type": "application/json"}
    if compress:
        raw = gzip.compress(raw)
        extra["Content-Encoding"] = "gzip"
    return client.post(URL, content=raw, headers={**headers, **extra})


@pytest.fixture
def worker_key(worker_key: dict[str, str], settings: ControlPlaneSettings) -> dict[str, str]:
    """The fleet key, with the policies the events here name: "seed" (pool-less) and "other" (pool "a").

    A worker key's events must name a policy that serves their pool (issue 16); these tests are about
    storage, so the world they claim exists.
    """
    seed_policy(settings.database_url)
    seed_policy(settings.database_url, name="other", pool="a")
    return worker_key


def count(engine: Engine, model: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(model)).scalar_one())


def event_ids(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(select(TelemetryEventRecord.event_id)).scalars())


def rollup_state(engine: Engine) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    with engine.connect() as conn:
        rollups = sorted(tuple(r) for r in conn.execute(select(TelemetryRollup.__table__)))
        hist = sorted(tuple(r) for r in conn.execute(select(TelemetryRollupHistogram.__table__)))
    return rollups, hist


# --- the fixed buckets (no database) --------------------------------------------------------------

def test_batch_buckets_are_the_documented_ones() -> None:
    assert BATCH_BUCKETS == (1, 2, 3, 5, 9, 17, 33, 65)
    for size in range(0, 300):
        assert batch_bucket(size) == expected_bucket(size), size
    assert [batch_bucket_label(b) for b in BATCH_BUCKETS] == ["1", "2", "3-4", "5-8", "9-16", "17-32", "33-64",
                                                              "65+"]


def test_latency_buckets_are_log_spaced_from_a_tenth_of_a_ms_to_about_100_s() -> None:
    assert NUM_BUCKETS == 48
    assert len(EDGES) == 47
    assert EDGES[0] == 0.1
    assert 90_000 < EDGES[-1] < 110_000
    assert all(math.isclose(b / a, 1.35) for a, b in itertools.pairwise(EDGES))
    assert bucket_index(0.0) == 0
    assert bucket_index(0.0999) == 0
    assert bucket_index(0.1) == 1  # edges belong to the bucket above them
    assert bucket_index(0.1349) == 1
    assert bucket_index(EDGES[10]) == 11
    assert bucket_index(1e9) == NUM_BUCKETS - 1
    for value in (0.05, 0.3, 7.7, 123.4, 5000.0, 99_000.0, 3e6):
        lower, upper = bucket_bounds(bucket_index(value))
        assert lower <= value < upper


def test_quantile_interpolates_within_the_bucket() -> None:
    b = bucket_index(10.0)
    lower, upper = bucket_bounds(b)
    assert quantile({b: 4}, 0.5) == pytest.approx(lower + (upper - lower) * 0.5)
    assert quantile({b: 4}, 0.0) == pytest.approx(lower)
    assert quantile({b: 4}, 1.0) == pytest.approx(upper)
    # 90 small values, 10 large ones: p50 among the small, p99 among the large.
    small, large = bucket_index(5.0), bucket_index(500.0)
    p50, p99 = quantile({small: 90, large: 10}, 0.5), quantile({small: 90, large: 10}, 0.99)
    assert p50 is not None
    assert p99 is not None
    assert bucket_bounds(small)[0] <= p50 < bucket_bounds(small)[1]
    assert bucket_bounds(large)[0] <= p99 < bucket_bounds(large)[1]
    assert quantile({}, 0.5) is None
    assert quantile({NUM_BUCKETS - 1: 3}, 0.5) == EDGES[-1]  # the open bucket answers its lower bound
    with pytest.raises(ValueError, match="q must be"):
        quantile({1: 1}, 1.5)


def test_every_contract_field_has_a_column() -> None:
    assert set(EVENT_COLUMNS) == set(TelemetryEvent.model_fields)
    assert set(TelemetryEventRecord.__table__.columns.keys()) == set(EVENT_COLUMNS) | {"batch_id", "received_at"}


# --- ingest ---------------------------------------------------------------------------------------

def test_plain_and_gzip_batches_are_stored_field_for_field(client: TestClient, worker_key: dict[str, str],
                                                           db: Engine) -> None:
    r = post(client, worker_key, batch("b-plain", [event(1), event(2)]), compress=False)
    assert r.status_code == 200, r.text
    assert r.json() == {"batch_id": "b-plain", "accepted": 2, "stored": 2, "rejected": [], "rejected_count": 0,
                        "duplicate": False, "rollups_accepted": 0, "rollups_stored": 0, "rollups_rejected": [],
                        "rollups_rejected_count": 0}
    offset = event(3, time="2026-12-02T12:00:30.250+02:00", structured_valid=True, fallback_reason="read_timeout",
                   ttft_ms=None, spec_draft_tokens=None, shadow_match=False, shadow_first_diff=17,
                   shadow_structured_valid=False, shadow_check_passed=False,
                   shadow_check_reason="the plain answer names another city " + "é" * 200)
    naive = event(4, time="2026-12-02T10:05:00")
    r = post(client, worker_key, batch("b-gzip", [offset, naive]))
    assert r.status_code == 200, r.text
    assert r.json()["stored"] == 2
    assert event_ids(db) == {"ev-1", "ev-2", "ev-3", "ev-4"}
    with db.connect() as conn:
        row = conn.execute(select(TelemetryEventRecord.__table__)
                           .where(TelemetryEventRecord.event_id == "ev-3")).mappings().one()
        t4 = conn.execute(select(TelemetryEventRecord.time).where(TelemetryEventRecord.event_id == "ev-4")).scalar()
    expected = TelemetryEvent.model_validate(offset).model_dump()
    for name in EVENT_COLUMNS:
        if name != "time":
            assert row[name] == expected[name], name
    assert row["time"] == dt.datetime(2026, 12, 2, 10, 0, 30, 250_000, tzinfo=dt.UTC)
    assert row["batch_id"] == "b-gzip"
    assert row["received_at"] is not None
    assert t4 == dt.datetime(2026, 12, 2, 10, 5, tzinfo=dt.UTC)  # no zone: UTC, as the contract says


def test_bad_events_are_rejected_with_index_and_reason_and_the_rest_kept(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    missing = event(1)
    del missing["e2e_ms"]
    events = [event(0), missing, event(2, ttft_ms=-1), event(3, colour="red"), event(4),
              event(5, route="ch\x00at"), event(6, batch_size=2**40), event(7, status="meh"), "not an event",
              event(9)]
    r = post(client, worker_key, batch("b-mixed", events))
    assert r.status_code == 200, r.text
    ack = r.json()
    assert (ack["accepted"], ack["stored"]) == (3, 3)
    reasons = {rej["index"]: {(e["path"], e["code"]) for e in rej["errors"]} for rej in ack["rejected"]}
    assert reasons == {
        1: {("e2e_ms", "missing")}, 2: {("ttft_ms", "out_of_range")}, 3: {("colour", "unknown_field")},
        5: {("route", "invalid_format")}, 6: {("batch_size", "out_of_range")},
        7: {("status", "invalid_value")}, 8: {("", "wrong_type")},
    }
    assert all(e["message"] for rej in ack["rejected"] for e in rej["errors"])
    assert event_ids(db) == {"ev-0", "ev-4", "ev-9"}


def test_a_fallback_reason_outside_the_closed_set_is_refused_per_event(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    reasons = ["timeout", "upstream_503", "upstream_404", "connect_error", "upstream_5031", None]
    events = [event(i, fallback=reason is not None, fallback_reason=reason) for i, reason in enumerate(reasons)]
    r = post(client, worker_key, batch("b-reasons", events))
    assert r.status_code == 200, r.text
    ack = r.json()
    assert [(rej["index"], [(e["path"], e["code"]) for e in rej["errors"]]) for rej in ack["rejected"]] == [
        (0, [("fallback_reason", "invalid_format")]), (2, [("fallback_reason", "invalid_format")]),
        (4, [("fallback_reason", "invalid_format")])]
    assert event_ids(db) == {"ev-1", "ev-3", "ev-5"}


def test_a_batch_recorded_with_the_old_open_codes_is_answered_in_the_closed_ones(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    # Records written before the codes were closed hold pydantic's error types. A batch whose answer was lost
    # is sent again, possibly after an upgrade: it must be answered (a 500 would be retried for ever).
    old = [{"index": 1, "errors": [{"path": "route", "code": "string_pattern_mismatch", "message": "NUL"},
                                   {"path": "ttft_ms", "code": "finite_number", "message": "inf"}]},
           {"index": 2, "errors": [{"path": "e2e_ms", "code": "missing", "message": "Field required"}]}]
    with unit_of_work(make_sessionmaker(db)) as session:
        assert TelemetryRepository(session).claim_batch({
            "batch_id": "b-old", "worker_id": "w-1", "sent_by": "worker", "received_at": T0, "event_count": 3,
            "accepted": 1, "stored": 1, "rejected": old})
    r = post(client, worker_key, batch("b-old", [event(1), event(2), event(3)]))
    assert r.status_code == 200, r.text
    assert r.json()["duplicate"] is True
    assert [(rej["index"], [(e["path"], e["code"]) for e in rej["errors"]]) for rej in r.json()["rejected"]] == [
        (1, [("route", "invalid_format"), ("ttft_ms", "out_of_range")]), (2, [("e2e_ms", "missing")])]
    assert {e["code"] for rej in r.json()["rejected"] for e in rej["errors"]} <= set(ProblemCode)


def test_non_finite_numbers_are_rejected_not_stored(client: TestClient, worker_key: dict[str, str],
                                                    db: Engine) -> None:
    # Python's json writes Infinity/NaN; neither may reach a sum.
    body = json.dumps(batch("b-inf", [event(1, itl_ms=float("inf")), event(2, e2e_ms=float("nan")),
                                      event(3, ttft_ms=5e12), event(4)])).encode()
    r = post(client, worker_key, body)
    assert r.status_code == 200, r.text
    ack = r.json()
    assert [(rej["index"], rej["errors"][0]["path"], rej["errors"][0]["code"]) for rej in ack["rejected"]] == [
        (0, "itl_ms", "out_of_range"), (1, "e2e_ms", "out_of_range"), (2, "ttft_ms", "out_of_range")]
    assert event_ids(db) == {"ev-4"}
    # Valid by the contract, but its time does not exist in UTC.
    r = post(client, worker_key, batch("b-time", [event(5), event(6, time="0001-01-01T00:30:00+01:00")]))
    assert r.json()["rejected"] == [{"index": 1, "errors": [
        {"path": "time", "code": "out_of_range", "message": "is out of range in UTC"}]}]
    assert event_ids(db) == {"ev-4", "ev-5"}


@pytest.mark.parametrize(("body", "paths"), [
    ({"worker_id": "w", "events": []}, {"batch_id"}),
    ({"batch_id": "b", "worker_id": 7, "events": []}, {"worker_id"}),
    ({"batch_id": "b", "worker_id": "w", "events": {"0": {}}}, {"events"}),
    ({"batch_id": "", "worker_id": "w"}, {"batch_id", "events"}),
    ({"batch_id": "b", "worker_id": "w", "events": [], "extra": 1}, {"extra"}),
    ({"batch_id": "b", "worker_id": "w", "events": [], "schema_version": 2}, {"schema_version"}),
    ({"batch_id": "b\x00", "worker_id": "w", "events": []}, {"batch_id"}),
    ([], {""}),
    (b"{not json", {"body"}),
    (b'{"batch_id": "b\\ud800", "worker_id": "w", "events": []}', {"body"}),  # no database stores it
])
def test_envelope_errors_are_422_problems_with_paths(client: TestClient, worker_key: dict[str, str],
                                                     db: Engine, body: Any, paths: set[str]) -> None:
    r = post(client, worker_key, body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert {e["path"] for e in r.json()["errors"]} == paths
    assert count(db, TelemetryBatchRecord) == 0


def test_too_many_events_is_an_envelope_error(client: TestClient, worker_key: dict[str, str]) -> None:
    r = post(client, worker_key, batch("b-big", [{}] * 10_001))
    assert r.status_code == 422
    assert [e["path"] for e in r.json()["errors"]] == ["events"]


@pytest.mark.parametrize("body", [b"definitely not gzip", gzip.compress(b'{"batch_id": "b"}')[:-12], b""])
def test_malformed_gzip_is_400(client: TestClient, worker_key: dict[str, str], body: bytes) -> None:
    r = client.post(URL, content=body, headers={**worker_key, "Content-Encoding": "gzip",
                                                "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["errors"][0]["code"] == "invalid_gzip"


def test_gzip_bomb_is_413_without_inflating_it(client: TestClient, worker_key: dict[str, str],
                                               settings: ControlPlaneSettings, db: Engine) -> None:
    bomb = gzip.compress(b" " * (16 * settings.max_body_bytes + 1), 9)
    assert len(bomb) < settings.max_body_bytes  # it passes the body limit; only inflating it is refused
    r = client.post(URL, content=bomb, headers={**worker_key, "Content-Encoding": "gzip"})
    assert r.status_code == 413, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    # Just under the limit inflates, and is then judged as JSON.
    fits = gzip.compress(b" " * (16 * settings.max_body_bytes - 10) + b"[]", 9)
    assert client.post(URL, content=fits, headers={**worker_key, "Content-Encoding": "gzip"}).status_code == 422
    # Two gzip members are one body (as `gzip.decompress` reads them).
    two = gzip.compress(json.dumps(batch("b-two", [event(1)]))[:20].encode()) + gzip.compress(
        json.dumps(batch("b-two", [event(1)]))[20:].encode())
    r = client.post(URL, content=two, headers={**worker_key, "Content-Encoding": "gzip"})
    assert r.status_code == 200
    assert r.json()["stored"] == 1
    assert count(db, TelemetryEventRecord) == 1


@pytest.mark.parametrize(("headers", "path"), [
    ({"Content-Encoding": "br"}, "Content-Encoding"),
    ({"Content-Type": "text/plain"}, "Content-Type"),
])
def test_other_encodings_and_types_are_415(client: TestClient, worker_key: dict[str, str],
                                           headers: dict[str, str], path: str) -> None:
    r = client.post(URL, content=json.dumps(batch("b", [])).encode(), headers={**worker_key, **headers})
    assert r.status_code == 415
    assert r.json()["errors"][0]["path"] == path


def test_only_worker_keys_may_send(client: TestClient, admin: dict[str, str], viewer: dict[str, str],
                                   operator: dict[str, str], db: Engine) -> None:
    for key in (admin, operator, viewer):
        r = post(client, key, batch("b-x", [event(1)]))
        assert r.status_code == 403, r.text
        assert r.json()["type"].endswith("/forbidden")
    assert post(client, {}, batch("b-x", [event(1)])).status_code == 401
    assert count(db, TelemetryEventRecord) == 0


def test_a_replayed_batch_is_acknowledged_and_stores_nothing(client: TestClient, worker_key: dict[str, str],
                                                             db: Engine) -> None:
    events = [event(1), event(2, e2e_ms=-5), event(3, route="code")]
    first = post(client, worker_key, batch("b-once", events))
    assert first.status_code == 200
    assert first.json()["duplicate"] is False
    before = rollup_state(db)
    again = post(client, worker_key, batch("b-once", events), compress=False)
    assert again.status_code == 200
    assert again.json() == {**first.json(), "duplicate": True}
    # A replay is answered from the first time even if its content differs.
    other = post(client, worker_key, batch("b-once", [event(9)]))
    assert other.json() == {**first.json(), "duplicate": True}
    assert event_ids(db) == {"ev-1", "ev-3"}
    assert count(db, TelemetryBatchRecord) == 1
    assert rollup_state(db) == before
    metrics = client.get("/metrics").text
    assert 'specgate_telemetry_batches_total{outcome="duplicate"} 2.0' in metrics
    assert 'specgate_telemetry_batches_total{outcome="new"} 1.0' in metrics
    assert 'specgate_telemetry_events_total{outcome="stored"} 2.0' in metrics
    assert 'specgate_telemetry_events_total{outcome="rejected"} 1.0' in metrics


def test_an_event_in_two_batches_is_stored_and_counted_once(client: TestClient, worker_key: dict[str, str],
                                                            db: Engine) -> None:
    a = post(client, worker_key, batch("b-a", [event(1), event(2)])).json()
    b = post(client, worker_key, batch("b-b", [event(2), event(3), event(3)])).json()
    assert (a["accepted"], a["stored"]) == (2, 2)
    assert (b["accepted"], b["stored"], b["duplicate"]) == (3, 1, False)
    assert event_ids(db) == {"ev-1", "ev-2", "ev-3"}
    with db.connect() as conn:
        assert conn.execute(select(func.sum(TelemetryRollup.requests))).scalar() == 3
        origin = conn.execute(select(TelemetryEventRecord.batch_id)
                              .where(TelemetryEventRecord.event_id == "ev-2")).scalar()
    assert origin == "b-a"
    assert 'specgate_telemetry_events_total{outcome="already_stored"} 2.0' in client.get("/metrics").text
    assert_rollups_equal_raw(db)


# --- rollups equal the raw events -----------------------------------------------------------------

def test_rollups_equal_the_raw_events_after_many_batches_replays_and_duplicates(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    rng = random.Random(20261202)
    pool = [random_event(rng, n) for n in range(3000)]
    sent: list[dict[str, Any]] = []
    i = 0
    while i < len(pool):
        size = rng.randint(1, 150)
        events: list[Any] = pool[i:i + size]
        i += size
        if sent and rng.random() < 0.3:  # events sent before, in a new batch
            events += rng.sample(sent[-1]["events"], min(5, len(sent[-1]["events"])))
        if rng.random() < 0.2:
            events.append(event("bad", e2e_ms=None))
        body = batch(f"b-{len(sent)}", events)
        r = post(client, worker_key, body, compress=rng.random() < 0.7)
        assert r.status_code == 200, r.text
        sent.append(body)
        if rng.random() < 0.2:  # a replay of some earlier batch
            replay = post(client, worker_key, rng.choice(sent))
            assert replay.json()["duplicate"] is True
    assert event_ids(db) == {e["event_id"] for e in pool}
    rows = assert_rollups_equal_raw(db)
    assert rows > 300  # many keys, so the comparison means something
    with db.connect() as conn:  # and every shadow counter has something to be compared on
        shadow = conn.execute(select(*(func.sum(TelemetryRollup.__table__.c[name])
                                       for name in COUNTERS if name.startswith("shadow_")))).one()
    assert min(shadow) > 50, shadow


def test_the_plain_sqlalchemy_statements_store_the_same(client: TestClient, worker_key: dict[str, str],
                                                        db: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executemany statements the bulk paths replaced (bench/ingest.py's "before") stay exact too."""
    monkeypatch.setattr(TelemetryRepository, "pg_bulk", False)
    monkeypatch.setattr(TelemetryRepository, "sqlite_bulk", False)
    rng = random.Random(3)
    pool = [random_event(rng, n) for n in range(400)]
    seen: set[str] = set()
    for k in range(0, 400, 50):
        events = pool[k:k + 80]  # overlapping: 30 events of each batch were in the one before
        r = post(client, worker_key, batch(f"g-{k}", events))
        assert r.status_code == 200, r.text
        ids = {e["event_id"] for e in events}
        assert r.json()["stored"] == len(ids - seen)
        seen |= ids
    assert event_ids(db) == {e["event_id"] for e in pool}
    assert_rollups_equal_raw(db)


def test_concurrent_overlapping_batches_keep_rollups_exact(settings: ControlPlaneSettings,
                                                           worker_key: dict[str, str], db: Engine) -> None:
    from controlplane.app import create_app

    rng = random.Random(7)
    pool = [random_event(rng, n) for n in range(1200)]
    # Every batch shares events with its neighbours, and every batch is sent twice, from different threads.
    bodies = [gzip.compress(json.dumps(batch(f"c-{k}", pool[k * 40:k * 40 + 80])).encode()) for k in range(30)]
    failures: list[str] = []
    with serve(create_app(settings)) as url:
        def send(items: list[bytes]) -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                for body in items:
                    r = http.post(URL, content=body, headers={**worker_key, "Content-Encoding": "gzip"})
                    if r.status_code != 200:
                        failures.append(r.text)

        threads = [threading.Thread(target=send, args=(bodies[k::3] + bodies[(k + 1) % 3::3],)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failures == []
    assert event_ids(db) == {e["event_id"] for e in pool}
    assert count(db, TelemetryBatchRecord) == 30
    assert_rollups_equal_raw(db)


# --- retention ------------------------------------------------------------------------------------

def test_purge_removes_old_telemetry_and_keeps_recent(client: TestClient, worker_key: dict[str, str],
                                                      db: Engine, settings: ControlPlaneSettings,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    now = dt.datetime.now(dt.UTC)
    old = [event(f"old-{k}", time=(now - dt.timedelta(days=40, minutes=k)).isoformat()) for k in range(5)]
    recent = [event(f"new-{k}", time=(now - dt.timedelta(days=1, minutes=k)).isoformat(), route="code")
              for k in range(3)]
    assert post(client, worker_key, batch("b-old", old)).json()["stored"] == 5
    assert post(client, worker_key, batch("b-new", recent)).json()["stored"] == 3
    monkeypatch.setenv("SPECGATE_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("SPECGATE_TELEMETRY_RETENTION_DAYS", "30")
    result = CliRunner().invoke(cli_app, ["telemetry", "purge"])
    assert result.exit_code == 0, result.output
    assert "5 events" in result.output
    assert "5 rollup rows" in result.output
    assert event_ids(db) == {f"ev-new-{k}" for k in range(3)}
    with db.connect() as conn:
        assert set(conn.execute(select(TelemetryRollup.route)).scalars()) == {"code"}
    assert_rollups_equal_raw(db)
    # The batch records are younger than 30 days: a replay of the old batch is still a duplicate.
    assert post(client, worker_key, batch("b-old", old)).json()["duplicate"] is True
    assert event_ids(db) == {f"ev-new-{k}" for k in range(3)}
    # The service function with a cutoff ahead of everything takes the rest, batch records included.
    with unit_of_work(make_sessionmaker(db)) as session:
        counts = purge(session, dt.datetime.now(dt.UTC) + dt.timedelta(minutes=2))
    assert (counts.events, counts.rollups, counts.batches) == (3, 3, 2)
    assert counts.histogram_rows > 3
    for model in (TelemetryEventRecord, TelemetryRollup, TelemetryRollupHistogram, TelemetryBatchRecord):
        assert count(db, model) == 0


# --- reading rollups -------------------------------------------------------------------------------

def exact_quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def test_rollup_quantiles_are_within_one_bucket_of_the_exact_ones(
        client: TestClient, worker_key: dict[str, str], viewer: dict[str, str], db: Engine) -> None:
    rng = random.Random(99)
    pool = [random_event(rng, n) for n in range(2500)]
    for k in range(0, len(pool), 500):
        assert post(client, worker_key, batch(f"q-{k}", pool[k:k + 500])).status_code == 200
    r = client.get(ROLLUPS, params={"group_by": "route"}, headers=viewer)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["group_by"] == ["route"]
    assert report["truncated"] is False
    assert sorted(g["key"]["route"] for g in report["groups"]) == ["agent", "chat", "code", "rag"]
    for group in report["groups"]:
        mine = [e for e in pool if e["route"] == group["key"]["route"]]
        assert group["counters"]["requests"] == len(mine)
        drafted = sum(e["spec_draft_tokens"] for e in mine
                      if e["spec_draft_tokens"] is not None and e["spec_accepted_tokens"] is not None)
        accepted = sum(e["spec_accepted_tokens"] for e in mine
                       if e["spec_draft_tokens"] is not None and e["spec_accepted_tokens"] is not None)
        assert group["acceptance_rate"] == pytest.approx(accepted / drafted)
        for metric, field in (("ttft_ms", "ttft_ms"), ("itl_ms", "itl_ms"), ("e2e_ms", "e2e_ms")):
            values = [e[field] for e in mine if e[field] is not None]
            for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
                estimate = group[metric][name]
                exact = exact_quantile(values, q)
                assert abs(bucket_index(estimate) - bucket_index(exact)) <= 1, (metric, name, estimate, exact)


def test_rollups_filter_group_and_validate(client: TestClient, worker_key: dict[str, str],
                                           admin: dict[str, str], viewer: dict[str, str]) -> None:
    events = [event(1, route="chat", batch_size=1, time="2026-12-02T10:00:10Z", e2e_ms=100.0),
              event(2, route="chat", batch_size=3, time="2026-12-02T10:01:10Z", e2e_ms=300.0),
              event(3, route="code", batch_size=70, time="2026-12-02T10:02:10Z", engine="base",
                    spec_draft_tokens=None, spec_accepted_tokens=None, status="error"),
              event(4, route="chat", batch_size=4, time="2026-12-02T10:01:50Z", explored=True)]
    assert post(client, worker_key, batch("f-1", events)).status_code == 200
    everything = client.get(ROLLUPS, headers=admin).json()
    assert len(everything["groups"]) == 1
    total = everything["groups"][0]
    assert total["key"] == {k: None for k in total["key"]}
    assert total["counters"]["requests"] == 4
    assert total["counters"]["errors"] == 1
    assert total["error_rate"] == 0.25
    assert total["acceptance_rate"] == pytest.approx(27 / 36)

    by = client.get(ROLLUPS, params=[("group_by", "minute,batch_bucket"), ("route", "chat")], headers=viewer).json()
    keys = [(g["key"]["minute"], g["key"]["batch_bucket"], g["key"]["batch_range"], g["counters"]["requests"])
            for g in by["groups"]]
    assert keys == [("2026-12-02T10:00:00Z", 1, "1", 1), ("2026-12-02T10:01:00Z", 3, "3-4", 2)]
    window = client.get(ROLLUPS, params={"from": "2026-12-02T10:01:00", "to": "2026-12-02T10:02:00Z"},
                        headers=viewer).json()
    assert window["groups"][0]["counters"]["requests"] == 2
    assert window["groups"][0]["e2e_ms_mean"] == pytest.approx((300.0 + 650.0) / 2)
    explored = client.get(ROLLUPS, params=[("group_by", "explored"), ("group_by", "engine")], headers=viewer)
    assert [(g["key"]["explored"], g["key"]["engine"], g["counters"]["requests"])
            for g in explored.json()["groups"]] == [(False, "base", 1), (False, "draft", 2), (True, "draft", 1)]
    base = client.get(ROLLUPS, params={"engine": "base"}, headers=viewer).json()["groups"][0]
    assert base["acceptance_rate"] is None
    assert base["ttft_ms"]["p50"] is not None
    assert client.get(ROLLUPS, params={"policy": "nope"}, headers=viewer).json()["groups"] == []
    limited = client.get(ROLLUPS, params={"group_by": "minute", "limit": 2}, headers=viewer).json()
    assert len(limited["groups"]) == 2
    assert limited["truncated"] is True

    bad = client.get(ROLLUPS, params={"group_by": "route,colour"}, headers=viewer)
    assert bad.status_code == 422
    assert bad.json()["errors"][0]["path"] == "group_by[1]"
    backwards = client.get(ROLLUPS, params={"from": "2026-12-02T11:00:00Z", "to": "2026-12-02T10:00:00Z"},
                           headers=viewer)
    assert backwards.status_code == 422
    assert backwards.json()["errors"][0]["path"] == "to"
    for bad_time in ("yesterday", "0.5", "1700000000", "2026-12-02"):
        refused = client.get(ROLLUPS, params={"from": bad_time}, headers=viewer)
        assert refused.status_code == 422, bad_time
        assert refused.json()["errors"][0]["path"] == "from"
    edge = client.get(ROLLUPS, params={"to": "9999-12-31T23:59:59-05:00"}, headers=viewer)
    assert edge.status_code == 422
    assert edge.json()["errors"][0]["path"] == "to"
    assert client.get(ROLLUPS, headers=worker_key).status_code == 403


def test_a_batch_of_many_bad_events_answers_and_stores_counts_and_the_first_few(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    many = MAX_EVENTS
    r = post(client, worker_key, batch("b-empty", [{}] * many))
    assert r.status_code == 200, r.text
    ack = r.json()
    assert ack["rejected_count"] == many
    assert len(ack["rejected"]) == REJECTED_KEPT
    assert [x["index"] for x in ack["rejected"]] == list(range(REJECTED_KEPT))
    assert len(r.content) < 20_000
    with db.connect() as conn:
        query = select(TelemetryBatchRecord.rejected).where(TelemetryBatchRecord.batch_id == "b-empty")
        stored = conn.execute(query).scalar_one()
    assert len(stored) == REJECTED_KEPT
    again = post(client, worker_key, batch("b-empty", [{}] * many)).json()
    assert again["duplicate"]
    assert again["rejected_count"] == many
    assert len(again["rejected"]) == REJECTED_KEPT


def test_nul_and_int32_overflow_refuse_only_their_own_event(
        client: TestClient, worker_key: dict[str, str], db: Engine) -> None:
    events = [event(0), event(1, route="\x00"), event(2, batch_size=2**31), event(3, batch_size=2**31 - 1), event(4)]
    ack = post(client, worker_key, batch("b-edges", events)).json()
    assert {rej["index"] for rej in ack["rejected"]} == {1, 2}
    assert ack["rejected_count"] == 2
    assert event_ids(db) == {"ev-0", "ev-3", "ev-4"}
