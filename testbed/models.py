"""The trained model pair, built once per recipe and kept in the cache."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed import env
from testbed.paths import cache_dir, file_lock, read_stamp, write_stamp
from testbed.recipe import full_recipe, models_key


@dataclass(frozen=True)
class ModelPaths:
    root: Path
    target: Path
    draft: Path

    @property
    def report(self) -> dict[str, Any]:
        data = read_stamp(self.root / "report.json")
        return data or {}

    def fingerprint(self) -> dict[str, str]:
        """sha256 (first 16 hex digits) of each model's weights: which models a measurement was made with.

        The recipe does not pin the weights across machines: the same recipe trained on another CPU (other
        vector kernels, other rounding) learns other models, with other acceptance per route, so a recorded
        sweep only describes the models whose fingerprint it carries.
        """
        out = {}
        for name, directory in (("target", self.target), ("draft", self.draft)):
            digest = hashlib.sha256()
            with (directory / "model.safetensors").open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
            out[name] = digest.hexdigest()[:16]
        return out


def models_dir(recipe: dict[str, Any] | None = None) -> Path:
    return cache_dir() / "models" / models_key(recipe or full_recipe())


def _paths(root: Path) -> ModelPaths:
    return ModelPaths(root=root, target=root / "target", draft=root / "draft")


def is_ready(recipe: dict[str, Any] | None = None) -> bool:
    recipe = recipe or full_recipe()
    return read_stamp(models_dir(recipe) / "recipe.json") == recipe


def ensure_models(python: Path | None = None, *, recipe: dict[str, Any] | None = None, quiet: bool = False,
                  force: bool = False) -> ModelPaths:
    """Train the pair unless this recipe's models exist; return their directories. Idempotent, concurrency-safe."""
    recipe = recipe or full_recipe()
    root = models_dir(recipe)
    if not force and is_ready(recipe):
        return _paths(root)
    python = python or env.ensure_env(quiet=quiet)
    with file_lock(cache_dir() / "locks" / f"models-{root.name}.lock"):
        if not force and is_ready(recipe):
            return _paths(root)
        # Train into a scratch directory and move it in whole: a reader never sees half a model.
        scratch = root.with_name(root.name + ".partial")
        if scratch.exists():
            shutil.rmtree(scratch)
        scratch.mkdir(parents=True)
        recipe_file = scratch / "recipe.json.in"
        recipe_file.write_text(json.dumps(recipe, indent=2, sort_keys=True))
        log = scratch / "train.log"
        if not quiet:
            print(f"training the testbed models into {root} (a few minutes; log {log})", file=sys.stderr)
        started = time.monotonic()
        with log.open("w") as out:
            result = subprocess.run(  # noqa: S603
                [str(python), "-m", "testbed.train", "--out", str(scratch), "--recipe", str(recipe_file)],
                stdout=out, stderr=subprocess.STDOUT, env=env.engine_env(), check=False)
        if result.returncode != 0:
            tail = "\n".join(log.read_text().splitlines()[-30:])
            raise RuntimeError(f"training failed ({result.returncode}); see {log}:\n{tail}")
        recipe_file.unlink()
        write_stamp(scratch / "recipe.json", recipe)
        if root.exists():
            shutil.rmtree(root)
        scratch.replace(root)
        if not quiet:
            print(f"models ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return _paths(root)


@dataclass(frozen=True)
class Testbed:
    python: Path
    models: ModelPaths


def ensure(*, quiet: bool = False) -> Testbed:
    """The engine environment and the trained models, built or reused: what the engines and tests need."""
    python = env.ensure_env(quiet=quiet)
    return Testbed(python=python, models=ensure_models(python, quiet=quiet))
