"""Replica pools against twin engines, on the testbed: ``python -m bench.pools``.

Four arms, the same seeded traffic each (the testbed's route mix, a
concurrency schedule of 1, 2, 4, 8, 16), real vLLM CPU engines with the
testbed's trained models:

* ``twin`` — today's worker: ``specgate sidecar`` (batch per worker) in front of
  a plain (``base``) and a speculative (``draft``) engine, the testbed policy;
* ``pools`` — ``specgate sidecar --kind gateway`` (batch per replica) in front of
  one speculative replica (``draft``) and one plain replica (``base``), the same
  policy: speculate while the speculative replica has room, spill to plain;
* ``plain`` — the gateway in front of two plain replicas, never speculating;
* ``spec`` — the gateway in front of two speculative replicas, always
  speculating (each of these two arms has two servers, as the others do);
* ``pools-2gw`` — ``pools`` with two gateway instances, the traffic split
  evenly between them (each gets half of each concurrency level, at least 1);
* ``threshold-1gw`` and ``threshold-2gw`` — the error two gateways leave: one
  gateway, then two with the traffic split, in front of the same two replicas
  under a policy with one threshold and nothing else ("draft while its batch
  is at most 4", every route, no exploration), so that every request the
  speculative engine runs beyond 4 is one a gateway sent it by not yet seeing
  the other's. A poller reads the speculative engine's own
  ``vllm:num_requests_running`` every 50 ms: how often, and by how much, it ran
  more than 4. Each gateway counts the other's requests as of its last scrape
  (docs/sidecar-request-path.md), so bursts can overshoot by what the other
  sent within one scrape interval.

Each proxy gets its policy from a signed last-known-good bundle and talks to a
stand-in control plane (``bench/cp_sink.py``); answers carry vLLM's
per-request metrics (``SPECGATE_EXPOSE_ENGINE_METRICS``), so the server-side
inter-token latency of every request is known. Reported per arm: requests/s,
end-to-end p50/p95 per concurrency, server-side ITL median per route and
concurrency, the share of requests speculated, what each replica served, and
the proxy's CPU per request (its process, user + system, over the arm).

What 2 shared cores distort: every engine, the proxy and the load generator
share the same two cores, so the "replicas" of an arm are not independent
hardware as they would be on a GPU fleet; two servers on two cores each get
about one core, and work on one slows the other. The arms compare the routing
shapes under the same distortion; they do not predict GPU numbers. The
proxy's added CPU per request is measured precisely, with a fake upstream, by
``python -m bench.proxy --peers sidecar,gateway`` (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.loadgen import percentile, tree_cpu_s
from bench.proxy import (
    ROOT,
    WORKER_KEY,
    BenchError,
    Proc,
    _console_script,
    _env,
    _stop,
    free_port,
    spawn,
    spawn_ready_line,
    write_sidecar_state,
)

ROUTES = "extract=3,classify=2,chat=3,creative=2"
LEVELS = (1, 2, 4, 8, 16)
TESTBED_POLICY = ROOT / "policies" / "examples" / "testbed.yaml"
CORPUS_SEED = 20261203
ARMS = ("twin", "pools", "pools-2gw", "threshold-1gw", "threshold-2gw", "plain", "spec")
THRESHOLD = 4
ONE_THRESHOLD = ("apiVersion: specgate/v1\nname: one-threshold\nengines:\n  base: {method: none}\n"
                 "  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}\n"
                 f"rules:\n  - name: draft-with-room\n    when: {{batch_size: {{max: {THRESHOLD}}}}}\n"
                 "    then: {engine: draft}\ndefault: {engine: base}\n")
TWO_GATEWAYS = ("pools-2gw", "threshold-2gw")
# The engines each arm runs, in an order that restarts as few as possible between arms.
ARM_ENGINES: dict[str, tuple[str, ...]] = {"twin": ("base", "draft"), "pools": ("base", "draft"),
                                           "pools-2gw": ("base", "draft"), "threshold-1gw": ("base", "draft"),
                                           "threshold-2gw": ("base", "draft"),
                                           "spec": ("draft", "draft-2"), "plain": ("base", "base-2")}
ALWAYS_BASE = "apiVersion: specgate/v1\nname: always-plain\nengines: {base: {method: none}}\ndefault: {engine: base}\n"
ALWAYS_DRAFT = ("apiVersion: specgate/v1\nname: always-speculative\nengines:\n  base: {method: none}\n"
                "  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}\n"
                "default: {engine: draft}\n")


def testbed_policy(engines: Sequence[str]) -> str:
    from specgate.stack import fit_policy

    return yaml.safe_dump(fit_policy(yaml.safe_load(TESTBED_POLICY.read_text()), set(engines)), sort_keys=False)


class Engines:
    """The testbed's vLLM engines, started and stopped per arm, tied to this process's life."""

    def __init__(self, state_dir: Path, base_port: int) -> None:
        from testbed import engines
        from testbed.models import ensure

        self.engines = engines
        self.testbed = ensure(quiet=False)
        self.state_dir = state_dir
        self.base_port = engines.free_base_port(("base", "draft", "base-2", "draft-2"), base_port)
        self.running: set[str] = set()
        self.started_with: dict[str, Any] = {}  # what each running engine was started with

    def want(self, names: Sequence[str], schedules: dict[str, list[list[int]]] | None = None,
             extra_env: dict[str, str] | None = None) -> dict[str, str]:
        """These engines and no others, each started with its draft schedule (None: none) and ``extra_env``;
        one running with other settings is restarted."""
        schedules = schedules or {}
        wanted = {n: (schedules.get(n), sorted((extra_env or {}).items())) for n in names}
        extra = sorted(self.running - set(names)
                       | {n for n in self.running & set(names) if self.started_with.get(n) != wanted[n]})
        if extra:
            self.engines.stop(extra, state_dir=self.state_dir)
            self.running -= set(extra)
        self.started_with = wanted
        t0 = time.monotonic()
        urls = self.engines.start(list(names), self.base_port, state_dir=self.state_dir, testbed=self.testbed,
                                  timeout_s=900.0, die_with_parent=True, schedules=schedules, extra_env=extra_env)
        started = sorted(set(names) - self.running)
        self.running |= set(names)
        if started:
            print(f"  engines {', '.join(started)} started in {time.monotonic() - t0:.0f} s", flush=True)
        return urls

    def stop(self) -> None:
        self.engines.stop(state_dir=self.state_dir)


def start_proxy(arm: str, urls: dict[str, str], sink: str, work: Path, log_dir: Path, instance: int = 1, *,
                policy: str | None = None, kind: str | None = None) -> Proc:
    """The arm's proxy on a signed last-known-good bundle; ``policy`` and ``kind`` override the arm's own."""
    from specgate.stack import engine_pools

    policy = policy or {"twin": testbed_policy(("base", "draft")), "plain": ALWAYS_BASE, "spec": ALWAYS_DRAFT,
                        "threshold-1gw": ONE_THRESHOLD, "threshold-2gw": ONE_THRESHOLD}.get(arm) or testbed_policy(
        ("base", "draft"))
    kind = kind or ("worker" if arm == "twin" else "gateway")
    name = f"{arm}-{instance}"
    state = work / f"{name}-state"
    key = write_sidecar_state(state, policy)
    port = free_port()
    argv = [_console_script("specgate"), "sidecar", "--kind", kind,
            "--listen", f"127.0.0.1:{port}", "--state-dir", str(state), "--public-key", key, "--key", WORKER_KEY,
            "--control-plane", sink, "--pool", "bench", "--worker-id", f"bench-{name}", "--log-level", "warning"]
    for engine, replicas in engine_pools(urls).items():
        argv += ["--engine", f"{engine}={','.join(replicas)}"]
    proc = spawn(name, argv, log_dir, env=_env(SPECGATE_EXPOSE_ENGINE_METRICS="true"))
    proc.url = f"http://127.0.0.1:{port}"
    proc.info = {"command": " ".join(argv[1:]).replace(key, "KEY")}
    return proc


def wait_proxy(proc: Proc, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.check()
        with contextlib.suppress(OSError), urllib.request.urlopen(proc.url + "/readyz", timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.25)
    raise BenchError(f"{proc.name} not ready after {timeout_s:.0f} s:\n{proc.tail()}")


def run_traffic(urls: Sequence[str], stage_s: float, levels: Sequence[int], seed: int,
                structured_share: float = 0.0) -> tuple[list[Any], float]:
    """The schedule against one proxy, or split evenly over several (each gets its share of each level; the
    seeds differ so that the proxies do not get the same requests)."""
    from sidecar.loadgen import LoadRun, build_plan, load_prompt_source

    runs = []
    for i, url in enumerate(urls):
        shares = [max(1, level // len(urls)) for level in levels]
        plan = build_plan(url=url, routes=ROUTES, schedule=",".join(f"{c}:{stage_s:g}s" for c in shares),
                          stream_share=0.3, structured_share=structured_share, max_tokens=48, temperature=0.0,
                          seed=seed + i,
                          prompts=load_prompt_source("testbed.corpus", corpus_seed=CORPUS_SEED))
        runs.append(LoadRun(plan))

    async def all_runs() -> None:
        await asyncio.gather(*(run.run() for run in runs))

    asyncio.run(all_runs())
    return [o for run in runs for o in run.outcomes], max(run.elapsed_s for run in runs)


class RunningPoller:
    """Reads one engine's own vllm:num_requests_running every 50 ms in a thread: samples over the arm."""

    def __init__(self, url: str) -> None:
        import threading

        self.url = url
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import urllib.request

        from sidecar.replicas import parse_running

        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(self.url + "/metrics", timeout=2) as resp:
                    value = parse_running(resp.read().decode())
                if value is not None:
                    self.samples.append(value)
            self._stop.wait(0.05)

    def __enter__(self) -> RunningPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self) -> dict[str, Any]:
        over = [s for s in self.samples if s > THRESHOLD]
        return {"samples": len(self.samples), "peak": max(self.samples, default=None),
                "share_over_threshold": round(len(over) / len(self.samples), 4) if self.samples else None,
                "mean_over_when_over": round(statistics.mean(s - THRESHOLD for s in over), 2) if over else 0.0}


def summarize_arm(outcomes: Sequence[Any], levels: Sequence[int], stage_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    by_level: dict[str, Any] = {}
    for stage, level in enumerate(levels):
        mine = [o for o in ok if o.stage == stage]
        latencies = [o.latency_s * 1000 for o in mine]
        by_level[str(level)] = {
            "requests": len(mine), "requests_per_s": round(len(mine) / stage_s, 2),
            "e2e_p50_ms": _round(percentile(latencies, 50)), "e2e_p95_ms": _round(percentile(latencies, 95)),
            "speculated_share": _round(sum(1 for o in mine if o.engine not in (None, "base")) / len(mine), 3)
            if mine else None,
        }
    itl: dict[str, dict[str, float | None]] = defaultdict(dict)
    for stage, level in enumerate(levels):
        for route in sorted({o.route for o in ok}):
            values = [o.engine_itl_ms for o in ok if o.stage == stage and o.route == route
                      and o.engine_itl_ms is not None]
            itl[route][str(level)] = _round(statistics.median(values)) if values else None
    return {"requests": len(outcomes), "errors": len(outcomes) - len(ok),
            "errors_by_kind": dict(Counter(o.error for o in outcomes if o.error)),
            "by_level": by_level, "engine_itl_median_ms": dict(itl),
            "replicas": dict(Counter(f"{o.engine}@{o.replica}" for o in ok))}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


@contextlib.contextmanager
def _sink(log_dir: Path) -> Iterator[Proc]:
    sink, port = spawn_ready_line("cp-sink", [sys.executable, "-m", "bench.cp_sink"], log_dir)
    sink.url = f"http://127.0.0.1:{port}"
    try:
        yield sink
    finally:
        _stop(sink.process)


def run(arms: Sequence[str], stage_s: float, levels: Sequence[int], seed: int, base_port: int,
        log_dir: Path | None) -> dict[str, Any]:
    report: dict[str, Any] = {"arms": {}, "stage_s": stage_s, "levels": list(levels), "seed": seed,
                              "routes": ROUTES, "machine": {"cpus": os.cpu_count(),
                                                            "load1_at_start": os.getloadavg()[0]}}
    order = sorted(arms, key=lambda arm: ("twin", "pools", "pools-2gw", "threshold-1gw", "threshold-2gw", "spec",
                                          "plain").index(arm))
    with tempfile.TemporaryDirectory(prefix="specgate-bench-pools-") as tmp:
        work = Path(tmp)
        logs = log_dir or work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        engines = Engines(work / "engines", base_port)
        try:
            with _sink(logs) as sink:
                for arm in order:
                    print(f"arm {arm}: engines {', '.join(ARM_ENGINES[arm])}", flush=True)
                    urls = engines.want(ARM_ENGINES[arm])
                    proxies = [start_proxy(arm, urls, sink.url, work, logs, instance)
                               for instance in range(1, 3 if arm in TWO_GATEWAYS else 2)]
                    poller = RunningPoller(urls["draft"]) if arm.startswith("threshold") else None
                    try:
                        for proxy in proxies:
                            wait_proxy(proxy)
                        cpu0 = sum(tree_cpu_s(proxy.pid) for proxy in proxies)
                        with poller or contextlib.nullcontext():
                            outcomes, elapsed = run_traffic([p.url for p in proxies], stage_s, levels, seed)
                        cpu = sum(tree_cpu_s(proxy.pid) for proxy in proxies) - cpu0
                    finally:
                        for proxy in proxies:
                            _stop(proxy.process)
                    proxy = proxies[0]
                    summary = summarize_arm(outcomes, levels, stage_s)
                    if poller is not None:
                        summary["speculative_engine_running"] = poller.summary()
                    summary["elapsed_s"] = round(elapsed, 1)
                    summary["requests_per_s"] = round(len(outcomes) / elapsed, 2) if elapsed else None
                    summary["proxy_cpu_ms_per_request"] = round(1000 * cpu / max(1, len(outcomes)), 3)
                    summary["proxy"] = proxy.info["command"]
                    report["arms"][arm] = summary
                    print(render_arm(arm, summary, levels), flush=True)
        finally:
            engines.stop()
    return report


def render_arm(arm: str, summary: dict[str, Any], levels: Sequence[int]) -> str:
    lines = [f"\n{arm}: {summary['requests']} requests, {summary['errors']} errors, "
             f"{summary['requests_per_s']} req/s, proxy CPU {summary['proxy_cpu_ms_per_request']} ms/request",
             f"  {'c':>3} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'spec':>6}"]
    for level in levels:
        row = summary["by_level"][str(level)]
        share = row["speculated_share"]
        lines.append(f"  {level:>3} {row['requests_per_s']:>7} {row['e2e_p50_ms'] or '-':>8} "
                     f"{row['e2e_p95_ms'] or '-':>8} {'-' if share is None else f'{share:.0%}':>6}")
    lines.append("  server-side ITL median ms, route x concurrency: " + "; ".join(
        f"{route} " + "/".join(str(v if v is not None else "-") for v in by_level.values())
        for route, by_level in summary["engine_itl_median_ms"].items()))
    lines.append("  served: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["replicas"].items())))
    running = summary.get("speculative_engine_running")
    if running:
        lines.append(f"  speculative engine's own running count: peak {running['peak']}, above the threshold "
                     f"({THRESHOLD}) in {running['share_over_threshold']:.1%} of {running['samples']} samples, by "
                     f"{running['mean_over_when_over']} on average when above")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pools", description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"any of {', '.join(ARMS)}")
    parser.add_argument("--stage-s", type=float, default=20.0, help="seconds per concurrency level")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels")
    parser.add_argument("--seed", type=int, default=7, help="seed of the traffic")
    parser.add_argument("--base-port", type=int, default=18700, help="first port tried for the engines")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(ARMS)}")
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    report = run(arms, args.stage_s, levels, args.seed, args.base_port, args.log_dir)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
