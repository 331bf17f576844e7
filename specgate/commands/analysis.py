"""``specgate analysis ...`` and ``specgate recommend ...``: the analysis API from the command line.

Everything talks to a running control plane over REST, except
``specgate recommend offline``, which runs the recommender on a file of
recorded per-bucket statistics (``specgate analysis cells --out``) and a
policy document, with no control plane at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from apiclient import calls
from apiclient.models import Basis, Recommendation, ShadowSummary, WorkerSummary
from specgate.commands.rest import DEFAULT_URL, JsonOpt, KeyOpt, UrlOpt, control_plane, fail, show

analysis_app = typer.Typer(help="Telemetry analysis: summaries, speedups, before/after, what-if, guardrails.",
                           no_args_is_help=True)
recommend_app = typer.Typer(help="Recommended rule edits, with evidence; apply one as a draft revision.",
                            no_args_is_help=True)

FromOpt = Annotated[str | None, typer.Option("--from", help="window start, ISO 8601 (UTC if no zone)")]
ToOpt = Annotated[str | None, typer.Option("--to", help="window end, exclusive")]
PolicyOpt = Annotated[str, typer.Option("--policy", help="the policy's name")]


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _count(value: int | float) -> str:
    """A request count; an estimate from sampled events (a float) is printed whole, with a ~."""
    return str(value) if isinstance(value, int) else f"~{value:.0f}"


def _note(basis: Basis | None) -> None:
    """Where the figures rest on sampled events, say so after them; nothing otherwise."""
    note = None if basis is None else basis.note()
    if note is not None:
        typer.echo(note)


def _raw_rows(rows: list[WorkerSummary], label: Callable[[dict[str, Any]], str]) -> None:
    for w in rows:
        typer.echo(f"{label(w.key):<24} n={_count(w.requests):<8} acc={_fmt(w.acceptance_rate)} "
                   f"itl_mean={_fmt(w.itl_ms_mean)}ms err={_fmt(w.error_rate)}")


@analysis_app.command("summary")
def summary(policy: Annotated[str | None, typer.Option()] = None, route: Annotated[str | None, typer.Option()] = None,
            group_by: Annotated[str, typer.Option(help="comma-separated: route, engine, batch_bucket, revision, "
                                                       "policy, explored; or worker, or replica (from the raw "
                                                       "events)")] = "route,engine,batch_bucket",
            window: Annotated[str | None, typer.Option(help="minute, hour or day")] = None,
            start: FromOpt = None, end: ToOpt = None, as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL,
            key: KeyOpt = "") -> None:
    """Requests, acceptance, p50/p95 latencies and rates per group (from the rollups; per worker or replica from
    the raw events, with a note where those are estimates from sampled events)."""
    with control_plane(url, key) as api:
        reply = api.send(calls.summary(group_by=group_by, policy=policy, route=route, window=window, since=start,
                                       until=end))
    if as_json:
        show(reply.json, True)
        return
    if reply.data.workers is not None:
        _raw_rows(reply.data.workers, lambda key: key["worker_id"])
        _note(reply.data.basis)
        return
    if reply.data.replicas is not None:
        _raw_rows(reply.data.replicas, lambda key: f"{key['engine']}/{key['replica'] or '-'}")
        _note(reply.data.basis)
        return
    for row in reply.data.rows:
        group = " ".join(f"{k}={v}" for k, v in row.key.items() if k != "batch_bucket")
        typer.echo(f"{group:<48} n={row.requests:<8} acc={_fmt(row.acceptance_rate)} "
                   f"itl p50/p95={_fmt(row.itl_ms.p50)}/{_fmt(row.itl_ms.p95)}ms "
                   f"e2e p95={_fmt(row.e2e_ms.p95)}ms retries={_fmt(row.retry_rate)} "
                   f"err={_fmt(row.error_rate)}{_shadow(row.shadow)}")


def _shadow(shadow: ShadowSummary | None) -> str:
    """A summary row's shadow comparisons, after its figures; nothing when none was made."""
    if shadow is None:
        return ""
    low, high = shadow.match_interval
    out = (f" shadow {shadow.matched}/{shadow.compared} matched {shadow.match_rate:.1%} [{low:.1%}, {high:.1%}] "
           f"first_diff={_fmt(shadow.first_diff_mean)}")
    if shadow.structured_checked:
        out += (f" structured valid served/plain={_fmt(shadow.structured_valid_served)}/"
                f"{_fmt(shadow.structured_valid_plain)} of {shadow.structured_checked}")
    if shadow.check_run:
        out += f" check failed {shadow.check_failed}/{shadow.check_run}"
    return out


@analysis_app.command("speedups")
def speedups(policy: PolicyOpt, route: Annotated[str | None, typer.Option()] = None,
             rollout: Annotated[str | None, typer.Option(help="compare this rollout's two cohorts")] = None,
             start: FromOpt = None, end: ToOpt = None, as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL,
             key: KeyOpt = "") -> None:
    """Speculative vs plain per route and batch bucket, with intervals and sample sizes."""
    with control_plane(url, key) as api:
        reply = api.send(calls.speedups(policy, route=route, rollout=rollout, since=start, until=end))
    if as_json:
        show(reply.json, True)
        return
    for row in reply.data.rows:
        # The interval the verdict read: end-to-end latency (what clients feel) where measured, else ITL.
        est = row.e2e_speedup if row.measure == "e2e" else row.itl_speedup
        ci = f"{est.ratio:.2f} [{est.low:.2f}, {est.high:.2f}]" if est else "-"
        theory = row.theory.speedup if row.theory else None
        k0 = ""
        if row.k0 is not None:
            tax = row.k0.tax
            k0 = (f" K=0 n={row.k0.requests} tax "
                  f"{'-' if tax is None else f'{tax.ratio:.2f} [{tax.low:.2f}, {tax.high:.2f}]'}")
        typer.echo(f"{row.route:<16} batch {row.batch_range:<6} {row.measure} speedup {ci:<22} "
                   f"n={row.n_speculative}/{row.n_plain:<6} theory={_fmt(theory)} {row.verdict} "
                   f"({row.source}){k0}")


@analysis_app.command("before-after")
def before_after(rollout: Annotated[str | None, typer.Option()] = None,
                 policy: Annotated[str | None, typer.Option()] = None,
                 from_revision: Annotated[str | None, typer.Option()] = None,
                 to_revision: Annotated[str | None, typer.Option()] = None,
                 start: FromOpt = None, end: ToOpt = None, as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL,
                 key: KeyOpt = "") -> None:
    """p50/p95, retries and acceptance per route for a rollout (or two revisions over a window)."""
    with control_plane(url, key) as api:
        show(api.send(calls.before_after(rollout=rollout, policy=policy, from_revision=from_revision,
                                         to_revision=to_revision, since=start, until=end)).json, as_json)


@analysis_app.command("what-if")
def what_if(policy: PolicyOpt,
            revision: Annotated[str | None, typer.Option(help="a stored revision to score")] = None,
            file: Annotated[Path | None, typer.Option("-f", "--file", help="or a candidate document")] = None,
            start: FromOpt = None, end: ToOpt = None, as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL,
            key: KeyOpt = "") -> None:
    """Score a candidate on the recorded window before it ships."""
    import yaml

    document: Any = None
    if file is not None:
        try:
            document = yaml.safe_load(file.read_text())
        except (OSError, yaml.YAMLError) as exc:
            fail(f"cannot read {file}: {exc}", 2)
    with control_plane(url, key) as api:
        reply = api.send(calls.what_if(policy, revision=revision, document=document, since=start, until=end))
    show(reply.json, as_json)
    if not as_json:
        _note(reply.data.basis)


@analysis_app.command("cells")
def cells(policy: PolicyOpt, out: Annotated[Path | None, typer.Option(help="write them to this file")] = None,
          start: FromOpt = None, end: ToOpt = None, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """The per-bucket statistics the recommender reads (for `specgate recommend offline`)."""
    with control_plane(url, key) as api:
        reply = api.send(calls.cells(policy, since=start, until=end))
    text = json.dumps(reply.json, indent=1)
    if out is None:
        typer.echo(text)
    else:
        out.write_text(text + "\n")
        typer.echo(f"{len(reply.data.cells)} cells written to {out}")


@analysis_app.command("guardrails")
def guardrails(rollout_id: str, evaluate: Annotated[bool, typer.Option(help="evaluate the current step now")] = False,
               as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """A rollout's guardrail evaluations (newest first), or a new one with --evaluate."""
    with control_plane(url, key) as api:
        if evaluate:
            show(api.send(calls.evaluate_guardrails(rollout_id)).json, as_json)
            return
        show(api.send(calls.guardrails(rollout_id)).json, as_json)


def _print_recommendations(recs: list[Recommendation]) -> None:
    if not recs:
        typer.echo("no recommendations: nothing holds with confidence on this window")
    for rec in recs:
        mark = "" if rec.applicable else "  (not applicable" + (
            f": {rec.problems[0]['message']})" if rec.problems else ")")
        typer.echo(f"[{rec.confidence}] {rec.id}  {rec.title}{mark}\n    {rec.message}")


@recommend_app.command("list")
def recommend_list(policy: PolicyOpt, start: FromOpt = None, end: ToOpt = None, as_json: JsonOpt = False,
                   url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Recommended rule edits for the policy's active revision."""
    with control_plane(url, key) as api:
        reply = api.send(calls.recommendations(policy, since=start, until=end))
    if as_json:
        show(reply.json, True)
    else:
        listing = reply.data
        typer.echo(f"for the active revision {listing.revision} of {listing.policy}; head {listing.head} "
                   f"(apply with --head {listing.head})")
        _print_recommendations(listing.recommendations)


@recommend_app.command("apply")
def recommend_apply(recommendation_id: str, policy: PolicyOpt, start: FromOpt = None, end: ToOpt = None,
                    head: Annotated[str | None, typer.Option(
                        help="the head `recommend list` showed: the draft builds on it, and a revision saved "
                             "since is refused; default: the revision the recommendation was computed on")] = None,
                    as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Create a draft revision with a recommendation's edit (same policy and window as the listing)."""
    with control_plane(url, key) as api:
        reply = api.send(calls.apply_recommendation(recommendation_id, policy, since=start, until=end,
                                                    head=head))
    if as_json:
        show(reply.json, True)
    else:
        applied = reply.data
        typer.echo(f"draft revision {applied.revision} (seq {applied.seq}): {applied.message}")


@recommend_app.command("offline")
def recommend_offline(cells_file: Annotated[Path, typer.Option("--cells", help="JSON from `analysis cells`")],
                      policy_file: Annotated[Path, typer.Option("--policy-file", help="the policy (YAML/JSON)")],
                      min_samples: Annotated[int, typer.Option(min=2)] = 100,
                      confidence: Annotated[float, typer.Option(min=0.5, max=0.999)] = 0.95,
                      as_json: JsonOpt = False) -> None:
    """Run the recommender on recorded per-bucket statistics, without a control plane."""
    from analysis.cells import Cell
    from analysis.recommend import RecommendConfig, recommend
    from policies import PolicyError, canonical_document, load_policy, revision_id

    try:
        raw = json.loads(cells_file.read_text())
        items = raw["cells"] if isinstance(raw, dict) else raw
        cell_list = [Cell.from_dict(item) for item in items]
        doc = load_policy(policy_file.read_text())
    except (OSError, ValueError, KeyError, TypeError, PolicyError) as exc:
        fail(f"cannot read the input: {exc}", 2)
    recs = recommend(canonical_document(doc), revision_id(doc), cell_list,
                     RecommendConfig(confidence=confidence, min_samples=min_samples))
    data = [r.to_dict() for r in recs]
    if as_json:
        show(data, True)
    else:
        _print_recommendations([Recommendation.model_validate(item) for item in data])
