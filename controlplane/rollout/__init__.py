"""Rollouts, their guardrails, policy rollbacks and the kill switch: how the active policy changes safely."""
