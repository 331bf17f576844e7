"""``specgate telemetry ...``: server-side commands on the telemetry store (they use the database directly)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

import typer

telemetry_app = typer.Typer(help="Telemetry store (works on the database directly).", no_args_is_help=True)


@telemetry_app.command("purge")
def purge(older_than_days: Annotated[int | None, typer.Option(
        "--older-than-days", min=0,
        help="delete telemetry older than this many days (default: SPECGATE_TELEMETRY_RETENTION_DAYS)")] = None,
          ) -> None:
    """Delete raw events, rollups and batch records older than the retention period.

    PostgreSQL drops raw events by whole day partitions (never row by row), up to the cutoff's day."""
    from controlplane.db import make_engine, make_sessionmaker, unit_of_work
    from controlplane.models import utcnow
    from controlplane.settings import ControlPlaneSettings
    from controlplane.telemetry import service

    settings = ControlPlaneSettings()
    days = settings.telemetry_retention_days if older_than_days is None else older_than_days
    cutoff = service.purge_cutoff(utcnow() - dt.timedelta(days=days))
    engine = make_engine(settings.database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            counts = service.purge(session, cutoff)
    finally:
        engine.dispose()
    typer.echo(f"purged telemetry before {cutoff.isoformat()} ({days} days): {counts.events} events, "
               f"{counts.rollups} rollup rows, {counts.histogram_rows} histogram rows, "
               f"{counts.batches} batch records")
    if counts.events_before is not None and (counts.partitions or counts.events_before != cutoff):
        # PostgreSQL: raw events go by whole day partitions, rollups with them
        dropped = ", ".join(counts.partitions) or "none"
        typer.echo(f"events and rollups before {counts.events_before.isoformat()} (whole days): "
                   f"{len(counts.partitions)} day partitions dropped ({dropped})")
