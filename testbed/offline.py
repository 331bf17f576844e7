"""The engine's own throughput on static batches, through ``vllm.LLM`` (no HTTP server). Runs in the engine
environment: ``python -m testbed.offline --variant ngram --target DIR --draft DIR --out FILE.json``.

One engine per process; for each route and batch size the same held-out
prompts are generated greedily once to warm up and then timed ``--reps``
times; the fastest run counts, because on a shared machine the slower ones
measure the neighbours. Acceptance comes from each output's
``spec_decode_metrics``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from testbed import corpus


def spec_config(variant: str, draft: str, ngram_k: int, draft_k: int) -> dict[str, Any] | None:
    if variant == "ngram":
        return {"method": "ngram", "num_speculative_tokens": ngram_k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if variant == "draft":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": draft_k}
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.offline")
    parser.add_argument("--variant", required=True, choices=("base", "ngram", "draft"))
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--routes", default=",".join(corpus.ROUTES))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--ngram-k", type=int, default=4)
    parser.add_argument("--draft-k", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)

    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    spec = spec_config(args.variant, args.draft, args.ngram_k, args.draft_k)
    kwargs: dict[str, Any] = {"model": args.target, "dtype": "float32", "max_model_len": 1024, "seed": 0}
    if spec is not None:
        kwargs["speculative_config"] = spec
        kwargs["per_request_spec_decode_metrics"] = "summary"
    llm = LLM(**kwargs)
    startup_s = time.monotonic() - t0
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict[str, Any]] = []
    for route in args.routes.split(","):
        examples = corpus.requests(route, max(batches), args.seed)
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}],
                                                 add_generation_prompt=True, tokenize=False) for ex in examples]
        for batch in batches:
            llm.generate(prompts[:batch], params, use_tqdm=False)  # warm-up of this shape
            times = []
            for _ in range(args.reps):
                started = time.perf_counter()
                outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
                times.append(time.perf_counter() - started)
            elapsed = min(times)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            drafted = accepted = 0
            for o in outputs:
                metrics = getattr(o.outputs[0], "spec_decode_metrics", None)
                if metrics is not None:
                    summary = metrics.to_dict()
                    drafted += summary["num_draft_tokens"]
                    accepted += summary["num_accepted_draft_tokens"]
            rows.append({"variant": args.variant, "route": route, "batch": batch, "seconds": elapsed,
                         "seconds_all": times,
                         "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
                         "draft_tokens": drafted, "accepted_tokens": accepted,
                         "acceptance": accepted / drafted if drafted else None})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.write_text(json.dumps({"variant": args.variant, "startup_s": startup_s, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
