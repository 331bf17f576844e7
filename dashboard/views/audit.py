"""Audit log: every change, who, when and why; newest first, searchable, a page at a time."""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from apiclient import calls
from dashboard import ui

ACTIONS = ["", "policy.create", "revision.create", "rollout.start", "rollout.promote", "rollout.pause",
           "rollout.resume", "rollout.abort", "rollout.rollback", "rollout.auto_rollback", "policy.rollback",
           "killswitch.on", "killswitch.off", "worker.register", "worker.engine_restart_failed",
           "worker.engine_crashed", "worker.engine_down", "key.create", "key.bind", "key.revoke",
           "recommendation.apply"]


def render() -> None:
    session = ui.require_session()
    st.title("Audit log")
    c1, c2, c3 = st.columns([3, 2, 2])
    q = c1.text_input("Search (reason, action, actor, target, before/after)", key=ui.key("audit_q"))
    action = c2.selectbox("Action", ACTIONS, format_func=lambda a: a or "(any)", key=ui.key("audit_action"))
    actor = c3.text_input("Actor (exact, e.g. admin:alice)", key=ui.key("audit_actor"))
    query = (q.strip(), action, actor.strip())
    # A new search starts again at the newest page.
    if st.session_state.get(ui.key("audit_query")) != query:
        st.session_state[ui.key("audit_query")] = query
        st.session_state[ui.key("audit_cursors")] = [None]
    cursors: list[int | None] = st.session_state[ui.key("audit_cursors")]
    page = ui.call(lambda: session.read(calls.audit(q=query[0] or None, action=query[1] or None,
                                                    actor=query[2] or None, cursor=cursors[-1],
                                                    limit=session.settings.page_size)))
    if page is None:
        return
    if not page.items:
        st.caption("Nothing matches." if any(query) else "The audit log is empty.")
        return
    st.caption(f"Page {len(cursors)}, newest first")
    st.dataframe(pd.DataFrame([{
        "#": e.id, "when": e.at.strftime("%Y-%m-%d %H:%M:%S UTC"), "actor": e.actor, "action": e.action,
        "target": f"{e.target_type}:{e.target_id[:24]}", "reason": e.reason,
    } for e in page.items]), hide_index=True, width="stretch")
    b1, b2, _ = st.columns([1, 1, 4])
    if b1.button("Newer", disabled=len(cursors) == 1, key=ui.key("audit_newer")):
        cursors.pop()
        st.rerun()
    if b2.button("Older", disabled=page.next_cursor is None, key=ui.key("audit_older")):
        cursors.append(page.next_cursor)
        st.rerun()
    labels = {e.id: f"#{e.id} {e.at:%H:%M:%S} {e.action} {e.target_id[:24]}" for e in page.items}
    chosen = st.selectbox("Details of", list(labels), format_func=labels.__getitem__, key=ui.key("audit_pick"))
    event = next((e for e in page.items if e.id == chosen), None)
    if event is not None:
        left, right = st.columns(2)
        left.markdown("**before**")
        left.code(json.dumps(event.before, indent=2, sort_keys=True, default=str), language="json")
        right.markdown("**after**")
        right.code(json.dumps(event.after, indent=2, sort_keys=True, default=str), language="json")
