"""Hardening of the pass-through path: what it must never forward to an engine."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.support.sidecars import SidecarFactory, wait_for


class _EchoHeaders(BaseHTTPRequestHandler):
    """An engine stand-in that answers every request with the headers it received."""

    def _echo(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _echo

    def log_message(self, format: str, *args: object) -> None:
        pass


class _SlowToClose(BaseHTTPRequestHandler):
    """A streaming engine that pauses after each event, `data: [DONE]` included, before ending the stream."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
        try:
            for event in (b"data: " + json.dumps(chunk).encode() + b"\n\n", b"data: [DONE]\n\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                time.sleep(0.5)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the sidecar went away with its client
            pass

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def slow_to_close_engine() -> Iterator[str]:
    yield from _serve(_SlowToClose)


@pytest.fixture
def echo_engine() -> Iterator[str]:
    yield from _serve(_EchoHeaders)


def test_pass_through_never_forwards_specgate_headers(make_sidecar: SidecarFactory, echo_engine: str) -> None:
    sidecar = make_sidecar(engines={"base": echo_engine})
    seen = httpx.get(sidecar.url + "/v1/models", headers={
        "X-Specgate-Route": "chat", "X-Specgate-Labels": "tenant=a", "X-Specgate-Anything": "1", "X-Custom": "yes"})
    assert seen.status_code == 200
    assert seen.json()["x-custom"] == "yes"
    assert not [name for name in seen.json() if name.startswith("x-specgate-")]


def test_invocations_is_refused_not_passed_through_undecided(make_sidecar: SidecarFactory,
                                                             echo_engine: str) -> None:
    sidecar = make_sidecar(engines={"base": echo_engine})
    resp = httpx.post(sidecar.url + "/invocations", json={"prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 404
    assert resp.headers["content-type"].startswith("application/problem+json")
    assert "/invocations" in resp.json()["detail"]


def _stream_until(sidecar: Any, request_id: str, stop_at: bytes) -> Any:
    """Stream a chat completion, close once ``stop_at`` has been read, and return the one event it made."""
    with httpx.stream("POST", sidecar.url + "/v1/chat/completions",
                      json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
                      headers={"X-Specgate-Route": "chat", "X-Request-Id": request_id}) as response:
        seen = b""
        for chunk in response.iter_raw():
            seen += chunk
            if stop_at in seen:
                break
    wait_for(lambda: len(sidecar.exporter.events) == 1, timeout=3)
    return sidecar.exporter.one()


@pytest.mark.parametrize("server", ["specgate", "uvicorn"])
def test_a_stream_read_to_done_counts_as_delivered(make_sidecar: SidecarFactory, slow_to_close_engine: str,
                                                   server: str) -> None:
    sidecar = make_sidecar(engines={"base": slow_to_close_engine}, server=server)
    # As loadgen and many clients do: close once [DONE] is read.
    event = _stream_until(sidecar, "done-1", b"data: [DONE]")
    assert (event.request_id, event.status) == ("done-1", "ok")


@pytest.mark.parametrize("server", ["specgate", "uvicorn"])
def test_a_stream_left_before_done_is_a_client_disconnect(make_sidecar: SidecarFactory, slow_to_close_engine: str,
                                                          server: str) -> None:
    sidecar = make_sidecar(engines={"base": slow_to_close_engine}, server=server)
    assert _stream_until(sidecar, "done-2", b"hi").status == "client_disconnect"


@pytest.mark.parametrize("raw", [
    b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b', "messages": []}',
], ids=["5000-deep", "5000-digits"])
def test_hostile_json_is_a_400_not_a_500(make_sidecar: SidecarFactory, raw: bytes) -> None:
    sidecar = make_sidecar()
    resp = httpx.post(sidecar.url + "/v1/chat/completions", content=raw,
                      headers={"Content-Type": "application/json", "X-Specgate-Route": "chat"})
    assert resp.status_code == 400
    assert resp.headers["content-type"].startswith("application/problem+json")
    assert resp.json()["detail"]
    time.sleep(0.05)
    assert sidecar.exporter.events == []


def test_a_4000_digit_integer_the_stdlib_still_parses_is_no_500(make_sidecar: SidecarFactory) -> None:
    sidecar = make_sidecar()
    resp = httpx.post(sidecar.url + "/v1/chat/completions",
                      content=b'{"model": "m", "max_tokens": ' + b"9" * 4000 + b', "messages": []}',
                      headers={"Content-Type": "application/json", "X-Specgate-Route": "chat"})
    assert resp.status_code < 500
