"""``specgate testbed ...``: argument parsing and the commands that need no engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specgate.cli import app
from testbed import engines

runner = CliRunner()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECGATE_TESTBED_STATE", str(tmp_path / "state"))


def test_help_lists_the_commands() -> None:
    result = runner.invoke(app, ["testbed", "--help"])
    assert result.exit_code == 0
    for command in ("env", "train", "start", "stop", "status", "sweep"):
        assert command in result.output


def test_status_on_a_fresh_cache(tmp_path: Path) -> None:
    result = runner.invoke(app, ["testbed", "status", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["env_ready"] is False
    assert info["models_ready"] is False
    assert info["engines"] == {}
    assert info["models"].startswith(str(tmp_path / "cache"))
    assert "none recorded" in runner.invoke(app, ["testbed", "status"]).output


def test_stop_with_nothing_running() -> None:
    result = runner.invoke(app, ["testbed", "stop"])
    assert result.exit_code == 0
    assert "nothing was running" in result.output


def test_status_shows_a_recorded_engine_that_is_gone(tmp_path: Path) -> None:
    engines.StateFile(tmp_path / "state").write({"base": engines.EngineRecord(
        name="base", pid=2**22 + 12345, start_ticks=1, port=8100, url="http://127.0.0.1:8100",
        log="base.log", started_at=0.0)})
    result = runner.invoke(app, ["testbed", "status"])
    assert "engine base" in result.output
    assert "gone" in result.output
    assert runner.invoke(app, ["testbed", "stop", "base"]).output.strip() == "stopped: nothing was running"
    assert engines.StateFile(tmp_path / "state").read() == {}


@pytest.mark.parametrize("argv", [["testbed", "start", "eagle"], ["testbed", "stop", "base", "medusa"],
                                  ["testbed", "sweep", "--variants", "base,eagle", "--no-http", "--no-offline"],
                                  ["testbed", "sweep", "--routes", "chat,poetry", "--no-http", "--no-offline"],
                                  ["testbed", "start", "--base-port", "x"]])
def test_bad_arguments_are_usage_errors(argv: list[str]) -> None:
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
