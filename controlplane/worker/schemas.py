"""Request and response models of the workers API: registration, heartbeats, worker pages, the fleet."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints, field_validator
from pydantic_core import PydanticCustomError

from controlplane.distribution.service import normalize_etag

WORKER_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
# PostgreSQL refuses NUL in text, and names with control characters only confuse people.
NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"
NO_NUL = r"^[^\x00]*$"

WorkerId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=WORKER_ID_PATTERN)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_CONTROL)]
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=NO_CONTROL)]
LabelValue = Annotated[str, StringConstraints(max_length=256, pattern=NO_CONTROL)]
EngineName = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=NO_CONTROL)]
EngineDescription = Annotated[str, StringConstraints(max_length=2048, pattern=NO_NUL)]
Short = Annotated[str, StringConstraints(max_length=64, pattern=NO_CONTROL)]
# HOST:PORT[/PREFIX] as the sidecar names a replica; shown to people, so no control characters.
ReplicaAddress = Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=NO_CONTROL)]

WorkerKind = Literal["worker", "gateway"]
ReplicaState = Literal["healthy", "ejected", "held"]
MAX_REPLICAS = 256
# What a sidecar's engine supervisor (sidecar/supervisor.py) says of an engine it runs.
SupervisedState = Literal["starting", "serving", "draining", "restarting", "failed", "stopped"]
MAX_SUPERVISED = 64
ConfigHash = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")]
# Shown in terminals (specgate workers --engines) and tables: no control characters but newline and tab.
ErrorText = Annotated[str, StringConstraints(max_length=2048, pattern=r"^[^\x00-\x08\x0b-\x1f\x7f]*$")]
# Replica reports are stored as JSON and summed for the fleet: the same bounds as telemetry's counters
# (32-bit integers, finite floats up to 1e12), so no report can overflow a reader. Strict: JSON false is
# not a count, nor "3" a gauge.
Count = Annotated[int, Field(ge=0, le=2**31 - 1, strict=True)]
Gauge = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False, strict=True)]


class WorkerRegister(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: WorkerId = Field(description="stable id of the worker: letters, digits and _ . : -")
    pool: Name = Field(description="the pool whose policy the worker runs")
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64,
                                               description="labels rollouts may target")
    engines: dict[EngineName, EngineDescription] = Field(
        default_factory=dict, max_length=64, description="engine variants offered: name -> url or text")
    sidecar_version: Short | None = None
    kind: WorkerKind = Field("worker", description="worker: a sidecar beside its engines; gateway: a sidecar "
                             "in front of pools of engine replicas on other hosts")


class ReplicaReport(BaseModel):
    """One replica of one engine, as the sidecar in front of it sees it now."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineName = Field(description="the engine name the replica serves")
    replica: ReplicaAddress = Field(description="the replica: HOST:PORT[/PREFIX]")
    state: ReplicaState = Field(description="healthy: the sidecar sends it requests; ejected: it does not, "
                                            "until a probe brings it back; held: the sidecar's engine supervisor "
                                            "keeps it out of routing while it starts, drains or restarts")
    in_flight: Count = Field(0, description="requests the sidecar has in flight on it")
    running: Gauge | None = Field(None, description="requests the engine reports running; null when unknown")
    waiting: Gauge | None = Field(None, description="requests the engine reports queued; null when unknown")
    consecutive_failures: Count = 0
    ejections: Count = Field(0, description="times it was ejected since the sidecar started")
    returns: Count = Field(0, description="times it came back after an ejection")
    next_probe_in_s: Gauge | None = Field(None, description="while ejected: seconds until the next probe")


# A tokenizer check's difference, as people read it (pairs.tokenizers): bounded, no control characters.
Difference = Annotated[str, StringConstraints(max_length=512, pattern=NO_CONTROL)]


class TokenizerCheckReport(BaseModel):
    """Whether an engine's draft model has its target's tokenizer (pairs.tokenizers, run by the sidecar)."""

    model_config = ConfigDict(extra="forbid")

    aligned: StrictBool | None = Field(description="true: the same vocabulary, token-to-id map, special tokens "
                                                   "and chat template; false: they differ (the engine is refused "
                                                   "unless its supervise entry allows heterogeneous vocabularies); "
                                                   "null: a directory could not be read, so it was not checked")
    draft: Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=NO_CONTROL)] = Field(
        description="the draft model's path on the worker")
    differences: list[Difference] = Field(default=[], max_length=8,
                                          description="what makes the draft's ids mean other text (the pair is "
                                                      "misaligned), or why it was not checked")
    notes: list[Difference] = Field(default=[], max_length=8,
                                    description="what differs without changing what an id means: special token "
                                                "roles, the chat template (the server uses the target's)")


class SupervisedEngineReport(BaseModel):
    """One engine the sidecar starts and restarts itself (``specgate sidecar --supervise``), as it runs now."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineName
    state: SupervisedState = Field(description="serving: routed to; starting, draining, restarting: held out of "
                                               "routing; failed: down (neither new nor previous arguments came "
                                               "up); stopped: not started yet, or the sidecar is stopping")
    config_hash: ConfigHash | None = Field(None, description="a hash of the engine's whole command line; null "
                                                             "before it was first started")
    revision: Short | None = Field(None, description="the policy revision whose arguments the engine runs; null: "
                                                     "no policy's (started before any bundle)")
    restarts: Count = Field(0, description="restarts with new arguments that came up")
    failed_restarts: Count = Field(0, description="restarts whose new arguments did not come up (the engine went "
                                                  "back to its previous ones)")
    crashes: Count = Field(0, description="times its process ended while it served (started again)")
    last_error: ErrorText | None = Field(None, description="why the last start or restart failed, or why the "
                                                           "latest policy was not applied; null once it serves "
                                                           "with new arguments")
    error_revision: Short | None = Field(None, description="the policy revision whose arguments last_error is "
                                                           "about (a refused or failed restart, a crash); null "
                                                           "without an error, or from a sidecar that does not say")
    tokenizer: TokenizerCheckReport | None = Field(None, description="the tokenizer check of the draft model in "
                                                                     "the arguments the engine runs or was last asked "
                                                                     "to run; null: no draft model")


class WorkerHeartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    active_revision: Short | None = Field(None, description="revision the worker runs now")
    active_etag: Short | None = Field(None, description="ETag of the bundle it runs now, quoted or bare")
    # Strict: JSON false is not a count, though Python would read it as 0.
    in_flight: int | None = Field(None, ge=0, strict=True,
                                  description="requests in flight (informational, not stored)")
    replicas: list[ReplicaReport] | None = Field(
        None, max_length=MAX_REPLICAS,
        description="every replica the sidecar routes to, now; null or left out: unchanged since the last "
                    "report; []: none")
    supervised_engines: list[SupervisedEngineReport] | None = Field(
        None, max_length=MAX_SUPERVISED,
        description="the engines the sidecar supervises, now; null or left out: unchanged since the last report; "
                    "[]: it supervises none")

    @field_validator("active_etag", mode="before")
    @classmethod
    def _bare_etag(cls, value: object) -> object:
        # Stored bare, as the expected ETag is, so the two compare; checked for length afterwards.
        return normalize_etag(value) if isinstance(value, str) else value

    @field_validator("replicas")
    @classmethod
    def _one_report_per_replica(cls, value: list[ReplicaReport] | None) -> list[ReplicaReport] | None:
        # Two reports of one replica would be counted twice in the fleet, and one of them would be wrong.
        seen: set[tuple[str, str]] = set()
        for i, report in enumerate(value or ()):
            key = (report.engine, report.replica)
            if key in seen:
                raise PydanticCustomError("duplicate_key", "replica '{replica}' of engine '{engine}' is reported "
                                          "twice (again at index {index})",
                                          {"replica": report.replica, "engine": report.engine, "index": i})
            seen.add(key)
        return value

    @field_validator("supervised_engines")
    @classmethod
    def _one_report_per_engine(cls, value: list[SupervisedEngineReport] | None) -> list[SupervisedEngineReport] | None:
        seen: set[str] = set()
        for i, report in enumerate(value or ()):
            if report.engine in seen:
                raise PydanticCustomError("duplicate_key", "engine '{engine}' is reported twice (again at index "
                                          "{index})", {"engine": report.engine, "index": i})
            seen.add(report.engine)
        return value


class HeartbeatAck(BaseModel):
    expected_etag: str | None = Field(description="the ETag /v1/bundle would serve this worker now; "
                                      "null when no policy applies to it")
    converged: bool = Field(description="whether the reported ETag is the expected one")


class ReplicaRead(BaseModel):
    engine: str
    replica: str
    state: ReplicaState
    in_flight: int
    running: float | None
    waiting: float | None
    consecutive_failures: int
    ejections: int
    returns: int
    next_probe_in_s: float | None = Field(description="null unless ejected")


class TokenizerCheckRead(BaseModel):
    aligned: bool | None
    draft: str
    differences: list[str]
    notes: list[str] = []


class SupervisedEngineRead(BaseModel):
    engine: str
    state: SupervisedState
    config_hash: str | None
    revision: str | None
    restarts: int
    failed_restarts: int
    crashes: int
    last_error: str | None
    error_revision: str | None = Field(None, description="the revision whose arguments last_error is about")
    tokenizer: TokenizerCheckRead | None = Field(None, description="the tokenizer check of its draft model (null: "
                                                                   "no draft model, or reported before the check)")
    # A default: reports stored before the control plane stamped them have none.
    serving_since: dt.datetime | None = Field(
        None, description="when the engine began serving its current arguments (config_hash), by the control "
                          "plane's clock; null while it has not served them yet. A crash and restart with the "
                          "same arguments keeps it")


class WorkerRead(BaseModel):
    id: str
    kind: WorkerKind
    pool: str
    labels: dict[str, str]
    engines: dict[str, str]
    sidecar_version: str | None
    registered_at: dt.datetime
    last_heartbeat_at: dt.datetime
    active_revision: str | None
    active_etag: str | None
    expected_etag: str | None
    stale: bool = Field(description="no heartbeat for longer than SPECGATE_WORKER_STALE_AFTER_S")
    converged: bool = Field(description="the reported ETag is the expected one, and the engines the worker "
                                        "supervises (if any) serve with the arguments of the revision it runs")
    engines_converged: bool | None = Field(description="every engine the worker supervises serves with the "
                                                       "arguments of its active revision; null when it supervises "
                                                       "none")
    replicas: list[ReplicaRead] = Field(description="the replicas it last reported, by engine and replica; "
                                                    "[] when it never reported any")
    replicas_reported_at: dt.datetime | None = Field(description="when it last reported its replicas; null "
                                                                 "when it never did")
    supervised_engines: list[SupervisedEngineRead] = Field(description="the engines it last reported supervising, "
                                                                       "by name; [] when none")
    supervised_reported_at: dt.datetime | None = Field(description="when it last reported them; null when it "
                                                                   "never did")


class WorkerPage(BaseModel):
    items: list[WorkerRead]
    next_cursor: str | None = Field(description="pass as cursor for the next page; null on the last page")


class RevisionCount(BaseModel):
    revision: str | None = Field(description="revision reported by workers; null when they report none")
    workers: int


class FleetGroup(BaseModel):
    workers: int
    stale: int
    converged_workers: int = Field(description="non-stale workers reporting their expected ETag")
    converged: bool = Field(description="every non-stale worker reports its expected ETag")
    revisions: list[RevisionCount] = Field(description="revisions non-stale workers report running")


class PoolFleet(FleetGroup):
    pool: str


class ReplicaCounts(BaseModel):
    reporters: int = Field(description="non-stale workers and gateways whose replica report is fresh (within "
                                       "stale_after_s)")
    total: int = Field(description="replicas those reporters route to")
    healthy: int
    ejected: int


class FleetRead(BaseModel):
    generation: int
    kill_switch: bool
    stale_after_s: float
    overall: FleetGroup = Field(description="sidecars of kind worker only (gateways are in `gateways`)")
    pools: list[PoolFleet] = Field(description="per pool, sidecars of kind worker only")
    gateways: FleetGroup = Field(description="sidecars of kind gateway, counted as `overall` counts workers")
    gateway_pools: list[PoolFleet] = Field(description="per pool, sidecars of kind gateway")
    replicas: ReplicaCounts = Field(description="engine replicas reported by workers and gateways alike")
