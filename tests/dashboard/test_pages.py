"""Each page's logic with Streamlit's AppTest, against a real control plane (uvicorn, SQLite)."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.migrations_state import upgrade
from controlplane.rollout.service import fleet_cohort_secret
from controlplane.settings import ControlPlaneSettings
from policies.evaluate import exploration_salt
from tests.support import dashboard_seed as seed
from tests.support.apptest import app, button, changed_elsewhere, no_exception, page, texts, use
from tests.support.dashboard_live import LiveControlPlane, mint_keys
from tests.support.live import serve
from tests.support.telemetry_data import event


def _api(cp: LiveControlPlane, key: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {key or cp.admin}"}, timeout=30)


def _metric(at: object, label: str) -> str:
    values = [m.value for m in at.metric if m.label == label]  # type: ignore[attr-defined]
    assert values, f"no metric {label!r}"
    return str(values[0])


# --- sign-in, navigation, errors ------------------------------------------------------------

def test_sign_in_from_the_sidebar_then_every_page_renders(live_control_plane: LiveControlPlane,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    use(monkeypatch, cp.url, None)
    at = app().run()
    no_exception(at)
    assert "Sign in with an API key" in texts(at.info)
    at.sidebar.text_input[1].set_value("sgk_not-a-key")
    at.sidebar.button[0].click().run()
    assert "the API key is not known" in texts(at.sidebar.error)
    at.sidebar.text_input[1].set_value(cp.operator)
    at.sidebar.button[0].click().run()
    no_exception(at)
    assert "Signed in as **`operator:olga`** (operator)" in texts(at.sidebar.markdown)
    assert [t.value for t in at.title] == ["Overview"]
    assert "Kill switch is off" in texts(at.success)
    button(at, "Sign out").click().run()
    assert "Sign in with an API key" in texts(at.info)


def test_refusals_are_messages_with_the_problem_detail(live_control_plane: LiveControlPlane,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    use(monkeypatch, cp.url, "sgk_revoked-or-never-made")
    at = page("overview").run()
    no_exception(at)
    assert "Missing or invalid API key" in texts(at.error)
    assert "the API key is not known" in texts(at.error)

    use(monkeypatch, "http://127.0.0.1:9", cp.admin)  # nothing listens there
    at = page("overview").run()
    no_exception(at)
    assert "Control plane unreachable" in texts(at.error)


# --- overview -------------------------------------------------------------------------------

def test_overview_shows_the_fleet_the_last_hour_and_the_kill_switch(live_control_plane: LiveControlPlane,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seeded = seed.seed_all(cp.url, cp.admin, cp.worker, minutes=30, per_minute=20)
    use(monkeypatch, cp.url, cp.viewer)
    at = page("overview").run()
    no_exception(at)
    assert _metric(at, "Requests") == f"{seeded.events:,}"
    assert _metric(at, "Workers") == "6"
    assert _metric(at, "Converged") == "5/6"
    with _api(cp) as api:
        totals = api.get("/v1/telemetry/rollups").json()["groups"][0]["counters"]
    assert _metric(at, "Speculated") == f"{totals['speculated'] / totals['requests']:.1%}"
    assert _metric(at, "Acceptance") == f"{totals['accepted_tokens_sum'] / totals['draft_tokens_sum']:.1%}"
    assert "Kill switch is off" in texts(at.success)
    workers = _table(at, "worker")
    assert sorted(workers["worker"]) == sorted(seeded.workers)
    assert list(workers["state"]).count("converging") == 1

    with _api(cp, cp.operator) as api:
        api.put("/v1/killswitch", json={"enabled": True, "reason": "incident 42"}).raise_for_status()
    at.run()
    assert "Kill switch is off" in texts(at.success)  # a read of a few seconds ago
    changed_elsewhere()
    at.run()
    assert "Kill switch is ON" in texts(at.error)
    assert "incident 42" in texts(at.error)


def _table(at: Any, column: str) -> Any:
    """The first table on the page with this column."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


def _gateway_with_replicas(cp: LiveControlPlane, gateway: str = "fleet-gw-1",
                           address: str = "10.0.0.7:8000") -> None:
    """A gateway of the seeded pool, in front of three replicas of which one is ejected."""
    with _api(cp, cp.worker) as api:
        api.post("/v1/workers/register", json={"id": gateway, "pool": "fleet", "kind": "gateway",
                                               "engines": {"base": "pool"}}).raise_for_status()
        replica = {"engine": "base", "state": "healthy", "in_flight": 1, "running": 2.0, "waiting": 0.0,
                   "consecutive_failures": 0, "ejections": 0, "returns": 0, "next_probe_in_s": None}
        api.post(f"/v1/workers/{gateway}/heartbeat", json={"replicas": [
            {**replica, "replica": "10.0.0.5:8000"}, {**replica, "replica": "10.0.0.6:8000", "in_flight": 4},
            {**replica, "replica": address, "state": "ejected", "in_flight": 0, "running": None,
             "consecutive_failures": 3, "ejections": 2, "returns": 1, "next_probe_in_s": 7.2}]}).raise_for_status()


def test_overview_shows_gateways_apart_and_every_replica(live_control_plane: LiveControlPlane,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seeded = seed.seed_all(cp.url, cp.admin, cp.worker, minutes=2, per_minute=5)
    _gateway_with_replicas(cp)
    use(monkeypatch, cp.url, cp.viewer)
    at = page("overview").run()
    no_exception(at)
    # Workers count as before; the gateway beside them.
    assert _metric(at, "Workers") == "6"
    assert _metric(at, "Gateways") == "1"
    assert (_metric(at, "Replicas"), _metric(at, "Healthy"), _metric(at, "Ejected")) == ("3", "2", "1")
    pools = _table(at, "sidecars")
    assert sorted(zip(pools["pool"], pools["kind"], pools["sidecars"], strict=True)) == [
        ("fleet", "gateway", 1), ("fleet", "worker", 6)]
    workers, gateways, replicas = _table(at, "worker"), _table(at, "gateway"), _table(at, "replica")
    assert sorted(workers["worker"]) == sorted(seeded.workers)
    assert list(gateways["gateway"]) == ["fleet-gw-1"]
    rows = replicas.to_dict("records")
    assert [(r["worker"], r["engine"], r["replica"], r["state"]) for r in rows] == [
        ("fleet-gw-1", "base", "10.0.0.5:8000", "healthy"), ("fleet-gw-1", "base", "10.0.0.6:8000", "healthy"),
        ("fleet-gw-1", "base", "10.0.0.7:8000", "ejected")]
    ejected = rows[2]
    assert (ejected["in flight"], ejected["ejections"], ejected["returns"]) == (0, 2, 1)
    assert ejected["next probe"] == "in 7 s"
    assert rows[1]["in flight"] == 4
    assert rows[0]["next probe"] == "-"


def test_overview_shows_supervised_engines_and_a_worker_whose_engine_did_not_restart(
        live_control_plane: LiveControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seed.seed_all(cp.url, cp.admin, cp.worker, minutes=1, per_minute=2)
    with _api(cp, cp.worker) as api:
        api.post("/v1/workers/register", json={"id": "fleet-sup-1", "pool": "fleet",
                                               "engines": {"base": "http://127.0.0.1:8000"}}).raise_for_status()
        etag = api.get("/v1/bundle", params={"worker": "fleet-sup-1"}).json()["etag"]
    with _api(cp, cp.viewer) as api:
        active = api.get("/v1/policies/fleet").json()["active_revision_id"]
    engine = {"state": "serving", "config_hash": "0123456789abcdef", "restarts": 0, "failed_restarts": 0,
              "crashes": 0, "last_error": None}
    with _api(cp, cp.worker) as api:
        api.post("/v1/workers/fleet-sup-1/heartbeat", json={
            "active_revision": active, "active_etag": etag, "supervised_engines": [
                {**engine, "engine": "base", "revision": active},
                {**engine, "engine": "draft", "revision": "r-previous", "failed_restarts": 1,
                 "last_error": "the new arguments did not come up: **not markdown**",
                 "tokenizer": {"aligned": False, "draft": "/models/other-draft",
                               "differences": ["641 ids differ", "eos differs"]}}]}).raise_for_status()
    use(monkeypatch, cp.url, cp.viewer)
    at = page("overview").run()
    no_exception(at)
    workers = _table(at, "worker")
    states = dict(zip(workers["worker"], workers["state"], strict=True))
    # the draft engine serves the previous revision's arguments (its restart failed): not on its way
    assert states["fleet-sup-1"] == "engines behind"
    rows = _table(at, "runs arguments of").to_dict("records")
    assert [(r["worker"], r["engine"], r["state"], r["runs arguments of"], r["failed restarts"]) for r in rows] == [
        ("fleet-sup-1", "base", "serving", active[:12], 0), ("fleet-sup-1", "draft", "serving", "r-previous", 1)]
    assert rows[1]["last error"] == "the new arguments did not come up: **not markdown**"
    assert rows[1]["worker runs"] == active[:12]
    assert [r["tokenizer"] for r in rows] == ["-", "misaligned: 641 ids differ; eos differs"]


def test_overview_of_workers_only_shows_no_gateway_or_replica_table(live_control_plane: LiveControlPlane,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seed.seed_all(cp.url, cp.admin, cp.worker, minutes=1, per_minute=2)
    use(monkeypatch, cp.url, cp.viewer)
    at = page("overview").run()
    no_exception(at)
    assert [m.label for m in at.metric if m.label in ("Gateways", "Replicas", "Ejected")] == []
    assert not [d for d in at.dataframe if {"gateway", "replica"} & set(d.value.columns)]
    assert "gateway" not in set(_table(at, "sidecars")["kind"])


# --- policies -------------------------------------------------------------------------------

def _policies_page(cp: LiveControlPlane, monkeypatch: pytest.MonkeyPatch, key: str) -> object:
    seed.create_policy(cp.url, cp.admin, "multi-route.yaml", "fleet", message="route-aware speculation")
    use(monkeypatch, cp.url, key)
    at = page("policies").run()
    no_exception(at)
    return at


def test_policy_editor_validates_live_diffs_and_saves_a_draft(live_control_plane: LiveControlPlane,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    at = _policies_page(cp, monkeypatch, cp.admin)
    source = (seed.EXAMPLES / "multi-route.yaml").read_text()
    assert at.text_area(key="sg_editor_fleet").value == source
    assert "it would become revision" not in texts(at.success)
    assert "already revision" in texts(at.success)

    at.text_area(key="sg_editor_fleet").set_value(source.replace("batch_size: {max: 4}",
                                                                 "batch_size: {min: 5, max: 4}")).run()
    no_exception(at)
    error = texts(at.error)
    assert "The policy document is invalid" in error
    line = seed.line_of(source, "batch_size: {max: 4}")
    assert f"`rules[2].when.batch_size.max (line {line})`: `max (4) is below min (5)" in error
    assert "[inverted_range]" in error
    assert not [b for b in at.button if b.label == "Save as draft revision"]  # nothing to save

    fixed = source.replace("batch_size: {max: 4}", "batch_size: {max: 5}")
    at.text_area(key="sg_editor_fleet").set_value(fixed).run()
    assert not at.error
    assert "Valid. Saved, it would become revision" in texts(at.success)
    assert "rules changed: chat-draft-small-batch" in texts(at.markdown)
    diff = texts(at.code)
    assert "-      max: 4" in diff
    assert "+      max: 5" in diff

    button(at, "Save as draft revision").click().run()
    assert "Write a message" in texts(at.warning)
    at.text_input(key="sg_message_fleet").set_value("chat speculates up to batch 5")
    button(at, "Save as draft revision").click().run()
    no_exception(at)
    assert "Revision #2" in texts(at.success)
    assert "it is a draft" in texts(at.success)
    with _api(cp) as api:
        policy = api.get("/v1/policies/fleet").json()
        head = api.get(f"/v1/revisions/{policy['head_revision_id']}").json()
    assert head["seq"] == 2
    assert head["message"] == "chat speculates up to batch 5"
    assert head["author"] == "admin:alice"
    assert head["source_text"] == fixed
    assert policy["active_revision_id"] != head["id"]
    history = at.dataframe[-1].value
    assert list(history["seq"]) == [2, 1]


def test_dry_run_shows_the_draft_and_the_active_decision(live_control_plane: LiveControlPlane,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    at = _policies_page(cp, monkeypatch, cp.admin)
    source = (seed.EXAMPLES / "multi-route.yaml").read_text()
    at.text_area(key="sg_editor_fleet").set_value(source.replace("batch_size: {min: 5, max: 8}",
                                                                 "batch_size: {min: 5, max: 5}"))
    at.number_input(key="sg_dry_batch_fleet").set_value(6).run()
    no_exception(at)
    decisions = next(d.value for d in at.dataframe if "rule" in d.value.columns)
    rows = {r["revision"].split(" ")[0]: (r["engine"], r["rule"], r["k"]) for _, r in decisions.iterrows()}
    assert rows["draft"] == ("base", "default", 0)
    assert rows["active"] == ("draft", "chat-draft-medium-batch", 2)

    at.checkbox(key="sg_dry_structured_fleet").check().run()
    decisions = next(d.value for d in at.dataframe if "rule" in d.value.columns)
    assert set(decisions["rule"]) == {"no-structured"}


def test_a_viewer_sees_policies_but_cannot_save(live_control_plane: LiveControlPlane,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    at = _policies_page(cp, monkeypatch, cp.viewer)
    assert "you can look" in texts(at.caption)
    source = (seed.EXAMPLES / "multi-route.yaml").read_text()
    at.text_area(key="sg_editor_fleet").set_value(source.replace("max: 4}", "max: 3}")).run()
    assert "Valid. Saved, it would become revision" in texts(at.success)  # validation is a read
    assert button(at, "Save as draft revision").disabled
    assert button(at, "Create policy").disabled


# --- rollouts -------------------------------------------------------------------------------

def test_rollout_needs_a_reason_and_a_confirmation_then_pause_and_abort(live_control_plane: LiveControlPlane,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seeded = seed.seed_all(cp.url, cp.admin, cp.worker, minutes=2, per_minute=5)
    use(monkeypatch, cp.url, cp.operator)
    at = page("rollouts").run()
    no_exception(at)
    assert at.selectbox(key="sg_start_revision").value == seeded.draft

    def rollouts() -> list[dict[str, object]]:
        with _api(cp) as api:
            items: list[dict[str, object]] = api.get("/v1/rollouts").json()["items"]
            return items

    button(at, "Start rollout").click().run()
    assert "A reason is required" in texts(at.warning)
    at.text_input(key="sg_start_reason_0").set_value("canary the chat threshold")
    button(at, "Start rollout").click().run()
    assert "Tick the confirmation box" in texts(at.warning)
    assert rollouts() == []
    at.checkbox(key="sg_start_confirm_0").check()
    button(at, "Start rollout").click().run()
    no_exception(at)
    assert "started at 10%" in texts(at.success)
    [started] = rollouts()
    assert started["state"] == "running"
    assert started["reason"] == "canary the chat threshold"
    assert started["to_revision"] == seeded.draft
    assert started["created_by"] == "operator:olga"

    with _api(cp, cp.operator) as api:
        evaluated = api.post(f"/v1/rollouts/{started['id']}/guardrails/evaluate")
        assert evaluated.status_code == 200, evaluated.text
    changed_elsewhere()
    at.run()
    assert f"Guardrails at step 1: **{evaluated.json()['verdict']}**" in texts(at.markdown)

    key = f"sg_act_{started['id']}"
    at.selectbox(key=f"{key}_action").set_value("pause")
    at.text_input(key=f"{key}_reason_1").set_value("looking at p95")
    at.checkbox(key=f"{key}_confirm_1").check()
    button(at, "Apply").click().run()
    assert "pause done; it is now paused" in texts(at.success)
    at.selectbox(key=f"{key}_action").set_value("abort")
    at.text_input(key=f"{key}_reason_2").set_value("p95 up 30% on chat")
    at.checkbox(key=f"{key}_confirm_2").check()
    button(at, "Apply").click().run()
    assert "abort done; it is now aborted" in texts(at.success)
    assert rollouts()[0]["state"] == "aborted"
    assert "No rollout is running or paused." in texts(at.caption)


def test_rollout_refused_by_the_api_shows_the_field(live_control_plane: LiveControlPlane,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seed.seed_all(cp.url, cp.admin, cp.worker, minutes=1, per_minute=2)
    use(monkeypatch, cp.url, cp.operator)
    at = page("rollouts").run()
    at.text_input(key="sg_start_steps").set_value("10,50")
    at.text_input(key="sg_start_reason_0").set_value("try")
    at.checkbox(key="sg_start_confirm_0").check()
    button(at, "Start rollout").click().run()
    no_exception(at)
    assert "`steps[1]`" in texts(at.error)
    assert "last_not_100" in texts(at.error)


def test_rollback_and_kill_switch_reach_the_audit_log(live_control_plane: LiveControlPlane,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seeded = seed.seed_all(cp.url, cp.admin, cp.worker, minutes=1, per_minute=2)
    use(monkeypatch, cp.url, cp.operator, page_size="3")
    at = page("rollouts").run()
    at.selectbox(key="sg_rollback_revision").set_value(seeded.draft)
    at.text_input(key="sg_rollback_reason_0").set_value("back to the known-good thresholds")
    at.checkbox(key="sg_rollback_confirm_0").check()
    button(at, "Roll back").click().run()
    no_exception(at)
    assert f"`fleet` rolled back to `{seeded.draft[:12]}`" in texts(at.success)
    at.text_input(key="sg_killswitch_reason_1").set_value("incident 42: drafter OOM")
    at.checkbox(key="sg_killswitch_confirm_1").check()
    button(at, "Turn the kill switch ON").click().run()
    assert "Kill switch is now ON" in texts(at.success)
    with _api(cp) as api:
        assert api.get("/v1/policies/fleet").json()["active_revision_id"] == seeded.draft
        assert api.get("/v1/killswitch").json()["enabled"] is True

    audit = page("audit").run()
    no_exception(audit)
    newest = audit.dataframe[0].value
    assert list(newest["action"])[:2] == ["killswitch.on", "policy.rollback"]
    assert list(newest["reason"])[:2] == ["incident 42: drafter OOM", "back to the known-good thresholds"]
    assert list(newest["actor"])[:2] == ["operator:olga", "operator:olga"]
    assert "Page 1, newest first" in texts(audit.caption)
    button(audit, "Older").click().run()
    older = audit.dataframe[0].value
    assert "Page 2, newest first" in texts(audit.caption)
    assert max(older["#"]) < min(newest["#"])
    assert len(older) == 3
    audit.text_input(key="sg_audit_q").set_value("known-good").run()
    found = audit.dataframe[0].value
    assert list(found["action"]) == ["policy.rollback"]
    assert "Page 1, newest first" in texts(audit.caption)


def test_a_viewer_has_every_rollout_control_disabled(live_control_plane: LiveControlPlane,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seed.seed_all(cp.url, cp.admin, cp.worker, minutes=1, per_minute=2)
    use(monkeypatch, cp.url, cp.viewer)
    at = page("rollouts").run()
    no_exception(at)
    assert "you can look, the controls on this page need an admin or operator key" in texts(at.caption)
    for label in ("Start rollout", "Roll back", "Turn the kill switch ON"):
        assert button(at, label).disabled
    assert all(t.disabled for t in at.text_input if t.key and "reason" in t.key)


# --- telemetry ------------------------------------------------------------------------------

def test_telemetry_draws_the_charts_from_rollups_and_filters_by_route(live_control_plane: LiveControlPlane,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seeded = seed.seed_all(cp.url, cp.admin, cp.worker, minutes=20, per_minute=20)
    use(monkeypatch, cp.url, cp.viewer)
    at = page("telemetry").run()
    no_exception(at)
    assert not at.warning
    assert len(at.get("vega_lite_chart")) == 5
    assert f"{seeded.events:,} requests in the window" in texts(at.caption)
    # nothing was compared: the section says how to turn shadow comparisons on
    assert "Shadow comparisons" in texts(at.subheader)
    assert "No shadow comparisons in this window" in texts(at.info)
    assert "`quality.shadow_rate`" in texts(at.info)
    assert not at.dataframe

    at.selectbox(key="sg_tm_route").set_value("chat").run()
    no_exception(at)
    with _api(cp) as api:
        chat = api.get("/v1/telemetry/rollups", params={"route": "chat"}).json()["groups"][0]["counters"]
    assert 0 < chat["requests"] < seeded.events
    assert f"{chat['requests']:,} requests in the window" in texts(at.caption)

    at.selectbox(key="sg_tm_pool").set_value("(any)").run()  # the seed policy's pool: no traffic there
    assert "No telemetry in this window" in texts(at.info)


def test_telemetry_shows_the_shadow_comparisons_per_route_and_engine(live_control_plane: LiveControlPlane,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seeded = seed.seed_all(cp.url, cp.admin, cp.worker, minutes=5, per_minute=10)
    assert seed.shadow_telemetry(cp.url, cp.worker, seeded) == {("chat", "draft"): 40, ("extract", "ngram"): 20}
    use(monkeypatch, cp.url, cp.viewer)
    at = page("telemetry").run()
    no_exception(at)
    assert "Shadow comparisons" in texts(at.subheader)
    assert "No shadow comparisons" not in texts(at.info)
    (table,) = [d.value for d in at.dataframe]
    rows = table.to_dict("records")
    # the lowest match rate first: where the answers differ most
    assert [(r["route"], r["engine"], r["compared"], r["match rate"]) for r in rows] == [
        ("extract", "ngram", 20, "75.0%"), ("chat", "draft", 40, "95.0%")]
    extract, chat = rows
    assert extract["95% interval"] == "53.1% - 88.8%"  # Wilson, 15 of 20
    assert extract["first diff (tokens)"] == 12.0
    assert (extract["structured compared"], extract["structured valid: served"],
            extract["structured valid: plain"]) == (20, "100.0%", "90.0%")
    assert extract["check failures"] == "3 of 10"
    assert (chat["structured compared"], chat["structured valid: plain"], chat["check failures"]) == (0, "-", "-")
    assert "off the client's path" in texts(at.caption)

    # filtered to a route: that route's row only
    at.selectbox(key="sg_tm_route").set_value("chat").run()
    no_exception(at)
    (table,) = [d.value for d in at.dataframe]
    assert list(table["route"]) == ["chat"]


# --- recommendations ------------------------------------------------------------------------

def test_recommendation_becomes_a_draft_revision(live_control_plane: LiveControlPlane,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    seed.seed_all(cp.url, cp.admin, cp.worker, minutes=60, per_minute=40)
    use(monkeypatch, cp.url, cp.admin)
    at = page("recommendations").run()
    no_exception(at)
    assert "For the active revision" in texts(at.caption)
    at.number_input(key="sg_rec_min_samples").set_value(30).run()
    applicable = [b for b in at.button if b.label == "Create draft revision"]
    assert applicable, texts(at.markdown)
    with _api(cp) as api:
        before = api.get("/v1/policies/fleet").json()["revision_count"]
    applicable[0].click().run()
    no_exception(at)
    assert "Draft revision #3" in texts(at.success)
    with _api(cp) as api:
        policy = api.get("/v1/policies/fleet").json()
    assert policy["revision_count"] == before + 1
    assert policy["active_revision_id"] != policy["head_revision_id"]

    button(at, "Score it").click().run()
    no_exception(at)
    assert "Decisions changed" in [m.label for m in at.metric]
    assert "Estimated from" not in texts(at.info)  # every recorded request was sent raw


def test_what_if_says_when_it_rests_on_sampled_events(live_control_plane: LiveControlPlane,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    active = seed.create_policy(cp.url, cp.admin, "seed.yaml", None, message="first")
    (worker,) = seed.register_workers(cp.url, cp.worker, "fleet", 1)
    when = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)).isoformat()
    # Two requests sent raw and three samples of a worker that sends one request in 100 (raw_sample_rate 0.01).
    events = [{**event(revision=active["id"], batch=2, worker=worker), "pool": "fleet", "time": when}
              for _ in range(5)]
    for e in events[2:]:
        e["sample_weight"] = 100.0
    with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {cp.worker}"}, timeout=30) as api:
        r = api.post("/v1/telemetry/batches", json={"batch_id": uuid.uuid4().hex, "worker_id": worker,
                                                    "events": events})
        assert r.status_code == 200, r.text
        assert r.json()["stored"] == 5, r.text
    use(monkeypatch, cp.url, cp.viewer)
    at = page("recommendations").run()
    no_exception(at)
    button(at, "Score it").click().run()
    no_exception(at)
    assert _metric(at, "Decisions changed") == "0 of 302 (estimated)"
    assert ("Estimated from 5 recorded requests, 3 of them sampled, standing for about 302 "
            "(`telemetry.raw_sample_rate`: pre-aggregating workers send only a sample of their requests as raw "
            "events).") in texts(at.info)
    routes = _table(at, "decisions changed")
    assert routes[["route", "requests", "recorded", "sampled"]].to_dict("records") == [
        {"route": "chat", "requests": 302.0, "recorded": 5, "sampled": 3}]


def _switchback_policy(cp: LiveControlPlane) -> None:
    """Policy "windows" (pool fleet, always speculative, one-minute switchback windows) and 30 minutes of its
    traffic in which clients waited 900 ms in the policy's windows and 500 ms in the explored (plain) ones."""
    with _api(cp) as api:
        api.post("/v1/policies", json={"name": "windows", "pool": "fleet"}).raise_for_status()
        created = api.post("/v1/policies/windows/revisions", json={"document": seed.SWITCHBACK_POLICY,
                                                                   "message": "switchback"})
        created.raise_for_status()
    (worker,) = seed.register_workers(cp.url, cp.worker, "fleet", 1)
    engine = make_engine(cp.database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            salt = exploration_salt("windows", fleet_cohort_secret(session))
    finally:
        engine.dispose()
    assert seed.switchback_telemetry(cp.url, cp.worker, revision=created.json()["id"], salt=salt,
                                     worker=worker) == 600


def test_the_overview_says_whether_speculation_pays_on_what_clients_feel(live_control_plane: LiveControlPlane,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    _switchback_policy(cp)
    use(monkeypatch, cp.url, cp.viewer)
    at = page("overview").run()
    no_exception(at)
    assert "Does speculation pay here?" in texts(at.subheader)
    assert "Clients fared worse speculating more" in texts(at.error)
    measures = _table(at, "policy advantage [interval]")
    e2e = measures[measures["measure"] == "end-to-end latency"].iloc[0]
    ratio, interval = e2e["policy advantage [interval]"].split(" ", 1)
    assert 0.45 < float(ratio) < 0.7  # 500 / 900
    low, high = (float(v) for v in interval.strip("[]").split(", "))
    assert low < float(ratio) < high < 1
    routes = _table(at, "plain / speculative [interval]")
    assert list(routes["route"]) == ["chat"]
    assert list(routes["measure"]) == ["end-to-end latency"]
    assert list(routes["verdict"]) == ["loses"]


def test_recommendations_show_the_whole_worker_and_the_autopilot_panel(live_control_plane: LiveControlPlane,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    _switchback_policy(cp)
    use(monkeypatch, cp.url, cp.admin)
    at = page("recommendations").run()
    no_exception(at)
    at.selectbox(key="sg_rec_policy").set_value("windows").run()
    at.number_input(key="sg_rec_min_samples").set_value(30).run()
    no_exception(at)
    titles = texts(at.markdown)
    assert "do not speculate: policy 'windows' sends every request to the plain engine" in titles
    assert "driven by `end-to-end latency`" in titles
    assert "Clients fared worse speculating more" in texts(at.error)
    assert [m.value for m in at.metric if m.label == "Autopilot"] == ["off"]
    at.toggle(key="sg_ap_enabled_windows").set_value(True)
    at.selectbox(key="sg_ap_confidence_windows").set_value("medium")
    button(at, "Save autopilot").click().run()
    no_exception(at)
    assert "Autopilot of `windows` enabled" in texts(at.success)
    assert [m.value for m in at.metric if m.label == "Autopilot"] == ["on"]
    history = _table(at, "action")
    assert list(history["action"]) == ["enabled"]
    with _api(cp) as api:
        state = api.get("/v1/policies/windows/autopilot").json()
    assert (state["enabled"], state["min_confidence"], state["updated_by"]) == (True, "medium", "admin:alice")


def test_without_the_analysis_api_the_page_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    database_url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(database_url)
    keys = mint_keys(database_url)
    application = create_app(ControlPlaneSettings(database_url=database_url))
    missing = json.dumps({"type": "https://specgate.dev/problems/not-found", "title": "Not found", "status": 404,
                          "detail": "Not Found"}).encode()

    async def older_control_plane(scope: Any, receive: Any, send: Any) -> None:
        """The control plane as it was before the analysis: its paths answer 404."""
        if scope["type"] == "http" and scope["path"].startswith(("/v1/recommendations", "/v1/analysis")):
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/problem+json")]})
            await send({"type": "http.response.body", "body": missing})
            return
        await application(scope, receive, send)

    with serve(older_control_plane) as url:  # type: ignore[arg-type]
        seed.create_policy(url, keys[Scope.admin], "seed.yaml", None, message="first")
        use(monkeypatch, url, keys[Scope.viewer])
        at = page("recommendations").run()
    no_exception(at)
    assert "Analysis not available" in texts(at.info)
    assert not at.error


def test_a_new_policy_gets_its_first_revision_from_the_editor(live_control_plane: LiveControlPlane,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    use(monkeypatch, cp.url, cp.admin)
    at = page("policies").run()
    assert "No policies yet." in texts(at.info)
    at.text_input[0].set_value("chat-pool")
    at.text_input[1].set_value("chat")
    button(at, "Create policy").click().run()
    no_exception(at)
    assert "Policy `chat-pool` created" in texts(at.success)
    assert "name: chat-pool" in at.text_area(key="sg_editor_chat-pool").value
    assert "The policy has no active revision yet" in texts(at.caption)
    at.text_input(key="sg_message_chat-pool").set_value("first rules for the chat pool")
    button(at, "Save as draft revision").click().run()
    assert "it is active (the policy's first revision)" in texts(at.success)
    with _api(cp) as api:
        policy = api.get("/v1/policies/chat-pool").json()
    assert policy["pool"] == "chat"
    assert policy["active_revision_id"] == policy["head_revision_id"]


def test_saving_against_a_stale_head_shows_the_current_head(live_control_plane: LiveControlPlane,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cp = live_control_plane
    at = _policies_page(cp, monkeypatch, cp.admin)
    source = (seed.EXAMPLES / "multi-route.yaml").read_text()
    rival = seed.add_revision(cp.url, cp.admin, "fleet", source.replace("max: 4}", "max: 2}"), "someone else")
    changed_elsewhere()
    at.text_area(key="sg_editor_fleet").set_value(source.replace("max: 4}", "max: 3}")).run()
    at.text_input(key="sg_message_fleet").set_value("mine")
    button(at, "Save as draft revision").click().run()
    no_exception(at)
    error = texts(at.error)
    assert "Precondition failed" in error
    assert f"current head: `{rival['id']}`" in error
    assert "A newer revision" in texts(at.warning)
    with _api(cp) as api:
        assert api.get("/v1/policies/fleet").json()["revision_count"] == 2
    button(at, "Load the newest").click().run()
    assert at.text_area(key="sg_editor_fleet").value == source.replace("max: 4}", "max: 2}")
    assert "A newer revision" not in texts(at.warning)
