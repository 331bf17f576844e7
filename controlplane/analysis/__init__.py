"""Analysis of the telemetry: summaries, speedups, recommendations, what-if, rollout guardrails."""
