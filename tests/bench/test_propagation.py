"""Smoke test of the propagation benchmark (bench/propagation.py).

Tiny and SQLite only: a real control-plane process, 5 long-polling workers, 2
publishes (a kill-switch flip, then a rollback). Correctness only: every
worker must reach each publish's new ETag, and the report must be complete.
Nothing here asserts a timing.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from tests.support import paths

# bench/ is not an installed package: make the repository root importable.
_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
propagation = importlib.import_module("bench.propagation")


def test_every_worker_converges_to_each_new_etag() -> None:
    config = propagation.Config(workers=5, publishes=2, pause_s=0.0, timeout_s=30.0, setup_timeout_s=60.0)
    report = propagation.run(config, ["sqlite"])

    result = report["databases"]["sqlite"]
    (run,) = result["runs"]
    rounds = run["rounds"]
    assert [r["kind"] for r in rounds] == ["killswitch", "rollback"]
    assert [r["action"] for r in rounds] == ["killswitch on", "rollback to B"]
    for r in rounds:
        assert r["converged_workers"] == 5
        assert r["first_s"] > 0  # no worker held the new ETag before it was published
    etags = [r["etag"] for r in rounds]
    assert len(set(etags)) == 2
    assert run["poll_errors"] == 0
    assert all(r["cold"] for r in rounds)  # both bundles are new to the server
    assert set(result["summary"]) == {"killswitch", "rollback", "combined", "cold"}
    assert result["summary"]["combined"]["all_s"]["pooled"]["n"] == 2
    assert "sqlite" in propagation.render(report)


def test_percentile_interpolates() -> None:
    assert propagation.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert propagation.percentile([5.0], 99) == 5.0
    assert propagation.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
