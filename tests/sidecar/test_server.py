"""The sidecar's HTTP server (sidecar/server.py), spoken to byte by byte over real sockets.

The apps here are small ASGI apps written for each test; the sidecar's own app
runs on this server in every other sidecar test (tests/sidecar/conftest.py).
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sidecar.server import HttpServer

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with what it got: method, path, query, body and one header."""
    message = await receive()
    headers = dict(scope["headers"])
    answer = json.dumps({"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
                         "body": message["body"].decode(), "x": headers.get(b"x-test", b"").decode()}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


async def started(app: Any, **options: Any) -> HttpServer:
    server = HttpServer(app, **options)
    await server.start("127.0.0.1", 0)
    return server


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One HTTP/1.1 response, content-length or chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            headers[name.lower()] = value.strip()
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            body += (await reader.readexactly(size + 2))[:-2]
            if not size:
                return status, headers, body
    return status, headers, b""


def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async def scenario() -> None:
        server = await started(echo)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /a%20b?q=1 HTTP/1.1\r\nhost: x\r\nx-test: one\r\ncontent-length: 3\r\n\r\nabc"
                     b"GET /second HTTP/1.1\r\nhost: x\r\nx-test: two\r\n\r\n"
                     b"POST /third HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
        answers = [await read_response(reader) for _ in range(3)]
        assert [json.loads(body) for _, _, body in answers] == [
            {"method": "POST", "path": "/a b", "query": "q=1", "body": "abc", "x": "one"},
            {"method": "GET", "path": "/second", "query": "", "body": "", "x": "two"},
            {"method": "POST", "path": "/third", "query": "", "body": "hi", "x": ""},
        ]
        assert all(status == 200 and b"date" in headers and b"connection" not in headers
                   for status, headers, _ in answers)
        writer.close()
        await server.shutdown(1)

    run(scenario())


def test_an_answer_without_length_is_chunked_and_head_gets_no_body() -> None:
    async def streaming(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for part in (b"one ", b"", b"two"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def scenario() -> None:
        server = await started(streaming)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert (status, headers[b"transfer-encoding"], body) == (200, b"chunked", b"one two")
        writer.write(b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"transfer-encoding" not in head.lower()
        status, _, body = await read_response(reader)  # the next answer follows at once: HEAD's had no body
        assert (status, body) == (200, b"one two")
        writer.close()
        await server.shutdown(1)

    run(scenario())


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_problem_json_and_the_app_never_runs(framing: str) -> None:
    calls: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        calls.append(scope["path"])
        await echo(scope, receive, send)

    async def scenario() -> None:
        server = await started(app, max_body_bytes=10)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        if framing == "content-length":
            writer.write(b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: 11\r\n\r\n01234567890")
        else:
            writer.write(b"POST /big HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"6\r\n012345\r\n6\r\n678901\r\n0\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert status == 413
        assert headers[b"content-type"] == b"application/problem+json"
        problem = json.loads(body)
        assert (problem["status"], problem["title"]) == (413, "Request body too large")
        assert "10 bytes" in problem["detail"]
        assert await reader.read() == b""  # closed
        assert calls == []
        await server.shutdown(1)

    run(scenario())


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def scenario() -> None:
        server = await started(echo)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        status, _, body = await read_response(reader)
        assert (status, json.loads(body)["body"]) == (200, "ok")
        writer.close()
        await server.shutdown(1)

    run(scenario())


@pytest.mark.parametrize("request_bytes", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
], ids=["garbage", "upgrade"])
def test_what_it_cannot_serve_is_400_problem_json_then_closed(request_bytes: bytes) -> None:
    async def scenario() -> None:
        server = await started(echo)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes)
        status, headers, body = await read_response(reader)
        assert status == 400
        assert headers[b"content-type"] == b"application/problem+json"
        assert json.loads(body)["title"] == "Bad request"
        assert await reader.read() == b""
        await server.shutdown(1)

    run(scenario())


def test_an_app_that_fails_gets_500_problem_json_and_one_that_answers_nothing_closes_the_connection() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/fail":
            raise RuntimeError("boom")
        if scope["path"] == "/half":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})

    async def scenario() -> None:
        server = await started(app)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /fail HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 500
        assert json.loads(body)["title"] == "Internal error"
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /half HTTP/1.1\r\nhost: x\r\n\r\n")
        rest = await asyncio.wait_for(reader.read(), 2)  # ends: no terminating chunk, so the client sees a break
        assert rest.endswith(b"4\r\npart\r\n")
        await server.shutdown(1)

    run(scenario())


def test_a_client_that_goes_away_is_reported_by_callback_and_by_receive() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        scope["extensions"]["specgate.disconnect"].on_disconnect = lambda: seen.append("callback")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        message = await receive()  # waits until the client is gone
        seen.append(message["type"])

    async def scenario() -> None:
        server = await started(app)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await reader.readuntil(b"first\r\n")
        writer.close()
        for _ in range(100):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.02)
        assert seen == ["callback", "http.disconnect"]
        await server.shutdown(1)

    run(scenario())


def test_a_finished_request_leaves_no_garbage_holding_its_body() -> None:
    # Each request's cycle was its scope's disconnect extension: a reference cycle, so a body parsed into
    # many objects reached the oldest GC generation and stayed (1 MB requests grew a sidecar 1.1 MiB each).
    size = 200_000

    class Watch:  # as the sidecar's proxy watches a request: a callback that holds the scope
        def __init__(self, scope: Scope) -> None:
            self.scope = scope
            self.hook = scope["extensions"]["specgate.disconnect"]
            self.hook.on_disconnect = self.lost

        def lost(self) -> None:
            raise AssertionError("the client stayed")

        def done(self) -> None:
            self.hook.on_disconnect = None

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        watch = Watch(scope)
        message = await receive()
        answer = b"%d" % len(message["body"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})
        watch.done()

    async def scenario() -> list[Any]:
        server = await started(app, max_body_bytes=4 * size)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(5):
                writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size + b"x" * size)
                assert (await read_response(reader))[2] == b"%d" % size
            gc.collect()  # what only the collector would have freed
            left = list(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        writer.close()
        await server.shutdown(1)
        return left

    left = run(scenario())
    assert [type(o).__name__ for o in left if type(o).__module__ == "sidecar.server"] == []
    assert [len(o) for o in left if isinstance(o, bytes) and len(o) >= size] == []


def test_a_slow_reader_makes_the_app_wait_instead_of_buffering_everything() -> None:
    piece = b"x" * 65536
    total = 256  # 16 MiB
    sent: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for n in range(total):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            sent.append(n)
        await send({"type": "http.response.body", "body": b""})

    async def scenario() -> None:
        server = await started(app)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, limit=1 << 16)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.3)  # not reading
        assert len(sent) < total // 2
        _, _, body = await read_response_body_chunked(reader)
        assert len(body) == total * len(piece)
        assert len(sent) == total
        writer.close()
        await server.shutdown(1)

    run(scenario())


async def read_response_body_chunked(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        parts.append((await reader.readexactly(size + 2))[:-2])
        if not size:
            return 200, {}, b"".join(parts)


def test_shutdown_lets_requests_in_flight_finish_and_refuses_new_ones() -> None:
    release = asyncio.Event()
    events: list[str] = []

    class App:
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            await receive()
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
            await send({"type": "http.response.body", "body": b"done"})

        async def startup(self) -> None:
            events.append("startup")

        async def shutdown(self) -> None:
            events.append("shutdown")

    async def scenario() -> None:
        server = await started(App())
        port = server.port
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(server.shutdown(5))
        await asyncio.sleep(0.1)
        assert await asyncio.wait_for(idle_reader.read(), 1) == b""  # an idle keep-alive connection is closed
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        assert not stopping.done()
        release.set()
        status, _, body = await read_response(reader)
        assert (status, body) == (200, b"done")
        await asyncio.wait_for(stopping, 2)
        assert events == ["startup", "shutdown"]
        idle_writer.close()
        writer.close()

    run(scenario())


def test_shutdown_cancels_what_outlives_its_timeout_with_a_503() -> None:
    cancelled: list[bool] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario() -> None:
        server = await started(app)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        await asyncio.wait_for(server.shutdown(0.2), 3)
        assert cancelled == [True]
        status, headers, body = await read_response(reader)
        assert (status, headers[b"content-type"], json.loads(body)["title"]) == (
            503, b"application/problem+json", "Shutting down")
        assert await asyncio.wait_for(reader.read(), 1) == b""
        writer.close()

    run(scenario())


def test_idle_and_stalled_connections_close_after_the_keep_alive_timeout() -> None:
    async def scenario() -> None:
        server = await started(echo, keepalive_s=0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await read_response(reader)
        assert await asyncio.wait_for(reader.read(), 3) == b""
        writer.close()
        # a request that stops half-way is closed the same way, with nothing sent back
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
        assert await asyncio.wait_for(reader.read(), 3) == b""
        writer.close()
        await server.shutdown(1)

    run(scenario())


def test_http_1_0_and_connection_close_end_the_connection_after_the_answer() -> None:
    async def scenario() -> None:
        server = await started(echo)
        for request in (b"GET / HTTP/1.0\r\n\r\n", b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(request)
            status, headers, _ = await read_response(reader)
            assert (status, headers[b"connection"]) == (200, b"close")
            assert await asyncio.wait_for(reader.read(), 1) == b""
            writer.close()
        await server.shutdown(1)

    run(scenario())
