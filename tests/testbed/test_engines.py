"""Engine bookkeeping without an engine: arguments, ports, the state file, stopping only what was started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from testbed import engines
from testbed.models import ModelPaths, Testbed

MODELS = ModelPaths(root=Path("/m"), target=Path("/m/target"), draft=Path("/m/draft"))


def test_base_has_no_speculation_and_no_spec_metrics_flag() -> None:
    args = engines.server_args("base", 8100, MODELS)
    assert "--speculative-config" not in args
    assert "--per-request-spec-decode-metrics" not in args
    assert "--enable-per-request-metrics" in args
    assert args[args.index("--model") + 1] == "/m/target"
    assert args[args.index("--dtype") + 1] == "float32"
    assert args[args.index("--max-model-len") + 1] == "1024"


@pytest.mark.parametrize(("variant", "method"), [("ngram", "ngram"), ("draft", "draft_model")])
def test_speculative_variants(variant: str, method: str) -> None:
    args = engines.server_args(variant, 8101, MODELS)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == method
    assert args[args.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert "--enable-per-request-metrics" in args
    if variant == "draft":
        assert spec["model"] == "/m/draft"


def test_a_draft_schedule_goes_into_the_speculative_config_and_means_nothing_to_a_plain_engine() -> None:
    args = engines.server_args("draft", 8101, MODELS, schedule=[(1, 4, 3), (5, 256, 0)])
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 256, 0]]
    assert spec["num_speculative_tokens"] == 3
    assert "num_speculative_tokens_per_batch_size" not in engines.server_args("draft", 8101, MODELS)[
        args.index("--speculative-config") + 1]
    with pytest.raises(ValueError, match="does not speculate"):
        engines.server_args("base", 8100, MODELS, schedule=[(1, 4, 3)])


def test_ports_are_fixed_per_variant() -> None:
    assert engines.ports_for(["draft", "base"], 9000) == {"draft": 9002, "base": 9000}
    with pytest.raises(ValueError, match="unknown engine variant"):
        engines.ports_for(["eagle"], 9000)
    with pytest.raises(ValueError, match="unknown engine variant"):
        engines.server_args("eagle", 1, MODELS)


def test_replicas_of_a_variant_are_instances_of_their_own() -> None:
    # base-2 is a second plain server: its variant's arguments, a port of its own (+3 per replica)
    assert engines.variant_of("base-2") == "base"
    assert engines.replica_number("draft-3") == 3
    assert engines.ports_for(["base", "draft", "base-2", "draft-2", "ngram-3"], 9000) == {
        "base": 9000, "draft": 9002, "base-2": 9003, "draft-2": 9005, "ngram-3": 9007}
    assert engines.server_args("base-2", 9003, MODELS) == [
        arg if arg != "9000" else "9003" for arg in engines.server_args("base", 9000, MODELS)]
    assert "--speculative-config" in engines.server_args("draft-2", 9005, MODELS)
    for bad in ("base-1", "base-4", "base-x", "base-", "eagle-2"):
        with pytest.raises(ValueError, match="unknown engine variant"):
            engines.variant_of(bad)


def test_second_replicas_take_the_other_half_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert engines.cpu_binding("base-2", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert engines.cpu_binding("draft-2", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert engines.cpu_binding("base-3", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}


def _record(name: str, pid: int, ticks: int) -> engines.EngineRecord:
    return engines.EngineRecord(name=name, pid=pid, start_ticks=ticks, port=1, url="http://127.0.0.1:1",
                                log="x.log", started_at=0.0)


def test_state_file_round_trip_and_garbage(tmp_path: Path) -> None:
    state = engines.StateFile(tmp_path / "s")
    assert state.read() == {}
    rec = _record("base", 123, 456)
    state.write({"base": rec})
    assert state.read() == {"base": rec}
    state.path.write_text("{not json")
    assert state.read() == {}
    state.path.write_text(json.dumps({"engines": {"base": {"pid": 1}, "ngram": {**rec.__dict__, "name": "ngram"}}}))
    assert list(state.read()) == ["ngram"]


def test_a_recycled_pid_is_not_ours() -> None:
    ticks = engines.process_start_ticks(os.getpid())
    assert ticks is not None
    assert engines.is_alive(_record("base", os.getpid(), ticks))
    assert not engines.is_alive(_record("base", os.getpid(), ticks + 1))
    assert engines.process_start_ticks(2**22 + 12345) is None


def test_stop_kills_the_whole_group_it_recorded_and_forgets_dead_ones(tmp_path: Path) -> None:
    # A leader with a child in its own session, like the vLLM server and its engine core.
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                             "print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"up"
    child = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True,
                               check=True).stdout.split()[0])
    ticks = engines.process_start_ticks(proc.pid)
    assert ticks is not None
    state = engines.StateFile(tmp_path)
    state.write({"base": _record("base", proc.pid, ticks), "ngram": _record("ngram", proc.pid, ticks + 1)})
    try:
        assert engines.stop(["ngram"], state_dir=tmp_path) == []  # not ours: a recycled pid
        assert proc.poll() is None
        assert list(state.read()) == ["base"]
        assert engines.stop(state_dir=tmp_path) == ["base"]
        assert proc.wait(timeout=10) == -signal.SIGTERM
        deadline = time.monotonic() + 10
        while engines.process_start_ticks(child) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engines.process_start_ticks(child) is None
        assert state.read() == {}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_status_reports_dead_engines(tmp_path: Path) -> None:
    engines.StateFile(tmp_path).write({"draft": _record("draft", 2**22 + 12345, 1)})
    status = engines.status(state_dir=tmp_path)
    assert status["draft"]["alive"] is False
    assert status["draft"]["healthy"] is False


# An engine another caller started and that is still loading: /health answers only after a delay.
_SLOW_HEALTH = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def _adopt(tmp_path: Path, delay_s: float) -> tuple[subprocess.Popen[bytes], int]:
    from tests.support.live import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_HEALTH, str(port), str(delay_s)], start_new_session=True)
    ticks = engines.process_start_ticks(proc.pid)
    assert ticks is not None
    record = engines.EngineRecord(name="base", pid=proc.pid, start_ticks=ticks, port=port,
                                  url=f"http://127.0.0.1:{port}", log=str(tmp_path / "base.log"), started_at=0.0)
    engines.StateFile(tmp_path).write({"base": record})
    return proc, port


def test_start_waits_for_an_engine_another_caller_is_still_starting(tmp_path: Path) -> None:
    proc, port = _adopt(tmp_path, delay_s=1.5)
    testbed = Testbed(python=Path(sys.executable), models=MODELS)
    try:
        t0 = time.monotonic()
        urls = engines.start(["base"], port, state_dir=tmp_path, testbed=testbed, timeout_s=30)
        assert urls == {"base": f"http://127.0.0.1:{port}"}
        assert time.monotonic() - t0 >= 1.0  # it waited for /health rather than answering at once
        assert engines.status(state_dir=tmp_path)["base"]["healthy"] is True
        assert proc.poll() is None  # adopted, never restarted or stopped
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_start_reports_an_adopted_engine_that_dies_while_starting(tmp_path: Path) -> None:
    proc, port = _adopt(tmp_path, delay_s=60)
    testbed = Testbed(python=Path(sys.executable), models=MODELS)
    threading.Timer(0.5, lambda: os.killpg(proc.pid, signal.SIGKILL)).start()
    with pytest.raises(RuntimeError, match="engine base exited while starting"):
        engines.start(["base"], port, state_dir=tmp_path, testbed=testbed, timeout_s=30)
    proc.wait()


def test_plain_and_speculative_engines_are_bound_to_different_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert engines.cpu_binding("base", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert engines.cpu_binding("ngram", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert engines.cpu_binding("draft", [1, 0]) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert engines.cpu_binding("base", [4, 5, 6, 7, 8]) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5"}
    assert engines.cpu_binding("draft", [4, 5, 6, 7, 8]) == {"VLLM_CPU_OMP_THREADS_BIND": "6,7,8"}
    # One CPU: nothing to spread over; vLLM's own default applies.
    assert engines.cpu_binding("draft", [3]) == {}


def test_an_explicit_binding_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert engines.cpu_binding("draft", [0, 1]) == {}


# A stand-in for the engine environment's interpreter: ignores vLLM's arguments but --port, starts a child
# of its own (vLLM's engine core) that ignores SIGTERM when FAKE_CHILD_IGNORES_TERM is set, writes both
# pids to PORT.pids in its working directory (the state directory) and answers /health.
_FAKE_VLLM = """
import http.server, os, signal, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if os.environ.get("FAKE_CHILD_IGNORES_TERM") else ""
kid = subprocess.Popen([sys.executable, "-c", f"import signal, time; {ignore}time.sleep(600)"])
with open(f"{port}.pids", "w") as out:
    out.write(f"{os.getpid()} {kid.pid}\\n")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _fake_vllm(tmp_path: Path) -> Path:
    script = tmp_path / "fake_vllm.py"
    script.write_text(_FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    return python


def _engine_pids(state: Path, port: int) -> dict[int, int | None]:
    pids = [int(p) for p in (state / f"{port}.pids").read_text().split()]
    return {pid: engines.process_start_ticks(pid) for pid in pids}


def _still_alive(pids: dict[int, int | None], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid, ticks in pids.items() if ticks is not None and engines.process_start_ticks(pid) == ticks]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _kill(pids: dict[int, int | None]) -> None:
    for pid in _still_alive(pids, 0):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_stop_also_ends_what_the_engine_left_in_its_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server exits on SIGTERM; a worker of its that ignores SIGTERM must not stay behind."""
    from tests.support.live import free_port

    monkeypatch.setenv("FAKE_CHILD_IGNORES_TERM", "1")
    port = free_port()
    testbed = Testbed(python=_fake_vllm(tmp_path), models=MODELS)
    engines.start(["base"], port, state_dir=tmp_path, testbed=testbed, timeout_s=30)
    pids = _engine_pids(tmp_path, port)
    try:
        assert engines.stop(state_dir=tmp_path) == ["base"]
        assert _still_alive(pids, 5) == []
    finally:
        _kill(pids)


_LAUNCHER = """
import sys, time
from pathlib import Path
from testbed import engines
from testbed.models import ModelPaths, Testbed
models = ModelPaths(root=Path("/m"), target=Path("/m/target"), draft=Path("/m/draft"))
engines.start(["base"], int(sys.argv[1]), state_dir=Path(sys.argv[2]), timeout_s=30,
              testbed=Testbed(python=Path(sys.argv[3]), models=models), die_with_parent=True)
print("ready", flush=True)
time.sleep(600)
"""


def test_engines_started_to_die_with_their_parent_go_when_it_is_killed(tmp_path: Path) -> None:
    """``specgate up`` killed outright (SIGKILL): its engines and their worker processes go too."""
    from tests.support.live import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(engines.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p)}
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(port), str(tmp_path), str(_fake_vllm(tmp_path))],
                                stdout=subprocess.PIPE, text=True, env=env)
    assert launcher.stdout is not None
    pids: dict[int, int | None] = {}
    try:
        assert launcher.stdout.readline().strip() == "ready"
        record = engines.StateFile(tmp_path).read()["base"]
        pids = {record.pid: record.start_ticks, **_engine_pids(tmp_path, port)}
        assert len(_still_alive(pids, 0)) == 3  # the supervisor, the server and its child
        launcher.kill()
        launcher.wait(10)
        assert _still_alive(pids, 15) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        _kill(pids)
