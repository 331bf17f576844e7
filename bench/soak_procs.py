"""The processes of the soak (``bench/soak.py``): a private PostgreSQL, the control plane, sidecars, engines.

Every process starts in a session of its own under :func:`testbed.lifeline.wrap`,
so that SIGKILL of its process group is a crash of the whole part (PostgreSQL's
backends, vLLM's engine core and workers) and nothing outlives the soak, even
when the soak itself is killed. Starting and stopping happen on the main thread
only: the kernel's parent-death signal follows the thread that started a child.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.proxy import free_port
from testbed import lifeline

ROOT = Path(__file__).resolve().parents[1]

# PostgreSQL refuses to run as root; as root the soak runs it as this user, dropping privileges in a small
# shim so the lifeline supervisor above it stays able to signal it.
PG_USERS = ("postgres", "nobody")
_DROP_PRIVILEGES = ("import os, sys; os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1])); "
                    "os.execv(sys.argv[3], sys.argv[3:])")


class SoakError(RuntimeError):
    """A part of the soak could not be started or stopped: the run cannot go on."""


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, alive: Callable[[], bool] | None = None,
               log: Path | None = None) -> float:
    """Seconds until ``check()`` held; SoakError after ``timeout_s`` or when ``alive()`` says the process died."""
    t0 = time.monotonic()
    while not check():
        if alive is not None and not alive():
            raise SoakError(f"{what}: the process exited{_tail(log)}")
        if time.monotonic() - t0 > timeout_s:
            raise SoakError(f"{what}: not within {timeout_s:.0f} s{_tail(log)}")
        time.sleep(0.1)
    return time.monotonic() - t0


def _tail(log: Path | None, lines: int = 25) -> str:
    if log is None:
        return ""
    try:
        return "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the SPECGATE_/OTEL_ settings of whoever runs the soak."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECGATE_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclass
class Part:
    """One part of the soak: a command run in a process group of its own, restartable."""

    name: str
    log: Path
    cmd: Sequence[str] = ()
    env: Mapping[str, str] | None = None
    ready: Callable[[], bool] = field(default=lambda: True)
    ready_timeout_s: float = 60.0
    grace_s: float = 10.0
    process: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    started_at: list[float] = field(default_factory=list)

    @property
    def pgid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> float:
        """Start it and wait until it is ready; seconds it took."""
        t0 = time.monotonic()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"\n=== {time.strftime('%H:%M:%S')} start {self.name}\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                lifeline.wrap(self.cmd, grace_s=self.grace_s), cwd=ROOT, env=dict(self.env or clean_env()),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.incarnation += 1
        self.started_at.append(time.monotonic())
        wait_until(self.ready, self.ready_timeout_s, f"{self.name} ready", self.alive, self.log)
        return time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, not a shutdown."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after the grace period."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(self.grace_s)
        # Also when the leader is gone: whatever it left in its group goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)

    def tail(self, lines: int = 25) -> str:
        return _tail(self.log, lines)


# --- PostgreSQL ---------------------------------------------------------------------------------


def postgres_bindir() -> Path | None:
    """Where initdb and postgres live: ``pg_config --bindir``, else the directory of ``postgres`` on PATH."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
            candidates.append(Path(out.stdout.strip()))
    found = shutil.which("postgres")
    if found:
        candidates.append(Path(found).resolve().parent)
    for bindir in candidates:
        if (bindir / "postgres").is_file() and (bindir / "initdb").is_file():
            return bindir
    return None


def _pg_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in PG_USERS:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise SoakError("running as root and no unprivileged user to run PostgreSQL as (tried postgres, nobody)")


class Postgres:
    """A private cluster: initdb in a temporary directory, trust auth on 127.0.0.1, a free port, database
    ``specgate``. Its own, so the soak may SIGKILL it and start it again (crash recovery from its WAL)."""

    def __init__(self, bindir: Path, work: Path) -> None:
        self.bindir = bindir
        self.user = _pg_user()
        self.dir = Path(tempfile.mkdtemp(prefix="specgate-soak-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/specgate"
        cmd = [str(bindir / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.dir),
               "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=60", "-c", "shared_buffers=32MB",
               "-c", "fsync=on", "-c", "synchronous_commit=on"]
        self.part = Part("postgres", work / "logs" / "postgres.log", self._as_user(cmd), clean_env(),
                         ready=self._accepting, ready_timeout_s=60, grace_s=10)

    def _as_user(self, cmd: list[str]) -> list[str]:
        if self.user is None:
            return cmd
        return [sys.executable, "-I", "-c", _DROP_PRIVILEGES, str(self.user.pw_uid), str(self.user.pw_gid), *cmd]

    def _accepting(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                                 connect_timeout=2):
                return True
        except psycopg.Error:
            return False

    def init(self) -> None:
        if self.user is not None:
            os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        initdb = self._as_user([str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                                "--auth=trust", "-E", "UTF8", "--locale=C", "--no-instructions"])
        result = subprocess.run(initdb, capture_output=True, text=True, timeout=180, check=False)
        if result.returncode != 0:
            raise SoakError(f"initdb failed ({result.returncode}): {result.stdout[-2000:]}{result.stderr[-2000:]}")
        self.part.start()
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute("CREATE DATABASE specgate")

    def remove(self) -> None:
        self.part.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# --- memory of process groups --------------------------------------------------------------------


def _psutil() -> Any:
    # The bench extra installs psutil; without it /proc does (Linux only, as is the soak).
    try:
        return importlib.import_module("psutil")
    except ImportError:
        return None


psutil = _psutil()


def _memory_kib(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) of one process in KiB; PSS shares each shared page among its users (PostgreSQL's buffers)."""
    if psutil is not None:
        try:
            info: Any = psutil.Process(pid).memory_full_info()
            return int(info.rss) // 1024, int(getattr(info, "pss", info.rss)) // 1024
        except (psutil.Error, OSError):  # gone between the scan and the read
            return None
    rss = pss = None
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return (rss, pss) if rss is not None and pss is not None else None


def process_memory(pid: int) -> tuple[float, float] | None:
    """(RSS MiB, PSS MiB) of one process."""
    mem = _memory_kib(pid)
    return None if mem is None else (mem[0] / 1024, mem[1] / 1024)


def group_memory(pgids: Mapping[str, int | None]) -> dict[str, tuple[float, float, int]]:
    """name -> (RSS MiB, PSS MiB, processes) summed over each process group that is alive."""
    groups = lifeline.process_groups()
    out = {}
    for name, pgid in pgids.items():
        if pgid is None or pgid not in groups:
            continue
        rss = pss = 0
        count = 0
        for pid in groups[pgid]:
            mem = _memory_kib(pid)
            if mem is not None:
                rss += mem[0]
                pss += mem[1]
                count += 1
        if count:
            out[name] = (rss / 1024, pss / 1024, count)
    return out
