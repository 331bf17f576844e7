"""``specgate autopilot enable|status|disable`` against a live control plane."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest
from typer.testing import CliRunner

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.settings import ControlPlaneSettings
from specgate.cli import app as cli_app
from tests.support.factories import seed_policy
from tests.support.live import serve


@pytest.fixture
def live(migrated_url: str) -> Iterator[str]:
    settings = ControlPlaneSettings(database_url=migrated_url, guardrail_interval_s=0, autopilot_interval_s=0)
    with serve(create_app(settings)) as url:
        yield url


def test_enable_status_disable(live: str, migrated_url: str, make_key: Callable[[Scope, str], str]) -> None:
    seed_policy(migrated_url)
    admin, viewer = make_key(Scope.admin, "cli-admin"), make_key(Scope.viewer, "cli-viewer")
    runner = CliRunner()

    def run(key: str, *args: str) -> tuple[int, str]:
        result = runner.invoke(cli_app, list(args), env={"SPECGATE_URL": live, "SPECGATE_KEY": key})
        return result.exit_code, result.output

    code, out = run(admin, "autopilot", "enable", "seed", "--min-confidence", "medium", "--steps", "20,100",
                    "--hold-s", "120", "--kind", "stop_speculating", "--kind", "exclude_route")
    assert code == 0, out
    assert "autopilot of seed: enabled; idle" in out
    assert "min confidence medium, steps 20, 100 %, hold 120 s" in out
    assert "kinds: stop_speculating, exclude_route" in out
    with httpx.Client(base_url=live, headers={"Authorization": f"Bearer {viewer}"}) as api:
        state = api.get("/v1/policies/seed/autopilot").json()
    code, out = run(viewer, "autopilot", "status", "seed", "--json")
    assert code == 0, out
    assert json.loads(out) == state
    assert state["steps"] == [20, 100]
    # a viewer may read, not change
    code, out = run(viewer, "autopilot", "disable", "seed")
    assert code != 0
    assert "a viewer key cannot do this" in out
    code, out = run(admin, "autopilot", "disable", "seed")
    assert code == 0, out
    assert "autopilot of seed: disabled; off" in out
    code, out = run(admin, "autopilot", "status", "seed")
    assert code == 0, out
    assert " disabled" in out
    assert " enabled" in out  # the history lists both changes
    # the setting survives a disable: same steps and kinds
    code, out = run(admin, "autopilot", "status", "seed", "--json")
    assert json.loads(out)["kinds"] == ["stop_speculating", "exclude_route"]
    code, out = run(admin, "autopilot", "enable", "seed", "--steps", "50,20")
    assert code != 0
    assert "steps[1]" in out
    code, out = run(admin, "autopilot", "enable", "seed", "--steps", "ten")
    assert code != 0
    assert "--steps" in out
