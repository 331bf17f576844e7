"""The OpenAPI document names every schema once, readably: no module paths glued on with ``__``."""

from __future__ import annotations

from collections import Counter
from typing import Any

from controlplane.app import create_app
from controlplane.settings import ControlPlaneSettings


def _schema_names(openapi: dict[str, Any]) -> list[str]:
    return list(openapi["components"]["schemas"])


def _referenced_names(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"].rsplit("/", 1)[-1]] if isinstance(node.get("$ref"), str) else []
        return found + [name for value in node.values() for name in _referenced_names(value)]
    if isinstance(node, list):
        return [name for value in node for name in _referenced_names(value)]
    return []


def test_no_schema_name_carries_a_module_path(tmp_path: Any) -> None:
    # No database is touched: building the document needs only the routes.
    app = create_app(ControlPlaneSettings(database_url=f"sqlite:///{tmp_path / 'unused.db'}"))
    openapi = app.openapi()
    names = _schema_names(openapi)
    assert len(names) > 50  # the whole API, not an empty document
    assert [n for n in names if "__" in n] == []
    # components.schemas is a mapping, so uniqueness also means: no two names differ only in case,
    # which generated clients on case-insensitive file systems would write to one file
    folded = Counter(n.lower() for n in names)
    assert [n for n, count in folded.items() if count > 1] == []
    # every reference resolves to a component of that exact name
    assert set(_referenced_names(openapi["paths"])) <= set(names)
