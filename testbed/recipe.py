"""The model recipe: everything that decides the trained models, hashed into their cache key."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from testbed.paths import recipe_hash

# Sources whose behaviour is part of the recipe: editing them makes new models.
_SOURCES = ("corpus.py", "train.py")

RECIPE: dict[str, Any] = {
    "seed": 20261203,
    "examples": 30_000,
    "mix": {"extract": 0.7, "classify": 0.08, "chat": 0.11, "creative": 0.11},
    "vocab_size": 1024,
    "seq_len": 128,
    "batch_size": 16,
    "mask_prompt": True,
    # Copying (an induction head) appears only after ~600 steps and needs well over 1000 to be reliable.
    "steps": 1800,
    "warmup_steps": 30,
    # One thread per model (the two train side by side in two processes): the same bits whether they run
    # together or in turns, and no OpenMP barrier stalls when neighbours share the cores.
    "threads": 1,
    "target": {"hidden": 96, "layers": 4, "heads": 3, "intermediate": 256, "lr": 3e-3},
    # head_dim 32 is the smallest vLLM's CPU attention accepts.
    "draft": {"hidden": 64, "layers": 1, "heads": 2, "intermediate": 128, "lr": 4e-3},
    "eval_requests": 24,
}


def source_digest() -> str:
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return digest.hexdigest()


def misaligned_source_digest() -> str:
    """What decides the misaligned draft beyond the recipe (testbed.train_misaligned)."""
    here = Path(__file__).resolve().parent
    return hashlib.sha256((here / "train_misaligned.py").read_bytes()).hexdigest()[:16]


def full_recipe(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    recipe = {**RECIPE, **(overrides or {})}
    recipe["sources"] = source_digest()
    return recipe


def models_key(recipe: dict[str, Any]) -> str:
    return recipe_hash(recipe)[:16]
