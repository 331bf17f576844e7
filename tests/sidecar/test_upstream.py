"""The sidecar's engine client (sidecar/upstream.py) against raw TCP servers written here, byte for byte.

A FAKE server per test (a plain asyncio server that writes exactly the bytes a
test wants), so that keep-alive, chunked bodies, early closes, silence and
garbage can each be produced on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sidecar.upstream import Upstream, UpstreamError
from tests.support.fake_upstream import Blackhole, closed_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Accepts connections; each is served by ``handler``. Counts connections and what they sent."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0
        self.server: asyncio.base_events.Server | None = None
        self.url = ""

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), b"".join(line + b"\r\n" for line in extra), body)


def client(url: str, read_timeout_s: float = 5.0) -> Upstream:
    return Upstream(url, connect_timeout_s=0.5, read_timeout_s=read_timeout_s)


def test_requests_share_one_keep_alive_connection_and_the_request_is_well_formed() -> None:
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.read_request(reader)
                writer.write(ok(b'{"n":%d}' % len(server.requests), b"X-Engine: a"))
                await writer.drain()

        async with RawServer(handler) as server:
            upstream = client(server.url + "/prefix/")
            for n in (1, 2, 3):
                response = await upstream.request(b"POST", b"/v1/chat/completions?x=1",
                                                  [(b"x-request-id", b"r%d" % n)], b'{"a":1}')
                assert response.status == 200
                assert response.header(b"x-engine") == b"a"  # names come lower-case
                assert await response.read() == b'{"n":%d}' % n
                response.release()
            await upstream.close()
        assert server.connections == 1
        head = server.requests[0].split(b"\r\n")
        assert head[0] == b"POST /prefix/v1/chat/completions?x=1 HTTP/1.1"
        assert f"host: {server.url[7:]}".encode() in head
        assert b"content-length: 7" in head
        assert b"x-request-id: r1" in head
        assert server.requests[0].endswith(b'\r\n\r\n{"a":1}')

    run(scenario())


def test_a_chunked_body_arrives_piece_by_piece_and_unread_responses_are_not_reused() -> None:
    async def scenario() -> None:
        release = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
                await writer.drain()
                await release.wait()
                writer.write(b"6\r\n world\r\n0\r\n\r\n")
                await writer.drain()
                release.clear()

        async with RawServer(handler) as server:
            upstream = client(server.url)
            response = await upstream.request(b"POST", b"/s", [], b"{}")
            assert response.header(b"content-type") == b"text/event-stream"
            assert await response.next_chunk() == b"hello"  # before the rest exists
            release.set()
            assert await response.next_chunk() == b" world"
            assert await response.next_chunk() == b""
            response.release()
            # the second one is closed unread: its connection must not serve a third request
            second = await upstream.request(b"POST", b"/s", [], b"{}")
            assert await second.next_chunk() == b"hello"
            second.close()
            release.set()
            third = await upstream.request(b"POST", b"/s", [], b"{}")
            assert await third.next_chunk() == b"hello"
            third.close()
            await upstream.close()
        assert server.connections == 2

    run(scenario())


@pytest.mark.parametrize("extra", [b"connection: close", None], ids=["connection-close", "http-1.0"])
def test_a_connection_the_engine_will_close_is_not_reused(extra: bytes | None) -> None:
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            if extra is None:
                writer.write(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            else:
                writer.write(ok(b"{}", extra))
            await writer.drain()
            await asyncio.sleep(0.2)  # the close comes late: the client must not wait for it

        async with RawServer(handler) as server:
            upstream = client(server.url)
            for _ in range(2):
                response = await upstream.request(b"POST", b"/x", [], b"")
                assert await response.read() == b"{}"
                response.release()
            await upstream.close()
        assert server.connections == 2

    run(scenario())


def test_bytes_after_a_complete_response_keep_that_connection_out_of_the_pool() -> None:
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.read_request(reader)
                writer.write(ok(b"{}"))
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")  # nobody asked for it
                await writer.drain()

        async with RawServer(handler) as server:
            upstream = client(server.url)
            for _ in range(2):
                response = await upstream.request(b"POST", b"/x", [], b"")
                assert await response.read() == b"{}"
                await asyncio.sleep(0.15)  # the stray answer arrives while the response is still held
                response.release()
                assert not upstream.idle
            await upstream.close()
        assert server.connections == 2

    run(scenario())


@pytest.mark.parametrize("when", ["before-headers", "mid-body"])
def test_the_engine_closing_early_is_upstream_disconnected(when: str) -> None:
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            if when == "mid-body":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial\"")
                await writer.drain()

        async with RawServer(handler) as server:
            upstream = client(server.url)

            async def fetch() -> bytes:
                response = await upstream.request(b"POST", b"/x", [], b"")
                return await response.read()

            with pytest.raises(UpstreamError) as caught:
                await fetch()
            assert caught.value.reason == "upstream_disconnected"
            await upstream.close()

    run(scenario())


def test_garbage_instead_of_http_is_upstream_disconnected() -> None:
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(1)

        async with RawServer(handler) as server:
            upstream = client(server.url)
            with pytest.raises(UpstreamError) as caught:
                await upstream.request(b"POST", b"/x", [], b"")
            assert caught.value.reason == "upstream_disconnected"
            assert "not HTTP" in str(caught.value)
            await upstream.close()

    run(scenario())


def test_silence_longer_than_the_read_timeout_is_read_timeout_and_closes_the_connection() -> None:
    async def scenario() -> None:
        closed = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
            await writer.drain()
            await reader.read()  # returns at EOF: the client closed
            closed.set()

        async with RawServer(handler) as server:
            upstream = client(server.url, read_timeout_s=0.3)
            response = await upstream.request(b"POST", b"/x", [], b"")
            assert await response.next_chunk() == b"hi"
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(UpstreamError) as caught:
                await response.next_chunk()
            assert caught.value.reason == "read_timeout"
            assert 0.3 <= loop.time() - started < 3
            await asyncio.wait_for(closed.wait(), 2)
            await upstream.close()

    run(scenario())


def test_a_cancelled_reader_closes_the_connection_so_the_engine_sees_it() -> None:
    async def scenario() -> None:
        closed = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await writer.drain()
            await reader.read()
            closed.set()

        async with RawServer(handler) as server:
            upstream = client(server.url)
            response = await upstream.request(b"POST", b"/x", [], b"")
            reading = asyncio.ensure_future(response.next_chunk())
            await asyncio.sleep(0.05)
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            await asyncio.wait_for(closed.wait(), 2)
            assert not upstream.idle
            await upstream.close()

    run(scenario())


def test_a_slow_reader_pauses_the_engine_and_still_gets_every_byte() -> None:
    size = 8 << 20

    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
            block = bytes(range(256)) * 256
            for _ in range(size // len(block)):
                writer.write(block)
                await writer.drain()

        async with RawServer(handler) as server:
            upstream = client(server.url)
            response = await upstream.request(b"POST", b"/x", [], b"")
            await asyncio.sleep(0.3)  # not reading: the client must stop buffering at its high-water mark
            conn = response.conn
            assert conn.paused
            assert response.buffered < 4 << 20
            received = 0
            while chunk := await response.next_chunk():
                received += len(chunk)
            assert received == size
            response.release()
            assert len(upstream.idle) == 1
            await upstream.close()

    run(scenario())


def test_a_whole_body_larger_than_the_high_water_mark_is_read_to_the_end() -> None:
    size = 3 << 20

    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
            writer.write(b"y" * size)
            await writer.drain()

        async with RawServer(handler) as server:
            upstream = client(server.url)
            response = await upstream.request(b"POST", b"/x", [], b"")
            await asyncio.sleep(0.2)  # arrives before anyone reads: must not stay paused once read() waits
            assert len(await asyncio.wait_for(response.read(), 5)) == size
            response.release()
            await upstream.close()

    run(scenario())


def test_connect_failures_have_their_reasons() -> None:
    async def scenario() -> None:
        refused = client(f"http://127.0.0.1:{closed_port()}")
        with pytest.raises(UpstreamError) as caught:
            await refused.request(b"POST", b"/x", [], b"")
        assert caught.value.reason == "connect_error"
        blackhole = Blackhole()
        try:
            hanging = Upstream(blackhole.url, connect_timeout_s=0.2, read_timeout_s=5)
            with pytest.raises(UpstreamError) as caught:
                await hanging.request(b"POST", b"/x", [], b"")
            assert caught.value.reason == "connect_timeout"
        finally:
            blackhole.close()

    run(scenario())


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:1", "127.0.0.1:8000", "http://"])
def test_engine_urls_it_cannot_serve_are_refused_up_front(url: str) -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="engine URL must be http://"):
            client(url)

    run(scenario())


@pytest.mark.parametrize("answered", [False, True])
def test_a_reused_connection_closed_unanswered_is_sent_again_once_on_a_new_one(answered: bool) -> None:
    """vLLM's server closes idle keep-alive connections after 5 s; a request written as it does is lost. The
    engine here closes its first connection after one answer, at the next request (a fake of that race)."""
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            first = server.connections == 1
            await server.read_request(reader)
            writer.write(ok(b'{"n": 1}'))
            await writer.drain()
            if first:
                await server.read_request(reader)
                if answered:  # a byte of an answer, then the close: the engine failed, not the keep-alive
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n{")
                    await writer.drain()
                return
            with contextlib.suppress(asyncio.IncompleteReadError):
                await server.read_request(reader)

        async with RawServer(handler) as server:
            upstream = client(server.url)
            first = await upstream.request(b"POST", b"/x", [], b"one")
            assert await first.read() == b'{"n": 1}'
            first.release()
            if answered:
                async def fetch() -> bytes:
                    response = await upstream.request(b"POST", b"/x", [], b"two")
                    return await response.read()

                with pytest.raises(UpstreamError) as caught:
                    await fetch()
                assert caught.value.reason == "upstream_disconnected"
                assert server.connections == 1
            else:
                second = await upstream.request(b"POST", b"/x", [], b"two")
                assert await second.read() == b'{"n": 1}'
                second.release()
                assert server.connections == 2
                assert [r.endswith(b"two") for r in server.requests] == [False, True, True]
            await upstream.close()

    run(scenario())


def test_a_new_connection_closed_unanswered_is_not_sent_again() -> None:
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)

        async with RawServer(handler) as server:
            upstream = client(server.url)
            with pytest.raises(UpstreamError) as caught:
                await upstream.request(b"POST", b"/x", [], b"")
            assert caught.value.reason == "upstream_disconnected"
            assert server.connections == 1
            await upstream.close()

    run(scenario())


def test_a_connection_idle_past_the_keep_alive_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sidecar.upstream._IDLE_KEEPALIVE_S", 0.05)

    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError):
                while True:
                    await server.read_request(reader)
                    writer.write(ok(b"{}"))
                    await writer.drain()

        async with RawServer(handler) as server:
            upstream = client(server.url)
            for pause in (0.0, 0.0, 0.2):
                await asyncio.sleep(pause)
                response = await upstream.request(b"POST", b"/x", [], b"")
                await response.read()
                response.release()
            assert server.connections == 2  # the first two shared one; the third came after the keep-alive
            await upstream.close()

    run(scenario())


def test_a_reused_connection_closed_unanswered_after_a_while_is_not_sent_again() -> None:
    """Past the keep-alive race a close may mean the engine ran the request (and died): never twice."""
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(ok(b"{}"))
            await writer.drain()
            await server.read_request(reader)
            await asyncio.sleep(0.6)  # "generating", then gone

        async with RawServer(handler) as server:
            upstream = client(server.url)
            first = await upstream.request(b"POST", b"/x", [], b"one")
            await first.read()
            first.release()
            with pytest.raises(UpstreamError) as caught:
                await upstream.request(b"POST", b"/x", [], b"two")
            assert caught.value.reason == "upstream_disconnected"
            assert server.connections == 1
            assert len(server.requests) == 2
            await upstream.close()

    run(scenario())
