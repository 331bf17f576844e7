"""specgate controlplane (built in a later issue)."""
