"""The control plane's own commands: serve, migrate, mint the first key (they use the database directly).

The composition root (``specgate.cli``) mounts them on the ``specgate`` command.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from controlplane.auth.schemas import Scope
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry.cli import telemetry_app

db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
signing_key_app = typer.Typer(help="The bundle signing key kept in the database (embedded default).",
                              no_args_is_help=True)
generation_app = typer.Typer(help="The distribution generation that sidecars refuse to go back on.",
                             no_args_is_help=True)

__all__ = ["db_app", "generation_app", "keys_app", "serve", "signing_key_app", "telemetry_app"]


# Seconds an idle client connection is kept open (see serve).
KEEP_ALIVE_S = 20

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
    # Idle keep-alive connections are kept longer than the sidecar's client keeps them (aiohttp: 15 s), so the
    # client always closes first. With uvicorn's 5 s a sidecar heartbeating every 5 s reused a connection as
    # the server closed it, and lost that heartbeat (1 in 10 in bench/fleet.py).
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info", timeout_graceful_shutdown=5,
                timeout_keep_alive=KEEP_ALIVE_S)


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
                name: Annotated[str, typer.Option(help="who or what uses the key")],
                pool: Annotated[str | None, typer.Option(help="worker keys: bind to this pool")] = None,
                worker: Annotated[list[str] | None, typer.Option(
                    help="worker keys: bind to this worker id (repeatable)")] = None) -> None:
    """Create a key directly in the database (how the first admin key is made).

    The token is printed once, on stdout; only its hash is stored. A worker key given neither --pool nor
    --worker binds itself to the first worker it registers.
    """
    from controlplane.auth.service import create_key
    from controlplane.db import make_engine, make_sessionmaker, unit_of_work
    from controlplane.errors import ValidationFailed

    if not name.strip():
        typer.secho("error: --name must not be empty", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    engine = make_engine(ControlPlaneSettings().database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            _, token = create_key(session, name=name, scope=scope, created_by="cli:local", pool=pool,
                                  worker_ids=worker or None)
    except ValidationFailed as exc:
        typer.secho(f"error: {exc.detail} (--pool and --worker are for --scope worker)", err=True,
                    fg=typer.colors.RED)
        raise typer.Exit(2) from None
    finally:
        engine.dispose()
    bound = f" bound to pool {pool!r}" if pool else ""
    bound += f" bound to workers {', '.join(worker)}" if worker else ""
    typer.secho(f"created {scope.value} key '{name}'{bound} (shown once):", err=True)
    typer.echo(token)



def _change_embedded_keys(action: str, change: Callable[[Any], str]) -> None:
    """Apply ``change`` to fleet_state's signing keys under a row lock, audited, and print what it says."""
    from controlplane.audit.service import record
    from controlplane.db import make_engine, make_sessionmaker, unit_of_work
    from controlplane.models import FleetState
    from policies import SigningKey

    def key_id(private_b64: str | None) -> str | None:
        return SigningKey.from_b64(private_b64).key_id if private_b64 else None

    settings = ControlPlaneSettings()
    if settings.signing_key:
        typer.secho("warning: SPECGATE_SIGNING_KEY is set, so the control plane ignores the key in the "
                    "database; rotate by setting SPECGATE_SIGNING_KEY_PREVIOUS to the old key and "
                    "SPECGATE_SIGNING_KEY to the new one", err=True, fg=typer.colors.YELLOW)
    engine = make_engine(settings.database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            state = session.get(FleetState, 1, with_for_update=True)
            if state is None:
                typer.secho("error: the database has no fleet_state row: run the migrations first", err=True,
                            fg=typer.colors.RED)
                raise typer.Exit(1)
            before = {"current": key_id(state.signing_key), "previous": key_id(state.previous_signing_key)}
            message = change(state)
            after = {"current": key_id(state.signing_key), "previous": key_id(state.previous_signing_key)}
            # Only key ids are audited: the private keys never leave fleet_state.
            record(session, actor="cli:local", action=action, target_type="signing_key", target_id="fleet",
                   before=before, after=after)
    finally:
        engine.dispose()
    typer.echo(message)
    typer.secho("restart the control plane processes to sign with the new key set", err=True)


@signing_key_app.command("rotate")
def signing_key_rotate() -> None:
    """Make the current embedded key the previous one and generate a new current one.

    Bundles are then signed with both, so sidecars pinned to either accept them; update the sidecars'
    SPECGATE_PUBLIC_KEYS to the new key, then run drop-previous.
    """
    from policies import SigningKey

    def rotate(state: Any) -> str:
        new = SigningKey.generate()
        state.previous_signing_key, state.signing_key = state.signing_key, new.private_key_b64()
        return f"new current signing key {new.key_id}, public key {new.public_key_b64}"

    _change_embedded_keys("signing_key.rotate", rotate)


@signing_key_app.command("drop-previous")
def signing_key_drop_previous() -> None:
    """Stop signing with the previous embedded key: sidecars that trust only it refuse new bundles."""

    def drop(state: Any) -> str:
        if not state.previous_signing_key:
            return "no previous signing key to drop"
        state.previous_signing_key = None
        return "dropped the previous signing key"

    _change_embedded_keys("signing_key.drop_previous", drop)


@signing_key_app.command("generate")
def signing_key_generate() -> None:
    """Print a new private key for SPECGATE_SIGNING_KEY (stdout) and its public key (stderr); stores nothing."""
    from policies import SigningKey

    key = SigningKey.generate()
    typer.secho(f"public key {key.public_key_b64} (key id {key.key_id}); private key:", err=True)
    typer.echo(key.private_key_b64())


@generation_app.command("show")
def generation_show() -> None:
    """Print the current distribution generation."""
    from controlplane.db import make_engine, make_sessionmaker
    from controlplane.models import FleetState

    engine = make_engine(ControlPlaneSettings().database_url)
    try:
        with make_sessionmaker(engine)() as session:
            state = session.get(FleetState, 1)
    finally:
        engine.dispose()
    if state is None:
        typer.secho("error: the database has no fleet_state row: run the migrations first", err=True,
                    fg=typer.colors.RED)
        raise typer.Exit(1)
    typer.echo(str(state.generation))


@generation_app.command("raise")
def generation_raise(
        at_least: Annotated[int, typer.Option(min=0, help="the new generation is at least this (e.g. the "
                                                            "highest a sidecar reports refusing below)")] = 0,
        reason: Annotated[str, typer.Option(help="why, for the audit trail")] = "") -> None:
    """Raise the generation past what sidecars accepted before (after restoring the database from a backup).

    Sidecars refuse bundles older than the highest generation they accepted (a replay). Every change
    already floors its generation to the clock; this makes one now, without changing a policy, so every
    worker fetches and accepts the restored state. Waiting sidecars hear of it within their poll interval.
    """
    from controlplane.db import make_engine, make_sessionmaker, unit_of_work
    from controlplane.distribution.service import raise_generation

    engine = make_engine(ControlPlaneSettings().database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            before, after = raise_generation(session, at_least=at_least, actor="cli:local", reason=reason)
    except LookupError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None
    finally:
        engine.dispose()
    typer.echo(f"generation {before} -> {after}")
