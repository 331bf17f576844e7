"""How many telemetry events per second does a real control plane take in, rollups included?

Run ``python -m bench.ingest --database sqlite|postgresql|both --senders 10 --seconds 20 --batch-size 500``.

For each database it:

1. makes a fresh database (SQLite: a file in a temporary folder; PostgreSQL: a
   throw-away database on the server of ``--pg-admin-url``, dropped afterwards),
   migrates it and creates a worker key;
2. prepares gzip-compressed batches of realistic, unique events before the clock
   starts, as many as ``--seconds`` at ``--supply-rate`` events/s would need (the
   senders stand for sidecars on other machines, so building batches is not
   charged to the control plane; a run that uses them all up says so);
3. starts the control plane as its own process (uvicorn, ``bench.ingest_server``)
   on a free port and waits for ``/readyz``;
4. lets ``--senders`` threads POST the batches (``Content-Encoding: gzip``, as the
   sidecar sends them) for ``--seconds``, timing each POST;
5. stops, then checks in the database that every event sent is stored once, that
   the rollups count every stored event, and that every batch has its record.

Reported: events/s stored (rollups on: ingest updates them in the same
transaction), batches/s, p50/p90/p99 batch latency as the senders saw it, CPU
seconds of the control-plane process and of the database server's backends
(PostgreSQL) during the run, the same per event stored (µs), and the machine's
load average.

``--ingest-path copy|json|generic`` picks how raw events are stored
(bench/ingest_server.py); ``--compare copy,json`` runs the paths named
alternately, ``--rounds`` times each, every run on a fresh database, and
reports the medians per path and the events per CPU-second (control plane plus
PostgreSQL) of each path over the last one named.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import json
import math
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from bench.machine import machine_facts
from controlplane.auth.local import mint_keys
from controlplane.auth.schemas import Scope
from controlplane.db import make_engine
from controlplane.migrations_state import upgrade
from controlplane.models import TelemetryBatchRecord, TelemetryEventRecord, TelemetryRollup

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
GOAL_EVENTS_PER_S = 20_000
# Issue 20: events per CPU-second (control plane + PostgreSQL) of the COPY path over the JSON path.
GOAL_CPU_RATIO = 3.0
INGEST_PATHS = ("copy", "json", "generic")
URL_PATH = "/v1/telemetry/batches"

ROUTES = (("chat", 0.45), ("code", 0.2), ("summarize", 0.12), ("agent", 0.13), ("extract", 0.1))
MODELS = ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct")


# --- realistic events -------------------------------------------------------------------------

def _route(rng: random.Random) -> str:
    x = rng.random()
    for name, weight in ROUTES:
        x -= weight
        if x < 0:
            return name
    return ROUTES[-1][0]


def make_event(rng: random.Random, event_id: str, worker: str, at: dt.datetime) -> dict[str, Any]:
    """One request as a sidecar in front of vLLM would report it."""
    route = _route(rng)
    batch_size = min(1 + int(rng.expovariate(1 / 6)), 128)
    structured = route == "extract" or rng.random() < 0.05
    explored = rng.random() < 0.03
    canary = rng.random() < 0.1
    speculate = route in ("chat", "code") and batch_size <= 4 and not structured
    if explored:
        speculate = not speculate
    engine = ("draft" if route == "chat" else "ngram") if speculate else "base"
    k = 3 if engine == "draft" else (4 if engine == "ngram" else 0)
    completion = max(1, int(rng.lognormvariate(5.0, 0.8)))
    prompt = max(1, int(rng.lognormvariate(6.5, 1.0)))
    itl = rng.lognormvariate(math.log(9 + batch_size * 0.6), 0.25) * (0.6 if speculate else 1.0)
    queue = rng.expovariate(1 / (1 + batch_size))
    ttft = queue + prompt * 0.02 + rng.lognormvariate(3.0, 0.4)
    status = "ok"
    roll = rng.random()
    if roll < 0.01:
        status = "error"
    elif roll < 0.015:
        status = "client_disconnect"
    elif roll < 0.02:
        status = "upstream_error"
    event: dict[str, Any] = {
        "event_id": event_id, "request_id": f"req-{event_id}", "time": at.isoformat(), "worker_id": worker,
        "pool": "pool-a", "route": route, "model": rng.choice(MODELS), "policy": "default",
        "revision": "c0ffee" * 10 + ("beef" if canary else "0000"), "rule": "chat-low-batch" if speculate
        else "default", "engine": engine, "decided_engine": engine, "speculate": speculate,
        "num_speculative_tokens": k, "explored": explored, "canary": canary, "kill_switch": False,
        "batch_size": batch_size, "stream": rng.random() < 0.7, "structured_output": structured,
        "tools": route == "agent" and rng.random() < 0.6, "max_tokens": rng.choice([256, 512, 1024, None]),
        "prompt_tokens": prompt, "completion_tokens": completion, "ttft_ms": round(ttft, 3),
        "itl_ms": round(itl, 3), "e2e_ms": round(ttft + itl * (completion - 1), 3), "status": status,
        "http_status": 200 if status == "ok" else 502, "retries": 1 if rng.random() < 0.01 else 0,
        "fallback": False, "fallback_reason": None,
        "structured_valid": (rng.random() < 0.97) if structured else None,
        "spec_draft_tokens": None, "spec_accepted_tokens": None, "spec_acceptance_rate": None,
        "spec_mean_acceptance_length": None, "spec_steps": None,
        "engine_ttft_ms": round(ttft * 0.9, 3), "engine_itl_ms": round(itl * 0.95, 3),
        "engine_queue_ms": round(queue, 3),
    }
    if speculate:
        steps = max(1, completion // (k + 1))
        drafted = steps * k
        rate = min(1.0, max(0.0, rng.gauss(0.7 if engine == "draft" else 0.45, 0.1)))
        accepted = min(drafted, round(drafted * rate))
        event.update(spec_draft_tokens=drafted, spec_accepted_tokens=accepted,
                     spec_acceptance_rate=round(accepted / drafted, 4) if drafted else None,
                     spec_mean_acceptance_length=round(1 + accepted / steps, 3), spec_steps=steps)
    return event


def make_body(args: tuple[str, int, int, int, float]) -> bytes:
    """A gzip-compressed TelemetryBatch of ``size`` events with unique ids (picklable for a pool)."""
    run, index, size, seed, at_ts = args
    rng = random.Random(seed * 1_000_003 + index)
    worker = f"worker-{index % 10:02d}"
    at = dt.datetime.fromtimestamp(at_ts, dt.UTC)
    events = [make_event(rng, f"{run}-{index}-{i}", worker, at + dt.timedelta(milliseconds=i))
              for i in range(size)]
    body = {"batch_id": f"{run}-b{index}", "worker_id": worker, "schema_version": 1, "events": events}
    return gzip.compress(json.dumps(body, separators=(",", ":")).encode(), 6, mtime=0)


def prepare_bodies(count: int, size: int, seed: int) -> tuple[str, list[bytes]]:
    run = uuid.uuid4().hex[:8]
    now = time.time()
    jobs = [(run, i, size, seed, now) for i in range(count)]
    procs = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2, 8))
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        bodies = pool.map(make_body, jobs, chunksize=max(1, count // (procs * 8)))
    return run, bodies


# --- databases and the server -----------------------------------------------------------------

@contextlib.contextmanager
def fresh_database(kind: str, pg_admin_url: str) -> Iterator[str]:
    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="specgate-bench-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'specgate.db'}"
        return
    name = f"specgate_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(pg_admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def create_the_policy_events_name(url: str) -> None:
    # A worker key's events must name a policy that serves their pool; the revisions are not checked.
    from controlplane.db import make_sessionmaker, unit_of_work
    from controlplane.policy.service import create_policy

    engine = make_engine(url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            create_policy(session, name="default", description="bench.ingest", pool="pool-a", actor="bench:ingest")
    finally:
        engine.dispose()


def worker_key(url: str) -> str:
    # Bound to the ids make_body sends for (never registered, so a pool binding would not cover them).
    ids = [f"worker-{i:02d}" for i in range(10)]
    return mint_keys(url, {"bench-sender": Scope.worker}, created_by="bench:ingest",
                     worker_ids={"bench-sender": ids})["bench-sender"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def control_plane(url: str, *, workers: int, ingest_path: str, concurrency: int | None,
                  log: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    env = {**os.environ, "SPECGATE_DATABASE_URL": url, "PYTHONPATH": str(ROOT),
           "SPECGATE_BENCH_INGEST_PATH": ingest_path, "SPECGATE_BENCH_GENERIC_INSERT": "0"}
    if concurrency is not None:
        env["SPECGATE_TELEMETRY_INGEST_CONCURRENCY"] = str(concurrency)
    cmd = [sys.executable, "-m", "uvicorn", "--factory", "bench.ingest_server:make_app", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--no-access-log", "--workers", str(workers)]
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the control plane exited with {process.returncode}:\n{log.read_text()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the control plane was not ready in 60 s:\n{log.read_text()}")
            time.sleep(0.1)
        yield base, process.pid
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def process_tree_cpu_s(pid: int) -> float:
    """utime + stime of a process and its children (uvicorn workers), from /proc; 0 where unreadable."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    pids = [pid]
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            pids.append(int(child))
    total = 0.0
    for p in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def postgres_cpu_s(url: str) -> float | None:
    """CPU seconds of the PostgreSQL backends serving this database, when /proc shows them (same host)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            pids = list(conn.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                          "AND pid <> pg_backend_pid()")).scalars())
    finally:
        engine.dispose()
    if not pids or not Path(f"/proc/{pids[0]}/stat").exists():
        return None
    return sum(process_tree_cpu_s(p) for p in pids)


# --- sending ----------------------------------------------------------------------------------

@dataclass
class SendStats:
    latencies_ms: list[float] = field(default_factory=list)
    batches: int = 0
    events_sent: int = 0
    accepted: int = 0
    stored: int = 0
    rejected: int = 0
    failures: list[str] = field(default_factory=list)


def send_all(base: str, token: str, bodies: list[bytes], batch_size: int, senders: int,
             seconds: float) -> tuple[SendStats, float, bool]:
    stats = SendStats()
    lock = threading.Lock()
    next_index = 0
    deadline = time.perf_counter() + seconds
    exhausted = False

    def sender() -> None:
        nonlocal next_index, exhausted
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                   "Content-Encoding": "gzip"}
        with httpx.Client(base_url=base, timeout=120) as http:
            while time.perf_counter() < deadline:
                with lock:
                    if next_index >= len(bodies):
                        exhausted = True
                        return
                    body = bodies[next_index]
                    next_index += 1
                start = time.perf_counter()
                try:
                    response = http.post(URL_PATH, content=body, headers=headers)
                except httpx.HTTPError as exc:
                    with lock:
                        stats.failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                elapsed = (time.perf_counter() - start) * 1000
                with lock:
                    stats.latencies_ms.append(elapsed)
                    stats.batches += 1
                    stats.events_sent += batch_size
                    if response.status_code == 200:
                        ack = response.json()
                        stats.accepted += ack["accepted"]
                        stats.stored += ack["stored"]
                        stats.rejected += len(ack["rejected"])
                    else:
                        stats.failures.append(f"HTTP {response.status_code}: {response.text[:300]}")

    threads = [threading.Thread(target=sender, name=f"sender-{i}") for i in range(senders)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stats, time.perf_counter() - start, exhausted


def verify(url: str, stats: SendStats) -> dict[str, Any]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            stored = conn.execute(select(func.count()).select_from(TelemetryEventRecord)).scalar_one()
            rolled = conn.execute(select(func.coalesce(func.sum(TelemetryRollup.requests), 0))).scalar_one()
            rollup_rows = conn.execute(select(func.count()).select_from(TelemetryRollup)).scalar_one()
            batches = conn.execute(select(func.count()).select_from(TelemetryBatchRecord)).scalar_one()
    finally:
        engine.dispose()
    ok = (stored == stats.events_sent == stats.stored and int(rolled) == stored and batches == stats.batches
          and not stats.failures)
    return {"events_in_db": stored, "events_in_rollups": int(rolled), "rollup_rows": rollup_rows,
            "batch_records": batches, "ok": ok}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_one(kind: str, args: argparse.Namespace, ingest_path: str | None = None) -> dict[str, Any]:
    path = ingest_path or args.ingest_path
    batches_needed = max(args.senders * 2, math.ceil(args.seconds * args.supply_rate / args.batch_size))
    t = time.perf_counter()
    run, bodies = prepare_bodies(batches_needed, args.batch_size, args.seed)
    prepare_s = time.perf_counter() - t
    with fresh_database(kind, args.pg_admin_url) as url, tempfile.TemporaryDirectory() as tmp:
        upgrade(url)
        create_the_policy_events_name(url)
        token = worker_key(url)
        with control_plane(url, workers=args.workers, ingest_path=path,
                           concurrency=args.ingest_concurrency, log=Path(tmp) / "server.log") as (base, pid):
            load_before = os.getloadavg()
            cpu_server = process_tree_cpu_s(pid)
            cpu_db = postgres_cpu_s(url) if kind == "postgresql" else None
            stats, elapsed, exhausted = send_all(base, token, bodies, args.batch_size, args.senders, args.seconds)
            cpu_server = process_tree_cpu_s(pid) - cpu_server
            cpu_db_after = postgres_cpu_s(url) if kind == "postgresql" else None
            load_after = os.getloadavg()
        check = verify(url, stats)
    lat = stats.latencies_ms
    cpu_pg = cpu_db_after - cpu_db if cpu_db is not None and cpu_db_after is not None else None
    return {
        "database": kind, "run": run, "senders": args.senders, "seconds": args.seconds,
        "batch_size": args.batch_size, "workers": args.workers,
        "ingest_concurrency": args.ingest_concurrency or "default",
        "ingest_path": path,
        "prepared_batches": len(bodies), "prepare_s": round(prepare_s, 2),
        "mean_body_bytes": round(statistics.fmean(len(b) for b in bodies)),
        "supply_exhausted": exhausted, "elapsed_s": round(elapsed, 3), "batches": stats.batches,
        "events_sent": stats.events_sent, "events_stored": stats.stored,
        "events_per_s": round(stats.stored / elapsed, 1) if elapsed else 0.0,
        "batches_per_s": round(stats.batches / elapsed, 2) if elapsed else 0.0,
        "latency_ms": {"p50": round(percentile(lat, 0.5), 2), "p90": round(percentile(lat, 0.9), 2),
                       "p99": round(percentile(lat, 0.99), 2), "max": round(max(lat), 2) if lat else None},
        "cpu_s": {"control_plane": round(cpu_server, 2), "postgres": None if cpu_pg is None else round(cpu_pg, 2)},
        "cpu_us_per_event": cpu_per_event(cpu_server, cpu_pg, stats.stored),
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
        "failures": stats.failures[:5], "failure_count": len(stats.failures), "verify": check,
    }


def cpu_per_event(cpu_server: float, cpu_pg: float | None, events: int) -> dict[str, float | None] | None:
    """CPU µs per event stored: the control plane's, PostgreSQL's (None where not measured) and their sum."""
    if not events:
        return None
    server = cpu_server / events * 1e6
    pg = None if cpu_pg is None else cpu_pg / events * 1e6
    return {"control_plane": round(server, 2), "postgres": None if pg is None else round(pg, 2),
            "sum": round(server + (pg or 0.0), 2)}


def machine() -> dict[str, Any]:
    return {**machine_facts(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def format_result(r: dict[str, Any]) -> str:
    lat = r["latency_ms"]
    lines = [
        f"{r['database']:<10} {r['events_per_s']:>10,.0f} events/s  {r['batches_per_s']:>7.1f} batches/s  "
        f"batch latency p50 {lat['p50']:.1f} ms, p90 {lat['p90']:.1f} ms, p99 {lat['p99']:.1f} ms  "
        f"({r['ingest_path']} path, gate {r['ingest_concurrency']}, {r['workers']} worker"
        f"{'s' if r['workers'] != 1 else ''})",
        f"{'':<10} {r['events_stored']:,} events in {r['batches']} batches over {r['elapsed_s']:.1f} s; "
        f"CPU s: control plane {r['cpu_s']['control_plane']}, postgres {r['cpu_s']['postgres']} "
        f"(µs/event {r['cpu_us_per_event']}); load {r['load_average']['before']} -> {r['load_average']['after']}",
        f"{'':<10} verify: {r['verify']}" + ("  SUPPLY EXHAUSTED (raise --supply-rate)"
                                             if r["supply_exhausted"] else ""),
    ]
    if r["failure_count"]:
        lines.append(f"{'':<10} {r['failure_count']} failed POSTs, e.g. {r['failures'][:2]}")
    return "\n".join(lines)


def _paths(value: str) -> list[str]:
    paths = [p.strip() for p in value.split(",") if p.strip()]
    unknown = [p for p in paths if p not in INGEST_PATHS]
    if unknown or len(paths) < 2 or len(set(paths)) != len(paths):
        raise argparse.ArgumentTypeError(f"two or more distinct paths of {', '.join(INGEST_PATHS)}, comma-separated")
    return paths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--senders", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes of the control plane")
    parser.add_argument("--supply-rate", type=float, default=40_000,
                        help="events/s the prepared batches can sustain for --seconds (default 40000)")
    parser.add_argument("--ingest-path", choices=INGEST_PATHS, default="copy",
                        help="how raw events are stored: copy (binary COPY on PostgreSQL, the default), json "
                             "(the JSON INSERT ... ON CONFLICT statement), generic (SQLAlchemy's executemany)")
    parser.add_argument("--generic-insert", dest="ingest_path", action="store_const", const="generic",
                        help="the same as --ingest-path generic")
    parser.add_argument("--compare", type=_paths, default=None, metavar="PATH,PATH[,...]",
                        help="run these ingest paths alternately (--rounds each, a fresh database every run) "
                             "and compare them with the last one named, e.g. copy,json")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each path with --compare (default 3)")
    parser.add_argument("--ingest-concurrency", type=int, default=None,
                        help="SPECGATE_TELEMETRY_INGEST_CONCURRENCY for the control plane (default: its default)")
    parser.add_argument("--pg-admin-url", default=os.environ.get("SPECGATE_TEST_POSTGRES_URL", DEFAULT_PG_ADMIN_URL))
    parser.add_argument("--seed", type=int, default=20261202)
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def compare(results: list[dict[str, Any]], paths: list[str]) -> dict[str, Any]:
    """Medians per path of one database's runs, and each path's events per CPU-second over the last path's.

    ``ratio_paired`` is the median of the round-by-round ratios (each round ran every path back to back, so
    a neighbour's load that drifts over the whole run cancels out of it); ``ratio`` is that of the medians.
    """
    by_path = {p: [r for r in results if r["ingest_path"] == p] for p in paths}
    summary: dict[str, Any] = {}
    for path, runs in by_path.items():
        per_event = [r["cpu_us_per_event"] or {} for r in runs]
        total = _median([e.get("sum") for e in per_event])
        summary[path] = {
            "runs": len(runs),
            "events_per_s": _median([r["events_per_s"] for r in runs]),
            "events_per_s_runs": [r["events_per_s"] for r in runs],
            "cpu_s_control_plane": _median([r["cpu_s"]["control_plane"] for r in runs]),
            "cpu_s_postgres": _median([r["cpu_s"]["postgres"] for r in runs]),
            "cpu_us_per_event": {"control_plane": _median([e.get("control_plane") for e in per_event]),
                                 "postgres": _median([e.get("postgres") for e in per_event]), "sum": total},
            "sum_us_runs": [e.get("sum") for e in per_event],
            "events_per_cpu_s": round(1e6 / total) if total else None,
        }
    base = paths[-1]
    base_sums = summary[base]["sum_us_runs"]
    for path in paths[:-1]:
        mine = summary[path]["sum_us_runs"]
        paired = [b / m for m, b in zip(mine, base_sums, strict=False) if m and b]
        total, base_total = summary[path]["cpu_us_per_event"]["sum"], summary[base]["cpu_us_per_event"]["sum"]
        summary[path]["vs"] = base
        summary[path]["ratio"] = round(base_total / total, 2) if total and base_total else None
        summary[path]["ratio_paired"] = round(statistics.median(paired), 2) if paired else None
    return summary


def format_comparison(kind: str, summary: dict[str, Any]) -> str:
    lines = [f"{kind}: medians per path"]
    for path, s in summary.items():
        us = s["cpu_us_per_event"]
        line = (f"  {path:<8} {s['events_per_s']:>10,.0f} events/s {s['events_per_s_runs']}  CPU s: control plane "
                f"{s['cpu_s_control_plane']}, postgres {s['cpu_s_postgres']}  µs/event: control plane "
                f"{us['control_plane']}, postgres {us['postgres']}, sum {us['sum']}  "
                f"({s['events_per_cpu_s']:,} events per CPU-s)")
        if "vs" in s:
            line += f"  x{s['ratio']} of {s['vs']} (paired rounds: x{s['ratio_paired']})"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    kinds = ["sqlite", "postgresql"] if args.database == "both" else [args.database]
    facts = machine()
    print(f"python {facts['python']} on {facts['cpu']} ({facts['nproc']} CPUs), load average "
          f"{facts['load_average_at_start']}; {args.senders} senders x {args.seconds:g} s, "
          f"{args.batch_size} events per batch", flush=True)
    results = []
    comparisons: dict[str, Any] = {}
    for kind in kinds:
        if args.compare is None:
            result = run_one(kind, args)
            results.append(result)
            print(format_result(result), flush=True)
            continue
        runs = []
        for round_ in range(args.rounds):
            # each round starts with the next path, so none always runs first (or right after another)
            shift = round_ % len(args.compare)
            for path in args.compare[shift:] + args.compare[:shift]:
                result = run_one(kind, args, path)
                result["round"] = round_
                runs.append(result)
                print(f"[round {round_ + 1}/{args.rounds}] " + format_result(result), flush=True)
        results.extend(runs)
        comparisons[kind] = compare(runs, args.compare)
        print(format_comparison(kind, comparisons[kind]), flush=True)
    pg_runs = [r for r in results if r["database"] == "postgresql"]
    goal_path = args.compare[0] if args.compare else args.ingest_path
    goal_rate = _median([r["events_per_s"] for r in pg_runs if r["ingest_path"] == goal_path]) if pg_runs else None
    report: dict[str, Any] = {"machine": facts, "results": results,
                              "goal": {"events_per_s_postgresql": GOAL_EVENTS_PER_S,
                                       "met": goal_rate >= GOAL_EVENTS_PER_S if goal_rate is not None else None}}
    if goal_rate is not None:
        print(f"goal >= {GOAL_EVENTS_PER_S:,} events/s into PostgreSQL: "
              f"{'met' if report['goal']['met'] else 'NOT met'} ({goal_rate:,.0f}, {goal_path} path"
              f"{', median' if args.compare else ''})")
    if comparisons:
        report["comparison"] = comparisons
        pg = comparisons.get("postgresql", {})
        copy = pg.get("copy", {})
        if copy.get("vs") == "json":
            met = (copy["ratio_paired"] or 0) >= GOAL_CPU_RATIO
            report["goal"]["cpu_ratio_copy_vs_json"] = {"goal": GOAL_CPU_RATIO, "ratio": copy["ratio"],
                                                        "ratio_paired": copy["ratio_paired"], "met": met}
            print(f"goal >= {GOAL_CPU_RATIO:g}x events per CPU-second, copy over json: "
                  f"{'met' if met else 'NOT met'} (x{copy['ratio_paired']} paired, x{copy['ratio']} of the medians)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    report = main()
    sys.exit(0 if all(r["verify"]["ok"] for r in report["results"]) else 1)
