"""``specgate up`` with engines: choosing them, fitting the testbed policy, and the whole orchestration
(sidecar registered, looping traffic turned into telemetry, every child stopped on Ctrl-C or SIGTERM)
with FAKE engines standing in for vLLM (tests/controlplane/fake_engines.py)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from controlplane.db import make_engine, make_sessionmaker
from controlplane.rollout.service import fleet_cohort_secret
from policies import load_policy, sticky_fraction
from policies.evaluate import exploration_salt
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


@pytest.mark.parametrize(("available", "expected"), [
    (None, ["base", "draft", "base-2"]),
    (24.0, ["base", "draft", "base-2"]),
    (8.5, ["base", "draft"]),
    (1.0, ["base", "draft"]),
])
def test_the_pool_shape_starts_a_speculative_replica_and_plain_ones(available: float | None,
                                                                    expected: list[str]) -> None:
    assert devstack.choose_pool_engines("auto", available)[0] == expected
    assert devstack.choose_pool_engines("base,base-2,draft, draft-2", None) == (
        ["base", "base-2", "draft", "draft-2"], "as asked")
    for bad, message in (("base,base-2", "a speculative one"), ("draft,ngram", "a plain replica"),
                         ("base,draft-9", "unknown engine variant")):
        with pytest.raises(ValueError, match=message):
            devstack.choose_pool_engines(bad, None)


def test_replicas_of_one_variant_become_one_engine_of_the_gateway(tmp_path: Path) -> None:
    urls = {"base": "http://127.0.0.1:8100", "draft": "http://127.0.0.1:8102", "base-2": "http://127.0.0.1:8103"}
    assert devstack.engine_pools(urls) == {"base": ["http://127.0.0.1:8100", "http://127.0.0.1:8103"],
                                           "draft": ["http://127.0.0.1:8102"]}
    cmd = devstack.sidecar_command(api_url="http://cp", engine_urls=urls, listen="127.0.0.1:9000", pool="testbed",
                                   state_dir=tmp_path, bundle_key="KEY", kind="gateway")
    assert cmd[cmd.index("--kind") + 1] == "gateway"
    engines_given = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--engine"]
    assert engines_given == ["base=http://127.0.0.1:8100,http://127.0.0.1:8103", "draft=http://127.0.0.1:8102"]


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
    ports = {"port": free_port(), "dashboard": free_port(), "sidecar": free_port(), "engine": _free_ports(4)}
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


def _read_until(proc: subprocess.Popen[Any], out: queue.Queue[str], marker: str, timeout_s: float) -> str:
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


def _until_an_explored_window_ended(data: Path) -> float:
    """Seconds from now to the end of the testbed policy's first explored time window."""
    doc = load_policy(TESTBED_POLICY.read_text())
    window_s, rate = doc.exploration.window_s, doc.exploration.rate
    assert window_s is not None
    engine = make_engine(f"sqlite:///{data / 'specgate.db'}")
    try:
        with make_sessionmaker(engine)() as session:
            salt = exploration_salt(doc.name, fleet_cohort_secret(session))
    finally:
        engine.dispose()
    now = time.time()
    index = math.floor(now / window_s)
    while sticky_fraction(f"window:{index}", salt) >= rate:
        index += 1
    return (index + 1) * window_s - now


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
        # Keys travel in the environment or files: a command line is readable by every user (`ps`).
        tree = _descendants(proc.pid)
        assert len(tree) >= len(children)
        assert not {pid: line for pid, line in _cmdlines(tree).items() if "sgk_" in line}

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
            # the engine's acceptance numbers, explored ones tagged. The testbed explores whole time
            # windows: the wait lasts until the end of the first explored window from now (its sticky
            # hash is salted with the fleet's cohort secret), plus a margin for the telemetry to arrive.
            deadline = time.monotonic() + 60 + _until_an_explored_window_ended(data)
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




def test_up_in_the_pool_shape_puts_a_gateway_in_front_of_replica_pools(tmp_path: Path) -> None:
    proc, ports = _start_up(tmp_path, "tests.support.fake_engines:FakeEngineStarter", "--shape", "pools",
                            "--engines", "base,draft,base-2", "--no-traffic", "--dashboard-port", "0")
    assert proc.stdout is not None
    data = tmp_path / "data"
    try:
        out = line_queue(proc.stdout)
        text = _read_until(proc, out, "Ctrl-C stops everything", 120)
        banner = text.split("specgate is up")[1]
        base = re.search(r"control plane +(\S+)", banner)
        key = re.search(r"admin key +(sgk_\S+)", banner)
        assert base, text
        assert key, text
        gateway = f"127.0.0.1:{ports['sidecar']}"
        assert re.search(rf"gateway +http://{gateway}/v1 +\(OpenAI-compatible; gateway {gateway}", banner), banner
        assert re.search(rf"engine base-2 +http://127.0.0.1:{ports['engine'] + 3}\b", banner), banner
        with httpx.Client(base_url=base.group(1), headers={"Authorization": f"Bearer {key.group(1)}"},
                          timeout=10) as api:
            def reported() -> dict[str, Any]:
                items = api.get("/v1/workers", params={"kind": "gateway"}).json()["items"]
                return next((w for w in items if w["id"] == gateway), {"replicas": []})

            deadline = time.monotonic() + 30
            while len(reported()["replicas"]) < 3:
                assert time.monotonic() < deadline, reported()
                time.sleep(0.5)
            worker = reported()
        assert worker["kind"] == "gateway"
        engine = f"http://127.0.0.1:{ports['engine']}"
        assert worker["engines"] == {"base": f"{engine},http://127.0.0.1:{ports['engine'] + 3}",
                                     "draft": f"http://127.0.0.1:{ports['engine'] + 2}"}
        assert sorted((r["engine"], r["state"]) for r in worker["replicas"]) == [
            ("base", "healthy"), ("base", "healthy"), ("draft", "healthy")]
        # through the gateway: a chat request at batch 1 runs on the speculative replica and names it.
        # The testbed explores whole 10-second windows: a request in one of them runs on a plain
        # replica instead (and says so); the test then waits for a window of the policy's own.
        base_replicas = {f"127.0.0.1:{ports['engine']}", f"127.0.0.1:{ports['engine'] + 3}"}
        deadline = time.monotonic() + 60
        while True:
            answer = httpx.post(f"http://{gateway}/v1/chat/completions", headers={"X-Specgate-Route": "chat"},
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
            assert answer.status_code == 200, answer.text
            decision = dict(part.split("=", 1) for part in answer.headers["x-specgate-decision"].split("; "))
            if decision.get("explored") != "true":
                break
            assert decision["engine"] == "base", decision
            assert decision["replica"] in base_replicas, decision
            assert time.monotonic() < deadline, "no window of the policy's own within 60 s"
            time.sleep(1)
        assert decision["engine"] == "draft", decision
        assert decision["replica"] == f"127.0.0.1:{ports['engine'] + 2}", decision
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        assert proc.returncode == 0
    finally:
        _cleanup(proc, data)


def test_up_refuses_an_unknown_shape(tmp_path: Path) -> None:
    result = subprocess.run([*specgate_command(), "up", "--data-dir", str(tmp_path), "--shape", "mesh"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2
    assert "--shape must be twin or pools, got 'mesh'" in result.stderr


# --- output that goes away, and a parent killed outright --------------------------------------

def _descendants(root: int) -> dict[int, int]:
    """pid -> start ticks of every living process below ``root``."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid, ppid in parents.items():
            ticks = process_start_ticks(pid)
            if ppid == parent and pid not in found and ticks is not None:
                found[pid] = ticks
                todo.append(pid)
    return found


def _cmdlines(pids: dict[int, int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return out


def _still_running(pids: dict[int, int], timeout_s: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {pid: ticks for pid, ticks in pids.items() if process_start_ticks(pid) == ticks}
        if not alive or time.monotonic() > deadline:
            return _cmdlines(alive)
        time.sleep(0.2)


def _kill_all(pids: dict[int, int]) -> None:
    for pid, ticks in pids.items():
        if process_start_ticks(pid) == ticks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# Passes its input on, like `tee`: killing it is what a Ctrl-C does to `make run 2>&1 | tee run.log`.
_RELAY = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()\n"


def _up_light(tmp_path: Path) -> tuple[subprocess.Popen[bytes], subprocess.Popen[str], dict[str, int]]:
    """``specgate up --no-engines`` with its output through a relay; (up, relay, ports)."""
    ports = {"port": free_port(), "dashboard": free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [*specgate_command(), "up", "--no-engines", "--data-dir", str(tmp_path / "data"),
           "--port", str(ports["port"]), "--dashboard-port", str(ports["dashboard"])]
    up = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True, preexec_fn=ctrl_c_as_at_a_terminal)
    relay = subprocess.Popen([sys.executable, "-c", _RELAY], stdin=up.stdout, stdout=subprocess.PIPE, text=True)
    assert up.stdout is not None
    up.stdout.close()  # the relay holds the only reading end now
    return up, relay, ports


def _stop_light(up: subprocess.Popen[bytes], relay: subprocess.Popen[str], tree: dict[int, int]) -> None:
    for proc in (relay, up):
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    _kill_all(tree)


@contextlib.contextmanager
def _light_stack_up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[str],
                                                      dict[str, int], dict[int, int]]]:
    """`up` without engines, piped through a relay as through `tee`, once it says it is up; stopped after."""
    up, relay, ports = _up_light(tmp_path)
    tree: dict[int, int] = {}
    try:
        assert relay.stdout is not None
        _read_until(up, line_queue(relay.stdout), "Ctrl-C stops everything", 120)
        tree.update(_descendants(up.pid))
        assert tree, "the dashboard is not running"
        yield up, relay, ports, tree
    finally:
        _stop_light(up, relay, tree)


def test_ctrl_c_stops_every_child_when_the_output_pipe_is_gone(tmp_path: Path) -> None:
    """`make run 2>&1 | tee run.log` and Ctrl-C: `tee` dies too, every line `up` writes while stopping meets a
    closed pipe, and still everything it started stops."""
    with _light_stack_up(tmp_path) as (up, relay, ports, tree):
        relay.kill()
        relay.wait(10)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert _still_running(tree, 10) == {}
        assert _refused(f"http://127.0.0.1:{ports['port']}/healthz")
        assert _refused(f"http://127.0.0.1:{ports['dashboard']}/")


def test_what_up_started_dies_with_it_when_it_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves `up` no chance to stop anything: its children go by the parent-death signal."""
    with _light_stack_up(tmp_path) as (up, _relay, _ports, tree):
        up.kill()
        up.wait(10)
        assert _still_running(tree, 20) == {}


# A launcher that starts a stand-in child (which starts one of its own) with the stack's launcher, prints
# the pids, and waits to be killed.
_LAUNCH = """
import sys, time
from pathlib import Path
from specgate import stack
tree = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \
       "time.sleep(600)"
child = stack.spawn("sidecar", [sys.executable, "-c", tree], Path(sys.argv[1]))
print(child.process.pid, flush=True)
time.sleep(600)
"""


def test_the_stack_launcher_ties_a_child_and_its_own_children_to_the_launcher(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                                       if p)}
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCH, str(tmp_path / "child.log")], stdout=subprocess.PIPE,
                                text=True, env=env)
    tree: dict[int, int] = {}
    try:
        assert launcher.stdout is not None
        launcher.stdout.readline()
        deadline = time.monotonic() + 20
        while len(tree) < 3 and time.monotonic() < deadline:  # the supervisor, the child, its child
            tree = _descendants(launcher.pid)
            time.sleep(0.1)
        assert len(tree) == 3, _cmdlines(tree)
        launcher.kill()
        launcher.wait(10)
        assert _still_running(tree, 15) == {}
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        _kill_all(tree)


def test_stopping_the_stack_reaches_every_child_when_nothing_can_be_written(tmp_path: Path) -> None:
    def broken(line: str) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    stack = devstack.Stack(data_dir=tmp_path, say=broken)
    for name in ("loadgen", "sidecar", "dashboard"):
        stack.add(devstack.spawn(name, [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / name))
    processes = [child.process for child in stack.children]
    try:
        stack.stop()
        assert [p.poll() is not None for p in processes] == [True, True, True]
        assert not (tmp_path / "run.json").exists()
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)


def test_the_sidecar_gets_its_key_from_the_environment_not_the_command_line() -> None:
    cmd = devstack.sidecar_command(api_url="http://127.0.0.1:1", engine_urls={"base": "http://127.0.0.1:2"},
                                   listen="127.0.0.1:3", pool="testbed", state_dir=Path("s"), bundle_key="pk")
    assert "--key" not in cmd
    env = devstack.sidecar_env("sgk_secret", {"SPECGATE_KEY_FILE": "/elsewhere", "PATH": "/bin"})
    assert env == {"SPECGATE_KEY": "sgk_secret", "PATH": "/bin"}


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
