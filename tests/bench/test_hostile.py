"""Smoke test of the hostile-clients benchmark (bench/hostile.py).

One short round, the hostile payloads made smaller so that a sidecar still
slow on them does not make the test long: the run completes, every ordinary
request is answered 200, and each hostile kind was sent. Nothing here asserts
a timing.
"""

from __future__ import annotations

import importlib
import sys

from tests.support import paths

# bench/ is not an installed package: make the repository root importable.
_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
hostile = importlib.import_module("bench.hostile")


def test_every_ordinary_request_is_answered_while_hostile_requests_are_in_flight() -> None:
    config = hostile.Config(rounds=1, duration_s=1.0, rate=20.0, settle_s=0.5, slowloris=2, label_pairs=2000,
                            schema_bytes=64 * 1024, depth=5000)
    report = hostile.run(config)

    assert "FAKE upstream" in report["upstream"]
    for phase in ("alone", "hostile"):
        summary = report["summary"][phase]
        assert summary["sent"] == summary["answered"] == 20, report["rounds"]
        assert summary["p50_ms"] is not None
        assert summary["p99_ms"] is not None
    assert set(report["summary"]["ratio"]) == {"p50_ms", "p99_ms"}
    assert set(report["hostile_requests"]) == set(hostile.KINDS)
    assert all(report["hostile_requests"][kind] for kind in hostile.KINDS)
    assert "ratio" in hostile.render(report)
