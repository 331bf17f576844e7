"""A FAKE OpenAI-compatible, vLLM-like engine server, written for these tests.

It is not vLLM: it answers ``/v1/chat/completions`` and ``/v1/completions``
(JSON and SSE streams) with made-up tokens and a vLLM-shaped per-request
``metrics`` object (``speculative_decoding`` included on a "speculative"
instance), ``/v1/models``, and a Prometheus ``/metrics`` with
``vllm:num_requests_running``. Every other path echoes the request.

Fault injection, per instance (attributes) or per request (``x-fake-*``
headers, which the sidecar forwards untouched):

* ``tokens`` / ``x-fake-tokens`` — completion chunks to send
* ``token_delay`` / ``x-fake-token-delay`` — seconds between chunks
* ``first_byte_delay`` / ``x-fake-first-byte-delay`` — seconds before the response starts
* ``fail_status`` — answer this status (e.g. 503) instead
* ``drop_after`` — close the connection after this many content chunks (mid-stream break);
  0: streams close right after the status line and headers, JSON answers before them
* ``content`` — the completion text (split into 3-character chunks), e.g. JSON
* ``running`` — the ``vllm:num_requests_running`` to report (default: requests being served)

Helpers for connection faults: :func:`closed_port` (connection refused) and
:class:`Blackhole` (a port whose TCP connect never completes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import zlib
from typing import Any

from aiohttp import web

SPEC_METRICS = {
    "mean_acceptance_length": 2.75,
    "draft_acceptance_rate": 0.5833,
    "acceptance_histogram": [1, 2, 1, 0],
    "num_spec_steps": 4,
    "num_accepted_draft_tokens": 7,
    "num_draft_tokens": 12,
    "num_spec_tokens": 3,
}


def engine_metrics(speculative: bool) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "time_to_first_token_ms": 12.5,
        "generation_time_ms": 40.25,
        "queue_time_ms": 0.75,
        "mean_itl_ms": 3.125,
        "tokens_per_second": 123.0,
    }
    if speculative:
        metrics["speculative_decoding"] = dict(SPEC_METRICS)
    return metrics


class FakeEngine:
    def __init__(self, name: str, *, speculative: bool = False) -> None:
        self.name = name
        self.speculative = speculative
        self.port = 0
        self._runner: web.AppRunner | None = None
        self.reset()

    def reset(self) -> None:
        self.tokens = 5
        self.token_delay = 0.0
        self.first_byte_delay = 0.0
        self.fail_status: int | None = None
        self.drop_after: int | None = None
        self.content: str | None = None
        self.running: int | None = None
        self.waiting = 0
        self.health_status = 200  # what GET /health answers
        self.health_checks = 0
        self.requests: list[dict[str, Any]] = []  # path, headers, body of each API request
        self.disconnects: list[str] = []  # request ids whose client went away mid-answer
        self.last_sent: dict[str, float] = {}  # request id -> time.monotonic() of the last chunk
        self.active = 0
        self.metrics_scrapes = 0
        self.tokenize_status = 200  # what POST /tokenize answers (vLLM has it; other servers may not)
        self.tokenized: list[str] = []  # the prompts POST /tokenize was asked to count

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request_ids(self) -> list[str]:
        return [r["headers"].get("x-request-id", "") for r in self.requests]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # --- handlers ---------------------------------------------------------------

    def _chunks(self, count: int) -> list[str]:
        if self.content is not None:
            return [self.content[i:i + 3] for i in range(0, len(self.content), 3)]
        return [f"tok{i} " for i in range(count)]

    async def _sleep(self, request: web.Request, seconds: float) -> bool:
        """Sleeps; False (and records it) when the client went away meanwhile."""
        deadline = time.monotonic() + seconds
        while True:
            transport = request.transport
            if transport is None or transport.is_closing():
                self.disconnects.append(request.headers.get("X-Request-Id", ""))
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            await asyncio.sleep(min(left, 0.01))

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id", "")
        self.requests.append({"path": request.path, "query": request.rel_url.raw_query_string,
                              "headers": {k.lower(): v for k, v in request.headers.items()}, "body": body})
        self.active += 1
        try:
            return await self._answer(request, body, rid)
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request, body: dict[str, Any], rid: str) -> web.StreamResponse:
        headers = request.headers
        count = int(headers.get("x-fake-tokens", self.tokens))
        token_delay = float(headers.get("x-fake-token-delay", self.token_delay))
        first_delay = float(headers.get("x-fake-first-byte-delay", self.first_byte_delay))
        if first_delay and not await self._sleep(request, first_delay):
            return web.Response(status=499)
        if self.fail_status is not None:
            return web.json_response({"error": {"message": "injected failure", "code": self.fail_status}},
                                     status=self.fail_status)
        chat = request.path.endswith("/chat/completions")
        chunks = self._chunks(count)
        model = body.get("model", "fake-model")
        usage = {"prompt_tokens": 11, "completion_tokens": len(chunks), "total_tokens": 11 + len(chunks)}
        base = {"id": f"cmpl-{rid}", "created": int(time.time()), "model": model}
        if not body.get("stream"):
            for _ in chunks:
                if token_delay and not await self._sleep(request, token_delay):
                    return web.Response(status=499)
            text = "".join(chunks)
            choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                       "finish_reason": "stop"} if chat
                                      else {"index": 0, "text": text, "finish_reason": "stop"})
            if self.drop_after is not None:
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=499)
            answer = {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                      "usage": usage, "metrics": engine_metrics(self.speculative)}
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + json.dumps({**base, "object": kind, "choices": choices, **extra}).encode() + b"\n\n"

        try:
            await resp.prepare(request)
            if self.drop_after == 0:  # status and headers sent, not one event
                assert request.transport is not None
                request.transport.close()
                return resp
            if chat:
                await resp.write(event([{"index": 0, "delta": {"role": "assistant", "content": ""}}]))
            for i, piece in enumerate(chunks):
                if self.drop_after is not None and i >= self.drop_after:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if token_delay and i and not await self._sleep(request, token_delay):
                    return resp
                delta = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                await resp.write(event([delta]))
                self.last_sent[rid] = time.monotonic()
            final = {"index": 0, "delta": {}, "finish_reason": "stop"} if chat else \
                {"index": 0, "text": "", "finish_reason": "stop"}
            await resp.write(event([final]))
            options = body.get("stream_options") or {}
            if options.get("include_usage"):
                await resp.write(event([], usage=usage, metrics=engine_metrics(self.speculative)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            self.disconnects.append(rid)
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [{"id": "fake-model", "object": "model", "owned_by": self.name}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        running = self.active if self.running is None else self.running
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="fake-model"}} {float(running)}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="fake-model"}} {float(self.waiting)}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize`` answer shape; this fake's tokens are the prompt's whitespace-separated words
        (each word's id its CRC-32)."""
        body = await request.json()
        prompt = body.get("prompt", "")
        self.tokenized.append(prompt)
        if self.tokenize_status != 200:
            return web.json_response({"error": {"message": "no tokenizer"}}, status=self.tokenize_status)
        words = prompt.split()
        return web.json_response({"count": len(words), "max_model_len": 2048,
                                  "tokens": [zlib.crc32(word.encode()) for word in words]})

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response(status=self.health_status)

    async def _echo(self, request: web.Request) -> web.Response:
        data = await request.read()
        if request.path == "/moved":  # a redirect is the client's to follow, never the proxy's
            return web.Response(status=307, headers={"Location": "/v1/models", "X-Fake-Engine": self.name})
        return web.json_response(
            {"engine": self.name, "method": request.method, "path": request.path, "query": request.query_string,
             "body": data.decode(), "x_custom": request.headers.get("X-Custom")},
            headers={"X-Fake-Engine": self.name}, status=207 if request.path == "/status207" else 200)


def closed_port() -> int:
    """A local port nobody listens on (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Blackhole:
    """A listening port whose accept queue is full and never drained: a TCP connect to it hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.port = int(self.sock.getsockname()[1])
        self._fillers: list[socket.socket] = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", self.port))
            self._fillers.append(filler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        for filler in self._fillers:
            filler.close()
        self.sock.close()
