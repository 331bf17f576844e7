"""Wakes long-polls and SSE streams when any worker's bundle may have changed.

Each change bumps ``fleet_state.generation`` in its transaction. In one
process, the hub is told right after commit; across processes (several
replicas on PostgreSQL) a LISTEN/NOTIFY listener tells it. Waiters only learn
"something changed" and recompute their own bundle, so a lost or duplicated
notice costs a recomputation, never a wrong bundle.
"""

from __future__ import annotations

import asyncio
import threading


class ChangeHub:
    def __init__(self) -> None:
        self._generation = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._lock = threading.Lock()
        self.waiters = 0
        self.notices = 0
        self.publishes = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()

    @property
    def generation(self) -> int:
        return self._generation

    def publish(self, generation: int) -> None:
        """A change committed by this process: count it, then wake local waiters."""
        with self._lock:
            self.publishes += 1
        self.notify(generation)

    def notify(self, generation: int | None = None) -> None:
        """Thread-safe: called from request threads after commit, or the listener."""
        with self._lock:
            self._generation = max(self._generation + 1, generation or 0)
            self.notices += 1
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._fire()
        else:
            loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        # Replace the event so that waiters woken now do not see it set when
        # they come back to wait for the next change.
        event, self._event = self._event, asyncio.Event()
        if event is not None:
            event.set()

    async def wait(self, timeout: float) -> bool:
        """True when a change was announced within ``timeout`` seconds."""
        event = self._event
        if event is None:
            await asyncio.sleep(timeout)
            return False
        self.waiters += 1
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self.waiters -= 1
