"""Does the recommender find, from telemetry alone, where speculation stops paying on the real engines?

Two measurements of the same testbed (tiny trained models on vLLM's CPU build) meet here:

* the ground truth: an HTTP sweep (``specgate testbed sweep``), which ran each engine variant alone at
  concurrency 1, 2, 4, 8 and 16 and measured the server-side inter-token latency (ITL) of every
  route; speculation *pays* in a cell when the plain engine's ITL over the speculative one's is >= 1;
* the evidence: telemetry from ``specgate loadgen`` through a real sidecar and control plane with
  :data:`CHECK_POLICY`, which speculates on every route at every batch size with the method under test
  and explores half of the time on the plain engine, in 3-second windows (a switchback). The
  recommender sees nothing but those per-bucket statistics (``GET /v1/analysis/cells``).

Concurrency ``c`` in the sweep and batch-size bucket ``batch_bucket(c)`` in the telemetry are the same
scale: 1, 2, 4, 8 and 16 fall into the buckets 1, 2, 3-4, 5-8 and 9-16.

:func:`ground_truth` turns the sweep into what a recommendation must say per route: ``exclude`` when
speculation paid at no level; otherwise the range of buckets a threshold may end in, from the last
bucket of the unbroken paying run from the smallest load to the largest bucket that paid (a clean
crossover makes that one bucket), widened by one bucket on each side (the tolerance of the issue).
:func:`outcome` applies the recommendations to :data:`CHECK_POLICY` and
reads where each route ends up; :func:`compare` puts the two side by side.

``specgate testbed recommend-check`` runs the comparison on the recorded files (the test suite does the
same, ``tests/testbed/test_recommend_check.py``); ``--live`` first records new telemetry: it starts the
engines, a control plane on a fresh SQLite database, a sidecar and the load generator, then exports the
cells (:func:`record_live`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.buckets import BATCH_BUCKETS, batch_bucket, batch_bucket_label
from analysis.cells import Cell
from analysis.recommend import Recommendation, RecommendConfig, cell_report, recommend
from policies import canonical_document, load_policy, revision_id

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results-testbed"
SWEEP_FILE = RESULTS / "crossover" / "sweep.json"
CELLS_FILE = RESULTS / "recommend-check-cells.json"
REPORT_FILE = RESULTS / "recommend-check.md"

# Every route speculates at every batch size, each with the method whose crossover the check looks for,
# and the worker switches between that method and the plain engine in 3-second windows (exploration by
# time window, a switchback, at rate 0.5): per bucket, a speculative and a plain cohort of about the same
# size, each measured with its engine carrying the whole load, as in the sweep. A per-request split
# (exploration without window_s) runs both engines at once on the same two cores, and then each one's
# latency depends on the other's load more than on speculation (BENCHMARKS.md, "The recommender against
# the sweep"). No acceptance guardrail: an admin's acceptance floor would exclude a route whatever its
# speed, and the check is about speed. The methods are chosen from the sweep of the recorded models
# (fingerprint in both recordings) so that the check meets a crossover (extract, draft model: pays at
# 1-4, loses from 8), a route where speculation pays at every load and must keep it (chat, n-gram) and two
# where it never pays (classify and creative, draft model). A first sweep of these models, whose client
# could not hold the concurrency (BENCHMARKS.md, "HTTP again"), had chat's n-gram crossing between 8 and
# 16 and extract's draft model between 2 and 4; no other method of the second sweep crosses cleanly.
CHECK_POLICY = """\
apiVersion: specgate/v1
name: recommend-check
description: Speculates everywhere and explores half of the time on the plain engine, in windows of
  3 s, so that the recommender has a speculative and a plain cohort in every batch-size bucket.
engines:
  base:
    method: none
  ngram:
    method: ngram
    num_speculative_tokens: 4
    prompt_lookup_min: 1
    prompt_lookup_max: 3
  draft:
    method: draft_model
    model: testbed/draft
    num_speculative_tokens: 3
rules:
  - name: chat-ngram
    when: {route: [chat]}
    then: {engine: ngram}
  - name: others-draft
    when: {route: [extract, classify, creative]}
    then: {engine: draft}
default: {engine: base}
exploration:
  rate: 0.5
  speculative_engine: draft
  window_s: 3
guardrails:
  min_samples: 100
"""

# The traffic of a live recording: one route at a time, each through the sweep's concurrency levels;
# plain JSON answers (structured output never speculates), greedy like the sweep (vLLM's CPU build
# accepts no draft token when it samples). One route at a time because a bucket counts the worker's
# requests in flight, and an engine should run all of them, as in the sweep: with every route at once (a
# first recording) the n-gram engine held a quarter of a bucket's requests, two buckets below the sweep's
# scale. About 15 minutes, some 100 to 400 requests per cohort and bucket.
LIVE_ROUTES = ("extract", "classify", "chat", "creative")
LIVE_SCHEDULE = "1:60s,2:45s,4:40s,8:35s,16:30s"
LIVE_MAX_TOKENS = 32
POOL = "testbed"


def check_policy() -> dict[str, Any]:
    """The normal form of :data:`CHECK_POLICY`."""
    return canonical_document(load_policy(CHECK_POLICY))


def route_engines(document: Mapping[str, Any]) -> dict[str, str]:
    """route -> the engine its first rule names (the check policy has one rule per route set)."""
    out: dict[str, str] = {}
    for rule in document.get("rules") or []:
        for route in (rule.get("when") or {}).get("route") or []:
            out.setdefault(route, rule["then"]["engine"])
    return out


# --- the ground truth -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Truth:
    """What the sweep measured for one route and the method the check policy gives it."""

    route: str
    variant: str
    speedups: dict[int, float]  # concurrency -> base ITL / variant ITL
    expect: str  # "exclude" or "threshold"
    allowed: tuple[int, ...]  # bucket lower bounds a threshold may end in (empty for "exclude")
    unbounded_ok: bool  # speculation paid at the top load: keeping no limit agrees too
    shape: str  # "pays everywhere", "never pays", "clean crossover", "no clean crossover"

    def describe(self) -> str:
        loads = ", ".join(f"{c}: {s:.2f}" for c, s in sorted(self.speedups.items()))
        return f"{self.variant} ITL speedup by load {{{loads}}} ({self.shape})"


def _sweep_itl(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, int], float]:
    out = {}
    for row in rows:
        itl = row.get("mean_itl_ms")
        if itl and not row.get("errors"):
            out[(row["variant"], row["route"], int(row["concurrency"]))] = float(itl)
    return out


def ground_truth(sweep: Mapping[str, Any], engines_by_route: Mapping[str, str]) -> dict[str, Truth]:
    """Per route: what the sweep says a recommendation should do for the route's speculative engine."""
    itl = _sweep_itl(sweep["http"])
    loads = sorted({c for (_, _, c) in itl})
    order = list(BATCH_BUCKETS)
    out = {}
    for route, variant in sorted(engines_by_route.items()):
        speedups = {c: itl[("base", route, c)] / itl[(variant, route, c)]
                    for c in loads if ("base", route, c) in itl and (variant, route, c) in itl}
        if not speedups:
            raise ValueError(f"the sweep has no cells for route {route!r} on base and {variant!r}")
        pays = {batch_bucket(c): s >= 1.0 for c, s in speedups.items()}
        measured = sorted(pays)
        paying = [b for b in measured if pays[b]]
        if not paying:
            out[route] = Truth(route, variant, speedups, "exclude", (), False, "never pays")
            continue
        run_end = None  # the last bucket of the unbroken paying run from the smallest load
        for b in measured:
            if not pays[b]:
                break
            run_end = b
        last_pay = paying[-1]
        low = order.index(run_end) if run_end is not None else order.index(measured[0])
        high = order.index(last_pay)
        allowed = tuple(order[max(low - 1, 0):min(high + 1, len(order) - 1) + 1])
        if all(pays.values()):
            shape = "pays everywhere"
        elif run_end == last_pay:
            shape = "clean crossover"
        else:
            shape = "no clean crossover"
        out[route] = Truth(route, variant, speedups, "threshold", allowed, pays[measured[-1]], shape)
    return out


# --- what the recommender makes of the telemetry ------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Outcome:
    """Where a route ends up once the recommendations are applied to the check policy."""

    route: str
    action: str  # "exclude", "threshold" (a set_batch_max) or "unchanged" (speculates at every size)
    batch_max: int | None
    bucket: int | None  # the bucket the threshold ends in
    recommendations: tuple[str, ...]  # every recommendation's kind for the route, for the report


def outcome(recommendations: Sequence[Recommendation], routes: Sequence[str]) -> dict[str, Outcome]:
    out = {}
    for route in routes:
        mine = [r for r in recommendations if r.route == route]
        kinds = tuple(r.kind for r in mine)
        exclude = next((r for r in mine if r.kind == "exclude_route"), None)
        threshold = next((r for r in mine if r.edit and r.edit.get("kind") == "set_batch_max"), None)
        if exclude is not None:
            out[route] = Outcome(route, "exclude", None, None, kinds)
        elif threshold is not None:
            batch_max = int(threshold.edit["batch_max"])  # type: ignore[index]
            out[route] = Outcome(route, "threshold", batch_max, batch_bucket(batch_max), kinds)
        else:
            out[route] = Outcome(route, "unchanged", None, None, kinds)
    return out


@dataclass(frozen=True, slots=True)
class RouteVerdict:
    route: str
    agrees: bool
    expected: str
    got: str
    truth: str


def _buckets_text(buckets: Sequence[int]) -> str:
    return ", ".join(batch_bucket_label(b) for b in buckets)


def compare(truth: Mapping[str, Truth], got: Mapping[str, Outcome]) -> list[RouteVerdict]:
    verdicts = []
    for route, t in sorted(truth.items()):
        o = got[route]
        if t.expect == "exclude":
            expected = "exclude the route"
            agrees = o.action == "exclude"
        else:
            expected = (f"a threshold ending in bucket {_buckets_text(t.allowed)}"
                        + (" (or no limit)" if t.unbounded_ok else ""))
            if o.action == "threshold":
                agrees = o.bucket in t.allowed
            elif o.action == "unchanged":
                agrees = t.unbounded_ok
            else:
                agrees = False
        if o.action == "exclude":
            got_text = "exclude the route"
        elif o.action == "threshold":
            assert o.bucket is not None
            got_text = f"batch_max {o.batch_max} (bucket {batch_bucket_label(o.bucket)})"
        else:
            got_text = "no threshold change (speculate at every measured size)"
        verdicts.append(RouteVerdict(route, agrees, expected, got_text, t.describe()))
    return verdicts


@dataclass(frozen=True, slots=True)
class CheckResult:
    verdicts: list[RouteVerdict]
    recommendations: list[Recommendation]
    cells: list[Cell]
    config: RecommendConfig

    @property
    def passed(self) -> bool:
        return all(v.agrees for v in self.verdicts)


def same_models(sweep: Mapping[str, Any], cells_export: Mapping[str, Any]) -> None:
    """Refuse to judge telemetry of one model pair against a sweep of another.

    Both recordings carry the fingerprint of the weights they were made with. The recipe alone does not
    fix the weights: trained on another CPU the same recipe gives other models (a pair trained on an AMD
    machine and one trained on an Intel machine differed in n-gram acceptance on ``creative``, 0.25 and
    0.80), so the crossovers of one say nothing about the other.
    """
    sweep_models, cells_models = sweep.get("models"), cells_export.get("models")
    if sweep_models is None or cells_models is None:
        missing = "the sweep" if sweep_models is None else "the telemetry"
        raise ValueError(f"{missing} does not say which models it was measured with ('models' fingerprint); "
                         "record it again")
    if sweep_models != cells_models:
        raise ValueError(f"the sweep was measured with models {sweep_models}, the telemetry with {cells_models}: "
                         "run the sweep on this machine's models first (specgate testbed sweep --no-offline "
                         "--per-cell 100 --out bench/results-testbed/crossover)")


def run_check(sweep: Mapping[str, Any], cells_export: Mapping[str, Any],
              config: RecommendConfig | None = None) -> CheckResult:
    """The recommender on recorded cells for :data:`CHECK_POLICY`, against the sweep's ground truth."""
    config = config or RecommendConfig()
    same_models(sweep, cells_export)
    document = check_policy()
    cells = [Cell.from_dict(item) for item in cells_export["cells"]]
    recs = recommend(document, revision_id(load_policy(CHECK_POLICY)), cells, config)
    by_route = route_engines(document)
    truth = ground_truth(sweep, by_route)
    return CheckResult(compare(truth, outcome(recs, sorted(by_route))), recs, cells, config)


def report(result: CheckResult, *, sweep_path: Path, cells_path: Path, meta: Mapping[str, Any]) -> str:
    """The markdown report: per route the truth, the recommendation, the agreement and the evidence."""
    lines = ["# Recommender against the sweep", "",
             f"Ground truth: `{_rel(sweep_path)}` (HTTP sweep, each variant alone). Evidence: `{_rel(cells_path)}` "
             f"(telemetry through the sidecar; recorded {meta.get('recorded_at', '?')}, "
             f"{meta.get('requests', '?')} requests, one route at a time, schedule "
             f"`{meta.get('schedule', '?')}` each). Models (sha256 of the weights): "
             f"{', '.join(f'{k} `{v}`' for k, v in (meta.get('models') or {}).items()) or '?'}. "
             f"Recommender: confidence {result.config.confidence}, min_samples {result.config.min_samples} "
             "per cohort.", "",
             "| route | sweep | expected | recommended | agrees |", "|---|---|---|---|---|"]
    for v in result.verdicts:
        lines.append(f"| {v.route} | {v.truth} | {v.expected} | {v.got} | {'yes' if v.agrees else '**no**'} |")
    lines += ["", f"Result: {'PASS' if result.passed else 'FAIL'} "
                  f"({sum(v.agrees for v in result.verdicts)} of {len(result.verdicts)} routes agree).", "",
              "## Evidence per bucket (plain / speculative ITL; > 1: speculation is faster)", "",
              "| route | bucket | engine | n plain | n spec | ITL ratio | 95% interval | verdict | acceptance |",
              "|---|---|---|---:|---:|---:|---|---|---:|"]
    for cell in sorted(result.cells, key=lambda c: (c.route, c.batch_bucket)):
        row = cell_report(cell, result.config)
        itl = row["itl_speedup"] or {}
        acc = row["acceptance_rate"]
        lines.append(
            f"| {row['route']} | {row['batch_range']} | {row['engine'] or '-'} | {row['n_plain']} | "
            f"{row['n_speculative']} | {itl.get('ratio', '-')} | "
            f"{itl.get('low', '-')}-{itl.get('high', '-')} | {row['verdict']} | "
            f"{'-' if acc is None else f'{acc:.3f}'} |")
    lines += ["", "## Recommendations", ""]
    for rec in result.recommendations:
        lines.append(f"- **{rec.kind}** ({rec.confidence}): {rec.message}")
    if not result.recommendations:
        lines.append("- none")
    return "\n".join(lines) + "\n"


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def load_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
