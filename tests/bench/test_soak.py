"""The soak-and-chaos suite (bench/soak.py), short: two minutes on FAKE engines, the accounting asserted.

``python -m bench.soak --minutes 2 --fake-engines`` runs as its own process, as
a user would run it: a private PostgreSQL (SQLite where there is none), the
control plane, two sidecars, the fake engines, traffic with hostile inputs, and
every fault once. Asserted is the accounting only, never a timing: every
request answered or failed with a clear error, every answered request stored
exactly once, events lost only to a sidecar's SIGKILL and only within the
window the report states.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import subprocess
import sys
from pathlib import Path

from tests.support import paths

_ROOT = paths.ROOT
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
soak = importlib.import_module("bench.soak")
soak_stall = importlib.import_module("bench.soak_stall")

# Bounded: two minutes of traffic, start-up, the faults' restarts and the drain fit well inside.
RUN_TIMEOUT_S = 600


def test_two_minutes_of_chaos_lose_nothing_outside_the_sigkill_window(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "2", "--fake-engines",
                           "--json", str(out)], cwd=_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          check=False)
    assert out.exists(), f"no report (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    report = json.loads(out.read_text())
    summary = soak.render(report)
    assert "FAKE" in report["engines"]

    ran = {f["fault"] for f in report["faults"] if "skipped" not in f}
    expected = set(soak.FAULTS) - ({"postgres_kill"} if not report["database"].startswith("postgresql") else set())
    assert ran >= expected, summary
    assert report["sidecar_kills"], summary

    requests, events = report["requests"], report["events"]
    assert requests["sent"] > 0
    assert requests.get("unaccounted", 0) == 0, summary
    assert requests["sent"] == sum(requests.get(k, 0) for k in
                                   ("ok", "clear error", "failed: sidecar killed", "unaccounted"))
    assert events["drain"]["drained"], summary
    assert events["duplicates"] == 0, summary
    assert events["stray"] == 0, summary
    assert events["status_mismatch"] == 0, summary
    assert events["missing_outside_window"] == 0, summary
    assert events["matched"] + events["lost_in_sigkill_window"] == events["expected"], summary
    window = report["loss_window"]["stated_s"]
    for kill in report["sidecar_kills"]:
        assert kill["events_lost"] <= kill["answered_in_window_before"], summary
        assert kill["oldest_lost_age_s"] <= window, summary
    for name, outcomes in report["hostile"].items():
        # A 5xx only as a clear error: an engine the soak had killed (502 upstream-unavailable), never the input.
        assert all(not k.startswith("5") or k == "502 error" for k in outcomes), (name, outcomes)
    assert report["accounting_passed"], summary


def test_the_stall_proxy_holds_bytes_while_paused_and_delivers_them_after() -> None:
    async def scenario() -> tuple[bytes, bytes]:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(1024):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        proxy = soak_stall.StallProxy(server.sockets[0].getsockname()[1])
        await proxy.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"before")
            first = await asyncio.wait_for(reader.readexactly(6), 10)
            proxy.pause()
            writer.write(b"held")
            held = b""
            with contextlib.suppress(TimeoutError):
                held = await asyncio.wait_for(reader.read(4), 0.3)
            assert held == b"", "bytes crossed a stalled link"
            proxy.resume()
            after = await asyncio.wait_for(reader.readexactly(4), 10)
            writer.close()
            return first, after
        finally:
            await proxy.close()
            server.close()

    assert asyncio.run(scenario()) == (b"before", b"held")


def test_memory_slope_is_fitted_within_each_incarnation() -> None:
    # Two incarnations growing 1 MiB a minute from different levels: a restart's drop is not a slope.
    samples = [(t, 1, 100.0 + t / 60, 0.0) for t in range(0, 120, 5)]
    samples += [(t, 2, 50.0 + t / 60, 0.0) for t in range(120, 240, 5)]
    assert soak.slope_per_min(samples, 2, skip_s=0.0) == 1.0
    assert soak.slope_per_min(samples[:2], 2, skip_s=0.0) is None


def test_the_rss_curve_keeps_each_minutes_last_sample_per_incarnation() -> None:
    samples = [(5.0, 1, 100.0, 0.0), (55.0, 1, 101.0, 0.0), (65.0, 1, 102.0, 0.0), (70.0, 2, 90.0, 0.0),
               (130.0, 2, 91.26, 0.0)]
    assert soak.rss_by_minute(samples) == [[0, 1, 101.0], [1, 1, 102.0], [1, 2, 90.0], [2, 2, 91.3]]
