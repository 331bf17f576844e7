"""The wiring: the ``specgate sidecar`` command, the Sidecar object, and a real run stopped by SIGTERM."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import sidecar.main
from policies import PolicyStore
from sidecar.main import Sidecar, resolve_worker_id
from sidecar.otel import OTelHook, OTelRuntime
from sidecar.settings import SidecarSettings
from sidecar.telemetry import TelemetryExporter
from specgate.cli import app as specgate
from tests.support import paths
from tests.support.live import ControlPlane, free_port

ROOT = paths.ROOT


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[SidecarSettings]:
    seen: list[SidecarSettings] = []
    monkeypatch.setattr(sidecar.main, "run", lambda settings, log_level="info": seen.append(settings))
    for name in list(os.environ):
        if name.startswith("SPECGATE_"):
            monkeypatch.delenv(name)
    return seen


def test_the_command_builds_settings_from_options_over_the_environment(
        captured: list[SidecarSettings], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECGATE_POOL", "gpu-a")
    monkeypatch.setenv("SPECGATE_KEY", "sgk_from_env")
    monkeypatch.setenv("SPECGATE_ENGINES", '{"base": "http://env:1"}')
    result = CliRunner().invoke(specgate, [
        "sidecar", "--control-plane", "http://cp:8080", "--key", "sgk_flag", "--engine", "base=http://e:8000",
        "--engine", "draft=http://e:8001", "--listen", "0.0.0.0:9100", "--label", "zone=eu", "--label", "gpu=h100",
        "--route", "/v1/completions=batch", "--route", "llama=chat", "--state-dir", str(tmp_path),
        "--public-key", "AAAA", "--worker-id", "w-7"])
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert settings.control_plane == "http://cp:8080"
    assert settings.key == "sgk_flag"
    assert settings.engines == {"base": ["http://e:8000"], "draft": ["http://e:8001"]}
    assert settings.pool == "gpu-a"  # not given: from the environment
    assert settings.labels == {"zone": "eu", "gpu": "h100"}
    assert settings.routes == {"/v1/completions": "batch", "llama": "chat"}
    assert settings.state_dir == tmp_path
    assert settings.public_keys == ["AAAA"]
    assert settings.worker_id == "w-7"
    assert settings.listen == "0.0.0.0:9100"

    captured.clear()
    assert CliRunner().invoke(specgate, ["sidecar"]).exit_code == 0  # everything from the environment
    assert captured[0].engines == {"base": ["http://env:1"]}
    assert captured[0].key == "sgk_from_env"
    assert captured[0].kind == "worker"
    assert not captured[0].replica_scope


def test_engines_given_as_pools_of_replicas(captured: list[SidecarSettings],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECGATE_KEY", "sgk_from_env")
    # a name given twice, and NAME=URL1,URL2, both make a pool, in the order given
    result = CliRunner().invoke(specgate, [
        "sidecar", "--kind", "gateway", "--engine", "draft=http://a:8000", "--engine", "draft=http://b:8000",
        "--engine", "base=http://c:8000,http://d:8000/v"])
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert settings.engines == {"draft": ["http://a:8000", "http://b:8000"],
                                "base": ["http://c:8000", "http://d:8000/v"]}
    assert settings.kind == "gateway"
    assert settings.replica_scope  # auto: a gateway's batch is the replica's
    captured.clear()
    # the environment's JSON takes a URL, a list, or "URL1,URL2" per name
    monkeypatch.setenv("SPECGATE_ENGINES", '{"draft": ["http://a:1", "http://b:2"], "base": "http://c:3,http://d:4"}')
    monkeypatch.setenv("SPECGATE_BATCH_SCOPE", "replica")
    assert CliRunner().invoke(specgate, ["sidecar"]).exit_code == 0
    assert captured[0].engines == {"draft": ["http://a:1", "http://b:2"], "base": ["http://c:3", "http://d:4"]}
    assert captured[0].kind == "worker"
    assert captured[0].replica_scope


@pytest.mark.parametrize(("args", "message"), [
    (["--engine", "draft=http://a:1,"], "--engine must be NAME=URL or NAME=URL1,URL2"),
    (["--engine", "draft=http://a:1", "--engine", "draft=http://a:1/"], "replica 'http://a:1/' is listed twice"),
    (["--engine", "draft=http://A:80,http://a"], "replica 'http://a' is listed twice (as a:80)"),
    (["--engine", "base=http://e:1", "--kind", "router"], "kind"),
    (["--engine", "base=http://e:1", "--batch-scope", "pool"], "batch_scope"),
])
def test_bad_pool_options_exit_2_and_name_the_setting(captured: list[SidecarSettings],
                                                      monkeypatch: pytest.MonkeyPatch, args: list[str],
                                                      message: str) -> None:
    monkeypatch.setenv("SPECGATE_KEY", "sgk_from_env")
    result = CliRunner().invoke(specgate, ["sidecar", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert not captured


@pytest.mark.parametrize(("args", "message"), [
    (["--engine", "base"], "--engine must be NAME=URL"),
    (["--engine", "base=http://e:1", "--listen", "nowhere"], "listen"),
    (["--engine", "base=e:8000", "--key", "k"], "engine 'base': the URL must be http(s)://"),
    (["--engine", "draft=http://e:99999", "--key", "k"], "engine 'draft'"),
    (["--engine", "base=http://e:1", "--key", ""], "no worker key"),
    (["--key", "k"], "no engines"),
])
def test_bad_options_exit_2_and_say_why(captured: list[SidecarSettings], args: list[str], message: str) -> None:
    result = CliRunner().invoke(specgate, ["sidecar", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert captured == []


def test_worker_id_defaults_to_the_listen_address() -> None:
    assert resolve_worker_id(SidecarSettings(listen="10.1.2.3:9000")) == "10.1.2.3:9000"
    assert resolve_worker_id(SidecarSettings(listen="0.0.0.0:9000")) == f"{socket.gethostname()}:9000"
    assert resolve_worker_id(SidecarSettings(listen="0.0.0.0:9000", worker_id="w1")) == "w1"


def test_the_sidecar_object_wires_store_sync_exporter_and_hook(tmp_path: Path) -> None:
    built: dict[str, Any] = {}

    def stand_in(settings: SidecarSettings, store: PolicyStore, exporter: TelemetryExporter, *,
                 on_event: Any = None) -> Any:
        built.update(settings=settings, store=store, exporter=exporter, on_event=on_event)

        class App:  # a trivial ASGI stand-in that reports in-flight requests like the proxy does
            class inflight:
                count = 4

            async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                raise AssertionError("not called here")

        return App()

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    hook = OTelHook(TracerProvider(), MeterProvider())
    settings = SidecarSettings(listen="127.0.0.1:9555", state_dir=tmp_path, engines={"base": "http://e:1"})
    car = Sidecar(settings, app_factory=stand_in, otel=OTelRuntime(hook, []))
    assert built["settings"].worker_id == "127.0.0.1:9555" == car.sync.worker_id == car.exporter.worker_id
    assert built["store"] is car.store is car.sync.store
    assert built["exporter"] is car.exporter
    assert built["on_event"] == hook.on_event
    assert car._in_flight() == 4
    assert car.sync._in_flight == car._in_flight  # its heartbeats report the app's requests in flight
    # Without an OTLP endpoint there is no hook at all.
    plain = Sidecar(settings, app_factory=stand_in)
    assert plain.otel is None
    assert built["on_event"] is None


def test_serve_cancelled_still_finishes_the_request_in_flight_and_stops_listening(tmp_path: Path) -> None:
    """Not every host sends a signal (an embedding program cancels the task): the shutdown must run anyway."""
    events: list[str] = []

    def slow_app(settings: SidecarSettings, store: PolicyStore, exporter: TelemetryExporter, *,
                 on_event: Any = None) -> Any:
        class App:
            async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                await receive()
                await asyncio.sleep(0.3)
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
                await send({"type": "http.response.body", "body": b"ok"})

            async def shutdown(self) -> None:
                events.append("app shut down")

        return App()

    port = free_port()
    settings = SidecarSettings(listen=f"127.0.0.1:{port}", state_dir=tmp_path, engines={"base": "http://127.0.0.1:9"},
                               control_plane=f"http://127.0.0.1:{free_port()}", key="sgk_test")

    async def scenario() -> None:
        serving = asyncio.ensure_future(sidecar.main.serve(settings, app_factory=slow_app, shutdown_timeout_s=5))
        for _ in range(200):
            try:
                _, probe = await asyncio.open_connection("127.0.0.1", port)
                probe.close()
                break
            except OSError:
                await asyncio.sleep(0.02)
        async with httpx.AsyncClient() as client:
            answer = asyncio.ensure_future(client.get(f"http://127.0.0.1:{port}/x", timeout=5))
            await asyncio.sleep(0.1)
            serving.cancel()
            assert (await answer).text == "ok"  # answered although the server was told to stop
        with pytest.raises(asyncio.CancelledError):
            await serving
        assert events == ["app shut down"]
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)

    asyncio.run(scenario())


def test_a_real_sidecar_serves_reports_and_shuts_down_gracefully_on_sigterm(tmp_path: Path) -> None:
    from controlplane.migrations_state import upgrade
    from tests.support.factories import seed_policy

    url = f"sqlite:///{tmp_path / 'cp.db'}"
    upgrade(url)
    seed_policy(url)
    cp = ControlPlane(url)
    cp.start()
    port = free_port()
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECGATE_", "OTEL_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specgate", "sidecar", "--control-plane", cp.base, "--key",
         cp.worker_token, "--engine", "base=http://127.0.0.1:9", "--engine", "draft=http://127.0.0.1:9",
         "--listen", f"127.0.0.1:{port}", "--state-dir", str(state), "--worker-id", "w-main"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the sidecar did not become ready"
            time.sleep(0.05)

        async def reported() -> dict[str, Any] | None:
            for _ in range(100):
                worker = await cp.worker("w-main")
                if worker is not None and worker["active_etag"]:
                    return worker
                await asyncio.sleep(0.05)
            return None

        worker = asyncio.run(reported())
        assert worker is not None
        assert worker["converged"] is True
        assert json.loads((state / "bundle.json").read_bytes())["etag"] == worker["active_etag"]

        # A request through the real proxy (its engines are down) still makes one telemetry event.
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                   json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]})

        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, output
        assert "sidecar stopped" in output
        counters = ast.literal_eval(output.split("telemetry exporter stopped: ", 1)[1].splitlines()[0])
        assert counters["queued"] == 1
        # Nothing lost: delivered, or (the control plane too slow to answer before the flush
        # deadline) spooled for the next start.
        assert counters["sent"] + counters["spool_events"] == 1, output
        assert counters["memory_events"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        cp.stop()

