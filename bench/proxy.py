"""What does the sidecar add to a request? Proxy overhead, side by side with vllm-router, LiteLLM and nginx.

Run ``python -m bench.proxy`` from the repository root (``--help`` for the
knobs) after ``bash bench/peers.sh`` has installed the peers. Every piece is
its own process, all on 127.0.0.1:

* ``bench/fake_openai.py`` — a FAKE, fast OpenAI upstream (zero token delay;
  16-token JSON answers, 64-token SSE streams, ``/health``, ``/v1/models``);
* ``bench/cp_sink.py`` — a stand-in control plane that registers the sidecar,
  answers its heartbeats and bundle long-polls and takes its telemetry batches
  (counted), so the sidecar pays what a healthy worker pays for telemetry;
* the proxies, each in front of the same upstream:
  ``sidecar`` — ``specgate sidecar`` with engines ``draft`` and ``base`` both
  at the upstream, a signed last-known-good bundle of
  ``policies/examples/seed.yaml`` in its state dir with the key passed as
  ``--public-key``, the route table ``/v1/chat/completions=chat`` (so the seed
  rule speculates at batch size <= 4 and not above), telemetry to the sink;
  ``gateway`` — the same sidecar as ``--kind gateway`` (replica scope) with
  each engine a pool of two replicas: the upstream and a second FAKE upstream
  of its own, so that what replica pools add per request (scrapes per
  replica, the batch per engine, the choice of a replica) is measured against
  ``sidecar``;
  ``vllm-router`` — ``--policy round_robin``; ``litellm`` — the LiteLLM proxy,
  one worker, model ``openai/fake-model`` at the upstream; ``nginx`` — one
  worker process, HTTP/1.1 keep-alive upstream, no buffering, no access log;
* ``bench/loadgen.py`` — the load generator (uvloop + aiohttp), one process
  for the whole run.

For every peer, level of concurrency (``--levels``) and kind of request
(JSON, 16 tokens; stream, 64 tokens) it runs a *direct* run against the
upstream and, right after it, the *proxied* run through the peer: a pair.
Pairs are repeated (``--pairs``, the order of the peers rotating) and the
report gives the medians over the pairs of: the added p50/p99 latency (time to
first chunk for streams) proxied minus direct, the throughput ratio (requests
completed inside the window, proxied / direct), and the proxy's CPU time per
request (its whole process tree, user + system). The machine has 2 cores that
load generator, upstream and proxy share, and other people's work runs beside
it: each run records the 1-minute load average and the CPU that processes
other than the benchmark's took during its window.

``--profile DIR`` then profiles the sidecar alone under load with py-spy
(collapsed stacks and an SVG flame graph in DIR, top frames in the report).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "bench" / ".peers"
SEED = ROOT / "policies" / "examples" / "seed.yaml"
ALL_PEERS = ("sidecar", "gateway", "vllm-router", "litellm", "nginx")
MODES = ("json", "stream")
TOKENS = {"json": 16, "stream": 64}
LITELLM_KEY = "sk-specgate-bench"  # a local benchmark's made-up key
WORKER_KEY = "sgk_specgate_bench"  # the stand-in control plane accepts anything

# Measured on these machines by others (the issue): context beside this run's numbers.
PUBLISHED = {
    "nginx": {"added_p50_c1_ms": "0.08", "cpu_json_ms": "0.05-0.11", "cpu_stream_ms": "0.4"},
    "vllm-router": {"added_p50_c1_ms": "0.23", "cpu_json_ms": "0.12-0.23", "cpu_stream_ms": "0.8"},
    "litellm": {"added_p50_c1_ms": "20", "cpu_json_ms": "12-19", "cpu_stream_ms": "58-75"},
}
GOAL_ADDED_P50_MS = 0.5
GOAL_CPU_JSON_MS = 0.5
GOAL_CPU_STREAM_MS = 1.0
GOAL_VS_ROUTER = 0.8
GOAL_VS_LITELLM = 20.0
GOAL_POOL_EXTRA_CPU_US = 20.0  # issue 17: what the pool logic may add to the sidecar's CPU per request


class BenchError(RuntimeError):
    """The run cannot go on (a process died, a peer never became ready): fail loudly."""


# --- small helpers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def loadavg() -> list[float]:
    with open("/proc/loadavg") as handle:
        return [float(v) for v in handle.read().split()[:3]]


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _version(package: str, python: Path | None = None) -> str | None:
    if python is None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None
    try:
        out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                             capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def wait_for_quiet(max_load: float, max_wait_s: float) -> dict[str, Any]:
    """Wait (at most ``max_wait_s``) for the 1-minute load average to fall below ``max_load``."""
    start = time.monotonic()
    first = loadavg()
    while loadavg()[0] >= max_load and time.monotonic() - start < max_wait_s:
        time.sleep(5)
    return {"load_before_wait": first, "waited_s": round(time.monotonic() - start, 1), "load_at_start": loadavg(),
            "max_load": max_load}


# --- processes ---------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def check(self) -> None:
        if self.process.poll() is not None:
            raise BenchError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")


def _stop(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _env(**extra: str) -> dict[str, str]:
    """The environment without the SPECGATE_/OTEL_/LITELLM_ settings of whoever runs the benchmark."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECGATE_", "OTEL_", "LITELLM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def spawn(name: str, argv: list[str], log_dir: Path, *, env: dict[str, str] | None = None,
          stdout_pipe: bool = False) -> Proc:
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        # Own process group, so stopping it stops what it started (nginx workers, uvicorn workers).
        process = subprocess.Popen(argv, cwd=ROOT, env=env or _env(), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE if stdout_pipe else out, stderr=out,
                                   start_new_session=True)
    return Proc(name, process, log)


def spawn_ready_line(name: str, argv: list[str], log_dir: Path, timeout: float = 30.0) -> tuple[Proc, int]:
    """A helper of ours that prints ``READY PORT`` once listening."""
    proc = spawn(name, argv, log_dir, stdout_pipe=True)
    assert proc.process.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline:
        line = proc.process.stdout.readline()
        if line.startswith(b"READY"):
            return proc, int(line.split()[1])
        if not line:
            break
    _stop(proc.process)
    raise BenchError(f"{name} did not start: {line!r}\n{proc.tail()}")


def post_json(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
              timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def wait_ready(proc: Proc, timeout: float) -> None:
    """Ready means: a real chat completion through it comes back 200 with content."""
    deadline = time.monotonic() + timeout
    last = ""
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 16}
    while time.monotonic() < deadline:
        proc.check()
        try:
            status, _, raw = post_json(proc.url + "/v1/chat/completions", body, proc.headers, timeout=5.0)
            if status == 200 and json.loads(raw)["choices"][0]["message"]["content"]:
                return
            last = f"HTTP {status}: {raw[:200]!r}"
        except (OSError, ValueError, KeyError, IndexError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.25)
    raise BenchError(f"{proc.name} was not ready in {timeout:.0f}s ({last}):\n{proc.tail()}")


# --- the peers ---------------------------------------------------------------------------------


def _console_script(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise BenchError(f"{name!r} not found next to {sys.executable} nor on PATH")
    return found


def write_sidecar_state(state_dir: Path, policy_text: str | None = None) -> str:
    """A signed last-known-good bundle of ``policy_text`` (the seed policy by default); returns the public key to
    trust."""
    from policies import BundlePayload, Delivery, Revision, SigningKey, load_policy

    key = SigningKey.generate()
    text = SEED.read_text() if policy_text is None else policy_text
    # Bound to the sidecar's pool ("bench"), or it refuses the bundle as another pool's.
    envelope = key.sign(BundlePayload(Revision.of(load_policy(text))), Delivery(pool="bench"))
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "bundle.json").write_text(json.dumps(envelope))
    return key.public_key_b64


def start_sidecar(upstreams: Sequence[str], sink: str, work: Path, log_dir: Path, kind: str = "worker") -> Proc:
    """``specgate sidecar`` with engines draft and base, each the pool of ``upstreams``; ``kind`` gateway is the
    ``gateway`` peer."""
    name = "sidecar" if kind == "worker" else kind
    port = free_port()
    state = work / f"{name}-state"
    public_key = write_sidecar_state(state)
    replicas = ",".join(upstreams)
    argv = [_console_script("specgate"), "sidecar", "--kind", kind, "--engine", f"draft={replicas}",
            "--engine", f"base={replicas}", "--listen", f"127.0.0.1:{port}", "--route", "/v1/chat/completions=chat",
            "--state-dir", str(state), "--public-key", public_key, "--key", WORKER_KEY, "--control-plane", sink,
            "--pool", "bench", "--worker-id", f"bench-{name}", "--log-level", "warning"]
    proc = spawn(name, argv, log_dir)
    proc.url = f"http://127.0.0.1:{port}"
    shown = ",".join(f"UPSTREAM{i + 1 if i else ''}" for i in range(len(upstreams)))
    proc.info = {"command": f"specgate sidecar --kind {kind} --engine draft={shown} --engine base={shown} "
                            "--route /v1/chat/completions=chat --state-dir DIR --public-key KEY "
                            "--control-plane SINK --log-level warning",
                 "version": _version("specgate"), "policy": "policies/examples/seed.yaml (last-known-good bundle)"}
    return proc


def start_vllm_router(upstream: str, log_dir: Path, peers_dir: Path) -> Proc:
    binary = peers_dir / "vllm-router" / "bin" / "vllm-router"
    if not binary.exists():
        raise BenchError(f"vllm-router is not installed at {binary}: run `bash bench/peers.sh vllm-router`")
    port, metrics_port = free_port(), free_port()
    argv = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream,
            "--policy", "round_robin", "--log-level", "warning", "--prometheus-port", str(metrics_port)]
    proc = spawn("vllm-router", argv, log_dir)
    proc.url = f"http://127.0.0.1:{port}"
    proc.info = {"command": "vllm-router --worker-urls UPSTREAM --policy round_robin --log-level warning",
                 "version": _version("vllm-router", binary.parent / "python"), "policy": "round_robin"}
    return proc


def start_litellm(upstream: str, work: Path, log_dir: Path, peers_dir: Path) -> Proc:
    binary = peers_dir / "litellm" / "bin" / "litellm"
    if not binary.exists():
        raise BenchError(f"LiteLLM is not installed at {binary}: run `bash bench/peers.sh litellm`")
    port = free_port()
    config = work / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: fake-model\n"
        "    litellm_params:\n"
        "      model: openai/fake-model\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: sk-fake-upstream\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_KEY}\n")
    env = _env(LITELLM_MASTER_KEY=LITELLM_KEY, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False",
               LITELLM_LOG="ERROR", DISABLE_SCHEMA_UPDATE="True")
    env.pop("PYTHONPATH", None)
    argv = [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    proc = spawn("litellm", argv, log_dir, env=env)
    proc.url = f"http://127.0.0.1:{port}"
    proc.headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
    proc.info = {"command": "litellm --config CONF --num_workers 1 (model openai/fake-model, api_base UPSTREAM/v1)",
                 "version": _version("litellm", binary.parent / "python")}
    return proc


def _nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def start_nginx(upstream: str, work: Path, log_dir: Path) -> Proc:
    binary = _nginx_binary()
    if binary is None:
        raise BenchError("nginx is not installed: run `bash bench/peers.sh nginx` (apt-get install nginx)")
    port = free_port()
    prefix = work / "nginx"
    for sub in ("tmp", "logs"):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    host_port = upstream.removeprefix("http://")
    conf = prefix / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    upstream fake {{
        server {host_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
""")
    argv = [binary, "-c", str(conf), "-p", str(prefix), "-e", str(prefix / "logs" / "error.log"),
            "-g", "daemon off;"]
    proc = spawn("nginx", argv, log_dir)
    proc.url = f"http://127.0.0.1:{port}"
    version = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr.strip().split("/")[-1]
    proc.info = {"command": "nginx -c CONF -p PREFIX (worker_processes 1, proxy_http_version 1.1, keepalive 256, "
                            "proxy_buffering off, proxy_request_buffering off, access_log off)",
                 "version": version}
    return proc


# --- the harness ---------------------------------------------------------------------------------


class LoadGen:
    def __init__(self, log_dir: Path) -> None:
        log = log_dir / "loadgen.log"
        with log.open("wb") as err:
            process = subprocess.Popen([sys.executable, "-m", "bench.loadgen"], cwd=ROOT, env=_env(),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                       start_new_session=True)
        self.proc = Proc("loadgen", process, log)
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith(b"READY"):
            _stop(process)
            raise BenchError(f"the load generator did not start: {line!r}\n{self.proc.tail()}")

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        process = self.proc.process
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.write(json.dumps(command).encode() + b"\n")
        process.stdin.flush()
        line = process.stdout.readline()
        if not line:
            raise BenchError(f"the load generator died:\n{self.proc.tail()}")
        result: dict[str, Any] = json.loads(line)
        if "fatal" in result:
            raise BenchError(f"the load generator failed: {result['fatal']}")
        return result

    def close(self) -> None:
        process = self.proc.process
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            _stop(process)


@dataclass
class Config:
    levels: list[int] = field(default_factory=lambda: [1, 16, 64])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    peers: list[str] = field(default_factory=lambda: list(ALL_PEERS))
    duration_s: float = 2.0
    warmup_s: float = 0.5
    pairs: int = 3
    max_load: float = 1.5
    load_wait_s: float = 180.0
    ready_timeout_s: float = 120.0
    peers_dir: Path = PEERS_DIR
    validate: bool = False
    profile_dir: Path | None = None
    profile_level: int = 16
    profile_duration_s: float = 8.0
    log_dir: Path | None = None


@contextlib.contextmanager
def harness(config: Config) -> Iterator[dict[str, Any]]:
    """Upstream, sink, load generator and the requested peers, all started and ready."""
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specgate-bench-proxy-")))
        log_dir = config.log_dir or work / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        started: list[Proc] = []

        def stop_all() -> None:
            for proc in reversed(started):
                _stop(proc.process)

        stack.callback(stop_all)
        upstream, up_port = spawn_ready_line("upstream", [sys.executable, "-m", "bench.fake_openai",
                                                          "--tokens", str(TOKENS["json"]),
                                                          "--stream-tokens", str(TOKENS["stream"])], log_dir)
        started.append(upstream)
        upstream.url = f"http://127.0.0.1:{up_port}"
        peers: dict[str, Proc] = {}
        sink = None
        second: Proc | None = None
        if "gateway" in config.peers:
            second, second_port = spawn_ready_line("upstream-2", [sys.executable, "-m", "bench.fake_openai",
                                                                  "--tokens", str(TOKENS["json"]),
                                                                  "--stream-tokens", str(TOKENS["stream"])],
                                                   log_dir)
            started.append(second)
            second.url = f"http://127.0.0.1:{second_port}"
        if "sidecar" in config.peers or "gateway" in config.peers:
            sink, sink_port = spawn_ready_line("cp-sink", [sys.executable, "-m", "bench.cp_sink"], log_dir)
            started.append(sink)
            sink.url = f"http://127.0.0.1:{sink_port}"
        for name in config.peers:
            if name == "sidecar":
                assert sink is not None
                proc = start_sidecar([upstream.url], sink.url, work, log_dir)
            elif name == "gateway":
                assert sink is not None
                assert second is not None
                proc = start_sidecar([upstream.url, second.url], sink.url, work, log_dir, kind="gateway")
            elif name == "vllm-router":
                proc = start_vllm_router(upstream.url, log_dir, config.peers_dir)
            elif name == "litellm":
                proc = start_litellm(upstream.url, work, log_dir, config.peers_dir)
            elif name == "nginx":
                proc = start_nginx(upstream.url, work, log_dir)
            else:
                raise BenchError(f"unknown peer {name!r} (known: {', '.join(ALL_PEERS)})")
            started.append(proc)
            peers[name] = proc
        for proc in peers.values():
            wait_ready(proc, config.ready_timeout_s)
        loadgen = LoadGen(log_dir)
        stack.callback(loadgen.close)
        yield {"upstream": upstream, "sink": sink, "peers": peers, "loadgen": loadgen, "work": work,
               "log_dir": log_dir}


def measure(h: dict[str, Any], target: Proc, peer: Proc, mode: str, level: int, config: Config) -> dict[str, Any]:
    """One run of the load generator against ``target`` (the upstream itself, or a peer)."""
    watch = {"proxy": peer.pid, "upstream": h["upstream"].pid}
    if h["sink"] is not None:
        watch["sink"] = h["sink"].pid
    load = loadavg()
    result = h["loadgen"].run({
        "url": target.url + "/v1/chat/completions", "concurrency": level, "stream": mode == "stream",
        "duration": config.duration_s, "warmup": config.warmup_s, "headers": target.headers,
        "max_tokens": TOKENS[mode], "watch": watch, "validate": config.validate,
        "expect_tokens": TOKENS[mode] if mode == "stream" else None})
    result["load1"] = load[0]
    for proc in (h["upstream"], peer):
        proc.check()
    return result


def run_pairs(h: dict[str, Any], config: Config) -> list[dict[str, Any]]:
    runs = []
    names = list(h["peers"])
    for rep in range(config.pairs):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for level in config.levels:
            for mode in config.modes:
                for name in order:
                    peer = h["peers"][name]
                    direct = measure(h, h["upstream"], peer, mode, level, config)
                    proxied = measure(h, peer, peer, mode, level, config)
                    runs.append({"peer": name, "mode": mode, "level": level, "rep": rep, "direct": direct,
                                 "proxied": proxied})
                    print(f"  pair {rep + 1}/{config.pairs} {name:<11} {mode:<6} c={level:<3} "
                          f"direct {direct['rps']:7.0f}/s p50 {direct['latency_ms']['p50'] or 0:7.3f} ms | "
                          f"proxied {proxied['rps']:7.0f}/s p50 {proxied['latency_ms']['p50'] or 0:7.3f} ms | "
                          f"cpu {1000 * proxied['cpu_s']['proxy'] / max(proxied['completed'], 1):6.3f} ms/req | "
                          f"load {proxied['load1']:.2f}", file=sys.stderr, flush=True)
    return runs


def summarize(runs: list[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["peer"], r["mode"], r["level"]) for r in runs},
                  key=lambda k: (MODES.index(k[1]), k[2], ALL_PEERS.index(k[0])))
    for peer, mode, level in keys:
        pairs = [r for r in runs if (r["peer"], r["mode"], r["level"]) == (peer, mode, level)]

        def stat(run: dict[str, Any], what: str, q: str) -> float | None:
            values = run.get(what)
            return None if values is None else values.get(q)

        def added(pairs: list[dict[str, Any]], what: str, q: str) -> float | None:
            values = []
            for p in pairs:
                a, b = stat(p["proxied"], what, q), stat(p["direct"], what, q)
                values.append(None if a is None or b is None else a - b)
            return median(values)

        def share(run: dict[str, Any]) -> float:
            return run["others_cpu_s"] / run["window_s"]

        rows.append({
            "peer": peer, "mode": mode, "level": level, "pairs": len(pairs),
            "direct_p50_ms": median([stat(p["direct"], "latency_ms", "p50") for p in pairs]),
            "proxied_p50_ms": median([stat(p["proxied"], "latency_ms", "p50") for p in pairs]),
            "added_p50_ms": added(pairs, "latency_ms", "p50"),
            "added_p99_ms": added(pairs, "latency_ms", "p99"),
            "added_e2e_p50_ms": added(pairs, "e2e_ms", "p50") if mode == "stream" else None,
            "throughput_ratio": median([p["proxied"]["completed"] / p["direct"]["completed"]
                                        if p["direct"]["completed"] else None for p in pairs]),
            "direct_rps": median([p["direct"]["rps"] for p in pairs]),
            "proxied_rps": median([p["proxied"]["rps"] for p in pairs]),
            "proxy_cpu_ms_per_req": median([1000 * p["proxied"]["cpu_s"]["proxy"] / p["proxied"]["completed"]
                                            if p["proxied"]["completed"] else None for p in pairs]),
            "upstream_cpu_ms_per_req": median([1000 * p["direct"]["cpu_s"]["upstream"] / p["direct"]["completed"]
                                               if p["direct"]["completed"] else None for p in pairs]),
            "loadgen_cpu_ms_per_req": median([1000 * p["direct"]["cpu_s"]["loadgen"] / p["direct"]["completed"]
                                              if p["direct"]["completed"] else None for p in pairs]),
            "load1": [round(p["proxied"]["load1"], 2) for p in pairs],
            "others_cpu_share": median([share(p["proxied"]) for p in pairs]),
            "completed": sum(p["proxied"]["completed"] for p in pairs),
            "errors": sum(p["proxied"]["errors"] + p["proxied"]["bad"] + p["direct"]["errors"] + p["direct"]["bad"]
                          for p in pairs),
            "decision_headers": sum(p["proxied"]["decision_header"] for p in pairs),
        })
    return rows


def evaluate_goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def row(peer: str, mode: str, level: int) -> dict[str, Any] | None:
        return next((r for r in rows if (r["peer"], r["mode"], r["level"]) == (peer, mode, level)), None)

    goals: list[dict[str, Any]] = []
    side = [r for r in rows if r["peer"] == "sidecar"]
    if not side:
        return goals
    c1 = row("sidecar", "json", 1)
    if c1 is not None and c1["added_p50_ms"] is not None:
        goals.append({"goal": f"added p50 at concurrency 1 (JSON) under {GOAL_ADDED_P50_MS} ms",
                      "result": f"{c1['added_p50_ms']:.3f} ms", "met": c1["added_p50_ms"] < GOAL_ADDED_P50_MS})
    for mode, limit in (("json", GOAL_CPU_JSON_MS), ("stream", GOAL_CPU_STREAM_MS)):
        cpu = {r["level"]: r["proxy_cpu_ms_per_req"] for r in side if r["mode"] == mode
               and r["proxy_cpu_ms_per_req"] is not None}
        if cpu:
            what = "non-streaming request" if mode == "json" else f"{TOKENS['stream']}-token stream"
            goals.append({"goal": f"CPU under {limit} ms per {what}",
                          "result": ", ".join(f"c={k}: {v:.3f} ms" for k, v in sorted(cpu.items())),
                          "met": all(v < limit for v in cpu.values())})
    parts, met = [], True
    for r in side:
        g = row("gateway", r["mode"], r["level"])
        if g is None or g["proxy_cpu_ms_per_req"] is None or r["proxy_cpu_ms_per_req"] is None:
            continue
        extra_us = 1000 * (g["proxy_cpu_ms_per_req"] - r["proxy_cpu_ms_per_req"])
        parts.append(f"{r['mode']} c={r['level']}: {extra_us:+.0f} us")
        met = met and extra_us < GOAL_POOL_EXTRA_CPU_US
    if parts:
        goals.append({"goal": f"replica pools (gateway, 2 replicas per engine) add under {GOAL_POOL_EXTRA_CPU_US} us "
                              "of CPU per request to the sidecar's", "result": ", ".join(parts), "met": met})
    for other, factor, what in (("vllm-router", GOAL_VS_ROUTER, "throughput ratio >= 0.8x vllm-router's"),
                                ("litellm", GOAL_VS_LITELLM, "throughput >= 20x LiteLLM's")):
        parts, met = [], True
        for r in side:
            o = row(other, r["mode"], r["level"])
            if o is None:
                continue
            if other == "vllm-router":
                ratio = r["throughput_ratio"] / o["throughput_ratio"] if o["throughput_ratio"] else math.inf
            else:
                ratio = r["proxied_rps"] / o["proxied_rps"] if o["proxied_rps"] else math.inf
            shown = f"{ratio:.2f}x" if ratio != math.inf else f"({other} completed none in the window)"
            parts.append(f"{r['mode']} c={r['level']}: {shown}")
            met = met and ratio >= factor
        if parts:
            goals.append({"goal": what + " at every level", "result": ", ".join(parts), "met": met})
    return goals


# --- profiling ------------------------------------------------------------------------------------


def _frame(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)`` with the package directory kept."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif path.startswith(str(ROOT) + "/"):
        path = path[len(str(ROOT)) + 1:]
    elif "/lib/python3" in path:  # the standard library: lib/python3.11/asyncio/runners.py -> asyncio/runners.py
        path = path.split("/lib/python3", 1)[1].partition("/")[2]
    return f"{name} ({path})" if path else name


# Frames every sample of the main thread passes through (the command line, the runner): left out of "inclusive".
_ROOT_FRAMES = ("typer/", "click/", "specgate/cli.py", "sidecar/cli.py", "sidecar/main.py", "runners.py",
                "uvloop/__init__.py", "<module>", "threading.py")


def _area(frames: list[str]) -> str:
    """Where a sample's time goes, by its stack: the leaf frame's package, with a few stack-wide rules."""
    leaf = frames[-1]
    if any("concurrent/futures/thread.py" in f for f in frames):
        return "telemetry encoder thread (to_thread: pydantic JSON dump + gzip; includes waiting for the GIL)"
    if leaf.startswith("Runner.run ") or "uvloop/" in leaf:
        return "uvloop C code under the event loop (socket reads/writes, syscalls, scheduling)"
    if "ThreadPoolExecutor.submit" in leaf:
        return "telemetry batch hand-off to the thread (ThreadPoolExecutor.submit, GIL)"
    own = "sidecar's own request path (parse, classify, decide, relay, event)"
    # aiohttp is no longer on the request path (sidecar/upstream.py is): what remains is background work
    aiohttp = "aiohttp (telemetry batches to the control plane, engine scrapes, policy sync)"
    loop = "asyncio Python code (tasks, futures)"
    areas = (("sidecar/telemetry.py", "sidecar telemetry exporter (event loop side)"),
             ("sidecar/server.py", "sidecar/server.py: HTTP server, the client's side (incl. its write() calls)"),
             ("sidecar/upstream.py", "sidecar/upstream.py: engine client (incl. its write() calls)"),
             ("sidecar/", own), ("policies/", own), ("aiohttp/", aiohttp), ("yarl/", aiohttp),
             ("multidict/", aiohttp), ("aiohappyeyeballs/", aiohttp), ("http/cookies.py", aiohttp),
             ("uvicorn/", "uvicorn + httptools server (the client's side)"),
             ("pydantic", "pydantic (telemetry event construction)"), ("uuid.py", "uuid4 request ids"),
             ("asyncio/", loop), ("_weakrefset.py", loop), ("json/", "json"), ("gzip", "gzip"))
    for marker, area in areas:
        if marker in leaf:
            return area
    return "other"


def summarize_profile(raw: str, top: int = 15) -> dict[str, Any]:
    """Self and inclusive shares of frames from py-spy's raw (collapsed stack) output."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";") if f]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        areas[_area(frames)] += count
        for f in set(frames):
            if not any(marker in f for marker in _ROOT_FRAMES):
                inclusive[f] += count
    if not total:
        return {"samples": 0, "self": [], "inclusive": [], "areas": []}

    def shares(counter: Counter[str], n: int | None = top) -> list[list[Any]]:
        return [[name, round(100.0 * count / total, 1)] for name, count in counter.most_common(n)]

    return {"samples": total, "self": shares(own), "inclusive": shares(inclusive), "areas": shares(areas, None)}


def profile(h: dict[str, Any], config: Config) -> dict[str, Any]:
    """py-spy on the sidecar while the load generator drives it, per kind of request."""
    assert config.profile_dir is not None
    sidecar = h["peers"].get("sidecar")
    if sidecar is None:
        raise BenchError("--profile needs the sidecar among --peers")
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out_dir = config.profile_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"tool": "py-spy record --nonblocking --rate 250", "level": config.profile_level,
                              "duration_s": config.profile_duration_s, "modes": {}}
    for mode in config.modes:
        raw_path, svg_path = out_dir / f"sidecar-{mode}.txt", out_dir / f"sidecar-{mode}.svg"
        # the raw stacks (the numbers) first; the SVG from a second, shorter sampling below, never both at once
        spy = subprocess.Popen([pyspy, "record", "--pid", str(sidecar.pid), "--rate", "250", "--nonblocking",
                                "--format", "raw", "-o", str(raw_path),
                                "--duration", str(int(config.profile_duration_s + 2))],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(0.5)
        load = loadavg()[0]
        result = h["loadgen"].run({
            "url": sidecar.url + "/v1/chat/completions", "concurrency": config.profile_level,
            "stream": mode == "stream", "duration": config.profile_duration_s, "warmup": 0.5,
            "headers": {}, "max_tokens": TOKENS[mode], "watch": {"proxy": sidecar.pid}})
        out, _ = spy.communicate(timeout=60)
        if not raw_path.exists():
            report["modes"][mode] = {"error": "py-spy wrote nothing: " + out.decode(errors="replace")[-500:]}
            continue
        summary = summarize_profile(raw_path.read_text())
        summary.update({"load1": load, "rps": result["rps"],
                        "cpu_ms_per_req": 1000 * result["cpu_s"]["proxy"] / max(result["completed"], 1),
                        "raw": str(raw_path)})
        # the flame graph, from a second, shorter sampling of the same load
        svg = subprocess.Popen([pyspy, "record", "--pid", str(sidecar.pid), "--rate", "250", "--nonblocking",
                                "-o", str(svg_path), "--duration", "4"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
        time.sleep(0.3)
        h["loadgen"].run({"url": sidecar.url + "/v1/chat/completions", "concurrency": config.profile_level,
                          "stream": mode == "stream", "duration": 3.5, "warmup": 0.2, "headers": {},
                          "max_tokens": TOKENS[mode], "watch": {}})
        svg.communicate(timeout=60)
        if svg_path.exists():
            summary["svg"] = str(svg_path)
        report["modes"][mode] = summary
    return report


# --- report -----------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(report: dict[str, Any]) -> str:
    lines = []
    for mode in MODES:
        rows = [r for r in report["rows"] if r["mode"] == mode]
        if not rows:
            continue
        latency = "time to first chunk" if mode == "stream" else "latency"
        lines += [f"### {mode.upper()} ({TOKENS[mode]} tokens) — {latency}, medians over pairs", "",
                  "| peer | c | direct p50 ms | proxied p50 ms | added p50 ms | added p99 ms | "
                  + ("added e2e p50 ms | " if mode == "stream" else "")
                  + "throughput ratio | proxied req/s | proxy CPU ms/req | load1 | others' CPU | errors |",
                  "|---|---:|---:|---:|---:|---:|" + ("---:|" if mode == "stream" else "")
                  + "---:|---:|---:|---|---:|---:|"]
        for r in rows:
            lines.append(
                f"| {r['peer']} | {r['level']} | {_fmt(r['direct_p50_ms'])} | {_fmt(r['proxied_p50_ms'])} | "
                f"{_fmt(r['added_p50_ms'])} | {_fmt(r['added_p99_ms'])} | "
                + (f"{_fmt(r['added_e2e_p50_ms'])} | " if mode == "stream" else "")
                + f"{_fmt(r['throughput_ratio'], 2)} | {_fmt(r['proxied_rps'], 0)} | "
                f"{_fmt(r['proxy_cpu_ms_per_req'])} | {', '.join(f'{v:.2f}' for v in r['load1'])} | "
                f"{100 * r['others_cpu_share']:.0f} % | {r['errors']} |")
        lines.append("")
    published = [r for r in report["rows"] if r["peer"] in PUBLISHED or r["peer"] == "sidecar"]
    if published:
        lines += ["### Beside the published numbers (measured on these machines by others)", "",
                  "| peer | added p50, JSON c=1 (ms) | published | CPU/JSON request (ms), by level | published | "
                  "CPU/64-token stream (ms), by level | published |", "|---|---:|---:|---|---:|---|---:|"]
        for peer in ALL_PEERS:
            rows = [r for r in published if r["peer"] == peer]
            if not rows:
                continue
            c1 = next((r for r in rows if r["mode"] == "json" and r["level"] == 1), None)

            def cpu(mode: str, rows: list[dict[str, Any]] = rows) -> str:
                return ", ".join(_fmt(r["proxy_cpu_ms_per_req"]) for r in rows if r["mode"] == mode) or "-"

            pub = PUBLISHED.get(peer, {})
            lines.append(f"| {peer} | {_fmt(c1['added_p50_ms']) if c1 else '-'} | {pub.get('added_p50_c1_ms', '-')} | "
                         f"{cpu('json')} | {pub.get('cpu_json_ms', '-')} | {cpu('stream')} | "
                         f"{pub.get('cpu_stream_ms', '-')} |")
        lines.append("")
    if report.get("goals"):
        lines += ["### Goals", "", "| goal | result | met? |", "|---|---|---|"]
        lines += [f"| {g['goal']} | {g['result']} | {'yes' if g['met'] else 'NO'} |" for g in report["goals"]]
        lines.append("")
    prof = report.get("profile")
    if prof:
        for mode, p in prof["modes"].items():
            if "error" in p:
                lines += [f"profile {mode}: {p['error']}", ""]
                continue
            lines += [f"### Profile: sidecar, {mode}, c={prof['level']} ({p['samples']} samples, "
                      f"{p['rps']:.0f} req/s, {p['cpu_ms_per_req']:.3f} ms CPU/req)", "",
                      "| area (leaf frame) | share |", "|---|---:|"]
            lines += [f"| {a} | {s} % |" for a, s in p["areas"]]
            lines += ["", "| top frames, self | share | top frames, inclusive | share |", "|---|---:|---|---:|"]
            for (a, sa), (b, sb) in zip(p["self"], p["inclusive"], strict=False):
                lines.append(f"| `{a}` | {sa} % | `{b}` | {sb} % |")
            lines.append("")
    return "\n".join(lines)


def run(config: Config) -> dict[str, Any]:
    quiet = wait_for_quiet(config.max_load, config.load_wait_s)
    print(f"load average {quiet['load_at_start']} after waiting {quiet['waited_s']} s", file=sys.stderr)
    t0 = time.monotonic()
    with harness(config) as h:
        runs = run_pairs(h, config) if config.pairs else []
        telemetry = None
        if h["sink"] is not None and runs:
            # one event per request the sidecar decided (its own counter: readiness, warm-up and drain included);
            # the exporter sends a batch every second
            deadline = time.monotonic() + 15.0
            while True:
                answered, sink = _sidecar_requests(h), _sink_stats(h)
                if sink["events"] >= answered or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            telemetry = {"events_received": sink["events"], "batches": sink["batches"],
                         "sidecar_requests_answered": answered, "sink": sink}
        prof = profile(h, config) if config.profile_dir is not None else None
        versions = {name: p.info for name, p in h["peers"].items()}
    rows = summarize(runs, config)
    report = {
        "config": {"levels": config.levels, "modes": config.modes, "peers": config.peers,
                   "duration_s": config.duration_s, "warmup_s": config.warmup_s, "pairs": config.pairs,
                   "tokens": TOKENS},
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "aiohttp": _version("aiohttp"), "uvloop": _version("uvloop"), "httptools": _version("httptools")},
        "peers": versions, "quiet": quiet, "wall_s": round(time.monotonic() - t0, 1), "runs": runs, "rows": rows,
        "goals": evaluate_goals(rows), "telemetry": telemetry, "profile": prof, "published": PUBLISHED,
        "load_at_end": loadavg(),
    }
    return report


def _sink_stats(h: dict[str, Any]) -> dict[str, int]:
    with urllib.request.urlopen(h["sink"].url + "/stats", timeout=5) as resp:
        stats: dict[str, int] = json.loads(resp.read())
        return stats


def _sidecar_requests(h: dict[str, Any]) -> int:
    """The requests the sidecar and the gateway (both send their events to the sink) count as finished
    (``specgate_sidecar_requests_total``)."""
    total = 0.0
    for name in ("sidecar", "gateway"):
        if name not in h["peers"]:
            continue
        with urllib.request.urlopen(h["peers"][name].url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("specgate_sidecar_requests_total{"))
    return int(total)


def parse_args(argv: list[str] | None = None) -> tuple[Config, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,16,64", help="concurrency levels, comma-separated")
    parser.add_argument("--modes", default="json,stream", help="json, stream or both")
    parser.add_argument("--peers", default=",".join(ALL_PEERS), help=f"any of {', '.join(ALL_PEERS)}")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds of each measured window")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds of load before each window")
    parser.add_argument("--pairs", type=int, default=3, help="direct+proxied pairs per peer, level and mode")
    parser.add_argument("--max-load", type=float, default=1.5, help="wait for the 1-min load average below this")
    parser.add_argument("--load-wait", type=float, default=180.0, help="... at most this many seconds")
    parser.add_argument("--peers-dir", type=Path, default=PEERS_DIR, help="where bench/peers.sh put the venvs")
    parser.add_argument("--validate", action="store_true", help="parse every stream event (slower client)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="afterwards, profile the sidecar with py-spy; stacks and SVGs into DIR")
    parser.add_argument("--profile-level", type=int, default=16)
    parser.add_argument("--profile-duration", type=float, default=8.0)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the full report here")
    args = parser.parse_args(argv)
    config = Config(levels=[int(v) for v in args.levels.split(",") if v],
                    modes=[m for m in args.modes.split(",") if m], peers=[p for p in args.peers.split(",") if p],
                    duration_s=args.duration, warmup_s=args.warmup, pairs=args.pairs, max_load=args.max_load,
                    load_wait_s=args.load_wait, peers_dir=args.peers_dir, validate=args.validate,
                    profile_dir=args.profile, profile_level=args.profile_level,
                    profile_duration_s=args.profile_duration, log_dir=args.log_dir)
    for mode in config.modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}")
    for peer in config.peers:
        if peer not in ALL_PEERS:
            parser.error(f"unknown peer {peer!r}")
    return config, args.json


def main(argv: list[str] | None = None) -> None:
    config, out = parse_args(argv)
    report = run(config)
    print(render(report))
    if report["telemetry"]:
        t = report["telemetry"]
        print(f"telemetry: the stand-in control plane received {t['events_received']} events in {t['batches']} "
              f"batches for the {t['sidecar_requests_answered']} requests the sidecar (and gateway) answered")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"report written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
