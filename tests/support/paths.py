"""Where the repository's files are, for tests that read them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "policies" / "examples"
VECTORS = ROOT / "tests" / "vectors"
