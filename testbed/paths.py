"""Where the testbed keeps what it builds: a cache outside the repository, shared by runs and by CI on one machine."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """``$SPECGATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/specgate``, else ``~/.cache/specgate``."""
    explicit = os.environ.get("SPECGATE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specgate"


def recipe_hash(recipe: Any) -> str:
    """sha256 of the canonical JSON of a recipe: the cache key of whatever the recipe builds."""
    canonical = json.dumps(recipe, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock: concurrent builders of one artefact wait, then find it built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def read_stamp(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_stamp(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
