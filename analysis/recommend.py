"""The recommender: a pure function from per-bucket statistics and a policy to rule edits.

:func:`recommend` reads no database and no clock: give it the policy's
normal form, its revision id and a list of :class:`~analysis.cells.Cell`
(from the rollups, or from a file of recorded statistics) and it returns the
recommendations, each with its evidence, expected effect and confidence.

Which measure decides: what clients feel first. A cell's verdict reads the
first of ``RecommendConfig.measures`` (end-to-end latency, then inter-token
latency) that has ``min_samples`` requests in both cohorts; every evidence row
and recommendation names it (``measure``). Inter-token latency stays in the
tables as the mechanism view. With exploration in time windows
(``exploration.window_s``), both cohorts of a cell ran under one regime per
window, so a cell's end-to-end latency includes what the other engines' work
cost it.

The whole worker: given a switchback comparison
(:mod:`analysis.switchback`), when the policy's windows speculate more than
the explored ones and clients fared worse in them with confidence, the
recommender proposes ``stop_speculating`` (edit ``plain_only``: "do not
speculate on this pool"), naming the measure that drove it, and proposes
nothing else but quality flags: it covers the route edits, and nothing that widens speculation (raise a
threshold, change K, switch method) is proposed on per-request figures the whole worker contradicts.

What it proposes, per route:

- ``raise_threshold`` / ``lower_threshold``: speculate up to the largest
  batch-size bucket where speculation still wins with confidence (the
  interval of plain/speculative latency lies above 1), walking up
  from the smallest bucket and stopping at the first bucket where it loses
  with confidence. A raise needs every bucket it adds to win; a lower is
  proposed when a bucket the policy speculates in loses, and goes down to the
  largest winning bucket below it (just below the loss when none wins).
- ``exclude_route``: speculation loses with confidence and wins nowhere, or
  the measured acceptance is below the guardrail's minimum with confidence.
- ``change_k``: measured first: another engine of the same method,
  configured with another draft length, ran the route and is faster with
  confidence (edit: send the route there); else the Leviathan formula with the
  measured acceptance prefers another draft length by at least 5 % (low
  confidence, measure ``leviathan``: not measured, so an autopilot at medium
  confidence or above never applies it).
- ``switch_method``: a speculative engine of another method ran on the route
  and is faster with confidence.
- ``quality_risk`` (a flag, nothing to apply): retries or structured-output
  failures are higher on the speculative path with confidence.

Engines that schedule in the engine (``schedule: in_engine``): the requests
decided into their K=0 band (the ``k0`` rollups) are in neither cohort; each
row reports them as ``k0`` with the K=0 tax (their latency over the plain
cohort's, which there is the holdout's explored plain requests). Where that
tax is above 1 with confidence, the engine's K=0 steps cost more than not
speculating, and the recommender proposes ``route_instead`` (edit
``route_instead``: the engine drops ``schedule: in_engine``, so its rules
route by batch again and the band goes to the plain engine) in place of every
threshold edit on the routes it serves. Otherwise a threshold edit on such a
route is a new schedule for the engine: its expected effect carries the
schedule before and after (``[[lo, hi, K], ...]``, as rendered for vLLM).
``route_instead`` is proposed only where the engine drafts one K wherever it
drafts and the edited policy serves every K=0 band of the engine plain (the
rules of other routes could send a band to another speculative engine);
it counts as widening for the switchback guard.

Client disconnects: a bucket where one cohort's clients went away markedly
more often (:func:`analysis.cells.more_disconnects`) never says that cohort
is the faster one: its verdict is ``confounded by disconnects`` instead of
``wins`` or ``loses``, so no threshold moves on it; an engine is not proposed
as faster when its clients left it markedly more often. Every evidence row
carries the disconnect count and rate of both cohorts.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from analysis import edits
from analysis.buckets import BATCH_BUCKETS, batch_bucket_label
from analysis.cells import Cell, Cohort, more_disconnects
from analysis.stats import (
    DEFAULT_COST_RATIO,
    RatioEstimate,
    expected_tokens_per_step,
    leviathan_speedup,
    welch_ratio,
)
from analysis.switchback import EXPLORED_BETTER, MEASURES, SwitchbackResult
from policies import PolicyDocument, PolicyValidationError, RequestShape, compile_policy, validate_data
from policies.model import Engine, PlainEngine, engine_k
from policies.render import batch_size_schedule

INSUFFICIENT = "insufficient evidence"
CONFOUNDED = "confounded by disconnects"


@dataclass(frozen=True, slots=True)
class RecommendConfig:
    confidence: float = 0.95
    min_samples: int = 100  # per cohort, before a bucket counts as evidence
    min_gain: float = 0.05  # smallest theoretical gain worth a k change
    cost_ratio: float | None = None  # draft/target cost; None: by method (stats.DEFAULT_COST_RATIO)
    max_k: int = 8
    # The measures a verdict may rest on, client-side first; the first with min_samples in both cohorts decides.
    measures: tuple[str, ...] = ("e2e", "itl")


MEASURE_LABELS = {"e2e": "end-to-end latency", "itl": "inter-token latency", "ttft": "time to first token"}
# route_instead too: the rules then route by batch again, and a band they send elsewhere may speculate there.
WIDENING = frozenset({"raise_threshold", "change_k", "switch_method", "route_instead"})
THRESHOLD_KINDS = frozenset({"raise_threshold", "lower_threshold"})


@dataclass(slots=True)
class Recommendation:
    id: str
    kind: str
    route: str
    title: str
    edit: dict[str, Any] | None
    confidence: str
    expected_effect: dict[str, Any]
    evidence: dict[str, Any]
    message: str
    applicable: bool = True
    problems: list[dict[str, Any]] = field(default_factory=list)
    measure: str | None = None  # what drove it: e2e, itl, requests_per_s, acceptance, ...; None for a flag

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "route": self.route, "title": self.title, "edit": self.edit,
                "confidence": self.confidence, "expected_effect": self.expected_effect,
                "evidence": self.evidence, "message": self.message, "applicable": self.applicable,
                "problems": self.problems, "measure": self.measure}


def recommendation_id(policy: str, revision: str, kind: str, route: str, edit: Mapping[str, Any] | None) -> str:
    raw = json.dumps([policy, revision, kind, route, edit], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def bucket_upper(lower: int) -> int:
    """The largest batch size of a bucket; the open last bucket answers twice its lower bound."""
    i = BATCH_BUCKETS.index(lower)
    return BATCH_BUCKETS[i + 1] - 1 if i + 1 < len(BATCH_BUCKETS) else lower * 2


def _ratio_dict(r: RatioEstimate | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {"ratio": round(r.ratio, 4), "low": round(r.low, 4), "high": round(r.high, 4),
            "n_plain": r.n_a, "n_speculative": r.n_b, "confidence": r.confidence}


def cell_measure(cell: Cell, cfg: RecommendConfig) -> str:
    """The first of ``cfg.measures`` measured on ``min_samples`` requests of both cohorts (else the last)."""
    for metric in cfg.measures:
        est = cell.speedup(metric, cfg.confidence)
        if est is not None and est.n_a >= cfg.min_samples and est.n_b >= cfg.min_samples:
            return metric
    return cfg.measures[-1]


def verdict(cell: Cell, cfg: RecommendConfig) -> tuple[str, RatioEstimate | None]:
    """``wins`` / ``loses`` / ``insufficient evidence`` for speculation in one cell, on its
    :func:`cell_measure` (end-to-end latency where it is measured).

    The faster cohort must not be the one its clients left markedly more often (their slow answers are
    missing from its latencies): then ``confounded by disconnects``.
    """
    est = cell.speedup(cell_measure(cell, cfg), cfg.confidence)
    if est is None or est.n_a < cfg.min_samples or est.n_b < cfg.min_samples:
        return INSUFFICIENT, est
    if est.above_one:
        return (CONFOUNDED if more_disconnects(cell.speculative, cell.plain, cfg.confidence) else "wins"), est
    if est.below_one:
        return (CONFOUNDED if more_disconnects(cell.plain, cell.speculative, cfg.confidence) else "loses"), est
    return "no clear difference", est


def cost_ratio_of(method: str | None, cfg: RecommendConfig) -> float:
    if cfg.cost_ratio is not None:
        return cfg.cost_ratio
    return DEFAULT_COST_RATIO.get(method or "", 0.1)


def theory(cell: Cell, cfg: RecommendConfig) -> dict[str, Any] | None:
    """The Leviathan column: expected speedup from the measured acceptance, k and the assumed cost ratio."""
    a = cell.speculative.acceptance_rate
    if a is None or not cell.k:
        return None
    c = cost_ratio_of(cell.method, cfg)
    return {"acceptance": round(a, 4), "k": cell.k, "cost_ratio": c,
            "expected_tokens_per_step": round(expected_tokens_per_step(a, cell.k), 4),
            "speedup": round(leviathan_speedup(a, cell.k, c), 4)}


def k0_measure(cell: Cell, cfg: RecommendConfig) -> str | None:
    """The first of ``cfg.measures`` with ``min_samples`` K=0 and plain requests; None: not measured."""
    for metric in cfg.measures:
        k0, plain = cell.k0.moments(metric), cell.plain.moments(metric)
        if k0 is not None and plain is not None and k0.n >= cfg.min_samples and plain.n >= cfg.min_samples:
            return metric
    return None


def k0_report(cell: Cell, cfg: RecommendConfig) -> dict[str, Any] | None:
    """The cell's requests that an in-engine-scheduled engine ran at K=0, and their tax over the plain cohort
    (None without such requests; ``tax`` None below min_samples)."""
    if not cell.k0.requests:
        return None
    measure = k0_measure(cell, cfg)
    tax = cell.k0_tax(measure, cfg.confidence) if measure is not None else None
    drafted = cell.k0.draft_tokens / cell.k0.spec_reported if cell.k0.spec_reported else None
    return {"engine": cell.k0_engine, "requests": cell.k0.requests, "measure": measure,
            "drafted_per_request": None if drafted is None else round(drafted, 3),
            "tax": None if tax is None else {"ratio": round(tax.ratio, 4), "low": round(tax.low, 4),
                                             "high": round(tax.high, 4), "n_k0": tax.n_a, "n_plain": tax.n_b,
                                             "confidence": tax.confidence},
            "e2e_ms_p50": cell.k0.quantile("e2e", 0.5), "itl_ms_p50": cell.k0.quantile("itl", 0.5)}


def cell_report(cell: Cell, cfg: RecommendConfig) -> dict[str, Any]:
    """One row of the speedup table (and of a recommendation's evidence)."""
    word, _ = verdict(cell, cfg)
    itl = cell.speedup("itl", cfg.confidence)
    e2e = cell.speedup("e2e", cfg.confidence)
    ttft = cell.speedup("ttft", cfg.confidence)
    return {
        "route": cell.route, "batch_bucket": cell.batch_bucket, "batch_range": batch_bucket_label(cell.batch_bucket),
        "source": cell.source, "engine": cell.engine, "method": cell.method, "k": cell.k,
        "n_speculative": cell.speculative.requests, "n_plain": cell.plain.requests,
        "measure": cell_measure(cell, cfg), "e2e_speedup": _ratio_dict(e2e), "ttft_speedup": _ratio_dict(ttft),
        "itl_speedup": _ratio_dict(itl), "verdict": word,
        "e2e_ms_p50": {"speculative": cell.speculative.quantile("e2e", 0.5), "plain": cell.plain.quantile("e2e", 0.5)},
        "e2e_ms_p95": {"speculative": cell.speculative.quantile("e2e", 0.95),
                       "plain": cell.plain.quantile("e2e", 0.95)},
        "itl_ms_p50": {"speculative": cell.speculative.quantile("itl", 0.5), "plain": cell.plain.quantile("itl", 0.5)},
        "client_disconnects": {"speculative": cell.speculative.client_disconnects,
                               "plain": cell.plain.client_disconnects},
        "client_disconnect_rate": {"speculative": cell.speculative.client_disconnect_rate,
                                   "plain": cell.plain.client_disconnect_rate},
        "acceptance_rate": cell.speculative.acceptance_rate,
        "mean_acceptance_length": cell.speculative.mean_acceptance_length,
        "theory": theory(cell, cfg),
        "k0": k0_report(cell, cfg),
    }


# --- the current policy, per cell -------------------------------------------------------------

def _decides_speculation(doc_data: Mapping[str, Any], routes: Sequence[str]) -> dict[tuple[str, int], bool]:
    """Whether the policy speculates for each route and bucket (both ends of the bucket must)."""
    doc = validate_data(doc_data)
    compiled = compile_policy(doc)
    out = {}
    for route in routes:
        for lower in BATCH_BUCKETS:
            decisions = [compiled.decide(RequestShape(route=route, batch_size=size)).speculate
                         for size in (lower, bucket_upper(lower))]
            out[(route, lower)] = all(decisions)
    return out


def _threshold(speculates: Mapping[int, bool]) -> int | None:
    """The largest batch size of the contiguous speculated buckets from the smallest; None if none."""
    top = None
    for lower in BATCH_BUCKETS:
        if not speculates.get(lower):
            break
        top = bucket_upper(lower)
    return top


def _confidence(estimates: Sequence[RatioEstimate | None], cfg: RecommendConfig) -> str:
    ns = [min(e.n_a, e.n_b) for e in estimates if e is not None]
    if ns and min(ns) >= 4 * cfg.min_samples:
        return "high"
    return "medium"


def _share(cells: Sequence[Cell], buckets: set[int]) -> float:
    total = sum(c.speculative.requests + c.plain.requests for c in cells)
    part = sum(c.speculative.requests + c.plain.requests for c in cells if c.batch_bucket in buckets)
    return part / total if total else 0.0


def _mean_speedup(cells: Sequence[Cell], buckets: set[int], cfg: RecommendConfig) -> float | None:
    ests = [(c.speculative.requests + c.plain.requests, c.speedup(cell_measure(c, cfg), cfg.confidence))
            for c in cells if c.batch_bucket in buckets]
    pairs = [(w, e.ratio) for w, e in ests if e is not None and w > 0]
    if not pairs:
        return None
    return math.exp(sum(w * math.log(r) for w, r in pairs) / sum(w for w, _ in pairs))


def _rate_difference(spec_num: int, spec_den: int, plain_num: int, plain_den: int,
                     confidence: float) -> tuple[float, float] | None:
    """spec rate - plain rate and the lower end of its interval (Poisson-style variance for counts)."""
    if spec_den == 0 or plain_den == 0:
        return None
    rs, rp = spec_num / spec_den, plain_num / plain_den
    se = math.sqrt(max(rs, 1 / spec_den) / spec_den + max(rp, 1 / plain_den) / plain_den)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    return rs - rp, rs - rp - z * se


def _validity_drop(spec: Cohort, plain: Cohort, confidence: float) -> tuple[float, float] | None:
    """plain validity - spec validity and the lower end of its interval (binomial)."""
    if spec.structured_checked == 0 or plain.structured_checked == 0:
        return None
    ps = spec.structured_valid / spec.structured_checked
    pp = plain.structured_valid / plain.structured_checked
    se = math.sqrt(max(ps * (1 - ps), 0.25 / spec.structured_checked) / spec.structured_checked
                   + max(pp * (1 - pp), 0.25 / plain.structured_checked) / plain.structured_checked)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    return pp - ps, pp - ps - z * se


# --- what every section reads about one route -----------------------------------------------------

@dataclass(slots=True)
class _RouteFacts:
    """One route's cells, their verdicts and what the policy does with it now."""

    policy: str
    revision: str
    route: str
    cells: list[Cell]  # by batch-size bucket
    verdicts: dict[int, tuple[str, RatioEstimate | None]]
    measures: dict[int, str]  # bucket -> the measure its verdict read
    evidence: dict[str, Any]  # the speedup table, shared by the route's recommendations
    spec_now: dict[int, bool]  # bucket -> whether the policy speculates there
    current: int | None  # the policy's threshold (see _threshold)
    wins: list[int]
    loses: list[int]
    spec_all: Cohort  # every speculative request of the route

    @property
    def speculating(self) -> bool:
        return any(self.spec_now.values())

    def verdict_of(self, bucket: int) -> str:
        return self.verdicts.get(bucket, (INSUFFICIENT, None))[0]

    def recommendation(self, kind: str, title: str, edit: dict[str, Any] | None, confidence: str,
                       expected_effect: dict[str, Any], evidence: dict[str, Any], message: str,
                       measure: str | None = None) -> Recommendation:
        """A recommendation for this route, named by the policy, revision, kind, route and edit."""
        rid = recommendation_id(self.policy, self.revision, kind, self.route, edit)
        return Recommendation(rid, kind, self.route, title, edit, confidence, expected_effect, evidence, message,
                              measure=measure)

    def measure_of(self, buckets: Sequence[int]) -> str | None:
        """The measure the verdicts of ``buckets`` read: the client-side one when any of them read it."""
        found = {self.measures[b] for b in buckets if b in self.measures}
        return next((m for m in ("e2e", "ttft", "itl") if m in found), None)

    def label(self, buckets: Sequence[int]) -> str:
        return MEASURE_LABELS.get(self.measure_of(buckets) or "itl", "latency")

    def main_speculative_cell(self) -> Cell | None:
        """The cell with the most speculative requests among those that know their draft length."""
        spec_cells = [c for c in self.cells if c.k]
        return max(spec_cells, key=lambda c: c.speculative.requests) if spec_cells else None


def _route_facts(policy: str, revision: str, route: str, cells: Sequence[Cell],
                 speculates: Mapping[tuple[str, int], bool], cfg: RecommendConfig) -> _RouteFacts:
    route_cells = sorted(cells, key=lambda c: c.batch_bucket)
    verdicts = {c.batch_bucket: verdict(c, cfg) for c in route_cells}
    measures = {c.batch_bucket: cell_measure(c, cfg) for c in route_cells}
    spec_now = {lower: speculates[(route, lower)] for lower in BATCH_BUCKETS}
    spec_all = Cohort()
    for c in route_cells:
        spec_all.add(c.speculative)
    return _RouteFacts(
        policy=policy, revision=revision, route=route, cells=route_cells, verdicts=verdicts, measures=measures,
        evidence={"buckets": [cell_report(c, cfg) for c in route_cells]},
        spec_now=spec_now, current=_threshold(spec_now),
        wins=[b for b, (v, _) in verdicts.items() if v == "wins"],
        loses=[b for b, (v, _) in verdicts.items() if v == "loses"], spec_all=spec_all)


def recommend(document: Mapping[str, Any], revision: str, cells: Sequence[Cell],
              cfg: RecommendConfig | None = None, switchback: SwitchbackResult | None = None) -> list[Recommendation]:
    """Recommendations for a policy (its normal form) from per-bucket statistics and, when the policy
    explores in time windows, the whole worker's switchback comparison; pure."""
    cfg = cfg or RecommendConfig()
    doc = validate_data(document)
    by_route: dict[str, list[Cell]] = defaultdict(list)
    for cell in cells:
        by_route[cell.route].append(cell)
    speculates = _decides_speculation(document, sorted(by_route))
    out: list[Recommendation] = []
    for route in sorted(by_route):
        facts = _route_facts(doc.name, revision, route, by_route[route], speculates, cfg)
        out += _route_recommendations(facts, doc.guardrails.min_acceptance_rate, doc.engines, cfg)
    out = _in_engine_schedules(doc, document, revision, cells, out, cfg)
    if switchback is None or switchback.verdict != EXPLORED_BETTER:
        return out
    # Clients fared worse in the windows that speculated more: nothing that widens speculation is proposed,
    # whatever the per-request figures say (they cannot see what one engine's work costs the others).
    speculation_loses = switchback.policy_speculates_more
    if not speculation_loses:
        return out
    kept = [r for r in out if r.kind not in WIDENING]
    stop = _stop_speculating(doc, revision, switchback)
    return kept if stop is None else [stop, *[r for r in kept if r.edit is None]]


def _stop_speculating(doc: PolicyDocument, revision: str, sb: SwitchbackResult) -> Recommendation | None:
    """``plain_only`` when the policy speculates somewhere and its windows served clients worse."""
    policy = doc.name
    default_speculates = not isinstance(doc.engines[doc.default.engine], PlainEngine)
    if not default_speculates and all(isinstance(doc.engines[r.then.engine], PlainEngine) for r in doc.rules):
        return None
    driver = sb.driver or "e2e"
    label = next(m.label for m in MEASURES if m.name == driver)
    est = sb.estimates[driver]
    assert est is not None  # a verdict names a measured driver
    edit = {"kind": "plain_only"}
    share = sb.speculated_share
    return Recommendation(
        recommendation_id(policy, revision, "stop_speculating", "*", edit), "stop_speculating", "*",
        f"do not speculate: policy {policy!r} sends every request to the plain engine", edit,
        "high" if sb.pairs >= 12 else "medium",
        {"text": "every request runs on the plain engine; exploration keeps measuring speculation in its windows",
         "policy_advantage": {m: None if e is None else round(e.ratio, 4) for m, e in sb.estimates.items()}},
        {"switchback": sb.to_dict()},
        f"Stop speculating: in the policy's windows (speculated share {share['policy'] or 0:.0%}) clients got a "
        f"worse {label} than in the explored windows (speculated share {share['explored'] or 0:.0%}): the "
        f"policy's advantage is {est.ratio:.2f} ({est.confidence:.0%} interval {est.low:.2f}-{est.high:.2f}) "
        f"over {sb.pairs} switchback pairs of {sb.window_s:g} s windows.",
        measure=driver)


def _route_recommendations(facts: _RouteFacts, min_acceptance: float | None, engines: Mapping[str, Engine],
                     cfg: RecommendConfig) -> list[Recommendation]:
    """One route's recommendations, in the order they are listed."""
    # An exclusion or a lowered threshold is the route's only recommendation: the others would tune
    # speculation that the edit stops or narrows.
    exclusion = _exclude_route(facts, min_acceptance, cfg)
    if exclusion is not None:
        return [exclusion]
    lowered = _lower_threshold(facts, cfg)
    if lowered is not None:
        return [lowered]
    found = (_raise_threshold(facts, cfg), _change_k(facts, engines, cfg), _switch_method(facts, engines, cfg),
                 _quality_risk(facts, cfg))
    return [r for r in found if r is not None]


# --- engines that schedule in the engine -------------------------------------------------------------

def _route_engine(doc: PolicyDocument, route: str) -> str | None:
    """The speculative engine the rules send ``route`` to at batch 1 (None: a plain one)."""
    decision = compile_policy(doc).decide(RequestShape(route=route, batch_size=1))
    return decision.engine if decision.speculate else None


def _schedule(doc: PolicyDocument, engine: str) -> list[list[int]]:
    return [list(entry) for entry in batch_size_schedule(doc, engine)]


def _in_engine_schedules(doc: PolicyDocument, document: Mapping[str, Any], revision: str, cells: Sequence[Cell],
                         found: list[Recommendation], cfg: RecommendConfig) -> list[Recommendation]:
    """``route_instead`` for each in-engine engine whose K=0 steps cost more than the plain engine (it takes
    the place of the threshold edits on the routes that engine serves: they would tune a schedule the edit
    removes); the other threshold edits on such routes name the schedule they make."""
    in_engine = doc.in_engine_schedules
    if not in_engine:
        return found
    routed_around: set[str] = set()
    extra: list[Recommendation] = []
    for engine in sorted(in_engine):
        rec = _route_instead(doc, document, revision, engine, [c for c in cells if c.k0_engine == engine], cfg)
        if rec is not None:
            extra.append(rec)
            routed_around.add(engine)
    out: list[Recommendation] = []
    for rec in found:
        served_by = _route_engine(doc, rec.route) if rec.kind in THRESHOLD_KINDS else None
        if served_by is None or served_by not in in_engine:
            out.append(rec)
        elif served_by not in routed_around and rec.edit is not None:
            out.append(_as_schedule(doc, document, served_by, rec))
    return extra + out


def _as_schedule(doc: PolicyDocument, document: Mapping[str, Any], engine: str,
                 rec: Recommendation) -> Recommendation:
    """A threshold edit on a route of an in-engine engine, told as the engine's new schedule."""
    assert rec.edit is not None
    try:
        _, after = edits.apply_edit(dict(document), rec.edit)
        to: list[list[int]] | None = _schedule(after, engine)
    except (ValueError, PolicyValidationError):
        to = None  # the service checks every edit and marks it not applicable with the library's errors
    before = _schedule(doc, engine)
    rec.expected_effect = {**rec.expected_effect, "schedule": {"engine": engine, "from": before, "to": to}}
    if to is not None:
        rec.title = f"{rec.title}: engine {engine!r} drafts by the schedule {to}"
        rec.message = (f"{rec.message} Engine {engine!r} schedules in the engine: its schedule becomes {to} "
                       f"(was {before}); a supervising sidecar restarts it with the new schedule.")
    return rec


def _k0_bands_served_plain(doc: PolicyDocument, after: PolicyDocument, engine: str, routes: Sequence[str]) -> bool:
    """Whether every request the policy decides into the engine's K=0 band, on every route its rules name (and
    one they do not), at every batch-bucket edge, is decided plain after the edit."""
    named = {r for rule in doc.rules if rule.when.route for r in rule.when.route}
    before_policy, after_policy = compile_policy(doc), compile_policy(after)
    for route in sorted({*named, *routes, "(a route no rule names)"}):
        for lower in BATCH_BUCKETS:
            for size in (lower, bucket_upper(lower)):
                shape = RequestShape(route=route, batch_size=size)
                was = before_policy.decide(shape)
                if was.engine == engine and not was.speculate and after_policy.decide(shape).speculate:
                    return False
    return True


def _route_instead(doc: PolicyDocument, document: Mapping[str, Any], revision: str, engine: str,
                   cells: Sequence[Cell], cfg: RecommendConfig) -> Recommendation | None:
    """Drop the engine's in-engine schedule when its K=0 requests are slower than plain ones with confidence,
    nowhere faster, and the edit sends that band to a plain engine (rules may route it elsewhere)."""
    rows = []
    for cell in cells:
        measure = k0_measure(cell, cfg)
        if measure is None:
            continue
        tax = cell.k0_tax(measure, cfg.confidence)
        if tax is None:
            continue
        if tax.below_one:
            return None  # K=0 steps are cheaper than plain somewhere: no case for routing around them
        # A plain cohort whose clients left more often lost its slow tail: it only looks faster.
        if tax.above_one and not more_disconnects(cell.plain, cell.k0, cfg.confidence):
            rows.append((cell, measure, tax))
    if not rows:
        return None
    before = _schedule(doc, engine)
    if len({k for _, _, k in before if k}) > 1:
        return None  # routed, the engine drafts one K everywhere: bands with a smaller K would draft more
    edit = {"kind": "route_instead", "engine": engine}
    try:
        _, after = edits.apply_edit(dict(document), edit)
    except (ValueError, PolicyValidationError):
        return None
    if not _k0_bands_served_plain(doc, after, engine, [cell.route for cell in cells]):
        return None  # a band would be speculated elsewhere, which the K=0 tax says nothing about
    weights = [(cell.k0.requests, tax.ratio) for cell, _, tax in rows]
    mean_tax = math.exp(sum(w * math.log(r) for w, r in weights) / sum(w for w, _ in weights))
    measure = next((m for m in ("e2e", "ttft", "itl") if any(row[1] == m for row in rows)), "itl")
    where = ", ".join(f"{cell.route!r} {batch_bucket_label(cell.batch_bucket)} ({tax.ratio:.2f}, "
                      f"{tax.confidence:.0%} interval {tax.low:.2f}-{tax.high:.2f})" for cell, _, tax in rows)
    evidence = {"k0_tax": [{"route": cell.route, "batch_bucket": cell.batch_bucket,
                            "batch_range": batch_bucket_label(cell.batch_bucket), **(k0_report(cell, cfg) or {})}
                           for cell, _, _ in rows],
                "buckets": [cell_report(c, cfg) for c in cells]}
    label = MEASURE_LABELS.get(measure, "latency")
    return Recommendation(
        recommendation_id(doc.name, revision, "route_instead", "*", edit), "route_instead", "*",
        f"route around engine {engine!r}'s K=0 band: send it to the plain engine instead of scheduling K=0",
        edit, _confidence([tax for _, _, tax in rows], cfg),
        {"schedule": {"engine": engine, "from": before, "to": None},
         "latency_change_in_k0_band": round(1 / mean_tax, 4), "measure": measure,
         "text": f"engine {engine!r} no longer schedules in the engine: its rules route by batch again, the "
                 "requests it ran at K=0 go to the plain engine, and it drafts at its K whenever it runs"},
        evidence,
        f"Route instead of scheduling K=0: requests decided into engine {engine!r}'s K=0 band had a worse {label} "
        f"than the plain engine's in {where}; its K=0 steps still pay the speculative engine's overhead. "
        f"Drop its in-engine schedule (was {before}) so the rules route that band to the plain engine.",
        measure=measure)


# --- exclude the route --------------------------------------------------------------------------------

def _acceptance_upper_bound(spec: Cohort, cfg: RecommendConfig) -> float | None:
    """The upper end of the acceptance rate's interval; None below min_samples reported requests."""
    acceptance = spec.acceptance_rate
    if acceptance is None or spec.spec_reported < cfg.min_samples:
        return None
    z = NormalDist().inv_cdf(0.5 + cfg.confidence / 2)
    return acceptance + z * math.sqrt(max(acceptance * (1 - acceptance), 1e-4) / spec.spec_reported)


def _exclude_route(facts: _RouteFacts, min_acc: float | None, cfg: RecommendConfig) -> Recommendation | None:
    route, loses, spec_all = facts.route, facts.loses, facts.spec_all
    acceptance = spec_all.acceptance_rate
    acc_high = _acceptance_upper_bound(spec_all, cfg)
    low_acceptance = min_acc is not None and acc_high is not None and acc_high < min_acc
    if not (facts.speculating and ((loses and not facts.wins) or low_acceptance)):
        return None
    why = (f"acceptance {acceptance:.3f} (interval up to {acc_high:.3f}) is below the guardrail "
           f"minimum {min_acc}" if low_acceptance and acceptance is not None
           else f"speculation is slower ({facts.label(loses)}) with confidence in bucket(s) "
                f"{', '.join(batch_bucket_label(b) for b in loses)} and faster in none")
    ests = [facts.verdicts[b][1] for b in loses]
    return facts.recommendation(
        "exclude_route", f"exclude route {route!r} from speculation",
        {"kind": "exclude_route", "route": route}, _confidence(ests, cfg) if loses else "medium",
        {"latency_change": None if not loses else round(1 / (_mean_speedup(facts.cells, set(loses), cfg) or 1), 4),
         "share_of_route_traffic": round(_share(facts.cells, set(loses)), 4),
         "text": "the route's requests run on the plain engine"},
        {**facts.evidence, "acceptance": acceptance, "spec_reported": spec_all.spec_reported,
         "min_acceptance_rate": min_acc},
        f"Exclude route {route!r}: {why}.",
        "acceptance" if low_acceptance else facts.measure_of(loses))


# --- batch-size threshold -----------------------------------------------------------------------------

def _threshold_recommendation(kind: str, facts: _RouteFacts, current: int, new_max: int, affected: set[int],
                        ests: Sequence[RatioEstimate | None], cfg: RecommendConfig, message: str) -> Recommendation:
    """A new batch threshold for the route; the expected effect is measured on the buckets it moves."""
    sp = _mean_speedup(facts.cells, affected, cfg)
    verb = "lower" if kind == "lower_threshold" else "raise"
    return facts.recommendation(
        kind, f"{verb} route {facts.route!r}'s batch threshold to {new_max}",
        {"kind": "set_batch_max", "route": facts.route, "batch_max": new_max}, _confidence(ests, cfg),
        {"batch_max": {"from": current, "to": new_max},
         "latency_change_in_affected_buckets": None if sp is None else round(1 / sp, 4),
         "measure": facts.measure_of(sorted(affected)),
         "share_of_route_traffic": round(_share(facts.cells, affected), 4)},
        facts.evidence, message, facts.measure_of(sorted(affected)))


def _lower_threshold(facts: _RouteFacts, cfg: RecommendConfig) -> Recommendation | None:
    route, current, spec_now, verdicts = facts.route, facts.current, facts.spec_now, facts.verdicts
    if current is None or not facts.loses:
        return None
    first_loss = min((b for b in facts.loses if spec_now.get(b)), default=None)
    if first_loss is None:
        return None
    keep = [b for b in BATCH_BUCKETS if b < first_loss and spec_now.get(b)]
    if not keep:
        return None
    # Down to the largest bucket that still wins, not to the one just below the loss: a bucket
    # between them with no clear difference gives no reason to pay for drafting there, and
    # the loss above says which way it leans. Where nothing below the loss wins (thin or
    # unclear evidence), stop just below the loss and let more traffic decide the rest.
    winning = [b for b in keep if facts.verdict_of(b) == "wins"]
    new_max = bucket_upper(winning[-1] if winning else keep[-1])
    dropped = {b for b in BATCH_BUCKETS if bucket_upper(b) > new_max and spec_now.get(b)}
    unclear = sorted(b for b in dropped if b < first_loss and b in verdicts)
    ests = [verdicts[b][1] for b in facts.loses if b in dropped]
    loss = verdicts[first_loss][1]
    return _threshold_recommendation(
        "lower_threshold", facts, current, new_max, dropped, ests, cfg,
        f"Lower route {route!r}'s batch threshold from {current} to {new_max}: speculation is "
        f"slower with confidence from batch size {batch_bucket_label(first_loss)} "
        f"(plain/speculative {facts.label([first_loss])} {loss.ratio:.2f}, "  # type: ignore[union-attr]
        f"{cfg.confidence:.0%} interval {loss.low:.2f}-"  # type: ignore[union-attr]
        f"{loss.high:.2f})"  # type: ignore[union-attr]
        + ("" if not unclear else
           f"; in {', '.join(batch_bucket_label(b) for b in unclear)} it is not faster with "
           "confidence")
        + ".")


def _largest_win_below_any_loss(facts: _RouteFacts) -> int | None:
    target = None
    for lower in BATCH_BUCKETS:
        word = facts.verdict_of(lower)
        if word == "loses":
            break
        if word == "wins":
            target = lower
    return target


def _raise_threshold(facts: _RouteFacts, cfg: RecommendConfig) -> Recommendation | None:
    route, current, verdicts = facts.route, facts.current, facts.verdicts
    target = _largest_win_below_any_loss(facts)
    if target is None or current is None or bucket_upper(target) <= current:
        return None
    added = {b for b in BATCH_BUCKETS if b <= target and not facts.spec_now.get(b)}
    if not added or not all(facts.verdict_of(b) == "wins" for b in added):
        return None
    new_max = bucket_upper(target)
    ests = [verdicts[b][1] for b in added]
    return _threshold_recommendation(
        "raise_threshold", facts, current, new_max, added, ests, cfg,
        f"Raise route {route!r}'s batch threshold from {current} to {new_max}: speculation is "
        f"faster with confidence up to batch size {batch_bucket_label(target)} "
        f"(plain/speculative {facts.label(sorted(added))} "
        f"{', '.join(f'{verdicts[b][1].ratio:.2f}' for b in sorted(added))}).")  # type: ignore[union-attr]


# --- draft length -------------------------------------------------------------------------------------

def _change_k(facts: _RouteFacts, engines: Mapping[str, Engine], cfg: RecommendConfig) -> Recommendation | None:
    """Measured first (:func:`_measured_k`: engines with another K that ran the route); else the formula."""
    if facts.speculating:
        measured = _measured_k(facts, engines, cfg)
        if measured is not None:
            return measured
    route, spec_all = facts.route, facts.spec_all
    acceptance = spec_all.acceptance_rate
    main = facts.main_speculative_cell()
    if not facts.speculating or main is None or acceptance is None or spec_all.spec_reported < cfg.min_samples:
        return None
    k_now = main.k or 0
    ratio = cost_ratio_of(main.method, cfg)
    scores = {k: leviathan_speedup(acceptance, k, ratio) for k in range(1, cfg.max_k + 1)}
    best = max(scores, key=lambda k: scores[k])
    if best == k_now or not k_now or scores[best] < scores[k_now] * (1 + cfg.min_gain):
        return None
    configured = engines.get(main.engine or "")
    engine_max = engine_k(configured) if configured is not None else 0
    if best <= engine_max:
        edit: dict[str, Any] = {"kind": "set_k", "route": route, "k": best}
        where = f"on route {route!r}"
    else:  # a rule cannot draft more than its engine is configured for
        edit = {"kind": "set_engine_k", "route": route, "engine": main.engine, "k": best}
        where = f"on engine {main.engine!r} (every route it serves; the engine restarts)"
    return facts.recommendation(
        "change_k", f"draft {best} tokens instead of {k_now} {where}", edit, "low",
        {"theoretical_speedup": {"from": round(scores[k_now], 4), "to": round(scores[best], 4)},
         "text": "from the Leviathan formula with the measured acceptance; not yet measured"},
        {**facts.evidence, "acceptance": acceptance, "spec_reported": spec_all.spec_reported,
         "cost_ratio": ratio, "method": main.method},
        f"Change k {where} from {k_now} to {best}: with measured acceptance "
        f"{acceptance:.3f} the expected speedup moves from {scores[k_now]:.2f} to {scores[best]:.2f}.",
        "leviathan")


# --- engines measured side by side -------------------------------------------------------------------

@dataclass(slots=True)
class _EngineEvidence:
    """The route's speculative engines measured on one measure: the first of cfg.measures with min_samples
    requests on two engines."""

    metric: str
    moments: dict[str, Any]
    cohorts: dict[str, Cohort]

    def table(self) -> dict[str, Any]:
        return {n: {"requests": c.requests, "e2e_p50": c.quantile("e2e", .5), "itl_p50": c.quantile("itl", .5),
                    "acceptance_rate": c.acceptance_rate, "client_disconnects": c.client_disconnects,
                    "client_disconnect_rate": c.client_disconnect_rate} for n, c in sorted(self.cohorts.items())}


def _engine_evidence(facts: _RouteFacts, cfg: RecommendConfig) -> _EngineEvidence | None:
    cohorts: dict[str, Cohort] = defaultdict(Cohort)
    for cell in facts.cells:
        for name, cohort in cell.engines.items():
            cohorts[name].add(cohort)
    for metric in cfg.measures:
        counted = {n: c for n, c in cohorts.items()
                   if (c.itl_count if metric == "itl" else c.requests) >= cfg.min_samples}
        usable = {n: m for n, c in counted.items() if (m := c.moments(metric)) is not None}
        if len(usable) >= 2:
            return _EngineEvidence(metric, usable, dict(cohorts))
    return None


def _faster(facts: _RouteFacts, evidence: _EngineEvidence, others: Sequence[str],
            cfg: RecommendConfig) -> tuple[str, str, RatioEstimate] | None:
    """(current engine, the first of ``others`` faster than it with confidence, current/other)."""
    main = facts.main_speculative_cell()
    current = main.engine if main is not None else None
    if current is None or current not in evidence.moments:
        return None
    for other in sorted(others):
        if other == current or other not in evidence.moments:
            continue
        est = welch_ratio(evidence.moments[current], evidence.moments[other], cfg.confidence)
        if est.above_one and not more_disconnects(evidence.cohorts[other], evidence.cohorts[current],
                                                  cfg.confidence):
            return current, other, est
    return None


def _method_of(engine: Engine | None) -> str:
    return "none" if engine is None or isinstance(engine, PlainEngine) else engine.method


def _measured_k(facts: _RouteFacts, engines: Mapping[str, Engine], cfg: RecommendConfig) -> Recommendation | None:
    """Another engine of the same method, configured with another K, measured faster on this route."""
    evidence = _engine_evidence(facts, cfg)
    main = facts.main_speculative_cell()
    if evidence is None or main is None or main.engine is None or main.engine not in engines:
        return None
    method, k_now = _method_of(engines[main.engine]), engine_k(engines[main.engine])
    siblings = [n for n in evidence.moments if n in engines and _method_of(engines[n]) == method
                and engine_k(engines[n]) != k_now]
    found = _faster(facts, evidence, siblings, cfg)
    if found is None:
        return None
    current, other, est = found
    k_new = engine_k(engines[other])
    label = MEASURE_LABELS.get(evidence.metric, evidence.metric)
    return facts.recommendation(
        "change_k", f"draft {k_new} tokens instead of {k_now} on route {facts.route!r} (engine {other!r})",
        {"kind": "set_engine", "route": facts.route, "engine": other}, _confidence([est], cfg),
        {"measured_speedup": _ratio_dict(est), "k": {"from": k_now, "to": k_new}, "measure": evidence.metric,
         "text": f"measured: the route's requests on both engines, {label}"},
        {**facts.evidence, "engines": evidence.table()},
        f"Draft {k_new} tokens instead of {k_now} on route {facts.route!r}: on engine {other!r} ({method}, K "
        f"{k_new}) its {label} is lower than on {current!r} (K {k_now}) by a factor {est.ratio:.2f} "
        f"({cfg.confidence:.0%} interval {est.low:.2f}-{est.high:.2f}).", evidence.metric)


# --- method -------------------------------------------------------------------------------------------

def _switch_method(facts: _RouteFacts, engines: Mapping[str, Engine], cfg: RecommendConfig) -> Recommendation | None:
    """Another speculative method measured faster on this route (an engine of the same method with another K
    is a draft-length change, :func:`_measured_k`)."""
    route = facts.route
    evidence = _engine_evidence(facts, cfg)
    main = facts.main_speculative_cell()
    if not facts.speculating or evidence is None or main is None:
        return None
    method = _method_of(engines.get(main.engine or ""))
    others = [n for n in evidence.moments if _method_of(engines.get(n)) != method or n not in engines]
    found = _faster(facts, evidence, others, cfg)
    if found is None:
        return None
    current_engine, other, est = found
    label = MEASURE_LABELS.get(evidence.metric, evidence.metric)
    return facts.recommendation(
        "switch_method", f"switch route {route!r} to engine {other!r}",
        {"kind": "set_engine", "route": route, "engine": other}, _confidence([est], cfg),
        {"ratio_current_over_new": _ratio_dict(est), "measure": evidence.metric},
        {**facts.evidence, "engines": evidence.table()},
        f"Switch route {route!r} from {current_engine!r} to {other!r}: its {label} is lower by a "
        f"factor {est.ratio:.2f} ({cfg.confidence:.0%} interval {est.low:.2f}-{est.high:.2f}).",
        evidence.metric)


# --- quality risk -------------------------------------------------------------------------------------

def _quality_risk(facts: _RouteFacts, cfg: RecommendConfig) -> Recommendation | None:
    route, spec_all = facts.route, facts.spec_all
    plain_all = Cohort()
    for c in facts.cells:
        plain_all.add(c.plain)
    retry = _rate_difference(spec_all.retries + spec_all.fallbacks, spec_all.requests,
                             plain_all.retries + plain_all.fallbacks, plain_all.requests, cfg.confidence)
    validity = _validity_drop(spec_all, plain_all, cfg.confidence)
    risks = []
    if retry is not None and retry[1] > 0 and min(spec_all.requests, plain_all.requests) >= cfg.min_samples:
        risks.append(f"retries and fallbacks per request are {retry[0]:+.3f} higher on the speculative path")
    if validity is not None and validity[1] > 0 and min(spec_all.structured_checked,
                                                      plain_all.structured_checked) >= cfg.min_samples:
        risks.append(f"structured-output validity is {validity[0]:.3f} lower on the speculative path")
    if not risks:
        return None
    return facts.recommendation(
        "quality_risk", f"quality risk on route {route!r}", None, "medium",
        {"text": "speculation may trade quality for latency here; investigate before widening it"},
        {"retry_rate": {"speculative": spec_all.retry_rate, "plain": plain_all.retry_rate,
                        "difference": None if retry is None else round(retry[0], 4)},
         "fallback_rate": {"speculative": spec_all.fallback_rate, "plain": plain_all.fallback_rate},
         "structured_validity": {"speculative": spec_all.structured_validity,
                                 "plain": plain_all.structured_validity},
         "requests": {"speculative": spec_all.requests, "plain": plain_all.requests}},
        f"Quality risk on route {route!r}: {'; '.join(risks)}.", "quality")


def engine_facts(document: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """``{engine: (method, k)}`` of a policy's normal form."""
    doc = validate_data(document)
    return {name: ("none" if isinstance(e, PlainEngine) else e.method, engine_k(e)) for name, e in doc.engines.items()}
