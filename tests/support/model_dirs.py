"""Model directories as Hugging Face fast tokenizers save them, small enough to write in a test: what the
tokenizer-pair check (pairs.tokenizers) reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
SPECIALS = ["<|pad|>", "<|user|>", "<|end|>"]


def write_model(directory: Path, tokens: list[str], *, eos: str = "<|end|>", template: str | None = TEMPLATE,
                rows: int | None = None, fmt: str = "bpe") -> Path:
    """A model directory as a fast tokenizer saves it: specials first (ids 0..2), then ``tokens``."""
    directory.mkdir(parents=True, exist_ok=True)
    added = [{"id": i, "content": t, "special": True} for i, t in enumerate(SPECIALS)]
    vocab_ids = {t: len(SPECIALS) + i for i, t in enumerate(tokens)}
    if fmt == "bpe":
        model: dict[str, Any] = {"type": "BPE", "vocab": {**{t: i for i, t in enumerate(SPECIALS)}, **vocab_ids},
                                 "merges": []}
        (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "added_tokens": added,
                                                              "model": model}))
    elif fmt == "unigram":
        pieces = [[t, 0.0] for t in SPECIALS] + [[t, -1.0] for t in tokens]
        (directory / "tokenizer.json").write_text(json.dumps({"added_tokens": added,
                                                              "model": {"type": "Unigram", "vocab": pieces}}))
    else:
        (directory / "vocab.json").write_text(json.dumps({**{t: i for i, t in enumerate(SPECIALS)}, **vocab_ids}))
    config: dict[str, Any] = {"bos_token": "<|user|>", "eos_token": eos,
                              "pad_token": {"content": "<|pad|>", "special": True}}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "config.json").write_text(json.dumps({"vocab_size": rows or len(SPECIALS) + len(tokens)}))
    return directory
