"""The control plane's own commands: serve, migrate, mint the first key (they use the database directly).

The composition root (``specgate.cli``) mounts them on the ``specgate`` command.
"""

from __future__ import annotations

from typing import Annotated

import typer

from controlplane.auth.schemas import Scope
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry.cli import telemetry_app

db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)

__all__ = ["db_app", "keys_app", "serve", "telemetry_app"]


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
        typer.secho("error: --name must not be empty", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
    engine = make_engine(ControlPlaneSettings().database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            _, token = create_key(session, name=name, scope=scope, created_by="cli:local")
    finally:
        engine.dispose()
    typer.secho(f"created {scope.value} key '{name}' (shown once):", err=True)
    typer.echo(token)
