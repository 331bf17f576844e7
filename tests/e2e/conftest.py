"""The end-to-end harness: real vLLM engines, the real control plane and a real sidecar process.

* ``fleet`` (session): the testbed's vLLM CPU engines ``base`` and ``draft``, built (environment, models) or
  reused from the cache, started once on their own ports with their own state directory under pytest's
  temporary directory, and stopped at the end of the session. A failure to set them up is an error of the
  tests that need them, with the engines' log tails; never a skip. A test that kills an engine leaves it
  dead; the next test that needs it starts it again (``Fleet.require``).
* ``make_stack`` (per test, on SQLite and on PostgreSQL through ``database_url``): a migrated database
  holding the example seed policy (``policies/examples/seed.yaml``), the control plane serving it
  (``specgate serve`` in a subprocess, on a fixed port, so a test can stop it and start it again) and
  ``specgate sidecar`` as a subprocess in front of the engines. The sidecar runs with
  ``SPECGATE_EXPOSE_ENGINE_METRICS=true``, so every answer carries the engine's own per-request ``metrics``
  object, unchanged, next to what the sidecar stored from it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy import text as sql

from controlplane.migrations_state import upgrade
from controlplane.models import Policy
from tests.support.e2e import (
    SEED_POLICY,
    ControlPlaneProcess,
    Fleet,
    SidecarProcess,
    Stack,
    StackBuilder,
    StackFactory,
    _interrupt,
)
from tests.support.factories import add_revision, seed_policy
from tests.support.fleet_rows import session_for

# --- the engines --------------------------------------------------------------------------------













@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("engines"))
    # The engines lead their own sessions, so a terminal's signals never reach them: a SIGTERM to pytest
    # (a CI timeout, say) becomes an interrupt, which still runs this fixture's teardown and stops them.
    previous = signal.signal(signal.SIGTERM, _interrupt) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        fleet.up()
        yield fleet
    finally:
        fleet.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        print(f"\nengines: environment+models {fleet.setup_s and round(fleet.setup_s, 1)} s, "
              f"starts (variants, seconds) {fleet.starts}")


# --- the control plane process -------------------------------------------------------------------



# --- the sidecar process ---------------------------------------------------------------------------





# --- requests -----------------------------------------------------------------------------------------























# --- telemetry in SQL --------------------------------------------------------------------------------



# --- the stack ---------------------------------------------------------------------------------------





@pytest.fixture
def build_stack(fleet: Fleet, tmp_path: Path) -> Iterator[StackBuilder]:
    """``build(database_url, policy_texts=(seed,))``: a stack on that (empty) database; several may run at once.

    The first text becomes the policy's first revision, each later one a newer revision, the last active;
    ``cp_env`` adds to the control plane's environment (SPECGATE_* settings), ``sidecar_env`` to the sidecar's."""
    made: list[Stack] = []

    def build(database_url: str, policy_texts: Sequence[str] = (SEED_POLICY,),
              cp_env: Mapping[str, str] | None = None, sidecar_env: Mapping[str, str] | None = None) -> Stack:
        fleet.require()
        upgrade(database_url)
        policy_id, ids = seed_policy(database_url, policy_texts[0])
        if len(policy_texts) > 1:
            with session_for(database_url) as session:
                policy = session.get(Policy, policy_id)
                assert policy is not None
                ids += [add_revision(session, policy, text, activate=True).id for text in policy_texts[1:]]
        directory = tmp_path / f"stack-{len(made)}"
        directory.mkdir()
        cp = ControlPlaneProcess(database_url, directory)
        cp.env.update(cp_env or {})
        cp.start()
        sidecar = SidecarProcess(cp, fleet.urls, directory, worker_id=f"e2e-{tmp_path.name}-{len(made)}")
        sidecar.env.update(sidecar_env or {})
        stack = Stack(database_url, cp, sidecar, fleet, ids)
        made.append(stack)
        sidecar.start()
        return stack

    try:
        yield build
    finally:
        for stack in made:
            log = stack.sidecar.stop()
            stack.cp.stop(grace_s=0.5)  # the test is over: no need to wait for its long-polls
            if "Traceback" in log:
                print(f"\nthe sidecar logged a traceback:\n{log[-4000:]}")


@pytest.fixture
def make_stack(database_url: str, build_stack: StackBuilder) -> StackFactory:
    """``make(policy_texts=(seed,), sidecar_env=None)``: a stack on this test's database (SQLite, then
    PostgreSQL)."""

    def make(policy_texts: Sequence[str] = (SEED_POLICY,), sidecar_env: Mapping[str, str] | None = None) -> Stack:
        return build_stack(database_url, policy_texts, sidecar_env=sidecar_env)

    return make


@pytest.fixture
def both_databases(postgres_database: str, tmp_path: Path) -> dict[str, str]:
    """An empty SQLite database and an empty PostgreSQL one, for a test that runs on both at once."""
    engine = create_engine(postgres_database, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sql("DROP SCHEMA public CASCADE"))
            conn.execute(sql("CREATE SCHEMA public"))
    finally:
        engine.dispose()
    return {"sqlite": f"sqlite:///{tmp_path / 'both.db'}", "postgresql": postgres_database}
