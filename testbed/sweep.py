"""The testbed sweep: does speculation pay, per route, method and load?

Two views, because on a 2-core machine vLLM's HTTP front end starves under
load (three busy processes plus the load client):

* HTTP: each variant's server alone, requests of one route at concurrency
  1..16; the server's own per-request ``metrics`` (TTFT, mean inter-token
  latency, speculative acceptance), the client-side aggregate tokens/s and
  how many requests were inside the engine on average (whether the
  concurrency reached the engine or queued in front of it).
* Offline: ``vllm.LLM`` on static batches of 1..32 (``testbed.offline``, in
  the engine environment): the engine's own throughput, no HTTP.

Writes ``sweep.json`` (raw) and ``sweep.md`` (tables and crossovers).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from testbed import corpus, engines, env
from testbed.models import ensure
from testbed.recipe import RECIPE

CONCURRENCY = (1, 2, 4, 8, 16)
BATCHES = (1, 2, 4, 8, 16, 32)
MAX_TOKENS = 96


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": engines.MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0}


async def _cell(url: str, prompts: Sequence[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    # aiohttp, not httpx: on 2 cores an httpx client held 16 "concurrent" requests at 20-24 requests/s and
    # kept the plain engine at about one request in flight (occupancy 0.97-1.35), where aiohttp reached
    # 41-80 requests/s and 2.6-6 in flight on the same engine. The cell's load must be the engine's.
    import aiohttp

    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict[str, Any]] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=300.0)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as client:

        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                prompt = queue.get_nowait()
                async with client.post("/v1/chat/completions", json=chat_body(prompt, max_tokens)) as response:
                    if response.status != 200:
                        await response.read()
                        errors += 1
                        continue
                    results.append(await response.json())

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return summarize(results, wall, errors)


def summarize(responses: Sequence[dict[str, Any]], wall_s: float, errors: int = 0) -> dict[str, Any]:
    """Aggregate of one cell from the engine's own per-request metrics."""
    tokens = sum(int((r.get("usage") or {}).get("completion_tokens") or 0) for r in responses)
    metrics = [r.get("metrics") or {} for r in responses]
    itl = [m["mean_itl_ms"] for m in metrics if m.get("mean_itl_ms") is not None]
    ttft = [m["time_to_first_token_ms"] for m in metrics if m.get("time_to_first_token_ms") is not None]
    spec = [m["speculative_decoding"] for m in metrics if m.get("speculative_decoding")]
    drafted = sum(int(s.get("num_draft_tokens") or 0) for s in spec)
    accepted = sum(int(s.get("num_accepted_draft_tokens") or 0) for s in spec)
    steps = sum(int(s.get("num_spec_steps") or 0) for s in spec)
    # Requests inside the engine on average (Little's law: arrival rate x time from arrival at the engine to
    # the last token). It says whether the cell's concurrency reached the engine or queued before it.
    occupancy = None
    if responses and wall_s > 0 and itl and ttft:
        per_request_s = (statistics.fmean(ttft) + statistics.fmean(itl) * max(tokens / len(responses) - 1, 0)) / 1000
        occupancy = round(len(responses) / wall_s * per_request_s, 2)
    return {
        "requests": len(responses), "errors": errors, "wall_s": round(wall_s, 3), "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "mean_itl_ms": round(statistics.fmean(itl), 3) if itl else None,
        "ttft_ms": round(statistics.fmean(ttft), 2) if ttft else None,
        "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance": round(accepted / drafted, 4) if drafted else None,
        "mean_acceptance_length": round(1 + accepted / steps, 3) if steps else None,
        "engine_occupancy": occupancy,
    }


def prompts_for(route: str, n: int, seed: int) -> list[str]:
    """Held-out requests in the models' language: ``seed`` must be the recipe's, which also draws its words."""
    return [ex.prompt for ex in corpus.requests(route, n, seed)]


def http_sweep(url: str, variant: str, routes: Sequence[str], concurrencies: Sequence[int], per_cell: int,
               max_tokens: int, seed: int) -> list[dict[str, Any]]:
    # Warm-up: the first requests of a fresh server pay for compilation and cache allocation.
    asyncio.run(_cell(url, prompts_for("chat", 4, seed), 2, max_tokens))
    rows = []
    for route in routes:
        for c in concurrencies:
            n = max(per_cell, 2 * c)
            cell = asyncio.run(_cell(url, prompts_for(route, n, seed), c, max_tokens))
            # The machine is shared: the load average says how much the neighbours took meanwhile.
            rows.append({"variant": variant, "route": route, "concurrency": c, **cell,
                         "loadavg_1m": round(os.getloadavg()[0], 2)})
            print(f"  http {variant:5s} {route:8s} c={c:2d}  {cell['tokens_per_s']} tok/s  itl "
                  f"{cell['mean_itl_ms']} ms  ttft {cell['ttft_ms']} ms  acc {cell['acceptance']}",
                  file=sys.stderr, flush=True)
    return rows


def offline_sweep(python: Path, variant: str, target: Path, draft: Path, out: Path, routes: Sequence[str],
                  batches: Sequence[int], max_tokens: int, seed: int, reps: int = 2) -> dict[str, Any]:
    cmd = [str(python), "-m", "testbed.offline", "--variant", variant, "--target", str(target), "--draft",
           str(draft), "--out", str(out), "--routes", ",".join(routes), "--batches", ",".join(map(str, batches)),
           "--max-tokens", str(max_tokens), "--seed", str(seed),
           "--ngram-k", str(engines.NGRAM_K), "--draft-k", str(engines.DRAFT_K), "--reps", str(reps)]
    # vLLM's log names local paths: it goes beside the engines' logs, not into the committed results.
    log = engines.state_dir_default() / f"offline-{variant}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as handle:
        result = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env.engine_env(),  # noqa: S603
                                check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"offline sweep of {variant} failed; log {log}:\n{tail}")
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def run(out_dir: Path, *, variants: Sequence[str] = engines.VARIANTS, routes: Sequence[str] = corpus.ROUTES,
        concurrencies: Sequence[int] = CONCURRENCY, batches: Sequence[int] = BATCHES, per_cell: int = 16,
        max_tokens: int = MAX_TOKENS, base_port: int = engines.DEFAULT_BASE_PORT, http: bool = True,
        offline: bool = True, seed: int = RECIPE["seed"], reps: int = 2) -> dict[str, Any]:
    """Run the sweep one engine at a time (so engines never compete for the cores); return and write results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    testbed = ensure()
    result: dict[str, Any] = {
        "machine": {"cpus": _cpus(), "python": platform.python_version(), "platform": platform.platform()},
        "recipe": RECIPE, "models": testbed.models.fingerprint(), "training": testbed.models.report, "settings": {
            "concurrency": list(concurrencies), "batches": list(batches), "per_cell": per_cell,
            "max_tokens": max_tokens, "ngram_k": engines.NGRAM_K, "draft_k": engines.DRAFT_K, "seed": seed,
            "offline_reps": reps},
        "startup_s": {}, "http": [], "offline": [], "offline_startup_s": {},
    }
    if http:
        for variant in variants:
            already = engines.status().get(variant, {}).get("alive", False)
            t0 = time.monotonic()
            urls = engines.start([variant], base_port)
            result["startup_s"][variant] = round(time.monotonic() - t0, 1)
            try:
                result["http"] += http_sweep(urls[variant], variant, routes, concurrencies, per_cell, max_tokens,
                                             seed)
            finally:
                if not already:
                    engines.stop([variant])
            _write(out_dir, result)  # a later failure keeps what was measured
    if offline:
        for variant in variants:
            data = offline_sweep(testbed.python, variant, testbed.models.target, testbed.models.draft,
                                 out_dir / f"offline-{variant}.json", routes, batches, max_tokens, seed, reps)
            result["offline"] += data["rows"]
            result["offline_startup_s"][variant] = round(data["startup_s"], 1)
            _write(out_dir, result)
    return result


def _write(out_dir: Path, result: dict[str, Any]) -> None:
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "sweep.md").write_text(markdown(result))


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def _index(rows: Sequence[dict[str, Any]], key: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    return {(r["variant"], r["route"], r[key]): r for r in rows}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def crossover(speedups: Sequence[tuple[int, float | None]]) -> str:
    """Where speculation pays (speedup >= 1) and where it loses, given (load, speedup) in load order.

    Both sets are listed, not just the first loss: on a shared machine one noisy cell must not read as the
    crossover.
    """
    known = [(load, s) for load, s in speedups if s is not None]
    if not known:
        return "-"
    pays = [str(load) for load, s in known if s >= 1]
    loses = [str(load) for load, s in known if s < 1]
    if not loses:
        return f"pays at every load ({', '.join(pays)})"
    if not pays:
        return f"never pays ({', '.join(loses)})"
    last_pay = max(load for load, s in known if s >= 1)
    first_loss = min(load for load, s in known if s < 1)
    shape = f"crossover between {last_pay} and {first_loss}" if last_pay < first_loss else "no clean crossover"
    return f"pays at {', '.join(pays)}; loses at {', '.join(loses)} ({shape})"


def markdown(result: dict[str, Any]) -> str:
    lines: list[str] = []
    http = result.get("http") or []
    offline = result.get("offline") or []
    variants = sorted({r["variant"] for r in http + offline}, key=engines.VARIANTS.index)
    spec_variants = [v for v in variants if v != "base"]
    routes = [r for r in corpus.ROUTES if any(row["route"] == r for row in http + offline)]
    if http:
        idx = _index(http, "concurrency")
        loads = sorted({r["concurrency"] for r in http})
        lines += ["### HTTP: server-side mean inter-token latency (ms) and speedup vs base", "",
                  "Speedup = base ITL / variant ITL at the same route and concurrency; acceptance = accepted / "
                  "drafted tokens; tok/s = completion tokens / wall time of the cell (client side); in engine = "
                  "requests inside the engine on average (requests/s x (TTFT + ITL x (tokens - 1))), what the "
                  "concurrency became at the engine.", ""]
        header = ["route", "conc"] + [f"{v} ITL" for v in variants] + [f"{v} speedup" for v in spec_variants] \
            + [f"{v} tok/s" for v in variants] + [f"{v} TTFT ms" for v in variants] \
            + [f"{v} accept" for v in spec_variants] + [f"{v} in engine" for v in variants]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for route in routes:
            for c in loads:
                row = [route, str(c)] + [_fmt(_get(idx, v, route, c, "mean_itl_ms"), 2) for v in variants]
                row += [_fmt(_ratio(_get(idx, "base", route, c, "mean_itl_ms"), _get(idx, v, route, c, "mean_itl_ms")),
                             2) for v in spec_variants]
                row += [_fmt(_get(idx, v, route, c, "tokens_per_s"), 0) for v in variants]
                row += [_fmt(_get(idx, v, route, c, "ttft_ms"), 0) for v in variants]
                row += [_fmt(_get(idx, v, route, c, "acceptance"), 2) for v in spec_variants]
                row += [_fmt(_get(idx, v, route, c, "engine_occupancy"), 1) for v in variants]
                lines.append("| " + " | ".join(row) + " |")
        lines += ["", "Crossover (HTTP, by ITL speedup):", ""]
        for route in routes:
            for v in spec_variants:
                s = [(c, _ratio(_get(idx, "base", route, c, "mean_itl_ms"), _get(idx, v, route, c, "mean_itl_ms")))
                     for c in loads]
                lines.append(f"- {route} / {v}: {crossover(s)}")
        lines.append("")
    if offline:
        idx = _index(offline, "batch")
        loads = sorted({r["batch"] for r in offline})
        lines += ["### Offline (`vllm.LLM`, static batches): output tokens/s and speedup vs base", ""]
        header = ["route", "batch"] + [f"{v} tok/s" for v in variants] + [f"{v} speedup" for v in spec_variants] \
            + [f"{v} accept" for v in spec_variants]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for route in routes:
            for b in loads:
                row = [route, str(b)] + [_fmt(_get(idx, v, route, b, "tokens_per_s"), 0) for v in variants]
                row += [_fmt(_ratio(_get(idx, v, route, b, "tokens_per_s"), _get(idx, "base", route, b,
                                                                                  "tokens_per_s")), 2)
                        for v in spec_variants]
                row += [_fmt(_get(idx, v, route, b, "acceptance"), 2) for v in spec_variants]
                lines.append("| " + " | ".join(row) + " |")
        lines += ["", "Crossover (offline, by throughput speedup):", ""]
        for route in routes:
            for v in spec_variants:
                s = [(b, _ratio(_get(idx, v, route, b, "tokens_per_s"), _get(idx, "base", route, b, "tokens_per_s")))
                     for b in loads]
                lines.append(f"- {route} / {v}: {crossover(s)}")
        lines.append("")
    return "\n".join(lines)


def _get(idx: dict[tuple[str, str, int], dict[str, Any]], variant: str, route: str, load: int,
         key: str) -> float | None:
    row = idx.get((variant, route, load))
    value = row.get(key) if row else None
    return float(value) if value is not None else None


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den
