"""Telemetry: where speculation pays, from the control plane's per-minute rollups (never raw events)."""

from __future__ import annotations

import datetime as dt

import pandas as pd
import streamlit as st

from apiclient import calls
from apiclient.models import Policy, RollupReport
from dashboard import charts, ui
from dashboard.views.common import active_documents

WINDOWS = {"last 15 minutes": dt.timedelta(minutes=15), "last hour": dt.timedelta(hours=1),
           "last 6 hours": dt.timedelta(hours=6), "last 24 hours": dt.timedelta(days=1),
           "last 3 days": dt.timedelta(days=3)}
ALL = "(all)"
SHADOW_OFF = ("No shadow comparisons in this window. To check that speculation does not change the answers, set "
              "`quality.shadow_rate` in the policy (a share of the greedy requests a speculative engine serves, "
              "at most 0.05, e.g. `quality: {shadow_rate: 0.01}`): the sidecar sends them again to the plain "
              "engine and reports whether the answers match. `guardrails.min_shadow_match_rate` then rolls back "
              "a canary whose answers differ too often.")


def _values(report: RollupReport | None, field: str) -> list[str]:
    if report is None:
        return []
    return sorted({str(getattr(g.key, field)) for g in report.groups if getattr(g.key, field) is not None})


def _rollups(session: ui.Session, group_by: list[str], filters: dict[str, str | None], since: dt.datetime,
             until: dt.datetime, limit: int) -> RollupReport | None:
    report = ui.call(lambda: session.read(calls.rollups(group_by=group_by, since=since, until=until, limit=limit,
                                                        **filters)))
    if report is not None and report.truncated:
        st.warning(f"More than {limit} groups matched: the chart shows part of the window. Narrow the filters "
                   "or the window.")
    return report


def _thresholds(df: pd.DataFrame, documents: dict[str, dict[str, object]]) -> dict[str, int | None]:
    """Per route, the threshold of the policy that served most of its requests."""
    out: dict[str, int | None] = {}
    if df.empty:
        return out
    busiest = df.groupby(["route", "policy"], as_index=False)["requests"].sum()
    for route, rows in busiest.groupby("route"):
        policy = rows.sort_values("requests", ascending=False)["policy"].iloc[0]
        document = documents.get(str(policy))
        out[str(route)] = charts.speculation_threshold(document, str(route)) if document else None
    return out


def render() -> None:
    session = ui.require_session()
    st.title("Telemetry")
    policies: list[Policy] = ui.call(lambda: session.read(calls.policies())) or []
    until = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0) + dt.timedelta(minutes=1)

    c1, c2, c3, c4, c5 = st.columns(5)
    window = c1.selectbox("Window", list(WINDOWS), index=1, key=ui.key("tm_window"))
    since = until - WINDOWS[window]
    pools = sorted({p.pool or "(any)" for p in policies})
    pool = c2.selectbox("Pool", [ALL, *pools], key=ui.key("tm_pool"),
                        help="a pool is served by one policy: this filters by that policy")
    policy_names = [p.name for p in policies if pool in (ALL, p.pool or "(any)")]
    policy = c3.selectbox("Policy", [ALL, *policy_names] if pool == ALL else policy_names,
                          key=ui.key("tm_policy"))
    base_filters: dict[str, str | None] = {"policy": None if policy == ALL else policy}
    options = _rollups(session, ["route", "revision"], base_filters, since, until,
                       session.settings.telemetry_limit)
    route = c4.selectbox("Route", [ALL, *_values(options, "route")], key=ui.key("tm_route"))
    revision = c5.selectbox("Revision", [ALL, *_values(options, "revision")], key=ui.key("tm_revision"),
                            format_func=lambda r: r if r == ALL else r[:12])
    filters = {**base_filters, "route": None if route == ALL else route,
               "revision": None if revision == ALL else revision}
    limit = session.settings.telemetry_limit

    if options is not None and not options.groups:
        st.info("No telemetry in this window: sidecars send it as requests are served.")
        return
    documents = active_documents(session, [p for p in policies if filters["policy"] in (None, p.name)])
    kinds = charts.engine_kinds(documents)

    by_route = _rollups(session, ["minute", "route"], filters, since, until, limit)
    if by_route is not None:
        df = charts.frame(by_route, kinds)
        if df.empty or df["acceptance"].isna().all():
            st.caption("No speculative tokens were drafted in this window: no acceptance to show.")
        else:
            st.altair_chart(charts.acceptance_over_time(df), width="stretch")

    by_batch = _rollups(session, ["route", "batch_bucket", "policy", "engine"], filters, since, until, limit)
    if by_batch is not None:
        batch_df = charts.frame(by_batch, kinds)
        merged = charts.itl_by_batch(batch_df)
        if merged.empty:
            st.caption("No inter-token latency reported in this window.")
        else:
            st.altair_chart(charts.itl_vs_batch(merged, _thresholds(batch_df, documents)))
            st.caption("Speculative and plain at the same batch size come from the exploration holdout and from "
                       "rollouts; where the red line rises above the blue one, speculation costs latency.")

    by_minute = _rollups(session, ["minute"], filters, since, until, limit)
    if by_minute is not None and by_minute.groups:
        minute_df = charts.frame(by_minute, kinds)
        rollouts = ui.call(lambda: session.read(calls.rollouts(policy=filters["policy"], limit=100)))
        rollbacks = ui.call(lambda: session.read(calls.audit(action="policy.rollback", limit=100)))
        marks = charts.markers(rollouts.items if rollouts else [],
                               [(e.at, f"{e.target_id}: rolled back ({e.reason})") for e in rollbacks.items
                                if filters["policy"] in (None, e.target_id)] if rollbacks else [],
                               since, until)
        st.altair_chart(charts.latency_over_time(minute_df, marks), width="stretch")
        left, right = st.columns(2)
        left.altair_chart(charts.reliability_over_time(minute_df), width="stretch")
        if minute_df["structured_validity"].notna().any():
            right.altair_chart(charts.structured_validity_over_time(minute_df), width="stretch")
        else:
            right.caption("No structured output was checked in this window.")
        totals = charts.headline(by_minute, kinds)
        st.caption(f"{totals['requests']:,} requests in the window; figures from per-minute rollups.")

    _shadow_comparisons(session, filters, since, until, limit)


def _shadow_comparisons(session: ui.Session, filters: dict[str, str | None], since: dt.datetime,
                        until: dt.datetime, limit: int) -> None:
    """Whether speculation changed the answers: the plain engine's answer to a sample of the same requests."""
    st.subheader("Shadow comparisons")
    report = ui.call(lambda: session.read(calls.summary(
        group_by="route,engine", policy=filters["policy"], route=filters["route"], revision=filters["revision"],
        since=since, until=until, limit=limit)))
    if report is None:
        return
    if report.truncated:
        st.warning(f"More than {limit} route and engine pairs matched: the table shows part of them. Narrow the "
                   "filters.")
    table = charts.shadow_table(report)
    if table.empty:
        st.info(SHADOW_OFF)
        return
    st.dataframe(table, hide_index=True, width="stretch")
    st.caption("A sample of the greedy requests a speculative engine served was sent again to the plain engine, "
               "off the client's path, and the two answers compared: the match rate with its 95 % interval, how "
               "many output tokens they shared before the first difference, the validity of structured output "
               "served and plain on the same requests, and the worker's own quality check. Speculative decoding "
               "is lossless in theory; floating-point and batch effects can still change exact outputs.")
