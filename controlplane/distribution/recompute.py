"""One database read per change for all the long-polls and streams of a process.

When a change is announced, every waiting long-poll and SSE stream wakes at
once and needs its worker's bundle again. Each asks the Recomputer, which
gathers the requests that arrive before it starts reading and answers them
all from one read in the threadpool (the workers' rows, then the shared view
of policies, rollouts and the kill switch). A request never joins a read that
has already started, so an answer is never older than the notice that
prompted the request.

The same thread then signs each distinct envelope of the read (one per worker) once, so the
woken long-polls all find their envelope cached. Otherwise, after a change
that makes a bundle never served before, every one of them would miss that
cache at once and make its own threadpool round trip to sign, queued with the
re-polls' authentication: on a loaded 2-core machine that added a few hundred
ms before the last of 200 workers had the change (bench/propagation.py --fresh).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State

from controlplane.db import unit_of_work
from controlplane.distribution.service import Bundle, BundleSigner, expected_bundles, signed_body
from controlplane.errors import SpecgateError
from controlplane.worker.service import WorkerNotFound, get_workers

Outcomes = dict[str, Bundle | SpecgateError]


def load_bundles(sessions: sessionmaker[Session], worker_ids: Sequence[str]) -> Outcomes:
    with unit_of_work(sessions) as session:
        workers = get_workers(session, worker_ids)
        outcomes: Outcomes = dict(expected_bundles(session, workers.values()))
    for worker_id in worker_ids:
        if worker_id not in workers:
            outcomes[worker_id] = WorkerNotFound(
                f"worker {worker_id!r} is not registered; POST /v1/workers/register first", worker=worker_id)
    return outcomes


def sign_once(signing_key: BundleSigner, outcomes: Outcomes) -> None:
    """Sign (or find cached) the envelope of every distinct bundle among ``outcomes``."""
    distinct = {(outcome.etag, outcome.pool, outcome.worker_id, outcome.generation): outcome
                for outcome in outcomes.values() if isinstance(outcome, Bundle)}
    for bundle in distinct.values():
        signed_body(signing_key, bundle)


class Recomputer:
    def __init__(self, sessions: sessionmaker[Session], signing_key: BundleSigner | None = None) -> None:
        self._sessions = sessions
        self._signing_key = signing_key
        self._pending: set[str] = set()
        self._next: asyncio.Future[Outcomes] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.reads = 0

    async def bundle(self, worker_id: str) -> Bundle:
        """The worker's bundle, from a read that starts after this call."""
        if self._next is None:
            loop = asyncio.get_running_loop()
            self._next = loop.create_future()
            # Retrieved here too, so a read whose every asker went away logs no "never retrieved".
            self._next.add_done_callback(lambda f: f.cancelled() or f.exception())
            task = loop.create_task(self._read())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._pending.add(worker_id)
        # Shielded: one asker giving up (its client left) must not cancel the read for the others.
        outcome = (await asyncio.shield(self._next))[worker_id]
        if isinstance(outcome, SpecgateError):
            # A fresh exception per asker: two long-polls of one worker must not share one.
            raise type(outcome)(outcome.detail, errors=outcome.errors, headers=outcome.headers, **outcome.extra)
        return outcome

    async def _read(self) -> None:
        # Waiters woken by one notice reach bundle() over the next few loop iterations; yielding
        # once lets them join this read instead of queueing a read each.
        await asyncio.sleep(0)
        future, worker_ids = self._next, sorted(self._pending)
        self._next, self._pending = None, set()
        assert future is not None
        self.reads += 1
        try:
            outcomes = await run_in_threadpool(self._load, worker_ids)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(outcomes)

    def _load(self, worker_ids: Sequence[str]) -> Outcomes:
        # load_bundles looked up at call time: tests replace it to stage races.
        outcomes = load_bundles(self._sessions, worker_ids)
        if self._signing_key is not None:
            sign_once(self._signing_key, outcomes)
        return outcomes


def recomputer_of(app_state: State) -> Recomputer:
    """The app's Recomputer, made on first use (in the event loop, so never twice)."""
    found: Recomputer | None = getattr(app_state, "bundle_recomputer", None)
    if found is None:
        # The lifespan has set the signing key before any request can get here.
        found = app_state.bundle_recomputer = Recomputer(app_state.sessions,
                                                         getattr(app_state, "bundle_signer", None))
    return found
