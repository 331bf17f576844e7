"""Engine and sessions. The schema itself comes only from Alembic migrations."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("specgate.controlplane")

# The files SQLite keeps beside a database in WAL or rollback-journal mode.
SQLITE_SIBLINGS = ("-wal", "-shm", "-journal")


def _private_sqlite_file(url: str) -> None:
    """Create a new SQLite database file readable by its owner only, before SQLite opens it.

    The database holds key hashes, the cohort secret and (without SPECGATE_SIGNING_KEY) the signing key;
    under the usual umask SQLite would create it world-readable. SQLite gives its -wal, -shm and -journal
    files the mode of the database file, so a 0600 database keeps them 0600 too; siblings left over from
    an earlier file are tightened here. An existing database keeps the mode its operator gave it.
    """
    parsed = make_url(url)
    path = parsed.database
    if not path or path == ":memory:" or path.startswith("file:") or parsed.query.get("mode") == "memory":
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            log.warning("the database file %s is readable by others (mode %o): chmod 600 it", path, mode)
        return
    except OSError:
        return  # a missing directory and the like: SQLite's own open says so, with its own message
    os.close(fd)
    os.chmod(path, 0o600)  # the umask may have taken bits away, never added: this only makes it exact
    for suffix in SQLITE_SIBLINGS:
        with suppress(FileNotFoundError):
            sibling = path + suffix
            os.chmod(sibling, stat.S_IMODE(os.stat(sibling).st_mode) & 0o600)


def make_engine(url: str, **kwargs: Any) -> Engine:
    if url.startswith("sqlite"):
        _private_sqlite_file(url)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            # WAL lets readers (long-polls, dashboards) proceed while a writer commits.
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20, **kwargs)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def unit_of_work(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: committed at the end of the block, rolled back on error.

    Services never commit; the endpoint (or CLI command) that owns the unit of
    work does, here.
    """
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
