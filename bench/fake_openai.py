"""A FAKE, fast OpenAI-compatible upstream for the proxy benchmark (``bench/proxy.py``): not vLLM, no model.

Zero token delay, answers made of fixed made-up tokens, so that what a proxy
in front of it costs is not hidden by the upstream. A raw asyncio protocol on
uvloop with the httptools parser (HTTP/1.1 keep-alive; pipelining is not
supported, nobody here pipelines):

* ``POST /v1/chat/completions`` (and ``/v1/completions``): JSON with
  ``--tokens`` (16) tokens; with ``"stream": true`` an SSE stream of a role
  chunk, ``--stream-tokens`` (64) content chunks, a finish chunk, the usage
  chunk when ``stream_options.include_usage`` is set, and ``data: [DONE]``.
  Each event is its own chunked write, with one event-loop turn between
  events, as a token-by-token server would send them. Like vLLM with
  ``--enable-per-request-metrics``, JSON answers and the usage chunk carry a
  top-level ``metrics`` object (the sidecar strips it, the other proxies pass
  it on);
* ``GET /health`` (200, empty), ``GET /v1/models``, ``GET /metrics``
  (``vllm:num_requests_running``), anything else 404.

Run standalone: ``python -m bench.fake_openai --port 8001`` (prints ``READY PORT`` once listening).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import time
from typing import Any

import httptools

try:
    import orjson

    _dumps = orjson.dumps
    _loads = orjson.loads
except ImportError:  # pragma: no cover
    def _dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

    _loads = json.loads

MODEL = "fake-model"
METRICS = {"time_to_first_token_ms": 1.0, "generation_time_ms": 2.0, "queue_time_ms": 0.0, "mean_itl_ms": 0.0,
           "tokens_per_second": 8000.0,
           "speculative_decoding": {"mean_acceptance_length": 2.5, "draft_acceptance_rate": 0.5,
                                    "acceptance_histogram": [1, 1, 1, 1], "num_spec_steps": 6,
                                    "num_accepted_draft_tokens": 9, "num_draft_tokens": 18, "num_spec_tokens": 3}}


def _response(status: bytes, content_type: bytes, body: bytes, keep_alive: bool) -> bytes:
    return b"".join([b"HTTP/1.1 ", status, b"\r\ncontent-type: ", content_type, b"\r\ncontent-length: ",
                     b"%d" % len(body), b"\r\n", b"" if keep_alive else b"connection: close\r\n", b"\r\n", body])


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Upstream:
    """Counts what it answered; builds the answers."""

    def __init__(self, tokens: int, stream_tokens: int, token_delay: float = 0.0) -> None:
        self.tokens = tokens
        self.token_delay = token_delay
        self.stream_tokens = stream_tokens
        self.counts = {"json": 0, "stream": 0, "other": 0}
        self.running = 0
        self.seq = 0
        self.text = "".join(f"tok{i} " for i in range(tokens))

    def completion(self, body: dict[str, Any], chat: bool) -> bytes:
        self.seq += 1
        usage = {"prompt_tokens": 12, "completion_tokens": self.tokens, "total_tokens": 12 + self.tokens}
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": self.text},
                                   "logprobs": None, "finish_reason": "stop"} if chat
                                  else {"index": 0, "text": self.text, "logprobs": None, "finish_reason": "stop"})
        return _dumps({"id": f"cmpl-fake-{self.seq}", "object": "chat.completion" if chat else "text_completion",
                       "created": int(time.time()), "model": body.get("model") or MODEL, "choices": [choice],
                       "usage": usage, "metrics": METRICS})

    def events(self, body: dict[str, Any], chat: bool) -> list[bytes]:
        self.seq += 1
        head = (b'{"id":"cmpl-fake-%d","object":"%s","created":%d,"model":%s,"choices":'
                % (self.seq, b"chat.completion.chunk" if chat else b"text_completion", int(time.time()),
                   _dumps(str(body.get("model") or MODEL))))
        out = []
        if chat:
            out.append(head + b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}')
        for i in range(self.stream_tokens):
            piece = b'"tok%d "' % i
            out.append(head + (b'[{"index":0,"delta":{"content":%s},"finish_reason":null}]}' % piece if chat
                               else b'[{"index":0,"text":%s,"finish_reason":null}]}' % piece))
        out.append(head + (b'[{"index":0,"delta":{},"finish_reason":"stop"}]}' if chat
                           else b'[{"index":0,"text":"","finish_reason":"stop"}]}'))
        options = body.get("stream_options")
        if type(options) is dict and options.get("include_usage"):
            usage = {"prompt_tokens": 12, "completion_tokens": self.stream_tokens,
                     "total_tokens": 12 + self.stream_tokens}
            out.append(head + b"[]," + _dumps({"usage": usage, "metrics": METRICS})[1:])
        events = [b"data: " + e + b"\n\n" for e in out]
        events.append(b"data: [DONE]\n\n")
        return events

    def models(self) -> bytes:
        return _dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                   "owned_by": "fake"}]})

    def prometheus(self) -> bytes:
        return (b"# TYPE vllm:num_requests_running gauge\n"
                b'vllm:num_requests_running{model_name="%s"} %d\n' % (MODEL.encode(), self.running))


class _Conn(asyncio.Protocol):
    __slots__ = ("up", "transport", "parser", "url", "body", "closed")

    def __init__(self, up: Upstream) -> None:
        self.up = up
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(_response(b"400 Bad Request", b"text/plain", b"bad request", False))
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        keep_alive = self.parser.should_keep_alive()
        path = self.url.split(b"?", 1)[0]
        body = b"".join(self.body)
        assert self.transport is not None
        up = self.up
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            try:
                data = _loads(body) if body else {}
            except ValueError:
                data = None
            if type(data) is not dict:
                self.transport.write(_response(b"400 Bad Request", b"application/json",
                                               b'{"error":{"message":"body is not a JSON object"}}', keep_alive))
                return
            chat = path == b"/v1/chat/completions"
            if data.get("stream"):
                up.counts["stream"] += 1
                events = up.events(data, chat)
                # the status line, headers and first event go out at once; the rest from a task
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                                     b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n"
                                     + (b"" if keep_alive else b"connection: close\r\n") + b"\r\n"
                                     + _chunk(events[0]))
                up.running += 1
                asyncio.get_running_loop().create_task(self._stream(events[1:], keep_alive))
                return
            up.counts["json"] += 1
            self.transport.write(_response(b"200 OK", b"application/json", up.completion(data, chat), keep_alive))
        elif method == b"GET" and path == b"/health":
            up.counts["other"] += 1
            self.transport.write(_response(b"200 OK", b"text/plain", b"", keep_alive))
        elif method == b"GET" and path == b"/v1/models":
            up.counts["other"] += 1
            self.transport.write(_response(b"200 OK", b"application/json", up.models(), keep_alive))
        elif method == b"GET" and path == b"/metrics":
            self.transport.write(_response(b"200 OK", b"text/plain; version=0.0.4", up.prometheus(), keep_alive))
        else:
            up.counts["other"] += 1
            self.transport.write(_response(b"404 Not Found", b"application/json",
                                           b'{"error":{"message":"not found"}}', keep_alive))
        if not keep_alive:
            self.transport.close()

    async def _stream(self, events: list[bytes], keep_alive: bool) -> None:
        transport = self.transport
        assert transport is not None
        try:
            for event in events:
                # one loop turn before each event (a separate send per token), or the configured delay
                await asyncio.sleep(self.up.token_delay)
                if self.closed:
                    return
                transport.write(_chunk(event))
            transport.write(b"0\r\n\r\n")
            if not keep_alive:
                transport.close()
        finally:
            self.up.running -= 1


async def serve(host: str, port: int, tokens: int, stream_tokens: int, token_delay: float = 0.0) -> None:
    up = Upstream(tokens, stream_tokens, token_delay)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(up), host, port, backlog=1024, reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    print(json.dumps({"counts": up.counts}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed as READY PORT)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens of a JSON answer")
    parser.add_argument("--stream-tokens", type=int, default=64, help="content chunks of a stream")
    parser.add_argument("--token-delay-ms", type=float, default=0.0, help="between stream events (default 0)")
    args = parser.parse_args(argv)
    serving = serve(args.host, args.port, args.tokens, args.stream_tokens, args.token_delay_ms / 1000.0)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(serving)
    else:
        uvloop.run(serving)


if __name__ == "__main__":
    main()
