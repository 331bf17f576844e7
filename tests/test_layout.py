"""The test tree mirrors the source tree, and test modules share helpers only through ``tests.support``."""

from __future__ import annotations

import ast

from tests.support import paths

TESTS = paths.ROOT / "tests"
# Directories of tests that are not one part's: the whole product end to end, the deployment files, the
# benchmarks' own tests, and the shared data (vectors) and helpers.
NOT_A_PART = {"e2e", "deploy", "bench", "vectors", "support", "__pycache__"}


def _parts() -> set[str]:
    return {p.name for p in paths.ROOT.iterdir() if (p / "__init__.py").is_file() and p.name not in {"tests", "bench"}}


def test_every_test_directory_is_a_part_and_every_part_has_one() -> None:
    directories = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith(".")}
    parts = _parts()
    assert directories - NOT_A_PART - parts == set(), "a test directory that names no part"
    assert parts - directories == set(), "a part without tests of its own"


def _imported_test_modules(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            names = ["tests.<relative>"]
        found += [n for n in names if n == "tests" or n.startswith("tests.")]
    return found


def test_test_modules_import_only_the_shared_helpers() -> None:
    offenders = {}
    for path in TESTS.rglob("*.py"):
        if "support" in path.relative_to(TESTS).parts[:1]:
            continue
        bad = [name for name in _imported_test_modules(path.read_text())
               if not (name == "tests.support" or name.startswith("tests.support."))]
        if bad:
            offenders[str(path.relative_to(paths.ROOT))] = bad
    assert offenders == {}


def test_the_shared_helpers_import_no_test_module() -> None:
    offenders = {}
    for path in (TESTS / "support").rglob("*.py"):
        bad = [name for name in _imported_test_modules(path.read_text())
               if not name.startswith("tests.support")]
        if bad:
            offenders[path.name] = bad
    assert offenders == {}


def test_the_layout_check_sees_an_import_of_another_test_module() -> None:
    assert _imported_test_modules("from tests.sidecar.conftest import wait_for\nimport tests.support.live\n") == [
        "tests.sidecar.conftest", "tests.sidecar.conftest.wait_for", "tests.support.live"]
    assert _imported_test_modules("from .conftest import x\n") == ["tests.<relative>"]


# The packages that ship or run code; tests/ is held to its own rules above.
SOURCE_PACKAGES = ("policies", "wire", "analysis", "pairs", "apiclient", "controlplane", "sidecar", "dashboard",
                   "testbed", "specgate", "bench")


def test_every_source_module_says_what_it_is_for() -> None:
    # A reader opening any file learns its purpose from its first line; a placeholder that promises the
    # module for later outlives the day it was true, so it counts as no docstring.
    lacking = []
    for package in SOURCE_PACKAGES:
        for path in sorted((paths.ROOT / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()))
            first = doc.strip().splitlines()[0] if doc and doc.strip() else ""
            if not first or "later issue" in first or "not yet built" in first:
                lacking.append(str(path.relative_to(paths.ROOT)))
    assert lacking == []
