"""What every page shares: the signed-in client, roles, errors as messages, confirmed actions."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import streamlit as st

from dashboard.client import ApiClient, ApiError, Problem, WhoAmI
from dashboard.settings import DashboardSettings

T = TypeVar("T")

_URL, _KEY, _WHO, _FLASH, _GENERATION = "sg_api_url", "sg_api_key", "sg_who", "sg_flash", "sg_form_generation"

OPERATE_SCOPES = ("admin", "operator")
EDIT_SCOPES = ("admin",)


@dataclass(frozen=True)
class Session:
    api: ApiClient
    who: WhoAmI
    settings: DashboardSettings

    @property
    def can_operate(self) -> bool:
        """Rollouts, rollbacks, the kill switch."""
        return self.who.scope in OPERATE_SCOPES

    @property
    def can_edit(self) -> bool:
        """Policy documents: new policies and revisions."""
        return self.who.scope in EDIT_SCOPES


def settings() -> DashboardSettings:
    return DashboardSettings()


def show_problem(problem: Problem) -> None:
    """A refusal as a person reads it: title, detail, and each field error with its path and line."""
    lines = [f"**{problem.title}**" + (f" (HTTP {problem.status})" if problem.status else "")
             + (f": {problem.detail}" if problem.detail else "")]
    for err in problem.errors:
        where = err.path or "document"
        if err.line is not None:
            where += f" (line {err.line})"
        lines.append(f"- `{where}`: {err.message}" + (f" [{err.code}]" if err.code else ""))
    for name in ("state", "current_head", "active_revision", "policy"):
        if name in problem.extra:
            lines.append(f"- {name.replace('_', ' ')}: `{problem.extra[name]}`")
    st.error("\n".join(lines))


def call(fn: Callable[[], T]) -> T | None:
    """Run one API call; a refusal becomes a message on the page and None, never a traceback."""
    try:
        return fn()
    except ApiError as exc:
        show_problem(exc.problem)
        return None


def sign_in(url: str, key: str) -> Problem | None:
    """Check the key against the control plane and keep it for this browser session."""
    cfg = settings()
    api = ApiClient(url, key.strip(), timeout_s=cfg.timeout_s)
    try:
        who = api.whoami()
    except ApiError as exc:
        return exc.problem
    finally:
        api.close()
    st.session_state[_URL], st.session_state[_KEY] = url, key.strip()
    st.session_state[_WHO] = who.model_dump()
    st.session_state.pop("sg_signed_out", None)
    return None


def sign_out() -> None:
    for name in (_KEY, _WHO):
        st.session_state.pop(name, None)
    st.session_state["sg_signed_out"] = True


def current() -> Session | None:
    """The signed-in session, signing in with the configured key on first use; None when nobody is."""
    cfg = settings()
    if _WHO not in st.session_state and cfg.api_key and not st.session_state.get("sg_signed_out"):
        problem = sign_in(st.session_state.get(_URL, cfg.api_url), cfg.api_key)
        if problem is not None:
            show_problem(problem)
            return None
    if _WHO not in st.session_state:
        return None
    api = ApiClient(st.session_state[_URL], st.session_state[_KEY], timeout_s=cfg.timeout_s)
    return Session(api, WhoAmI.model_validate(st.session_state[_WHO]), cfg)


def require_session() -> Session:
    """The page's session; without one, a sign-in hint and the page stops."""
    session = current()
    if session is None:
        st.info("Sign in with an API key in the sidebar to use the dashboard.")
        st.stop()
    assert session is not None
    return session


def read_only_note(session: Session, *, need: tuple[str, ...]) -> None:
    if session.who.scope not in need:
        st.caption(f"Signed in as `{session.who.actor}` ({session.who.scope}): you can look, the controls on "
                   f"this page need an {' or '.join(need)} key.")


def flash(message: str) -> None:
    """A success message that survives the rerun that refreshes the page.

    It also empties every confirmation form: the next change asks for its own reason and confirmation.
    """
    st.session_state.setdefault(_FLASH, []).append(message)
    st.session_state[_GENERATION] = st.session_state.get(_GENERATION, 0) + 1


def show_flash() -> None:
    for message in st.session_state.pop(_FLASH, []):
        st.success(message)


def confirmed(form_key: str, *, what: str, button: str, disabled: bool,
              extra: Callable[[], None] | None = None) -> str | None:
    """A form that asks for a reason and an explicit confirmation; answers the reason once both are given.

    ``extra`` draws further inputs inside the form (read them from session state by their keys).
    """
    generation = st.session_state.get(_GENERATION, 0)
    with st.form(form_key, clear_on_submit=False, border=True):
        if extra is not None:
            extra()
        reason = st.text_input("Reason (goes to the audit log)", key=f"{form_key}_reason_{generation}",
                               disabled=disabled)
        sure = st.checkbox(f"I confirm: {what}", key=f"{form_key}_confirm_{generation}", disabled=disabled)
        pressed = st.form_submit_button(button, disabled=disabled, type="primary")
    if not pressed:
        return None
    if not reason.strip():
        st.warning("A reason is required: it is recorded in the audit log with the change.")
        return None
    if not sure:
        st.warning("Tick the confirmation box to go ahead.")
        return None
    return reason.strip()


def short(revision_id: str | None) -> str:
    return revision_id[:12] if revision_id else "-"


def ago(when: dt.datetime | None) -> str:
    if when is None:
        return "never"
    seconds = (dt.datetime.now(dt.UTC) - when.astimezone(dt.UTC)).total_seconds()
    if seconds < 90:
        return f"{max(int(seconds), 0)} s ago"
    if seconds < 5400:
        return f"{int(seconds // 60)} min ago"
    if seconds < 172800:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} d ago"
