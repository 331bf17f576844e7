"""Reads several pages share."""

from __future__ import annotations

from functools import partial
from typing import Any

from apiclient import ApiError, calls
from apiclient.models import Policy, Rollout
from dashboard import ui


def active_documents(session: ui.Session, policies: list[Policy]) -> dict[str, dict[str, Any]]:
    """Each policy's active document (canonical), by policy name; policies without one are left out.

    One read per policy (the API has no call that lists active documents); revisions never change, so
    each is read once and then comes from the cache.
    """
    documents: dict[str, dict[str, Any]] = {}
    for policy in policies:
        if policy.active_revision_id:
            try:
                documents[policy.name] = session.revision(policy.active_revision_id).document
            except ApiError:
                continue
    return documents


def open_rollouts_of(session: ui.Session) -> list[Rollout]:
    """Running and paused rollouts (a refusal shows as a message and counts as none)."""
    found: list[Rollout] = []
    for state in ("running", "paused"):
        page = ui.call(partial(session.read, calls.rollouts(state=state, limit=100)))
        found.extend(page.items if page is not None else [])
    return found
