"""Engines a sidecar supervises, on the control plane: what heartbeats report of them, a worker that has
not converged until its engines run the revision it runs, and an engine failure in the audit log."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from apiclient import models as api_models
from controlplane.settings import ControlPlaneSettings
from tests.support.factories import seed_policy
from tests.support.fleet_rows import register


def engine(name: str, revision: str | None, state: str = "serving", **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"engine": name, "state": state, "config_hash": "0123456789abcdef", "revision": revision,
                            "restarts": 0, "failed_restarts": 0, "crashes": 0, "last_error": None}
    body.update(changes)
    return body


def beat(client: TestClient, key: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/workers/w1/heartbeat", json=body, headers=key)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def listed(client: TestClient, key: dict[str, str]) -> dict[str, Any]:
    (worker,) = client.get("/v1/workers", headers=key).json()["items"]
    assert isinstance(worker, dict)
    return worker


def audited(client: TestClient, admin: dict[str, str], action: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = client.get("/v1/audit", params={"action": action}, headers=admin).json()["items"]
    return items


@pytest.fixture
def running(client: TestClient, settings: ControlPlaneSettings, worker_key: dict[str, str]) -> tuple[str, str]:
    """Worker w1 registered, a policy active for it; returns (revision, etag) it should run."""
    register(client, worker_key, "w1")
    _, (revision,) = seed_policy(settings.database_url)
    etag = client.get("/v1/bundle", params={"worker": "w1"}, headers=worker_key).json()["etag"]
    return revision, etag


def test_a_worker_converges_only_once_its_engines_serve_the_revision_it_runs(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str], running: tuple[str, str]) -> None:
    revision, etag = running
    runs = {"active_revision": revision, "active_etag": etag}
    # The bundle arrived; the draft engine still runs the previous revision's arguments while it restarts.
    ack = beat(client, worker_key, {**runs, "supervised_engines": [
        engine("base", revision), engine("draft", "r-old", state="restarting")]})
    assert ack == {"expected_etag": etag, "converged": False}
    worker = listed(client, admin)
    assert (worker["converged"], worker["engines_converged"]) == (False, False)
    assert [e["engine"] for e in worker["supervised_engines"]] == ["base", "draft"]
    assert worker["supervised_engines"][1]["state"] == "restarting"
    assert worker["supervised_reported_at"] is not None
    fleet = client.get("/v1/fleet", headers=admin).json()
    assert (fleet["overall"]["converged_workers"], fleet["overall"]["converged"]) == (0, False)

    # Restarted with the new arguments: converged.
    ack = beat(client, worker_key, {**runs, "supervised_engines": [
        engine("base", revision), engine("draft", revision, restarts=1, config_hash="fedcba9876543210")]})
    assert ack["converged"] is True
    worker = listed(client, admin)
    assert (worker["converged"], worker["engines_converged"]) == (True, True)
    assert worker["supervised_engines"][1]["config_hash"] == "fedcba9876543210"
    assert client.get("/v1/fleet", headers=admin).json()["overall"]["converged_workers"] == 1
    api_models.WorkerPage.model_validate(client.get("/v1/workers", headers=admin).json())

    # A heartbeat that leaves the report out keeps it; [] says the worker supervises none.
    beat(client, worker_key, runs)
    assert len(listed(client, admin)["supervised_engines"]) == 2
    beat(client, worker_key, {**runs, "supervised_engines": []})
    worker = listed(client, admin)
    assert (worker["supervised_engines"], worker["engines_converged"], worker["converged"]) == ([], None, True)


def test_a_worker_whose_etag_is_behind_is_not_converged_whatever_its_engines_say(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str], running: tuple[str, str]) -> None:
    revision, _ = running
    ack = beat(client, worker_key, {"active_revision": revision, "active_etag": "older",
                                    "supervised_engines": [engine("draft", revision)]})
    assert ack["converged"] is False
    worker = listed(client, admin)
    assert (worker["converged"], worker["engines_converged"]) == (False, True)


def test_a_failed_restart_a_crash_and_an_engine_down_are_audited_once_each(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str], running: tuple[str, str]) -> None:
    revision, etag = running
    runs = {"active_revision": revision, "active_etag": etag}
    beat(client, worker_key, {**runs, "supervised_engines": [engine("draft", revision)]})
    assert audited(client, admin, "worker.engine_restart_failed") == []

    why = "the new arguments did not come up: it exited with 1 (log engines/draft.log); back on the previous ones"
    failed = engine("draft", "r-old", failed_restarts=1, last_error=why)
    for _ in range(3):  # every heartbeat repeats the report: one event
        assert beat(client, worker_key, {**runs, "supervised_engines": [failed]})["converged"] is False
    (event,) = audited(client, admin, "worker.engine_restart_failed")
    assert (event["actor"], event["target_type"], event["target_id"]) == ("worker:pool-a", "worker", "w1")
    assert event["reason"] == why
    assert event["after"]["engine"] == "draft"
    assert event["after"]["revision"] == "r-old"
    assert event["before"]["revision"] == revision

    beat(client, worker_key, {**runs, "supervised_engines": [
        engine("draft", "r-old", failed_restarts=1, crashes=1, state="restarting", last_error="exited with -9")]})
    assert len(audited(client, admin, "worker.engine_crashed")) == 1
    assert len(audited(client, admin, "worker.engine_restart_failed")) == 1
    beat(client, worker_key, {**runs, "supervised_engines": [
        engine("draft", "r-old", failed_restarts=1, crashes=1, state="failed", last_error="down")]})
    (down,) = audited(client, admin, "worker.engine_down")
    assert down["reason"] == "down"
    # A restarted sidecar counts from 0 again; its first failed restart is news.
    beat(client, worker_key, {**runs, "supervised_engines": [engine("draft", revision)]})
    beat(client, worker_key, {**runs, "supervised_engines": [engine("draft", "r-old", failed_restarts=1)]})
    assert len(audited(client, admin, "worker.engine_restart_failed")) == 2


@pytest.mark.parametrize(("change", "path"), [
    ({"state": "exploded"}, "supervised_engines[0].state"),
    ({"state": None}, "supervised_engines[0].state"),
    ({"engine": ""}, "supervised_engines[0].engine"),
    ({"config_hash": "XYZ"}, "supervised_engines[0].config_hash"),
    ({"config_hash": "a" * 65}, "supervised_engines[0].config_hash"),
    ({"revision": "r" * 65}, "supervised_engines[0].revision"),
    ({"restarts": -1}, "supervised_engines[0].restarts"),
    ({"failed_restarts": True}, "supervised_engines[0].failed_restarts"),
    ({"crashes": "2"}, "supervised_engines[0].crashes"),
    ({"last_error": "x" * 2049}, "supervised_engines[0].last_error"),
    ({"last_error": "nul\x00"}, "supervised_engines[0].last_error"),
    ({"last_error": "\x1b[2J"}, "supervised_engines[0].last_error"),
    ({"pid": 4242}, "supervised_engines[0].pid"),
    ({"tokenizer": {"aligned": "yes", "draft": "/m/d"}}, "supervised_engines[0].tokenizer.aligned"),
    ({"tokenizer": {"aligned": False, "draft": ""}}, "supervised_engines[0].tokenizer.draft"),
    ({"tokenizer": {"aligned": False, "draft": "/m/d", "differences": ["x"] * 9}},
     "supervised_engines[0].tokenizer.differences"),
    ({"tokenizer": {"aligned": False, "draft": "/m/d", "differences": ["\x1b[2J"]}},
     "supervised_engines[0].tokenizer.differences[0]"),
    ({"tokenizer": {"aligned": True, "draft": "/m/d", "colour": 1}}, "supervised_engines[0].tokenizer.colour"),
])
def test_a_bad_engine_report_is_a_problem_naming_its_field(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str], change: dict[str, Any],
        path: str) -> None:
    register(client, worker_key, "w1")
    beat(client, worker_key, {"supervised_engines": [engine("base", None)]})
    r = client.post("/v1/workers/w1/heartbeat", json={"supervised_engines": [{**engine("draft", None), **change}]},
                    headers=worker_key)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert [e["path"] for e in r.json()["errors"]] == [path], r.json()
    # Refused whole: the last good report stands.
    assert [e["engine"] for e in listed(client, admin)["supervised_engines"]] == ["base"]


def test_a_sidecar_that_registers_again_starts_without_the_last_ones_engines(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str], running: tuple[str, str]) -> None:
    revision, etag = running
    beat(client, worker_key, {"active_revision": revision, "active_etag": etag,
                              "supervised_engines": [engine("draft", "r-old", state="restarting")]})
    assert listed(client, admin)["converged"] is False
    # the sidecar restarted without --supervise: a report it will never send again must not hold convergence
    register(client, worker_key, "w1")
    ack = beat(client, worker_key, {"active_revision": revision, "active_etag": etag})
    assert ack["converged"] is True
    worker = listed(client, admin)
    assert (worker["supervised_engines"], worker["supervised_reported_at"], worker["engines_converged"]) == (
        [], None, None)
    # newlines and tabs are text an engine's error may hold
    beat(client, worker_key, {"supervised_engines": [engine("draft", revision, last_error="a\n\tb")]})
    assert listed(client, admin)["supervised_engines"][0]["last_error"] == "a\n\tb"


def test_each_engine_once_and_at_most_64(client: TestClient, worker_key: dict[str, str]) -> None:
    register(client, worker_key, "w1")
    r = client.post("/v1/workers/w1/heartbeat", json={"supervised_engines": [
        engine("base", None), engine("draft", None), engine("base", None, state="failed")]}, headers=worker_key)
    assert r.status_code == 422
    (error,) = r.json()["errors"]
    assert (error["path"], error["code"]) == ("supervised_engines", "duplicate_key")
    assert "index 2" in error["message"]
    many = [engine(f"e{i}", None) for i in range(65)]
    r = client.post("/v1/workers/w1/heartbeat", json={"supervised_engines": many}, headers=worker_key)
    assert [e["path"] for e in r.json()["errors"]] == ["supervised_engines"]
    beat(client, worker_key, {"supervised_engines": many[:64]})


def test_the_tokenizer_check_of_a_draft_model_is_shown_per_engine(
        client: TestClient, admin: dict[str, str], worker_key: dict[str, str], running: tuple[str, str]) -> None:
    revision, etag = running
    misaligned = {"aligned": False, "draft": "/models/other-draft",
                  "differences": ["draft has 32,000 tokens, target 32,064", "64 ids differ"],
                  "notes": ["eos differs (target '</s>' id 2, draft '<|end|>' id 7)"]}
    beat(client, worker_key, {"active_revision": revision, "active_etag": etag, "supervised_engines": [
        engine("base", revision),
        engine("draft", "r-old", failed_restarts=1, last_error="refused", tokenizer=misaligned)]})
    engines = {e["engine"]: e for e in listed(client, admin)["supervised_engines"]}
    assert engines["draft"]["tokenizer"] == misaligned
    assert engines["base"]["tokenizer"] is None
    worker = api_models.Worker.model_validate(listed(client, admin))
    draft = next(e for e in worker.supervised_engines if e.engine == "draft")
    assert draft.tokenizer is not None
    assert draft.tokenizer.differences[1] == "64 ids differ"
