"""The sidecar harness: fake engines and real sidecars (sidecar.server, or uvicorn; uvloop) on a background loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import policies
from sidecar.proxy import build_app
from sidecar.settings import SidecarSettings
from tests.support.fake_upstream import FakeEngine
from tests.support.sidecars import (
    LoopThread,
    RecordingExporter,
    Sidecar,
    SidecarFactory,
    seed_bundle,
)
from wire.telemetry import TelemetryEvent


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def _engines(loop_thread: LoopThread) -> Iterator[tuple[FakeEngine, FakeEngine]]:
    draft, base = FakeEngine("draft", speculative=True), FakeEngine("base")
    loop_thread.run(draft.start())
    loop_thread.run(base.start())
    yield draft, base
    loop_thread.run(draft.stop())
    loop_thread.run(base.stop())


@pytest.fixture
def draft(_engines: tuple[FakeEngine, FakeEngine]) -> FakeEngine:
    _engines[0].reset()
    return _engines[0]


@pytest.fixture
def base(_engines: tuple[FakeEngine, FakeEngine]) -> FakeEngine:
    _engines[1].reset()
    return _engines[1]




@pytest.fixture
def make_sidecar(loop_thread: LoopThread, draft: FakeEngine, base: FakeEngine) -> Iterator[SidecarFactory]:
    started: list[Sidecar] = []

    def make(*, engines: dict[str, Any] | None = None, bundle: policies.CompiledBundle | str | None = "seed",
             on_event: Callable[[TelemetryEvent], None] | None = None, expose_engine_metrics: bool = False,
             server: str = "specgate", **settings: Any) -> Sidecar:
        values: dict[str, Any] = {"worker_id": "w1", "pool": "gpu-a", "engine_metrics_s": 60.0,
                                  "engines": {"draft": draft.url, "base": base.url} if engines is None else engines}
        values.update(settings)
        store = policies.PolicyStore(seed_bundle() if bundle == "seed" else bundle)  # type: ignore[arg-type]
        exporter = RecordingExporter()
        hooked: list[TelemetryEvent] = []

        def hook(event: TelemetryEvent) -> None:
            hooked.append(event)
            if on_event is not None:
                on_event(event)

        app = build_app(SidecarSettings(**values), store, exporter, on_event=hook,
                        expose_engine_metrics=expose_engine_metrics)
        sidecar = Sidecar(loop_thread, app, store, exporter, hooked, server)
        started.append(sidecar)
        return sidecar

    yield make
    for sidecar in started:
        sidecar.stop()
