"""What K=0 steps cost, and what an in-engine schedule pays, on the testbed: ``python -m bench.schedule``.

Four arms, the same seeded traffic each (the testbed's route mix, 30 % streams, greedy, 48 tokens at most),
one concurrency level at a time (1, 2, 4, 8, 16), real vLLM CPU engines with the testbed's trained models:

* ``plain`` — one plain engine (``base``), every request on it;
* ``spec`` — one draft-model engine (``draft``, K=3), every request on it, always drafting;
* ``scheduled`` — the same engine started with the schedule compiled from one rule, "draft while the batch
  is at most 4" (``policies.render.batch_size_schedule`` of that rule on an engine marked
  ``schedule: in_engine``: ``[[1, 4, 3], [5, 256, 0]]``); the sidecar runs that policy, so it sends every
  request to the engine and the engine drafts by its own running batch;
* ``twin`` — the same rule as routing: a worker sidecar in front of a plain and a draft engine, "draft while
  the worker's batch is at most 4, else plain".

The single-engine arms run their one vLLM server on the same cores (those the testbed gives speculative
engines: the second half of the CPUs), so that their ratios compare engines, not cores; ``twin`` runs its
plain engine on the first half as the testbed does. The load generator and the proxy are not pinned.

Reported per arm and concurrency: requests/s, end-to-end p50/p95, server-side inter-token latency (vLLM's
per-request mean ITL) median per route, output tokens/s per request (client side) median, and the draft
tokens per request (vLLM's per-request speculative summary) — the proof that the scheduled engine stops
drafting above the threshold. The **K=0 tax** is the scheduled engine's server ITL over the plain engine's at
each concurrency where its schedule says K=0 (the engine's batch is about the concurrency: it serves every
request), over the requests that drafted nothing (as requests end and arrive the running batch dips to the
threshold now and then, and those steps draft; their share is reported beside the ratio): what the
speculative machinery costs when it drafts nothing. Its confidence interval is a bootstrap of the ratio of
medians. Each arm is warmed up at the lowest and the highest level before it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.loadgen import percentile
from bench.pools import (
    ALWAYS_BASE,
    ALWAYS_DRAFT,
    ONE_THRESHOLD,
    THRESHOLD,
    Engines,
    _sink,
    run_traffic,
    start_proxy,
    wait_proxy,
)
from bench.proxy import _stop

ARMS = ("plain", "spec", "scheduled", "twin")
LEVELS = (1, 2, 4, 8, 16)
# In an order that restarts as few engines as possible: base, base+draft, draft, draft with its schedule.
ORDER = ("plain", "twin", "spec", "scheduled")
ARM_ENGINES: dict[str, tuple[str, ...]] = {"plain": ("base",), "twin": ("base", "draft"), "spec": ("draft",),
                                           "scheduled": ("draft",)}
WARMUP_S = 5.0


def in_engine_policy() -> str:
    """The one-threshold rule with its engine marked ``schedule: in_engine``."""
    data = yaml.safe_load(ONE_THRESHOLD)
    data["name"] = "one-threshold-in-engine"
    data["engines"]["draft"]["schedule"] = "in_engine"
    return yaml.safe_dump(data, sort_keys=False)


def compiled_schedule(max_num_seqs: int = 256) -> list[list[int]]:
    """What the scheduled engine is started with: the policy library's rendering of the in-engine rule."""
    from policies import load_policy
    from policies.render import batch_size_schedule

    return [list(entry) for entry in batch_size_schedule(load_policy(in_engine_policy()), "draft", max_num_seqs)]


def k_at(schedule: Sequence[Sequence[int]], batch: int) -> int:
    return next((k for lo, hi, k in schedule if lo <= batch <= hi), 0)


ARM_SETUP: dict[str, tuple[str, str]] = {  # arm -> (policy, sidecar kind)
    "plain": (ALWAYS_BASE, "gateway"),
    "spec": (ALWAYS_DRAFT, "gateway"),
    "scheduled": (in_engine_policy(), "gateway"),
    "twin": (ONE_THRESHOLD, "worker"),
}


def _r(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def level_figures(outcomes: Sequence[Any], stage_s: float) -> dict[str, Any]:
    """One arm at one concurrency level."""
    ok = [o for o in outcomes if o.error is None]
    latencies = [o.latency_s * 1000 for o in ok]
    itl_by_route: dict[str, float | None] = {}
    for route in sorted({o.route for o in ok}):
        values = [o.engine_itl_ms for o in ok if o.route == route and o.engine_itl_ms is not None]
        itl_by_route[route] = _r(statistics.median(values)) if values else None
    itl = [o.engine_itl_ms for o in ok if o.engine_itl_ms is not None]
    undrafted = [o.engine_itl_ms for o in ok if o.engine_itl_ms is not None and not o.drafted]
    rates = [o.completion_tokens / o.latency_s for o in ok if o.completion_tokens and o.latency_s > 0]
    drafted = [o.drafted for o in ok if o.drafted is not None]
    return {
        "requests": len(outcomes), "failed": len(outcomes) - len(ok),
        "requests_per_s": _r(len(ok) / stage_s),
        "e2e_p50_ms": _r(percentile(latencies, 50), 1), "e2e_p95_ms": _r(percentile(latencies, 95), 1),
        "server_itl_p50_ms": _r(statistics.median(itl)) if itl else None,
        "server_itl_p50_by_route_ms": itl_by_route,
        "tokens_per_s_p50": _r(statistics.median(rates), 1) if rates else None,
        "drafted_per_request": _r(statistics.mean(drafted)) if drafted else None,
        "drafting_share": _r(sum(1 for d in drafted if d > 0) / len(drafted), 3) if drafted else None,
        "engines": sorted({o.engine for o in ok if o.engine}),
        # dropped from the written report; kept for the tax and its interval
        "itl_samples": itl, "itl_samples_undrafted": undrafted,
    }


def ratio_of_medians(numerator: Sequence[float], denominator: Sequence[float], rounds: int = 400,
                     seed: int = 1) -> tuple[float, float, float] | None:
    """Median(numerator) / median(denominator) and a 95 % bootstrap interval; None with fewer than 5 each."""
    if len(numerator) < 5 or len(denominator) < 5:
        return None
    point = statistics.median(numerator) / statistics.median(denominator)
    rng = random.Random(seed)
    draws = sorted(statistics.median(rng.choices(numerator, k=len(numerator)))
                   / statistics.median(rng.choices(denominator, k=len(denominator))) for _ in range(rounds))
    return point, draws[int(0.025 * rounds)], draws[int(0.975 * rounds) - 1]


def k0_tax(arms: dict[str, dict[str, Any]], schedule: Sequence[Sequence[int]],
           levels: Sequence[int]) -> list[dict[str, Any]]:
    """Per concurrency: the scheduled engine's server ITL over the plain engine's (and the always-drafting
    engine's over the plain one's, for scale), with where the schedule drafts and where it does not."""
    rows = []
    for level in levels:
        row: dict[str, Any] = {"concurrency": level, "schedule_k": k_at(schedule, level)}
        plain = arms.get("plain", {}).get("levels", {}).get(str(level))
        for arm in ("scheduled", "spec", "twin"):
            mine = arms.get(arm, {}).get("levels", {}).get(str(level))
            if plain is None or mine is None:
                continue
            # Where the schedule drafts nothing, the tax reads the scheduled engine's requests that drafted nothing
            samples = mine["itl_samples_undrafted"] if arm == "scheduled" and row["schedule_k"] == 0 \
                else mine["itl_samples"]
            if arm == "scheduled":
                row["scheduled_drafting_share"] = mine.get("drafting_share")
            found = ratio_of_medians(samples, plain["itl_samples"])
            row[f"{arm}_over_plain_itl"] = None if found is None else [round(v, 3) for v in found]
            if mine["e2e_p50_ms"] and plain["e2e_p50_ms"]:
                row[f"{arm}_over_plain_e2e_p50"] = round(mine["e2e_p50_ms"] / plain["e2e_p50_ms"], 3)
        rows.append(row)
    return rows


def _without_samples(report: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(report))
    for arm in out["arms"].values():
        for figures in arm["levels"].values():
            figures.pop("itl_samples", None)
            figures.pop("itl_samples_undrafted", None)
    return out


def run(arms: Sequence[str], stage_s: float, levels: Sequence[int], seed: int, base_port: int,
        log_dir: Path | None) -> dict[str, Any]:
    schedule = compiled_schedule()
    report: dict[str, Any] = {"arms": {}, "stage_s": stage_s, "levels": list(levels), "seed": seed,
                              "schedule": schedule, "threshold": THRESHOLD,
                              "machine": {"cpus": os.cpu_count(), "load1_at_start": os.getloadavg()[0]}}
    with tempfile.TemporaryDirectory(prefix="specgate-bench-schedule-") as tmp:
        work = Path(tmp)
        logs = log_dir or work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        engines = Engines(work / "engines", base_port)
        from testbed.engines import cpu_binding

        same_cores = cpu_binding("draft") or None  # the single-engine arms' engine, wherever the variant
        report["single_engine_cores"] = (same_cores or {}).get("VLLM_CPU_OMP_THREADS_BIND", "unbound")
        try:
            with _sink(logs) as sink:
                for arm in [a for a in ORDER if a in arms]:
                    print(f"arm {arm}: engines {', '.join(ARM_ENGINES[arm])}", flush=True)
                    urls = engines.want(ARM_ENGINES[arm], {"draft": schedule} if arm == "scheduled" else None,
                                        None if arm == "twin" else same_cores)
                    policy, kind = ARM_SETUP[arm]
                    proxy = start_proxy(arm, urls, sink.url, work, logs, policy=policy, kind=kind)
                    try:
                        wait_proxy(proxy)
                        # the first compiled shapes, small and large batches, discarded
                        run_traffic([proxy.url], WARMUP_S, [min(levels), max(levels)], seed + 1000)
                        by_level = {}
                        for level in levels:
                            outcomes, _ = run_traffic([proxy.url], stage_s, [level], seed)
                            by_level[str(level)] = level_figures(outcomes, stage_s)
                    finally:
                        _stop(proxy.process)
                    report["arms"][arm] = {"levels": by_level, "proxy": proxy.info["command"]}
                    print(render_arm(arm, report["arms"][arm], levels), flush=True)
        finally:
            engines.stop()
    report["k0_tax"] = k0_tax(report["arms"], schedule, levels)
    print(render_tax(report["k0_tax"]), flush=True)
    return _without_samples(report)


def render_arm(arm: str, summary: dict[str, Any], levels: Sequence[int]) -> str:
    lines = [f"\n{arm}:", f"  {'c':>3} {'req/s':>6} {'p50 ms':>7} {'p95 ms':>7} {'ITL ms':>7} {'tok/s':>6} "
                          f"{'drafted':>7}  ITL by route"]
    for level in levels:
        f = summary["levels"][str(level)]
        routes = ", ".join(f"{r} {v}" for r, v in f["server_itl_p50_by_route_ms"].items())
        lines.append(f"  {level:>3} {f['requests_per_s']!s:>6} {f['e2e_p50_ms']!s:>7} {f['e2e_p95_ms']!s:>7} "
                     f"{f['server_itl_p50_ms']!s:>7} {f['tokens_per_s_p50']!s:>6} {f['drafted_per_request']!s:>7}"
                     f"  {routes}" + (f"  ({f['failed']} failed)" if f["failed"] else ""))
    return "\n".join(lines)


def render_tax(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["\nserver ITL over the plain engine's (median ratio [95 % interval]):"]
    for row in rows:
        parts = [f"c={row['concurrency']:<3} schedule K={row['schedule_k']}"]
        for arm in ("scheduled", "spec", "twin"):
            found = row.get(f"{arm}_over_plain_itl")
            if found:
                parts.append(f"{arm} {found[0]:.3f} [{found[1]:.3f}, {found[2]:.3f}]")
        share = row.get("scheduled_drafting_share")
        if share is not None and row["schedule_k"] == 0:
            parts.append(f"(scheduled requests that drafted: {share:.0%}, left out)")
        lines.append("  " + "; ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.schedule", description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"any of {', '.join(ARMS)}")
    parser.add_argument("--stage-s", type=float, default=30.0, help="seconds per concurrency level")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels")
    parser.add_argument("--seed", type=int, default=7, help="seed of the traffic")
    parser.add_argument("--base-port", type=int, default=18800, help="first port tried for the engines")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(ARMS)}")
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--levels: whole numbers separated by commas, got {args.levels!r}")
    if not levels or min(levels) < 1:
        parser.error(f"--levels: at least one, each 1 or more, got {args.levels!r}")
    started = time.monotonic()
    report = run(arms, args.stage_s, levels, args.seed, args.base_port, args.log_dir)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
