"""Small pieces the sidecar shares: backoff with jitter, durable file writes, waking a waiter."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path


class Backoff:
    """Delays ``base * 2**n`` capped at ``cap``, each drawn from its upper half ("equal jitter").

    The jitter spreads a fleet of sidecars that lost the control plane at the
    same moment, so they do not all come back in the same instant.
    """

    def __init__(self, base: float = 0.1, cap: float = 5.0, *, rng: random.Random | None = None) -> None:
        if base <= 0 or cap < base:
            raise ValueError("backoff needs 0 < base <= cap")
        self.base = base
        self.cap = cap
        self.attempts = 0
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security

    def next(self) -> float:
        ceiling = min(self.cap, self.base * 2.0 ** min(self.attempts, 32))
        self.attempts += 1
        return ceiling / 2 + self._rng.random() * ceiling / 2

    def reset(self) -> None:
        self.attempts = 0


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old file or the new one, never half of one.

    Written to a temporary file in the same directory, flushed to disk, renamed
    over the target, and the directory entry flushed too.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds; True if it was set.

    ``asyncio.timeout`` rather than ``asyncio.wait_for``: on Python 3.11 the
    latter can lose a cancellation that races with the timeout, and a task
    that cannot be cancelled hangs shutdown.
    """
    try:
        async with asyncio.timeout(max(0.0, timeout)):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


def wake(waiter: asyncio.Future[None] | None) -> None:
    """Resolves a waiter that may already be gone or done (a cancelled reader's, say)."""
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
