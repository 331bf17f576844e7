"""How the dashboard uses the API: a fixed number of calls per page, cached reads, one client per session.

The control plane here counts what it is asked (method, path and the connection it came on).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from apiclient import ApiClient
from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.migrations_state import upgrade
from controlplane.settings import ControlPlaneSettings
from tests.support import dashboard_seed as seed
from tests.support.apptest import app, button, changed_elsewhere, no_exception, page, texts, use
from tests.support.dashboard_live import mint_keys
from tests.support.factories import seed_text
from tests.support.live import serve


@dataclass
class Counted:
    url: str
    keys: dict[Scope, str]
    calls: list[tuple[str, str]] = field(default_factory=list)
    connections: set[tuple[str, int]] = field(default_factory=set)

    def reset(self) -> None:
        self.calls.clear()
        self.connections.clear()


@pytest.fixture
def counted(tmp_path: Path) -> Iterator[Counted]:
    database_url = f"sqlite:///{tmp_path / 'specgate.db'}"
    upgrade(database_url)
    application = create_app(ControlPlaneSettings(database_url=database_url, worker_stale_after_s=600))
    found: list[Counted] = []

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and found:
            found[0].calls.append((scope["method"], scope["path"]))
            found[0].connections.add(tuple(scope["client"]))
        await application(scope, receive, send)

    with serve(counting) as url:  # type: ignore[arg-type]
        found.append(Counted(url, mint_keys(database_url)))
        yield found[0]


def _policy(cp: Counted, name: str) -> None:
    with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {cp.keys[Scope.admin]}"},
                      timeout=30) as api:
        api.post("/v1/policies", json={"name": name, "pool": f"pool-{name}"}).raise_for_status()
        api.post(f"/v1/policies/{name}/revisions", json={"document": seed_text(name)}).raise_for_status()


def test_the_overview_makes_the_same_calls_whatever_the_number_of_policies(counted: Counted,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _policy(counted, "p0")
    use(monkeypatch, counted.url, counted.keys[Scope.viewer])
    counted.reset()
    no_exception(page("overview").run())
    with_one = sorted(counted.calls)
    assert ("GET", "/v1/whoami") in with_one
    assert not [path for _, path in with_one if path.startswith("/v1/revisions/")]

    for name in ("p1", "p2", "p3", "p4"):
        _policy(counted, name)
    changed_elsewhere()
    counted.reset()
    at = page("overview").run()
    no_exception(at)
    assert sorted(counted.calls) == with_one
    assert len(next(d.value for d in at.dataframe if "policy" in d.value.columns and "head" in d.value.columns)) == 5


def test_reads_are_cached_and_a_change_made_in_the_dashboard_drops_them(counted: Counted,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _policy(counted, "p0")
    use(monkeypatch, counted.url, counted.keys[Scope.operator])
    overview = page("overview").run()
    assert "Kill switch is off" in texts(overview.success)
    counted.reset()
    overview.run()
    assert counted.calls == []  # everything came from the cache
    assert "Kill switch is off" in texts(overview.success)

    rollouts = page("rollouts").run()
    rollouts.text_input(key="sg_killswitch_reason_0").set_value("incident 7")
    rollouts.checkbox(key="sg_killswitch_confirm_0").check()
    button(rollouts, "Turn the kill switch ON").click().run()
    assert "Kill switch is now ON" in texts(rollouts.success)

    counted.reset()
    overview.run()
    assert ("GET", "/v1/fleet") in counted.calls  # read again: the change dropped it (the rollouts page reads
    assert "Kill switch is ON" in texts(overview.error)  # the switch, and has read it again since)
    assert "incident 7" in texts(overview.error)


def test_a_session_keeps_one_client_and_its_connection(counted: Counted, monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, counted.url, counted.keys[Scope.viewer])
    overview = page("overview").run()
    for _ in range(3):
        changed_elsewhere()
        overview.run()
    no_exception(overview)
    assert len(counted.calls) > 10
    assert len(counted.connections) == 1  # a new client per rerun would open a connection each time


def test_signing_out_or_a_refused_key_closes_the_client(counted: Counted, monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []
    close = ApiClient.close

    def recording_close(self: ApiClient) -> None:
        closed.append(self.base_url)
        close(self)

    monkeypatch.setattr(ApiClient, "close", recording_close)
    use(monkeypatch, counted.url, None)
    at = app().run()
    at.sidebar.text_input[1].set_value("sgk_not-a-key")
    at.sidebar.button[0].click().run()
    assert "the API key is not known" in texts(at.sidebar.error)
    assert closed == [counted.url]

    at.sidebar.text_input[1].set_value(counted.keys[Scope.admin])
    at.sidebar.button[0].click().run()
    no_exception(at)
    for _ in range(2):
        at.run()
    assert closed == [counted.url]  # reruns use the same client
    button(at, "Sign out").click().run()
    assert closed == [counted.url, counted.url]
    assert "Sign in with an API key" in texts(at.info)


def test_every_session_state_key_of_the_dashboard_has_its_prefix(counted: Counted,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    admin = counted.keys[Scope.admin]
    seed.create_policy(counted.url, admin, "multi-route.yaml", "fleet", message="first")
    source = (seed.EXAMPLES / "multi-route.yaml").read_text()
    seed.add_revision(counted.url, admin, "fleet", source.replace("max: 4}", "max: 5}"), "a draft")
    use(monkeypatch, counted.url, counted.keys[Scope.admin])
    seen: set[str] = set()
    for name in ("overview", "policies", "rollouts", "telemetry", "recommendations", "audit"):
        at = page(name).run()
        no_exception(at)
        seen |= set(at.session_state.keys())
    whole = app().run()
    button(whole, "Refresh data").click().run()
    seen |= set(whole.session_state.keys())
    # Streamlit names a form's submit button after the form: "FormSubmitter:<form key>-<label>".
    assert sorted(k for k in seen if not k.removeprefix("FormSubmitter:").startswith("sg_")) == []
    assert [k for k in seen if k.startswith("FormSubmitter:")]
    assert {"sg_who", "sg_editor_fleet", "sg_audit_q", "sg_rollback_revision", "sg_tm_window"} <= seen
