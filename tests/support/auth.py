"""Authorization headers for API keys."""

from __future__ import annotations


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
