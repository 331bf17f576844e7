"""Overview: the fleet, the policies and rollouts, the last hour in numbers, the kill switch.

A fixed number of reads, whatever the size of the fleet: no call per policy or per worker.
"""

from __future__ import annotations

import datetime as dt

import pandas as pd
import streamlit as st

from apiclient import ApiError, calls
from apiclient.models import Fleet, RollupReport, SupervisedEngine, Worker
from dashboard import charts, ui
from dashboard.views.common import open_rollouts_of, speedup_rows, switchback_table, switchback_verdict

_SHOWN = 200  # workers and gateways listed, in one read


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _state(w: Worker) -> str:
    if w.stale:
        return "stale"
    if w.converged:
        return "converged"
    return w.engines_lag() or "converging"


def _sidecars(items: list[Worker], name: str) -> pd.DataFrame:
    return pd.DataFrame([{
        name: w.id, "pool": w.pool, "state": _state(w),
        "running": ui.short(w.active_revision), "last heartbeat": ui.ago(w.last_heartbeat_at),
        "labels": ", ".join(f"{k}={v}" for k, v in w.labels.items()),
    } for w in items])


def _probe(seconds: float | None) -> str:
    return "-" if seconds is None else f"in {seconds:.0f} s"


def _replicas(items: list[Worker]) -> pd.DataFrame:
    # Engines, replica addresses and worker ids are what sidecars reported: shown in a table, as text.
    return pd.DataFrame([{
        "worker": w.id, "kind": w.kind, "engine": r.engine, "replica": r.replica, "state": r.state,
        "in flight": r.in_flight, "running": r.running, "waiting": r.waiting, "ejections": r.ejections,
        "returns": r.returns, "next probe": _probe(r.next_probe_in_s),
        "as of": "stale" if w.stale else ui.ago(w.replicas_reported_at),
    } for w in items for r in w.replicas])


def _supervised(items: list[Worker]) -> pd.DataFrame:
    # Errors are the engines' own words relayed by sidecars: shown in a table, as text.
    return pd.DataFrame([{
        "worker": w.id, "engine": e.engine, "state": e.state, "runs arguments of": ui.short(e.revision),
        "worker runs": ui.short(w.active_revision), "config": e.config_hash or "-", "restarts": e.restarts,
        "failed restarts": e.failed_restarts, "crashes": e.crashes, "tokenizer": _tokenizer(e),
        "last error": e.last_error or "", "as of": "stale" if w.stale else ui.ago(w.supervised_reported_at),
    } for w in items for e in w.supervised_engines])


def _tokenizer(engine: SupervisedEngine) -> str:
    check = engine.tokenizer
    if check is None:
        return "-"  # no draft model
    if check.aligned is None:
        return "not checked: " + "; ".join(check.differences)
    if check.aligned:
        return "aligned" + "".join(f"; note: {note}" for note in check.notes)
    return "misaligned: " + "; ".join(check.differences)


def _fleet(session: ui.Session, fleet: Fleet) -> None:
    """Workers (beside their engines) and gateways (in front of replica pools) apart, then every replica."""
    workers, gateways = fleet.overall, fleet.gateways
    cols = st.columns(4)
    cols[0].metric("Workers", workers.workers)
    cols[1].metric("Stale", workers.stale)
    cols[2].metric("Converged", f"{workers.converged_workers}/{workers.workers - workers.stale}")
    cols[3].metric("Generation", fleet.generation)
    if gateways.workers:
        cols = st.columns(4)
        cols[0].metric("Gateways", gateways.workers)
        cols[1].metric("Stale gateways", gateways.stale)
        cols[2].metric("Gateways converged", f"{gateways.converged_workers}/{gateways.workers - gateways.stale}")
    if fleet.replicas.reporters:
        cols = st.columns(4)
        cols[0].metric("Replicas", fleet.replicas.total)
        cols[1].metric("Healthy", fleet.replicas.healthy)
        cols[2].metric("Ejected", fleet.replicas.ejected)
    if workers.workers == 0 and gateways.workers == 0:
        st.caption("No worker has registered yet.")
        return
    st.dataframe(pd.DataFrame([{
        "pool": p.pool, "kind": kind, "sidecars": p.workers, "stale": p.stale, "converged": p.converged,
        "revisions running": ", ".join(f"{ui.short(r.revision)} x{r.workers}" for r in p.revisions),
    } for kind, pools in (("worker", fleet.pools), ("gateway", fleet.gateway_pools)) for p in pools]),
        hide_index=True, width="stretch")
    page = ui.call(lambda: session.read(calls.workers(limit=_SHOWN)))
    if page is None:
        return
    if page.next_cursor:
        st.caption(f"Showing the first {_SHOWN} workers and gateways.")
    listed_workers = [w for w in page.items if w.kind != "gateway"]
    listed_gateways = [w for w in page.items if w.kind == "gateway"]
    if listed_workers:
        st.dataframe(_sidecars(listed_workers, "worker"), hide_index=True, width="stretch")
    if listed_gateways:
        st.caption("Gateways: sidecars in front of pools of engine replicas on other hosts")
        st.dataframe(_sidecars(listed_gateways, "gateway"), hide_index=True, width="stretch")
    replicas = _replicas(page.items)
    if not replicas.empty:
        st.caption("Replicas, as each worker and gateway last reported them (ejected: no requests until a probe "
                   "brings it back)")
        st.dataframe(replicas, hide_index=True, width="stretch")
    supervised = _supervised(page.items)
    if not supervised.empty:
        st.caption("Engines the sidecars start and restart themselves (--supervise): the revision whose arguments "
                   "each runs; a restart that failed leaves an engine on the previous arguments")
        st.dataframe(supervised, hide_index=True, width="stretch")


def _busiest_policy(report: RollupReport) -> str | None:
    requests: dict[str, float] = {}
    for group in report.groups:
        name = group.key.policy
        if name:
            requests[name] = requests.get(name, 0) + group.count("requests")
    return max(requests, key=requests.__getitem__) if requests else None


def _does_it_pay(session: ui.Session, policy: str, since: dt.datetime) -> None:
    """What clients felt under the busiest policy, speculating and not: whole-worker windows first."""
    st.subheader("Does speculation pay here?")
    st.caption(f"Policy {ui.literal(policy)} (most requests in the past sixty minutes), on what clients feel: "
               "end-to-end "
               "latency, time to first token, completed requests per second.")
    try:
        worker = session.read(calls.switchback(policy, since=since))
    except ApiError as exc:
        ui.show_problem(exc.problem)
        return
    if worker.available and worker.comparison is not None:
        sentence, tone = switchback_verdict(worker.comparison)
        {"error": st.error, "success": st.success}.get(tone, st.info)(sentence)
        st.dataframe(pd.DataFrame(switchback_table(worker.comparison)), hide_index=True, width="stretch")
        st.caption("Whole-worker switchback: in the explored time windows every request got the other decision, so "
                   "the cost one engine's work puts on the others is inside the numbers. Policy advantage above 1: "
                   "the policy's own windows were better for clients.")
    else:
        st.info(f"{ui.literal(worker.reason or '')}. Per request the cohorts share the engines at the same moment, "
                "so the table below cannot show what speculating costs the other engines.")
    report = ui.call(lambda: session.read(calls.speedups(policy, since=since)))
    if report is not None and report.rows:
        st.dataframe(pd.DataFrame(speedup_rows(report.rows)), hide_index=True, width="stretch")


def render() -> None:
    session = ui.require_session()
    st.title("Overview")
    ui.show_flash()

    switch = ui.call(lambda: session.read(calls.kill_switch()))
    if switch is not None:
        if switch.enabled:
            st.error(f"**Kill switch is ON**: every request goes to the plain engine. Reason: "
                     f"{ui.literal(switch.reason or '-')} ({ui.literal(switch.changed_by or '?')}, "
                     f"{ui.ago(switch.changed_at)})")
        else:
            st.success("Kill switch is off: policies decide.")

    fleet = ui.call(lambda: session.read(calls.fleet()))
    policies = ui.call(lambda: session.read(calls.policies())) or []
    st.subheader("Last hour")
    # On the minute, so that the read is the same (and cached) for a minute.
    since = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0) - dt.timedelta(hours=1)
    report = ui.call(lambda: session.read(calls.rollups(group_by=["policy", "engine"], since=since)))
    if report is not None:
        # An engine's kind from its requests' decisions, not from the policy documents: reading those would
        # take a call per policy (the API has no call that lists active documents).
        kinds: charts.EngineKinds = {}
        numbers = charts.headline(report, kinds)
        cols = st.columns(5)
        cols[0].metric("Requests", f"{numbers['requests']:,}")
        cols[1].metric("Speculated", _pct(numbers["speculated_share"]))
        cols[2].metric("Acceptance", _pct(numbers["acceptance"]))
        cols[3].metric("Retry rate", _pct(numbers["retry_rate"]))
        cols[4].metric("Fallback rate", _pct(numbers["fallback_rate"]))
        latency = charts.latency_by_kind(report, kinds)
        if latency.empty:
            st.caption("No telemetry in the last hour.")
        else:
            st.caption("Inter-token latency per engine, speculative vs plain (quantiles from the rollup histograms)")
            st.dataframe(latency, hide_index=True, width="stretch")
        busiest = _busiest_policy(report)
        if busiest is not None:
            _does_it_pay(session, busiest, since)

    st.subheader("Fleet")
    if fleet is not None:
        _fleet(session, fleet)

    st.subheader("Policies")
    if policies:
        st.dataframe(pd.DataFrame([{
            "policy": p.name, "pool": p.pool or "(any)", "active": ui.short(p.active_revision_id),
            "head": ui.short(p.head_revision_id), "revisions": p.revision_count,
            "draft pending": bool(p.head_revision_id and p.head_revision_id != p.active_revision_id),
        } for p in policies]), hide_index=True, width="stretch")
    else:
        st.caption("No policies yet.")

    st.subheader("Rollouts in progress")
    open_rollouts = open_rollouts_of(session)
    if open_rollouts:
        st.dataframe(pd.DataFrame([{
            "policy": r.policy, "state": r.state, "to": ui.short(r.to_revision), "mode": r.mode,
            "step": f"{r.current_step + 1}/{len(r.steps)} ({r.current_percent:g}%)", "by": r.created_by,
            "started": ui.ago(r.created_at), "reason": r.reason,
        } for r in open_rollouts]), hide_index=True, width="stretch")
    else:
        st.caption("No rollout is running or paused.")
