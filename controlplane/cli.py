"""The ``specgate`` command line.

Server-side commands (``serve``, ``db``, ``keys create``) work on the database
directly; everything else talks to a running control plane over its REST API
(``--url``/``SPECGATE_URL``, ``--key``/``SPECGATE_KEY``).

Exit codes: 0 done, 1 the control plane refused (4xx/5xx, message printed),
2 bad usage or input file, 3 the control plane could not be reached.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
import yaml

from controlplane.analysis.cli import analysis_app, recommend_app
from controlplane.auth.schemas import Scope
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry.cli import telemetry_app
from testbed.cli import testbed_app

app = typer.Typer(help="specgate: per-request speculative decoding control plane.", no_args_is_help=True,
                  add_completion=False)
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
rollout_app = typer.Typer(help="Roll a revision out step by step.", no_args_is_help=True)
killswitch_app = typer.Typer(help="Fleet-wide kill switch for speculation.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(rollout_app, name="rollout")
app.add_typer(killswitch_app, name="killswitch")
app.add_typer(telemetry_app, name="telemetry")
app.add_typer(analysis_app, name="analysis")
app.add_typer(recommend_app, name="recommend")
app.add_typer(testbed_app, name="testbed")

UrlOpt = Annotated[str, typer.Option("--url", envvar="SPECGATE_URL", help="control plane base URL")]
KeyOpt = Annotated[str, typer.Option("--key", envvar="SPECGATE_KEY", help="API key (sgk_...)")]
DEFAULT_URL = "http://127.0.0.1:8080"
JsonOpt = Annotated[bool, typer.Option("--json", help="print the raw JSON answer")]


def _fail(message: str, code: int) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


class Api:
    def __init__(self, url: str, key: str) -> None:
        if not key:
            _fail("no API key: pass --key or set SPECGATE_KEY", 2)
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=30.0,
                                   headers={"Authorization": f"Bearer {key}"})

    def call(self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201), **kwargs: Any) -> httpx.Response:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            _fail(f"cannot reach the control plane at {self.client.base_url}: {exc}", 3)
        if response.status_code not in ok:
            _fail(_problem_text(response), 1)
        return response


def _problem_text(response: httpx.Response) -> str:
    try:
        problem = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:500]}"
    text = f"{problem.get('title', 'HTTP ' + str(response.status_code))}: {problem.get('detail', '')}"
    for err in problem.get("errors", []) or []:
        line = f" (line {err['line']})" if err.get("line") else ""
        text += f"\n  {err.get('path') or '<document>'}{line}: {err.get('message')} [{err.get('code')}]"
    if "state" in problem:
        text += f"\n  current state: {problem['state']}"
    return text


def _print(data: Any, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        typer.echo(yaml.safe_dump(data, sort_keys=False, default_flow_style=False).rstrip())


# --- server side -------------------------------------------------------------------

@app.command()
def serve(host: Annotated[str, typer.Option()] = "127.0.0.1",
          port: Annotated[int, typer.Option()] = 8080,
          migrate: Annotated[bool, typer.Option(help="upgrade the schema before serving")] = True) -> None:
    """Run the control plane (settings from SPECGATE_* environment variables)."""
    import uvicorn

    from controlplane.app import create_app
    from controlplane.migrations_state import upgrade

    settings = ControlPlaneSettings()
    if migrate:
        upgrade(settings.database_url)
    # Long-polls (up to long_poll_max_s) and change streams never end on their own: without a bound, SIGTERM
    # would wait for them. After it, they are cancelled (workers reconnect) and the lifespan shutdown runs.
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Migrate the schema up (to head by default)."""
    from controlplane.migrations_state import upgrade

    upgrade(ControlPlaneSettings().database_url, revision)
    typer.echo(f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()]) -> None:
    """Migrate the schema down (e.g. to base)."""
    from controlplane.migrations_state import downgrade

    downgrade(ControlPlaneSettings().database_url, revision)
    typer.echo(f"database at {revision}")


@db_app.command("current")
def db_current() -> None:
    """Show the schema revision and the code's head."""
    from controlplane.db import make_engine
    from controlplane.migrations_state import migration_status

    engine = make_engine(ControlPlaneSettings().database_url)
    try:
        current, head = migration_status(engine)
    finally:
        engine.dispose()
    typer.echo(f"current: {current}\nhead:    {head}")
    if current != head:
        raise typer.Exit(1)


@keys_app.command("create")
def keys_create(scope: Annotated[Scope, typer.Option(help="admin, operator, worker or viewer")],
                name: Annotated[str, typer.Option(help="who or what uses the key")]) -> None:
    """Create a key directly in the database (how the first admin key is made).

    The token is printed once, on stdout; only its hash is stored.
    """
    from controlplane.auth.service import create_key
    from controlplane.db import make_engine, make_sessionmaker, unit_of_work

    if not name.strip():
        _fail("--name must not be empty", 2)
    engine = make_engine(ControlPlaneSettings().database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            _, token = create_key(session, name=name, scope=scope, created_by="cli:local")
    finally:
        engine.dispose()
    typer.secho(f"created {scope.value} key '{name}' (shown once):", err=True)
    typer.echo(token)


# --- client side -------------------------------------------------------------------

@app.command()
def apply(file: Annotated[Path, typer.Option("-f", "--file", help="policy document (YAML or JSON)")],
          message: Annotated[str, typer.Option("-m", "--message")] = "",
          pool: Annotated[str | None, typer.Option(help="pool, when the policy is created")] = None,
          url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Create a revision if the document changed, and print the diff (GitOps)."""
    from policies import PolicyValidationError, load_policy

    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        _fail(f"cannot read {file}: {exc}", 2)
    try:
        document = load_policy(text)
    except PolicyValidationError as exc:
        lines = "\n".join(f"  {e}" for e in exc.errors)
        _fail(f"{file} is invalid:\n{lines}", 2)
    api = Api(url, key)
    name = document.name
    found = api.call("GET", f"/v1/policies/{name}", ok=(200, 404))
    if found.status_code == 404:
        api.call("POST", "/v1/policies", json={"name": name, "pool": pool, "description": document.description})
        typer.echo(f"created policy {name}")
        head = None
    else:
        head = found.json().get("head_revision_id")
    headers = {"Content-Type": "application/yaml"}
    if head:
        headers["If-Match"] = f'"{head}"'
    created = api.call("POST", f"/v1/policies/{name}/revisions", content=text.encode(), headers=headers,
                       params={"message": message} if message else None)
    revision = created.json()
    if created.status_code == 200:
        typer.echo(f"unchanged: {name} is already at revision {revision['id'][:12]}")
        return
    typer.echo(f"revision {revision['id'][:12]} (#{revision['seq']}) of {name} created")
    if head:
        diff = api.call("GET", f"/v1/policies/{name}/diff", params={"from": head, "to": revision["id"]}).json()
        typer.echo(diff["unified"].rstrip())


@rollout_app.command("start")
def rollout_start(policy: str, revision: str,
                  reason: Annotated[str, typer.Option(help="why (the API requires one)")],
                  steps: Annotated[str, typer.Option(help="percents, e.g. 10,50,100")] = "10,50,100",
                  mode: Annotated[str, typer.Option(help="workers or traffic")] = "traffic",
                  pool: Annotated[str | None, typer.Option()] = None,
                  label: Annotated[list[str] | None, typer.Option(help="k=v, repeatable")] = None,
                  as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Start rolling REVISION of POLICY out."""
    try:
        percents = [float(s) for s in steps.split(",") if s.strip()]
    except ValueError:
        _fail(f"--steps must be comma-separated numbers, got {steps!r}", 2)
    labels: dict[str, str] = {}
    for item in label or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            _fail(f"--label must be k=v, got {item!r}", 2)
        labels[k] = v
    target: dict[str, Any] = {}
    if pool:
        target["pool"] = pool
    if labels:
        target["labels"] = labels
    body = {"policy": policy, "revision": revision, "mode": mode, "steps": percents, "target": target,
            "reason": reason}
    _print(Api(url, key).call("POST", "/v1/rollouts", json=body).json(), as_json)


def _transition(action: str, rollout_id: str, reason: str, url: str, key: str, as_json: bool) -> None:
    _print(Api(url, key).call("POST", f"/v1/rollouts/{rollout_id}/{action}", json={"reason": reason}).json(),
           as_json)


@rollout_app.command("promote")
def rollout_promote(rollout_id: str, reason: Annotated[str, typer.Option()] = "", as_json: JsonOpt = False,
                    url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Move a rollout to its next step (or complete it)."""
    _transition("promote", rollout_id, reason, url, key, as_json)


@rollout_app.command("pause")
def rollout_pause(rollout_id: str, reason: Annotated[str, typer.Option()] = "", as_json: JsonOpt = False,
                  url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Hold a rollout at its current step."""
    _transition("pause", rollout_id, reason, url, key, as_json)


@rollout_app.command("resume")
def rollout_resume(rollout_id: str, reason: Annotated[str, typer.Option()] = "", as_json: JsonOpt = False,
                   url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Resume a paused rollout."""
    _transition("resume", rollout_id, reason, url, key, as_json)


@rollout_app.command("abort")
def rollout_abort(rollout_id: str, reason: Annotated[str, typer.Option()], as_json: JsonOpt = False,
                  url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Stop a rollout; the policy stays on its active revision."""
    _transition("abort", rollout_id, reason, url, key, as_json)


@rollout_app.command("status")
def rollout_status(rollout_id: Annotated[str | None, typer.Argument()] = None,
                   policy: Annotated[str | None, typer.Option()] = None, as_json: JsonOpt = False,
                   url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Show one rollout, or the rollouts of a policy (newest first)."""
    api = Api(url, key)
    if rollout_id:
        _print(api.call("GET", f"/v1/rollouts/{rollout_id}").json(), as_json)
    else:
        _print(api.call("GET", "/v1/rollouts", params={"policy": policy} if policy else None).json(), as_json)


@app.command()
def rollback(policy: str, revision: str, reason: Annotated[str, typer.Option()],
             as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Make REVISION the active revision of POLICY now (ends any rollout of it)."""
    _print(Api(url, key).call("POST", f"/v1/policies/{policy}/rollback",
                              json={"revision": revision, "reason": reason}).json(), as_json)


def _killswitch(enabled: bool, reason: str, url: str, key: str, as_json: bool) -> None:
    _print(Api(url, key).call("PUT", "/v1/killswitch", json={"enabled": enabled, "reason": reason}).json(),
           as_json)


@killswitch_app.command("on")
def killswitch_on(reason: Annotated[str, typer.Option()], as_json: JsonOpt = False,
                  url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Turn speculation off fleet-wide (engines keep running)."""
    _killswitch(True, reason, url, key, as_json)


@killswitch_app.command("off")
def killswitch_off(reason: Annotated[str, typer.Option()], as_json: JsonOpt = False,
                   url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Let policies decide again."""
    _killswitch(False, reason, url, key, as_json)


@killswitch_app.command("status")
def killswitch_status(as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Show the kill switch."""
    _print(Api(url, key).call("GET", "/v1/killswitch").json(), as_json)


@app.command()
def workers(pool: Annotated[str | None, typer.Option()] = None, as_json: JsonOpt = False,
            url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """The fleet: which revision each worker runs and whether it converged."""
    api = Api(url, key)
    fleet = api.call("GET", "/v1/fleet").json()
    items: list[dict[str, Any]] = []
    params: dict[str, str] = {"pool": pool} if pool else {}
    while True:  # every page: the API gives at most `limit` workers at a time
        page = api.call("GET", "/v1/workers", params=params).json()
        items.extend(page["items"])
        if not page.get("next_cursor"):
            break
        params["cursor"] = page["next_cursor"]
    if as_json:
        _print({"fleet": fleet, "workers": items}, True)
        return
    typer.echo(f"converged: {fleet['overall']['converged']}")
    for w in items:
        mark = "stale" if w.get("stale") else ("ok" if w.get("converged") else "converging")
        typer.echo(f"{w['id']:<32} pool={w['pool']:<16} etag={str(w.get('active_etag'))[:12]:<12} "
                   f"expected={str(w.get('expected_etag'))[:12]:<12} {mark}")


def _register_up() -> None:
    from controlplane.devrun import up

    app.command(help="Bring the product up locally (what `make run` runs).")(up)


_register_up()


def _register_sidecar() -> None:
    from sidecar.cli import sidecar

    app.command(name="sidecar")(sidecar)


_register_sidecar()


def _register_loadgen() -> None:
    from sidecar.loadgen_cli import loadgen

    app.command(name="loadgen")(loadgen)


_register_loadgen()


def _register_dashboard() -> None:
    from dashboard.cli import dashboard

    app.command(name="dashboard")(dashboard)


_register_dashboard()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
