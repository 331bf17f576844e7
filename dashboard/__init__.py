"""specgate dashboard (built in a later issue)."""
