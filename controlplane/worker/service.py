"""Workers: who runs which pool, what they report running, and whether the fleet converged."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from controlplane.audit.service import record
from controlplane.auth.service import Principal, authorize_registration, authorize_worker
from controlplane.distribution.publish import bump_generation
from controlplane.distribution.service import DistributionView, ViewCache, load_view
from controlplane.errors import NotFound
from controlplane.models import Worker, utcnow
from controlplane.worker.repository import WorkerRepository
from controlplane.worker.schemas import (
    FleetGroup,
    FleetRead,
    HeartbeatAck,
    PoolFleet,
    ReplicaCounts,
    ReplicaRead,
    ReplicaReport,
    RevisionCount,
    SupervisedEngineRead,
    WorkerHeartbeat,
    WorkerKind,
    WorkerPage,
    WorkerRead,
    WorkerRegister,
)


class WorkerNotFound(NotFound):
    type_slug, title = "worker-not-found", "Worker not registered"


@dataclass(frozen=True, slots=True)
class Registration:
    worker: Worker
    created: bool
    # Set when the change can alter the worker's bundle: the endpoint announces it after commit.
    generation: int | None


def _registered(worker: Worker) -> dict[str, Any]:
    return {"pool": worker.pool, "labels": dict(worker.labels or {}), "engines": dict(worker.engines or {}),
            "kind": worker.kind}


def get_worker(session: Session, worker_id: str) -> Worker:
    worker = WorkerRepository(session).get(worker_id)
    if worker is None:
        raise WorkerNotFound(f"worker {worker_id!r} is not registered; POST /v1/workers/register first",
                             worker=worker_id)
    return worker


def get_workers(session: Session, worker_ids: Collection[str]) -> dict[str, Worker]:
    """The registered ones among ``worker_ids``, by id."""
    return {w.id: w for w in WorkerRepository(session).get_many(worker_ids)}


def register(session: Session, body: WorkerRegister, *, who: Principal) -> Registration:
    """Create or update a worker. Registering again is how a worker announces a new pool or labels.

    The key must be bound to the worker (or to its pool, and register it into that pool); an unbound
    key is bound to it here."""
    repo = WorkerRepository(session)
    now = utcnow()
    actor = who.actor
    labels, engines = dict(body.labels), dict(body.engines)
    wanted: dict[str, Any] = {"pool": body.pool, "labels": labels, "engines": engines, "kind": body.kind}
    worker = repo.get(body.id)
    authorize_registration(session, who, body.id, body.pool, None if worker is None else worker.pool)
    if worker is None:
        worker = repo.add(Worker(id=body.id, kind=body.kind, pool=body.pool, labels=labels, engines=engines,
                                 sidecar_version=body.sidecar_version, registered_at=now,
                                 last_heartbeat_at=now))
        record(session, actor=actor, action="worker.register", target_type="worker", target_id=worker.id,
               after={**wanted, "sidecar_version": body.sidecar_version})
        # Nobody can be waiting for the bundle of a worker that did not exist: no announcement.
        return Registration(worker, True, None)

    before = _registered(worker)
    worker.sidecar_version = body.sidecar_version
    # A registration is a sidecar (re)starting: what an earlier process said of the engines it supervised
    # is not about this one, which reports its own (or none: it would otherwise hold convergence forever).
    worker.supervised_engines, worker.supervised_reported_at = None, None
    # Registering is contact too: a worker that just re-registered is not stale.
    worker.last_heartbeat_at = now
    generation = None
    if before != wanted:
        worker.pool, worker.labels, worker.engines, worker.kind = body.pool, labels, engines, body.kind
        record(session, actor=actor, action="worker.register", target_type="worker", target_id=worker.id,
               before=before, after={**wanted, "sidecar_version": body.sidecar_version})
        if (before["pool"], before["labels"]) != (body.pool, labels):
            # Pool and labels pick the policy and the rollout cohort: this worker's long-polls
            # (on any replica) must recompute.
            generation = bump_generation(session)
    # A re-registration that changes nothing (a sidecar restart) is not audited.
    return Registration(worker, False, generation)


def heartbeat(session: Session, worker_id: str, body: WorkerHeartbeat, *, who: Principal,
              views: ViewCache | None = None) -> HeartbeatAck:
    # Heartbeats are not audited: they report liveness and what a worker runs, not a change anyone made,
    # and auditing them would bury the real changes. Except an engine failure they report: a policy change
    # that an engine could not run (or an engine that died) is what an operator looks for in the audit log.
    authorize_worker(session, who, worker_id)
    worker = get_worker(session, worker_id)
    worker.last_heartbeat_at = utcnow()
    # A field left out keeps what the worker reported before; an explicit null clears it.
    if "active_revision" in body.model_fields_set:
        worker.active_revision_id = body.active_revision
    if "active_etag" in body.model_fields_set:
        worker.active_etag = body.active_etag or None
    # Unlike the fields above, null keeps the replicas too: a sidecar that has nothing new to say about
    # them (or predates them) must not wipe what another heartbeat reported; [] says there are none.
    if body.replicas is not None:
        worker.replicas = [_stored(report) for report in body.replicas]
        worker.replicas_reported_at = worker.last_heartbeat_at
    if body.supervised_engines is not None:
        reports = [report.model_dump(mode="json") for report in body.supervised_engines]
        previous = worker.supervised_engines or []
        _audit_engine_failures(session, who, worker, previous, reports)
        _stamp_serving_since(previous, reports, worker.last_heartbeat_at)
        worker.supervised_engines = reports
        worker.supervised_reported_at = worker.last_heartbeat_at
    view = views.view(session, worker.pool) if views is not None else load_view(session, [worker.pool])
    expected = view.expected_etag(worker)
    return HeartbeatAck(expected_etag=expected,
                        converged=worker.active_etag == expected and _engines_converged(worker) is not False)


# What a report says went wrong, as counters that only grow while one sidecar process runs.
_FAILURES = (("failed_restarts", "worker.engine_restart_failed"), ("crashes", "worker.engine_crashed"))


def _audit_engine_failures(session: Session, who: Principal, worker: Worker, before: list[dict[str, Any]],
                           after: list[dict[str, Any]]) -> None:
    """An audit event when a heartbeat reports failures for the first time: restarts whose new arguments did
    not come up, crashes (one event per counter that changed, however many failures it added), an engine
    that went down. A restarted sidecar counts from 0 again, so a count that changed (up, or down and above
    0) is news; the same report sent again is not."""
    previous = {item.get("engine"): item for item in before if isinstance(item, dict)}
    for report in after:
        old = previous.get(report["engine"], {})
        events = [action for counter, action in _FAILURES
                  if report[counter] > 0 and report[counter] != old.get(counter, 0)]
        if report["state"] == "failed" and old.get("state") != "failed":
            events.append("worker.engine_down")
        for action in events:
            record(session, actor=who.actor, action=action, target_type="worker", target_id=worker.id,
                   before={key: old.get(key) for key in ("state", "revision", "config_hash")} if old else None,
                   after={"engine": report["engine"], "state": report["state"], "revision": report["revision"],
                          "config_hash": report["config_hash"], "failed_restarts": report["failed_restarts"],
                          "crashes": report["crashes"]},
                   reason=report["last_error"] or "")


def _stamp_serving_since(before: list[dict[str, Any]], after: list[dict[str, Any]], now: dt.datetime) -> None:
    """Set each report's ``serving_since``: when its engine began serving the arguments it runs now.

    The guardrails judge a workers-mode canary only from then on: before it, the requests sent to the engine
    were served by the fallback engine. Stamped by this clock, not the worker's, so that it compares with the
    rollout step's start (stamped by this clock too) whatever the worker's clock says. Carried over while the
    arguments (config_hash) stay the same, a crash and restart included: the fallbacks of a canary whose engine
    crashes count against it. New arguments clear it until the engine serves them.
    """
    previous = {item.get("engine"): item for item in before if isinstance(item, dict)}
    for report in after:
        old = previous.get(report["engine"]) or {}
        since = old.get("serving_since") if old.get("config_hash") == report["config_hash"] else None
        if since is None and report["state"] == "serving":
            since = now.isoformat()
        report["serving_since"] = since


def _supervised(worker: Worker) -> list[SupervisedEngineRead]:
    reports = [SupervisedEngineRead.model_validate(item) for item in worker.supervised_engines or ()]
    return sorted(reports, key=lambda r: r.engine)


def _engines_converged(worker: Worker) -> bool | None:
    """Whether every engine the worker supervises serves with the arguments of the revision it runs (None:
    it supervises none). A bundle arrives before its engines restart: until they serve its arguments the
    worker has not converged."""
    reports = worker.supervised_engines or []
    if not reports:
        return None
    return all(item.get("state") == "serving" and item.get("revision") == worker.active_revision_id
               for item in reports)


def _stored(report: ReplicaReport) -> dict[str, Any]:
    stored = report.model_dump(mode="json")
    if report.state != "ejected":
        # A probe is only scheduled for an ejected replica; a countdown beside "healthy" would only mislead.
        stored["next_probe_in_s"] = None
    return stored


def _replicas(worker: Worker) -> list[ReplicaRead]:
    reports = [ReplicaRead.model_validate(item) for item in worker.replicas or ()]
    return sorted(reports, key=lambda r: (r.engine, r.replica))


def _stale_before(stale_after_s: float) -> dt.datetime:
    return utcnow() - dt.timedelta(seconds=stale_after_s)


def describe(worker: Worker, view: DistributionView, stale_before: dt.datetime) -> WorkerRead:
    expected = view.expected_etag(worker)
    engines_converged = _engines_converged(worker)
    return WorkerRead(
        id=worker.id, kind=_kind(worker.kind), pool=worker.pool, labels=dict(worker.labels or {}),
        engines=dict(worker.engines or {}),
        sidecar_version=worker.sidecar_version, registered_at=worker.registered_at,
        last_heartbeat_at=worker.last_heartbeat_at, active_revision=worker.active_revision_id,
        active_etag=worker.active_etag, expected_etag=expected,
        stale=worker.last_heartbeat_at < stale_before,
        converged=worker.active_etag == expected and engines_converged is not False,
        engines_converged=engines_converged,
        replicas=_replicas(worker), replicas_reported_at=worker.replicas_reported_at,
        supervised_engines=_supervised(worker), supervised_reported_at=worker.supervised_reported_at,
    )


def _kind(value: str) -> WorkerKind:
    return "gateway" if value == "gateway" else "worker"


def describe_one(session: Session, worker: Worker, stale_after_s: float) -> WorkerRead:
    return describe(worker, load_view(session, [worker.pool]), _stale_before(stale_after_s))


def list_workers(session: Session, *, pool: str | None, stale: bool | None, cursor: str | None,
                 limit: int, stale_after_s: float, kind: WorkerKind | None = None) -> WorkerPage:
    stale_before = _stale_before(stale_after_s)
    rows = WorkerRepository(session).page(pool=pool, kind=kind, stale=stale, stale_before=stale_before,
                                          after_id=cursor, limit=limit)
    view = load_view(session, {w.pool for w in rows})
    items = [describe(w, view, stale_before) for w in rows]
    return WorkerPage(items=items, next_cursor=rows[-1].id if len(rows) == limit else None)


class _Tally:
    def __init__(self) -> None:
        self.workers = 0
        self.stale = 0
        self.converged = 0
        self.revisions: Counter[str | None] = Counter()

    def add(self, read: WorkerRead) -> None:
        self.workers += 1
        if read.stale:
            self.stale += 1
            return
        self.converged += read.converged
        self.revisions[read.active_revision] += 1

    def group(self) -> dict[str, Any]:
        revisions = sorted(self.revisions.items(), key=lambda item: (-item[1], item[0] or ""))
        return {"workers": self.workers, "stale": self.stale, "converged_workers": self.converged,
                "converged": self.converged == self.workers - self.stale,
                "revisions": [RevisionCount(revision=r, workers=n) for r, n in revisions]}


class _ReplicaTally:
    def __init__(self) -> None:
        self.reporters = self.total = self.healthy = self.ejected = 0

    def add(self, read: WorkerRead, stale_before: dt.datetime) -> None:
        # A report older than the staleness bound says nothing about now: a worker that stopped reporting
        # (an older sidecar after a downgrade) still heartbeats, and its last replicas would count forever.
        if read.stale or read.replicas_reported_at is None or read.replicas_reported_at < stale_before:
            return
        self.reporters += 1
        self.total += len(read.replicas)
        self.ejected += sum(r.state == "ejected" for r in read.replicas)
        self.healthy += sum(r.state == "healthy" for r in read.replicas)

    def counts(self) -> ReplicaCounts:
        return ReplicaCounts(reporters=self.reporters, total=self.total, healthy=self.healthy, ejected=self.ejected)


def fleet(session: Session, *, stale_after_s: float) -> FleetRead:
    """The fleet by kind: ``overall`` and ``pools`` count workers only, as they did before gateways
    existed, so a client that knows no gateways reads the same numbers; gateways are counted alike beside
    them, and replicas over both."""
    stale_before = _stale_before(stale_after_s)
    workers = WorkerRepository(session).all()
    view = load_view(session)
    overall = {"worker": _Tally(), "gateway": _Tally()}
    pools: dict[str, dict[str, _Tally]] = {"worker": {}, "gateway": {}}
    replicas = _ReplicaTally()
    for worker in workers:
        read = describe(worker, view, stale_before)
        overall[read.kind].add(read)
        pools[read.kind].setdefault(worker.pool, _Tally()).add(read)
        replicas.add(read, stale_before)

    def per_pool(kind: str) -> list[PoolFleet]:
        return [PoolFleet(pool=name, **tally.group()) for name, tally in sorted(pools[kind].items())]

    return FleetRead(generation=view.generation, kill_switch=view.kill_switch, stale_after_s=stale_after_s,
                     overall=FleetGroup(**overall["worker"].group()), pools=per_pool("worker"),
                     gateways=FleetGroup(**overall["gateway"].group()), gateway_pools=per_pool("gateway"),
                     replicas=replicas.counts())
