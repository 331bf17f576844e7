"""``specgate loadgen``: option validation, the request mix, the report, and runs against fake engines."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import types
from collections import Counter
from typing import Any

import pytest
from typer.testing import CliRunner

from sidecar.loadgen import (
    CorpusPrompts,
    FunctionPrompts,
    LoadgenError,
    LoadPlan,
    Outcome,
    Stage,
    SyntheticPrompts,
    build_plan,
    build_request,
    format_summary,
    load_prompt_source,
    parse_decision,
    parse_duration,
    parse_route_mix,
    parse_schedule,
    percentile,
    run_load,
    schema_for,
    summarize,
)
from specgate.cli import app
from tests.support.fake_upstream import FakeEngine, closed_port
from tests.support.sidecars import SidecarFactory

# --- options -----------------------------------------------------------------------------


def test_schedule_parses_stages_and_units() -> None:
    assert parse_schedule("1:30s,4:2m, 16:500ms,2:1.5") == [Stage(1, 30.0), Stage(4, 120.0), Stage(16, 0.5),
                                                             Stage(2, 1.5)]


@pytest.mark.parametrize(("text", "says"), [
    ("", "expected CONCURRENCY:DURATION"),
    ("4", "stage 1 '4' is not CONCURRENCY:DURATION"),
    ("1:30s,,4:30s", "expected CONCURRENCY:DURATION"),
    ("x:30s", "--schedule stage 1: concurrency 'x'"),
    ("0:30s", "concurrency '0' must be a whole number from 1"),
    ("1:30s,5000:1s", "--schedule stage 2: concurrency '5000'"),
    ("-1:30s", "concurrency '-1'"),
    ("4:30q", "--schedule stage 1: '30q' is not a duration"),
    ("4:0s", "a duration must be above zero"),
    ("4:", "is not a duration"),
])
def test_bad_schedules_name_the_option_and_stage(text: str, says: str) -> None:
    with pytest.raises(LoadgenError, match=r"^--schedule") as caught:
        parse_schedule(text)
    assert says in str(caught.value)
    assert caught.value.option.startswith("--schedule")


def test_durations() -> None:
    assert parse_duration("2m", "--duration") == 120.0
    assert parse_duration("1h", "--duration") == 3600.0
    assert parse_duration(" 250ms ", "--duration") == 0.25
    with pytest.raises(LoadgenError, match=r"^--duration: 'soon' is not a duration"):
        parse_duration("soon", "--duration")


def test_route_mix() -> None:
    assert parse_route_mix("chat=2, extract=1,creative") == {"chat": 2.0, "extract": 1.0, "creative": 1.0}
    assert parse_route_mix("chat=0,extract=0.5") == {"chat": 0.0, "extract": 0.5}


@pytest.mark.parametrize(("text", "says"), [
    ("chat=-1", "weight of 'chat' must be a finite number >= 0"),
    ("chat=lots", "weight of 'chat' must be a number"),
    ("chat=inf", "finite"),
    ("chat=0,extract=0", "at least one route needs a weight above 0"),
    ("chat=1,chat=2", "route 'chat' is given twice"),
    ("=2", "names no route"),
    ("chat=1,", "expected ROUTE=WEIGHT"),
])
def test_bad_route_mixes(text: str, says: str) -> None:
    with pytest.raises(LoadgenError, match=r"^--routes: ") as caught:
        parse_route_mix(text)
    assert says in str(caught.value)


def test_unknown_routes_are_refused_with_the_known_ones() -> None:
    with pytest.raises(LoadgenError, match=r"^--routes: unknown route") as caught:
        build_plan(routes="chat=1,poetry=2")
    assert "'poetry'" in str(caught.value)
    assert "extract, classify, chat, creative" in str(caught.value)


@pytest.mark.parametrize("option", ["structured_share", "stream_share"])
@pytest.mark.parametrize("value", [-0.01, 1.5, float("nan")])
def test_shares_outside_0_1_are_refused(option: str, value: float) -> None:
    flag = "--" + option.replace("_", "-")
    with pytest.raises(LoadgenError, match=rf"^{flag}: must be a share in \[0, 1\]"):
        build_plan(**{option: value})


@pytest.mark.parametrize(("options", "says"), [
    ({"schedule": "1:1s", "concurrency": 4}, "--schedule: replaces --concurrency and --duration"),
    ({"schedule": "1:1s", "duration": "3s"}, "--schedule: replaces"),
    ({"concurrency": 0}, "--concurrency: must be from 1"),
    ({"requests": 0}, "--requests: must be at least 1"),
    ({"max_tokens": 0}, "--max-tokens: must be from 1"),
    ({"endpoint": "embeddings"}, "--endpoint: must be one of chat, completions"),
    ({"route_in": "cookie"}, "--route-in: must be one of both, header, metadata"),
    ({"timeout_s": 0}, "--timeout: must be above zero"),
    ({"temperature": -0.1}, "--temperature: must be from 0 to 2"),
    ({"temperature": float("nan")}, "--temperature: must be from 0 to 2"),
    ({"url": "127.0.0.1:9000"}, "--url: must be an http(s) base URL"),
    ({"labels": ["tenant"]}, "--label: must be k=v"),
    ({"duration": "forever"}, "--duration: 'forever' is not a duration"),
])
def test_bad_options_name_the_option(options: dict[str, Any], says: str) -> None:
    with pytest.raises(LoadgenError) as caught:
        build_plan(**options)
    assert str(caught.value).startswith(says)


def test_stages_without_a_schedule() -> None:
    assert build_plan().stages == (Stage(4, 30.0),)
    assert build_plan(requests=10).stages == (Stage(4, None),)  # runs until the requests are sent
    assert build_plan(concurrency=2, duration="5s", requests=10).stages == (Stage(2, 5.0),)


# --- the request mix ---------------------------------------------------------------------


def _plan(**options: Any) -> LoadPlan:
    return build_plan(**{"run_id": "t", "model": "m", **options})


def test_requests_are_fixed_by_seed_and_index() -> None:
    plan = _plan(structured_share=0.5, stream_share=0.5, seed=7)
    assert build_request(plan, 11) == build_request(plan, 11)
    other = _plan(structured_share=0.5, stream_share=0.5, seed=8)
    assert [build_request(plan, i).body for i in range(20)] != [build_request(other, i).body for i in range(20)]


def test_request_ids_are_unique_per_request_and_per_run() -> None:
    a, b = build_plan(model="m"), build_plan(model="m")
    ids = [build_request(a, i).request_id for i in range(500)] + [build_request(b, i).request_id for i in range(500)]
    assert len(set(ids)) == 1000
    request = build_request(a, 3)
    assert request.headers["X-Request-Id"] == request.request_id


def test_shares_and_route_weights_hold_over_many_requests() -> None:
    plan = _plan(routes="chat=2,extract=1,creative=1", structured_share=0.3, stream_share=0.6)
    requests = [build_request(plan, i) for i in range(4000)]
    routes = Counter(r.route for r in requests)
    assert abs(routes["chat"] / 4000 - 0.5) < 0.03
    assert abs(routes["extract"] / 4000 - 0.25) < 0.03
    assert abs(routes["creative"] / 4000 - 0.25) < 0.03
    assert abs(sum(r.structured for r in requests) / 4000 - 0.3) < 0.03
    assert abs(sum(r.stream for r in requests) / 4000 - 0.6) < 0.03
    # independent draws: structured output is as common among streams as overall
    streams = [r for r in requests if r.stream]
    assert abs(sum(r.structured for r in streams) / len(streams) - 0.3) < 0.04


def test_zero_and_one_shares_are_exact() -> None:
    none = [build_request(_plan(structured_share=0.0, stream_share=1.0), i) for i in range(300)]
    assert not any(r.structured for r in none)
    assert all(r.stream for r in none)


def test_request_body_and_headers() -> None:
    plan = _plan(routes="extract", structured_share=1.0, stream_share=1.0, max_tokens=32, labels=["tenant=a"],
                 api_key="secret-token")
    request = build_request(plan, 0)
    body = request.body
    assert body["model"] == "m"
    assert body["max_tokens"] == 32
    assert body["metadata"] == {"route": "extract"}
    assert body["messages"][0]["role"] == "user"
    assert body["messages"][0]["content"].startswith("extract: ")
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    schema = body["response_format"]["json_schema"]["schema"]
    assert body["response_format"]["type"] == "json_schema"
    assert set(schema["required"]) == {"name", "city", "street", "phone", "item", "note"}
    assert request.headers["X-Specgate-Route"] == "extract"
    assert request.headers["X-Specgate-Labels"] == "tenant=a"
    assert request.headers["Authorization"] == "Bearer secret-token"
    assert "temperature" not in body  # the server's default unless asked


def test_temperature_is_sent_when_given() -> None:
    # vLLM's CPU build accepts no draft token when it samples: the testbed's traffic asks for greedy
    assert build_request(_plan(temperature=0.0), 0).body["temperature"] == 0.0
    assert build_request(_plan(temperature=0.7), 3).body["temperature"] == 0.7


def test_route_carrier_and_completions_endpoint() -> None:
    header_only = build_request(_plan(route_in="header", endpoint="completions"), 0)
    assert "metadata" not in header_only.body
    assert "X-Specgate-Route" in header_only.headers
    assert isinstance(header_only.body["prompt"], str)
    assert "messages" not in header_only.body
    assert _plan(endpoint="completions").path == "/v1/completions"
    metadata_only = build_request(_plan(route_in="metadata"), 0)
    assert "X-Specgate-Route" not in metadata_only.headers
    assert metadata_only.body["metadata"]["route"] == metadata_only.route


def test_synthetic_prompts_have_the_corpus_shapes() -> None:
    prompts = SyntheticPrompts(seed=3)
    rng = random.Random(1)
    extract = prompts.prompt("extract", rng)
    assert extract.startswith("extract: ")
    assert {"name", "city", "street", "phone", "item", "note"} <= set(json.loads(extract[len("extract: "):]))
    assert prompts.prompt("classify", rng).startswith("classify: ")
    assert prompts.prompt("chat", rng).startswith("chat: ")
    assert prompts.prompt("creative", rng).startswith("write: ")
    assert SyntheticPrompts(seed=3).prompt("chat", random.Random(5)) == prompts.prompt("chat", random.Random(5))
    with pytest.raises(KeyError):
        prompts.prompt("poetry", rng)


def test_a_corpus_module_as_prompt_source() -> None:
    corpus = types.ModuleType("corpus")

    class Lexicon:
        def __init__(self, seed: int) -> None:
            self.word = f"w{seed}"

    def poem(rng: random.Random, lex: Lexicon) -> Any:
        return types.SimpleNamespace(prompt=f"poem: {lex.word} {rng.randint(0, 9)}", completion="")

    corpus.Lexicon = Lexicon  # type: ignore[attr-defined]
    corpus.GENERATORS = {"poem": poem}  # type: ignore[attr-defined]
    source = CorpusPrompts(corpus, seed=42)
    plan = _plan(routes="poem", prompts=source)
    assert build_request(plan, 0).body["messages"][0]["content"].startswith("poem: w42 ")
    with pytest.raises(LoadgenError, match=r"^--routes: unknown route"):
        _plan(routes="chat", prompts=source)


def test_the_built_in_prompts_match_the_testbed_corpus_shapes() -> None:
    from testbed import corpus
    testbed, ours = load_prompt_source("testbed.corpus", corpus_seed=1), SyntheticPrompts()
    assert set(corpus.ROUTES) == set(ours.routes())
    for route in corpus.ROUTES:
        theirs, mine = testbed.prompt(route, random.Random(2)), ours.prompt(route, random.Random(2))
        assert theirs.split(":", 1)[0] == mine.split(":", 1)[0], route
    # an extraction record is written the same way (a JSON object) and holds the template's fields
    theirs, mine = (json.loads(source.prompt("extract", random.Random(3))[len("extract: "):])
                    for source in (testbed, ours))
    assert set(corpus.TEMPLATE_FIELDS) <= set(theirs)
    assert set(corpus.TEMPLATE_FIELDS) <= set(mine)
    assert tuple(corpus.TEMPLATE_FIELDS) == tuple(schema_for("extract")["required"])


def test_a_function_as_prompt_source_is_probed_per_route() -> None:
    def prompt(route: str, rng: random.Random) -> str:
        return {"chat": "chat: hello"}[route]

    source = FunctionPrompts(prompt, "m:prompt")
    assert build_request(_plan(routes="chat", prompts=source), 0).body["messages"][0]["content"] == "chat: hello"
    with pytest.raises(LoadgenError, match=r"^--routes: the prompt source has no route 'extract'"):
        _plan(routes="chat,extract", prompts=source)


def test_load_prompt_source_errors() -> None:
    assert isinstance(load_prompt_source(None), SyntheticPrompts)
    with pytest.raises(LoadgenError, match=r"^--prompts: cannot import"):
        load_prompt_source("no_such_module_here:f")
    with pytest.raises(LoadgenError, match=r"^--prompts: 'json' has no function 'nope'"):
        load_prompt_source("json:nope")
    with pytest.raises(LoadgenError, match=r"^--prompts: 'json' has neither GENERATORS"):
        load_prompt_source("json")
    assert isinstance(load_prompt_source("json:dumps"), FunctionPrompts)


# --- the report ---------------------------------------------------------------------------


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 95) == 95.0


def test_parse_decision() -> None:
    assert parse_decision("engine=draft; rule=chat-low-batch; policy=seed; revision=ab; explored=false") == {
        "engine": "draft", "rule": "chat-low-batch", "policy": "seed", "revision": "ab", "explored": "false"}
    assert parse_decision(None) == {}
    assert parse_decision("garbage") == {}


def _outcome(index: int, route: str, *, engine: str | None, error: str | None = None, latency: float = 0.1,
             stage: int = 0, **extra: Any) -> Outcome:
    return Outcome(index, f"r{index}", route, stage, False, False, 0.0, latency, 1, 200 if not error else 503,
                   error, engine=engine, **extra)


def test_summary_tallies_decisions_errors_and_latency() -> None:
    plan = _plan(routes="chat,extract", schedule="1:1s,4:1s", plain_engines=["base"])
    outcomes = [
        _outcome(0, "chat", engine="draft", latency=0.1, rule="chat-low-batch", drafted=12, accepted=6),
        _outcome(1, "chat", engine="draft", latency=0.3, rule="chat-low-batch", drafted=8, accepted=2),
        _outcome(2, "chat", engine="base", latency=0.2, stage=1, rule="default"),
        _outcome(3, "extract", engine="base", latency=0.4, stage=1, rule="default", fallback=True),
        _outcome(4, "extract", engine=None, error="connect", latency=0.01, stage=1),
        _outcome(5, "extract", engine="ngram", latency=0.5, stage=1, explored=True),
    ]
    summary = summarize(outcomes, plan, elapsed_s=2.0)
    assert summary["overall"]["requests"] == 6
    assert summary["overall"]["errors"] == 1
    assert summary["overall"]["requests_per_s"] == 3.0
    chat, extract = summary["routes"]["chat"], summary["routes"]["extract"]
    assert chat["p50_ms"] == 200.0
    assert chat["speculated_share"] == pytest.approx(2 / 3, abs=1e-4)
    assert chat["acceptance_rate"] == 0.4  # 8 accepted of 20 drafted
    assert extract["errors"] == 1
    assert extract["speculated_share"] == 0.5  # of the 2 requests with a decision: ngram yes, base no
    assert extract["p50_ms"] == 450.0  # errors do not count towards latency
    assert summary["engines"] == {"base": 2, "draft": 2, "ngram": 1}
    assert summary["rules"] == {"chat-low-batch": 2, "default": 2}
    assert summary["errors"] == {"connect": 1}
    assert summary["fallbacks"] == 1
    assert summary["explored"] == 1
    assert [s["requests"] for s in summary["stages"]] == [2, 4]
    assert [s["concurrency"] for s in summary["stages"]] == [1, 4]
    text = format_summary(summary)
    assert "6 requests in 2.0 s" in text
    assert "1 errors (16.7 %)" in text
    assert "engines: base 2, draft 2, ngram 1; fallbacks 1; explored 1" in text
    assert "errors: connect 1" in text
    json.dumps(summary)  # what --json prints


# --- runs against fake engines and a sidecar -----------------------------------------------


def _run(plan: LoadPlan, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(run_load(plan, **kwargs))


def test_through_a_sidecar_decisions_match_the_seed_policy(make_sidecar: SidecarFactory, draft: FakeEngine,
                                                             base: FakeEngine) -> None:
    base.content = '{"reply": "ok"}'
    sidecar = make_sidecar(expose_engine_metrics=True)
    plan = build_plan(url=sidecar.url, routes="chat", concurrency=1, requests=40, structured_share=0.25,
                      stream_share=0.5, max_tokens=16, run_id="via-sidecar")
    summary = _run(plan)
    events = sidecar.exporter.wait(40)
    overall = summary["overall"]
    assert overall["requests"] == 40
    assert overall["errors"] == 0
    assert draft.requests[0]["body"]["model"] == "fake-model"  # discovered through GET /v1/models
    # seed policy: chat at batch 1 speculates unless it asks for structured output
    structured = overall["structured"]
    assert 0 < structured < 40
    assert summary["engines"] == {"base": structured, "draft": 40 - structured}
    assert overall["speculated_share"] == pytest.approx((40 - structured) / 40, abs=1e-4)
    assert len(base.requests) == structured
    assert all("response_format" in r["body"] for r in base.requests)
    assert overall["streamed"] == sum(bool(r["body"].get("stream")) for r in draft.requests + base.requests)
    assert summary["routes"]["chat"]["valid_json_share"] == 1.0
    assert summary["routes"]["chat"]["acceptance_rate"] == pytest.approx(7 / 12, abs=1e-4)  # fake engine's metrics
    assert summary["rules"] == {"chat-low-batch": 40 - structured, "default": structured}
    # the sidecar saw the loadgen's request ids (unique) and routes
    ids = {event.request_id for event in events}
    assert ids == {f"lg-via-sidecar-{i:07d}" for i in range(40)}
    assert {event.route for event in events} == {"chat"}
    assert {event.batch_size for event in events} == {1}


@pytest.mark.parametrize("route_in", ["header", "metadata"])
def test_the_sidecar_classifies_the_route_from_either_carrier(make_sidecar: SidecarFactory, route_in: str) -> None:
    sidecar = make_sidecar()
    summary = _run(build_plan(url=sidecar.url, routes="extract=1,creative=1", requests=12, model="m",
                              route_in=route_in, run_id=route_in))
    assert summary["overall"]["errors"] == 0
    sent = {f"lg-{route_in}-{i:07d}": build_request(build_plan(routes="extract=1,creative=1", model="m",
                                                               run_id=route_in), i).route for i in range(12)}
    events = sidecar.exporter.wait(12)
    assert {event.request_id: event.route for event in events} == sent


def test_the_schedule_is_followed(make_sidecar: SidecarFactory, draft: FakeEngine, base: FakeEngine) -> None:
    draft.token_delay = base.token_delay = 0.01  # 5 tokens: ~40 ms a request
    sidecar = make_sidecar()
    # Stages long against a request (40 ms) and against a pause of the test process: late in a
    # full run on a busy machine, this process once stalled past a 0.5 s stage's deadline before
    # half its workers had started (3 requests at concurrency 6).
    plan = build_plan(url=sidecar.url, routes="chat", schedule="1:0.5s,6:1.5s", model="m", run_id="sched")
    started = time.perf_counter()
    summary = _run(plan)
    assert time.perf_counter() - started >= 2.0
    events = {event.request_id: event for event in sidecar.exporter.wait(summary["overall"]["requests"])}
    first, second = summary["stages"]
    assert first["requests"] >= 3
    assert second["requests"] >= 3 * 6
    assert first["max_inflight"] == 1
    assert second["max_inflight"] == 6
    # what the sidecar saw: never more in flight than the stage's concurrency
    index_stage = {f"lg-sched-{i:07d}": 0 for i in range(first["requests"] + second["requests"])}
    by_stage: dict[int, list[int]] = {0: [], 1: []}
    for n, rid in enumerate(sorted(index_stage)):
        by_stage[0 if n < first["requests"] else 1].append(events[rid].batch_size)
    assert max(by_stage[0]) == 1
    assert max(by_stage[1]) <= 6
    assert max(by_stage[1]) >= 5
    # and the policy's batch rule shows: all speculated alone, not all at concurrency 6
    assert first["speculated_share"] == 1.0
    assert second["speculated_share"] < 1.0


def test_errors_are_counted_by_kind(draft: FakeEngine) -> None:
    draft.fail_status = 503
    summary = _run(build_plan(url=draft.url, concurrency=2, requests=10, model="m"))
    assert summary["overall"]["requests"] == 10
    assert summary["overall"]["errors"] == 10
    assert summary["errors"] == {"http_503": 10}
    assert summary["overall"]["p50_ms"] is None
    refused = _run(build_plan(url=f"http://127.0.0.1:{closed_port()}", requests=4, model="m"))
    assert refused["errors"] == {"connect": 4}


def test_direct_to_an_engine_streams_and_usage(draft: FakeEngine) -> None:
    draft.token_delay = 0.005
    summary = _run(build_plan(url=draft.url, routes="creative,extract", concurrency=3, requests=24,
                              stream_share=1.0))
    overall = summary["overall"]
    assert overall["errors"] == 0
    assert overall["streamed"] == 24
    assert overall["ttft_p50_ms"] is not None
    assert overall["completion_tokens"] == 24 * 5
    assert overall["decided"] == 0  # no sidecar: no decision header
    assert overall["speculated_share"] is None
    assert overall["acceptance_rate"] == pytest.approx(7 / 12, abs=1e-4)  # the engine's own metrics
    sent = Counter(r["headers"]["x-specgate-route"] for r in draft.requests)
    assert set(sent) == {"creative", "extract"}
    assert all(r["body"]["metadata"]["route"] == r["headers"]["x-specgate-route"] for r in draft.requests)
    assert len({r["headers"]["x-request-id"] for r in draft.requests}) == 24


def test_a_stream_cut_short_is_an_error(draft: FakeEngine) -> None:
    draft.drop_after = 2
    summary = _run(build_plan(url=draft.url, requests=3, stream_share=1.0, model="m"))
    assert summary["overall"]["errors"] == 3
    assert set(summary["errors"]) <= {"incomplete_stream", "disconnected"}


def test_model_discovery_failure_names_the_option() -> None:
    with pytest.raises(LoadgenError, match=r"^--model: not given"):
        _run(build_plan(url=f"http://127.0.0.1:{closed_port()}", requests=1))


def test_stop_ends_a_run_early_with_a_report(draft: FakeEngine) -> None:
    draft.token_delay = 0.01
    lines: list[str] = []

    async def go() -> dict[str, Any]:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.4, stop.set)
        return await run_load(build_plan(url=draft.url, duration="60s", concurrency=2, model="m"), stop=stop,
                              on_progress=lines.append, report_every_s=0.1)

    started = time.perf_counter()
    summary = _run_in_thread(go)
    assert time.perf_counter() - started < 5
    assert summary["overall"]["requests"] > 0
    assert lines
    assert lines[0].startswith("[")
    assert "stage 1/1 c=2" in lines[0]


def _run_in_thread(factory: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(asyncio.run(factory())))
    thread.start()
    thread.join(10)
    return out


# --- the command ------------------------------------------------------------------------------


def test_cli_refuses_bad_options_naming_them() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["loadgen", "--schedule", "4:soon", "--url", "http://127.0.0.1:1"])
    assert result.exit_code == 2
    assert "--schedule stage 1: 'soon' is not a duration" in result.output
    result = runner.invoke(app, ["loadgen", "--stream-share", "2"])
    assert result.exit_code == 2
    assert "--stream-share: must be a share in [0, 1]" in result.output


def test_cli_runs_and_reports(draft: FakeEngine) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["loadgen", "--url", draft.url, "--requests", "8", "--concurrency", "2",
                                 "--routes", "chat=1,extract=1", "--report-every", "0", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["overall"]["requests"] == 8
    assert set(summary["routes"]) == {"chat", "extract"}
    draft.fail_status = 500
    failed = runner.invoke(app, ["loadgen", "--url", draft.url, "--requests", "4", "--model", "m",
                                 "--report-every", "0", "--max-error-rate", "0.5"])
    assert failed.exit_code == 1
    assert "errors: http_500 4" in failed.stdout
