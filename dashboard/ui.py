"""What every page shares: the signed-in client, cached reads, roles, errors as messages, confirmed actions.

Every key the dashboard puts in ``st.session_state`` (its own values and its
widgets') starts with :data:`PREFIX`: build them with :func:`key`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import streamlit as st

from apiclient import ApiClient, ApiError, Call, Reply, calls
from apiclient.models import Revision, WhoAmI
from dashboard.settings import DashboardSettings
from wire.problems import Problem

T = TypeVar("T")

PREFIX = "sg_"
# Reads are shared by every browser session with the same key for this long; a change made through the
# dashboard drops them at once, a change made elsewhere shows after at most this (or "Refresh data").
READ_TTL_S = 10
# Revisions never change (their id is the hash of their content): kept an hour.
REVISION_TTL_S = 3600

OPERATE_SCOPES = ("admin", "operator")
EDIT_SCOPES = ("admin",)


def key(*parts: object) -> str:
    """The session-state key of one of the dashboard's values or widgets."""
    return PREFIX + "_".join(str(p) for p in parts)


_URL, _KEY, _WHO, _SIGNED_OUT = key("api_url"), key("api_key"), key("who"), key("signed_out")
_FLASH, _GENERATION = key("flash"), key("form_generation")


def _close(api: ApiClient) -> None:
    api.close()


# One client per browser session and control plane + key: its connections are reused from rerun to rerun,
# and closed when the session signs out, signs in elsewhere, or ends.
@st.cache_resource(scope="session", max_entries=4, on_release=_close, show_spinner=False)
def _client(base_url: str, api_key: str, timeout_s: float) -> ApiClient:
    return ApiClient(base_url, api_key, timeout_s=timeout_s)


# The key's digest (not the key) tells one key's reads from another's; the client and the call are not
# hashed (the call is named by `what`).
@st.cache_data(ttl=READ_TTL_S, max_entries=2000, show_spinner=False)
def _read(base_url: str, key_digest: str, what: str, _api: ApiClient, _call: Call[Any]) -> Any:
    return _api.send(_call).data


@st.cache_data(ttl=REVISION_TTL_S, max_entries=500, show_spinner=False)
def _read_revision(base_url: str, key_digest: str, revision_id: str, _api: ApiClient) -> Revision:
    return _api.send(calls.revision(revision_id)).data


def invalidate() -> None:
    """Drop every cached read (revisions stay: they never change)."""
    _read.clear()


@dataclass(frozen=True)
class Session:
    api: ApiClient
    who: WhoAmI
    settings: DashboardSettings
    key_digest: str

    @property
    def can_operate(self) -> bool:
        """Rollouts, rollbacks, the kill switch."""
        return self.who.scope in OPERATE_SCOPES

    @property
    def can_edit(self) -> bool:
        """Policy documents: new policies and revisions."""
        return self.who.scope in EDIT_SCOPES

    def read(self, call: Call[T]) -> T:
        """A GET, answered from the cache when it is fresh."""
        assert call.endpoint.method == "GET", call.key
        return cast(T, _read(self.api.base_url, self.key_digest, call.key, self.api, call))

    def revision(self, revision_id: str) -> Revision:
        return _read_revision(self.api.base_url, self.key_digest, revision_id, self.api)

    def check(self, call: Call[T]) -> T:
        """A call that computes without storing anything (validate, evaluate, what-if): never cached."""
        return self.api.send(call).data

    def change(self, call: Call[T]) -> Reply[T]:
        """A change, with its status: every cached read is dropped afterwards, refused or not (a refusal
        often means the page showed something out of date)."""
        try:
            return self.api.send(call)
        finally:
            invalidate()

    def write(self, call: Call[T]) -> T:
        """A change (see :meth:`change`), answering what it made."""
        return self.change(call).data


_BACKTICKS = re.compile(r"`+")


def literal(value: object) -> str:
    """``value`` as Markdown that shows exactly its characters: an inline code span.

    Streamlit renders Markdown in messages, captions, labels and st.write, and adds emoji shortcodes,
    material icons, colours and LaTeX on top. Route names, reasons, key names, messages and anything else
    a client or the telemetry chose go through this before they meet Markdown: inside a code span none of
    it applies (backslash escapes would not stop the shortcodes, which Streamlit expands after parsing).
    The fence is one backtick longer than any run in the value, so the value cannot close it.
    """
    text = " ".join(str(value).splitlines())
    if not text:
        return ""
    fence = "`" * (max((len(run) for run in _BACKTICKS.findall(text)), default=0) + 1)
    # A space on each side keeps a value that starts or ends with a backtick (or with spaces) intact:
    # CommonMark strips exactly one space from each end of a code span.
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def settings() -> DashboardSettings:
    return DashboardSettings()


def show_problem(problem: Problem) -> None:
    """A refusal as a person reads it: title, detail, and each field error with its path and line."""
    # The detail and the field messages quote what the client sent (names, routes, document text): literal.
    lines = [f"**{literal(problem.title)}**" + (f" (HTTP {problem.status})" if problem.status else "")
             + (f": {literal(problem.detail)}" if problem.detail else "")]
    for err in problem.errors:
        where = err.path or "document"
        if err.line is not None:
            where += f" (line {err.line})"
        lines.append(f"- {literal(where)}: {literal(err.message)}" + (f" [{err.code}]" if err.code else ""))
    for name in ("state", "current_step", "current_head", "active_revision", "policy"):
        if name in problem.extra:
            lines.append(f"- {name.replace('_', ' ')}: {literal(problem.extra[name])}")
    st.error("\n".join(lines))


def call(fn: Callable[[], T]) -> T | None:
    """Run one API call; a refusal becomes a message on the page and None, never a traceback."""
    try:
        return fn()
    except ApiError as exc:
        show_problem(exc.problem)
        return None


def _digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _release(url: str, api_key: str) -> None:
    _client.clear(url, api_key, settings().timeout_s)


def sign_in(url: str, api_key: str) -> Problem | None:
    """Check the key against the control plane and keep it for this browser session."""
    api_key = api_key.strip()
    api = _client(url, api_key, settings().timeout_s)
    try:
        who = api.send(calls.whoami()).data
    except ApiError as exc:
        _release(url, api_key)
        return exc.problem
    if _KEY in st.session_state and (st.session_state[_URL], st.session_state[_KEY]) != (url, api_key):
        _release(st.session_state[_URL], st.session_state[_KEY])
    st.session_state[_URL], st.session_state[_KEY] = url, api_key
    st.session_state[_WHO] = who.model_dump()
    st.session_state.pop(_SIGNED_OUT, None)
    return None


def sign_out() -> None:
    if _KEY in st.session_state:
        _release(st.session_state[_URL], st.session_state[_KEY])
    for name in (_KEY, _WHO):
        st.session_state.pop(name, None)
    st.session_state[_SIGNED_OUT] = True


def signed_in_url(default: str) -> str:
    """The control plane this session last signed in to (the sign-in form starts there)."""
    url: str = st.session_state.get(_URL, default)
    return url


def current() -> Session | None:
    """The signed-in session, signing in with the configured key on first use; None when nobody is."""
    cfg = settings()
    if _WHO not in st.session_state and cfg.api_key and not st.session_state.get(_SIGNED_OUT):
        problem = sign_in(st.session_state.get(_URL, cfg.api_url), cfg.api_key)
        if problem is not None:
            show_problem(problem)
            return None
    if _WHO not in st.session_state:
        return None
    url, api_key = st.session_state[_URL], st.session_state[_KEY]
    return Session(_client(url, api_key, cfg.timeout_s), WhoAmI.model_validate(st.session_state[_WHO]), cfg,
                   _digest(api_key))


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
        st.caption(f"Signed in as {literal(session.who.actor)} ({session.who.scope}): you can look, the controls on "
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
    with st.form(key(form_key), clear_on_submit=False, border=True):
        if extra is not None:
            extra()
        reason = st.text_input("Reason (goes to the audit log)", key=key(form_key, "reason", generation),
                               disabled=disabled)
        sure = st.checkbox(f"I confirm: {what}", key=key(form_key, "confirm", generation), disabled=disabled)
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
