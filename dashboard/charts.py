"""Telemetry rollups -> tables -> Altair charts. Pure functions: no Streamlit, no network."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

import altair as alt
import pandas as pd

from apiclient.models import Rollout, RollupGroup, RollupReport, SummaryReport

SPECULATIVE, PLAIN = "speculative", "plain"
# Engine kinds keyed by (policy, engine); a rollup row whose pair is not known is judged by its decisions.
EngineKinds = Mapping[tuple[str, str], str]


def engine_kinds(documents: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str], str]:
    """``{(policy, engine): "speculative" | "plain"}`` from policy documents (canonical form)."""
    kinds: dict[tuple[str, str], str] = {}
    for policy, document in documents.items():
        for name, engine in (document.get("engines") or {}).items():
            method = engine.get("method") if isinstance(engine, Mapping) else None
            kinds[(policy, name)] = PLAIN if method in (None, "none") else SPECULATIVE
    return kinds


def kind_of(group: RollupGroup, kinds: EngineKinds) -> str:
    known = kinds.get((group.key.policy or "", group.key.engine or ""))
    if known is not None:
        return known
    requests = group.count("requests")
    return SPECULATIVE if requests and group.count("speculated") / requests > 0.5 else PLAIN


def speculation_threshold(document: Mapping[str, Any], route: str) -> int | None:
    """The largest batch size at which some rule sends ``route`` to a speculative engine (None: no bound)."""
    engines = document.get("engines") or {}
    best: int | None = None
    for rule in document.get("rules") or []:
        when, then = rule.get("when") or {}, rule.get("then") or {}
        routes = when.get("route")
        if routes is not None and route not in routes:
            continue
        engine = engines.get(then.get("engine"), {})
        if engine.get("method", "none") == "none":
            continue
        upper = (when.get("batch_size") or {}).get("max")
        if upper is None:
            continue
        best = upper if best is None else max(best, upper)
    return best


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def frame(report: RollupReport, kinds: EngineKinds | None = None) -> pd.DataFrame:
    """One row per rollup group: its key, the counters the charts need and the derived rates."""
    rows = []
    for g in report.groups:
        k = g.key
        requests = g.count("requests")
        rows.append({
            "minute": k.minute, "policy": k.policy, "revision": (k.revision or "")[:12] or None, "route": k.route,
            "engine": k.engine, "batch_bucket": k.batch_bucket, "batch_range": k.batch_range,
            "explored": k.explored,
            "kind": kind_of(g, kinds or {}),
            "requests": requests, "speculated": g.count("speculated"),
            "draft_tokens": g.count("draft_tokens_sum"), "accepted_tokens": g.count("accepted_tokens_sum"),
            "acceptance": g.acceptance_rate,
            "itl_sum": g.count("itl_ms_sum"), "itl_count": g.count("itl_count"),
            "itl_mean_ms": g.itl_ms_mean, "itl_p50_ms": g.itl_ms.p50, "itl_p95_ms": g.itl_ms.p95,
            "e2e_p50_ms": g.e2e_ms.p50, "e2e_p95_ms": g.e2e_ms.p95,
            "retry_rate": _ratio(g.count("retries"), requests),
            "fallback_rate": _ratio(g.count("fallbacks"), requests),
            "error_rate": g.error_rate,
            "structured_validity": _ratio(g.count("structured_valid"), g.count("structured_checked")),
        })
    df = pd.DataFrame(rows)
    if not df.empty and df["minute"].notna().any():
        df["minute"] = pd.to_datetime(df["minute"], utc=True)
    return df


def headline(report: RollupReport, kinds: EngineKinds) -> dict[str, Any]:
    """The overview's numbers from rollups grouped by (policy, engine)."""
    total = sum(g.count("requests") for g in report.groups)
    speculated = sum(g.count("speculated") for g in report.groups)
    drafted = sum(g.count("draft_tokens_sum") for g in report.groups)
    accepted = sum(g.count("accepted_tokens_sum") for g in report.groups)
    retries = sum(g.count("retries") for g in report.groups)
    fallbacks = sum(g.count("fallbacks") for g in report.groups)
    return {
        "requests": int(total),
        "speculated_share": _ratio(speculated, total),
        "acceptance": _ratio(accepted, drafted),
        "retry_rate": _ratio(retries, total),
        "fallback_rate": _ratio(fallbacks, total),
    }


def itl_by_batch(df: pd.DataFrame) -> pd.DataFrame:
    """Mean ITL per (route, batch bucket, engine kind), merged over policies and engines by their sums."""
    if df.empty:
        return df
    merged = df.groupby(["route", "batch_bucket", "batch_range", "kind"], as_index=False)[
        ["itl_sum", "itl_count", "requests"]].sum()
    merged = merged[merged["itl_count"] > 0]
    merged["itl_mean_ms"] = merged["itl_sum"] / merged["itl_count"]
    return merged


def latency_by_kind(report: RollupReport, kinds: EngineKinds) -> pd.DataFrame:
    """p50/p95 inter-token latency per engine, with its kind, busiest first (quantiles do not add up)."""
    rows = [{"engine": g.key.engine, "policy": g.key.policy, "kind": kind_of(g, kinds),
             "requests": int(g.count("requests")), "ITL p50 (ms)": g.itl_ms.p50, "ITL p95 (ms)": g.itl_ms.p95}
            for g in report.groups]
    df = pd.DataFrame(rows)
    return df.sort_values("requests", ascending=False) if not df.empty else df


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


SHADOW_COLUMNS = ("route", "engine", "compared", "match rate", "95% interval", "first diff (tokens)",
                  "structured compared", "structured valid: served", "structured valid: plain",
                  "check failures")


def shadow_table(report: SummaryReport) -> pd.DataFrame:
    """The shadow comparisons of a summary grouped by route and engine: one row per pair that has any,
    lowest match rate first (where the answers differ most is what to look at)."""
    rows = []
    for row in report.rows:
        shadow = row.shadow
        if shadow is None:
            continue
        low, high = shadow.match_interval
        rows.append({
            "route": row.key.get("route"), "engine": row.key.get("engine"), "compared": shadow.compared,
            "match rate": _percent(shadow.match_rate), "95% interval": f"{low:.1%} - {high:.1%}",
            "first diff (tokens)": None if shadow.first_diff_mean is None else round(shadow.first_diff_mean, 1),
            "structured compared": shadow.structured_checked,
            "structured valid: served": _percent(shadow.structured_valid_served),
            "structured valid: plain": _percent(shadow.structured_valid_plain),
            "check failures": f"{shadow.check_failed} of {shadow.check_run}" if shadow.check_run else "-",
            "_rate": shadow.match_rate,
        })
    if not rows:
        return pd.DataFrame(columns=list(SHADOW_COLUMNS))
    df = pd.DataFrame(rows).sort_values(["_rate", "route", "engine"], kind="stable")
    return df.drop(columns="_rate").reset_index(drop=True)


# --- charts --------------------------------------------------------------------------------

_TIME = alt.X("minute:T", title="time (UTC)")


def acceptance_over_time(df: pd.DataFrame) -> alt.Chart:
    data = df.dropna(subset=["acceptance"])
    chart: alt.Chart = alt.Chart(data, title="Acceptance rate by route").mark_line(point=True).encode(
        _TIME, alt.Y("acceptance:Q", title="accepted / drafted tokens", scale=alt.Scale(domain=[0, 1])),
        alt.Color("route:N", title="route"),
        tooltip=["minute:T", "route:N", alt.Tooltip("acceptance:Q", format=".2f"), "draft_tokens:Q"],
    )
    return chart


def itl_vs_batch(df: pd.DataFrame, thresholds: Mapping[str, int | None]) -> alt.HConcatChart:
    """Mean ITL per batch-size bucket, speculative vs plain, one panel per route, threshold as a dashed rule."""
    data = df.dropna(subset=["itl_mean_ms"])
    panels = []
    for route in sorted(set(data["route"].dropna())):
        rows = data[data["route"] == route]
        lines = alt.Chart(rows).mark_line(point=True).encode(
            alt.X("batch_bucket:Q", title="batch size (bucket lower bound)", scale=alt.Scale(type="log", base=2)),
            alt.Y("itl_mean_ms:Q", title="mean inter-token latency (ms)"),
            alt.Color("kind:N", title="engine", scale=alt.Scale(domain=[SPECULATIVE, PLAIN],
                                                                 range=["#e45756", "#4c78a8"])),
            tooltip=["route:N", "kind:N", "batch_range:N", alt.Tooltip("itl_mean_ms:Q", format=".1f"),
                     "requests:Q"],
        )
        layers: list[alt.Chart] = [lines]
        threshold = thresholds.get(route)
        if threshold is not None:
            mark = pd.DataFrame([{"threshold": threshold, "label": f"speculates up to batch {threshold}"}])
            layers.append(alt.Chart(mark).mark_rule(strokeDash=[6, 4], color="#333").encode(
                alt.X("threshold:Q"), tooltip=["label:N"]))
            layers.append(alt.Chart(mark).mark_text(align="left", dx=4, baseline="top", fontSize=10).encode(
                alt.X("threshold:Q"), y=alt.value(4), text="label:N"))
        panels.append(alt.layer(*layers).properties(title=f"route {route}", width=215, height=220))
    chart: alt.HConcatChart = alt.hconcat(*panels).properties(
        title="Inter-token latency vs batch size (dashed: the current speculation threshold)")
    return chart


def markers(rollouts: Iterable[Rollout], rollbacks: Iterable[tuple[dt.datetime, str]],
            since: dt.datetime, until: dt.datetime) -> pd.DataFrame:
    """Rollout steps and rollbacks inside the window, as (time, label, kind) rows."""
    rows: list[dict[str, Any]] = []
    for r in rollouts:
        for step in r.steps:
            if step.started_at is not None:
                rows.append({"time": step.started_at, "label": f"{r.policy}: {step.percent:g}% of "
                             f"{r.to_revision[:8]}", "kind": "rollout"})
        if r.state in ("aborted", "rolled_back"):
            rows.append({"time": r.updated_at, "label": f"{r.policy}: rollout {r.state}", "kind": "rollback"})
    for when, label in rollbacks:
        rows.append({"time": when, "label": label, "kind": "rollback"})
    df = pd.DataFrame(rows, columns=["time", "label", "kind"])
    if df.empty:
        return df
    df["time"] = pd.to_datetime(df["time"], utc=True)
    lo, hi = pd.Timestamp(since).tz_convert("UTC"), pd.Timestamp(until).tz_convert("UTC")
    return df[(df["time"] >= lo) & (df["time"] <= hi)]


def _with_markers(chart: alt.Chart, marks: pd.DataFrame) -> alt.LayerChart | alt.Chart:
    if marks.empty:
        return chart
    rules = alt.Chart(marks).mark_rule(strokeDash=[4, 3]).encode(
        alt.X("time:T"), alt.Color("kind:N", title="event", scale=alt.Scale(
            domain=["rollout", "rollback"], range=["#54a24b", "#e45756"])), tooltip=["time:T", "label:N"])
    layered: alt.LayerChart = alt.layer(chart, rules).resolve_scale(color="independent")
    return layered


def latency_over_time(df: pd.DataFrame, marks: pd.DataFrame) -> alt.LayerChart | alt.Chart:
    data = df.melt(id_vars=["minute"], value_vars=["itl_p50_ms", "itl_p95_ms"], var_name="quantile",
                   value_name="ms").dropna(subset=["ms"])
    data["quantile"] = data["quantile"].map({"itl_p50_ms": "p50", "itl_p95_ms": "p95"})
    chart = alt.Chart(data, title="Inter-token latency p50 / p95 (markers: rollout steps, rollbacks)").mark_line(
        point=True).encode(_TIME, alt.Y("ms:Q", title="inter-token latency (ms)"),
                           alt.StrokeDash("quantile:N", title="quantile"),
                           tooltip=["minute:T", "quantile:N", alt.Tooltip("ms:Q", format=".1f")])
    return _with_markers(chart, marks)


def _rates_chart(df: pd.DataFrame, names: Mapping[str, str], title: str) -> alt.Chart:
    data = df.melt(id_vars=["minute"], value_vars=list(names), var_name="metric",
                   value_name="rate").dropna(subset=["rate"])
    data["metric"] = data["metric"].map(names)
    chart: alt.Chart = alt.Chart(data, title=title).mark_line(point=True).encode(
        _TIME, alt.Y("rate:Q", title="rate", axis=alt.Axis(format="%")), alt.Color("metric:N", title=None),
        tooltip=["minute:T", "metric:N", alt.Tooltip("rate:Q", format=".2%")])
    return chart


def reliability_over_time(df: pd.DataFrame) -> alt.Chart:
    return _rates_chart(df, {"retry_rate": "retries / request", "fallback_rate": "fallbacks",
                             "error_rate": "errors"}, "Retries, fallbacks and errors")


def structured_validity_over_time(df: pd.DataFrame) -> alt.Chart:
    return _rates_chart(df, {"structured_validity": "valid structured outputs"},
                        "Structured-output validity (of the outputs checked)")
