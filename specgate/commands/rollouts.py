"""``specgate rollout ...``: roll a revision out step by step, pause, resume, abort, follow it."""

from __future__ import annotations

from typing import Annotated

import typer

from apiclient import calls
from specgate.commands.rest import DEFAULT_URL, JsonOpt, KeyOpt, UrlOpt, control_plane, fail, show

rollout_app = typer.Typer(help="Roll a revision out step by step.", no_args_is_help=True)


@rollout_app.command("start")
def rollout_start(policy: str, revision: str,
                  reason: Annotated[str, typer.Option(help="why (the API requires one)")],
                  steps: Annotated[str, typer.Option(help="percents, e.g. 10,50,100")] = "10,50,100",
                  mode: Annotated[str, typer.Option(help="workers or traffic")] = "traffic",
                  pool: Annotated[str | None, typer.Option()] = None,
                  label: Annotated[list[str] | None, typer.Option(help="k=v, repeatable")] = None,
                  as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Start rolling REVISION of POLICY out."""
    try:
        percents = [float(s) for s in steps.split(",") if s.strip()]
    except ValueError:
        fail(f"--steps must be comma-separated numbers, got {steps!r}", 2)
    labels: dict[str, str] = {}
    for item in label or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            fail(f"--label must be k=v, got {item!r}", 2)
        labels[k] = v
    with control_plane(url, key) as api:
        show(api.send(calls.start_rollout(policy=policy, revision=revision, mode=mode, steps=percents,
                                          reason=reason, pool=pool, labels=labels)).json, as_json)


def _transition(action: str, rollout_id: str, reason: str, url: str, key: str, as_json: bool) -> None:
    with control_plane(url, key) as api:
        show(api.send(calls.rollout_action(rollout_id, action, reason=reason)).json, as_json)


@rollout_app.command("promote")
def rollout_promote(rollout_id: str, reason: Annotated[str, typer.Option()] = "",
                    expected_step: Annotated[int | None, typer.Option(
                        "--expected-step", min=0,
                        help="the step you are promoting from (current_step, as `rollout status` showed it); "
                             "default: the step read just before")] = None,
                    as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Move a rollout to its next step (or complete it); refused if it is no longer at the expected step."""
    with control_plane(url, key) as api:
        if expected_step is None:
            # Even without a step from the operator, promote only the step just read: two promotes run at
            # once then move the rollout by one step, not two.
            seen = api.send(calls.rollout(rollout_id)).data
            expected_step = seen.current_step
            typer.echo(f"promoting from step {seen.current_step} ({seen.current_percent:g}%)", err=True)
        show(api.send(calls.rollout_action(rollout_id, "promote", reason=reason,
                                           expected_step=expected_step)).json, as_json)


@rollout_app.command("pause")
def rollout_pause(rollout_id: str, reason: Annotated[str, typer.Option()] = "", as_json: JsonOpt = False,
                  url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Hold a rollout at its current step."""
    _transition("pause", rollout_id, reason, url, key, as_json)


@rollout_app.command("resume")
def rollout_resume(rollout_id: str, reason: Annotated[str, typer.Option()] = "", as_json: JsonOpt = False,
                   url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Resume a paused rollout."""
    _transition("resume", rollout_id, reason, url, key, as_json)


@rollout_app.command("abort")
def rollout_abort(rollout_id: str, reason: Annotated[str, typer.Option()], as_json: JsonOpt = False,
                  url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Stop a rollout; the policy stays on its active revision."""
    _transition("abort", rollout_id, reason, url, key, as_json)


@rollout_app.command("status")
def rollout_status(rollout_id: Annotated[str | None, typer.Argument()] = None,
                   policy: Annotated[str | None, typer.Option()] = None, as_json: JsonOpt = False,
                   url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Show one rollout, or the rollouts of a policy (newest first)."""
    with control_plane(url, key) as api:
        if rollout_id:
            show(api.send(calls.rollout(rollout_id)).json, as_json)
        else:
            show(api.send(calls.rollouts(policy=policy or None)).json, as_json)
