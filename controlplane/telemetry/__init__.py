"""Telemetry store: idempotent batch ingest, raw events, mergeable per-minute rollups."""
