"""Does one hostile client slow everyone else down? The sidecar's latency on ordinary requests, alone and under attack.

Run ``python -m bench.hostile`` from the repository root (``--help`` for the
knobs). Every piece is its own process, all on 127.0.0.1, started with the
helpers of ``bench/proxy.py``: ``bench/fake_openai.py``, a FAKE upstream (no
model, zero token delay), ``bench/cp_sink.py`` as a stand-in control plane and
``specgate sidecar`` in front of the fake upstream with the seed policy.

This process sends *ordinary* requests (a small non-streaming chat
completion) at a steady rate, open loop: each request's latency counts from
the moment it was due, so a stalled sidecar shows as the stall, not as fewer
requests. Each round measures a window with the ordinary requests *alone*, then
one while a separate process keeps *hostile* requests in flight, one after
the other per kind:

* ``huge_headers``: a header block that would reach 16 MiB, sent as fast as
  the sidecar reads it;
* ``slowloris``: connections that feed their request one header line a second;
* ``labels``: an ``X-Specgate-Labels`` header of 8,000 pairs (under the
  header-block cap, so that it reaches the classifier);
* ``json_schema``: a chat request whose ``response_format`` carries a 1 MB JSON schema;
* ``deep_json``: a chat request nested 5,000 levels deep.

After each hostile window the next round waits until ``/healthz`` answers
fast again (the time it took is reported: leftovers of the attack must not
count as "alone"). The report gives, per phase, the medians over the rounds of p50 and p99 and
their ratio (hostile / alone), how many ordinary requests were sent and
answered, and what the sidecar answered each hostile kind. Nothing here
is a pass/fail: BENCHMARKS.md ("Hostile clients") has the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.machine import machine_facts
from bench.proxy import Proc, _stop, spawn_ready_line, start_sidecar, wait_ready

KINDS = ("huge_headers", "slowloris", "labels", "json_schema", "deep_json")
UPSTREAM = "bench/fake_openai.py (a FAKE upstream: no model, zero token delay)"
ORDINARY = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}


@dataclass
class Config:
    rounds: int = 3
    duration_s: float = 5.0
    rate: float = 50.0  # ordinary requests per second
    settle_s: float = 1.0  # hostile traffic before a hostile window is measured
    header_bytes: int = 16 << 20
    slowloris: int = 20  # connections
    label_pairs: int = 8000
    schema_bytes: int = 1 << 20
    depth: int = 5000
    request_timeout_s: float = 120.0
    kinds: tuple[str, ...] = KINDS
    ready_timeout_s: float = 60.0


# --- the hostile process -------------------------------------------------------------------------


def _head(path: str, host: str, extra: bytes = b"", body: bytes = b"") -> bytes:
    method = b"POST" if body else b"GET"
    lines = b"%s %s HTTP/1.1\r\nhost: %s\r\n%s" % (method, path.encode(), host.encode(), extra)
    if body:
        lines += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    return lines + b"\r\n" + body


def _payloads(config: Config, host: str) -> dict[str, bytes]:
    """The complete requests of the kinds sent whole (built once: building them is not what is measured)."""
    labels = ",".join(f"{n:x}=v" for n in range(config.label_pairs)).encode()
    props: dict[str, Any] = {}
    n = 0
    while len(json.dumps(props)) < config.schema_bytes:
        props.update({f"field_{n + i}": {"type": "string", "description": "x" * 40} for i in range(1000)})
        n += 1000
    schema = dict(ORDINARY, response_format={"type": "json_schema", "json_schema": {
        "name": "big", "schema": {"type": "object", "properties": props}}})
    deep = json.dumps(ORDINARY)[:-1] + ', "metadata": {"x": ' + "[" * config.depth + "]" * config.depth + "}}"
    chat = "/v1/chat/completions"
    return {
        "labels": _head(chat, host, b"x-specgate-labels: " + labels + b"\r\n", json.dumps(ORDINARY).encode()),
        "json_schema": _head(chat, host, body=json.dumps(schema).encode()),
        "deep_json": _head(chat, host, body=deep.encode()),
    }


async def _status(reader: asyncio.StreamReader) -> str:
    """The status of one response (its body is not needed: the connection is dropped after it)."""
    line = await reader.readline()
    parts = line.split()
    return parts[1].decode() if len(parts) > 1 else "closed"


async def _whole(host: str, port: int, data: bytes, timeout: float) -> str:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        return await asyncio.wait_for(_status(reader), timeout)
    finally:
        writer.close()


async def _huge_headers(host: str, port: int, config: Config) -> str:
    reader, writer = await asyncio.open_connection(host, port)

    async def pump() -> None:
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: %s\r\nx-filler: " % host.encode())
        piece = b"a" * 65536
        for _ in range(config.header_bytes // len(piece)):
            writer.write(piece)
            await writer.drain()
        writer.write(b"\r\n\r\n")
        await writer.drain()

    pumping = asyncio.ensure_future(pump())
    try:
        return await asyncio.wait_for(_status(reader), config.request_timeout_s)
    finally:
        pumping.cancel()
        with contextlib.suppress(BaseException):
            await pumping
        writer.close()


async def _slowloris(host: str, port: int, config: Config) -> str:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: %s\r\n" % host.encode())
        answer = asyncio.ensure_future(_status(reader))
        n = 0
        while not answer.done() and n < config.request_timeout_s:
            writer.write(b"x-slow-%d: 1\r\n" % n)
            n += 1
            await asyncio.wait([answer], timeout=1.0)
        return answer.result() if answer.done() else "still open"
    finally:
        writer.close()


async def _hostile(url: str, config: Config, stop: EventType, out: Any) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payloads = _payloads(config, host)
    seen: dict[str, Counter[str]] = {kind: Counter() for kind in config.kinds}

    async def repeat(kind: str, once: Callable[[], Awaitable[str]]) -> None:
        while not stop.is_set():
            try:
                seen[kind][await once()] += 1
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                seen[kind][type(exc).__name__] += 1
            except asyncio.CancelledError:
                seen[kind]["in flight at the end"] += 1
                raise
            await asyncio.sleep(0.05)

    tasks = []
    if "huge_headers" in config.kinds:
        tasks.append(asyncio.ensure_future(repeat("huge_headers", lambda: _huge_headers(host, port, config))))
    if "slowloris" in config.kinds:
        tasks += [asyncio.ensure_future(repeat("slowloris", lambda: _slowloris(host, port, config)))
                  for _ in range(config.slowloris)]
    for kind, data in payloads.items():
        if kind not in config.kinds:
            continue
        tasks.append(asyncio.ensure_future(
            repeat(kind, functools.partial(_whole, host, port, data, config.request_timeout_s))))
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    out.put({kind: dict(counts) for kind, counts in seen.items()})


def _hostile_main(url: str, config: Config, stop: EventType, out: Any) -> None:
    asyncio.run(_hostile(url, config, stop, out))


# --- the ordinary requests -----------------------------------------------------------------------


async def _ordinary(url: str, config: Config) -> dict[str, Any]:
    """Ordinary requests at ``config.rate`` per second for ``config.duration_s``; waits for every answer."""
    import aiohttp

    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    body = json.dumps(ORDINARY).encode()
    headers = {"content-type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(due: float) -> None:
            try:
                async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as resp:
                    await resp.read()
                    statuses[str(resp.status)] += 1
            except (TimeoutError, aiohttp.ClientError) as exc:
                statuses[type(exc).__name__] += 1
                return
            latencies.append(time.monotonic() - due)

        loop_start = time.monotonic()
        count = int(config.duration_s * config.rate)
        tasks = []
        for n in range(count):
            due = loop_start + n / config.rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(due)))
        await asyncio.gather(*tasks)
    ordered = sorted(latencies)

    def quantile(q: float) -> float | None:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3) if ordered else None

    return {"sent": count, "answered": statuses.get("200", 0), "statuses": dict(statuses),
            "p50_ms": quantile(0.5), "p99_ms": quantile(0.99), "max_ms": quantile(1.0)}


# --- the run --------------------------------------------------------------------------------------


def _recover(url: str, timeout_s: float) -> float:
    """Seconds until ``/healthz`` answers fast three times in a row: what the attack left behind is done.

    Without it a window "alone" right after a hostile one would measure the leftovers of the attack
    (a request still being classified holds the event loop after its client has gone).
    """
    start = time.monotonic()
    fast = 0
    while fast < 3 and time.monotonic() - start < timeout_s:
        t = time.monotonic()
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/healthz", timeout=timeout_s) as resp:
            resp.read()
        fast = fast + 1 if time.monotonic() - t < 0.02 else 0
        time.sleep(0.05)
    return round(time.monotonic() - start, 2)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def _ratio(hostile: float | None, alone: float | None) -> float | None:
    return round(hostile / alone, 2) if hostile is not None and alone else None


def run(config: Config) -> dict[str, Any]:
    t0 = time.monotonic()
    rounds: list[dict[str, Any]] = []
    hostile_seen: dict[str, Counter[str]] = {kind: Counter() for kind in config.kinds}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specgate-bench-hostile-")))
        log_dir = work / "logs"
        log_dir.mkdir()
        started: list[Proc] = []

        def stop_all() -> None:
            for proc in reversed(started):
                _stop(proc.process)

        stack.callback(stop_all)
        upstream, up_port = spawn_ready_line("upstream", [sys.executable, "-m", "bench.fake_openai"], log_dir)
        started.append(upstream)
        sink, sink_port = spawn_ready_line("cp-sink", [sys.executable, "-m", "bench.cp_sink"], log_dir)
        started.append(sink)
        sidecar = start_sidecar([f"http://127.0.0.1:{up_port}"], f"http://127.0.0.1:{sink_port}", work, log_dir)
        started.append(sidecar)
        wait_ready(sidecar, config.ready_timeout_s)
        context = multiprocessing.get_context("spawn")
        for n in range(config.rounds):
            alone = asyncio.run(_ordinary(sidecar.url, config))
            stop, out = context.Event(), context.Queue()
            attacker = context.Process(target=_hostile_main, args=(sidecar.url, config, stop, out), daemon=True)
            attacker.start()
            try:
                time.sleep(config.settle_s)
                hostile = asyncio.run(_ordinary(sidecar.url, config))
            finally:
                stop.set()
                seen = out.get(timeout=config.request_timeout_s + 30)
                attacker.join(30)
                if attacker.is_alive():
                    attacker.kill()
            recovery_s = _recover(sidecar.url, config.request_timeout_s)
            for kind, counts in seen.items():
                hostile_seen[kind].update(counts)
            sidecar.check()
            rounds.append({"round": n + 1, "alone": alone, "hostile": hostile, "hostile_requests": seen,
                           "recovery_s": recovery_s})
            print(f"round {n + 1}: alone p50 {alone['p50_ms']} p99 {alone['p99_ms']} ms; "
                  f"hostile p50 {hostile['p50_ms']} p99 {hostile['p99_ms']} ms; recovered in {recovery_s} s",
                  file=sys.stderr)
    summary: dict[str, Any] = {}
    for phase in ("alone", "hostile"):
        summary[phase] = {key: _median([r[phase][key] for r in rounds]) for key in ("p50_ms", "p99_ms", "max_ms")}
        summary[phase]["sent"] = sum(r[phase]["sent"] for r in rounds)
        summary[phase]["answered"] = sum(r[phase]["answered"] for r in rounds)
    summary["recovery_s"] = _median([r["recovery_s"] for r in rounds])
    summary["ratio"] = {key: _ratio(summary["hostile"][key], summary["alone"][key]) for key in ("p50_ms", "p99_ms")}
    return {"upstream": UPSTREAM, "config": asdict(config), "machine": machine_facts(),
            "wall_s": round(time.monotonic() - t0, 1), "summary": summary,
            "hostile_requests": {kind: dict(counts) for kind, counts in hostile_seen.items()}, "rounds": rounds}


def render(report: dict[str, Any]) -> str:
    s = report["summary"]
    c = report["config"]
    lines = [f"sidecar in front of {report['upstream']}; {c['rate']:g} ordinary requests/s, "
             f"{c['rounds']} rounds of {c['duration_s']:g} s per phase (medians over the rounds)",
             f"{'phase':<10}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'answered':>14}"]
    for phase in ("alone", "hostile"):
        row = s[phase]
        lines.append(f"{phase:<10}{row['p50_ms']!s:>10}{row['p99_ms']!s:>10}{row['max_ms']!s:>10}"
                     f"{row['answered']:>8}/{row['sent']:<5}")
    lines.append(f"{'ratio':<10}{s['ratio']['p50_ms']!s:>10}{s['ratio']['p99_ms']!s:>10}")
    lines.append(f"after the hostile process stopped, /healthz answered fast again within {s['recovery_s']} s")
    lines.append("hostile requests, what the sidecar answered:")
    for kind, counts in report["hostile_requests"].items():
        lines.append(f"  {kind:<14}" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[Config, bool]:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alone+hostile window pairs")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of each window")
    parser.add_argument("--rate", type=float, default=50.0, help="ordinary requests per second")
    parser.add_argument("--label-pairs", type=int, default=8000)
    parser.add_argument("--schema-bytes", type=int, default=1 << 20)
    parser.add_argument("--depth", type=int, default=5000)
    parser.add_argument("--slowloris", type=int, default=20, help="slowloris connections")
    parser.add_argument("--kinds", default=",".join(KINDS), help="the hostile kinds to send, comma-separated")
    parser.add_argument("--json", action="store_true", help="also the full report, as JSON on stdout (the table "
                        "goes to stderr)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration <= 0 or args.rate <= 0:
        parser.error("--rounds, --duration and --rate must be positive")
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(KINDS)}")
    return Config(rounds=args.rounds, duration_s=args.duration, rate=args.rate, label_pairs=args.label_pairs,
                  schema_bytes=args.schema_bytes, depth=args.depth, slowloris=args.slowloris,
                  kinds=kinds), args.json


def main(argv: list[str] | None = None) -> None:
    config, as_json = parse_args(argv)
    report = run(config)
    print(render(report), file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
