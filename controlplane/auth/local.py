"""Keys minted straight into a database, for local set-ups that own it: ``specgate up``, benchmarks, checks.

A served control plane creates keys through ``POST /v1/keys`` (an admin key, audited); the first admin key
of a fresh database and the throw-away keys of a local run have nobody to ask, so they come from here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from controlplane.auth.schemas import Scope
from controlplane.auth.service import create_key
from controlplane.db import make_engine, make_sessionmaker, unit_of_work


def mint_keys(database_url: str, keys: Mapping[str, Scope], *, created_by: str,
              pools: Mapping[str, str] | None = None,
              worker_ids: Mapping[str, Collection[str]] | None = None) -> dict[str, str]:
    """Create one key per ``name: scope`` in one transaction; return ``name -> token`` (shown only here).

    ``pools`` and ``worker_ids`` bind worker keys, by name, to a pool and to worker ids; a worker key in
    neither binds itself to the first worker it registers."""
    pools = pools or {}
    ids = worker_ids or {}
    engine = make_engine(database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            return {name: create_key(session, name=name, scope=scope, created_by=created_by,
                                     pool=pools.get(name), worker_ids=ids.get(name))[1]
                    for name, scope in keys.items()}
    finally:
        engine.dispose()
