"""Analysis use cases: summaries, speedups, before/after, recommendations, what-if.

Services never commit: the caller owns the unit of work. Latency quantiles
and acceptance come from the telemetry rollups
(:func:`controlplane.telemetry.service.summarize`); the statistics and the
recommender are pure functions over :class:`~analysis.cells.Cell`.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from analysis import edits
from analysis.buckets import batch_bucket, batch_bucket_label
from analysis.cells import Cell, Cohort
from analysis.recommend import (
    Recommendation,
    RecommendConfig,
    cell_report,
    engine_facts,
    recommend,
)
from analysis.stats import wilson_interval
from analysis.switchback import Period, SwitchbackConfig, SwitchbackResult, compare, window_exposure
from controlplane.analysis.repository import AnalysisRepository
from controlplane.audit.service import record
from controlplane.errors import Conflict, NotFound, PreconditionFailed, ValidationFailed
from controlplane.models import Policy, Revision, Rollout
from controlplane.policy import service as policy_service
from controlplane.rollout.service import fleet_cohort_secret
from controlplane.telemetry.repository import RollupFilter
from controlplane.telemetry.service import RollupSummary, summarize
from policies import (
    Decision,
    PolicyDocument,
    PolicyValidationError,
    RequestShape,
    compile_policy,
    sticky_fraction,
    validate_data,
)
from policies.evaluate import exploration_salt

WINDOWS = {"minute": 60, "hour": 3600, "day": 86400}
SUMMARY_KEYS = ("policy", "revision", "route", "engine", "batch_bucket", "explored")
MAX_SHAPE_GROUPS = 200_000


def _field(path: str, code: str, message: str, where: str = "query") -> dict[str, str]:
    return {"path": path, "in": where, "code": code, "message": message}


def _invalid(*errors: dict[str, str]) -> ValidationFailed:
    n = len(errors)
    return ValidationFailed(f"{n} parameter{'s' if n != 1 else ''} did not validate", errors=list(errors))


def _policy(session: Session, name: str, path: str = "policy") -> Policy:
    policy = AnalysisRepository(session).policy(name)
    if policy is None:
        raise NotFound(f"policy {name!r} does not exist", errors=[_field(path, "not_found", "no such policy")])
    return policy


def _floor(when: dt.datetime, seconds: int) -> dt.datetime:
    epoch = int(when.timestamp())
    return dt.datetime.fromtimestamp(epoch - epoch % seconds, tz=dt.UTC)


# --- summaries ----------------------------------------------------------------------------------

def _cohort(summary: RollupSummary) -> Cohort:
    return Cohort.from_rollup(summary.counters, summary.histograms)


def describe(cohort: Cohort) -> dict[str, Any]:
    """The figures of one summary row."""
    def q(metric: str) -> dict[str, float | None]:
        return {"p50": cohort.quantile(metric, 0.5), "p95": cohort.quantile(metric, 0.95)}

    return {"requests": cohort.requests, "acceptance_rate": cohort.acceptance_rate,
            "mean_acceptance_length": cohort.mean_acceptance_length, "ttft_ms": q("ttft"), "itl_ms": q("itl"),
            "e2e_ms": q("e2e"), "retry_rate": cohort.retry_rate, "fallback_rate": cohort.fallback_rate,
            "error_rate": cohort.error_rate, "client_disconnects": cohort.client_disconnects,
            "client_disconnect_rate": cohort.client_disconnect_rate,
            "structured_validity_rate": cohort.structured_validity, "shadow": shadow_summary(cohort)}


def shadow_summary(cohort: Cohort) -> dict[str, Any] | None:
    """The shadow comparisons of a summary row; None when nothing was compared."""
    n = cohort.shadow_compared
    interval = wilson_interval(cohort.shadow_matched, n)
    if interval is None:
        return None
    checked = cohort.shadow_structured_checked
    return {"compared": n, "matched": cohort.shadow_matched, "match_rate": cohort.shadow_matched / n,
            "match_interval": list(interval), "first_diff_mean": cohort.shadow_first_diff_mean,
            "first_diff_count": cohort.shadow_first_diff_count, "structured_checked": checked,
            "structured_valid_served": cohort.shadow_structured_valid_served / checked if checked else None,
            "structured_valid_plain": cohort.shadow_structured_valid_plain / checked if checked else None,
            "check_run": cohort.shadow_check_run, "check_failed": cohort.shadow_check_failed}


def summaries(session: Session, flt: RollupFilter, group_by: Sequence[str], window: str | None,
              limit: int) -> tuple[list[dict[str, Any]], bool]:
    """Summary rows per ``group_by`` (rollup key fields) and, with ``window``, per time window."""
    keys = [*group_by, "minute"] if window is not None else list(group_by)
    rows, truncated = summarize(session, flt, keys, limit, WINDOWS[window] if window is not None else None)
    out = []
    for row in rows:
        key = {name: row.key[name] for name in group_by}
        if window is not None:
            key["window_start"] = row.key["minute"]
        if "batch_bucket" in key:
            key["batch_range"] = batch_bucket_label(key["batch_bucket"])
        out.append({"key": key, **describe(_cohort(row))})
    return out, truncated


def represented(value: float | None, sampled_events: int) -> int | float:
    """A weighted count of raw events: an int where every row stood for itself (as it always was), the
    estimate otherwise (a sample's weight is 1 / its rate, rarely a whole number)."""
    value = value or 0
    return round(float(value), 6) if sampled_events else int(value)


def basis(events: int, sampled_events: int, represented_requests: float) -> dict[str, Any]:
    """What a figure from the raw events rests on: the rows read, how many of them were samples, and the
    requests they stand for; ``estimated`` as soon as one sample is among them."""
    return {"events": events, "sampled_events": sampled_events,
            "represented_requests": represented(represented_requests, sampled_events),
            "estimated": sampled_events > 0}


def total_basis(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return basis(sum(p["events"] for p in parts), sum(p["sampled_events"] for p in parts),
                 sum(p["represented_requests"] for p in parts))


def worker_summaries(session: Session, *, policy: str | None, route: str | None, start: dt.datetime | None,
                     end: dt.datetime | None, limit: int, by_replica: bool = False,
                     engine: str | None = None) -> list[dict[str, Any]]:
    """Per-worker rows (key ``worker_id``), or with ``by_replica`` per engine and replica (key ``engine``,
    ``replica``), from the raw events, sampled ones counted with their weights; each row's ``basis``."""
    rows = AnalysisRepository(session).worker_totals(policy=policy, route=route, start=start, end=end, limit=limit,
                                                     by_replica=by_replica, engine=engine)
    out = []
    for r in rows:
        key = {"engine": r["engine"], "replica": r["replica"]} if by_replica else {"worker_id": r["worker_id"]}
        sampled = int(r["sampled_events"])

        def count(name: str, sampled: int = sampled, r: Mapping[str, Any] = r) -> int | float:
            return represented(r[name], sampled)

        def mean(name: str, r: Mapping[str, Any] = r) -> float | None:
            weight = r[f"{name}_weight"]
            return float(r[f"{name}_sum"]) / float(weight) if weight else None

        n = count("requests")
        drafted = count("draft_tokens")
        checked = count("structured_checked")
        gone = count("client_disconnects")
        out.append({"key": key, "requests": n,
                    "acceptance_rate": count("accepted_tokens") / drafted if drafted else None,
                    "retry_rate": count("retries") / n, "fallback_rate": count("fallbacks") / n,
                    "error_rate": count("errors") / n,
                    "client_disconnects": gone, "client_disconnect_rate": gone / n,
                    "structured_validity_rate": count("structured_valid") / checked if checked else None,
                    "itl_ms_mean": mean("itl_ms"), "ttft_ms_mean": mean("ttft_ms"), "e2e_ms_mean": mean("e2e_ms"),
                    "basis": basis(int(r["events"]), sampled, r["requests"])})
    return out


# --- cells: speculative vs plain per route and batch bucket -------------------------------------

@dataclass(slots=True)
class _Split:
    spec: Cohort
    spec_explored: Cohort
    plain: Cohort
    plain_explored: Cohort
    engines: dict[str, Cohort]
    engine_requests: dict[tuple[str, str, int], int]
    # requests an in-engine-scheduled engine ran at K=0 throughout (policy's and explored alike): the cohort
    # whose latency against the plain engine's is the K=0 tax
    k0: Cohort
    k0_engines: dict[str, int]

    @classmethod
    def empty(cls) -> _Split:
        return cls(Cohort(), Cohort(), Cohort(), Cohort(), defaultdict(Cohort), defaultdict(int), Cohort(),
                   defaultdict(int))


@dataclass(frozen=True, slots=True)
class _Facts:
    engines: dict[str, dict[str, tuple[str, int]]]  # revision -> {engine: (method, k)}
    in_engine: dict[str, frozenset[str]]  # revision -> engines with schedule: in_engine


def _facts(session: Session, policy: Policy, revisions: Sequence[str]) -> _Facts:
    docs = AnalysisRepository(session).documents(policy.id, revisions)
    engines: dict[str, dict[str, tuple[str, int]]] = {}
    in_engine: dict[str, frozenset[str]] = {}
    for rid, doc in docs.items():
        try:
            engines[rid] = engine_facts(doc)
            in_engine[rid] = validate_data(doc).in_engine_schedules
        except PolicyValidationError:  # pragma: no cover - stored revisions were validated
            engines[rid], in_engine[rid] = {}, frozenset()
    return _Facts(engines, in_engine)


def _classify(summary: RollupSummary, facts: Mapping[str, Mapping[str, tuple[str, int]]]) -> tuple[str, int] | None:
    """(method, k) of the engine a row ran on; None when it is not known to be speculative or plain."""
    known = facts.get(summary.key["revision"], {}).get(summary.key["engine"])
    if known is not None:
        return known
    c = summary.counters
    if c["draft_tokens_sum"] > 0:
        return ("unknown", 0)
    if c["speculated"] == 0:
        return ("none", 0)
    return None


def _splits(session: Session, policy: Policy, flt: RollupFilter) -> dict[tuple[str, int], _Split]:
    # TTFT is not compared: reading only the ITL and e2e histograms saves a third of the rows.
    rows, _ = summarize(session, flt, ["revision", "route", "batch_bucket", "engine", "explored", "k0"],
                        metrics=("itl", "e2e"))
    facts = _facts(session, policy, sorted({r.key["revision"] for r in rows}))
    splits: dict[tuple[str, int], _Split] = defaultdict(_Split.empty)
    for row in rows:
        kind = _classify(row, facts.engines)
        if kind is None:
            continue
        method, k = kind
        split = splits[(row.key["route"], row.key["batch_bucket"])]
        cohort = _cohort(row)
        if row.key["k0"] and row.key["engine"] in facts.in_engine.get(row.key["revision"], ()):
            # An in-engine schedule's K=0 band: neither speculation (decided not to draft) nor the plain
            # engine (the speculative engine's steps ran). Chosen by the decision, as the holdout's explored
            # plain requests are, never by what the engine drafted (that would gather the short answers).
            split.k0.add(cohort)
            split.k0_engines[row.key["engine"]] += cohort.requests
            continue
        if method == "none":
            (split.plain_explored if row.key["explored"] else split.plain).add(cohort)
        else:
            (split.spec_explored if row.key["explored"] else split.spec).add(cohort)
            split.engines[row.key["engine"]].add(_cohort(row))
            split.engine_requests[(row.key["engine"], method, k)] += cohort.requests
    return splits


def _cell(route: str, bucket: int, split: _Split, spec: Cohort, plain: Cohort, source: str) -> Cell:
    engine = method = None
    k = None
    if split.engine_requests:
        engine, method, k = max(split.engine_requests, key=lambda e: split.engine_requests[e])
    k0_engine = max(split.k0_engines, key=lambda e: split.k0_engines[e]) if split.k0_engines else None
    return Cell(route, bucket, spec, plain, source, engine, method, k or None, dict(split.engines),
                k0=split.k0, k0_engine=k0_engine)


def cells(session: Session, policy_name: str, *, start: dt.datetime | None, end: dt.datetime | None,
          route: str | None = None) -> list[Cell]:
    """Per route and bucket: the holdout comparison where the policy explores, else all against all.

    Holdout: where the policy mostly speculates, its speculative requests
    against the explored ones that ran plain (and the other way round where it
    mostly does not): the sticky hash chose who was explored, so the two
    cohorts differ only by the engine.
    """
    policy = _policy(session, policy_name)
    splits = _splits(session, policy, RollupFilter(policy=policy.name, route=route, start=start, end=end))
    out = []
    for (route_name, bucket), s in sorted(splits.items()):
        if s.spec.requests >= s.plain.requests and s.plain_explored.requests:
            out.append(_cell(route_name, bucket, s, s.spec, s.plain_explored, "holdout"))
        elif s.plain.requests > s.spec.requests and s.spec_explored.requests:
            out.append(_cell(route_name, bucket, s, s.spec_explored, s.plain, "holdout"))
        else:
            spec = Cohort().add(s.spec).add(s.spec_explored)
            plain = Cohort().add(s.plain).add(s.plain_explored)
            out.append(_cell(route_name, bucket, s, spec, plain, "observational"))
    return out


def rollout_cells(session: Session, rollout_id: str, *, now: dt.datetime) -> list[Cell]:
    """Per route and bucket, where a rollout's two revisions decide differently: one cohort against the other."""
    repo = AnalysisRepository(session)
    rollout = _rollout(session, rollout_id)
    policy = repo.policy_by_id(rollout.policy_id)
    assert policy is not None
    end = now if rollout.state in ("running", "paused") else rollout.updated_at
    start = rollout.created_at
    out = []
    by_revision = {}
    for rid in (rollout.from_revision_id, rollout.to_revision_id):
        flt = RollupFilter(policy=policy.name, revision=rid, explored=False, start=_floor(start, 60),
                           end=end + dt.timedelta(minutes=1))
        by_revision[rid] = _splits(session, policy, flt)
    before, after = by_revision[rollout.from_revision_id], by_revision[rollout.to_revision_id]
    for key in sorted(set(before) & set(after)):
        b, a = before[key], after[key]
        b_spec, a_spec = b.spec.requests > b.plain.requests, a.spec.requests > a.plain.requests
        if b_spec == a_spec:
            continue
        spec_side, plain_side = (b, a) if b_spec else (a, b)
        out.append(_cell(key[0], key[1], spec_side, spec_side.spec, plain_side.plain, "rollout"))
    return out


def speedups(cell_list: Sequence[Cell], cfg: RecommendConfig) -> list[dict[str, Any]]:
    return [cell_report(c, cfg) for c in cell_list]


# --- the whole worker: switchback windows ---------------------------------------------------------

def switchback(session: Session, policy_name: str, *, start: dt.datetime | None, end: dt.datetime | None,
               cfg: SwitchbackConfig | None = None) -> tuple[Revision, SwitchbackResult | None]:
    """The active revision and :func:`revision_switchback` of it."""
    policy = _policy(session, policy_name)
    revision = _active(session, policy)
    return revision, revision_switchback(session, policy, revision, start=start, end=end, cfg=cfg)


def revision_switchback(session: Session, policy: Policy, revision: Revision, *, start: dt.datetime | None,
                        end: dt.datetime | None, cfg: SwitchbackConfig | None = None) -> SwitchbackResult | None:
    """The revision's windows against its explored windows, on what clients felt.

    None when the active revision does not explore in time windows (``exploration.window_s`` and a rate):
    requests explored one by one share the engines with the policy's own at the same moment, so their
    comparison cannot show what one engine's work costs another. The first and the last minute with
    traffic are left out: a revision activated, or a read made, within a minute has only part of it.
    """
    doc = validate_data(revision.document)
    window_s, rate = doc.exploration.window_s, doc.exploration.rate
    if window_s is None or rate <= 0:
        return None
    salt = exploration_salt(doc.name, fleet_cohort_secret(session))
    rows, _ = summarize(session, RollupFilter(policy=policy.name, revision=revision.id, start=start, end=end),
                        ["minute", "explored"], metrics=("e2e", "ttft", "itl"))
    minutes = sorted({r.key["minute"] for r in rows})
    # (policy seconds, explored seconds) of each inner minute, as the sidecars split its windows
    exposure = {minute: window_exposure(minute, window_s,
                                        lambda index: sticky_fraction(f"window:{index}", salt) < rate)
                for minute in minutes[1:-1]}
    periods = []
    for row in rows:
        minute = row.key["minute"]
        if minute not in exposure:
            continue
        is_explored = bool(row.key["explored"])
        periods.append(Period(minute, is_explored, exposure[minute][1 if is_explored else 0], _cohort(row),
                              speculated=int(row.counters["speculated"]),
                              completion_tokens=int(row.counters["completion_tokens_sum"])))
    return compare(periods, window_s, cfg or SwitchbackConfig())


# --- before / after -----------------------------------------------------------------------------

def _rollout(session: Session, rollout_id: str) -> Rollout:
    rollout = AnalysisRepository(session).rollout(rollout_id)
    if rollout is None:
        raise NotFound(f"rollout {rollout_id!r} does not exist")
    return rollout


def before_after(session: Session, *, rollout_id: str | None, policy_name: str | None,
                 from_revision: str | None, to_revision: str | None, start: dt.datetime | None,
                 end: dt.datetime | None, now: dt.datetime) -> dict[str, Any]:
    """Per route: the two revisions' p50/p95, retries and acceptance over one window.

    For a rollout, the window is the rollout's life (its cohorts ran side by
    side); otherwise the caller names the policy, both revisions and the window.
    """
    if rollout_id is not None:
        rollout = _rollout(session, rollout_id)
        policy = AnalysisRepository(session).policy_by_id(rollout.policy_id)
        assert policy is not None
        from_revision, to_revision = rollout.from_revision_id, rollout.to_revision_id
        start = start or _floor(rollout.created_at, 60)
        end = end or ((now if rollout.state in ("running", "paused") else rollout.updated_at)
                      + dt.timedelta(minutes=1))
    else:
        missing = [_field(name, "missing", "required without `rollout`")
                   for name, value in (("policy", policy_name), ("from_revision", from_revision),
                                       ("to_revision", to_revision)) if value is None]
        if missing:
            raise _invalid(*missing)
        assert policy_name is not None
        policy = _policy(session, policy_name)
    routes: dict[str, dict[str, Any]] = defaultdict(dict)
    totals: dict[str, Any] = {}
    for side, rid in (("before", from_revision), ("after", to_revision)):
        rows, _ = summarize(session, RollupFilter(policy=policy.name, revision=rid, start=start, end=end),
                            ["route"])
        all_routes = Cohort()
        for row in rows:
            cohort = _cohort(row)
            routes[row.key["route"]][side] = describe(cohort)
            all_routes.add(cohort)
        totals[side] = describe(all_routes)
    report = []
    for route, sides in sorted(routes.items()):
        before, after = sides.get("before"), sides.get("after")
        change = None
        if before and after:
            change = {f"{m}_{q}": _relative(before[m][q], after[m][q])
                      for m in ("itl_ms", "e2e_ms") for q in ("p50", "p95")}
            change["retry_rate"] = _delta(before["retry_rate"], after["retry_rate"])
            change["acceptance_rate"] = _delta(before["acceptance_rate"], after["acceptance_rate"])
        report.append({"route": route, "before": before, "after": after, "change": change})
    return {"policy": policy.name, "from_revision": from_revision, "to_revision": to_revision, "from": start,
            "to": end, "routes": report, "all_routes": totals}


def _relative(before: float | None, after: float | None) -> float | None:
    return None if before is None or before == 0 or after is None else after / before - 1


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


# --- recommendations ----------------------------------------------------------------------------

def _active(session: Session, policy: Policy) -> Revision:
    if policy.active_revision_id is None:
        raise Conflict(f"policy {policy.name!r} has no active revision")
    revision = AnalysisRepository(session).revision(policy.active_revision_id)
    assert revision is not None
    return revision


def recommendations(session: Session, policy_name: str, *, start: dt.datetime | None, end: dt.datetime | None,
                    cfg: RecommendConfig) -> tuple[Revision, list[Recommendation], list[Cell]]:
    revision, recs, cell_list, _ = recommendations_with_evidence(session, policy_name, start=start, end=end,
                                                                 cfg=cfg)
    return revision, recs, cell_list


def recommendations_with_evidence(session: Session, policy_name: str, *, start: dt.datetime | None,
                                  end: dt.datetime | None, cfg: RecommendConfig
                                  ) -> tuple[Revision, list[Recommendation], list[Cell], SwitchbackResult | None]:
    """The recommendations, the cells they read and the whole worker's switchback comparison."""
    policy = _policy(session, policy_name)
    revision = _active(session, policy)
    cell_list = cells(session, policy.name, start=start, end=end)
    worker = revision_switchback(session, policy, revision, start=start, end=end,
                                 cfg=SwitchbackConfig(confidence=cfg.confidence))
    return revision, recommend(revision.document, revision.id, cell_list, cfg, worker), cell_list, worker


def check_edits(revision: Revision, recs: list[Recommendation]) -> None:
    """Mark the recommendations whose edit does not make a valid policy (with the library's errors)."""
    for rec in recs:
        if rec.edit is None:
            rec.applicable = False
            continue
        try:
            edits.apply_edit(revision.document, rec.edit)
        except PolicyValidationError as exc:
            rec.applicable = False
            rec.problems = [{"path": e.path, "code": e.code, "message": e.message} for e in exc.errors]
        except ValueError as exc:
            rec.applicable = False
            rec.problems = [{"path": "", "code": "not_applicable", "message": str(exc)}]


def list_recommendations(session: Session, policy_name: str, *, start: dt.datetime | None,
                         end: dt.datetime | None, cfg: RecommendConfig
                         ) -> tuple[Revision, list[Recommendation], str | None, SwitchbackResult | None]:
    """The active revision, its recommendations, the policy's head (what applying one builds on) and the
    switchback comparison they read."""
    revision, recs, _, worker = recommendations_with_evidence(session, policy_name, start=start, end=end, cfg=cfg)
    check_edits(revision, recs)
    head = AnalysisRepository(session).head(revision.policy_id)
    return revision, recs, head.id if head is not None else None, worker


def apply_recommendation(session: Session, rec_id: str, *, policy_name: str, start: dt.datetime | None,
                         end: dt.datetime | None, cfg: RecommendConfig, actor: str,
                         if_match: policy_service.IfMatch | None = None) -> tuple[Revision, Recommendation]:
    """Create a draft revision (not active) with a recommendation's edit; the message cites its evidence.

    The draft is a new head of the policy, so it builds on a head the caller names: ``if_match`` (the
    listing's ``head``); without one, the revision the recommendation was computed against. A revision
    saved in between is then a 412, never silently left out of the new head.
    """
    revision, recs, _ = recommendations(session, policy_name, start=start, end=end, cfg=cfg)
    rec = next((r for r in recs if r.id == rec_id), None)
    if rec is None:
        raise NotFound(f"recommendation {rec_id!r} does not hold for policy {policy_name!r} on this window "
                       "(the evidence or the active revision changed): list the recommendations again")
    if rec.edit is None:
        raise Conflict(f"recommendation {rec_id!r} is a flag ({rec.kind}); it has no rule edit to apply")
    try:
        edited, _ = edits.apply_edit(revision.document, rec.edit)
    except PolicyValidationError as exc:
        raise ValidationFailed("the edited policy does not validate", errors=[
            {"path": e.path, "in": "policy", "code": e.code, "message": e.message} for e in exc.errors]) from None
    message = f"{rec.message} [recommendation {rec.id}, confidence {rec.confidence}, based on {revision.id[:12]}]"
    condition = if_match if if_match is not None else policy_service.IfMatch(any=False,
                                                                             tags=frozenset({revision.id}))
    try:
        outcome = policy_service.create_revision(
            session, policy_name=policy_name,
            submission=policy_service.Submission(data=edited, message=message[:4000]),
            if_match=condition, actor=actor)
    except PreconditionFailed as exc:
        head = exc.extra.get("current_head")
        raise PreconditionFailed(
            f"the policy's head is {head}, not the revision this recommendation was to build on "
            f"({', '.join(sorted(condition.tags)) or 'none named'}): a revision was saved since the "
            "recommendations were listed; list them again (the draft would have left that revision's changes out)",
            errors=exc.errors, headers=exc.headers, **exc.extra) from None
    record(session, actor=actor, action="recommendation.apply", target_type="revision",
           target_id=outcome.revision.id,
           before={"revision": revision.id},
           after={"revision": outcome.revision.id, "created": outcome.created, "recommendation": rec.to_dict()},
           reason=rec.message)
    return outcome.revision, rec


# --- what-if -------------------------------------------------------------------------------------

def candidate_document(session: Session, policy: Policy, *, revision: str | None,
                       document: Mapping[str, Any] | None) -> tuple[PolicyDocument, str]:
    if (revision is None) == (document is None):
        raise _invalid(_field("revision", "one_of", "give exactly one of `revision` and `document`", "body"))
    if revision is not None:
        row = AnalysisRepository(session).revision(revision)
        if row is None or row.policy_id != policy.id:
            raise ValidationFailed("no such revision of this policy", errors=[
                _field("revision", "not_found", f"revision {revision!r} is not a revision of {policy.name!r}",
                       "body")])
        return validate_data(row.document), row.id
    try:
        doc = validate_data(document)
    except PolicyValidationError as exc:
        raise ValidationFailed("the candidate document does not validate", errors=[
            {"path": f"document.{e.path}" if e.path else "document", "in": "body", "code": e.code,
             "message": e.message} for e in exc.errors]) from None
    if doc.name != policy.name:
        raise ValidationFailed("the candidate is another policy", errors=[
            _field("document.name", "name_mismatch", f"must be {policy.name!r}", "body")])
    return doc, "candidate"


def what_if(session: Session, policy_name: str, *, revision: str | None, document: Mapping[str, Any] | None,
            start: dt.datetime | None, end: dt.datetime | None) -> dict[str, Any]:
    """Decide every recorded request of the window with the active revision and with the candidate.

    Exploration is left out (each shape gets the policy's own decision), so
    the two columns differ only where the rules do. A shape counts the
    requests its events stand for: a pre-aggregating worker's sampled events
    with their weights, so the counts are estimates there (``basis`` says so). Latency is the measured
    mean of the route and batch bucket on the engine class (speculative or
    plain) a decision chooses, from the rollups of the same window; requests
    in a bucket where a needed class was never measured are counted as
    unestimated rather than guessed.
    """
    policy = _policy(session, policy_name)
    doc, label = candidate_document(session, policy, revision=revision, document=document)
    active = _active(session, policy)
    # The fleet's cohort secret, as the sidecars compile with (exploration is left out below in any case).
    secret = fleet_cohort_secret(session)
    before_policy = compile_policy(validate_data(active.document), active.id, cohort_secret=secret)
    after_policy = compile_policy(doc, label, cohort_secret=secret)
    fields, cuts = _shape_fields(validate_data(active.document), doc)
    groups = AnalysisRepository(session).shape_groups(policy=policy.name, start=start, end=end,
                                                      limit=MAX_SHAPE_GROUPS + 1, fields=fields, cuts=cuts)
    truncated = len(groups) > MAX_SHAPE_GROUPS
    splits = _splits(session, policy, RollupFilter(policy=policy.name, start=start, end=end))
    means: dict[tuple[str, int], dict[str, tuple[float | None, float | None]]] = {}
    for key, split in splits.items():
        spec = Cohort().add(split.spec).add(split.spec_explored)
        plain = Cohort().add(split.plain).add(split.plain_explored)
        means[key] = {"speculative": (spec.itl_mean, spec.e2e_mean), "plain": (plain.itl_mean, plain.e2e_mean),
                      "k0": (split.k0.itl_mean, split.k0.e2e_mean)}
    # A decision not to speculate that stays on an in-engine-scheduled engine runs its K=0 steps, at their cost
    in_engine_before = validate_data(active.document).in_engine_schedules
    in_engine_after = doc.in_engine_schedules

    def engine_class(decision: Decision, in_engine: frozenset[str]) -> str:
        if decision.speculate:
            return "speculative"
        return "k0" if decision.engine in in_engine else "plain"
    per_route: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for g in groups[:MAX_SHAPE_GROUPS]:
        try:
            labels = json.loads(g.labels) if g.labels else {}
        except ValueError:
            labels = {}
        shape = RequestShape(route=g.route, model=g.model, batch_size=g.batch_size,
                             structured_output=g.structured_output, tools=g.tools, stream=g.stream,
                             max_tokens=g.max_tokens, prompt_tokens=int(g.prompt_tokens), labels=labels)
        before, after = before_policy.decide(shape), after_policy.decide(shape)
        r = per_route[g.route]
        n = g.requests
        r["events"] += g.events
        r["sampled_events"] += g.sampled_events
        r["requests"] += n
        r["recorded_speculated"] += g.speculated
        r["speculated_before"] += n if before.speculate else 0
        r["speculated_after"] += n if after.speculate else 0
        if (before.engine, before.num_speculative_tokens) != (after.engine, after.num_speculative_tokens):
            r["changed"] += n
        measured = means.get((g.route, batch_bucket(g.batch_size)), {})
        b, a = measured.get(engine_class(before, in_engine_before)), measured.get(engine_class(after, in_engine_after))
        if b is None or a is None or None in b or None in a:
            r["unestimated"] += n
            continue
        r["estimated"] += n
        r["itl_before"] += n * b[0]  # type: ignore[operator]
        r["e2e_before"] += n * b[1]  # type: ignore[operator]
        r["itl_after"] += n * a[0]  # type: ignore[operator]
        r["e2e_after"] += n * a[1]  # type: ignore[operator]
    routes = []
    total: dict[str, float] = defaultdict(float)
    for route, r in sorted(per_route.items()):
        for name, value in r.items():
            total[name] += value
        routes.append(_what_if_row(route, r))
    all_routes = _what_if_row(None, total)
    return {"policy": policy.name, "candidate": label, "baseline": active.id, "from": start, "to": end,
            "routes": routes, "all_routes": all_routes, "truncated": truncated, "basis": all_routes["basis"],
            "method": "each recorded request shape decided with the active revision and with the candidate "
                      "(no exploration; a sampled event counted as the requests it stands for); latency from "
                      "the measured mean ITL and e2e of its route and batch bucket on the engine class each "
                      "decision chooses"}


def _shape_fields(*docs: PolicyDocument) -> tuple[set[str], dict[str, list[int]]]:
    """The request fields the documents' rules test, and the cut points of their token ranges."""
    fields: set[str] = set()
    cuts: dict[str, set[int]] = defaultdict(set)
    for doc in docs:
        for rule in doc.rules:
            when = rule.when
            for name in ("model", "structured_output", "tools", "stream", "labels"):
                if getattr(when, name) is not None:
                    fields.add(name)
            for name in ("max_tokens", "prompt_tokens"):
                r = getattr(when, name)
                if r is not None:
                    fields.add(name)
                    if r.min is not None:
                        cuts[name].add(r.min)
                    if r.max is not None:
                        cuts[name].add(r.max + 1)
    return fields, {name: sorted(points) for name, points in cuts.items()}


def _what_if_row(route: str | None, r: Mapping[str, float]) -> dict[str, Any]:
    n = r.get("requests", 0)
    est = r.get("estimated", 0)
    sampled = int(r.get("sampled_events", 0))

    def share(name: str) -> float | None:
        return r.get(name, 0) / n if n else None

    def mean(metric: str) -> dict[str, float | None] | None:
        if not est:
            return None
        before, after = r.get(f"{metric}_before", 0) / est, r.get(f"{metric}_after", 0) / est
        return {"before": before, "after": after, "change": after / before - 1 if before else None}

    row: dict[str, Any] = {
        "requests": represented(n, sampled), "recorded_speculated_share": share("recorded_speculated"),
        "speculated_share_before": share("speculated_before"), "speculated_share_after": share("speculated_after"),
        "decisions_changed": represented(r.get("changed", 0), sampled),
        "estimated_requests": represented(est, sampled),
        "unestimated_requests": represented(r.get("unestimated", 0), sampled),
        "itl_ms_mean": mean("itl"), "e2e_ms_mean": mean("e2e"),
        "basis": basis(int(r.get("events", 0)), sampled, n),
    }
    return row if route is None else {"route": route, **row}
