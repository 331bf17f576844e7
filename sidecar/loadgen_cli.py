"""``specgate loadgen``: the traffic generator's command line (registered on the ``specgate`` command line).

Kept light: :mod:`sidecar.loadgen` and aiohttp are imported only when the command runs.
Exit codes: 0 done, 1 the share of failed requests was above ``--max-error-rate``,
2 bad options (the message names the option) or the server could not be asked for a model.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, NoReturn

import typer


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def loadgen(
    url: Annotated[str, typer.Option("--url", help="base URL of the sidecar (or any OpenAI-compatible server)")]
    = "http://127.0.0.1:9000",
    routes: Annotated[str | None, typer.Option("--routes", help="route mix ROUTE=WEIGHT,... "
                                               "(default extract, classify, chat, creative equally)")] = None,
    schedule: Annotated[str | None, typer.Option("--schedule", help="concurrency schedule CONCURRENCY:DURATION,..., "
                                                 "e.g. 1:30s,4:30s,16:30s")] = None,
    concurrency: Annotated[int | None, typer.Option("--concurrency", help="requests in flight, without "
                                                    "--schedule (default 4)")] = None,
    duration: Annotated[str | None, typer.Option("--duration", help="how long, without --schedule (default 30s, "
                                                 "or until --requests are sent)")] = None,
    requests: Annotated[int | None, typer.Option("--requests", help="stop after this many requests")] = None,
    structured_share: Annotated[float, typer.Option("--structured-share", help="share of requests with "
                                                    "response_format json_schema, in [0, 1]")] = 0.0,
    stream_share: Annotated[float, typer.Option("--stream-share", help="share of streaming requests (with "
                                                "include_usage), in [0, 1]")] = 0.0,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    temperature: Annotated[float | None, typer.Option("--temperature", help="sampling temperature sent with "
                                                      "every request (default: none sent, the server's default; "
                                                      "0 is greedy)")] = None,
    endpoint: Annotated[str, typer.Option("--endpoint", help="chat (/v1/chat/completions) or completions")] = "chat",
    model: Annotated[str | None, typer.Option("--model", help="model name (default: the first of /v1/models)")]
    = None,
    seed: Annotated[int, typer.Option("--seed", help="the same seed sends the same requests")] = 0,
    run_id: Annotated[str | None, typer.Option("--run-id", help="part of every X-Request-Id (default random)")]
    = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds one request may take")] = 120.0,
    label: Annotated[list[str] | None, typer.Option("--label", help="k=v sent as X-Specgate-Labels; "
                                                    "repeatable")] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="SPECGATE_LOADGEN_API_KEY",
                                                help="bearer token for servers that want one")] = None,
    plain_engine: Annotated[list[str] | None, typer.Option("--plain-engine", help="engine names that do not "
                                                           "speculate (default base); repeatable")] = None,
    route_in: Annotated[str, typer.Option("--route-in", help="where the route travels: both, header "
                                          "(X-Specgate-Route) or metadata (metadata.route)")] = "both",
    prompts: Annotated[str | None, typer.Option("--prompts", help="prompt source: MODULE:FUNCTION(route, rng) "
                                                "or a corpus MODULE with GENERATORS and Lexicon")] = None,
    corpus_seed: Annotated[int, typer.Option("--corpus-seed", help="seed of the prompt language")] = 0,
    report_every: Annotated[float, typer.Option("--report-every", help="seconds between live lines on "
                                                "stderr; 0 for none")] = 5.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    max_error_rate: Annotated[float, typer.Option("--max-error-rate", help="exit 1 when a larger share of "
                                                  "requests failed")] = 1.0,
    repeat: Annotated[bool, typer.Option("--loop", help="run the schedule again and again (a new seed and run id "
                                       "each round) until Ctrl-C; the report covers the last round")] = False,
) -> None:
    """Send a route mix of OpenAI requests on a concurrency schedule; report latency, errors, speculation.

    Every request carries its route as the X-Specgate-Route header and metadata.route and a
    unique X-Request-Id; the share speculated comes from the sidecar's X-Specgate-Decision
    header. Ctrl-C stops early and still prints the report.
    """
    import asyncio
    import contextlib
    import json
    import signal
    from dataclasses import replace

    from sidecar.loadgen import LoadgenError, build_plan, format_summary, load_prompt_source, run_load

    if report_every < 0:
        _fail(f"--report-every: must be >= 0, got {report_every}")
    if not 0.0 <= max_error_rate <= 1.0:
        _fail(f"--max-error-rate: must be a share in [0, 1], got {max_error_rate}")
    try:
        plan = build_plan(url=url, routes=routes, schedule=schedule, concurrency=concurrency, duration=duration,
                          requests=requests, structured_share=structured_share, stream_share=stream_share,
                          max_tokens=max_tokens, endpoint=endpoint, model=model, seed=seed, run_id=run_id,
                          timeout_s=timeout, labels=label or (), api_key=api_key,
                          plain_engines=plain_engine or ("base",), route_in=route_in,
                          prompts=load_prompt_source(prompts, corpus_seed=corpus_seed), temperature=temperature)
    except LoadgenError as exc:
        _fail(str(exc))

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    async def main() -> dict[str, Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            # outside the main thread (or on Windows) signals stay with the default handlers
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        current, round_number = plan, 1
        while True:
            summary = await run_load(current, on_progress=progress, report_every_s=report_every, stop=stop)
            if not repeat or stop.is_set():
                return summary
            progress(f"round {round_number}: " + format_summary(summary).splitlines()[0])
            # Fresh request ids each round: the same ids would be the same requests to an idempotent telemetry store.
            current = replace(plan, seed=plan.seed + round_number, run_id=f"{plan.run_id}r{round_number}")
            round_number += 1

    stages = ", ".join(f"{s.concurrency} for {s.duration_s:g}s" if s.duration_s else f"{s.concurrency}"
                       for s in plan.stages)
    progress(f"loadgen {plan.run_id}: {plan.url}{plan.path}, concurrency {stages}"
             + (f", at most {plan.requests} requests" if plan.requests else "")
             + (", looping until stopped" if repeat else ""))
    try:
        summary = asyncio.run(main())
    except LoadgenError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(summary, indent=2, sort_keys=True) if as_json else format_summary(summary))
    overall = summary["overall"]
    if overall["requests"] and overall["errors"] / overall["requests"] > max_error_rate:
        raise typer.Exit(1)
