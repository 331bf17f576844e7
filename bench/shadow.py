"""How often greedy speculative answers differ from plain ones, on real vLLM CPU engines: ``python -m bench.shadow``.

What a shadow comparison (the policy's ``quality``) measures on live traffic, measured here on every request:
the testbed's three engines (``base`` plain, ``ngram`` k=4, ``draft`` the trained draft model k=3), the same
held-out prompts of every route, greedy (temperature 0), ``max_tokens`` 64. Each prompt is answered by the
plain engine one request at a time (the reference: what the target alone gives at batch 1), then by each
engine at concurrency 1, 4 and 8 (requests in flight, so verification runs on batches of several
sequences). An answer is compared with the reference as the sidecar compares a shadow
(``sidecar.shadow``: text, tool calls and finish reason equal; where they differ, the index of the first
token that differs, both texts tokenized by the plain engine's ``/tokenize``).

The plain engine at concurrency 4 and 8 against itself at 1 is the floor: what batching alone does to exact
outputs on this build, with no speculation. Reported per engine, concurrency and route, and per engine over
all of them: answers compared, the share equal to the reference with its 95 % Wilson interval (no
difference in n answers still leaves an upper bound on how often one would occur), and the median
first-difference position of those that differ.

    python -m bench.shadow --out bench/results-testbed/shadow.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from analysis.stats import wilson_interval
from sidecar.shadow import Answer, answer_of, common_prefix_length
from testbed import corpus, engines
from testbed.recipe import RECIPE

ENGINES = ("base", "ngram", "draft")
CONCURRENCY = (1, 4, 8)


def _ask(client: httpx.Client, prompt: str, max_tokens: int) -> Answer | None:
    response = client.post("/v1/chat/completions", json={
        "model": engines.MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0})
    return answer_of(response.json()) if response.status_code == 200 else None


def answers(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[Answer | None]:
    """Each prompt's answer, ``concurrency`` requests in flight (in prompt order, so each batch is alike)."""
    with httpx.Client(base_url=url, timeout=300) as client:
        if concurrency == 1:
            return [_ask(client, p, max_tokens) for p in prompts]
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: _ask(client, p, max_tokens), prompts))


def first_difference(base_url: str, served: Answer, plain: Answer) -> int | None:
    """As the sidecar counts it: the index of the first differing token id, both texts tokenized."""
    ids = []
    for text in (served.text, plain.text):
        response = httpx.post(base_url + "/tokenize", timeout=60, json={
            "model": engines.MODEL_NAME, "prompt": text, "add_special_tokens": False})
        if response.status_code != 200:
            return None
        ids.append(response.json()["tokens"])
    return common_prefix_length(ids[0], ids[1])


def compare(base_url: str, got: list[Answer | None], reference: list[Answer | None]) -> dict[str, Any]:
    pairs = [(g, r) for g, r in zip(got, reference, strict=True) if g is not None and r is not None]
    differ = [first_difference(base_url, g, r) for g, r in pairs if g != r]
    known = [d for d in differ if d is not None]
    return {**_rate(len(pairs), len(differ)), "failed": len(got) - len(pairs),
            "first_diff_tokens_p50": statistics.median(known) if known else None, "first_diff_tokens": sorted(known)}


def _rate(compared: int, differ: int) -> dict[str, Any]:
    interval = wilson_interval(compared - differ, compared)
    return {"compared": compared, "differ": differ,
            "match_rate": round(1 - differ / compared, 4) if compared else None,
            "match_rate_95": None if interval is None else [round(interval[0], 4), round(interval[1], 4)]}


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine_facts

    parser = argparse.ArgumentParser(prog="python -m bench.shadow", description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-route", type=int, default=24, help="held-out prompts per route")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--base-port", type=int, default=18400)
    parser.add_argument("--out", type=Path, help="write the result here as JSON")
    args = parser.parse_args(argv)
    seed = RECIPE["seed"]
    prompts = {route: [ex.prompt for ex in corpus.requests(route, args.per_route, seed)] for route in corpus.ROUTES}
    result: dict[str, Any] = {"machine": machine_facts(), "per_route": args.per_route, "max_tokens": args.max_tokens,
                              "engines": {}, "cells": []}
    with tempfile.TemporaryDirectory(prefix="specgate-shadow-") as state:
        t0 = time.monotonic()
        urls = engines.start(ENGINES, args.base_port, state_dir=Path(state), timeout_s=900, die_with_parent=True)
        result["start_s"] = round(time.monotonic() - t0, 1)
        try:
            for name in ENGINES:  # the first requests of a fresh server pay for compilation
                answers(urls[name], [p for route in corpus.ROUTES for p in prompts[route][:2]], 2, 8)
            reference = {route: answers(urls["base"], prompts[route], 1, args.max_tokens) for route in corpus.ROUTES}
            for name in ENGINES:
                for concurrency in CONCURRENCY:
                    if name == "base" and concurrency == 1:
                        continue  # the reference itself
                    for route in corpus.ROUTES:
                        got = answers(urls[name], prompts[route], concurrency, args.max_tokens)
                        cell = {"engine": name, "concurrency": concurrency, "route": route,
                                **compare(urls["base"], got, reference[route])}
                        result["cells"].append(cell)
                        print(json.dumps(cell), flush=True)
        finally:
            engines.stop(state_dir=Path(state))
    result["seconds"] = round(time.monotonic() - t0, 1)
    for name in ENGINES:
        cells = [c for c in result["cells"] if c["engine"] == name]
        result["engines"][name] = _rate(sum(c["compared"] for c in cells), sum(c["differ"] for c in cells))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
