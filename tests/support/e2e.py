"""The end-to-end stack: real vLLM engines, a control plane and sidecar processes, requests and answers."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from controlplane.auth.schemas import Scope
from controlplane.auth.service import create_key
from controlplane.models import TelemetryEventRecord
from policies import SigningKey
from testbed import corpus, engines
from testbed.models import ensure
from testbed.recipe import RECIPE
from tests.support import paths
from tests.support.fleet_rows import session_for
from tests.support.live import free_port

ROOT = paths.ROOT


SEED_POLICY = (ROOT / "policies" / "examples" / "seed.yaml").read_text()


VARIANTS = ("base", "draft")
# Engine instances started only by the tests that need them (replica pools): a second plain replica.
REPLICAS = ("base-2",)


# Away from the testbed's default (8100) and from other suites; moved up when taken.
BASE_PORT = int(os.environ.get("SPECGATE_E2E_BASE_PORT", "18300"))


ENGINE_START_TIMEOUT_S = 600.0


MODEL = engines.MODEL_NAME


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; an AssertionError naming ``what`` after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not reached within {timeout:.0f} s")
        time.sleep(interval)
    return time.monotonic() - t0


def prom_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` (exact name, any labels) in Prometheus text, with its labels."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            end = rest.rindex("}")
            for part in _split_labels(rest[1:end]):
                key, _, value = part.partition("=")
                labels[key.strip()] = json.loads(value)
            rest = rest[end + 1:]
        elif not rest.startswith(" "):
            continue  # another metric with this prefix
        out.append((labels, float(rest.split()[0])))
    return out


def _split_labels(text: str) -> list[str]:
    parts, current, quoted, escaped = [], "", False, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            parts.append(current)
            current = ""
            continue
        current += ch
    if current.strip():
        parts.append(current)
    return parts


def prom_sum(text: str, name: str, **labels: str) -> float:
    return sum(v for ls, v in prom_samples(text, name) if all(ls.get(k) == want for k, want in labels.items()))


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


class EngineSetupError(RuntimeError):
    pass


class Fleet:
    """This session's engines (see the module docs)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.base_port = engines.free_base_port((*VARIANTS, *REPLICAS), BASE_PORT)
        self.urls = {name: f"http://127.0.0.1:{port}"
                     for name, port in engines.ports_for((*VARIANTS, *REPLICAS), self.base_port).items()}
        self.setup_s: float | None = None
        self.starts: list[tuple[str, float]] = []  # (names, seconds) of every start

    def log_tails(self, lines: int = 40) -> str:
        out = []
        for name in self.urls:
            log = self.state_dir / f"{name}.log"
            if log.exists():
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
                out.append(f"--- {log} (last {lines} lines)\n{tail}")
        return "\n".join(out)

    def up(self, names: Sequence[str] = VARIANTS) -> None:
        """Start ``names`` (those not already running) and wait for their health; raise with the log tails."""
        t0 = time.monotonic()
        try:
            testbed = ensure(quiet=True)
            if self.setup_s is None:
                self.setup_s = time.monotonic() - t0
            urls = engines.start(names, self.base_port, state_dir=self.state_dir, testbed=testbed,
                                 timeout_s=ENGINE_START_TIMEOUT_S)
        except Exception as exc:
            raise EngineSetupError(f"the vLLM engines {list(names)} could not be set up: {exc}\n"
                                   f"{self.log_tails()}") from exc
        assert all(urls[n] == self.urls[n] for n in names), (urls, self.urls)
        self.starts.append((",".join(names), round(time.monotonic() - t0, 1)))

    def healthy(self, name: str) -> bool:
        try:
            return httpx.get(self.urls[name] + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def require(self, names: Sequence[str] = VARIANTS) -> None:
        """Every engine of ``names`` up: the ones a test killed (or that died) are started again."""
        dead = [name for name in names if not self.healthy(name)]
        if dead:
            engines.stop(dead, state_dir=self.state_dir)  # forget (and stop, if half alive) what is there
            self.up(dead)

    def kill(self, name: str) -> float:
        """SIGKILL the engine's whole process group (server, engine core, worker): a crash, not a shutdown.
        Returns the wall-clock time of the kill."""
        record = engines.StateFile(self.state_dir).read()[name]
        assert engines.is_alive(record)
        os.killpg(record.pid, signal.SIGKILL)
        killed = time.time()
        wait_until(lambda: not _listening(record.port), 30, f"engine {name} gone")
        with contextlib.suppress(ChildProcessError):
            os.waitpid(record.pid, 0)  # our child (engines.start ran here): reap it
        engines.stop([name], state_dir=self.state_dir)  # drops the record; nothing is alive to signal
        return killed

    def metrics(self, name: str) -> str:
        return httpx.get(self.urls[name] + "/metrics", timeout=10).text

    def stop(self) -> None:
        engines.stop(state_dir=self.state_dir)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class ControlPlaneProcess:
    """``specgate serve`` in a subprocess on a fixed port (its own interpreter, as deployed), so that a test
    can stop it and start it again; keys made in its database, one bundle signing key across restarts."""

    def __init__(self, database_url: str, directory: Path) -> None:
        self.database_url = database_url
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = directory / "control-plane.log"
        with session_for(database_url) as session:
            # The sidecars of these runs register into pool "default" (issue 16: worker keys are bound).
            _, self.worker_token = create_key(session, name="sidecar", scope=Scope.worker, created_by="e2e",
                                              pool="default")
            _, self.admin_token = create_key(session, name="admin", scope=Scope.admin, created_by="e2e")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECGATE_", "OTEL_"))}
        self.env.update({"SPECGATE_DATABASE_URL": database_url,
                         "SPECGATE_SIGNING_KEY": SigningKey.generate().private_key_b64(),
                         "SPECGATE_SSE_KEEPALIVE_S": "5", "SPECGATE_GUARDRAIL_INTERVAL_S": "0",
                         "PYTHONUNBUFFERED": "1"})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specgate", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 "--no-migrate"], cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)

        def up() -> bool:
            assert self.proc is not None
            assert self.proc.poll() is None, f"the control plane exited:\n{self.log_tail()}"
            try:
                return httpx.get(self.base + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(up, 60, "control plane up")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from exc

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM: a graceful stop (open long-polls and change streams are cut after ``specgate serve``'s own
        5 s bound); SIGKILL after ``grace_s``."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"


class SidecarProcess:
    """``specgate sidecar`` in a subprocess, its log in a file."""

    def __init__(self, cp: ControlPlaneProcess, engine_urls: Mapping[str, str | Sequence[str]], directory: Path,
                 worker_id: str, *, kind: str = "worker", log_name: str = "sidecar.log") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_id = worker_id
        self.log = directory / log_name
        self.args = [sys.executable, "-m", "specgate", "sidecar", "--control-plane", cp.base,
                     "--key", cp.worker_token, "--listen", f"127.0.0.1:{self.port}", "--kind", kind,
                     "--state-dir", str(directory / f"state-{worker_id}"), "--worker-id", worker_id,
                     "--pool", "default",
                     *[arg for name, urls in engine_urls.items()
                       for arg in ("--engine", f"{name}={urls if isinstance(urls, str) else ','.join(urls)}")]]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECGATE_", "OTEL_"))}
        self.env.update({"SPECGATE_EXPOSE_ENGINE_METRICS": "true", "SPECGATE_TELEMETRY_FLUSH_S": "0.2",
                         "SPECGATE_HEARTBEAT_S": "1", "PYTHONUNBUFFERED": "1"})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def ready() -> bool:
            assert self.proc is not None
            assert self.proc.poll() is None, f"the sidecar exited:\n{self.log_tail()}"
            try:
                return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(ready, 60, "sidecar ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from exc

    def stop(self) -> str:
        """SIGTERM (graceful: requests finish, telemetry is flushed or spooled); returns the log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.log.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def swaps(self) -> list[tuple[float, str]]:
        """(wall time, summary) of every policy swap the sidecar logged, from its own clock."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if "policy bundle updated: " in line:
                stamp = dt.datetime.strptime(line[:23], LOG_TIME)  # the logging module's local time
                out.append((stamp.timestamp(), line.split("policy bundle updated: ", 1)[1]))
        return out


PROMPT_SEED = int(RECIPE["seed"])


_PROMPTS: dict[str, list[str]] = {}


def prompt(route: str, index: int) -> str:
    """Held-out prompts in the trained language (the corpus' own generator), cycled."""
    if route not in _PROMPTS:
        _PROMPTS[route] = [ex.prompt for ex in corpus.requests(route, 64, PROMPT_SEED)]
    prompts = _PROMPTS[route]
    return prompts[index % len(prompts)]


EXTRACT_SCHEMA = {"type": "object", "properties": {k: {"type": "string"} for k in corpus.TEMPLATE_FIELDS},
                  "required": list(corpus.TEMPLATE_FIELDS)}


@dataclass
class Ask:
    route: str
    index: int = 0
    stream: bool = False
    structured: bool = False
    max_tokens: int = 24

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": self.max_tokens, "temperature": 0.0,
                                "messages": [{"role": "user", "content": prompt(self.route, self.index)}]}
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if self.structured:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "record", "schema": EXTRACT_SCHEMA}}
        return body


@dataclass
class Answer:
    ask: Ask
    request_id: str
    sent_at: float  # wall clock
    done_at: float = 0.0
    status: int | None = None
    error: str | None = None
    decision: dict[str, str] = field(default_factory=dict)
    fallback: str | None = None
    text: str = ""
    usage: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None  # the engine's per-request metrics, as it sent them
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def spec(self) -> dict[str, Any] | None:
        return (self.metrics or {}).get("speculative_decoding")


def parse_decision(value: str | None) -> dict[str, str]:
    out = {}
    for part in (value or "").split(";"):
        key, sep, val = part.strip().partition("=")
        if sep:
            out[key] = val
    return out


_COUNTER = iter(range(10**9))


_COUNTER_LOCK = threading.Lock()


def new_request_id(tag: str) -> str:
    with _COUNTER_LOCK:
        n = next(_COUNTER)
    return f"e2e-{tag}-{os.getpid()}-{n}-{os.urandom(3).hex()}"


def send(client: httpx.Client, url: str, ask: Ask, tag: str = "r", request_id: str | None = None) -> Answer:
    answer = Answer(ask, request_id or new_request_id(tag), time.time())
    headers = {"X-Request-Id": answer.request_id, "X-Specgate-Route": ask.route}
    try:
        if ask.stream:
            with client.stream("POST", url + "/v1/chat/completions", json=ask.body(), headers=headers) as resp:
                _read_headers(answer, resp)
                parts = []
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        answer.error = json.dumps(chunk["error"])
                    for choice in chunk.get("choices") or []:
                        parts.append((choice.get("delta") or {}).get("content") or "")
                        answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
                    if chunk.get("usage"):
                        answer.usage = chunk["usage"]
                    if chunk.get("metrics"):
                        answer.metrics = chunk["metrics"]
                answer.text = "".join(parts)
        else:
            resp = client.post(url + "/v1/chat/completions", json=ask.body(), headers=headers)
            _read_headers(answer, resp)
            if resp.status_code == 200:
                data = resp.json()
                answer.text = data["choices"][0]["message"]["content"] or ""
                answer.finish_reason = data["choices"][0].get("finish_reason")
                answer.usage = data.get("usage")
                answer.metrics = data.get("metrics")
            else:
                answer.error = resp.text[:500]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.done_at = time.time()
    return answer


def _read_headers(answer: Answer, resp: httpx.Response) -> None:
    answer.status = resp.status_code
    answer.decision = parse_decision(resp.headers.get("x-specgate-decision"))
    answer.fallback = resp.headers.get("x-specgate-fallback")
    assert resp.headers.get("x-request-id") == answer.request_id


class Load:
    """Closed-loop load: ``workers`` threads, each sending ``next_ask(i)`` and waiting for the whole answer
    (then ``pause_s``), until ``stop()`` (or ``per_worker`` requests each)."""

    def __init__(self, url: str, workers: int, next_ask: Callable[[int], Ask], *, per_worker: int | None = None,
                 tag: str = "load", pause_s: float = 0.0) -> None:
        self.url = url
        self.pause_s = pause_s
        self.next_ask = next_ask
        self.per_worker = per_worker
        self.tag = tag
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._count = iter(range(10**9))
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"load-{i}") for i in range(workers)]
        self._barrier = threading.Barrier(workers)  # the workers' first requests leave together

    def _work(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(180, connect=10)) as client:
            self._barrier.wait(60)
            done = 0
            while not self._stop.is_set() and (self.per_worker is None or done < self.per_worker):
                with self._lock:
                    i = next(self._count)
                answer = send(client, self.url, self.next_ask(i), self.tag)
                with self._lock:
                    self.answers.append(answer)
                done += 1
                if self.pause_s:
                    self._stop.wait(self.pause_s)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def count(self) -> int:
        with self._lock:
            return len(self.answers)

    def wait_for(self, n: int, timeout: float = 120) -> None:
        wait_until(lambda: self.count() >= n, timeout, f"{n} answers")

    def wait_for_sent_after(self, t: float, n: int, timeout: float = 120) -> None:
        """Until ``n`` requests sent after wall-clock time ``t`` were answered."""
        def enough() -> bool:
            with self._lock:
                return sum(1 for a in self.answers if a.sent_at > t) >= n

        wait_until(enough, timeout, f"{n} answers to requests sent after {t:.3f}")

    def join(self, timeout: float = 300) -> list[Answer]:
        for thread in self._threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a load worker hung"
        return self.answers

    def stop(self) -> list[Answer]:
        self._stop.set()
        return self.join()


def telemetry(database_url: str) -> list[dict[str, Any]]:
    columns = [c.key for c in TelemetryEventRecord.__table__.columns]
    with session_for(database_url) as session:
        rows = session.scalars(select(TelemetryEventRecord)).all()
        return [{c: getattr(row, c) for c in columns} for row in rows]


@dataclass
class Stack:
    database_url: str
    cp: ControlPlaneProcess
    sidecar: SidecarProcess
    fleet: Fleet
    revisions: list[str]  # in order; the last is active

    def rows_by_request(self, expected: int, timeout: float = 60) -> dict[str, dict[str, Any]]:
        """Waits until ``expected`` events are stored (and no more arrive for a moment); request id -> row."""
        wait_until(lambda: len(telemetry(self.database_url)) >= expected, timeout,
                   f"{expected} telemetry events in SQL", interval=0.25)
        time.sleep(0.6)  # three flush intervals: a duplicate or a stray event would show now
        rows = telemetry(self.database_url)
        by_id: dict[str, dict[str, Any]] = {}
        for row in rows:
            assert row["request_id"] not in by_id, f"request {row['request_id']} stored twice"
            by_id[row["request_id"]] = row
        assert len(rows) == expected, f"{len(rows)} events stored, {expected} requests made"
        return by_id


StackFactory = Callable[..., Stack]


StackBuilder = Callable[..., Stack]
