"""A FAKE engine starter for ``specgate up`` tests: stands in for the real vLLM engines.

``FakeEngineStarter`` has the shape of :class:`specgate.stack.EngineStarter`. It starts one
process (``python -m tests.support.fake_engines PORT=NAME ...``) that serves a
:class:`tests.support.fake_upstream.FakeEngine` per variant (``speculative`` for all but
``base``), waits until each answers ``/v1/models``, and stops that process again. It is not vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from specgate import stack as devstack
from testbed.engines import process_start_ticks, variant_of
from tests.support import paths
from tests.support.fake_upstream import FakeEngine

REPO_ROOT = paths.ROOT
# Per-token delay of the fake answers: keeps the looping traffic generator from spinning the CPU.
TOKEN_DELAY_S = 0.02


class FakeEngineStarter:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.names: list[str] = []

    def start(self, variants: Sequence[str], base_port: int, say: object) -> dict[str, str]:
        from testbed.engines import ports_for

        ports = ports_for(variants, base_port)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        with (self.state_dir / "fake-engines.log").open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.fake_engines",
                 *(f"{port}={name}" for name, port in ports.items())],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # pid and start time, so that a test can tell these engines from a process that got the pid later
        (self.state_dir / "fake-engines.pid").write_text(
            f"{self.process.pid} {process_start_ticks(self.process.pid)}\n")
        self.names = list(ports)
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        deadline = time.monotonic() + 30
        for url in urls.values():
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the fake engines exited with {self.process.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError("the fake engines did not answer within 30 s")
                time.sleep(0.1)
        return urls

    def stop(self) -> list[str]:
        if self.process is None or self.process.poll() is not None:
            return []
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)
        return self.names


async def _serve(specs: list[str]) -> None:
    engines = []
    for spec in specs:
        port, _, name = spec.partition("=")
        engine = FakeEngine(name, speculative=variant_of(name) != "base")
        engine.port = int(port)
        engine.token_delay = TOKEN_DELAY_S
        await engine.start()
        engines.append(engine)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for engine in engines:
        await engine.stop()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1:]))


class SlowFakeEngineStarter(devstack.TestbedEngines):
    """A FAKE starter whose engines start, then never become healthy (a start-up stuck half way)."""

    def __init__(self, state_dir: Path) -> None:
        from tests.support.fake_engines import FakeEngineStarter

        super().__init__(state_dir)
        self.fake = FakeEngineStarter(state_dir)

    def start(self, variants: Any, base_port: int, say: devstack.Say) -> dict[str, str]:
        self.fake.start(variants, base_port, say)
        say("fake engines waiting forever")
        time.sleep(3600)
        raise AssertionError("unreachable")

    def stop(self) -> list[str]:
        return self.fake.stop()
