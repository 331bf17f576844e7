"""How long do a summary query and the recommendation computation take over a million stored events?

Run ``python -m bench.analysis --database sqlite|postgresql|both --events 1000000 --minutes 360``.

For each database it:

1. makes a fresh, migrated database (SQLite: a temporary file; PostgreSQL: a
   throw-away database on the server of ``--pg-admin-url``, dropped afterwards)
   with a policy whose active revision is the seed rule ("speculate for chat
   and code at batch <= 4") plus exploration;
2. stores ``--events`` realistic events (``bench.ingest.make_event``: five
   routes, three engines, 3 % explored) spread evenly over ``--minutes``,
   through the telemetry service's ingest, so the per-minute rollups and their
   histograms are built as in production (not timed);
3. times, ``--repeat`` times each, in a fresh transaction:
   - ``summary``: ``GET /v1/analysis/summary``'s work, per route x engine x
     batch bucket over the whole window, p50/p95 from the rollup histograms;
   - ``summary_hourly``: the same per hour;
   - ``recommendations``: ``GET /v1/recommendations``'s work: the per-bucket
     cells (holdout split) from the rollups and the recommender, with every
     proposed edit validated;
   - ``what_if``: the what-if replay, which reads the raw events (grouped by
     request shape in SQL): reported, no goal.

Reported: median and best seconds per operation, the stored row counts, and
whether the goal (summary and recommendations under 1 s) is met.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text

from analysis.recommend import RecommendConfig
from bench.ingest import DEFAULT_PG_ADMIN_URL, fresh_database, make_event
from controlplane.analysis import service
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.migrations_state import upgrade
from controlplane.models import Policy, TelemetryEventRecord, TelemetryRollup, TelemetryRollupHistogram, utcnow
from controlplane.telemetry.repository import RollupFilter
from controlplane.telemetry.service import ParsedBatch, ingest
from policies import canonical_document, canonical_json, canonical_yaml, load_policy, revision_id
from wire.telemetry import TelemetryEvent

GOAL_S = 1.0
POLICY = """\
apiVersion: specgate/v1
name: default
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
  ngram: {method: ngram, num_speculative_tokens: 4}
rules:
  - name: no-structured
    when: {structured_output: true}
    then: {engine: base}
  - name: chat-low-batch
    when: {route: [chat], batch_size: {max: 4}}
    then: {engine: draft}
  - name: code-low-batch
    when: {route: [code], batch_size: {max: 4}}
    then: {engine: ngram}
default: {engine: base}
exploration: {rate: 0.03, speculative_engine: draft}
"""


def seed_policy(url: str) -> str:
    from controlplane.models import Revision

    doc = load_policy(POLICY)
    rid = revision_id(doc)
    normal = canonical_document(doc)
    engine = make_engine(url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            policy = Policy(name="default", created_by="bench:analysis", active_revision_id=rid)
            session.add(policy)
            session.flush()
            session.add(Revision(id=rid, policy_id=policy.id, seq=1, document=normal,
                                 canonical_json=canonical_json(normal).decode(), canonical_yaml=canonical_yaml(doc),
                                 source_text=POLICY, author="bench:analysis", message="bench"))
    finally:
        engine.dispose()
    return rid


def populate(url: str, rid: str, *, events: int, minutes: int, seed: int, chunk: int = 10_000) -> float:
    """Store ``events`` events spread over ``minutes`` minutes ending now; returns the seconds it took."""
    rng = random.Random(seed)
    end = utcnow().replace(second=0, microsecond=0)
    start = end - dt.timedelta(minutes=minutes)
    step = minutes * 60.0 / events
    run = uuid.uuid4().hex[:8]
    engine = make_engine(url)
    began = time.perf_counter()
    try:
        sessions = make_sessionmaker(engine)
        for first in range(0, events, chunk):
            batch = []
            for i in range(first, min(first + chunk, events)):
                at = start + dt.timedelta(seconds=i * step)
                data = make_event(rng, f"{run}-{i}", f"worker-{i % 10:02d}", at)
                data.update(policy="default", revision=rid, time=at, shape_prompt_tokens=data["prompt_tokens"])
                batch.append(TelemetryEvent.model_validate(data))
            with unit_of_work(sessions) as session:
                ingest(session, ParsedBatch(f"{run}-{first}", "bench", len(batch), batch, []),
                       sent_by="bench:analysis", received_at=utcnow())
            print(f"\r  stored {min(first + chunk, events):,} / {events:,}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        engine.dispose()
    return time.perf_counter() - began


def timed(sessions: Any, fn: Callable[[Any], Any], repeat: int) -> dict[str, float]:
    times = []
    for _ in range(repeat):
        with unit_of_work(sessions) as session:
            t0 = time.perf_counter()
            fn(session)
            times.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(times), 4), "best_s": round(min(times), 4)}


def measure(url: str, *, repeat: int) -> dict[str, Any]:
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    cfg = RecommendConfig()
    out: dict[str, Any] = {}
    try:
        # Planner statistics, as autovacuum keeps them on a production PostgreSQL (it is off on the
        # benchmark machine): without them PostgreSQL guesses a few rows per table and sorts the
        # histograms on disk instead of hashing them (1.4 s instead of 0.35 s for this query).
        with engine.begin() as conn:
            conn.execute(text("ANALYZE"))
        with engine.connect() as conn:
            out["rows"] = {name: int(conn.execute(select(func.count()).select_from(model)).scalar_one())
                           for name, model in (("events", TelemetryEventRecord), ("rollups", TelemetryRollup),
                                               ("histogram_rows", TelemetryRollupHistogram))}
        flt = RollupFilter(policy="default")
        ops: dict[str, Callable[[Any], Any]] = {
            "summary": lambda s: service.summaries(s, flt, ["route", "engine", "batch_bucket"], None, 10_000),
            "summary_hourly": lambda s: service.summaries(s, flt, ["route", "engine", "batch_bucket"], "hour",
                                                          100_000),
            "recommendations": lambda s: service.list_recommendations(s, "default", start=None, end=None, cfg=cfg),
            "what_if": lambda s: service.what_if(s, "default", revision=None, document=load_policy(POLICY)
                                                 .model_dump(mode="json", by_alias=True, exclude_none=True),
                                                 start=None, end=None),
        }
        for name, fn in ops.items():
            out[name] = timed(sessions, fn, repeat)
        with unit_of_work(sessions) as session:
            _, recs, _, _ = service.list_recommendations(session, "default", start=None, end=None, cfg=cfg)
        out["recommendations_found"] = [f"{r.kind}:{r.route}" for r in recs]
    finally:
        engine.dispose()
    return out


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    with fresh_database(kind, args.pg_admin_url) as url:
        upgrade(url)
        rid = seed_policy(url)
        print(f"{kind}: storing {args.events:,} events over {args.minutes} minutes", file=sys.stderr)
        load_s = populate(url, rid, events=args.events, minutes=args.minutes, seed=args.seed)
        result = {"database": kind, "events": args.events, "minutes": args.minutes, "load_s": round(load_s, 1),
                  **measure(url, repeat=args.repeat)}
    result["goal_met"] = (result["summary"]["median_s"] < GOAL_S and result["recommendations"]["median_s"] < GOAL_S)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--minutes", type=int, default=360, help="the span the events cover")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN_URL)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    kinds = ("sqlite", "postgresql") if args.database == "both" else (args.database,)
    report = {"goal_s": GOAL_S, "results": [run(kind, args) for kind in kinds]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
