"""Views over raw events when some are samples (``telemetry.raw_sample_rate``), on both databases.

A pre-aggregating worker sends every request in its rollup deltas and only a sample as raw events, each with
``sample_weight``, the requests it stands for. The views that read raw events (the summary per worker and per
replica, the what-if's request shapes) must count a sample as its weight, weight sums and means the same way,
and say what they rest on (``basis``); without samples they answer exactly what they did before, integers
included. Events go in through the ingest API, as a sidecar sends them; the expected figures are worked out
by hand below.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from controlplane.app import create_app
from controlplane.auth.schemas import Scope
from controlplane.settings import ControlPlaneSettings
from specgate.cli import app as cli_app
from tests.support.live import serve
from tests.support.telemetry_data import event, policy_text, seed

Headers = dict[str, str]
WEIGHT = 100.0  # a raw_sample_rate of 0.01


def _send(client: TestClient, worker_key: Headers, worker: str, events: list[dict[str, Any]]) -> None:
    body = {"batch_id": uuid.uuid4().hex, "worker_id": worker,
            "events": [{**e, "time": e["time"].isoformat()} for e in events]}
    r = client.post("/v1/telemetry/batches", json=body, headers=worker_key)
    assert r.status_code == 200, r.text
    assert (r.json()["stored"], r.json()["rejected_count"]) == (len(events), 0), r.text


def _sampled(e: dict[str, Any]) -> dict[str, Any]:
    return {**e, "sample_weight": WEIGHT}


def _worker_traffic(rid: str, *, sampled: bool) -> dict[str, list[dict[str, Any]]]:
    """Worker w-1: two ordinary requests and three that are samples when ``sampled`` (else ordinary too);
    worker w2: two ordinary requests."""
    o1 = event(revision=rid, itl=10.0, retries=1, accepted=60, worker="w-1")
    o2 = {**event(revision=rid, itl=10.0, accepted=30, worker="w-1"), "status": "error"}
    s = [event(revision=rid, itl=20.0, accepted=60, worker="w-1") for _ in range(3)]
    s[0]["status"] = "client_disconnect"
    if sampled:
        s = [_sampled(e) for e in s]
    return {"w-1": [o1, o2, *s], "w2": [event(revision=rid, itl=40.0, worker="w2") for _ in range(2)]}


def test_the_summary_per_worker_counts_each_sample_as_the_requests_it_stands_for(
        client: TestClient, viewer: Headers, worker_key: Headers, settings: ControlPlaneSettings) -> None:
    (rid,) = seed(settings.database_url, policy_text())
    for worker, events in _worker_traffic(rid, sampled=True).items():
        _send(client, worker_key, worker, events)

    r = client.get("/v1/analysis/summary", params={"group_by": "worker"}, headers=viewer)
    assert r.status_code == 200, r.text
    report = r.json()
    rows = {w["key"]["worker_id"]: w for w in report["workers"]}
    w1 = rows["w-1"]
    # 2 ordinary requests + 3 samples of 100 each
    assert w1["requests"] == 302
    assert w1["basis"] == {"events": 5, "sampled_events": 3, "represented_requests": 302, "estimated": True}
    assert w1["error_rate"] == pytest.approx((1 + 100) / 302)  # o2's error, and the disconnect sample's 100
    assert w1["client_disconnects"] == 100
    assert w1["client_disconnect_rate"] == pytest.approx(100 / 302)
    assert w1["retry_rate"] == pytest.approx(1 / 302)
    # drafted 90 each; accepted 60 and 30 on the ordinary ones, 60 on each sample
    assert w1["acceptance_rate"] == pytest.approx((60 + 30 + 300 * 60) / (90 + 90 + 300 * 90))
    assert w1["itl_ms_mean"] == pytest.approx((10 + 10 + 300 * 20) / 302)
    assert w1["e2e_ms_mean"] == pytest.approx((1050 + 1050 + 300 * 2050) / 302)  # e2e = 50 + 100 x ITL
    assert w1["ttft_ms_mean"] == pytest.approx(50.0)
    w2 = rows["w2"]
    assert w2["basis"] == {"events": 2, "sampled_events": 0, "represented_requests": 2, "estimated": False}
    assert (type(w2["requests"]), w2["requests"]) == (int, 2)
    assert type(w2["client_disconnects"]) is int
    assert report["basis"] == {"events": 7, "sampled_events": 3, "represented_requests": 304, "estimated": True}

    # per engine and replica: the same weights (every request here ran on draft, naming no replica)
    r = client.get("/v1/analysis/summary", params={"group_by": "replica"}, headers=viewer)
    (row,) = r.json()["replicas"]
    assert (row["key"], row["requests"]) == ({"engine": "draft", "replica": None}, 304)
    assert row["itl_ms_mean"] == pytest.approx((10 + 10 + 300 * 20 + 2 * 40) / 304)
    assert row["basis"]["estimated"] is True
    assert r.json()["basis"] == report["basis"]

    # the rollups never saw the samples' events (their requests come in rollup deltas): those rows are exact
    r = client.get("/v1/analysis/summary", params={"group_by": "route"}, headers=viewer)
    assert [row["requests"] for row in r.json()["rows"]] == [4]
    assert r.json()["basis"] is None


def test_without_samples_the_raw_event_views_answer_as_before(
        client: TestClient, viewer: Headers, worker_key: Headers, settings: ControlPlaneSettings) -> None:
    (rid,) = seed(settings.database_url, policy_text())
    for worker, events in _worker_traffic(rid, sampled=False).items():
        _send(client, worker_key, worker, events)

    report = client.get("/v1/analysis/summary", params={"group_by": "worker"}, headers=viewer).json()
    w1 = next(w for w in report["workers"] if w["key"]["worker_id"] == "w-1")
    assert (type(w1["requests"]), w1["requests"]) == (int, 5)
    assert (type(w1["client_disconnects"]), w1["client_disconnects"]) == (int, 1)
    assert w1["error_rate"] == 2 / 5
    assert w1["acceptance_rate"] == (60 + 30 + 3 * 60) / (5 * 90)
    assert w1["itl_ms_mean"] == pytest.approx((10 + 10 + 3 * 20) / 5)
    assert w1["basis"] == {"events": 5, "sampled_events": 0, "represented_requests": 5, "estimated": False}
    assert report["basis"] == {"events": 7, "sampled_events": 0, "represented_requests": 7, "estimated": False}

    r = client.post("/v1/analysis/what-if", json={"policy": "seed", "revision": rid}, headers=viewer)
    assert r.status_code == 200, r.text
    what_if = r.json()
    assert what_if["basis"] == {"events": 7, "sampled_events": 0, "represented_requests": 7, "estimated": False}
    (chat,) = what_if["routes"]
    for name in ("requests", "decisions_changed", "estimated_requests", "unestimated_requests"):
        assert type(chat[name]) is int, name
    assert (chat["requests"], chat["decisions_changed"], chat["estimated_requests"]) == (7, 0, 7)
    assert chat["basis"] == what_if["all_routes"]["basis"] == what_if["basis"]


def _what_if_traffic(rid: str) -> list[dict[str, Any]]:
    """Chat at batch 6 (plain under the active revision, threshold 4; speculative under threshold 8): two
    ordinary plain requests at 20 ms, one explored speculative one at 12 ms, three plain samples of 100; and one
    ordinary speculative request at batch 1 (10 ms), speculated under both."""
    events = [event(revision=rid, batch=6, speculate=False, itl=20.0) for _ in range(2)]
    events.append(event(revision=rid, batch=6, speculate=True, explored=True, itl=12.0))
    events += [_sampled(event(revision=rid, batch=6, speculate=False, itl=20.0)) for _ in range(3)]
    events.append(event(revision=rid, batch=1, itl=10.0))
    return events


def test_what_if_replays_each_sample_with_its_weight_and_says_so(
        client: TestClient, viewer: Headers, worker_key: Headers, settings: ControlPlaneSettings) -> None:
    (rid,) = seed(settings.database_url, policy_text())
    _send(client, worker_key, "w-1", _what_if_traffic(rid))

    r = client.post("/v1/analysis/what-if", json={"policy": "seed", "document": yaml.safe_load(policy_text(8))},
                    headers=viewer)
    assert r.status_code == 200, r.text
    report = r.json()
    (chat,) = report["routes"]
    # batch 6: 2 + 1 + 3 x 100 = 303 requests, every one decided anew onto the draft engine; batch 1: one
    assert chat["requests"] == 304
    assert chat["decisions_changed"] == 303
    assert (chat["estimated_requests"], chat["unestimated_requests"]) == (304, 0)
    assert chat["recorded_speculated_share"] == pytest.approx(2 / 304)
    assert chat["speculated_share_before"] == pytest.approx(1 / 304)
    assert chat["speculated_share_after"] == 1
    # latency per bucket and engine class from the rollups (the ordinary events): plain 20 ms, speculative 12 ms
    # at batch 6, speculative 10 ms at batch 1, weighted by the requests each shape stands for
    assert chat["itl_ms_mean"]["before"] == pytest.approx((303 * 20 + 10) / 304)
    assert chat["itl_ms_mean"]["after"] == pytest.approx((303 * 12 + 10) / 304)
    basis = {"events": 7, "sampled_events": 3, "represented_requests": 304, "estimated": True}
    assert chat["basis"] == report["all_routes"]["basis"] == report["basis"] == basis
    assert report["all_routes"]["decisions_changed"] == 303


def test_the_cli_says_when_a_view_rests_on_samples(migrated_url: str, worker_key: Headers, client: TestClient,
                                                   make_key: Callable[[Scope, str], str]) -> None:
    rid, candidate = seed(migrated_url, policy_text(), policy_text(8))
    _send(client, worker_key, "w2", _worker_traffic(rid, sampled=False)["w2"])
    # 7 events of w-1 (3 of them samples of 100) and 2 of w2: 9 rows standing for 306 requests
    note = ("Estimated from 9 recorded requests, 3 of them sampled, standing for about 306 "
            "(telemetry.raw_sample_rate: pre-aggregating workers send only a sample of their requests as raw "
            "events).")
    settings = ControlPlaneSettings(database_url=migrated_url, guardrail_interval_s=0, autopilot_interval_s=0)
    with serve(create_app(settings)) as url:
        env = {"SPECGATE_URL": url, "SPECGATE_KEY": make_key(Scope.viewer, "cli")}

        def run(*args: str) -> str:
            result = CliRunner().invoke(cli_app, list(args), env=env)
            assert result.exit_code == 0, result.output
            return result.output

        # nothing to say where no event is a sample
        assert run("analysis", "summary", "--group-by", "worker").splitlines() == [
            "w2                       n=2        acc=0.667 itl_mean=40ms err=0"]
        assert "Estimated" not in run("analysis", "what-if", "--policy", "seed", "--revision", candidate)

        _send(client, worker_key, "w-1", _what_if_traffic(rid))
        lines = run("analysis", "summary", "--group-by", "worker").splitlines()
        assert [line.split()[:2] for line in lines[:2]] == [["w-1", "n=~304"], ["w2", "n=2"]], lines
        assert lines[2:] == [note]
        lines = run("analysis", "summary", "--group-by", "replica").splitlines()
        assert [line.split()[0] for line in lines[:2]] == ["base/-", "draft/-"]
        assert lines[2:] == [note]
        out = run("analysis", "what-if", "--policy", "seed", "--revision", candidate)
        assert "decisions_changed: 303.0" in out  # an estimate: a float
        assert out.splitlines()[-1] == note
        assert run("analysis", "summary", "--group-by", "worker", "--route", "nowhere").strip() == ""
