"""Running one dashboard page (or the whole app) with Streamlit's AppTest, against a live control plane."""

from __future__ import annotations

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from tests.support import paths

APP = paths.ROOT / "dashboard" / "app.py"
TIMEOUT = 60  # seconds per script run: a page makes several API calls, on two busy cores


def page(name: str) -> AppTest:
    """One page's ``render()``, as the navigation runs it."""
    return AppTest.from_string(f"from dashboard.views.{name} import render\nrender()\n", default_timeout=TIMEOUT)


def app() -> AppTest:
    return AppTest.from_file(str(APP), default_timeout=TIMEOUT)


def use(monkeypatch: pytest.MonkeyPatch, url: str, key: str | None, **settings: str) -> None:
    """The dashboard's settings for the next runs: where the control plane is, and the key to sign in with."""
    monkeypatch.setenv("SPECGATE_DASHBOARD_API_URL", url)
    if key is None:
        monkeypatch.delenv("SPECGATE_DASHBOARD_API_KEY", raising=False)
    else:
        monkeypatch.setenv("SPECGATE_DASHBOARD_API_KEY", key)
    for name, value in settings.items():
        monkeypatch.setenv(f"SPECGATE_DASHBOARD_{name.upper()}", value)


def changed_elsewhere() -> None:
    """A change made outside the dashboard: drop its cached reads, as their time to live would (the dashboard
    drops them itself after its own changes)."""
    st.cache_data.clear()


def texts(elements: object) -> str:
    """Every value of a list of elements, joined: for `in` checks on messages."""
    return "\n".join(str(e.value) for e in elements)  # type: ignore[attr-defined]


def no_exception(at: AppTest) -> None:
    assert not at.exception, texts(at.exception)


def button(at: AppTest, label: str):  # type: ignore[no-untyped-def]
    found = [b for b in at.button if b.label == label]
    assert found, f"no button {label!r}: {[b.label for b in at.button]}"
    return found[0]
