"""LISTEN on PostgreSQL so a change committed by any replica wakes this one."""

from __future__ import annotations

import asyncio
import logging

import psycopg
from sqlalchemy.engine import make_url

from controlplane.distribution.hub import ChangeHub
from controlplane.distribution.publish import NOTIFY_CHANNEL

log = logging.getLogger("specgate.controlplane.listener")


def _libpq_url(sqlalchemy_url: str) -> str:
    url = make_url(sqlalchemy_url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


async def listen_for_changes(database_url: str, hub: ChangeHub, retry_s: float = 1.0) -> None:
    conninfo = _libpq_url(database_url)
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                # Anything committed while we were not listening: recompute once.
                hub.notify()
                async for notice in conn.notifies():
                    generation = int(notice.payload) if notice.payload.isdigit() else None
                    hub.notify(generation)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the database went away: keep trying, waiters time out meanwhile
            log.warning("change listener lost its connection (%s); retrying in %.1fs", exc, retry_s)
            await asyncio.sleep(retry_s)
