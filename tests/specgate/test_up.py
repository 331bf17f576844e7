"""``specgate up`` with engines: choosing them, fitting the testbed policy, and the whole orchestration
(sidecar registered, looping traffic turned into telemetry, every child stopped on Ctrl-C or SIGTERM)
with FAKE engines standing in for vLLM (tests/controlplane/fake_engines.py)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from policies import load_policy
from specgate import stack as devstack
from testbed import engines as testbed_engines
from testbed.engines import process_start_ticks
from tests.support import paths
from tests.support.cli import line_queue, specgate_command
from tests.support.live import ctrl_c_as_at_a_terminal, free_port

REPO_ROOT = paths.ROOT
TESTBED_POLICY = REPO_ROOT / "policies" / "examples" / "testbed.yaml"


# --- choosing engines ----------------------------------------------------------------------

@pytest.mark.parametrize(("available", "expected", "reason"), [
    (None, ["base", "draft", "ngram"], "all variants (available memory unknown)"),
    (24.0, ["base", "draft", "ngram"], "24.0 GiB available, about 3 GiB per engine"),
    (8.5, ["base", "draft"], "8.5 GiB available, about 3 GiB per engine"),
    (5.5, ["base"], "5.5 GiB available, about 3 GiB per engine"),
    (1.0, ["base"], "1.0 GiB available, about 3 GiB per engine; tight, starting base anyway"),
])
def test_auto_starts_as_many_engines_as_memory_holds(available: float | None, expected: list[str],
                                                     reason: str) -> None:
    chosen, why = devstack.choose_engines("auto", available)
    assert chosen == expected
    assert why == reason


def test_named_engines_are_checked_and_ordered() -> None:
    assert devstack.choose_engines("draft, base", 1.0) == (["base", "draft"], "as asked")
    with pytest.raises(ValueError, match="unknown variant"):
        devstack.choose_engines("base,eagle", None)
    with pytest.raises(ValueError, match="must include base"):
        devstack.choose_engines("draft,ngram", None)


# --- the testbed policy --------------------------------------------------------------------

def _testbed_data() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(TESTBED_POLICY.read_text())
    return data


def test_the_testbed_policy_matches_the_testbed_engines() -> None:
    doc = load_policy(TESTBED_POLICY.read_text())
    assert set(doc.engines) == set(testbed_engines.VARIANTS)
    assert doc.engines["ngram"].num_speculative_tokens == testbed_engines.NGRAM_K  # type: ignore[union-attr]
    assert doc.engines["draft"].num_speculative_tokens == testbed_engines.DRAFT_K  # type: ignore[union-attr]
    assert doc.exploration.rate > 0


@pytest.mark.parametrize("running", [["base", "draft", "ngram"], ["base", "draft"], ["base", "ngram"], ["base"]])
def test_the_fitted_policy_names_only_running_engines_and_stays_valid(running: list[str]) -> None:
    original = _testbed_data()
    fitted = devstack.fit_policy(original, running)
    assert original == _testbed_data()  # not changed in place
    doc = load_policy(json.dumps(fitted))
    assert set(doc.engines) == set(running)
    used = {rule.then.engine for rule in doc.rules} | {doc.default.engine}
    assert used <= set(running)
    if running == ["base"]:
        assert doc.exploration.rate == 0
    else:
        assert doc.exploration.speculative_engine in running
    if running == ["base", "draft"]:  # extraction goes to the draft model instead of the missing n-gram engine
        assert next(r for r in doc.rules if r.name == "extract-ngram").then.engine == "draft"


# --- the orchestration, on fake engines ----------------------------------------------------

def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports."""
    for _ in range(50):
        first = free_port()
        if first + count >= 65535:
            continue
        socks = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", port))
                socks.append(sock)
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no run of free ports")


def _start_up(tmp_path: Path, starter: str, *extra: str) -> tuple[subprocess.Popen[str], dict[str, int]]:
    ports = {"port": free_port(), "dashboard": free_port(), "sidecar": free_port(), "engine": _free_ports(3)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [*specgate_command(), "up", "--data-dir", str(tmp_path / "data"), "--port", str(ports["port"]),
           "--dashboard-port", str(ports["dashboard"]), "--engines", "base,ngram,draft",
           "--engine-port", str(ports["engine"]), "--sidecar-port", str(ports["sidecar"]),
           "--engine-starter", starter, *extra]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=ctrl_c_as_at_a_terminal)
    return proc, ports


def _read_until(proc: subprocess.Popen[str], out: queue.Queue[str], marker: str, timeout_s: float) -> str:
    text = ""
    deadline = time.monotonic() + timeout_s
    while marker not in text:
        assert proc.poll() is None, f"specgate up exited early ({proc.returncode}):\n{text}"
        assert time.monotonic() < deadline, f"no {marker!r} within {timeout_s} s:\n{text}"
        try:
            text += out.get(timeout=0.5)
        except queue.Empty:
            continue
    return text


def _children(data: Path) -> dict[str, tuple[int, int]]:
    """name -> (pid, start ticks) of every process ``up`` recorded, the fake engines included."""
    recorded = json.loads((data / "run.json").read_text())["children"]
    out = {name: (entry["pid"], entry["start_ticks"]) for name, entry in recorded.items()}
    out["engines"] = _fake_engines(data)
    return out


def _fake_engines(data: Path) -> tuple[int, int]:
    pid, ticks = (int(v) for v in (data / "engines" / "fake-engines.pid").read_text().split())
    return pid, ticks


def _gone(children: dict[str, tuple[int, int]]) -> dict[str, int]:
    deadline = time.monotonic() + 10
    while True:
        alive = {name: pid for name, (pid, ticks) in children.items() if process_start_ticks(pid) == ticks}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _cleanup(proc: subprocess.Popen[str], data: Path) -> None:
    """After a failure: let ``up`` stop its children (SIGTERM), then stop whatever it recorded and left."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    recorded: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        recorded = json.loads((data / "run.json").read_text())["children"]
    with contextlib.suppress(OSError, ValueError):
        pid, ticks = _fake_engines(data)
        recorded["engines"] = {"pid": pid, "start_ticks": ticks, "own_group": True}
    for entry in recorded.values():
        if entry.get("start_ticks") is not None and process_start_ticks(entry["pid"]) == entry["start_ticks"]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if entry.get("own_group"):
                    os.killpg(entry["pid"], signal.SIGKILL)
                else:
                    os.kill(entry["pid"], signal.SIGKILL)


def _refused(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
    except httpx.ConnectError:
        return True
    return False


def test_up_registers_a_sidecar_turns_traffic_into_telemetry_and_sigint_stops_every_child(tmp_path: Path) -> None:
    proc, ports = _start_up(tmp_path, "tests.support.fake_engines:FakeEngineStarter")
    assert proc.stdout is not None
    data = tmp_path / "data"
    try:
        out = line_queue(proc.stdout)
        text = _read_until(proc, out, "Ctrl-C stops everything", 120)
        assert "specgate is up" in text
        banner = text.split("specgate is up")[1]
        base = re.search(r"control plane +(\S+)", banner)
        key = re.search(r"admin key +(sgk_\S+)", banner)
        assert base, text
        assert key, text
        sidecar_url = f"http://127.0.0.1:{ports['sidecar']}"
        assert f"{sidecar_url}/v1" in text
        for name, offset in (("base", 0), ("ngram", 1), ("draft", 2)):
            assert re.search(rf"engine {name} +http://127.0.0.1:{ports['engine'] + offset}\b", text), text
        assert re.search(rf"dashboard +http://127.0.0.1:{ports['dashboard']}\b", text), text
        children = _children(data)
        assert set(children) == {"sidecar", "loadgen", "dashboard", "engines"}

        with httpx.Client(base_url=base.group(1), headers={"Authorization": f"Bearer {key.group(1)}"},
                          timeout=10) as api:
            workers = api.get("/v1/workers", params={"pool": "testbed"}).json()["items"]
            worker = next(w for w in workers if w["id"] == f"127.0.0.1:{ports['sidecar']}")
            assert set(worker["engines"]) == {"base", "ngram", "draft"}
            assert worker["converged"]
            policy = api.get("/v1/policies/testbed").json()
            assert policy["pool"] == "testbed"
            assert policy["active_revision_id"]

            # The looping traffic generator's requests arrive as telemetry, speculative ones with
            # the engine's acceptance numbers, explored ones tagged.
            deadline = time.monotonic() + 60
            while True:
                groups = api.get("/v1/telemetry/rollups", params={"group_by": "engine,explored"}).json()["groups"]
                speculative = [g for g in groups if g["key"]["engine"] in ("ngram", "draft")
                               and g["acceptance_rate"] is not None]
                plain = [g for g in groups if g["key"]["engine"] == "base" and g["counters"]["requests"]]
                explored = [g for g in groups if g["key"]["explored"]]
                # the traffic's route mix is random: the first requests need not cover every route yet
                routes = api.get("/v1/analysis/summary", params={"group_by": "route"}).json()["rows"]
                if speculative and plain and explored and {"extract", "chat"} <= {r["key"]["route"] for r in routes}:
                    break
                assert time.monotonic() < deadline, json.dumps({"groups": groups, "routes": routes}, indent=1)
                time.sleep(1)
            assert all(g["key"] for g in groups)

        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        rest = "".join(out.get() for _ in range(out.qsize()))
        assert proc.returncode == 0, rest
        assert "stopping..." in rest
        assert _gone(children) == {}
        assert _refused(f"{sidecar_url}/healthz")
        assert _refused(f"http://127.0.0.1:{ports['engine']}/v1/models")
        assert _refused(f"{base.group(1)}/healthz")
        assert not (data / "run.json").exists()
    finally:
        _cleanup(proc, data)




def test_sigterm_during_engine_start_up_stops_the_engines_already_started(tmp_path: Path) -> None:
    proc, ports = _start_up(tmp_path, "tests.support.fake_engines:SlowFakeEngineStarter")
    assert proc.stdout is not None
    data = tmp_path / "data"
    try:
        out = line_queue(proc.stdout)
        _read_until(proc, out, "fake engines waiting forever", 60)
        pid, ticks = _fake_engines(data)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode == 0
        assert _gone({"engines": (pid, ticks)}) == {}
        assert _refused(f"http://127.0.0.1:{ports['engine']}/v1/models")
    finally:
        _cleanup(proc, data)


def test_loadgen_loop_repeats_the_schedule_with_fresh_request_ids_until_sigint(tmp_path: Path) -> None:
    import asyncio
    import threading

    from tests.support.fake_upstream import FakeEngine

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine = FakeEngine("base")
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(10)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*specgate_command(), "loadgen", "--url", engine.url, "--loop", "--requests", "3",
                             "--concurrency", "1", "--report-every", "0"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        out = line_queue(proc.stdout)
        _read_until(proc, out, "round 3:", 60)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.returncode == 0
        ids = engine.request_ids()
        assert len(ids) >= 9
        assert len(set(ids)) == len(ids)  # every round its own request ids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        asyncio.run_coroutine_threadsafe(engine.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
