"""Hardening of the dashboard: what clients and telemetry chose is shown as text, and changes name what the
page showed (the rollout step a promote moves on from, the head a recommendation's draft builds on)."""

from __future__ import annotations

import datetime as dt
import random
import re
import uuid
from typing import Any

import httpx
import pytest

from dashboard.ui import literal
from tests.support import dashboard_seed as seed
from tests.support.apptest import button, changed_elsewhere, no_exception, page, texts, use
from tests.support.dashboard_live import LiveControlPlane

HOSTILE_ROUTE = "**x** [a](javascript:alert(1)) :red[y] $z$ `q`"
# A CommonMark code span: a run of backticks, the shortest text, the same run again.
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.*?)(?<!`)\1(?!`)")


def _api(cp: LiveControlPlane, key: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {key or cp.admin}"}, timeout=30)


def _markdown_bodies(at: Any) -> list[str]:
    """The source of every element Streamlit renders as Markdown."""
    groups = (at.markdown, at.caption, at.success, at.error, at.warning, at.info, at.sidebar.markdown)
    return [str(e.value) for group in groups for e in group]


def _hostile_route_events(seeded: seed.Seeded, n: int = 200) -> list[dict[str, Any]]:
    """A holdout on the hostile route where speculation retries far more: a quality-risk flag names it."""
    rng = random.Random(11)
    now = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0) - dt.timedelta(minutes=2)
    events = []
    for i in range(2 * n):
        speculate = i < n
        events.append({
            "event_id": uuid.uuid4().hex, "request_id": uuid.uuid4().hex,
            "time": (now + dt.timedelta(seconds=rng.uniform(0, 59))).isoformat(), "worker_id": seeded.workers[0],
            "pool": "fleet", "route": HOSTILE_ROUTE, "model": "target-8b", "policy": "fleet",
            "revision": seeded.active, "rule": "default", "engine": "draft" if speculate else "base",
            "decided_engine": "draft" if speculate else "base", "speculate": speculate,
            "num_speculative_tokens": 3 if speculate else 0, "explored": not speculate, "canary": False,
            "kill_switch": False, "batch_size": 1, "stream": True, "structured_output": False, "tools": False,
            "max_tokens": 256, "prompt_tokens": 100, "completion_tokens": 100, "ttft_ms": 50.0,
            "itl_ms": rng.uniform(10, 12) if speculate else rng.uniform(20, 22), "e2e_ms": 2000.0,
            "status": "ok", "retries": 1 if speculate and rng.random() < 0.4 else 0, "fallback": False,
        })
    return events


def test_a_hostile_route_name_is_shown_as_text_never_as_markdown(live_control_plane: LiveControlPlane,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seeded = seed.seed_all(cp.url, cp.admin, cp.worker, minutes=2, per_minute=5)
    with _api(cp, cp.worker) as api:
        r = api.post("/v1/telemetry/batches", json={"batch_id": uuid.uuid4().hex, "worker_id": seeded.workers[0],
                                                   "events": _hostile_route_events(seeded)})
        assert r.status_code == 200, r.text
        assert r.json()["stored"] == 400
    use(monkeypatch, cp.url, cp.admin)
    at = page("recommendations").run()
    at.number_input(key="sg_rec_min_samples").set_value(30).run()
    no_exception(at)
    bodies = _markdown_bodies(at)
    # The route reaches the page (the quality-risk card names it) ...
    assert any(literal(HOSTILE_ROUTE) in body for body in bodies), bodies
    assert any(HOSTILE_ROUTE in str(t.value) for t in at.text)
    # ... and never outside a code span, where Markdown, links, colours, LaTeX and shortcodes would apply.
    outside = [CODE_SPAN.sub("", body) for body in bodies]
    assert [text for text in outside if "**x**" in text or "javascript:" in text or ":red[" in text] == []

    at = page("telemetry").run()
    no_exception(at)
    assert [body for body in _markdown_bodies(at) if "javascript:" in body] == []


def test_replicas_and_engines_a_gateway_reports_are_shown_as_text(live_control_plane: LiveControlPlane,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seed.seed_all(cp.url, cp.admin, cp.worker, minutes=1, per_minute=2)
    with _api(cp, cp.worker) as api:
        api.post("/v1/workers/register", json={"id": "fleet-gw", "pool": "fleet", "kind": "gateway",
                                               "engines": {HOSTILE_ROUTE[:63]: "x"}}).raise_for_status()
        api.post("/v1/workers/fleet-gw/heartbeat", json={"replicas": [
            {"engine": HOSTILE_ROUTE[:63], "replica": HOSTILE_ROUTE, "state": "ejected",
             "next_probe_in_s": 3.0}]}).raise_for_status()
    use(monkeypatch, cp.url, cp.admin)
    at = page("overview").run()
    no_exception(at)
    (replicas,) = [d.value for d in at.dataframe if "replica" in d.value.columns]
    assert list(replicas["replica"]) == [HOSTILE_ROUTE]
    assert list(replicas["engine"]) == [HOSTILE_ROUTE[:63]]
    outside = [CODE_SPAN.sub("", body) for body in _markdown_bodies(at)]
    assert [text for text in outside if "**x**" in text or "javascript:" in text or ":red[" in text] == []


@pytest.mark.parametrize("value", ["**x**", "a`b", "`x`", " x ", "[a](javascript:alert(1))", "line\nbreak"])
def test_literal_code_spans_hold_any_text(value: str) -> None:
    shown = literal(value)
    fence = shown[:len(shown) - len(shown.lstrip("`"))]
    assert shown.endswith(fence)
    inner = shown[len(fence):-len(fence)]
    # A code span shows its content with one space stripped from each end when both are there.
    if inner.startswith(" ") and inner.endswith(" ") and inner.strip():
        inner = inner[1:-1]
    assert inner == value.replace("\n", " ")
    assert "`" * len(fence) not in value


def test_promote_names_the_step_the_page_showed(live_control_plane: LiveControlPlane,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seeded = seed.seed_all(cp.url, cp.admin, cp.worker, minutes=1, per_minute=2)
    with _api(cp, cp.operator) as api:
        started = api.post("/v1/rollouts", json={"policy": "fleet", "revision": seeded.draft, "mode": "traffic",
                                                 "steps": [10, 50, 100], "reason": "canary"}).json()
    use(monkeypatch, cp.url, cp.operator)
    at = page("rollouts").run()
    no_exception(at)
    # Another operator promotes 10 % -> 50 % while this page still shows 10 %.
    with _api(cp, cp.operator) as api:
        assert api.post(f"/v1/rollouts/{started['id']}/promote", json={"expected_step": 0}).status_code == 200
    key = f"sg_act_{started['id']}"
    at.selectbox(key=f"{key}_action").set_value("promote")
    at.text_input(key=f"{key}_reason_0").set_value("10% looked fine")
    at.checkbox(key=f"{key}_confirm_0").check()
    button(at, "Apply").click().run()
    no_exception(at)
    error = texts(at.error)
    assert "expected_step" in error
    assert "current step: `1`" in error
    with _api(cp) as api:
        assert api.get(f"/v1/rollouts/{started['id']}").json()["current_step"] == 1  # 50 % was not skipped


def test_a_recommendation_builds_on_the_head_the_page_listed(live_control_plane: LiveControlPlane,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seed.seed_all(cp.url, cp.admin, cp.worker, minutes=60, per_minute=40)
    use(monkeypatch, cp.url, cp.admin)
    at = page("recommendations").run()
    at.number_input(key="sg_rec_min_samples").set_value(30).run()
    applicable = [b for b in at.button if b.label == "Create draft revision"]
    assert applicable
    with _api(cp) as api:
        policy = api.get("/v1/policies/fleet").json()
        text = api.get(f"/v1/revisions/{policy['head_revision_id']}").json()["source_text"]
        edited = text.replace("batch_size: {max: 6}", "batch_size: {max: 7}")
        rival = api.post("/v1/policies/fleet/revisions", json={"document": edited, "message": "meanwhile"},
                         headers={"If-Match": f'"{policy["head_revision_id"]}"'})
        assert rival.status_code == 201, rival.text
    applicable[0].click().run()
    no_exception(at)
    error = texts(at.error)
    assert "Precondition failed" in error
    assert f"current head: `{rival.json()['id']}`" in error
    with _api(cp) as api:
        assert api.get("/v1/policies/fleet").json()["revision_count"] == policy["revision_count"] + 1
    changed_elsewhere()
