"""What one client may hold of the sidecar's HTTP server (sidecar/server.py): header bytes and lines, the time
to send a request, the bytes read ahead of the request being answered, and bodies over the limit.

Each test speaks raw bytes over a real socket, as a hostile client would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import pytest

from sidecar.server import HttpServer, ServerLimits
from sidecar.settings import SidecarSettings

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Recorder:
    """Answers each request with its path and body size, and remembers the paths it ran for."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.gated = False  # then requests to /slow wait for ``gate``
        self.gate = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.paths.append(scope["path"])
        body = (await receive())["body"]
        if scope["path"] == "/slow" and self.gated:
            await self.gate.wait()
        answer = b'{"path": "%s", "size": %d}' % (scope["path"].encode(), len(body))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})


async def started(app: Any, **limits: Any) -> HttpServer:
    server = HttpServer(app, limits=ServerLimits(**limits))
    await server.start("127.0.0.1", 0)
    return server


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name:
            headers[name.lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get(b"content-length", b"0"))), 5)
    return int(lines[0].split()[1]), headers, body


async def refused(reader: asyncio.StreamReader, status: int) -> dict[str, Any]:
    """The response is a problem with ``status``, and the server closes the connection after it."""
    got, headers, body = await read_response(reader)
    assert got == status, body
    assert headers[b"content-type"] == b"application/problem+json"
    assert headers[b"connection"] == b"close"
    problem: dict[str, Any] = json.loads(body)
    assert problem["status"] == status
    assert await asyncio.wait_for(reader.read(), 5) == b""
    return problem


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


def test_a_huge_header_block_is_431_before_it_is_all_read() -> None:
    app = Recorder()

    async def scenario() -> None:
        server = await started(app, max_header_bytes=8192)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /huge HTTP/1.1\r\nhost: x\r\nx-filler: ")
        for _ in range(8):  # 512 KiB of one header that never ends: refused while it still arrives
            writer.write(b"a" * 65536)
            await writer.drain()
            await asyncio.sleep(0.02)
        problem = await refused(reader, 431)
        assert problem["title"] == "Request header fields too large"
        assert "8192 bytes" in problem["detail"]
        assert app.paths == []
        await server.shutdown(1)

    run(scenario())


def test_a_complete_head_over_the_limit_is_431_naming_its_largest_header_and_one_under_it_is_served() -> None:
    app = Recorder()

    async def scenario() -> None:
        server = await started(app, max_header_bytes=4096)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /fits HTTP/1.1\r\nhost: x\r\nx-specgate-labels: " + b"a" * 3900 + b"\r\n\r\n")
        status, _, _ = await read_response(reader)
        assert status == 200
        writer.write(b"GET /over HTTP/1.1\r\nhost: x\r\nx-specgate-labels: " + b"a" * 4100 + b"\r\n\r\n")
        problem = await refused(reader, 431)
        assert "4096 bytes" in problem["detail"]
        assert "'x-specgate-labels'" in problem["detail"]
        assert app.paths == ["/fits"]
        await server.shutdown(1)

    run(scenario())


def test_a_head_over_the_limit_is_431_when_it_comes_in_reads_each_under_the_limit() -> None:
    app = Recorder()

    async def scenario() -> None:
        server = await started(app, max_header_bytes=4096)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        for n in range(3):  # three headers of 1800 bytes, one read each
            writer.write(b"GET / HTTP/1.1\r\n" if n == 0 else b"")
            writer.write(b"x-part-%d: %s\r\n" % (n, b"a" * 1800))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"\r\n")
        problem = await refused(reader, 431)
        assert "4096 bytes" in problem["detail"]
        assert app.paths == []
        await server.shutdown(1)

    run(scenario())


def test_too_many_header_lines_is_431() -> None:
    app = Recorder()

    async def scenario() -> None:
        server = await started(app, max_header_count=16)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\n" + b"".join(b"x-%d: 1\r\n" % n for n in range(17)) + b"\r\n")
        problem = await refused(reader, 431)
        assert "more than 16 header lines" in problem["detail"]
        assert app.paths == []
        await server.shutdown(1)

    run(scenario())


def test_a_head_fed_a_line_at_a_time_is_408_at_its_deadline_though_every_byte_resets_the_idle_timer() -> None:
    app = Recorder()

    async def scenario() -> None:
        server = await started(app, header_timeout_s=0.4)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\n")

        async def feed() -> None:
            for n in range(100):  # 10 s, well under the keep-alive timeout between two lines
                writer.write(b"x-%d: 1\r\n" % n)
                await asyncio.sleep(0.1)

        feeding = asyncio.ensure_future(feed())
        started_at = asyncio.get_running_loop().time()
        problem = await refused(reader, 408)
        assert asyncio.get_running_loop().time() - started_at < 3
        assert problem["detail"] == "the request's header block did not arrive within 0.4 s"
        feeding.cancel()
        assert app.paths == []
        await server.shutdown(1)

    run(scenario())


def test_a_body_fed_a_byte_at_a_time_is_408_at_its_deadline() -> None:
    app = Recorder()

    async def scenario() -> None:
        server = await started(app, body_timeout_s=0.4)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")

        async def feed() -> None:
            for _ in range(100):
                writer.write(b"a")
                await asyncio.sleep(0.1)

        feeding = asyncio.ensure_future(feed())
        problem = await refused(reader, 408)
        assert problem["detail"] == "the request's body did not arrive within 0.4 s"
        feeding.cancel()
        assert app.paths == []
        await server.shutdown(1)

    run(scenario())


def test_pipelined_bodies_stop_being_read_past_the_buffer_cap_and_are_all_answered_later() -> None:
    app = Recorder()
    app.gated = True
    body = b"b" * (256 * 1024)
    count = 12  # 3 MiB behind the request being answered

    async def scenario() -> None:
        server = await started(app, max_buffered_bytes=64 * 1024)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        for n in range(count):
            writer.write(b"POST /%d HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (n, len(body), body))
        await asyncio.sleep(0.5)
        (conn,) = server.connections
        assert conn.read_paused
        # what it holds ahead of /slow: the cap, overshot by at most the last read and one body
        assert conn.pending_bytes + conn.size < 64 * 1024 + 256 * 1024 + len(body)
        app.gate.set()
        answers = [json.loads((await read_response(reader))[2]) for _ in range(count + 1)]
        assert [a["path"] for a in answers] == ["/slow"] + [f"/{n}" for n in range(count)]
        assert {a["size"] for a in answers[1:]} == {len(body)}
        writer.close()
        await server.shutdown(1)

    run(scenario())


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_as_soon_as_it_passes_the_limit(framing: str) -> None:
    app = Recorder()

    async def scenario() -> None:
        server = HttpServer(app, max_body_bytes=1000)
        await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        if framing == "content-length":
            writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n" + b"a" * 600)
        else:  # more than the limit, and the body has not ended: the answer must not wait for its end
            writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                         + b"258\r\n" + b"a" * 600 + b"\r\n" + b"258\r\n" + b"a" * 600 + b"\r\n")
        problem = await refused(reader, 413)
        assert (problem["title"], problem["detail"]) == (
            "Request body too large", "the request body exceeds 1000 bytes")
        assert app.paths == []
        writer.close()
        await server.shutdown(1)

    run(scenario())


def test_a_refused_pipelined_request_is_answered_after_the_answers_before_it() -> None:
    app = Recorder()
    app.gated = True

    async def scenario() -> None:
        server = HttpServer(app, max_body_bytes=1000)
        await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"
                     b"POST /next HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nok"
                     b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n")
        await asyncio.sleep(0.2)
        app.gate.set()
        first = await read_response(reader)
        second = await read_response(reader)
        assert [json.loads(first[2])["path"], json.loads(second[2])["path"]] == ["/slow", "/next"]
        await refused(reader, 413)
        assert app.paths == ["/slow", "/next"]
        await server.shutdown(1)

    run(scenario())


def test_the_limits_come_from_the_sidecar_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECGATE_MAX_HEADER_BYTES", "32768")
    monkeypatch.setenv("SPECGATE_HEADER_TIMEOUT_S", "3")
    limits = ServerLimits.from_settings(SidecarSettings())
    assert (limits.max_header_bytes, limits.header_timeout_s) == (32768, 3.0)
    assert (limits.max_header_count, limits.body_timeout_s, limits.max_buffered_bytes) == (
        ServerLimits().max_header_count, ServerLimits().body_timeout_s, ServerLimits().max_buffered_bytes)
