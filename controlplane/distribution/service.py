"""Which bundle each worker should run now, and the signed bytes it downloads.

A bundle depends on the worker (pool, labels, id) and on rows every change
announces by bumping ``fleet_state.generation``: policies, their active
revisions, live rollouts and the kill switch. Revisions are content-addressed,
so a revision validated once is cached by id for good; a payload is cached by
what it is made of. The signature binds the payload to its delivery (generation,
pool, worker, expiry), so envelopes are cached by (keys, ETag, pool, worker,
generation, expiry bucket): the expiry is rounded up to a bucket, and a herd of
long-polls woken by one change therefore only reads a few small rows each and
reuses the documents and payloads; each worker's envelope is signed once per
change.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.orm import Session

from controlplane.audit.service import record
from controlplane.distribution.publish import bump_generation
from controlplane.distribution.repository import DistributionRepository
from controlplane.errors import NotFound, SpecgateError
from controlplane.lru import LRU
from controlplane.rollout.service import canary_salt, worker_in_canary
from policies import (
    BundlePayload,
    Canary,
    Delivery,
    PolicyValidationError,
    Revision,
    SigningKey,
    canonical_members,
    envelope_bytes,
    validate_data,
)

log = logging.getLogger("specgate.controlplane.distribution")

# A paused rollout keeps its current step's split; every other state stops splitting.
LIVE_ROLLOUT_STATES = ("running", "paused")


class NoPolicy(NotFound):
    type_slug, title = "no-policy", "No policy applies to this worker"


class RevisionCorrupt(SpecgateError):
    # Not the client's fault: a stored revision no longer validates or hashes to its id.
    status, type_slug, title = 500, "revision-corrupt", "A stored revision is corrupt"


class WorkerLike(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Bundle:
    payload: BundlePayload
    etag: str
    # For whom and when it was computed: signed into the envelope, not part of the ETag.
    pool: str = ""
    generation: int = 0
    worker_id: str = ""


class BundleSigner:
    """The keys that sign bundles (current first; the previous one during a rotation) and the bundles' TTL."""

    def __init__(self, keys: Iterable[SigningKey], ttl_s: float) -> None:
        self.keys = tuple(keys)
        if not self.keys:
            raise ValueError("at least one signing key is needed")
        self.ttl_s = ttl_s
        # A long-poll herd shares one expiry per bucket, so one signature; at most a tenth of the TTL
        # is added to it, so a bundle lives between TTL and 1.1 TTL.
        self.bucket_s = max(1, int(ttl_s / 10))
        self.key_ids = ",".join(key.key_id for key in self.keys)

    @property
    def current(self) -> SigningKey:
        return self.keys[0]

    def expires_at(self, now: float) -> int:
        return (math.floor((now + self.ttl_s) / self.bucket_s) + 1) * self.bucket_s


# (policy revision, canary revision, traffic percent, salt, kill switch, cohort secret): a payload's makings.
_BundleKey = tuple[str, str | None, float | None, str | None, bool, str]

_revisions: LRU[str, Revision] = LRU(1024)
_bundles: LRU[_BundleKey, BundlePayload] = LRU(4096)
# (signing key ids, ETag, pool, worker, generation, expiry bucket): one envelope per worker and change.
_EnvelopeKey = tuple[str, str, str, str, int, int]
# Bounded by bytes too: per worker, a fleet of large policies would otherwise hold thousands of big envelopes.
_envelopes: LRU[_EnvelopeKey, bytes] = LRU(16384, weigh=len, max_weight=64 * 1024 * 1024)
# A content's members serialised once (by ETag), for the envelopes of every worker it goes to.
_members: LRU[str, dict[str, bytes]] = LRU(1024, weigh=lambda members: sum(map(len, members.values())),
                                           max_weight=64 * 1024 * 1024)


def clear_caches() -> None:
    _revisions.clear()
    _bundles.clear()
    _envelopes.clear()
    _members.clear()


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    id: str
    mode: str
    to_revision: Revision
    percent: float
    target_pool: str | None
    target_labels: Mapping[str, Any]

    def targets(self, worker: WorkerLike) -> bool:
        if self.target_pool is not None and worker.pool != self.target_pool:
            return False
        labels = worker.labels or {}
        return all(labels.get(key) == value for key, value in self.target_labels.items())


@dataclass(frozen=True, slots=True)
class PolicyPlan:
    policy_id: str
    name: str
    pool: str | None
    active: Revision | None
    rollout: RolloutPlan | None
    # Set when a revision this policy's workers need is corrupt: their bundles fail, no one else's.
    problem: RevisionCorrupt | None = None


class DistributionView:
    """One read of everything bundles depend on, apart from the worker itself."""

    def __init__(self, plans: Iterable[PolicyPlan], *, kill_switch: bool, generation: int,
                 cohort_secret: str = "") -> None:
        self.kill_switch = kill_switch
        self.generation = generation
        self.cohort_secret = cohort_secret
        self._by_pool: dict[str, PolicyPlan] = {}
        self._poolless: PolicyPlan | None = None
        for plan in plans:
            if plan.pool is None:
                # At most one pool-less policy is allowed; should two exist, the first by name wins.
                self._poolless = self._poolless or plan
            else:
                self._by_pool.setdefault(plan.pool, plan)

    def plan_for(self, worker: WorkerLike) -> PolicyPlan | None:
        return self._by_pool.get(worker.pool) or self._poolless

    def bundle(self, worker: WorkerLike) -> Bundle:
        plan = self.plan_for(worker)
        if plan is None:
            raise NoPolicy(f"no policy for pool {worker.pool!r} and no pool-less policy")
        if plan.problem is not None:
            # A fresh exception each time: the view is shared by threads, a raised instance is not.
            raise RevisionCorrupt(plan.problem.detail, **plan.problem.extra)
        if plan.active is None:
            raise NoPolicy(f"policy {plan.name!r} for worker {worker.id!r} has no active revision yet")
        policy, canary = plan.active, None
        rollout = plan.rollout
        if rollout is not None and rollout.targets(worker):
            # The cohort rules belong to rollouts (controlplane.rollout.service); bundles apply them.
            if rollout.mode == "workers":
                if worker_in_canary(worker.id, rollout.id, rollout.percent, cohort_secret=self.cohort_secret):
                    policy = rollout.to_revision
            elif rollout.mode == "traffic":
                canary = Canary(rollout.to_revision, rollout.percent,
                                canary_salt(rollout.id, cohort_secret=self.cohort_secret))
        payload = _payload_of(policy, canary, self.kill_switch, self.cohort_secret)
        return Bundle(payload, payload.etag, worker.pool, self.generation, worker.id)

    def expected_etag(self, worker: WorkerLike) -> str | None:
        """None when nothing can be served: fleet views and heartbeats still work, only the bundle fails."""
        try:
            return self.bundle(worker).etag
        except (NoPolicy, RevisionCorrupt):
            return None


def _payload_of(policy: Revision, canary: Canary | None, kill_switch: bool, cohort_secret: str) -> BundlePayload:
    key: _BundleKey = (policy.id, canary.revision.id if canary else None,
                       canary.traffic_percent if canary else None, canary.salt if canary else None,
                       kill_switch, cohort_secret)
    cached = _bundles.get(key)
    if cached is not None:
        return cached
    return _bundles.put(key, BundlePayload(policy, canary, kill_switch, cohort_secret))


def _revisions_by_id(repo: DistributionRepository,
                     ids: Collection[str]) -> dict[str, Revision | RevisionCorrupt]:
    """Validated revisions; a corrupt one comes back as its error, so it only fails its own workers."""
    found: dict[str, Revision | RevisionCorrupt] = {}
    missing: list[str] = []
    for rid in ids:
        cached = _revisions.get(rid)
        if cached is None:
            missing.append(rid)
        else:
            found[rid] = cached
    for rid, document in repo.revision_documents(missing).items():
        try:
            revision = Revision.of(validate_data(document))
        except PolicyValidationError as exc:
            log.error("stored revision %s no longer validates: %s", rid, exc)
            found[rid] = RevisionCorrupt(f"stored revision {rid} does not validate: {exc}", revision=rid)
            continue
        if revision.id != rid:
            log.error("stored revision %s hashes to %s", rid, revision.id)
            found[rid] = RevisionCorrupt(f"stored revision {rid} hashes to {revision.id}; refusing to serve it",
                                         revision=rid)
            continue
        found[rid] = _revisions.put(rid, revision)
    return found


def load_view(session: Session, pools: Collection[str] | None = None, *,
              switches: tuple[bool, int, str] | None = None) -> DistributionView:
    """The view for workers of ``pools`` (every pool when None); ``switches``: the fleet's kill switch,
    generation and cohort secret when they were just read in this session."""
    repo = DistributionRepository(session)
    kill_switch, generation, cohort_secret = switches if switches is not None else repo.fleet_switches()
    policies = repo.policies(pools)
    rollouts: dict[str, tuple[Any, float | None]] = {}
    for rollout, percent in repo.live_rollouts([p.id for p in policies], LIVE_ROLLOUT_STATES):
        # At most one live rollout per policy is allowed; should two exist, the newest wins.
        rollouts.setdefault(rollout.policy_id, (rollout, percent))
    wanted = {p.active_revision_id for p in policies if p.active_revision_id}
    wanted |= {r.to_revision_id for r, percent in rollouts.values() if percent is not None}
    revisions = _revisions_by_id(repo, wanted)

    plans = []
    for policy in policies:
        active = revisions.get(policy.active_revision_id) if policy.active_revision_id else None
        problem = active if isinstance(active, RevisionCorrupt) else None
        plan_rollout = None
        if policy.id in rollouts:
            rollout, percent = rollouts[policy.id]
            to_revision = revisions.get(rollout.to_revision_id)
            if isinstance(to_revision, RevisionCorrupt):
                problem = problem or to_revision
            elif percent is None or to_revision is None:
                log.warning("rollout %s has no step at position %s; not splitting", rollout.id,
                            rollout.current_step)
            else:
                plan_rollout = RolloutPlan(rollout.id, rollout.mode, to_revision, float(percent),
                                           rollout.target_pool, dict(rollout.target_labels or {}))
        plans.append(PolicyPlan(policy.id, policy.name, policy.pool,
                                active if isinstance(active, Revision) else None, plan_rollout, problem))
    return DistributionView(plans, kill_switch=kill_switch, generation=generation, cohort_secret=cohort_secret)


def expected_bundles(session: Session,
                     workers: Iterable[WorkerLike]) -> dict[str, Bundle | NoPolicy | RevisionCorrupt]:
    """What /v1/bundle serves each of ``workers`` now (or why it cannot), from one read."""
    workers = list(workers)
    view = load_view(session, {w.pool for w in workers})
    outcomes: dict[str, Bundle | NoPolicy | RevisionCorrupt] = {}
    for worker in workers:
        try:
            outcomes[worker.id] = view.bundle(worker)
        except (NoPolicy, RevisionCorrupt) as exc:
            outcomes[worker.id] = exc
    return outcomes


class ViewCache:
    """The view of each pool, kept while ``fleet_state.generation`` stays the same: what a heartbeat's answer
    needs.

    Every change that can alter a bundle bumps the generation in its own transaction (that is what wakes the
    long-polls, on every replica), so the policies, rollouts and revisions read at generation G are current
    for as long as the generation is G; the generation, the kill switch and the cohort secret are read each
    time (one row). A fleet's heartbeats, 200 a second for a thousand workers, then read two rows fewer each
    (bench/fleet.py).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = -1
        self._views: dict[str, DistributionView] = {}

    def view(self, session: Session, pool: str) -> DistributionView:
        switches = DistributionRepository(session).fleet_switches()
        generation = switches[1]
        with self._lock:
            found = self._views.get(pool) if generation == self._generation else None
        if found is not None and (found.kill_switch, found.cohort_secret) == (switches[0], switches[2]):
            return found
        view = load_view(session, [pool], switches=switches)
        with self._lock:
            if generation > self._generation:
                self._generation, self._views = generation, {}
            if generation == self._generation:
                self._views[pool] = view
        return view


def expected_bundle(session: Session, worker: WorkerLike) -> Bundle:
    """What /v1/bundle serves ``worker`` now; NoPolicy when nothing applies to it."""
    return load_view(session, [worker.pool]).bundle(worker)


def bundle_for_worker(session: Session, worker: WorkerLike) -> BundlePayload:
    return expected_bundle(session, worker).payload


def _envelope_key(signer: BundleSigner, bundle: Bundle, now: float | None) -> _EnvelopeKey:
    return (signer.key_ids, bundle.etag, bundle.pool, bundle.worker_id, bundle.generation,
            signer.expires_at(time.time() if now is None else now))


def cached_body(signer: BundleSigner, bundle: Bundle, *, now: float | None = None) -> bytes | None:
    """The signed envelope if it was made before: cheap enough for the event loop."""
    return _envelopes.get(_envelope_key(signer, bundle, now))


def signed_body(signer: BundleSigner, bundle: Bundle, *, now: float | None = None) -> bytes:
    """The JSON envelope bytes; Ed25519 signatures are deterministic, so caching them is exact."""
    key = _envelope_key(signer, bundle, now)
    cached = _envelopes.get(key)
    if cached is not None:
        return cached
    members = _members.get(bundle.etag) or _members.put(bundle.etag, canonical_members(bundle.payload))
    body = envelope_bytes(signer.keys, members, bundle.etag,
                          Delivery(bundle.generation, bundle.pool, key[5], bundle.worker_id))
    return _envelopes.put(key, body)


def normalize_etag(value: str) -> str:
    """An entity tag as compared here: without W/ and quotes (sidecars may echo either form)."""
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')


def etags_in(if_none_match: str | None) -> set[str]:
    """The tags of an If-None-Match header, quoted or bare, one or a comma-separated list."""
    if not if_none_match:
        return set()
    return {normalize_etag(part) for part in if_none_match.split(",") if part.strip()}


def raise_generation(session: Session, *, at_least: int, actor: str, reason: str = "") -> tuple[int, int]:
    """Bump the generation (to at least ``at_least``) with no other change; audited. (before, after)."""
    before = DistributionRepository(session).lock_generation()
    if before is None:
        raise LookupError("the database has no fleet_state row: run the migrations first")
    after = bump_generation(session, at_least=at_least)
    record(session, actor=actor, action="generation.raise", target_type="fleet", target_id="generation",
           before={"generation": before}, after={"generation": after}, reason=reason)
    return before, after
