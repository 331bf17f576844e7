"""Autopilot: a policy that edits and rolls itself out from its recommendations, opt-in."""
