"""Reads several pages share."""

from __future__ import annotations

from functools import partial
from typing import Any

from dashboard import ui
from dashboard.client import ApiClient, ApiError, Policy, Rollout


def active_documents(api: ApiClient, policies: list[Policy]) -> dict[str, dict[str, Any]]:
    """Each policy's active document (canonical), by policy name; policies without one are left out."""
    documents: dict[str, dict[str, Any]] = {}
    for policy in policies:
        if policy.active_revision_id:
            try:
                documents[policy.name] = api.revision(policy.active_revision_id).document
            except ApiError:
                continue
    return documents


def open_rollouts_of(session: ui.Session) -> list[Rollout]:
    """Running and paused rollouts (a refusal shows as a message and counts as none)."""
    found: list[Rollout] = []
    for state in ("running", "paused"):
        page = ui.call(partial(session.api.rollouts, state=state, limit=100))
        found.extend(page.items if page is not None else [])
    return found
