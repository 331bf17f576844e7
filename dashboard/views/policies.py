"""Policies: a YAML editor with live validation, the diff against the active revision, a dry run,
saving a draft revision, and each policy's history."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from apiclient import calls
from apiclient.models import DraftCheck, Policy
from dashboard import ui

_NEW_POLICY_TEMPLATE = """\
apiVersion: specgate/v1
name: {name}
engines:
  base: {{method: none}}
  draft: {{method: draft_model, model: models/draft, num_speculative_tokens: 3}}
rules:
  - name: chat-low-batch
    when: {{route: [chat], batch_size: {{max: 4}}, structured_output: false}}
    then: {{engine: draft}}
default: {{engine: base}}
"""


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def _dry_run_shape(policy: str) -> dict[str, Any] | None:
    st.markdown("**Dry run**: a request shape, and what the draft and the active revision decide for it.")
    c1, c2, c3, c4 = st.columns(4)
    route = c1.text_input("route", value="chat", key=ui.key("dry_route", policy))
    model = c2.text_input("model", value="", key=ui.key("dry_model", policy))
    batch = c3.number_input("batch size", min_value=0, max_value=100_000, value=2, step=1,
                            key=ui.key("dry_batch", policy))
    max_tokens = c4.number_input("max_tokens (0: not set)", min_value=0, max_value=1_000_000, value=256,
                                 key=ui.key("dry_max", policy))
    c5, c6, c7, c8 = st.columns(4)
    structured = c5.checkbox("structured output", key=ui.key("dry_structured", policy))
    tools = c6.checkbox("tools", key=ui.key("dry_tools", policy))
    stream = c7.checkbox("stream", key=ui.key("dry_stream", policy))
    labels = c8.text_input("labels (k=v, ...)", value="", key=ui.key("dry_labels", policy))
    shape: dict[str, Any] = {"route": route, "batch_size": int(batch), "structured_output": structured,
                             "tools": tools, "stream": stream, "labels": _labels(labels)}
    if model:
        shape["model"] = model
    if max_tokens:
        shape["max_tokens"] = int(max_tokens)
    return shape


def _new_policy(session: ui.Session) -> None:
    with st.expander("New policy", expanded=False):
        with st.form(ui.key("new_policy")):
            name = st.text_input("name (letters, digits, _ . -)")
            pool = st.text_input("pool (empty: every pool without a policy of its own)")
            description = st.text_input("description")
            pressed = st.form_submit_button("Create policy", disabled=not session.can_edit)
        if pressed:
            created = ui.call(lambda: session.write(calls.create_policy(
                name.strip(), pool=pool.strip() or None, description=description.strip() or None)))
            if created is not None:
                ui.flash(f"Policy {ui.literal(created.name)} created: write its first revision below.")
                st.session_state[ui.key("policy")] = created.name
                st.rerun()


def _editor(session: ui.Session, policy: Policy) -> None:
    key = ui.key("editor", policy.name)
    # The head the editor's text was based on: saving builds on it (If-Match), so a revision someone else
    # saved in the meantime is a conflict to look at, not something silently overwritten.
    base_key = ui.key("base", policy.name)
    if key not in st.session_state:
        start = _NEW_POLICY_TEMPLATE.format(name=policy.name)
        if policy.head_revision_id:
            head = ui.call(lambda: session.revision(policy.head_revision_id or ""))
            if head is not None:
                start = head.source_text or head.canonical_yaml
        st.session_state[key] = start
        st.session_state[base_key] = policy.head_revision_id
    base = st.session_state.get(base_key)
    if base != policy.head_revision_id:
        c1, c2 = st.columns([4, 1])
        c1.warning(f"A newer revision {ui.literal(ui.short(policy.head_revision_id))} was saved since this editor "
                   f"loaded {ui.literal(ui.short(base))}: saving is refused until you reload it (your text is lost "
                   "then).")
        if c2.button("Load the newest", key=ui.key("reload", policy.name)):
            del st.session_state[key]
            st.rerun()
    text = st.text_area("Policy document (YAML)", key=key, height=360,
                        help="Validated by the control plane as you edit (press Ctrl+Enter or click outside "
                             "the editor to check).")
    with st.expander("Dry run", expanded=True):
        shape = _dry_run_shape(policy.name)

    check: DraftCheck | None = ui.call(lambda: session.check(calls.validate(policy.name, text,
                                                                            shapes=[shape] if shape else [])))
    if check is None:
        st.session_state[ui.key("valid", policy.name)] = False
        return
    st.session_state[ui.key("valid", policy.name)] = True
    if check.existing:
        st.success(f"Valid. This document is already revision {ui.literal(ui.short(check.revision_id))}.")
    else:
        st.success(f"Valid. Saved, it would become revision {ui.literal(ui.short(check.revision_id))}.")

    if check.evaluations and shape is not None:
        rows = [{"revision": "draft", "engine": e.decision.engine, "speculate": e.decision.speculate,
                 "k": e.decision.num_speculative_tokens, "rule": e.decision.rule} for e in check.evaluations]
        if policy.active_revision_id:
            active = ui.call(lambda: session.check(calls.evaluate(policy.active_revision_id or "", [shape])))
            for e in active or []:
                rows.append({"revision": f"active ({ui.short(policy.active_revision_id)})",
                             "engine": e.decision.engine, "speculate": e.decision.speculate,
                             "k": e.decision.num_speculative_tokens, "rule": e.decision.rule})
        st.markdown("**Decision for the dry-run shape**")
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")

    st.markdown("**Diff against the active revision**")
    if check.diff is None:
        st.caption("The policy has no active revision yet: the first revision becomes active when saved.")
    elif check.diff.identical:
        st.caption(f"Identical to the active revision #{check.diff.against.seq}.")
    else:
        for line in check.diff.summary.lines():
            # The lines name rules and engines of the document: the author's words, shown as written.
            st.markdown(f"- {ui.literal(line)}")
        st.code(check.diff.unified, language="diff")

    with st.form(ui.key("save", policy.name)):
        message = st.text_input("Message (why this revision exists)", key=ui.key("message", policy.name),
                                disabled=not session.can_edit)
        pressed = st.form_submit_button("Save as draft revision", disabled=not session.can_edit or check.existing,
                                        type="primary")
    if pressed:
        if not message.strip():
            st.warning("Write a message: it stays with the revision in the history.")
            return
        # Building on the head the text came from; a policy without revisions has none to build on.
        saved = ui.call(lambda: session.change(calls.create_revision(
            policy.name, text, message=message.strip(), if_match=f'"{base}"' if base else "*")))
        if saved is not None:
            revision, created = saved.data, saved.status == 201
            if created:
                st.session_state[base_key] = revision.id
            state = "active (the policy's first revision)" if revision.active else "a draft: roll it out from Rollouts"
            ui.flash(f"Revision #{revision.seq} {ui.literal(ui.short(revision.id))} of {ui.literal(policy.name)} "
                     f"saved; it is {state}." if created else
                     f"Nothing saved: revision {ui.literal(ui.short(revision.id))} already has this content.")
            st.rerun()


def _history(session: ui.Session, policy: Policy) -> None:
    stack_key = ui.key("hist_cursors", policy.name)
    cursors: list[int | None] = st.session_state.setdefault(stack_key, [None])
    page = ui.call(lambda: session.read(calls.revisions(policy.name, cursor=cursors[-1],
                                                        limit=session.settings.page_size)))
    if page is None:
        return
    if not page.items:
        st.caption("No revisions yet.")
        return
    st.dataframe(pd.DataFrame([{
        "seq": r.seq, "revision": ui.short(r.id), "active": "yes" if r.active else "", "author": r.author,
        "message": r.message, "created": r.created_at.strftime("%Y-%m-%d %H:%M:%S UTC"),
    } for r in page.items]), hide_index=True, width="stretch")
    c1, c2, _ = st.columns([1, 1, 4])
    if c1.button("Newer", disabled=len(cursors) == 1, key=ui.key("hist_newer", policy.name)):
        cursors.pop()
        st.rerun()
    if c2.button("Older", disabled=page.next_cursor is None, key=ui.key("hist_older", policy.name)):
        cursors.append(page.next_cursor)
        st.rerun()
    chosen = st.selectbox("Show revision", [r.id for r in page.items],
                          format_func=lambda rid: next(f"#{r.seq} {ui.short(r.id)} {r.message}"
                                                       for r in page.items if r.id == rid),
                          key=ui.key("hist_pick", policy.name))
    if chosen:
        revision = ui.call(lambda: session.revision(chosen))
        if revision is not None:
            st.code(revision.canonical_yaml, language="yaml")


def render() -> None:
    session = ui.require_session()
    st.markdown("<style>.stTextArea textarea {font-family: ui-monospace, monospace; font-size: 13px;}</style>",
                unsafe_allow_html=True)
    st.title("Policies")
    ui.show_flash()
    ui.read_only_note(session, need=ui.EDIT_SCOPES)
    _new_policy(session)
    policies = ui.call(lambda: session.read(calls.policies()))
    if not policies:
        if policies is not None:
            st.info("No policies yet.")
        return
    names = [p.name for p in policies]
    if st.session_state.get(ui.key("policy")) not in names:
        st.session_state[ui.key("policy")] = names[0]
    name = st.selectbox("Policy", names, key=ui.key("policy"))
    policy = next(p for p in policies if p.name == name)
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("Pool", policy.pool or "(any)")
    c2.metric("Active", ui.short(policy.active_revision_id))
    c3.metric("Head", ui.short(policy.head_revision_id))
    c4.metric("Revisions", policy.revision_count)
    edit, history = st.tabs(["Edit a new revision", "History"])
    with edit:
        _editor(session, policy)
    with history:
        _history(session, policy)
