"""Rollouts: start, promote, pause, resume, abort; roll back to any revision; the kill switch.

Every change asks for a reason (recorded in the audit log) and an explicit confirmation.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from apiclient import ApiError, calls
from apiclient.models import Policy, RevisionSummary, Rollout
from dashboard import ui
from dashboard.views.common import open_rollouts_of

_ACTION_WORDS = {"promote": "move to the next step (the last step completes the rollout)",
                 "pause": "hold the current split", "resume": "go on from the current step",
                 "abort": "stop splitting; the policy stays on its active revision"}


def _revisions(session: ui.Session, policy: str) -> list[RevisionSummary]:
    page = ui.call(lambda: session.read(calls.revisions(policy, limit=200)))
    return page.items if page is not None else []


def _label(r: RevisionSummary) -> str:
    return f"#{r.seq} {ui.short(r.id)}{' (active)' if r.active else ''} {r.message}".strip()


def _steps(text: str) -> list[float] | None:
    try:
        return [float(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        return None


def _kill_switch(session: ui.Session) -> None:
    st.subheader("Kill switch")
    switch = ui.call(lambda: session.read(calls.kill_switch()))
    if switch is None:
        return
    if switch.enabled:
        st.error(f"ON since {ui.ago(switch.changed_at)} ({ui.literal(switch.changed_by)}): "
                 f"{ui.literal(switch.reason)}. Every request goes to its policy's plain engine.")
    else:
        st.success("Off: policies decide." + (f" Last change {ui.ago(switch.changed_at)} by "
                                             f"{ui.literal(switch.changed_by)}." if switch.changed_at else ""))
    target = not switch.enabled
    what = ("turn speculation OFF fleet-wide (engines keep running)" if target
            else "let policies decide again")
    reason = ui.confirmed("killswitch", what=what, button="Turn the kill switch ON" if target
                          else "Turn the kill switch OFF", disabled=not session.can_operate)
    if reason is not None:
        changed = ui.call(lambda: session.write(calls.set_kill_switch(target, reason=reason)))
        if changed is not None:
            ui.flash(f"Kill switch is now {'ON' if changed.enabled else 'off'}.")
            st.rerun()


def _guardrails(session: ui.Session, r: Rollout) -> None:
    """The latest guardrail evaluation of the rollout, when the control plane evaluates guardrails."""
    try:
        history = session.read(calls.guardrails(r.id, limit=1))
    except ApiError as exc:
        if exc.status not in (404, 405):
            ui.show_problem(exc.problem)
        return
    if not history.evaluations:
        st.caption("Guardrails: not evaluated yet.")
        return
    latest = history.evaluations[0]
    st.markdown(f"Guardrails at step {latest.step + 1}: **{latest.verdict}** ({ui.ago(latest.evaluated_at)}; "
                f"canary {latest.canary_requests:,} vs baseline {latest.baseline_requests:,} requests)")
    if latest.checks:
        st.dataframe(pd.DataFrame([{"guardrail": c.guardrail, "status": c.status, "limit": c.limit,
                                    "observed": c.observed, "detail": c.detail} for c in latest.checks]),
                     hide_index=True, width="stretch")


def _open_rollout(session: ui.Session, r: Rollout) -> None:
    with st.container(border=True):
        st.markdown(f"**{ui.literal(r.policy)}**: {ui.literal(ui.short(r.from_revision))} -> "
                    f"{ui.literal(ui.short(r.to_revision))} · {r.mode} · "
                    f"**{r.state}** at step {r.current_step + 1}/{len(r.steps)} ({r.current_percent:g}%) · "
                    f"by {ui.literal(r.created_by)} {ui.ago(r.created_at)} · reason: {ui.literal(r.reason)}")
        st.dataframe(pd.DataFrame([{"step": s.position + 1, "percent": s.percent,
                                    "started": ui.ago(s.started_at) if s.started_at else "",
                                    "finished": ui.ago(s.finished_at) if s.finished_at else "",
                                    "outcome": s.outcome or ""} for s in r.steps]), hide_index=True)
        _guardrails(session, r)
        actions = [a for a in r.allowed_actions if a in _ACTION_WORDS]
        if not actions:
            return
        form = f"act_{r.id}"

        def pick() -> None:
            st.selectbox("Action", actions, key=ui.key(form, "action"),
                         format_func=lambda a: f"{a}: {_ACTION_WORDS[a]}", disabled=not session.can_operate)

        reason = ui.confirmed(form, what=f"change the rollout of {ui.literal(r.policy)}", button="Apply",
                              disabled=not session.can_operate, extra=pick)
        if reason is not None:
            action = st.session_state.get(ui.key(form, "action"), actions[0])
            # A promote names the step this page showed: if the rollout moved since (another operator, the
            # guardrails), the control plane refuses instead of skipping a step nobody looked at here.
            step = r.current_step if action == "promote" else None
            done = ui.call(lambda: session.write(calls.rollout_action(r.id, action, reason=reason,
                                                                      expected_step=step)))
            if done is not None:
                ui.flash(f"Rollout of {ui.literal(done.policy)}: {action} done; it is now {done.state} "
                         f"({done.current_percent:g}%).")
                st.rerun()


def _start(session: ui.Session, policies: list[Policy]) -> None:
    st.subheader("Start a rollout")
    names = [p.name for p in policies if p.active_revision_id]
    if not names:
        st.caption("No policy has an active revision to roll out from.")
        return
    name = st.selectbox("Policy", names, key=ui.key("start_policy"))
    policy = next(p for p in policies if p.name == name)
    candidates = [r for r in _revisions(session, name) if not r.active]
    if not candidates:
        st.caption(f"{ui.literal(name)} has no revision but its active one: save a draft on the Policies page "
                   "first.")
        return
    labels = {r.id: _label(r) for r in candidates}

    def fields() -> None:
        st.selectbox("Revision to roll out", list(labels), format_func=labels.__getitem__,
                     key=ui.key("start_revision"), disabled=not session.can_operate)
        c1, c2 = st.columns(2)
        c1.radio("Mode", ["traffic", "workers"], key=ui.key("start_mode"), horizontal=True,
                 help="traffic: each worker splits requests by a sticky hash; workers: a share of the workers "
                      "runs the new revision", disabled=not session.can_operate)
        c2.text_input("Steps (percent, comma separated, last 100)", value="10,50,100", key=ui.key("start_steps"),
                      disabled=not session.can_operate)
        c3, c4 = st.columns(2)
        c3.text_input("Target pool (empty: all the policy's workers)", value=policy.pool or "",
                      key=ui.key("start_pool", name), disabled=not session.can_operate)
        c4.text_input("Target labels (k=v, ...)", key=ui.key("start_labels"), disabled=not session.can_operate)

    reason = ui.confirmed("start", what=f"start moving {ui.literal(name)} to the chosen revision",
                          button="Start rollout",
                          disabled=not session.can_operate, extra=fields)
    if reason is None:
        return
    steps = _steps(st.session_state.get(ui.key("start_steps"), ""))
    if not steps:
        st.warning("Steps must be numbers separated by commas, e.g. 10,50,100.")
        return
    labels_text = st.session_state.get(ui.key("start_labels"), "")
    target_labels = {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in labels_text.split(",") if p)
                     if k.strip()}
    started = ui.call(lambda: session.write(calls.start_rollout(
        policy=name, revision=st.session_state[ui.key("start_revision")],
        mode=st.session_state.get(ui.key("start_mode"), "traffic"), steps=steps, reason=reason,
        pool=st.session_state.get(ui.key("start_pool", name)) or None, labels=target_labels)))
    if started is not None:
        ui.flash(f"Rollout of {ui.literal(name)} to {ui.literal(ui.short(started.to_revision))} started at "
                 f"{started.current_percent:g}%.")
        st.rerun()


def _rollback(session: ui.Session, policies: list[Policy]) -> None:
    st.subheader("Roll back")
    names = [p.name for p in policies if p.active_revision_id]
    if not names:
        return
    name = st.selectbox("Policy", names, key=ui.key("rollback_policy"))
    candidates = [r for r in _revisions(session, name) if not r.active]
    if not candidates:
        st.caption(f"{ui.literal(name)} has no other revision to go back to.")
        return
    labels = {r.id: _label(r) for r in candidates}

    def fields() -> None:
        st.selectbox("Make this revision active now", list(labels), format_func=labels.__getitem__,
                     key=ui.key("rollback_revision"), disabled=not session.can_operate)

    reason = ui.confirmed("rollback", what=f"make the chosen revision of {ui.literal(name)} active at once "
                                            "(ends its rollout)",
                          button="Roll back", disabled=not session.can_operate, extra=fields)
    if reason is not None:
        done = ui.call(lambda: session.write(calls.rollback(name, st.session_state[ui.key("rollback_revision")],
                                                            reason=reason)))
        if done is not None:
            ended = f"; rollout {ui.literal(done.ended_rollout.id[:8])} ended" if done.ended_rollout else ""
            ui.flash(f"{ui.literal(done.policy)} rolled back to {ui.literal(ui.short(done.active_revision))}{ended}.")
            st.rerun()


def _history(session: ui.Session) -> None:
    st.subheader("All rollouts")
    cursors: list[str | None] = st.session_state.setdefault(ui.key("rollout_cursors"), [None])
    page = ui.call(lambda: session.read(calls.rollouts(cursor=cursors[-1], limit=session.settings.page_size)))
    if page is None:
        return
    if not page.items:
        st.caption("No rollouts yet.")
        return
    st.dataframe(pd.DataFrame([{
        "policy": r.policy, "state": r.state, "from": ui.short(r.from_revision), "to": ui.short(r.to_revision),
        "mode": r.mode, "percent": r.current_percent, "by": r.created_by,
        "started": r.created_at.strftime("%Y-%m-%d %H:%M UTC"), "reason": r.reason,
    } for r in page.items]), hide_index=True, width="stretch")
    c1, c2, _ = st.columns([1, 1, 4])
    if c1.button("Newer", disabled=len(cursors) == 1, key=ui.key("rollouts_newer")):
        cursors.pop()
        st.rerun()
    if c2.button("Older", disabled=page.next_cursor is None, key=ui.key("rollouts_older")):
        cursors.append(page.next_cursor)
        st.rerun()


def render() -> None:
    session = ui.require_session()
    st.title("Rollouts")
    ui.show_flash()
    ui.read_only_note(session, need=ui.OPERATE_SCOPES)
    policies = ui.call(lambda: session.read(calls.policies())) or []
    st.subheader("In progress")
    open_rollouts = open_rollouts_of(session)
    if not open_rollouts:
        st.caption("No rollout is running or paused.")
    for r in open_rollouts:
        _open_rollout(session, r)
    left, right = st.columns(2)
    with left:
        _start(session, policies)
    with right:
        _rollback(session, policies)
        _kill_switch(session)
    _history(session)
