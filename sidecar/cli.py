"""``specgate sidecar``: run the worker sidecar (registered on the ``specgate`` command line).

Options override the ``SPECGATE_*`` environment (see :class:`sidecar.settings.SidecarSettings`);
repeatable options given on the command line replace the environment's value as a whole.
Kept light: the sidecar's modules are imported only when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def _engines(values: list[str] | None) -> dict[str, list[str]] | None:
    """``--engine NAME=URL`` repeatable, and ``NAME=URL1,URL2``: each name's replicas in the order given."""
    if not values:
        return None
    out: dict[str, list[str]] = {}
    for item in values:
        name, sep, urls = item.partition("=")
        replicas = [url.strip() for url in urls.split(",")]
        if not sep or not name.strip() or not all(replicas):
            _fail(f"--engine must be NAME=URL or NAME=URL1,URL2, got {item!r}")
        out.setdefault(name.strip(), []).extend(replicas)
    return out


def _pairs(values: list[str] | None, option: str, what: str) -> dict[str, str] | None:
    if not values:
        return None
    out: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            _fail(f"{option} must be {what}, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _read_key(path: Path) -> str:
    try:
        key = path.read_text().strip()
    except OSError as exc:
        _fail(f"cannot read the worker key from {path}: {exc.strerror or exc}")
    if not key:
        _fail(f"the worker key file {path} is empty")
    return key


def build_settings(**options: Any) -> Any:
    """SidecarSettings from the environment, overridden by the options that were given."""
    from pydantic import ValidationError

    from sidecar.settings import SidecarSettings

    given = {name: value for name, value in options.items() if value is not None}
    try:
        return SidecarSettings(**given)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        _fail(f"invalid sidecar settings: {problems}")


def sidecar(
    control_plane: Annotated[str | None, typer.Option("--control-plane", help="control plane base URL")] = None,
    key: Annotated[str | None, typer.Option("--key", help="worker API key (sgk_...); visible to every user in "
                                            "`ps`: prefer --key-file or SPECGATE_KEY")] = None,
    key_file: Annotated[Path | None, typer.Option("--key-file", help="file holding the worker API key "
                                                  "(mode 0600)")] = None,
    engine: Annotated[list[str] | None, typer.Option("--engine", help="NAME=URL of an engine variant's "
                                                     "OpenAI-compatible server; repeatable: a name given twice, "
                                                     "or NAME=URL1,URL2, is a pool of replicas")] = None,
    kind: Annotated[str | None, typer.Option("--kind", help="worker (beside its engines, which share its "
                                             "accelerator) or gateway (in front of replica pools on other "
                                             "hosts; batch per replica)")] = None,
    batch_scope: Annotated[str | None, typer.Option("--batch-scope", help="auto, worker or replica: which "
                                                    "requests a rule's batch size counts (auto: replica for "
                                                    "a gateway)")] = None,
    listen: Annotated[str | None, typer.Option("--listen", help="HOST:PORT to serve on")] = None,
    pool: Annotated[str | None, typer.Option("--pool", help="the pool whose policy this worker runs")] = None,
    label: Annotated[list[str] | None, typer.Option("--label", help="k=v, repeatable")] = None,
    route: Annotated[list[str] | None, typer.Option("--route", help="PATH_OR_MODEL=ROUTE for requests "
                                                    "that name no route; repeatable")] = None,
    state_dir: Annotated[Path | None, typer.Option("--state-dir", help="last-known-good bundle and "
                                                   "telemetry spool")] = None,
    public_key: Annotated[list[str] | None, typer.Option("--public-key", help="trusted bundle key (base64); "
                                                         "repeatable. Without one the control plane's key is "
                                                         "pinned on first use; configure it in production")] = None,
    worker_id: Annotated[str | None, typer.Option("--worker-id", help="stable worker id "
                                                  "(default HOST:PORT of --listen)")] = None,
    supervise: Annotated[Path | None, typer.Option("--supervise", help="YAML naming the engines this sidecar "
                                                   "starts itself (command, model path, port, binding, "
                                                   "arguments) and restarts when the policy changes their "
                                                   "speculative arguments; their URLs replace --engine")] = None,
    quality_check: Annotated[str | None, typer.Option("--quality-check", help="MODULE:FUNCTION: a check of "
                                                      "shadow comparisons (policy quality) of your own, called "
                                                      "as check(request, served, plain) -> bool or (bool, "
                                                      "reason)")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error")] = "info",
) -> None:
    """Run the worker sidecar: policy sync, per-request decisions, proxying, telemetry.

    Every option can also come from the environment: SPECGATE_CONTROL_PLANE, SPECGATE_KEY, SPECGATE_KEY_FILE,
    SPECGATE_ENGINES='{"base": "http://...", "draft": ["http://a...", "http://b..."]}', SPECGATE_KIND,
    SPECGATE_BATCH_SCOPE, SPECGATE_EJECT_AFTER, SPECGATE_PROBE_INITIAL_S, SPECGATE_PROBE_MAX_S,
    SPECGATE_MAX_QUEUE, SPECGATE_AFFINITY_SLACK, SPECGATE_LISTEN, SPECGATE_POOL, SPECGATE_LABELS,
    SPECGATE_ROUTES, SPECGATE_STATE_DIR, SPECGATE_PUBLIC_KEYS='["..."]', SPECGATE_WORKER_ID,
    SPECGATE_QUALITY_CHECK, SPECGATE_SHADOW_MAX_IN_FLIGHT, SPECGATE_SHADOW_TIMEOUT_S.
    OpenTelemetry export is on when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    """
    settings = build_settings(
        control_plane=control_plane, key=key, key_file=key_file, engines=_engines(engine), supervise=supervise,
        kind=kind, batch_scope=batch_scope,
        listen=listen, pool=pool, labels=_pairs(label, "--label", "k=v"),
        routes=_pairs(route, "--route", "PATH_OR_MODEL=ROUTE"), state_dir=state_dir, public_keys=public_key or None,
        worker_id=worker_id, quality_check=quality_check)
    if not settings.engines:
        _fail("no engines: pass --engine NAME=URL (or set SPECGATE_ENGINES)")
    if not settings.key and settings.key_file is not None:
        settings.key = _read_key(settings.key_file)
    if not settings.key:
        _fail("no worker key: set SPECGATE_KEY or SPECGATE_KEY_FILE, or pass --key-file")
    if settings.quality_check:
        from sidecar.shadow import QualityCheckError, load_check

        try:
            load_check(settings.quality_check)
        except QualityCheckError as exc:
            _fail(str(exc))
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        _fail(f"--log-level must be debug, info, warning or error, got {log_level!r}")

    from sidecar.main import run

    run(settings, log_level=log_level.lower())
