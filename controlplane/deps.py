"""What endpoints take from a request, written once: a session in one unit of work, and who may call.

``SessionDep`` gives the endpoint a SQLAlchemy session whose transaction
commits after the endpoint returns and before the response is sent (its
``scope="function"``), or rolls back if anything raised: a client that got a
2xx can read its write at once, from any connection. Endpoints that change a
worker's bundle take ``Announce`` too, and hand it the generation their
service returned: the hub is told after the commit, so a long-poll woken by it
reads the new state, never the old one.

An endpoint keeps an explicit ``unit_of_work`` when it needs more than one
transaction (a retry after losing a race) or runs its database work off the
event loop itself (an ``async`` endpoint with ``run_in_threadpool``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from controlplane.auth.dependencies import ADMIN, OPERATE, READ, WORKER, require
from controlplane.auth.schemas import Scope
from controlplane.auth.service import Principal
from controlplane.db import unit_of_work


class Announcer:
    """Bundle generations changed by this request; told to the hub once its transaction has committed."""

    def __init__(self) -> None:
        self.generations: list[int] = []
        self.bound = False

    def __call__(self, generation: int | None) -> None:
        if not self.bound:
            # Without SessionDep nothing would ever tell the hub: fail loudly instead of waking no one.
            raise RuntimeError("Announce needs SessionDep in the same endpoint: it announces after that commit")
        if generation is not None:
            self.generations.append(generation)


def _announcer() -> Announcer:
    return Announcer()


def _session(request: Request, announcer: Annotated[Announcer, Depends(_announcer)]) -> Iterator[Session]:
    announcer.bound = True
    with unit_of_work(request.app.state.sessions) as session:
        yield session
    # Reached only after a commit: an error raised at the yield rolls back and leaves before this line.
    for generation in announcer.generations:
        request.app.state.hub.publish(generation)


# "function": the exit (commit, then announce) runs before the response is sent; FastAPI's default for a
# yield dependency runs it after, when the client may already have read the old state (needs FastAPI 0.121.1+).
SessionDep = Annotated[Session, Depends(_session, scope="function")]
# The same Announcer as SessionDep's within one request (dependencies are cached per request).
Announce = Annotated[Announcer, Depends(_announcer)]

Reader = Annotated[Principal, Depends(require(*READ))]
Operator = Annotated[Principal, Depends(require(*OPERATE))]
Admin = Annotated[Principal, Depends(require(*ADMIN))]
WorkerKey = Annotated[Principal, Depends(require(*WORKER))]
# Admins may read any worker's bundle too, to debug what a worker is served.
BundleReader = Annotated[Principal, Depends(require(*WORKER, *ADMIN))]
AnyKey = Annotated[Principal, Depends(require(*Scope))]
