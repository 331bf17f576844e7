"""What a draft whose tokenizer differs from its target's does to speculative decoding, on real vLLM CPU
engines: ``python -m bench.pair``.

Two arms, one after the other on the same machine, the same held-out requests (every route, greedy,
one at a time): the testbed's target with its own draft (tokenizers aligned: the draft was trained with the
target's), and with a draft trained on the same examples and steps but with a tokenizer of its own
(``testbed.train_misaligned``: as many tokens, merged in another order). Reported per arm: what
``specgate check-pair`` says of the pair, whether vLLM starts it, and per route the acceptance rate
(accepted / drafted tokens, vLLM's per-request metrics), the mean accepted length and the server's
inter-token latency, as medians over the requests. It stops the engines when done.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def measure(url: str, routes: list[str], per_route: int, max_tokens: int, seed: int) -> dict[str, Any]:
    import httpx

    from testbed import corpus, engines

    out: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for route in routes:
            drafted = accepted = 0
            acceptance: list[float] = []
            length: list[float] = []
            itl: list[float] = []
            failed = 0
            for example in corpus.requests(route, per_route, seed):
                answer = client.post("/v1/chat/completions", json={
                    "model": engines.MODEL_NAME, "messages": [{"role": "user", "content": example.prompt}],
                    "max_tokens": max_tokens, "temperature": 0})
                if answer.status_code != 200:
                    failed += 1
                    continue
                metrics = answer.json().get("metrics") or {}
                spec = metrics.get("speculative_decoding") or {}
                d, a = spec.get("num_draft_tokens"), spec.get("num_accepted_draft_tokens")
                if isinstance(d, int) and isinstance(a, int) and d > 0:
                    drafted, accepted = drafted + d, accepted + a
                    acceptance.append(a / d)
                if isinstance(spec.get("mean_acceptance_length"), int | float):
                    length.append(float(spec["mean_acceptance_length"]))
                if isinstance(metrics.get("mean_itl_ms"), int | float):
                    itl.append(float(metrics["mean_itl_ms"]))
            out[route] = {"requests": per_route - failed, "failed": failed,
                          "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                          "acceptance_p50": _median(acceptance), "mean_acceptance_length_p50": _median(length),
                          "server_itl_ms_p50": _median(itl)}
    return out


def run_arm(name: str, draft: Path, base_port: int, routes: list[str], per_route: int, max_tokens: int,
            seed: int) -> dict[str, Any]:
    from pairs import check_pair
    from testbed import engines
    from testbed.models import ModelPaths, Testbed, ensure

    testbed = ensure(quiet=False)
    pair = check_pair(testbed.models.target, draft)
    # the draft's directory under the testbed's model cache (where the cache is belongs to the machine)
    arm: dict[str, Any] = {"draft": f"{draft.parent.name}/{draft.name}", "check_pair": {"aligned": pair.aligned,
                                                               "says": pair.describe(), "ids_differ": pair.ids_differ}}
    paths = ModelPaths(root=testbed.models.root, target=testbed.models.target, draft=draft)
    with tempfile.TemporaryDirectory(prefix=f"specgate-pair-{name}-") as state:
        t0 = time.monotonic()
        try:
            urls = engines.start(["draft"], base_port, state_dir=Path(state), testbed=Testbed(testbed.python, paths),
                                 timeout_s=900, die_with_parent=True)
        except (RuntimeError, TimeoutError) as exc:
            arm["started"] = False
            arm["error"] = str(exc)[-2000:]
            return arm
        arm["started"], arm["start_s"] = True, round(time.monotonic() - t0, 1)
        try:
            arm["routes"] = measure(urls["draft"], routes, per_route, max_tokens, seed)
        finally:
            engines.stop(state_dir=Path(state))
    return arm


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine_facts
    from testbed import corpus
    from testbed.models import ensure, ensure_misaligned_draft

    parser = argparse.ArgumentParser(prog="python -m bench.pair", description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-route", type=int, default=12, help="requests per route and arm")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--base-port", type=int, default=18300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    testbed = ensure(quiet=False)
    misaligned = ensure_misaligned_draft(testbed.python)
    routes = list(corpus.ROUTES)
    result: dict[str, Any] = {"machine": machine_facts(), "per_route": args.per_route, "max_tokens": args.max_tokens,
                              "arms": {}}
    for name, draft in (("aligned", testbed.models.draft), ("misaligned", misaligned)):
        result["arms"][name] = run_arm(name, draft, args.base_port, routes, args.per_route, args.max_tokens,
                                       args.seed)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
