"""``specgate testbed``: the engine environment, the trained models, local vLLM engines and the sweep."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from testbed import corpus, engines, env, models, sweep

testbed_app = typer.Typer(help="Real vLLM (CPU build) engines with tiny trained models, for tests and demos.",
                          no_args_is_help=True)

VariantsArg = Annotated[list[str] | None, typer.Argument(help=f"engine variants ({', '.join(engines.VARIANTS)}), "
                                                              "or replicas of one (base-2, draft-3); default: all")]
PortOpt = Annotated[int, typer.Option("--base-port", help="port of `base`; ngram +1, draft +2; "
                                                          "replica -N: +3 per replica after the first")]


def _variants(names: list[str] | None) -> list[str]:
    chosen = names or list(engines.VARIANTS)
    for name in chosen:
        try:
            engines.variant_of(name)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return chosen


@testbed_app.command("env")
def env_cmd() -> None:
    """Create (or reuse) the engine virtualenv with the pinned vLLM CPU build; print its python."""
    t0 = time.monotonic()
    python = env.ensure_env()
    typer.echo(f"{python}  ({time.monotonic() - t0:.0f} s)")


@testbed_app.command("train")
def train_cmd(force: Annotated[bool, typer.Option("--force", help="retrain even when cached")] = False,
              misaligned: Annotated[bool, typer.Option(
                  "--misaligned-draft", help="also a draft trained with a tokenizer of its own (for "
                                             "`specgate check-pair` and bench.pair)")] = False) -> None:
    """Train (or reuse) the tokenizer, target and draft models; print where they are and how good they are.

    The pair's tokenizers are checked (pairs.tokenizers): a cache whose draft does not match its target fails."""
    try:
        paths = models.ensure_models(force=force)
    except RuntimeError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None
    typer.echo(f"target  {paths.target}\ndraft   {paths.draft}  (tokenizer aligned with the target)")
    if misaligned:
        typer.echo(f"misaligned draft  {models.ensure_misaligned_draft()}")
    report = paths.report
    if report:
        typer.echo(json.dumps({"seconds": report.get("seconds"), "quality": report.get("quality")}, indent=2))


@testbed_app.command("start")
def start_cmd(variants: VariantsArg = None, base_port: PortOpt = engines.DEFAULT_BASE_PORT,
              timeout: Annotated[float, typer.Option(help="seconds to wait for /health")] = 300.0) -> None:
    """Start engine variants (building the environment and models first if needed); print their URLs."""
    try:
        urls = engines.start(_variants(variants), base_port, timeout_s=timeout, quiet=False)
    except (RuntimeError, TimeoutError) as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from exc
    for name, url in urls.items():
        typer.echo(f"{name:6s} {url}")


@testbed_app.command("stop")
def stop_cmd(variants: VariantsArg = None) -> None:
    """Stop engines this testbed started (all, or the named ones)."""
    stopped = engines.stop(_variants(variants) if variants else None)
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@testbed_app.command("status")
def status_cmd(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The recorded engines, whether they live and answer /health; the environment and models."""
    state = engines.status()
    info = {"engine_python": str(env.venv_python()), "env_ready": env.is_ready(),
            "models": str(models.models_dir()), "models_ready": models.is_ready(), "engines": state}
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(f"environment  {'ready' if info['env_ready'] else 'missing'}  {info['engine_python']}")
    typer.echo(f"models       {'ready' if info['models_ready'] else 'missing'}  {info['models']}")
    if not state:
        typer.echo("engines      none recorded")
    for name, entry in state.items():
        health = "healthy" if entry["healthy"] else ("alive" if entry["alive"] else "gone")
        typer.echo(f"engine {name:6s} {entry['url']}  pid {entry['pid']}  {health}  log {entry['log']}")


@testbed_app.command("sweep")
def sweep_cmd(
    out: Annotated[Path, typer.Option("--out", help="directory for sweep.json and sweep.md")] = Path(
        "bench/results-testbed"),
    variants: Annotated[str, typer.Option(help="comma-separated variants")] = ",".join(engines.VARIANTS),
    routes: Annotated[str, typer.Option(help="comma-separated routes")] = ",".join(corpus.ROUTES),
    concurrency: Annotated[str, typer.Option(help="HTTP concurrency levels")] = ",".join(map(str, sweep.CONCURRENCY)),
    batches: Annotated[str, typer.Option(help="offline static batch sizes")] = ",".join(map(str, sweep.BATCHES)),
    per_cell: Annotated[int, typer.Option(help="requests per HTTP cell (at least 2 x concurrency)")] = 16,
    max_tokens: Annotated[int, typer.Option()] = sweep.MAX_TOKENS,
    base_port: PortOpt = engines.DEFAULT_BASE_PORT,
    http: Annotated[bool, typer.Option("--http/--no-http")] = True,
    offline: Annotated[bool, typer.Option("--offline/--no-offline")] = True,
    reps: Annotated[int, typer.Option(help="timed offline runs per cell; the fastest counts")] = 2,
) -> None:
    """Measure tokens/s, ITL, TTFT and acceptance per variant and route (HTTP and offline); write JSON + markdown."""
    unknown = [r for r in routes.split(",") if r not in corpus.ROUTES]
    if unknown:
        raise typer.BadParameter(f"unknown route(s) {', '.join(unknown)}; known: {', '.join(corpus.ROUTES)}")
    result = sweep.run(out, variants=_variants(variants.split(",")), routes=routes.split(","),
                       concurrencies=[int(c) for c in concurrency.split(",")],
                       batches=[int(b) for b in batches.split(",")], per_cell=per_cell, max_tokens=max_tokens,
                       base_port=base_port, http=http, offline=offline, reps=reps)
    typer.echo(sweep.markdown(result))
    typer.echo(f"raw results: {out / 'sweep.json'}")
