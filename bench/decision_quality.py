"""Decisions judged by what clients feel, on the testbed: ``python -m bench.decision_quality``.

Every arm gets the same seeded traffic — the testbed's route mix, 30 % streams,
10 % structured output, greedy, 48 tokens at most — under a load that changes
(concurrency 1 -> 8 -> 2 -> 16 -> 1 by default, ``--stage-s`` seconds each),
on equal hardware: the same two real vLLM CPU engines run for every arm, the
plain ``base`` bound to the first half of the cores and the speculative
``draft`` (draft model, K=3) to the second half (testbed.engines' binding), so
the arms differ only in how requests are routed:

* ``plain`` (never speculate), ``spec`` (always the draft engine), ``seed``
  (the seed example: chat at batch <= 4 on the draft engine), ``testbed`` (the
  shipped testbed policy, exploration off): a ``specgate sidecar`` (kind
  worker, batch per worker) on a signed bundle of the arm's policy, against a
  stand-in control plane (``bench/cp_sink.py``);
* ``pools``: the testbed policy through ``specgate sidecar --kind gateway``
  (batch per replica: the speculative replica while it has room);
* ``autopilot``: a real control plane (``specgate serve``, SQLite) and a real
  sidecar, the policy starting always speculative with whole-worker switchback
  exploration (30 % of 5-second windows on the plain engine), the autopilot
  enabled (medium confidence, steps 50/100 %, a 20 s hold, 30 requests per
  cohort): what it changed, and when, is reported with the stage it happened in;
* ``oracle`` (computed, not run): per route and stage, the static arm whose
  requests of that route had the lowest end-to-end median.

Reported per arm and stage: end-to-end p50 (with a bootstrap 95 % interval)
and p95, TTFT p50 of the streams, requests/s, output tokens/s, the
server-side ITL median (vLLM's own per-request number), failed requests and
the share speculated; and the goals: the autopilot against the best static
arm at every stage, and within 10 % of the oracle once converged.

What 2 shared cores distort: the engines, the proxies, the control plane and
the load generator share two cores, so the arms compare routing decisions
under the same distortion; they do not predict GPU numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.loadgen import percentile
from bench.pools import (
    ALWAYS_BASE,
    ALWAYS_DRAFT,
    Engines,
    _sink,
    run_traffic,
    start_proxy,
    testbed_policy,
    wait_proxy,
)
from bench.proxy import ROOT, BenchError, Proc, _console_script, _env, _stop, free_port, spawn

STATIC_ARMS = ("plain", "spec", "seed", "testbed", "pools")
ARMS = (*STATIC_ARMS, "autopilot")
LEVELS = (1, 8, 2, 16, 1)
STRUCTURED_SHARE = 0.1
SEED_POLICY = (ROOT / "policies" / "examples" / "seed.yaml").read_text()
AUTOPILOT_POLICY = ("apiVersion: specgate/v1\nname: bench\nengines:\n  base: {method: none}\n"
                    "  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}\n"
                    "default: {engine: draft}\n"
                    "exploration: {rate: 0.3, speculative_engine: draft, window_s: 5}\n"
                    "guardrails: {max_p95_itl_regression: 0.5, max_p95_e2e_regression: 0.5, "
                    "max_retry_rate_increase: 0.05, min_samples: 30}\n")
AUTOPILOT_SETTING = {"enabled": True, "min_confidence": "medium", "steps": [50, 100], "hold_s": 20,
                     "min_samples": 30, "max_changes_per_day": 20}


def static_policy(arm: str) -> tuple[str, str]:
    """(policy text, sidecar kind) of a static arm."""
    if arm == "plain":
        return ALWAYS_BASE, "worker"
    if arm == "spec":
        return ALWAYS_DRAFT, "worker"
    if arm == "seed":
        return SEED_POLICY, "worker"
    document = yaml.safe_load(testbed_policy(("base", "draft")))
    document.pop("exploration", None)  # the static arm decides by its rules alone
    return yaml.safe_dump(document, sort_keys=False), "gateway" if arm == "pools" else "worker"


# --- the autopilot arm: a real control plane ------------------------------------------------------------

class ControlPlane:
    """``specgate serve`` on a fresh SQLite database, with an admin and a worker key and a signing key."""

    def __init__(self, work: Path, log_dir: Path) -> None:
        from controlplane.auth.local import mint_keys
        from controlplane.auth.schemas import Scope
        from controlplane.migrations_state import upgrade
        from policies import SigningKey

        self.database_url = f"sqlite:///{work / 'autopilot.db'}"
        upgrade(self.database_url)
        tokens = mint_keys(self.database_url, {"bench-admin": Scope.admin, "bench-worker": Scope.worker},
                           created_by="bench:decision_quality", pools={"bench-worker": "bench"})
        self.admin, self.worker = tokens["bench-admin"], tokens["bench-worker"]
        key = SigningKey.generate()
        self.public_key = key.public_key_b64
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = spawn("control-plane", [sys.executable, "-m", "specgate", "serve", "--host", "127.0.0.1",
                                            "--port", str(self.port)], log_dir,
                          env=_env(SPECGATE_DATABASE_URL=self.database_url,
                                   SPECGATE_SIGNING_KEY=key.private_key_b64(), SPECGATE_AUTOPILOT_INTERVAL_S="2",
                                   SPECGATE_GUARDRAIL_INTERVAL_S="0"))
        self._wait("/readyz")

    def _wait(self, path: str, timeout_s: float = 90.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.proc.check()
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + path, timeout=2) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.25)
        raise BenchError(f"the control plane is not ready after {timeout_s:.0f} s:\n{self.proc.tail()}")

    def api(self) -> Any:
        from apiclient import ApiClient

        return ApiClient(self.url, self.admin, timeout_s=30)

    def stop(self) -> None:
        _stop(self.proc.process)


def start_autopilot_arm(cp: ControlPlane, urls: dict[str, str], work: Path, log_dir: Path) -> Proc:
    from apiclient import calls

    with cp.api() as api:
        api.send(calls.create_policy("bench", pool="bench", description="bench.decision_quality"))
        api.send(calls.create_revision("bench", AUTOPILOT_POLICY, message="always speculative", if_match="*"))
        api.send(calls.set_autopilot("bench", AUTOPILOT_SETTING))
    port = free_port()
    argv = [_console_script("specgate"), "sidecar", "--control-plane", cp.url, "--listen", f"127.0.0.1:{port}",
            "--pool", "bench", "--worker-id", "bench-autopilot", "--state-dir", str(work / "autopilot-state"),
            "--public-key", cp.public_key, "--log-level", "warning"]
    for engine, url in urls.items():
        argv += ["--engine", f"{engine}={url}"]
    proc = spawn("autopilot-sidecar", argv, log_dir,
                 env=_env(SPECGATE_KEY=cp.worker, SPECGATE_EXPOSE_ENGINE_METRICS="true", SPECGATE_HEARTBEAT_S="2"))
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def autopilot_story(cp: ControlPlane, started_at: float, stage_s: float) -> list[dict[str, Any]]:
    """What the autopilot did, oldest first: seconds since the traffic started, the stage, the action, what."""
    from apiclient import calls

    with cp.api() as api:
        state = api.send(calls.autopilot("bench")).data
    out = []
    for event in reversed(state.history):
        at = event.at.timestamp() - started_at
        recommendation = event.detail.get("recommendation") or {}
        out.append({"at_s": round(at, 1), "stage": int(at // stage_s) if at >= 0 else None, "action": event.action,
                    "revision": (event.revision_id or "")[:12] or None, "kind": recommendation.get("kind"),
                    "measure": recommendation.get("measure"), "title": recommendation.get("title")})
    return out


# --- figures -------------------------------------------------------------------------------------------

def bootstrap_median(values: Sequence[float], rounds: int = 400, seed: int = 1) -> tuple[float, float] | None:
    """A percentile bootstrap 95 % interval of the median."""
    if len(values) < 5:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def _r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def stage_figures(outcomes: Sequence[Any], stage: int, stage_s: float) -> dict[str, Any]:
    mine = [o for o in outcomes if o.stage == stage]
    ok = [o for o in mine if o.error is None]
    e2e = [o.latency_s * 1000 for o in ok]
    ttft = [o.ttft_s * 1000 for o in ok if o.stream and o.ttft_s is not None]
    itl = [o.engine_itl_ms for o in ok if o.engine_itl_ms is not None]
    tokens = sum(o.completion_tokens or 0 for o in ok)
    interval = bootstrap_median(e2e)
    by_route: dict[str, float | None] = {}
    for route in sorted({o.route for o in ok}):
        values = [o.latency_s * 1000 for o in ok if o.route == route]
        by_route[route] = _r(statistics.median(values)) if values else None
    return {"requests": len(mine), "failed": len(mine) - len(ok), "requests_per_s": round(len(ok) / stage_s, 2),
            "tokens_per_s": round(tokens / stage_s, 1), "e2e_p50_ms": _r(percentile(e2e, 50)),
            "e2e_p50_interval_ms": None if interval is None else [round(interval[0], 1), round(interval[1], 1)],
            "e2e_p95_ms": _r(percentile(e2e, 95)), "ttft_p50_ms": _r(percentile(ttft, 50)),
            "server_itl_p50_ms": _r(percentile(itl, 50), 2),
            "speculated_share": _r(sum(1 for o in ok if o.engine not in (None, "base")) / len(ok), 3) if ok else None,
            "e2e_p50_by_route_ms": by_route}


def oracle(arms: dict[str, dict[str, Any]], levels: Sequence[int]) -> list[dict[str, Any]]:
    """Per stage and route, the static arm with the lowest e2e median, and the request-weighted result."""
    out = []
    for stage in range(len(levels)):
        best: dict[str, tuple[str, float]] = {}
        for arm in STATIC_ARMS:
            if arm not in arms:
                continue
            for route, value in arms[arm]["stages"][stage]["e2e_p50_by_route_ms"].items():
                if value is not None and (route not in best or value < best[route][1]):
                    best[route] = (arm, value)
        out.append({"stage": stage, "concurrency": levels[stage],
                    "by_route": {route: {"arm": arm, "e2e_p50_ms": value} for route, (arm, value) in best.items()}})
    return out


def goals(report: dict[str, Any]) -> dict[str, Any]:
    """The autopilot against the best static arm at every stage, and against the oracle per route."""
    arms, levels = report["arms"], report["levels"]
    if "autopilot" not in arms:
        return {}
    rows = []
    for stage in range(len(levels)):
        static = {a: arms[a]["stages"][stage]["e2e_p50_ms"] for a in STATIC_ARMS if a in arms}
        static = {a: v for a, v in static.items() if v is not None}
        mine = arms["autopilot"]["stages"][stage]
        best_arm = min(static, key=static.__getitem__) if static else None
        oracle_routes = report["oracle"][stage]["by_route"]
        ratios = [mine["e2e_p50_by_route_ms"][r] / o["e2e_p50_ms"] for r, o in oracle_routes.items()
                  if mine["e2e_p50_by_route_ms"].get(r) and o["e2e_p50_ms"]]
        rows.append({"stage": stage, "concurrency": levels[stage], "best_static_arm": best_arm,
                     "best_static_e2e_p50_ms": static.get(best_arm) if best_arm else None,
                     "best_static_interval_ms": arms[best_arm]["stages"][stage]["e2e_p50_interval_ms"]
                     if best_arm else None,
                     "autopilot_e2e_p50_ms": mine["e2e_p50_ms"], "autopilot_interval_ms": mine["e2e_p50_interval_ms"],
                     "autopilot_over_oracle": round(statistics.geometric_mean(ratios), 3) if ratios else None,
                     "autopilot_failed": mine["failed"]})
    return {"stages": rows}


# --- the run ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _running(proc: Proc) -> Iterator[Proc]:
    try:
        yield proc
    finally:
        _stop(proc.process)


def run(arms: Sequence[str], stage_s: float, levels: Sequence[int], seed: int, base_port: int,
        log_dir: Path | None) -> dict[str, Any]:
    report: dict[str, Any] = {"arms": {}, "stage_s": stage_s, "levels": list(levels), "seed": seed,
                              "structured_share": STRUCTURED_SHARE,
                              "machine": {"cpus": os.cpu_count(), "load1_at_start": os.getloadavg()[0]},
                              "binding": "base: first half of the cores; draft: second half (every arm)"}
    with tempfile.TemporaryDirectory(prefix="specgate-bench-dq-") as tmp:
        work = Path(tmp)
        logs = log_dir or work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        engines = Engines(work / "engines", base_port)
        try:
            urls = engines.want(("base", "draft"))
            with _sink(logs) as sink:
                for arm in arms:
                    print(f"arm {arm}", flush=True)
                    cp = ControlPlane(work, logs) if arm == "autopilot" else None
                    try:
                        if cp is not None:
                            proc = start_autopilot_arm(cp, urls, work, logs)
                        else:
                            policy, kind = static_policy(arm)
                            proc = start_proxy(arm, urls, sink.url, work, logs, policy=policy, kind=kind)
                        with _running(proc):
                            wait_proxy(proc)
                            started = time.time()
                            outcomes, elapsed = run_traffic([proc.url], stage_s, levels, seed,
                                                            structured_share=STRUCTURED_SHARE)
                        summary: dict[str, Any] = {
                            "requests": len(outcomes), "failed": sum(1 for o in outcomes if o.error),
                            "elapsed_s": round(elapsed, 1),
                            "stages": [stage_figures(outcomes, stage, stage_s) for stage in range(len(levels))]}
                        if cp is not None:
                            summary["autopilot"] = autopilot_story(cp, started, stage_s)
                    finally:
                        if cp is not None:
                            cp.stop()
                    report["arms"][arm] = summary
                    print(render_arm(arm, summary, levels), flush=True)
        finally:
            engines.stop()
    report["oracle"] = oracle(report["arms"], levels)
    report["goals"] = goals(report)
    return report


def render_arm(arm: str, summary: dict[str, Any], levels: Sequence[int]) -> str:
    lines = [f"\n{arm}: {summary['requests']} requests, {summary['failed']} failed",
             f"  {'stage':>5} {'c':>3} {'req/s':>6} {'tok/s':>7} {'p50 ms [95% CI]':>24} {'p95 ms':>8} "
             f"{'TTFT':>7} {'ITL':>6} {'spec':>5}"]
    for stage, level in enumerate(levels):
        s = summary["stages"][stage]
        ci = s["e2e_p50_interval_ms"]
        p50 = f"{s['e2e_p50_ms']} [{ci[0]:.0f}, {ci[1]:.0f}]" if ci else str(s["e2e_p50_ms"])
        share = s["speculated_share"]
        lines.append(f"  {stage:>5} {level:>3} {s['requests_per_s']:>6} {s['tokens_per_s']:>7} {p50:>24} "
                     f"{s['e2e_p95_ms'] or '-':>8} {s['ttft_p50_ms'] or '-':>7} {s['server_itl_p50_ms'] or '-':>6} "
                     f"{'-' if share is None else f'{share:.0%}':>5}")
    for event in summary.get("autopilot", []):
        lines.append(f"  autopilot t={event['at_s']} s (stage {event['stage']}): {event['action']}"
                     f"{' ' + event['revision'] if event['revision'] else ''}"
                     f"{' — ' + event['title'] + ' [' + str(event['measure']) + ']' if event['title'] else ''}")
    return "\n".join(lines)


def render_goals(report: dict[str, Any]) -> str:
    rows = report.get("goals", {}).get("stages", [])
    if not rows:
        return ""
    lines = ["\ngoals: autopilot e2e p50 against the best static arm and the oracle, per stage"]
    for r in rows:
        lines.append(f"  stage {r['stage']} (c={r['concurrency']}): autopilot {r['autopilot_e2e_p50_ms']} "
                     f"{r['autopilot_interval_ms']}, best static {r['best_static_arm']} "
                     f"{r['best_static_e2e_p50_ms']} {r['best_static_interval_ms']}; autopilot/oracle "
                     f"{r['autopilot_over_oracle']}; failed {r['autopilot_failed']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decision_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"any of {', '.join(ARMS)}")
    parser.add_argument("--stage-s", type=float, default=90.0, help="seconds per stage")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency per stage")
    parser.add_argument("--seed", type=int, default=7, help="seed of the traffic")
    parser.add_argument("--base-port", type=int, default=18900, help="first port tried for the engines")
    parser.add_argument("--out", type=Path, help="write the report (JSON) here")
    parser.add_argument("--log-dir", type=Path, help="keep the processes' logs here")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(ARMS)}")
    try:
        levels = [int(v) for v in args.levels.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--levels: not a comma-separated list of integers: {args.levels!r}")
    if not levels or min(levels) < 1:
        parser.error("--levels: at least one concurrency, each >= 1")
    if args.stage_s < 5:
        parser.error("--stage-s: at least 5 seconds")
    try:
        report = run(arms, args.stage_s, levels, args.seed, args.base_port, args.log_dir)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(render_goals(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
        print(f"\nreport: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
