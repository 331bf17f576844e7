"""specgate sidecar (built in a later issue)."""
