"""Children that die with the process that started them, their whole process tree included (Linux).

A launcher that is killed outright (SIGKILL, the OOM killer, a crash), or whose stop is cut short,
leaves its children re-parented to init: for ``specgate up`` that was three vLLM engines (about 9 GiB)
and a sidecar. :func:`wrap` puts a small supervisor, this file run as a script, in front of a command:

- it asks the kernel for a parent-death signal (``prctl(PR_SET_PDEATHSIG)``) and checks that its
  parent is still the launcher (which may have died before the request took effect);
- it runs the command in its own process group, the one the launcher started it in
  (``start_new_session=True``), which vLLM's engine core and workers inherit, and gives the command a
  parent-death SIGKILL of its own, so the command never outlives the supervisor;
- when the launcher dies it sends SIGTERM to the group, and SIGKILL to what is left after a grace
  period; when the command exits it kills what the command left in the group and exits as the command
  did.

A signal sent to the group (how every launcher here stops its children) reaches the command directly;
the supervisor only waits, so the command is not signalled twice. Where the parent-death signal is not
available (not Linux) :func:`wrap` returns the command unchanged.

The kernel sends the parent-death signal when the *thread* that started the supervisor ends: start it
from a thread that lives as long as the child should (the main thread, in every launcher here).
This file imports only the standard library: it runs with ``python -I`` under any interpreter.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# SIGHUP means "the launcher is gone": the launchers stop their children with SIGTERM, so the two differ.
PARENT_GONE = signal.SIGHUP
STOPS = (signal.SIGTERM, signal.SIGINT)
SUPPORTED = sys.platform.startswith("linux")


def wrap(cmd: Sequence[str], *, grace_s: float = 10.0) -> list[str]:
    """``cmd`` under a supervisor that ends it, and its process tree, when this process dies.

    Start the result with ``start_new_session=True`` from a long-lived thread; ``grace_s`` is how long
    the command has to stop on SIGTERM once this process is gone, before SIGKILL.
    """
    if not SUPPORTED:
        return list(cmd)
    return [sys.executable, "-I", str(Path(__file__).resolve()), str(os.getpid()), f"{grace_s:g}", "--", *cmd]


def _prctl_pdeathsig(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def process_groups() -> dict[int, list[int]]:
    """Process group id -> its live processes (field 5 of /proc/PID/stat; zombies left out)."""
    groups: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] not in ("Z", "X"):
            groups.setdefault(int(fields[2]), []).append(int(entry))
    return groups


def _group_members(pgrp: int) -> list[int]:
    """The processes of group ``pgrp`` other than this one."""
    me = os.getpid()
    return [pid for pid in process_groups().get(pgrp, []) if pid != me]


def _kill_leftovers(pgrp: int) -> None:
    for pid in _group_members(pgrp):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _exit_as(status: int) -> int:
    """This process ends the way the command did: the same exit code, or killed by the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        return 128 + sig  # a signal whose default is to go on (SIGCHLD, ...): exit as a shell would say it
    return os.waitstatus_to_exitcode(status)


def supervise(parent: int, grace_s: float, cmd: Sequence[str]) -> int:
    watched = {PARENT_GONE, signal.SIGCHLD, *STOPS}
    # Blocked and taken with sigtimedwait: a signal never interrupts the bookkeeping half way.
    original = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    _prctl_pdeathsig(PARENT_GONE)
    if os.getppid() != parent:
        return 1  # the launcher died before the parent-death signal was set: start nothing
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # the group signalled on the launcher's death must be ours alone, never its

    def in_child() -> None:  # this process has one thread, so running code between fork and exec is safe
        signal.pthread_sigmask(signal.SIG_SETMASK, original)
        _prctl_pdeathsig(signal.SIGKILL)

    pgrp = os.getpgrp()
    try:
        child = subprocess.Popen(list(cmd), preexec_fn=in_child)  # noqa: S603 - the launcher's command
    except OSError as exc:
        print(f"lifeline: cannot run {cmd[0]!r}: {exc}", file=sys.stderr)
        return 127
    deadline: float | None = None
    while True:
        pid, status = os.waitpid(child.pid, os.WNOHANG)
        if pid:
            child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
            _kill_leftovers(pgrp)
            return _exit_as(status)
        info: signal.struct_siginfo | None
        if deadline is None:
            info = signal.sigwaitinfo(watched)
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                os.killpg(pgrp, signal.SIGKILL)  # the command did not stop in time: the group, this one too
            info = signal.sigtimedwait(watched, max(remaining, 0.0))
        if info is not None and info.si_signo == PARENT_GONE and deadline is None:
            deadline = time.monotonic() + grace_s
            os.killpg(pgrp, signal.SIGTERM)  # reaches this process too, blocked: taken by the loop and ignored


def main(argv: Sequence[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: lifeline.py PARENT_PID GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    return supervise(int(argv[0]), float(argv[1]), argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
