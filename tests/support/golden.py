"""Golden files of rendered engine configuration: ``tests/policies/golden/<example>/<engine>.<kind>``.

``SPECGATE_UPDATE_GOLDEN=1`` rewrites them after an intended change; read the diff before committing it.
"""

from __future__ import annotations

import os

from tests.support import paths

GOLDEN = paths.ROOT / "tests" / "policies" / "golden"
UPDATE = os.environ.get("SPECGATE_UPDATE_GOLDEN") == "1"


def assert_golden(relative: str, text: str) -> None:
    path = GOLDEN / relative
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"missing golden file {path}; run with SPECGATE_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{path} differs; if the change is intended, rerun with " \
                                     "SPECGATE_UPDATE_GOLDEN=1 and review the diff"
