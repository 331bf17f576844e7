"""Tables of the control plane. Created by Alembic migrations only."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timestamps in UTC on both databases; SQLite has no time zones of its own."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dt.datetime: UTCDateTime(), dict[str, Any]: JSON(), list[Any]: JSON(),
    }


class Policy(Base):
    __tablename__ = "policies"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    description: Mapped[str | None] = mapped_column(Text)
    # The pool whose workers run this policy; NULL = every pool without a policy of its own.
    pool: Mapped[str | None] = mapped_column(String(128))
    # No foreign key: policies and revisions would reference each other, and
    # the service already guarantees the revision belongs to this policy.
    active_revision_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))


class Revision(Base):
    __tablename__ = "revisions"
    __table_args__ = (UniqueConstraint("policy_id", "seq", name="uq_revisions_policy_seq"),)

    # sha256 of the canonical document: content-addressed and immutable.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    policy_id: Mapped[str] = mapped_column(String(32), ForeignKey("policies.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[str | None] = mapped_column(String(64))
    document: Mapped[dict[str, Any]] = mapped_column(JSON)
    canonical_json: Mapped[str] = mapped_column(Text)
    canonical_yaml: Mapped[str] = mapped_column(Text)
    source_text: Mapped[str | None] = mapped_column(Text)
    author: Mapped[str] = mapped_column(String(128))
    message: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Rollout(Base):
    __tablename__ = "rollouts"
    __table_args__ = (Index("ix_rollouts_policy_state", "policy_id", "state"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    policy_id: Mapped[str] = mapped_column(String(32), ForeignKey("policies.id", ondelete="CASCADE"))
    from_revision_id: Mapped[str] = mapped_column(String(64), ForeignKey("revisions.id"))
    to_revision_id: Mapped[str] = mapped_column(String(64), ForeignKey("revisions.id"))
    mode: Mapped[str] = mapped_column(String(16))  # workers | traffic
    target_pool: Mapped[str | None] = mapped_column(String(128))
    target_labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    state: Mapped[str] = mapped_column(String(16))
    current_step: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str] = mapped_column(Text, default="")
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class RolloutStep(Base):
    __tablename__ = "rollout_steps"
    __table_args__ = (UniqueConstraint("rollout_id", "position", name="uq_rollout_steps_position"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(String(32), ForeignKey("rollouts.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    percent: Mapped[float] = mapped_column(Float)
    started_at: Mapped[dt.datetime | None] = mapped_column()
    finished_at: Mapped[dt.datetime | None] = mapped_column()
    outcome: Mapped[str | None] = mapped_column(String(32))


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # worker | gateway (a sidecar in front of engine replicas on other hosts); rows from before are workers.
    kind: Mapped[str] = mapped_column(String(16), default="worker", server_default="worker")
    pool: Mapped[str] = mapped_column(String(128), index=True)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    engines: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    sidecar_version: Mapped[str | None] = mapped_column(String(64))
    active_revision_id: Mapped[str | None] = mapped_column(String(64))
    active_etag: Mapped[str | None] = mapped_column(String(64))
    registered_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # The replicas it last reported ([{engine, replica, state, ...}], controlplane.worker.schemas.ReplicaRead);
    # NULL: it never reported any. Kept as one document: it is replaced whole by each report, never queried.
    replicas: Mapped[list[Any] | None] = mapped_column(JSON)
    replicas_reported_at: Mapped[dt.datetime | None] = mapped_column()
    # The engines its sidecar starts and restarts itself ([{engine, state, config_hash, revision, ...}],
    # controlplane.worker.schemas.SupervisedEngineRead); NULL: it never reported any. Replaced whole.
    supervised_engines: Mapped[list[Any] | None] = mapped_column(JSON)
    supervised_reported_at: Mapped[dt.datetime | None] = mapped_column()


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128))
    # The first characters of the token, shown in listings so a person can tell keys apart.
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scope: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[dt.datetime | None] = mapped_column()
    revoked_at: Mapped[dt.datetime | None] = mapped_column()
    # What a worker key may act as: workers of this pool and/or these worker ids. Both null on a worker key
    # means it was created before keys were bound; it binds itself to the first worker it registers.
    pool: Mapped[str | None] = mapped_column(String(128))
    worker_ids: Mapped[list[str] | None] = mapped_column(JSON)


class AuditEvent(Base):
    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_target", "target_type", "target_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64), index=True)
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(128))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(Text, default="")


class FleetState(Base):
    """One row: fleet-wide switches and the distribution generation.

    ``generation`` is bumped in the same transaction as any change that can
    alter a worker's bundle, so a long-poll can tell cheaply whether to
    recompute, on any replica.
    """

    __tablename__ = "fleet_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kill_switch: Mapped[bool] = mapped_column(Boolean, default=False)
    kill_switch_reason: Mapped[str] = mapped_column(Text, default="")
    kill_switch_changed_at: Mapped[dt.datetime | None] = mapped_column()
    kill_switch_changed_by: Mapped[str | None] = mapped_column(String(128))
    generation: Mapped[int] = mapped_column(BigInteger, default=0)
    signing_key: Mapped[str | None] = mapped_column(Text)
    # The key being rotated out: bundles are signed by both while sidecars move to the new one.
    previous_signing_key: Mapped[str | None] = mapped_column(Text)
    # Server-side secret that salts exploration and canary cohorts, so a client cannot pick its cohort
    # by choosing its request id.
    cohort_secret: Mapped[str | None] = mapped_column(String(64))


# --- telemetry (controlplane/telemetry) ---------------------------------------------------------

class TelemetryBatchRecord(Base):
    """One received telemetry batch: the idempotency record, written with its events.

    A batch sent again (same ``batch_id``) is answered from this row and
    stores nothing.
    """

    __tablename__ = "telemetry_batches"

    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    worker_id: Mapped[str] = mapped_column(String(128))
    sent_by: Mapped[str] = mapped_column(String(128))
    received_at: Mapped[dt.datetime] = mapped_column(index=True)
    event_count: Mapped[int] = mapped_column(Integer)
    accepted: Mapped[int] = mapped_column(Integer)
    stored: Mapped[int] = mapped_column(Integer)
    # [{index, errors: [{path, code, message}]}], as first answered
    rejected: Mapped[list[Any]] = mapped_column(JSON)
    # the rollup deltas of a pre-aggregating worker: how many came, validated, were new, and the refusals
    rollup_count: Mapped[int] = mapped_column(Integer, server_default="0")
    rollups_accepted: Mapped[int] = mapped_column(Integer, server_default="0")
    rollups_stored: Mapped[int] = mapped_column(Integer, server_default="0")
    rollups_rejected: Mapped[list[Any] | None] = mapped_column(JSON)


class TelemetryDeltaRecord(Base):
    """A rollup delta of a pre-aggregating worker that was added to the rollups: its idempotency record.

    A delta sent again (the same worker and ``delta_id``, in any batch) adds nothing. Purged with the rollups
    of its minute.
    """

    __tablename__ = "telemetry_rollup_deltas"

    worker_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    delta_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    minute: Mapped[dt.datetime] = mapped_column(index=True)
    batch_id: Mapped[str] = mapped_column(String(64))
    received_at: Mapped[dt.datetime] = mapped_column()


# PostgreSQL keeps telemetry_events partitioned by day of ``time`` (UTC): one partition per day, named
# telemetry_events_pYYYYMMDD, created ahead by the control plane (controlplane/telemetry/repository.py) and
# dropped whole by retention. They are not in the models: Alembic's comparisons skip them (is_event_partition).
EVENT_PARTITION_PREFIX = "telemetry_events_p"
_EVENT_PARTITION = re.compile(r"telemetry_events_p\d{8}")


def event_partition_name(day: dt.date) -> str:
    return f"{EVENT_PARTITION_PREFIX}{day:%Y%m%d}"


def is_event_partition(name: str | None) -> bool:
    """Whether ``name`` is one of the day partitions of telemetry_events (PostgreSQL)."""
    return name is not None and _EVENT_PARTITION.fullmatch(name) is not None


def include_name(name: str | None, type_: str, _parent_names: Any) -> bool:
    """Alembic's ``include_name``: the day partitions are the database's, not the models' (see above)."""
    return not (type_ == "table" and is_event_partition(name))


class TelemetryEventRecord(Base):
    """One request as the sidecar reported it: every field of ``wire.telemetry.TelemetryEvent``.

    The model is the table's shape on both databases but for one thing (migration ``20261207_0005``): on
    PostgreSQL the table is partitioned by range of ``time``, one partition per UTC day, and since a
    partitioned table's unique constraints must include the partition key its primary key is
    ``(event_id, time)``. An event resent carries the same time, so ingest's ``ON CONFLICT DO NOTHING``
    still stores it once (a reused id with another time would be a second event there). SQLite keeps
    the plain table with ``event_id`` alone as its key. Alembic does not compare primary keys;
    tests/controlplane/test_migrations.py checks both shapes.
    """

    __tablename__ = "telemetry_events"
    __table_args__ = (
        Index("ix_telemetry_events_time", "time"),
        Index("ix_telemetry_events_policy_time", "policy", "time"),
        Index("ix_telemetry_events_revision_time", "revision", "time"),
        Index("ix_telemetry_events_route_time", "route", "time"),
        Index("ix_telemetry_events_engine_time", "engine", "time"),
        Index("ix_telemetry_events_worker_time", "worker_id", "time"),
    )

    event_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128))
    time: Mapped[dt.datetime] = mapped_column()
    worker_id: Mapped[str] = mapped_column(String(128))
    pool: Mapped[str] = mapped_column(String(128))
    route: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    policy: Mapped[str] = mapped_column(String(63))
    revision: Mapped[str] = mapped_column(String(64))
    rule: Mapped[str] = mapped_column(String(63))
    engine: Mapped[str] = mapped_column(String(63))
    decided_engine: Mapped[str] = mapped_column(String(63))
    # NULL from sidecars before replica pools, or when no replica was tried.
    replica: Mapped[str | None] = mapped_column(String(255))
    speculate: Mapped[bool] = mapped_column(Boolean)
    num_speculative_tokens: Mapped[int] = mapped_column(Integer)
    explored: Mapped[bool] = mapped_column(Boolean)
    canary: Mapped[bool] = mapped_column(Boolean)
    kill_switch: Mapped[bool] = mapped_column(Boolean)
    batch_size: Mapped[int] = mapped_column(Integer)
    stream: Mapped[bool] = mapped_column(Boolean)
    structured_output: Mapped[bool] = mapped_column(Boolean)
    tools: Mapped[bool] = mapped_column(Boolean)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    shape_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    labels: Mapped[str] = mapped_column(String(2048), server_default="{}")
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    itl_ms: Mapped[float | None] = mapped_column(Float)
    e2e_ms: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(32))
    http_status: Mapped[int | None] = mapped_column(Integer)
    retries: Mapped[int] = mapped_column(Integer)
    fallback: Mapped[bool] = mapped_column(Boolean)
    fallback_reason: Mapped[str | None] = mapped_column(String(200))
    structured_valid: Mapped[bool | None] = mapped_column(Boolean)
    spec_draft_tokens: Mapped[int | None] = mapped_column(Integer)
    spec_accepted_tokens: Mapped[int | None] = mapped_column(Integer)
    spec_acceptance_rate: Mapped[float | None] = mapped_column(Float)
    spec_mean_acceptance_length: Mapped[float | None] = mapped_column(Float)
    spec_steps: Mapped[int | None] = mapped_column(Integer)
    engine_ttft_ms: Mapped[float | None] = mapped_column(Float)
    engine_itl_ms: Mapped[float | None] = mapped_column(Float)
    engine_queue_ms: Mapped[float | None] = mapped_column(Float)
    # a shadow comparison (the policy's ``quality``); all NULL on requests not compared, and on rows from before
    shadow_match: Mapped[bool | None] = mapped_column(Boolean)
    shadow_first_diff: Mapped[int | None] = mapped_column(Integer)
    shadow_structured_valid: Mapped[bool | None] = mapped_column(Boolean)
    shadow_check_passed: Mapped[bool | None] = mapped_column(Boolean)
    shadow_check_reason: Mapped[str | None] = mapped_column(String(256))
    # a sampled event of a pre-aggregating worker: the requests it stands for (its request is in a rollup
    # delta, not rolled up from this row); NULL on every event rolled up on arrival
    sample_weight: Mapped[float | None] = mapped_column(Float)
    # where it came from
    batch_id: Mapped[str] = mapped_column(String(64))
    received_at: Mapped[dt.datetime] = mapped_column()


class TelemetryRollup(Base):
    """Mergeable counters of the requests of one minute and one key.

    Ingest adds to these in the transaction that stores the raw events, so a
    rollup always equals the same aggregate over the raw events. Definitions
    of every counter: ``analysis.rollup``.
    """

    __tablename__ = "telemetry_rollups"
    __table_args__ = (
        UniqueConstraint("minute", "policy", "revision", "route", "engine", "batch_bucket", "explored", "k0",
                         name="uq_telemetry_rollups_key"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    # the key
    minute: Mapped[dt.datetime] = mapped_column()
    policy: Mapped[str] = mapped_column(String(63))
    revision: Mapped[str] = mapped_column(String(64))
    route: Mapped[str] = mapped_column(String(128))
    engine: Mapped[str] = mapped_column(String(63))
    batch_bucket: Mapped[int] = mapped_column(Integer)  # analysis.buckets
    explored: Mapped[bool] = mapped_column(Boolean)
    # decided into a speculative engine's K=0 band (analysis.rollup.decided_k0); false on rows from before
    k0: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # counts and sums
    requests: Mapped[int] = mapped_column(BigInteger)
    ok: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    client_disconnects: Mapped[int] = mapped_column(BigInteger)
    fallbacks: Mapped[int] = mapped_column(BigInteger)
    retries: Mapped[int] = mapped_column(BigInteger)
    speculated: Mapped[int] = mapped_column(BigInteger)
    structured_checked: Mapped[int] = mapped_column(BigInteger)
    structured_valid: Mapped[int] = mapped_column(BigInteger)
    spec_reported: Mapped[int] = mapped_column(BigInteger)
    draft_tokens_sum: Mapped[int] = mapped_column(BigInteger)
    accepted_tokens_sum: Mapped[int] = mapped_column(BigInteger)
    spec_steps_sum: Mapped[int] = mapped_column(BigInteger)
    spec_steps_count: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens_sum: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens_count: Mapped[int] = mapped_column(BigInteger)
    completion_tokens_sum: Mapped[int] = mapped_column(BigInteger)
    completion_tokens_count: Mapped[int] = mapped_column(BigInteger)
    e2e_ms_sum: Mapped[float] = mapped_column(Float)
    ttft_ms_sum: Mapped[float] = mapped_column(Float)
    ttft_count: Mapped[int] = mapped_column(BigInteger)
    itl_ms_sum: Mapped[float] = mapped_column(Float)
    itl_count: Mapped[int] = mapped_column(BigInteger)
    itl_weighted_ms_sum: Mapped[float] = mapped_column(Float)
    itl_weighted_tokens: Mapped[int] = mapped_column(BigInteger)
    # shadow comparisons; 0 on rows from before them (nothing was compared then)
    shadow_compared: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shadow_matched: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shadow_first_diff_sum: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shadow_first_diff_count: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shadow_structured_checked: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shadow_structured_valid_served: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shadow_structured_valid_plain: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shadow_check_run: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shadow_check_failed: Mapped[int] = mapped_column(BigInteger, server_default="0")


class TelemetryRollupHistogram(Base):
    """One latency bucket of one rollup row (``analysis.histogram``); merged by adding."""

    __tablename__ = "telemetry_rollup_histograms"

    rollup_id: Mapped[int] = mapped_column(BigId, ForeignKey("telemetry_rollups.id", ondelete="CASCADE"),
                                           primary_key=True, autoincrement=False)
    metric: Mapped[str] = mapped_column(String(8), primary_key=True)  # ttft | itl | e2e
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    count: Mapped[int] = mapped_column(BigInteger)


class GuardrailEvaluation(Base):
    """One look at a rollout step's guardrails (analysis.guardrails), and what it did."""

    __tablename__ = "guardrail_evaluations"
    __table_args__ = (Index("ix_guardrail_evaluations_rollout_at", "rollout_id", "evaluated_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(String(32), ForeignKey("rollouts.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    evaluated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    evaluated_by: Mapped[str] = mapped_column(String(128))
    verdict: Mapped[str] = mapped_column(String(16))  # pass | breach | pending
    action: Mapped[str] = mapped_column(String(16))  # none | rolled_back | promoted
    baseline_requests: Mapped[int] = mapped_column(BigInteger)
    canary_requests: Mapped[int] = mapped_column(BigInteger)
    checks: Mapped[list[Any]] = mapped_column(JSON)


# --- autopilot (controlplane/autopilot) ----------------------------------------------------------

class Autopilot(Base):
    """A policy's autopilot: its settings, and the rollout it runs now (at most one)."""

    __tablename__ = "autopilots"

    policy_id: Mapped[str] = mapped_column(String(32), ForeignKey("policies.id", ondelete="CASCADE"),
                                           primary_key=True)
    enabled: Mapped[bool] = mapped_column(Boolean, default=False)
    min_confidence: Mapped[str] = mapped_column(String(16))  # low | medium | high
    steps: Mapped[list[Any]] = mapped_column(JSON)
    hold_s: Mapped[float] = mapped_column(Float)
    min_samples: Mapped[int] = mapped_column(Integer)
    max_changes_per_day: Mapped[int] = mapped_column(Integer)
    kinds: Mapped[list[Any]] = mapped_column(JSON)
    # No foreign key: a rollout is never deleted while its policy lives, and the look tolerates a missing one.
    rollout_id: Mapped[str | None] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(32), default="idle")  # what the last look found (see service)
    status_detail: Mapped[str] = mapped_column(Text, default="")
    last_look_at: Mapped[dt.datetime | None] = mapped_column()
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(128))


class AutopilotEvent(Base):
    """What an autopilot did, with its evidence: its history (the audit log has the same actions)."""

    __tablename__ = "autopilot_events"
    __table_args__ = (Index("ix_autopilot_events_policy_at", "policy_id", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    policy_id: Mapped[str] = mapped_column(String(32), ForeignKey("policies.id", ondelete="CASCADE"))
    at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    action: Mapped[str] = mapped_column(String(32))
    rollout_id: Mapped[str | None] = mapped_column(String(32))
    revision_id: Mapped[str | None] = mapped_column(String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
