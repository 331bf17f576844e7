"""Settings of the control plane deployable (environment prefix ``SPECGATE_``)."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ControlPlaneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECGATE_", extra="ignore")

    database_url: str = Field(
        default="sqlite:///specgate.db",
        description="SQLAlchemy URL; sqlite:///PATH (embedded) or postgresql+psycopg://... (production)",
    )
    signing_key: str | None = Field(
        default=None,
        description="Ed25519 private key, raw 32 bytes in base64, that signs bundles. "
        "Without it, a key is generated and stored in the database on first start.",
    )
    signing_key_previous: str | None = Field(
        default=None,
        description="the previous Ed25519 signing key during a rotation (same encoding as SIGNING_KEY): "
        "bundles are signed with both, so sidecars pinned to either accept them",
    )
    bundle_ttl_s: float = Field(
        default=86400.0, ge=60, le=30 * 86400,
        description="how long a signed bundle may be accepted after it was issued; sidecars keep serving "
        "their current bundle past it, but refuse to accept an expired one (replays)",
    )
    worker_stale_after_s: float = Field(default=30.0, gt=0, description="heartbeat silence that marks a worker stale")
    long_poll_max_s: float = Field(default=60.0, gt=0, le=600)
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    sse_keepalive_s: float = Field(default=15.0, gt=0)
    telemetry_retention_days: int = Field(default=30, ge=1, le=3650,
                                          description="`specgate telemetry purge` deletes telemetry older than this "
                                          "(PostgreSQL: raw events by dropping whole day partitions)")
    telemetry_partition_interval_s: float = Field(
        default=3600.0, ge=0, le=86400,
        description="PostgreSQL: how often the control plane creates the day partitions of raw events ahead "
        "(also once at start); 0 turns the background task off (ingest still creates a missing day on demand)")
    telemetry_partition_days_ahead: int = Field(
        default=3, ge=1, le=366,
        description="PostgreSQL: how many days after today have their raw-event partition created ahead")
    telemetry_ingest_concurrency: int = Field(default=4, ge=1, le=64,
                                              description="telemetry batches one process writes at once "
                                              "(PostgreSQL; SQLite writes one at a time)")
    telemetry_max_event_age_s: float = Field(
        default=7 * 86400, gt=0, le=3650 * 86400,
        description="an event whose `time` is further back than this from its receipt is refused (per event); "
        "the bound never reaches past SPECGATE_TELEMETRY_RETENTION_DAYS, whose purge would delete it")
    telemetry_max_clock_skew_s: float = Field(
        default=300, ge=0, le=86400,
        description="an event whose `time` is further ahead of its receipt than this is refused (per event): "
        "a future time would escape retention")
    guardrail_interval_s: float = Field(default=60.0, ge=0, le=86400,
                                        description="how often the leader evaluates running rollouts' "
                                        "guardrails; 0 runs no evaluator in this process (another replica may)")
    guardrail_alpha: float = Field(default=0.05, gt=0, lt=0.5,
                                   description="false-alarm bound of a step's guardrails over all its looks")
    guardrail_auto_promote: bool = Field(default=False,
                                         description="promote a step whose guardrails all pass with confidence")
    autopilot_interval_s: float = Field(default=30.0, ge=0, le=86400,
                                        description="how often the leader looks at every enabled autopilot; 0 runs "
                                        "no autopilot in this process (another replica may)")
    autopilot_lock_key: int = Field(default=0x53470001, ge=-(2**63), le=2**63 - 1,
                                    description="the PostgreSQL advisory lock that elects the one autopilot leader "
                                    "among the control-plane replicas sharing a database")
    guardrail_lock_key: int = Field(default=0x53470003, ge=-(2**63), le=2**63 - 1,
                                    description="the PostgreSQL advisory lock that elects the one guardrail "
                                    "evaluator among the control-plane replicas sharing a database; not the "
                                    "autopilot's, nor 0x53470002 (telemetry partitions)")

    @model_validator(mode="after")
    def _distinct_lock_keys(self) -> ControlPlaneSettings:
        # With one key for both roles, a process's second role would never win the lock its first role holds.
        if self.autopilot_lock_key == self.guardrail_lock_key:
            raise ValueError("SPECGATE_AUTOPILOT_LOCK_KEY and SPECGATE_GUARDRAIL_LOCK_KEY must differ")
        return self
