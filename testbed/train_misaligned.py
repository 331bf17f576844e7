"""Train a draft whose tokenizer differs from the testbed target's. Runs in the engine environment.

``python -m testbed.train_misaligned --out DIR --recipe FILE.json`` (``testbed.models.ensure_misaligned_draft``
runs it) writes ``DIR/draft`` and ``DIR/report.json``: the recipe's draft, trained on the same examples and
steps as the testbed's, with a tokenizer of its own. What a pair whose tokenizers differ does to speculative
decoding is then measured, not assumed (``bench.pair``), and ``specgate check-pair`` has a real pair to
refuse. A module of its own, not an option of ``testbed.train``: that file's source is part of the pair's
recipe, and this one would retrain the pair for nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from testbed import corpus
from testbed.train import _train_in_place, build_model, encode, pack, train_tokenizer


def train(out: Path, recipe: dict[str, Any]) -> int:
    """The recipe's draft, trained on the same examples and steps, but with a tokenizer trained on every other
    example: as many tokens, merged in another order, so most ids mean other text than the target's."""
    import torch

    t_start = time.monotonic()
    torch.set_num_threads(recipe["threads"])
    random.seed(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    examples = corpus.generate(recipe["seed"], recipe["examples"], recipe["mix"])
    tok = train_tokenizer([ex.text() for ex in examples[1::2]], recipe["vocab_size"])
    encoded = [encode(tok, ex, recipe["mask_prompt"]) for ex in examples]
    rows, labels = pack(encoded, recipe["seq_len"], tok.pad_token_id)
    model = build_model(recipe["draft"], len(tok), tok)
    losses = _train_in_place("draft", model, torch.tensor(rows), torch.tensor(labels), recipe, t_start)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out / "draft", safe_serialization=True)
    tok.save_pretrained(out / "draft")
    report = {"seconds": round(time.monotonic() - t_start, 1), "vocab": len(tok),
              "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
              "tokenizer": "trained on every other example of the same corpus"}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.train_misaligned")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", type=Path, required=True, help="JSON file of the recipe")
    args = parser.parse_args(argv)
    return train(args.out, json.loads(args.recipe.read_text()))


if __name__ == "__main__":
    raise SystemExit(main())
