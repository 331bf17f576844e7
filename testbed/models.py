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

from pairs import TokenizerUnreadable, check_pair
from testbed import env
from testbed.paths import cache_dir, file_lock, read_stamp, write_stamp
from testbed.recipe import full_recipe, misaligned_source_digest, models_key


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


def check_aligned(paths: ModelPaths) -> None:
    """The pair's tokenizers must agree (the draft was trained with the target's); RuntimeError says what
    differs. Part of the set-up, so that a cache left half-written or edited by hand is caught before any
    engine drafts with it."""
    try:
        report = check_pair(paths.target, paths.draft)
    except TokenizerUnreadable as exc:
        raise RuntimeError(f"the testbed's models in {paths.root} cannot be checked: {exc}") from None
    if not report.aligned:
        raise RuntimeError(f"the testbed's draft and target tokenizers differ ({paths.root}): "
                           f"{report.describe()}; delete that directory to train them again")


def is_ready(recipe: dict[str, Any] | None = None) -> bool:
    recipe = recipe or full_recipe()
    return read_stamp(models_dir(recipe) / "recipe.json") == recipe


def _train(python: Path, module: str, root: Path, recipe: dict[str, Any], what: str, *, quiet: bool) -> Path:
    """Run ``python -m module --out SCRATCH --recipe FILE`` in the engine environment into a scratch directory
    beside ``root`` and return it, for the caller to check, stamp and move in whole: a reader never sees half
    a model. RuntimeError with the log's tail when it fails."""
    scratch = root.with_name(root.name + ".partial")
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    recipe_file = scratch / "recipe.json.in"
    recipe_file.write_text(json.dumps(recipe, indent=2, sort_keys=True))
    log = scratch / "train.log"
    if not quiet:
        print(f"training {what} (a few minutes; log {log})", file=sys.stderr)
    started = time.monotonic()
    with log.open("w") as out:
        result = subprocess.run(  # noqa: S603
            [str(python), "-m", module, "--out", str(scratch), "--recipe", str(recipe_file)],
            stdout=out, stderr=subprocess.STDOUT, env=env.engine_env(), check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"training {what} failed ({result.returncode}); see {log}:\n{tail}")
    recipe_file.unlink()
    if not quiet:
        print(f"{what}: ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return scratch


def ensure_models(python: Path | None = None, *, recipe: dict[str, Any] | None = None, quiet: bool = False,
                  force: bool = False) -> ModelPaths:
    """Train the pair unless this recipe's models exist; return their directories. Idempotent, concurrency-safe."""
    recipe = recipe or full_recipe()
    root = models_dir(recipe)
    if not force and is_ready(recipe):
        check_aligned(_paths(root))
        return _paths(root)
    python = python or env.ensure_env(quiet=quiet)
    with file_lock(cache_dir() / "locks" / f"models-{root.name}.lock"):
        if not force and is_ready(recipe):
            check_aligned(_paths(root))
            return _paths(root)
        scratch = _train(python, "testbed.train", root, recipe, f"the testbed models into {root}", quiet=quiet)
        check_aligned(_paths(scratch))
        write_stamp(scratch / "recipe.json", recipe)
        if root.exists():
            shutil.rmtree(root)
        scratch.replace(root)
    return _paths(root)


def misaligned_draft_dir(recipe: dict[str, Any] | None = None) -> Path:
    root = models_dir({k: v for k, v in (recipe or full_recipe()).items() if k != "misaligned_source"})
    return root.with_name(root.name + "-misaligned") / "draft"


def ensure_misaligned_draft(python: Path | None = None, *, recipe: dict[str, Any] | None = None,
                            quiet: bool = False) -> Path:
    """A draft like the testbed's, trained with a tokenizer of its own (``testbed.train_misaligned``):
    for the tokenizer check and for measuring what a misaligned pair does to acceptance. Built on demand (it is
    not part of the test set-up) and cached beside the pair; returns its directory."""
    recipe = {**(recipe or full_recipe()), "misaligned_source": misaligned_source_digest()}
    draft = misaligned_draft_dir(recipe)
    stamp = draft.parent / "recipe.json"
    if read_stamp(stamp) == recipe:
        return draft
    python = python or env.ensure_env(quiet=quiet)
    with file_lock(cache_dir() / "locks" / f"models-{draft.parent.name}.lock"):
        if read_stamp(stamp) == recipe:
            return draft
        scratch = _train(python, "testbed.train_misaligned", draft.parent, recipe,
                         f"a misaligned draft into {draft}", quiet=quiet)
        write_stamp(scratch / "recipe.json", recipe)
        if draft.parent.exists():
            shutil.rmtree(draft.parent)
        scratch.replace(draft.parent)
    return draft


@dataclass(frozen=True)
class Testbed:
    python: Path
    models: ModelPaths


def ensure(*, quiet: bool = False) -> Testbed:
    """The engine environment and the trained models, built or reused: what the engines and tests need."""
    python = env.ensure_env(quiet=quiet)
    return Testbed(python=python, models=ensure_models(python, quiet=quiet))
