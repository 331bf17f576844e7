"""telemetry store: batches (idempotency), raw events, per-minute rollups and their histograms

Revision ID: 20261202_0002
Revises: 20261202_0001
Create Date: 2026-12-02 19:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261202_0002"
down_revision = "20261202_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "telemetry_batches",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("worker_id", sa.String(length=128), nullable=False),
        sa.Column("sent_by", sa.String(length=128), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("event_count", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("stored", sa.Integer(), nullable=False),
        sa.Column("rejected", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("batch_id", name=op.f("pk_telemetry_batches")),
    )
    with op.batch_alter_table("telemetry_batches", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_telemetry_batches_received_at"), ["received_at"], unique=False)

    op.create_table(
        "telemetry_events",
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("worker_id", sa.String(length=128), nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("route", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("policy", sa.String(length=63), nullable=False),
        sa.Column("revision", sa.String(length=64), nullable=False),
        sa.Column("rule", sa.String(length=63), nullable=False),
        sa.Column("engine", sa.String(length=63), nullable=False),
        sa.Column("decided_engine", sa.String(length=63), nullable=False),
        sa.Column("speculate", sa.Boolean(), nullable=False),
        sa.Column("num_speculative_tokens", sa.Integer(), nullable=False),
        sa.Column("explored", sa.Boolean(), nullable=False),
        sa.Column("canary", sa.Boolean(), nullable=False),
        sa.Column("kill_switch", sa.Boolean(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("structured_output", sa.Boolean(), nullable=False),
        sa.Column("tools", sa.Boolean(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("itl_ms", sa.Float(), nullable=True),
        sa.Column("e2e_ms", sa.Float(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("retries", sa.Integer(), nullable=False),
        sa.Column("fallback", sa.Boolean(), nullable=False),
        sa.Column("fallback_reason", sa.String(length=200), nullable=True),
        sa.Column("structured_valid", sa.Boolean(), nullable=True),
        sa.Column("spec_draft_tokens", sa.Integer(), nullable=True),
        sa.Column("spec_accepted_tokens", sa.Integer(), nullable=True),
        sa.Column("spec_acceptance_rate", sa.Float(), nullable=True),
        sa.Column("spec_mean_acceptance_length", sa.Float(), nullable=True),
        sa.Column("spec_steps", sa.Integer(), nullable=True),
        sa.Column("engine_ttft_ms", sa.Float(), nullable=True),
        sa.Column("engine_itl_ms", sa.Float(), nullable=True),
        sa.Column("engine_queue_ms", sa.Float(), nullable=True),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_telemetry_events")),
    )
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.create_index("ix_telemetry_events_engine_time", ["engine", "time"], unique=False)
        batch_op.create_index("ix_telemetry_events_policy_time", ["policy", "time"], unique=False)
        batch_op.create_index("ix_telemetry_events_revision_time", ["revision", "time"], unique=False)
        batch_op.create_index("ix_telemetry_events_route_time", ["route", "time"], unique=False)
        batch_op.create_index("ix_telemetry_events_time", ["time"], unique=False)
        batch_op.create_index("ix_telemetry_events_worker_time", ["worker_id", "time"], unique=False)

    op.create_table(
        "telemetry_rollups",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("policy", sa.String(length=63), nullable=False),
        sa.Column("revision", sa.String(length=64), nullable=False),
        sa.Column("route", sa.String(length=128), nullable=False),
        sa.Column("engine", sa.String(length=63), nullable=False),
        sa.Column("batch_bucket", sa.Integer(), nullable=False),
        sa.Column("explored", sa.Boolean(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("ok", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("client_disconnects", sa.BigInteger(), nullable=False),
        sa.Column("fallbacks", sa.BigInteger(), nullable=False),
        sa.Column("retries", sa.BigInteger(), nullable=False),
        sa.Column("speculated", sa.BigInteger(), nullable=False),
        sa.Column("structured_checked", sa.BigInteger(), nullable=False),
        sa.Column("structured_valid", sa.BigInteger(), nullable=False),
        sa.Column("spec_reported", sa.BigInteger(), nullable=False),
        sa.Column("draft_tokens_sum", sa.BigInteger(), nullable=False),
        sa.Column("accepted_tokens_sum", sa.BigInteger(), nullable=False),
        sa.Column("spec_steps_sum", sa.BigInteger(), nullable=False),
        sa.Column("spec_steps_count", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens_sum", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens_count", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens_sum", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens_count", sa.BigInteger(), nullable=False),
        sa.Column("e2e_ms_sum", sa.Float(), nullable=False),
        sa.Column("ttft_ms_sum", sa.Float(), nullable=False),
        sa.Column("ttft_count", sa.BigInteger(), nullable=False),
        sa.Column("itl_ms_sum", sa.Float(), nullable=False),
        sa.Column("itl_count", sa.BigInteger(), nullable=False),
        sa.Column("itl_weighted_ms_sum", sa.Float(), nullable=False),
        sa.Column("itl_weighted_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_telemetry_rollups")),
        sa.UniqueConstraint(
            "minute",
            "policy",
            "revision",
            "route",
            "engine",
            "batch_bucket",
            "explored",
            name="uq_telemetry_rollups_key",
        ),
    )
    op.create_table(
        "telemetry_rollup_histograms",
        sa.Column(
            "rollup_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=False,
            nullable=False,
        ),
        sa.Column("metric", sa.String(length=8), nullable=False),
        sa.Column("bucket", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["rollup_id"],
            ["telemetry_rollups.id"],
            name=op.f("fk_telemetry_rollup_histograms_rollup_id_telemetry_rollups"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("rollup_id", "metric", "bucket", name=op.f("pk_telemetry_rollup_histograms")),
    )


def downgrade() -> None:
    op.drop_table("telemetry_rollup_histograms")
    op.drop_table("telemetry_rollups")
    with op.batch_alter_table("telemetry_events", schema=None) as batch_op:
        batch_op.drop_index("ix_telemetry_events_worker_time")
        batch_op.drop_index("ix_telemetry_events_time")
        batch_op.drop_index("ix_telemetry_events_route_time")
        batch_op.drop_index("ix_telemetry_events_revision_time")
        batch_op.drop_index("ix_telemetry_events_policy_time")
        batch_op.drop_index("ix_telemetry_events_engine_time")

    op.drop_table("telemetry_events")
    with op.batch_alter_table("telemetry_batches", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_telemetry_batches_received_at"))

    op.drop_table("telemetry_batches")
