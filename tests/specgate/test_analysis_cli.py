"""``specgate analysis ...`` and ``specgate recommend ...`` against a live control plane."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.settings import ControlPlaneSettings
from specgate.cli import app as cli_app
from tests.support.live import serve
from tests.support.telemetry_data import policy_text, recorded_window, seed


@pytest.fixture
def live(migrated_url: str) -> Iterator[str]:
    settings = ControlPlaneSettings(database_url=migrated_url, guardrail_interval_s=0)
    with serve(create_app(settings)) as url:
        yield url


def test_summary_speedups_recommend_offline_and_apply(live: str, migrated_url: str, tmp_path: Path,
                                                      make_key: Callable[[Scope, str], str]) -> None:
    (rid,) = seed(migrated_url, policy_text())
    recorded_window(migrated_url, rid)
    env = {"SPECGATE_URL": live, "SPECGATE_KEY": make_key(Scope.admin, "cli-admin")}
    runner = CliRunner()

    def run(*args: str) -> tuple[int, str]:
        result = runner.invoke(cli_app, list(args), env=env)
        return result.exit_code, result.output

    code, out = run("analysis", "summary", "--group-by", "route")
    assert code == 0, out
    assert "route=chat" in out
    assert "route=summarize" in out

    code, out = run("analysis", "speedups", "--policy", "seed", "--route", "chat")
    assert code == 0, out
    assert "insufficient evidence" in out
    assert "wins" in out

    code, out = run("recommend", "list", "--policy", "seed", "--json")
    assert code == 0, out
    listed = json.loads(out)["recommendations"]
    raise_chat = next(r for r in listed if r["kind"] == "raise_threshold")

    cells = tmp_path / "cells.json"
    code, out = run("analysis", "cells", "--policy", "seed", "--out", str(cells))
    assert code == 0, out
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy_text())
    code, out = run("recommend", "offline", "--cells", str(cells), "--policy-file", str(policy_file), "--json")
    assert code == 0, out
    offline = json.loads(out)
    # the same statistics and document give the same recommendations, with the same ids
    assert [(r["id"], r["kind"], r["route"]) for r in offline] == [(r["id"], r["kind"], r["route"]) for r in listed]

    code, out = run("recommend", "apply", raise_chat["id"], "--policy", "seed")
    assert code == 0, out
    assert "draft revision" in out
    code, out = run("recommend", "apply", "f" * 20, "--policy", "seed")
    assert code == 1
    assert "does not hold" in out

    code, out = run("analysis", "summary", "--group-by", "colour")
    assert code == 1
    assert "group_by[0]" in out
    code, out = run("recommend", "offline", "--cells", str(tmp_path / "missing.json"), "--policy-file",
                    str(policy_file))
    assert code == 2
