"""Smoke test of the proxy overhead benchmark (bench/proxy.py).

Tiny and sidecar only (no peer needs to be installed): the fake upstream, the
stand-in control plane, a real ``specgate sidecar`` process and the load
generator, one direct+proxied pair per level and kind of request. Correctness
only: every answer is complete, the sidecar's answers carry the decision
header, the streams carry all their tokens, the sidecar's telemetry arrives.
Nothing here asserts a timing.
"""

from __future__ import annotations

import importlib
import math
import sys

from tests.support import paths

# bench/ is not an installed package: make the repository root importable.
_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
proxy = importlib.import_module("bench.proxy")


def test_sidecar_against_direct_answers_completely() -> None:
    config = proxy.Config(levels=[1, 4], peers=["sidecar"], pairs=1, duration_s=0.4, warmup_s=0.1,
                          max_load=math.inf, load_wait_s=0.0, validate=True, ready_timeout_s=60.0)
    report = proxy.run(config)

    runs = report["runs"]
    assert {(r["mode"], r["level"]) for r in runs} == {("json", 1), ("json", 4), ("stream", 1), ("stream", 4)}
    for r in runs:
        assert r["peer"] == "sidecar"
        for kind in ("direct", "proxied"):
            run = r[kind]
            assert run["completed"] > 0, (kind, run)
            assert run["errors"] == run["bad"] == 0, (kind, run["first_error"])
            assert set(run["statuses"]) == {"200"}, run["statuses"]
            assert run["stuck"] == 0
            if r["mode"] == "stream":
                # a role chunk, 64 content chunks, the finish chunk and [DONE]; the usage chunk the sidecar
                # asked for on the client's behalf is not relayed
                assert run["content_chunks"] == 64 * run["completed"]
                assert run["events"] == 67 * run["completed"]
        # the sidecar did the proxying: its CPU time moved (the direct runs bypass it)
        assert r["proxied"]["cpu_s"]["proxy"] > 0, r["proxied"]["cpu_s"]
        # the sidecar decides every request it proxies; the upstream alone adds no decision header
        assert r["proxied"]["decision_header"] == r["proxied"]["completed"]
        assert r["direct"]["decision_header"] == 0

    telemetry = report["telemetry"]
    answered = sum(r["proxied"]["completed_total"] for r in runs)
    assert telemetry["events_received"] == telemetry["sidecar_requests_answered"] > answered

    rows = report["rows"]
    assert len(rows) == 4
    assert all(row["errors"] == 0 and row["pairs"] == 1 for row in rows)
    assert {g["goal"].split(" ")[0] for g in report["goals"]} >= {"added", "CPU"}
    text = proxy.render(report)
    assert "sidecar" in text
    assert "Goals" in text


def test_the_gateway_peer_proxies_over_two_replicas_beside_the_sidecar() -> None:
    config = proxy.Config(levels=[4], modes=["json"], peers=["sidecar", "gateway"], pairs=1, duration_s=0.4,
                          warmup_s=0.1, max_load=math.inf, load_wait_s=0.0, validate=True, ready_timeout_s=60.0)
    report = proxy.run(config)
    runs = {r["peer"]: r for r in report["runs"]}
    assert set(runs) == {"sidecar", "gateway"}
    gateway = runs["gateway"]["proxied"]
    assert gateway["completed"] > 0
    assert gateway["errors"] == gateway["bad"] == 0
    assert gateway["decision_header"] == gateway["completed"]
    assert gateway["cpu_s"]["proxy"] > 0
    # both send their events to the stand-in control plane: one per request either answered
    assert report["telemetry"]["events_received"] == report["telemetry"]["sidecar_requests_answered"]
    # the goal of replica pools: what the gateway adds to the sidecar's CPU per request (no timing asserted)
    [goal] = [g for g in report["goals"] if g["goal"].startswith("replica pools")]
    assert goal["result"].startswith("json c=4: ")
    assert goal["result"].endswith(" us")


def test_profile_summary_attributes_samples() -> None:
    root = proxy.ROOT
    raw = (f"run ({root}/sidecar/main.py:1);SidecarApp._api ({root}/sidecar/proxy.py:10) 3\n"
           f"run ({root}/sidecar/main.py:1);Runner.run (/usr/lib/python3.11/asyncio/runners.py:118) 1\n")
    summary = proxy.summarize_profile(raw)
    assert summary["samples"] == 4
    assert summary["self"][0] == ["SidecarApp._api (sidecar/proxy.py)", 75.0]
    assert summary["self"][1] == ["Runner.run (asyncio/runners.py)", 25.0]
    assert dict(summary["areas"])["uvloop C code under the event loop (socket reads/writes, syscalls, scheduling)"] \
        == 25.0
