"""Engines as pools of replicas (sidecar/replicas.py): replica choice, the batch a rule sees, spill-over, affinity,
ejection and probe-back, fallback across pools; units first, then through a sidecar in front of fake engines."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from sidecar.replicas import POOL_SATURATED, POOL_UNAVAILABLE, InFlight, Pools, replica_name, retry_after_s
from tests.support import paths
from tests.support.fake_upstream import FakeEngine, closed_port
from tests.support.sidecars import LoopThread, Sidecar, SidecarFactory, wait_for

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def pools(engines: dict[str, list[str]], **options: Any) -> Pools:
    return Pools(engines, inflight=InFlight(), replica_scope=True, **options)


def scraped(pool: Pools, url: str, running: float, waiting: float | None = None, own: int = 0) -> None:
    """As if a scrape of ``url`` had just answered ``running`` / ``waiting`` while ``own`` of ours ran there."""
    replica = pool.replicas[url]
    replica.running, replica.waiting = running, waiting
    replica.own_at_scrape = own
    replica.external = max(0, int(running) - own)
    replica.fresh_until = time.monotonic() + 60


# --- units ------------------------------------------------------------------------------------------

def test_replica_names_are_host_port_and_prefix_without_credentials() -> None:
    assert replica_name("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert replica_name("https://user:secret@gpu-1.example/v1/") == "gpu-1.example:443/v1"
    assert replica_name("http://[::1]:9/") == "[::1]:9"
    assert replica_name("http://h") == "h:80"


def test_the_least_loaded_replica_serves_and_ties_break_at_random() -> None:
    pool = pools({"base": ["http://a", "http://b", "http://c"]})
    now = time.monotonic()
    a, b, c = (pool.replicas[u] for u in ("http://a", "http://b", "http://c"))
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    scraped(pool, "http://b", running=4, own=1)  # b runs 3 more from elsewhere: load 4
    choice = pool.choose("base", now)
    assert choice.replica is c
    assert choice.batch == 2  # c's one + this request
    assert choice.reason is None
    # a, b and c equally loaded: each gets a share
    a.in_flight = b.in_flight = c.in_flight = 0
    b.fresh_until = 0.0
    random.seed(7)
    picked = Counter(pool.choose("base", now).replica.name for _ in range(300))  # type: ignore[union-attr]
    assert set(picked) == {"a:80", "b:80", "c:80"}
    assert min(picked.values()) > 50


def test_a_stale_scrape_counts_only_our_own_requests() -> None:
    pool = pools({"draft": ["http://a"]})
    replica = pool.replicas["http://a"]
    replica.in_flight = 2
    scraped(pool, "http://a", running=7, own=2)
    assert pool.choose("draft", time.monotonic()).batch == 8  # 2 ours + 5 elsewhere + this one
    replica.fresh_until = time.monotonic() - 1
    assert pool.choose("draft", time.monotonic()).batch == 3


def test_ejection_after_failures_in_a_row_and_an_answer_resets_the_count() -> None:
    pool = pools({"base": ["http://a", "http://b"]}, eject_after=3, probe_initial_s=2.0)
    a = pool.replicas["http://a"]
    pool.failed(a, "connect_error")
    pool.failed(a, "connect_error")
    pool.succeeded(a)  # not in a row
    pool.failed(a, "connect_error")
    pool.failed(a, "upstream_503")
    assert a.healthy
    pool.failed(a, "read_timeout")
    assert not a.healthy
    assert a.ejections == 1
    now = time.monotonic()
    assert [pool.choose("base", now).replica for _ in range(20)] == [pool.replicas["http://b"]] * 20
    assert 1.5 < (pool.next_probe_s("base", now) or 0) <= 2.0
    pool.failed(pool.replicas["http://b"], "connect_error")
    pool.failed(pool.replicas["http://b"], "connect_error")
    pool.failed(pool.replicas["http://b"], "connect_error")
    choice = pool.choose("base", now)
    assert (choice.replica, choice.reason) == (None, POOL_UNAVAILABLE)
    report = {r["replica"]: r for r in pool.report(now)}
    assert report["a:80"]["state"] == "ejected"
    assert report["a:80"]["ejections"] == 1
    assert report["a:80"]["consecutive_failures"] == 3
    assert 0 < report["a:80"]["next_probe_in_s"] <= 2.0


def test_retry_after_is_whole_seconds_and_at_least_one() -> None:
    assert retry_after_s(None) == 1
    assert retry_after_s(0.0) == 1
    assert retry_after_s(2.01) == 3


def test_affinity_sticks_to_one_replica_everywhere_until_it_is_much_busier() -> None:
    urls = ["http://a", "http://b", "http://c", "http://d"]
    first, second = pools({"base": urls}, affinity_slack=2), pools({"base": urls}, affinity_slack=2)
    now = time.monotonic()
    homes = {}
    for key in (f"conversation-{i}" for i in range(40)):
        home = first.choose("base", now, key).replica
        assert home is not None
        # the same key, the same replica, whatever the random tie-break, and in another gateway too
        assert {first.choose("base", now, key).replica.name for _ in range(10)} == {home.name}  # type: ignore[union-attr]
        assert second.choose("base", now, key).replica.name == home.name  # type: ignore[union-attr]
        homes[key] = home
    assert len({home.name for home in homes.values()}) >= 3  # keys spread over the replicas
    key, home = next(iter(homes.items()))
    home.in_flight = 2  # within the slack of the idle others: still home
    choice = first.choose("base", now, key)
    assert choice.replica is home
    assert choice.batch == 3  # the batch the request joins is its home's
    home.in_flight = 3  # beyond: the least-loaded
    assert first.choose("base", now, key).replica is not home
    home.in_flight = 0
    first.failed(home, "connect_error")
    first.failed(home, "connect_error")
    first.failed(home, "connect_error")
    moved = first.choose("base", now, key).replica
    assert moved is not None
    assert moved is not home
    # ejecting one replica moves only its own keys
    for other, its_home in homes.items():
        if its_home is not home:
            assert first.choose("base", now, other).replica is its_home


def test_a_full_replica_is_passed_over_and_a_pool_of_full_ones_is_saturated() -> None:
    pool = pools({"draft": ["http://a", "http://b"]}, max_queue=2)
    now = time.monotonic()
    scraped(pool, "http://a", running=1, waiting=5)  # queues 5 > 2: full, though the less loaded
    scraped(pool, "http://b", running=3, waiting=0)
    choice = pool.choose("draft", now)
    assert (choice.replica, choice.reason) == (pool.replicas["http://b"], None)
    assert choice.batch == 4
    scraped(pool, "http://b", running=3, waiting=3)
    choice = pool.choose("draft", now)
    assert choice.reason == POOL_SATURATED
    assert choice.replica is not None  # what a plain pool then serves on anyway
    # our own requests sent since the scrape queue too
    scraped(pool, "http://a", running=1, waiting=1)
    assert pool.choose("draft", now).replica is pool.replicas["http://a"]
    pool.replicas["http://a"].in_flight = 2
    assert pool.replicas["http://a"].queue(now) == 3
    assert pool.choose("draft", now).reason == POOL_SATURATED
    assert pools({"draft": ["http://a"]}).choose("draft", now).reason is None  # no bound: never full


def _vector_policies() -> list[policies.PolicyDocument]:
    import yaml

    groups = yaml.safe_load((paths.VECTORS / "valid.yaml").read_text(encoding="utf-8"))["groups"]
    return [policies.validate_data(group["policy"]) for group in groups]


VECTOR_POLICIES = _vector_policies()


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, len(VECTOR_POLICIES) - 1), batch=st.integers(0, 40),
       route=st.sampled_from(["chat", "extract", "classify", "creative", "default", "code"]),
       structured=st.booleans(), stream=st.booleans(), request_id=st.text(max_size=8))
def test_one_batch_for_every_engine_decides_as_no_engine_batch(index: int, batch: int, route: str,
                                                               structured: bool, stream: bool,
                                                               request_id: str) -> None:
    # With one replica per engine on one worker every engine's batch is the worker's: today's decisions.
    doc = VECTOR_POLICIES[index]
    compiled = policies.compile_policy(doc, "r1")
    shape = policies.RequestShape(route=route, batch_size=batch, structured_output=structured, stream=stream,
                                  request_id=request_id)
    same = policies.RequestShape(route=route, batch_size=batch, structured_output=structured, stream=stream,
                                 request_id=request_id, engine_batch=dict.fromkeys(doc.engines, batch))
    assert compiled.decide(same) == compiled.decide(shape) == policies.interpret(doc, shape, "r1")
    assert policies.interpret(doc, same, "r1") == compiled.decide(shape)


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, len(VECTOR_POLICIES) - 1), batch=st.integers(0, 40),
       batches=st.dictionaries(st.sampled_from(["base", "draft", "ngram", "eagle", "plain", "spec", "x"]),
                               st.integers(0, 40)),
       route=st.sampled_from(["chat", "extract", "classify", "creative", "default"]),
       structured=st.booleans())
def test_compiled_and_reference_agree_on_per_engine_batches(index: int, batch: int, batches: dict[str, int],
                                                            route: str, structured: bool) -> None:
    doc = VECTOR_POLICIES[index]
    shape = policies.RequestShape(route=route, batch_size=batch, structured_output=structured,
                                  engine_batch=batches)
    assert policies.compile_policy(doc, "r1").decide(shape) == policies.interpret(doc, shape, "r1")


def test_a_rule_sees_the_batch_of_its_own_engine() -> None:
    doc = policies.load_policy((paths.ROOT / "policies" / "examples" / "seed.yaml").read_text())
    compiled = policies.compile_policy(doc, "r1")

    def engine(**batches: int) -> str:
        return compiled.decide(policies.RequestShape(route="chat", batch_size=1, engine_batch=batches)).engine

    assert engine(draft=4, base=30) == "draft"  # a speculative replica has room
    assert engine(draft=5, base=1) == "base"  # it has not: the load spills to the plain pool
    assert engine(base=30) == "draft"  # an engine without its own batch sees batch_size


def test_engine_batch_is_validated_by_field() -> None:
    with pytest.raises(policies.RequestShapeError) as caught:
        policies.RequestShape.from_dict({"engine_batch": {"draft": -1, "base": "3", "x": True}})
    paths_seen = {error.path for error in caught.value.errors}
    assert paths_seen == {"engine_batch.draft", "engine_batch.base", "engine_batch.x"}
    shape = policies.RequestShape.from_dict({"engine_batch": {"draft": 2}})
    assert shape.batch_for("draft") == 2
    assert shape.batch_for("base") == 1
    assert policies.RequestShape.from_dict(shape.to_dict()) == shape


# --- through a sidecar in front of fake engines -------------------------------------------------------

@pytest.fixture(scope="module")
def _more(loop_thread: LoopThread) -> Iterator[tuple[FakeEngine, FakeEngine]]:
    engines = FakeEngine("draft2", speculative=True), FakeEngine("base2")
    for engine in engines:
        loop_thread.run(engine.start())
    yield engines
    for engine in engines:
        loop_thread.run(engine.stop())


@pytest.fixture
def draft2(_more: tuple[FakeEngine, FakeEngine]) -> FakeEngine:
    _more[0].reset()
    return _more[0]


@pytest.fixture
def base2(_more: tuple[FakeEngine, FakeEngine]) -> FakeEngine:
    _more[1].reset()
    return _more[1]


def chat(sidecar: Sidecar, client: httpx.Client | None = None, **headers: str) -> httpx.Response:
    send = client.post if client is not None else httpx.post
    return send(sidecar.url + "/v1/chat/completions", json=CHAT_BODY,
                headers={"X-Specgate-Route": "chat", **headers}, timeout=10)


def decision(response: httpx.Response) -> dict[str, str]:
    return dict(part.split("=", 1) for part in response.headers["x-specgate-decision"].split("; "))


def test_load_spills_from_the_speculative_pool_to_the_plain_pool_at_the_threshold(
        make_sidecar: SidecarFactory, draft: FakeEngine, draft2: FakeEngine, base: FakeEngine,
        base2: FakeEngine) -> None:
    # A gateway: the seed policy speculates on chat while the batch is at most 4. Each speculative replica
    # runs requests from elsewhere (traffic of other gateways); a request joins the least-loaded one while
    # its batch there stays within 4, and goes to the plain pool beyond.
    draft.running, draft2.running = 3, 5
    base.running, base2.running = 7, 2
    sidecar = make_sidecar(kind="gateway", engines={"draft": [draft.url, draft2.url], "base": [base.url, base2.url]},
                           engine_metrics_s=0.05)
    pools = sidecar.app.pools
    wait_for(lambda: pools.replicas[draft.url].external == 3 and pools.replicas[base2.url].external == 2)
    speculated = chat(sidecar)
    assert decision(speculated)["engine"] == "draft"
    assert decision(speculated)["replica"] == draft.url[7:]  # the least-loaded speculative replica: batch 4
    draft.running = 4
    wait_for(lambda: pools.replicas[draft.url].external == 4)
    spilled = chat(sidecar)
    assert decision(spilled)["engine"] == "base"  # batch 5 on the least-loaded speculative replica: no room
    assert decision(spilled)["replica"] == base2.url[7:]  # the least-loaded plain replica
    first, second = sidecar.exporter.wait(2)
    assert (first.engine, first.replica, first.batch_size) == ("draft", draft.url[7:], 4)
    assert (second.engine, second.replica, second.batch_size) == ("base", base2.url[7:], 3)
    assert second.fallback is False  # a decision by the rules, not a failure
    assert (len(draft.requests), len(draft2.requests), len(base.requests), len(base2.requests)) == (1, 0, 0, 1)


def test_worker_scope_keeps_the_batch_of_the_whole_worker(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                          base: FakeEngine) -> None:
    # The same load on the plain engine: on a worker (engines share its accelerator) it fills the batch
    # every rule sees; in a gateway only the plain pool's rules would see it.
    base.running = 5
    worker = make_sidecar(engine_metrics_s=0.05)
    gateway = make_sidecar(kind="gateway", engine_metrics_s=0.05)
    wait_for(lambda: worker.app.pools.total == 5)
    wait_for(lambda: gateway.app.pools.replicas[base.url].external == 5)
    assert decision(chat(worker))["engine"] == "base"
    assert decision(chat(gateway))["engine"] == "draft"
    assert worker.exporter.one().batch_size == 6
    assert gateway.exporter.one().batch_size == 1


def test_a_dead_replica_is_retried_around_then_ejected_then_probed_back(
        make_sidecar: SidecarFactory, loop_thread: LoopThread, base: FakeEngine, base2: FakeEngine) -> None:
    loop_thread.run(base2.stop())  # the replica goes down; its port stays ours to start it on again
    try:
        _dead_replica_comes_back(make_sidecar, loop_thread, base, base2)
    finally:
        if not base2.health_checks:  # not started again by the test: the next tests need it
            loop_thread.run(base2.start())


def _dead_replica_comes_back(make_sidecar: SidecarFactory, loop_thread: LoopThread, base: FakeEngine,
                             base2: FakeEngine) -> None:
    dead = base2.url
    base.running = 3
    plain = policies.load_policy("apiVersion: specgate/v1\nname: plain\nengines: {base: {method: none}}\n"
                                 "default: {engine: base}\n")
    sidecar = make_sidecar(kind="gateway", engines={"base": [dead, base.url]}, eject_after=2,
                           probe_initial_s=0.2, probe_max_s=0.4,
                           bundle=policies.CompiledBundle(policies.BundlePayload(policies.Revision.of(plain))))
    replicas = sidecar.app.pools.replicas
    changes: list[str] = []
    sidecar.app.pools.on_change = lambda: changes.append("changed")  # the sidecar heartbeats at once on it
    # The live replica runs 3 requests from elsewhere, so the dead one (load 0) is the least loaded: the first
    # request tries it. The start-up scrape could not connect to it (one failure), the request is the second.
    wait_for(lambda: replicas[base.url].external == 3)
    for _ in range(12):
        response = chat(sidecar)
        assert response.status_code == 200  # never lost: retried on the live replica
        assert decision(response)["replica"] == base.url[7:]
    events = sidecar.exporter.wait(12)
    assert [e.retries for e in events] == [1] + [0] * 11  # then it was ejected
    assert (events[0].fallback, events[0].engine, events[0].fallback_reason) == (False, "base", None)
    assert not replicas[dead].healthy
    assert replicas[dead].ejections == 1
    metrics = httpx.get(sidecar.url + "/metrics").text
    assert f'specgate_sidecar_replica_healthy{{engine="base",replica="{replica_name(dead)}"}} 0.0' in metrics
    assert f'specgate_sidecar_replica_ejections_total{{engine="base",replica="{replica_name(dead)}"}} 1.0' in metrics
    # the probes back off while the replica stays down; it returns once /health answers
    time.sleep(0.7)
    assert not replicas[dead].healthy
    assert replicas[dead].backoff_s == pytest.approx(0.4)
    loop_thread.run(base2.start())  # back, on the same address
    wait_for(lambda: replicas[dead].healthy, timeout=3)
    assert replicas[dead].returns == 1
    assert base2.health_checks >= 1
    assert changes == ["changed", "changed"]  # ejected, returned
    served = Counter(decision(chat(sidecar))["replica"] for _ in range(4))
    assert served == {replica_name(dead): 4}  # used again: the least loaded


def test_spec_pool_down_goes_to_the_plain_pool_and_no_plain_pool_is_a_503_with_retry_after(
        make_sidecar: SidecarFactory, base: FakeEngine) -> None:
    dead_draft = f"http://127.0.0.1:{closed_port()}"
    sidecar = make_sidecar(kind="gateway", engines={"draft": dead_draft, "base": base.url}, eject_after=1,
                           probe_initial_s=30.0)
    # The first request fails on the draft replica and is retried on the plain pool, unless the first scrape
    # (at start) found the replica unreachable and ejected it already.
    first = chat(sidecar)
    assert first.status_code == 200
    second = chat(sidecar)  # the draft replica is ejected: straight to the plain pool
    assert second.status_code == 200
    assert second.headers["x-specgate-fallback"] == "engine=base; reason=pool_unavailable"
    one, two = sidecar.exporter.wait(2)
    assert (one.retries, one.fallback_reason) in ((1, "connect_error"), (0, "pool_unavailable"))
    assert (two.retries, two.fallback, two.fallback_reason, two.decided_engine, two.engine) == (
        0, True, "pool_unavailable", "draft", "base")
    assert two.replica == base.url[7:]

    dead_base = f"http://127.0.0.1:{closed_port()}"
    down = make_sidecar(kind="gateway", engines={"draft": dead_draft, "base": dead_base}, eject_after=1,
                        probe_initial_s=30.0)
    chat(down)  # ejects both
    started = time.monotonic()
    refused = chat(down)
    assert time.monotonic() - started < 2  # an answer, never a hang
    assert refused.status_code == 503
    assert refused.headers["content-type"] == "application/problem+json"
    assert 25 <= int(refused.headers["retry-after"]) <= 30
    problem = refused.json()
    assert problem["status"] == 503
    assert "base" in problem["detail"]
    event = down.exporter.wait(2)[1]
    assert (event.status, event.http_status, event.replica) == ("upstream_error", 503, None)
    # a pass-through request has no replica either
    models = httpx.get(down.url + "/v1/models", timeout=5)
    assert models.status_code == 503
    assert "retry-after" in models.headers


IN_ENGINE = policies.load_policy("""apiVersion: specgate/v1
name: in-engine
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3, schedule: in_engine}
rules:
  - name: chat-draft-small
    when: {route: [chat], batch_size: {max: 2}}
    then: {engine: draft}
default: {engine: base}
""")


def test_a_decision_without_drafts_on_an_in_engine_engine_is_retried_on_the_plain_pool(
        make_sidecar: SidecarFactory, base: FakeEngine) -> None:
    # The worker's batch is 6: the in-engine engine still gets the chat request, to run it without drafts
    # (speculate false). Its only replica refuses connections: like a speculative decision, it goes to the
    # plain pool rather than failing.
    base.running = 5
    dead_draft = f"http://127.0.0.1:{closed_port()}"
    sidecar = make_sidecar(engines={"draft": dead_draft, "base": base.url}, eject_after=50, engine_metrics_s=0.05,
                           bundle=policies.CompiledBundle(policies.BundlePayload(policies.Revision.of(IN_ENGINE))))
    wait_for(lambda: sidecar.app.pools.total == 5)
    response = chat(sidecar)
    assert response.status_code == 200
    assert response.headers["x-specgate-fallback"] == "engine=base; reason=connect_error"
    event = sidecar.exporter.one()
    assert (event.decided_engine, event.engine, event.speculate, event.retries, event.fallback) == (
        "draft", "base", False, 1, True)
    assert event.rule == "chat-draft-small"


def test_a_saturated_speculative_pool_sends_requests_to_the_plain_pool(
        make_sidecar: SidecarFactory, draft: FakeEngine, base: FakeEngine) -> None:
    # No batch rule would stop speculation here (the batch is 1): the queue bound does.
    draft.waiting = 9
    sidecar = make_sidecar(kind="gateway", max_queue=4, engine_metrics_s=0.05)
    wait_for(lambda: sidecar.app.pools.replicas[draft.url].waiting == 9)
    response = chat(sidecar)
    assert response.headers["x-specgate-fallback"] == "engine=base; reason=pool_saturated"
    event = sidecar.exporter.one()
    assert (event.decided_engine, event.engine, event.fallback_reason) == ("draft", "base", "pool_saturated")
    draft.waiting = 0
    wait_for(lambda: sidecar.app.pools.replicas[draft.url].waiting == 0)
    assert decision(chat(sidecar))["engine"] == "draft"
    assert "x-specgate-fallback" not in chat(sidecar).headers


def test_affinity_keeps_a_conversation_on_its_replica(make_sidecar: SidecarFactory, base: FakeEngine,
                                                      base2: FakeEngine) -> None:
    sidecar = make_sidecar(kind="gateway", engines={"draft": base.url, "base": [base.url, base2.url]})
    homes = {key: {decision(chat(sidecar, **{"X-Specgate-Affinity": key, "X-Specgate-Route": "other"}))["replica"]
                   for _ in range(3)} for key in (f"conv-{i}" for i in range(20))}
    assert all(len(replicas) == 1 for replicas in homes.values())
    assert len({next(iter(r)) for r in homes.values()}) == 2  # different conversations, different homes
    too_long = chat(sidecar, **{"X-Specgate-Affinity": "k" * 257})
    assert too_long.status_code == 400
    assert too_long.json()["errors"] == [{"path": "X-Specgate-Affinity", "in": "header", "code": "too_long",
                                          "message": "is 257 characters, over the 256 allowed"}]
    # the header is ours: the engine never sees it
    assert all("x-specgate-affinity" not in r["headers"] for r in base.requests + base2.requests)


def test_two_gateways_see_each_others_load_through_the_scrapes(make_sidecar: SidecarFactory, base: FakeEngine,
                                                               base2: FakeEngine) -> None:
    # Gateway A holds two requests of one conversation on one plain replica; gateway B, scraping, sees them
    # as load from elsewhere and sends its next request to the other replica.
    base.first_byte_delay = base2.first_byte_delay = 1.5
    engines = {"draft": base.url, "base": [base.url, base2.url]}
    a = make_sidecar(kind="gateway", engines=engines, engine_metrics_s=0.05, worker_id="gw-a")
    b = make_sidecar(kind="gateway", engines=engines, engine_metrics_s=0.05, worker_id="gw-b")
    import threading

    headers = {"X-Specgate-Route": "other", "X-Specgate-Affinity": "conv-1"}
    threads = [threading.Thread(target=chat, args=(a,), kwargs=headers) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_for(lambda: max(r.in_flight for r in a.app.pools.replicas.values()) == 2)
    busy = max(a.app.pools.replicas.values(), key=lambda r: r.in_flight)
    wait_for(lambda: b.app.pools.replicas[busy.url].external == 2)
    b_busy = b.app.pools.replicas[busy.url]
    assert b_busy.load(time.monotonic()) == 2  # none of it B's own
    response = chat(b, **{"X-Specgate-Route": "other"})
    for thread in threads:
        thread.join(10)
    assert decision(response)["replica"] != busy.name


# --- what counts as a replica failing, and what brings one back ------------------------------------------

def test_scrapes_that_answer_do_not_hide_a_replica_whose_requests_fail(make_sidecar: SidecarFactory,
                                                                       base: FakeEngine, base2: FakeEngine) -> None:
    # A vLLM whose engine core died still serves /metrics but answers completions 503: frequent scrapes
    # between the requests must not reset its count.
    base2.fail_status = 503
    sidecar = make_sidecar(kind="gateway", engines={"draft": base.url, "base": [base.url, base2.url]},
                           engine_metrics_s=0.02, eject_after=3, probe_initial_s=30.0)
    replicas = sidecar.app.pools.replicas
    for _ in range(8):
        assert chat(sidecar, **{"X-Specgate-Route": "other"}).status_code == 200  # retried on base
        time.sleep(0.05)  # scrapes of base2 answer meanwhile
    assert not replicas[base2.url].healthy
    assert replicas[base2.url].ejections == 1
    assert base2.metrics_scrapes >= 3


def test_an_answer_of_500_is_relayed_and_ejects_nothing(make_sidecar: SidecarFactory, base: FakeEngine) -> None:
    # A 500 may be the request's own doing: counting it would let any client eject a pool (here the only one).
    base.fail_status = 500
    sidecar = make_sidecar(engines={"base": base.url}, eject_after=2)
    for _ in range(5):
        assert chat(sidecar, **{"X-Specgate-Route": "other"}).status_code == 500
    assert sidecar.app.pools.replicas[base.url].healthy
    assert sidecar.app.pools.replicas[base.url].failures == 0
    base.fail_status = 503
    for _ in range(2):
        assert chat(sidecar, **{"X-Specgate-Route": "other"}).status_code == 503
    assert not sidecar.app.pools.replicas[base.url].healthy
    refused = chat(sidecar, **{"X-Specgate-Route": "other"})
    assert refused.status_code == 503
    assert refused.json()["type"].endswith("/no-replica")


def test_a_full_speculative_pool_serves_anyway_when_the_plain_pool_is_down(
        make_sidecar: SidecarFactory, draft: FakeEngine) -> None:
    draft.waiting = 9
    dead = f"http://127.0.0.1:{closed_port()}"
    sidecar = make_sidecar(kind="gateway", engines={"draft": draft.url, "base": dead}, max_queue=2, eject_after=1,
                           engine_metrics_s=0.05, probe_initial_s=30.0)
    pools = sidecar.app.pools
    wait_for(lambda: pools.replicas[draft.url].waiting == 9 and not pools.replicas[dead].healthy)
    response = chat(sidecar)
    assert response.status_code == 200  # a full replica rather than none
    assert decision(response)["replica"] == draft.url[7:]
    assert "x-specgate-fallback" not in response.headers
    assert sidecar.exporter.one().fallback_reason is None


def test_a_pool_with_no_healthy_replica_is_probed_without_backing_off(loop_thread: LoopThread) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    pool = pools({"base": [dead], "draft": ["http://127.0.0.1:1", dead]}, eject_after=1, probe_initial_s=0.05,
                 probe_max_s=10.0)
    replica = pool.replicas[dead]
    pool.failed(replica, "connect_error")

    async def probes() -> None:
        for _ in range(4):
            replica.probe_at = 0.0
            await pool.probe_due()
        await pool.stop()

    loop_thread.run(probes())
    # its engine base has no other replica: every failed probe waits probe_initial_s again
    assert replica.backoff_s == pytest.approx(0.05)
    assert not replica.healthy


def test_a_server_without_a_health_route_comes_back(make_sidecar: SidecarFactory, base: FakeEngine,
                                                    base2: FakeEngine) -> None:
    base2.health_status = 404  # an OpenAI-compatible server that has no /health
    sidecar = make_sidecar(kind="gateway", engines={"draft": base.url, "base": [base.url, base2.url]},
                           probe_initial_s=0.05)
    pool = sidecar.app.pools
    for _ in range(3):
        pool.failed(pool.replicas[base2.url], "connect_error")
    assert not pool.replicas[base2.url].healthy
    wait_for(lambda: pool.replicas[base2.url].healthy)
    assert base2.health_checks >= 1


def test_scraped_values_that_are_not_counts_are_ignored() -> None:
    from sidecar.replicas import parse_engine_load

    for value in ("+Inf", "-1", "NaN", "1e400"):
        assert parse_engine_load(f"vllm:num_requests_running {value}\nvllm:num_requests_waiting {value}\n") == (
            None, None), value


def test_the_sidecar_heartbeats_at_once_when_a_replica_is_ejected_or_returns(tmp_path: Path) -> None:
    from sidecar.main import Sidecar
    from sidecar.settings import SidecarSettings

    sidecar = Sidecar(SidecarSettings(engines={"base": "http://127.0.0.1:1"}, key="sgk_x", state_dir=tmp_path),
                      use_env_otel=False)
    pool = sidecar.app.pools
    assert pool.on_change == sidecar.sync.report_soon
    assert not sidecar.sync._heartbeat_now.is_set()
    for _ in range(3):
        pool.failed(pool.replicas["http://127.0.0.1:1"], "connect_error")
    assert sidecar.sync._heartbeat_now.is_set()
