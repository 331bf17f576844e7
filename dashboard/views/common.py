"""Reads several pages share."""

from __future__ import annotations

from functools import partial
from typing import Any

from apiclient import ApiError, calls
from apiclient.models import Policy, Rollout
from dashboard import ui


def active_documents(session: ui.Session, policies: list[Policy]) -> dict[str, dict[str, Any]]:
    """Each policy's active document (canonical), by policy name; policies without one are left out.

    One read per policy (the API has no call that lists active documents); revisions never change, so
    each is read once and then comes from the cache.
    """
    documents: dict[str, dict[str, Any]] = {}
    for policy in policies:
        if policy.active_revision_id:
            try:
                documents[policy.name] = session.revision(policy.active_revision_id).document
            except ApiError:
                continue
    return documents


def open_rollouts_of(session: ui.Session) -> list[Rollout]:
    """Running and paused rollouts (a refusal shows as a message and counts as none)."""
    found: list[Rollout] = []
    for state in ("running", "paused"):
        page = ui.call(partial(session.read, calls.rollouts(state=state, limit=100)))
        found.extend(page.items if page is not None else [])
    return found


# --- does speculation pay: what clients feel ----------------------------------------------------------

MEASURE_LABELS = {"e2e": "end-to-end latency", "e2e_p95": "end-to-end p95", "requests_per_s": "requests/s",
                  "ttft": "time to first token", "tokens_per_s": "output tokens/s per request",
                  "itl": "inter-token latency"}


def _interval(estimate: dict[str, Any] | None) -> str:
    if not estimate:
        return "-"
    return f"{estimate['ratio']:.2f} [{estimate['low']:.2f}, {estimate['high']:.2f}]"


def switchback_verdict(comparison: dict[str, Any]) -> tuple[str, str]:
    """A sentence on the whole worker's comparison, and its tone (success, error, info)."""
    verdict, driver = comparison.get("verdict"), comparison.get("driver")
    share = comparison.get("speculated_share") or {}
    policy_share, explored_share = share.get("policy") or 0.0, share.get("explored") or 0.0
    more = "the policy's windows" if policy_share >= explored_share else "the explored windows"
    label = MEASURE_LABELS.get(str(driver), str(driver))
    pairs = comparison.get("pairs", 0)
    if verdict == "explored better":
        loser = "speculating more" if policy_share > explored_share else "speculating less"
        return (f"Clients fared worse {loser} ({label}, {pairs} window pairs): on this hardware, the policy's "
                f"speculation {'costs more than it gives' if policy_share > explored_share else 'is too timid'}.",
                "error" if policy_share > explored_share else "info")
    if verdict == "policy better":
        return (f"Clients fared better in the policy's windows ({label}, {pairs} window pairs); {more} "
                f"speculated more ({policy_share:.0%} vs {explored_share:.0%}).", "success")
    if verdict == "mixed":
        return f"Mixed: better on one client measure, worse on {label} ({pairs} window pairs).", "info"
    if verdict == "no clear difference":
        return f"No clear difference for clients yet ({pairs} window pairs).", "info"
    return f"Not enough switchback windows yet ({pairs} pairs).", "info"


def switchback_table(comparison: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per client measure: both arms' values and the policy's advantage with its interval."""
    arms = comparison.get("arms") or {}
    policy, explored = arms.get("policy") or {}, arms.get("explored") or {}

    def value(arm: dict[str, Any], name: str) -> Any:
        if name == "e2e":
            return (arm.get("e2e_ms") or {}).get("p50")
        if name == "e2e_p95":
            return (arm.get("e2e_ms") or {}).get("p95")
        if name == "ttft":
            return (arm.get("ttft_ms") or {}).get("p50")
        return arm.get(name)

    return [{"measure": MEASURE_LABELS.get(name, name), "policy windows": value(policy, name),
             "explored windows": value(explored, name),
             "policy advantage [interval]": _interval(estimate)}
            for name, estimate in (comparison.get("estimates") or {}).items()]


def speedup_rows(rows: list[Any]) -> list[dict[str, Any]]:
    """Speculative vs plain per route and batch: the client-side ratio the verdict read, with its interval."""
    out = []
    for row in rows:
        est = row.e2e_speedup if row.measure == "e2e" else row.itl_speedup
        out.append({"route": row.route, "batch": row.batch_range, "requests spec/plain":
                    f"{row.n_speculative}/{row.n_plain}", "measure": MEASURE_LABELS.get(row.measure, row.measure),
                    "plain / speculative [interval]": "-" if est is None else
                    f"{est.ratio:.2f} [{est.low:.2f}, {est.high:.2f}]",
                    "verdict": row.verdict, "source": row.source})
    if any(row.k0 is not None for row in rows):
        # Only where an engine schedules in the engine: its requests that drafted nothing, against plain.
        for shown, row in zip(out, rows, strict=True):
            shown["K=0 requests"] = row.k0.requests if row.k0 is not None else 0
            tax = row.k0.tax if row.k0 is not None else None
            shown["K=0 / plain [interval]"] = "-" if tax is None else f"{tax.ratio:.2f} [{tax.low:.2f}, {tax.high:.2f}]"
    return out
