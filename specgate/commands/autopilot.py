"""``specgate autopilot enable|disable|status POLICY``: a policy's autopilot over REST."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from apiclient import calls
from apiclient.models import Autopilot
from specgate.commands.rest import DEFAULT_URL, JsonOpt, KeyOpt, UrlOpt, control_plane, show

autopilot_app = typer.Typer(help="Let a policy edit and roll itself out from its recommendations (opt-in).",
                            no_args_is_help=True)


def _print(state: Autopilot, history: int) -> None:
    typer.echo(f"autopilot of {state.policy}: {'enabled' if state.enabled else 'disabled'}; {state.status}"
               f"{': ' + state.status_detail if state.status_detail else ''}")
    typer.echo(f"  min confidence {state.min_confidence}, steps {', '.join(f'{p:g}' for p in state.steps)} %, "
               f"hold {state.hold_s:g} s, min samples {state.min_samples}, "
               f"changes today {state.changes_today} of {state.max_changes_per_day}")
    typer.echo(f"  kinds: {', '.join(state.kinds)}")
    if state.rollout:
        typer.echo(f"  rollout in flight: {state.rollout}")
    for event in state.history[:history]:
        what = event.detail.get("recommendation", {}).get("title") if event.action == "started" else None
        typer.echo(f"  {event.at:%Y-%m-%d %H:%M:%S} {event.action}"
                   f"{' ' + event.rollout_id if event.rollout_id else ''}{': ' + what if what else ''}")


def _answer(reply: Any, as_json: bool) -> None:
    if as_json:
        show(reply.json, True)
    else:
        _print(reply.data, 3)


@autopilot_app.command("enable")
def enable(policy: str,
           min_confidence: Annotated[str, typer.Option(help="low, medium or high")] = "high",
           steps: Annotated[str, typer.Option(help="the traffic canary's percents, comma-separated")] = "10,50,100",
           hold_s: Annotated[float, typer.Option(help="seconds per step; hands off this long after a "
                                                      "person's change")] = 600.0,
           min_samples: Annotated[int, typer.Option(help="requests per cohort")] = 200,
           max_changes_per_day: Annotated[int, typer.Option()] = 4,
           kind: Annotated[list[str] | None, typer.Option(help="a recommendation kind it may apply (repeat); "
                                                              "default all")] = None,
           as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Enable the policy's autopilot with this whole setting (an option not given takes its default here, not the
    value set before)."""
    try:
        percents = [float(p) for p in steps.split(",") if p.strip()]
    except ValueError:
        raise typer.BadParameter(f"not a comma-separated list of numbers: {steps!r}", param_hint="--steps") from None
    setting: dict[str, Any] = {"enabled": True, "min_confidence": min_confidence, "steps": percents,
                               "hold_s": hold_s, "min_samples": min_samples,
                               "max_changes_per_day": max_changes_per_day}
    if kind:
        setting["kinds"] = kind
    with control_plane(url, key) as api:
        _answer(api.send(calls.set_autopilot(policy, setting)), as_json)


@autopilot_app.command("disable")
def disable(policy: str, as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Disable the policy's autopilot; a rollout it runs is paused for a person."""
    with control_plane(url, key) as api:
        current = api.send(calls.autopilot(policy)).data
        setting = {"enabled": False, "min_confidence": current.min_confidence, "steps": current.steps,
                   "hold_s": current.hold_s, "min_samples": current.min_samples,
                   "max_changes_per_day": current.max_changes_per_day, "kinds": current.kinds}
        _answer(api.send(calls.set_autopilot(policy, setting)), as_json)


@autopilot_app.command("status")
def status(policy: str, history: Annotated[int, typer.Option(help="history entries to print")] = 10,
           as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """The policy's autopilot: setting, what its last look found, its history."""
    with control_plane(url, key) as api:
        reply = api.send(calls.autopilot(policy))
    if as_json:
        show(reply.json, True)
    else:
        _print(reply.data, history)
