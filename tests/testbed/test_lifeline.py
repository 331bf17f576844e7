"""testbed.lifeline: a command, and the processes it starts, end with the process that launched it.

Stand-in commands only (``python -c`` with sleeps); every test is bounded and kills what it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import lifeline
from testbed.engines import process_start_ticks

pytestmark = pytest.mark.skipif(not lifeline.SUPPORTED, reason="the parent-death signal is Linux's")

# A command that starts a child of its own (like vLLM's server and its engine core), writes both pids,
# and sleeps; argv[1]: the pid file, argv[2]: "ignore" to ignore SIGTERM (a process that will not stop).
TREE = """
import signal, subprocess, sys, time
if sys.argv[2] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
kid = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\\n"
                        "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                        "time.sleep(600)", sys.argv[2]])
open(sys.argv[1], "w").write(f"{__import__('os').getpid()} {kid.pid}\\n")
time.sleep(600)
"""

# A launcher that wraps TREE and sleeps until it is killed; argv[1]: pid file, argv[2]: grace, argv[3]: mode.
LAUNCHER = """
import subprocess, sys, time
from testbed import lifeline
tree = sys.argv[4]
cmd = lifeline.wrap([sys.executable, "-c", tree, sys.argv[1], sys.argv[3]], grace_s=float(sys.argv[2]))
proc = subprocess.Popen(cmd, start_new_session=True)
print(proc.pid, flush=True)
time.sleep(600)
"""


def _pids(pid_file: Path, timeout_s: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            text = pid_file.read_text()
            if text.endswith("\n"):
                return [int(p) for p in text.split()]
        time.sleep(0.05)
    raise AssertionError(f"the command did not write {pid_file} within {timeout_s} s")


def _alive(pids: dict[int, int | None]) -> list[int]:
    return [pid for pid, ticks in pids.items() if ticks is not None and process_start_ticks(pid) == ticks]


def _wait_gone(pids: dict[int, int | None], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pids)


@contextlib.contextmanager
def _killed_after(pids: dict[int, int | None]) -> Iterator[None]:
    try:
        yield
    finally:
        for pid in _alive(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _env() -> dict[str, str]:
    root = str(Path(lifeline.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.parametrize(("mode", "grace_s", "within_s"), [("stop", 5.0, 10.0), ("ignore", 1.0, 10.0)])
def test_a_killed_launcher_takes_the_command_and_its_children_along(tmp_path: Path, mode: str, grace_s: float,
                                                                    within_s: float) -> None:
    """SIGKILL leaves the launcher no chance to stop anything: the kernel's parent-death signal does it, and
    a process that ignores SIGTERM is killed once the grace is over."""
    pid_file = tmp_path / "pids"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(pid_file), str(grace_s), mode, TREE],
                                stdout=subprocess.PIPE, text=True, env=_env())
    assert launcher.stdout is not None
    supervisor = int(launcher.stdout.readline())
    tree = {pid: process_start_ticks(pid) for pid in [supervisor, *_pids(pid_file)]}
    with _killed_after(tree):
        assert len(_alive(tree)) == 3
        launcher.kill()
        launcher.wait(10)
        assert _wait_gone(tree, within_s) == []


def test_a_group_stop_reaches_the_command_once_and_the_supervisor_exits_as_it_did(tmp_path: Path) -> None:
    marks = tmp_path / "sigterms"
    code = ("import os, signal, sys, time\n"
            "def on_term(signum, frame):\n"
            "    open(sys.argv[1], 'a').write('term\\n')\n"
            "signal.signal(signal.SIGTERM, on_term)\n"
            "open(sys.argv[1], 'a').write('up\\n')\n"
            "while 'term' not in open(sys.argv[1]).read(): time.sleep(0.05)\n"
            "time.sleep(0.5)\n"  # a second SIGTERM, if one came, would be counted meanwhile
            "sys.exit(3)\n")
    proc = subprocess.Popen(lifeline.wrap([sys.executable, "-c", code, str(marks)]), start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not (marks.exists() and "up" in marks.read_text()):
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(10) == 3
        assert marks.read_text().split() == ["up", "term"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def test_what_the_command_leaves_in_its_group_goes_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    code = ("import subprocess, sys\n"
            "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "open(sys.argv[1], 'w').write(f'{kid.pid}\\n')\n")
    proc = subprocess.Popen(lifeline.wrap([sys.executable, "-c", code, str(pid_file)]), start_new_session=True)
    try:
        assert proc.wait(20) == 0
        (kid,) = _pids(pid_file)
        assert _wait_gone({kid: process_start_ticks(kid) or -1}, 5) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_launcher_already_gone_starts_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    cmd = lifeline.wrap([sys.executable, "-c", "import sys; open(sys.argv[1], 'w')", str(marker)])
    pid_at = cmd.index(str(os.getpid()))
    cmd[pid_at] = "1"  # as if the launcher had died and the supervisor been re-parented
    assert subprocess.run(cmd, start_new_session=True, timeout=20, check=False).returncode == 1
    assert not marker.exists()


def test_the_exit_status_is_the_commands() -> None:
    for code, expected in (("raise SystemExit(7)", 7), ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
                                                         -signal.SIGTERM)):
        proc = subprocess.run(lifeline.wrap([sys.executable, "-c", code]), start_new_session=True, timeout=20,
                              check=False)
        assert proc.returncode == expected
