"""The load generator of the proxy benchmark: a light asyncio (uvloop + aiohttp) client in its own process.

It serves one run after another, so its start-up is paid once: the
orchestrator (``bench/proxy.py``) writes one JSON command per line on stdin,
this process answers one JSON result per line on stdout (after a first
``READY`` line). A command::

    {"url": "http://127.0.0.1:P/v1/chat/completions", "concurrency": 16, "stream": false,
     "duration": 2.0, "warmup": 0.5, "headers": {...}, "max_tokens": 16,
     "watch": {"proxy": PID, "upstream": PID}, "validate": false}

A run opens a fresh connection pool (``concurrency`` keep-alive connections),
keeps ``concurrency`` requests in flight for ``warmup`` seconds, then for
``duration`` seconds (the window), then stops issuing and lets the requests in
flight finish. Counted are the requests that *completed inside the window*;
their latencies are what the percentiles describe: the whole answer for JSON,
the first body chunk ("time to first chunk") and the whole stream for SSE.
At the window's edges it reads the CPU time (user + system, psutil) of every
watched process *and its children*, of itself, and of the whole machine
(``/proc/stat``), so the orchestrator can charge CPU per request and see how
much CPU other programs on the machine took meanwhile.

A response counts as ``ok`` when its status is 200 and its body is complete:
JSON with ``choices[0].message.content``, or a stream ending with
``data: [DONE]``. With ``validate`` every stream event is parsed and its
content chunks counted too (slower; the smoke test uses it, timed runs do not).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import aiohttp
import psutil

try:
    import orjson

    _loads = orjson.loads
    _dumps = orjson.dumps
except ImportError:  # pragma: no cover
    _loads = json.loads

    def _dumps(value: Any) -> bytes:
        return json.dumps(value).encode()

DONE = b"data: [DONE]\n\n"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary_ms(values: list[float]) -> dict[str, Any]:
    ms = [v * 1000.0 for v in values]
    return {"n": len(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99),
            "mean": sum(ms) / len(ms) if ms else None, "max": max(ms) if ms else None}


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (reaped children included)."""
    try:
        root = psutil.Process(pid)
        times = root.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    for child in children:
        try:
            t = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine was busy (all cores), from /proc/stat."""
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    busy = sum(values[:8]) - values[3] - values[4]
    return busy / CLK_TCK


def snapshot(watch: dict[str, int]) -> dict[str, float]:
    out = {name: tree_cpu_s(pid) for name, pid in watch.items()}
    out["loadgen"] = tree_cpu_s(os.getpid())
    out["machine"] = machine_busy_s()
    return out


class Run:
    def __init__(self, cmd: dict[str, Any]) -> None:
        self.url = cmd["url"]
        self.concurrency = int(cmd["concurrency"])
        self.stream = bool(cmd.get("stream"))
        self.duration = float(cmd["duration"])
        self.warmup = float(cmd.get("warmup", 0.5))
        self.validate = bool(cmd.get("validate"))
        self.watch = {str(k): int(v) for k, v in (cmd.get("watch") or {}).items()}
        self.expect_tokens = cmd.get("expect_tokens")
        max_tokens = int(cmd.get("max_tokens") or (64 if self.stream else 16))
        body: dict[str, Any] = {"model": cmd.get("model", "fake-model"), "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": "Say something short, please."}]}
        if self.stream:
            body["stream"] = True
        self.body = _dumps(body)
        self.headers = {"Content-Type": "application/json", **(cmd.get("headers") or {})}
        self.window: tuple[float, float] = (float("inf"), float("inf"))
        self.issuing = True
        self.latency: list[float] = []  # JSON: whole answer; streams: first chunk
        self.e2e: list[float] = []  # streams: whole stream
        self.counts = {"ok": 0, "bad": 0, "errors": 0, "decision_header": 0, "completed_total": 0,
                       "events": 0, "content_chunks": 0}
        self.first_error: str | None = None
        self.statuses: dict[str, int] = {}

    def _record(self, start: float, first: float, end: float, ok: bool, decided: bool, events: int,
                chunks: int) -> None:
        self.counts["completed_total"] += 1
        if not self.window[0] <= end <= self.window[1]:
            return
        if not ok:
            self.counts["bad"] += 1
            return
        self.counts["ok"] += 1
        self.counts["decision_header"] += decided
        self.counts["events"] += events
        self.counts["content_chunks"] += chunks
        self.latency.append(first - start)
        if self.stream:
            self.e2e.append(end - start)

    def _fail(self, where: float, message: str) -> None:
        if self.window[0] <= where <= self.window[1]:
            self.counts["errors"] += 1
        if self.first_error is None:
            self.first_error = message[:300]

    async def _one(self, session: aiohttp.ClientSession) -> None:
        perf = time.perf_counter
        start = perf()
        try:
            async with session.post(self.url, data=self.body, headers=self.headers) as resp:
                decided = "x-specgate-decision" in resp.headers
                key = str(resp.status)
                self.statuses[key] = self.statuses.get(key, 0) + 1
                if not self.stream:
                    raw = await resp.read()
                    end = perf()
                    ok = resp.status == 200 and self._json_ok(raw)
                    if not ok and self.first_error is None:
                        self.first_error = f"HTTP {resp.status}: {raw[:300]!r}"
                    self._record(start, end, end, ok, decided, 0, 0)
                    return
                first = 0.0
                parts = []
                async for data in resp.content.iter_any():
                    if not first:
                        first = perf()
                    parts.append(data)
                end = perf()
                raw = b"".join(parts)
                ok = resp.status == 200 and raw.endswith(DONE)
                events = raw.count(b"data:")
                chunks = self._stream_chunks(raw) if self.validate and ok else 0
                if self.validate and self.expect_tokens is not None and chunks != self.expect_tokens:
                    ok = False
                if not ok and self.first_error is None:
                    self.first_error = f"HTTP {resp.status}: stream of {len(raw)} bytes ending {raw[-80:]!r}"
                self._record(start, first or end, end, ok, decided, events, chunks)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            self._fail(perf(), f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _json_ok(raw: bytes) -> bool:
        try:
            data = _loads(raw)
            return bool(data["choices"][0]["message"]["content"])
        except (ValueError, KeyError, IndexError, TypeError):
            return False

    @staticmethod
    def _stream_chunks(raw: bytes) -> int:
        chunks = 0
        for event in raw.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            obj = _loads(event[6:])
            for choice in obj.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
        return chunks

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        while self.issuing:
            await self._one(session)

    async def run(self) -> dict[str, Any]:
        connector = aiohttp.TCPConnector(limit=self.concurrency, keepalive_timeout=60.0)
        timeout = aiohttp.ClientTimeout(total=60.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            workers = [asyncio.create_task(self._worker(session)) for _ in range(self.concurrency)]
            await asyncio.sleep(self.warmup)
            before = snapshot(self.watch)
            t0 = time.perf_counter()
            self.window = (t0, t0 + self.duration)
            await asyncio.sleep(self.duration)
            t1 = time.perf_counter()
            after = snapshot(self.watch)
            self.window = (t0, t1)
            self.issuing = False
            _, pending = await asyncio.wait(workers, timeout=30.0)
            for task in pending:
                task.cancel()
        window = t1 - t0
        cpu = {name: after[name] - before[name] for name in after}
        ours = sum(v for k, v in cpu.items() if k != "machine")
        result = {
            "window_s": window, "concurrency": self.concurrency, "stream": self.stream,
            "completed": self.counts["ok"], "rps": self.counts["ok"] / window, **self.counts,
            "latency_ms": summary_ms(self.latency), "e2e_ms": summary_ms(self.e2e) if self.stream else None,
            "cpu_s": cpu, "others_cpu_s": max(0.0, cpu["machine"] - ours), "statuses": self.statuses,
            "first_error": self.first_error, "stuck": len(pending),
        }
        return result


async def serve() -> None:
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            return
        try:
            result = await Run(json.loads(line)).run()
        except Exception as exc:  # the orchestrator shows it and stops
            result = {"fatal": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def main() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(serve())
    else:
        uvloop.run(serve())


if __name__ == "__main__":
    main()
