"""A live control plane for the dashboard tests, with a key of every scope."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.auth.schemas import Scope
from controlplane.auth.service import create_key
from controlplane.db import make_engine, make_sessionmaker, unit_of_work


@dataclass(frozen=True)
class LiveControlPlane:
    url: str
    database_url: str
    admin: str
    operator: str
    viewer: str
    worker: str


def mint_keys(database_url: str) -> dict[Scope, str]:
    engine = make_engine(database_url)
    names = {Scope.admin: "alice", Scope.operator: "olga", Scope.viewer: "victor", Scope.worker: "fleet-sidecar"}
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            # The worker key acts for the seeded fleet (tests/support/dashboard_seed.py: pool "fleet").
            return {scope: create_key(session, name=name, scope=scope, created_by="test:fixture",
                                      pool="fleet" if scope is Scope.worker else None)[1]
                    for scope, name in names.items()}
    finally:
        engine.dispose()
