"""Many requests at once through one sidecar: decisions, batch sizes, one event each."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.support.fake_upstream import FakeEngine
from tests.support.sidecars import SidecarFactory, wait_for

CHAT = "/v1/chat/completions"


def fields(header: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in header.split("; "))


async def _stream_all(url: str, count: int, extra_headers: dict[str, str]) -> list[tuple[str, int, str, str]]:
    """(request id, status, decision header, text) of ``count`` concurrent streaming requests."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> tuple[str, int, str, str]:
            rid = f"req-{i:03d}"
            payload = {"model": "m", "stream": True, "messages": [{"role": "user", "content": f"hi {i}"}]}
            async with session.post(url + CHAT, json=payload,
                                    headers={"X-Specgate-Route": "chat", "X-Request-Id": rid, **extra_headers},
                                    timeout=aiohttp.ClientTimeout(total=30)) as response:
                text = await response.text()
                return rid, response.status, response.headers["X-Specgate-Decision"], text

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_200_concurrent_streams(make_sidecar: SidecarFactory, draft: FakeEngine, base: FakeEngine) -> None:
    sidecar = make_sidecar()
    results = asyncio.run(_stream_all(sidecar.url, 200, {"x-fake-tokens": "4", "x-fake-token-delay": "0.02"}))
    events = sidecar.exporter.wait(200, timeout=10)
    wait_for(lambda: sidecar.app.inflight.count == 0)
    assert len(events) == 200
    by_id = {event.request_id: event for event in events}
    assert len(by_id) == 200  # unique request ids, one event each
    served = {rid: "draft" for rid in draft.request_ids()} | {rid: "base" for rid in base.request_ids()}
    assert len(served) == 200
    revision = sidecar.store.current.active.revision if sidecar.store.current else ""
    for rid, status, header, text in results:
        assert status == 200
        assert text.endswith("data: [DONE]\n\n")
        content = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                           for line in text.split("\n\n") if line.startswith("data: {"))
        assert content == "tok0 tok1 tok2 tok3 "
        event = by_id[rid]
        decision = fields(header)
        assert decision == {"engine": event.decided_engine, "rule": event.rule, "policy": "seed",
                            "revision": revision, "explored": "false", "replica": event.replica}
        assert event.replica == (draft.url if event.engine == "draft" else base.url).removeprefix("http://")
        # the header is what the policy says for the batch size the request was admitted at
        assert decision["engine"] == ("draft" if event.batch_size <= 4 else "base")
        assert served[rid] == event.engine == decision["engine"]
        assert event.status == "ok"
        assert event.completion_tokens == 4
    assert max(event.batch_size for event in events) > 4  # they really overlapped


def test_batch_size_reflects_concurrency(make_sidecar: SidecarFactory, draft: FakeEngine,
                                         base: FakeEngine) -> None:
    sidecar = make_sidecar()
    results = asyncio.run(_stream_all(sidecar.url, 8, {"x-fake-first-byte-delay": "0.4"}))
    events = sidecar.exporter.wait(8)
    assert sorted(event.batch_size for event in events) == list(range(1, 9))
    engines = sorted(fields(header)["engine"] for _, _, header, _ in results)
    assert engines == ["base"] * 4 + ["draft"] * 4
    assert len(draft.requests) == 4
    assert len(base.requests) == 4
    for event in events:
        assert event.engine == ("draft" if event.batch_size <= 4 else "base")
