"""Recommendations: the analysis' suggested rule edits for a policy, each with its evidence, expected
effect and confidence; one click turns one into a draft revision; what-if scores a revision against the
recorded telemetry.

The analysis API is optional: a control plane without it answers 404 at its paths, and the page says so.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from apiclient import ApiError, calls
from apiclient.models import Autopilot, Basis, Recommendation
from dashboard import ui
from dashboard.views.common import MEASURE_LABELS, switchback_table, switchback_verdict

NOT_AVAILABLE = "Analysis not available: this control plane does not serve recommendations."
WINDOWS = {"last hour": dt.timedelta(hours=1), "last 6 hours": dt.timedelta(hours=6),
           "last 24 hours": dt.timedelta(days=1), "last 7 days": dt.timedelta(days=7)}


def _missing(exc: ApiError) -> bool:
    """A 404 of the route itself (not of a policy the analysis does not know)."""
    return exc.status in (404, 405) and exc.problem.detail in ("Not Found", "Method Not Allowed")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        if set(value) >= {"from", "to"}:
            return f"{_fmt(value['from'])} -> {_fmt(value['to'])}"
        return ", ".join(f"{k.replace('_', ' ')}: {_fmt(v)}" for k, v in value.items())
    return str(value)


def evidence_frame(evidence: dict[str, Any]) -> pd.DataFrame:
    """Median latency of speculative and plain per batch bucket, from the recommendation's evidence rows: the
    end-to-end latency (what clients feel) where the rows have it, else the inter-token latency."""
    rows = []
    for bucket in evidence.get("buckets") or []:
        if not isinstance(bucket, dict):
            continue
        e2e = bucket.get("e2e_ms_p50")
        metric, values = ("e2e", e2e) if isinstance(e2e, dict) and any(e2e.values()) else \
            ("itl", bucket.get("itl_ms_p50") or {})
        gone = bucket.get("client_disconnect_rate") or {}
        for kind in ("speculative", "plain"):
            if isinstance(values, dict) and values.get(kind) is not None:
                rows.append({"batch_bucket": bucket.get("batch_bucket"), "batch": bucket.get("batch_range"),
                             "engine": kind, "metric": metric, "ms_p50": values[kind],
                             "verdict": bucket.get("verdict", ""), "n": bucket.get(f"n_{kind}"),
                             "client_disconnects": gone.get(kind) if isinstance(gone, dict) else None})
    return pd.DataFrame(rows)


def _evidence_chart(evidence: dict[str, Any]) -> alt.Chart | None:
    df = evidence_frame(evidence)
    if df.empty:
        return None
    title = "end-to-end p50 (ms)" if (df["metric"] == "e2e").all() else "ITL p50 (ms)"
    chart: alt.Chart = alt.Chart(df).mark_line(point=True).encode(
        alt.X("batch_bucket:Q", title="batch size (bucket lower bound)", scale=alt.Scale(type="log", base=2)),
        alt.Y("ms_p50:Q", title=title),
        alt.Color("engine:N", scale=alt.Scale(domain=["speculative", "plain"], range=["#e45756", "#4c78a8"])),
        tooltip=["batch:N", "engine:N", "metric:N", alt.Tooltip("ms_p50:Q", format=".1f"), "n:Q",
                 alt.Tooltip("client_disconnects:Q", format=".1%"), "verdict:N"])
    return chart.properties(height=200)


def _card(session: ui.Session, rec: Recommendation, policy: str, head: str | None, params: dict[str, Any]) -> None:
    with st.container(border=True):
        # Titles and messages quote the route, which a client named: shown as text, never as Markdown.
        st.markdown(f"**{ui.literal(rec.title)}** · route {ui.literal(rec.route)} · "
                    f"{ui.literal(rec.kind.replace('_', ' '))}"
                    + (f" · driven by {ui.literal(MEASURE_LABELS.get(rec.measure, rec.measure))}" if rec.measure
                       else ""))
        if rec.message:
            st.text(rec.message)
        c1, c2 = st.columns([3, 1])
        c1.markdown("**Expected effect**")
        c1.text(_fmt({k: v for k, v in rec.expected_effect.items() if k != "text"})
                + (f"\n{rec.expected_effect['text']}" if rec.expected_effect.get("text") else ""))
        c2.metric("Confidence", rec.confidence or "-")
        chart = _evidence_chart(rec.evidence)
        if chart is not None:
            st.altair_chart(chart, width="stretch")
        with st.expander("Evidence (numbers)"):
            st.code(json.dumps(rec.evidence, indent=2, default=str), language="json")
        for problem in rec.problems:
            st.caption(f"{ui.literal(problem.get('path', ''))}: {ui.literal(problem.get('message', problem))}")
        if not rec.applicable:
            st.caption("A flag to look at: there is no edit to apply.")
            return
        if st.button("Create draft revision", key=ui.key("apply", rec.id), disabled=not session.can_edit):
            # The draft builds on the head this listing was made with: a revision saved since is refused
            # (412, shown with the current head) rather than left out of the new head.
            applied = ui.call(lambda: session.write(calls.apply_recommendation(rec.id, policy, head=head,
                                                                               **params)))
            if applied is not None:
                ui.flash(f"Draft revision #{applied.seq} {ui.literal(ui.short(applied.revision))} of "
                         f"{ui.literal(policy)} created: review it on the Policies page, roll it out from Rollouts.")
                st.rerun()


def _what_if(session: ui.Session, policy: str, params: dict[str, Any]) -> None:
    st.subheader("What-if")
    st.caption("Score a revision (a draft, typically) on the recorded window: every recorded request is decided "
               "again, latency estimated from the measured per-bucket numbers.")
    page = ui.call(lambda: session.read(calls.revisions(policy, limit=100)))
    if page is None or not page.items:
        return
    labels = {r.id: f"#{r.seq} {ui.short(r.id)}{' (active)' if r.active else ''} {r.message}" for r in page.items}
    revision = st.selectbox("Revision", list(labels), format_func=labels.__getitem__,
                            key=ui.key("whatif_rev", policy))
    if st.button("Score it", key=ui.key("whatif_run")):
        try:
            report = session.check(calls.what_if(policy, revision=revision, since=params.get("since"),
                                                 until=params.get("until")))
        except ApiError as exc:
            if _missing(exc):
                st.info("What-if is not available on this control plane.")
            else:
                ui.show_problem(exc.problem)
            return
        st.session_state[ui.key("whatif_report")] = report.model_dump()
    shown = st.session_state.get(ui.key("whatif_report"))
    if shown and shown.get("policy") == policy:
        total = shown.get("all_routes") or {}
        itl = total.get("itl_ms_mean") or {}
        basis = Basis.model_validate(shown["basis"]) if shown.get("basis") else None
        estimated = basis is not None and basis.estimated
        c1, c2, c3 = st.columns(3)
        c1.metric("Decisions changed", f"{_count(total.get('decisions_changed', 0))} of "
                                       f"{_count(total.get('requests', 0))}" + (" (estimated)" if estimated else ""))
        c2.metric("Speculated share", _fmt(total.get("speculated_share_after")),
                  delta=None if total.get("speculated_share_before") is None or total.get("speculated_share_after")
                  is None else f"{total['speculated_share_after'] - total['speculated_share_before']:+.1%}")
        c3.metric("Mean ITL (ms)", _fmt(itl.get("after")),
                  delta=None if itl.get("change") is None else f"{itl['change']:+.1%}", delta_color="inverse")
        note = None if basis is None else basis.note(ui.literal("telemetry.raw_sample_rate"))
        if note is not None:
            st.info(note)
        routes = shown.get("routes") or []
        if routes:
            st.dataframe(pd.DataFrame([{
                "route": r.get("route"), "requests": r.get("requests"), "decisions changed": r.get("decisions_changed"),
                "speculated before": r.get("speculated_share_before"), "after": r.get("speculated_share_after"),
                "ITL change": (r.get("itl_ms_mean") or {}).get("change"),
                # Where samples are in the replay, per route: how many recorded requests its figures rest on.
                **({"recorded": (r.get("basis") or {}).get("events"),
                    "sampled": (r.get("basis") or {}).get("sampled_events")} if estimated else {}),
            } for r in routes]), hide_index=True, width="stretch")


def _count(value: Any) -> str:
    """A request count: an estimate from sampled events (a float) rounded to whole requests."""
    return f"{value:,.0f}" if isinstance(value, float) else f"{value:,}"


def _switchback(comparison: dict[str, Any] | None) -> None:
    st.subheader("The whole worker")
    if comparison is None:
        st.caption("The active revision explores request by request (or not at all): set exploration.window_s to "
                   "compare whole time windows, where what one engine's work costs the others is measured too.")
        return
    sentence, tone = switchback_verdict(comparison)
    {"error": st.error, "success": st.success}.get(tone, st.info)(sentence)
    st.dataframe(pd.DataFrame(switchback_table(comparison)), hide_index=True, width="stretch")


def _autopilot_form(session: ui.Session, policy: str, state: Autopilot) -> None:
    with st.form(ui.key("autopilot_form", policy)):
        c1, c2, c3 = st.columns(3)
        enabled = c1.toggle("Enabled", value=state.enabled, key=ui.key("ap_enabled", policy))
        confidence = c2.selectbox("Minimum confidence", ["low", "medium", "high"],
                                  index=["low", "medium", "high"].index(state.min_confidence),
                                  key=ui.key("ap_confidence", policy))
        steps = c3.text_input("Canary steps (%)", value=", ".join(f"{p:g}" for p in state.steps))
        c1, c2, c3 = st.columns(3)
        hold_s = c1.number_input("Hold per step (s)", min_value=10.0, max_value=604800.0, value=float(state.hold_s))
        min_samples = c2.number_input("Requests per cohort", min_value=1, max_value=10_000_000,
                                      value=int(state.min_samples))
        per_day = c3.number_input("Changes per day", min_value=0, max_value=100, value=int(state.max_changes_per_day))
        kinds = st.multiselect("Kinds it may apply", ["stop_speculating", "exclude_route", "route_instead",
                                                      "lower_threshold", "raise_threshold", "switch_method",
                                                      "change_k"],
                               default=state.kinds)
        if st.form_submit_button("Save autopilot", disabled=not session.can_edit):
            try:
                percents = [float(p) for p in steps.replace(",", " ").split()]
            except ValueError:
                st.error(f"steps: not a list of numbers: {ui.literal(steps)}")
                return
            saved = ui.call(lambda: session.write(calls.set_autopilot(policy, {
                "enabled": enabled, "min_confidence": confidence, "steps": percents, "hold_s": float(hold_s),
                "min_samples": int(min_samples), "max_changes_per_day": int(per_day), "kinds": kinds})))
            if saved is not None:
                ui.flash(f"Autopilot of {ui.literal(policy)} {'enabled' if saved.enabled else 'disabled'}.")
                st.rerun()


def _autopilot(session: ui.Session, policy: str) -> None:
    st.subheader("Autopilot")
    try:
        state = session.read(calls.autopilot(policy))
    except ApiError as exc:
        if _missing(exc):
            st.caption("This control plane has no autopilot.")
        else:
            ui.show_problem(exc.problem)
        return
    c1, c2, c3 = st.columns(3)
    c1.metric("Autopilot", "on" if state.enabled else "off")
    c2.metric("Status", state.status)
    c3.metric("Changes today", f"{state.changes_today} of {state.max_changes_per_day}")
    if state.status_detail:
        st.text(state.status_detail)
    st.caption("Applies the best recommendation at or above its confidence as a draft (author system:autopilot) "
               "and rolls it out as a traffic canary, holding each step and promoting it with no guardrail breach; "
               "never while the kill switch is on, a rollout is in flight or a person changed the policy within "
               "the hold. Disabling it mid-rollout pauses that rollout for a person.")
    _autopilot_form(session, policy, state)
    if state.history:
        st.dataframe(pd.DataFrame([{
            "at": e.at, "action": e.action, "rollout": e.rollout_id or "", "revision": ui.short(e.revision_id),
            "what": (e.detail.get("recommendation") or {}).get("title", "") if isinstance(e.detail, dict) else "",
        } for e in state.history]), hide_index=True, width="stretch")


def render() -> None:
    session = ui.require_session()
    st.title("Recommendations")
    ui.show_flash()
    policies = ui.call(lambda: session.read(calls.policies()))
    if policies is None:
        return
    names = [p.name for p in policies if p.active_revision_id]
    if not names:
        st.info("No policy has an active revision to analyse.")
        return
    c1, c2, c3 = st.columns(3)
    policy = c1.selectbox("Policy", names, key=ui.key("rec_policy"))
    window = c2.selectbox("Recorded window", list(WINDOWS), index=2, key=ui.key("rec_window"))
    min_samples = c3.number_input("Requests per cohort before a bucket counts", min_value=2, max_value=1_000_000,
                                  value=100, step=10, key=ui.key("rec_min_samples"))
    until = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
    params: dict[str, Any] = {"since": until - WINDOWS[window], "until": until, "min_samples": int(min_samples)}
    try:
        listing = session.read(calls.recommendations(policy, **params))
    except ApiError as exc:
        if _missing(exc):
            st.info(NOT_AVAILABLE)
        else:
            ui.show_problem(exc.problem)
        return
    ui.read_only_note(session, need=ui.EDIT_SCOPES)
    st.caption(f"For the active revision {ui.literal(ui.short(listing.revision))} of {ui.literal(policy)}.")
    if not listing.recommendations:
        st.success("No recommendations: the recorded telemetry suggests no rule change (or there is too little of "
                   "it: lower the cohort size to look anyway).")
    for rec in listing.recommendations:
        _card(session, rec, policy, listing.head, params)
    _switchback(listing.switchback)
    _autopilot(session, policy)
    _what_if(session, policy, {"since": params["since"], "until": params["until"]})
