"""The documents name files and functions that exist, so that they fail the tests when code moves under them."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import paths

ROOT = paths.ROOT
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("policies", "wire", "analysis", "pairs", "apiclient", "controlplane", "sidecar", "dashboard",
            "testbed", "specgate", "bench")
TRACE_HEADING = "## One request, through the loop"
MAX_TRACED_FILES = 10

# `something/file.py`, `controlplane/telemetry/`: a repository path in backticks (no spaces, no placeholders).
PATH_TOKEN = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/(?:[\w.-]+)?$")
DOTTED_TOKEN = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+$")
# A path of a file inside the repository, anywhere in a document's text (not part of a longer path or URL).
FILE_IN_TEXT = re.compile(r"(?<![\w./$-])((?:[\w-]+/)+[\w.-]+\.(?:py|md|yaml|yml|json|toml|sh|ini))\b")


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _resolve(dotted: str) -> tuple[ModuleType, Any]:
    """The module a dotted name lives in, and the object it names (ImportError/AttributeError when gone)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not dotted.startswith(exc.name):
                raise  # a module that exists but fails to import its own dependency
            continue
        obj: Any = module
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return module, obj
    raise ImportError(dotted)


def _architecture() -> str:
    return ARCHITECTURE.read_text()


def test_every_path_the_architecture_names_exists() -> None:
    text = _architecture()
    named = [t for t in _backticked(text) if PATH_TOKEN.match(t) and not t.startswith("/")]
    named += [f"docs/{link}" for link in re.findall(r"\]\(([\w.-]+\.md)\)", text)]
    assert len(named) > 30, "the paths were not found: did the document's notation change?"
    assert [p for p in named if not (ROOT / p).exists()] == []


def test_every_module_name_the_architecture_names_resolves() -> None:
    named = sorted({t for t in _backticked(_architecture()) if DOTTED_TOKEN.match(t)})
    assert len(named) > 20, "the dotted names were not found: did the document's notation change?"
    missing = []
    for dotted in named:
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{dotted}: {exc}")
    assert missing == []


def _traced_files(section: str) -> set[str]:
    files = set()
    for token in _backticked(section):
        if PATH_TOKEN.match(token) and token.endswith(".py"):
            files.add(token)
        elif DOTTED_TOKEN.match(token):
            module, _ = _resolve(token)
            files.add(str(Path(module.__file__ or "").resolve().relative_to(ROOT)))
    return files


def test_the_traced_request_stays_within_ten_files() -> None:
    files = _traced_files(_section(_architecture(), TRACE_HEADING))
    # From the sidecar's request path to the recommender: the loop the section promises.
    assert {"sidecar/proxy.py", "wire/telemetry.py", "analysis/recommend.py"} <= files
    assert len(files) <= MAX_TRACED_FILES, sorted(files)


def test_the_trace_count_sees_files_named_by_path_and_by_module() -> None:
    section = "`sidecar/proxy.py` `wire.telemetry.TelemetryEvent` `analysis.rollup.aggregate` `sidecar/proxy.py`"
    assert _traced_files(section) == {"sidecar/proxy.py", "wire/telemetry.py", "analysis/rollup.py"}


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def test_the_architecture_describes_every_import_contract() -> None:
    section = _section(_architecture(), "## What may import what")
    described = set(_backticked(section))
    assert [c["id"] for c in _contracts() if c["id"] not in described] == []


def test_the_layer_diagram_follows_the_layers_contract() -> None:
    (layers,) = [c["layers"] for c in _contracts() if c["type"] == "layers"]
    diagram = _section(_architecture(), "## What may import what").split("```")[1].splitlines()

    def line_of(package: str) -> int:
        found = [i for i, line in enumerate(diagram) if re.search(rf"(?<![\w.]){package}(?![\w.])", line)]
        assert found, f"{package} is not in the diagram"
        return found[0]

    rows = [{line_of(p.strip()) for p in layer.split("|")} for layer in layers]
    assert all(len(row) == 1 for row in rows), "siblings of one layer drawn on different lines"
    order = [row.pop() for row in rows]
    assert order == sorted(order), "the diagram's order is not the contract's, top to bottom"


def _parts() -> list[str]:
    return sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests")


def test_the_readme_layout_names_every_part() -> None:
    layout = _section((ROOT / "README.md").read_text(), "## Layout")
    expected = [*_parts(), "migrations", "tests", "docs", "deploy"]
    assert [part for part in expected if f"`{part}/" not in layout] == []


@pytest.mark.parametrize("document", ["README.md", "BENCHMARKS.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_every_repository_file_a_document_names_exists(document: str) -> None:
    top = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    named = {m for m in FILE_IN_TEXT.findall((ROOT / document).read_text()) if m.split("/")[0] in top}
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


def test_the_file_pattern_skips_urls_absolute_and_hidden_paths() -> None:
    text = "see tests/support/paths.py, /tmp/x/out.json, ../schema/a.json, .specgate/run.json, http://h/x/y.py"
    assert FILE_IN_TEXT.findall(text) == ["tests/support/paths.py"]
