"""Liveness, readiness and Prometheus metrics of the control plane."""
