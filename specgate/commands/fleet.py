"""``specgate killswitch ...`` and ``specgate workers``: the fleet-wide switch and who runs what."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from specgate.commands.rest import DEFAULT_URL, Api, JsonOpt, KeyOpt, UrlOpt, show

killswitch_app = typer.Typer(help="Fleet-wide kill switch for speculation.", no_args_is_help=True)


def _killswitch(enabled: bool, reason: str, url: str, key: str, as_json: bool) -> None:
    show(Api(url, key).call("PUT", "/v1/killswitch", json={"enabled": enabled, "reason": reason}).json(),
           as_json)


@killswitch_app.command("on")
def killswitch_on(reason: Annotated[str, typer.Option()], as_json: JsonOpt = False,
                  url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Turn speculation off fleet-wide (engines keep running)."""
    _killswitch(True, reason, url, key, as_json)


@killswitch_app.command("off")
def killswitch_off(reason: Annotated[str, typer.Option()], as_json: JsonOpt = False,
                   url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Let policies decide again."""
    _killswitch(False, reason, url, key, as_json)


@killswitch_app.command("status")
def killswitch_status(as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Show the kill switch."""
    show(Api(url, key).call("GET", "/v1/killswitch").json(), as_json)


def workers(pool: Annotated[str | None, typer.Option()] = None, as_json: JsonOpt = False,
            url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """The fleet: which revision each worker runs and whether it converged."""
    api = Api(url, key)
    fleet = api.call("GET", "/v1/fleet").json()
    items: list[dict[str, Any]] = []
    params: dict[str, str] = {"pool": pool} if pool else {}
    while True:  # every page: the API gives at most `limit` workers at a time
        page = api.call("GET", "/v1/workers", params=params).json()
        items.extend(page["items"])
        if not page.get("next_cursor"):
            break
        params["cursor"] = page["next_cursor"]
    if as_json:
        show({"fleet": fleet, "workers": items}, True)
        return
    typer.echo(f"converged: {fleet['overall']['converged']}")
    for w in items:
        mark = "stale" if w.get("stale") else ("ok" if w.get("converged") else "converging")
        typer.echo(f"{w['id']:<32} pool={w['pool']:<16} etag={str(w.get('active_etag'))[:12]:<12} "
                   f"expected={str(w.get('expected_etag'))[:12]:<12} {mark}")
