"""Tests of the sidecar request path (classification, proxy, telemetry, metrics)."""
