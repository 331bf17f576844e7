"""``specgate killswitch ...`` and ``specgate workers``: the fleet-wide switch and who runs what."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from apiclient import calls
from apiclient.models import Worker
from specgate.commands.rest import DEFAULT_URL, JsonOpt, KeyOpt, UrlOpt, control_plane, show

killswitch_app = typer.Typer(help="Fleet-wide kill switch for speculation.", no_args_is_help=True)


def _killswitch(enabled: bool, reason: str, url: str, key: str, as_json: bool) -> None:
    with control_plane(url, key) as api:
        show(api.send(calls.set_kill_switch(enabled, reason=reason)).json, as_json)


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
    with control_plane(url, key) as api:
        show(api.send(calls.kill_switch()).json, as_json)


def workers(pool: Annotated[str | None, typer.Option()] = None,
            kind: Annotated[str | None, typer.Option(help="worker or gateway; both when left out")] = None,
            replicas: Annotated[bool, typer.Option("--replicas", help="also each one's engine replicas, as its "
                                                   "last heartbeat reported them")] = False,
            engines: Annotated[bool, typer.Option("--engines", help="also the engines each one supervises: their "
                                                  "state and the revision whose arguments they run")] = False,
            as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """The fleet: which revision each worker and gateway runs, whether it converged, and its replicas."""
    raw: list[dict[str, Any]] = []
    items: list[Worker] = []
    with control_plane(url, key) as api:
        fleet = api.send(calls.fleet())
        cursor: str | None = None
        while True:  # every page: the API gives at most `limit` workers at a time
            page = api.send(calls.workers(pool=pool or None, kind=kind or None, cursor=cursor))
            raw.extend(page.json["items"])
            items.extend(page.data.items)
            cursor = page.data.next_cursor
            if not cursor:
                break
    if as_json:
        show({"fleet": fleet.json, "workers": raw}, True)
        return
    typer.echo(f"converged: {fleet.data.overall.converged}")
    for w in items:
        mark = "stale" if w.stale else ("ok" if w.converged else (w.engines_lag() or "converging"))
        typer.echo(f"{w.id:<32} {w.kind:<8} pool={w.pool:<16} etag={str(w.active_etag)[:12]:<12} "
                   f"expected={str(w.expected_etag)[:12]:<12} {mark}")
        if replicas:
            for r in w.replicas:
                probe = f", next probe in {r.next_probe_in_s:.0f} s" if r.next_probe_in_s is not None else ""
                running = "-" if r.running is None else f"{r.running:g}"
                waiting = "-" if r.waiting is None else f"{r.waiting:g}"
                typer.echo(f"    {r.engine:<12} {r.replica:<32} {r.state:<8} in flight {r.in_flight}, running "
                           f"{running}, waiting {waiting}, ejections {r.ejections}{probe}")
        if engines:
            for e in w.supervised_engines:
                error = f"; last error: {e.last_error}" if e.last_error else ""
                tok = e.tokenizer
                pair = "" if tok is None else (
                    "; tokenizer aligned" if tok.aligned else
                    f"; tokenizer {'misaligned' if tok.aligned is False else 'not checked'}: "
                    f"{'; '.join(tok.differences)}")
                typer.echo(f"    {e.engine:<12} {e.state:<10} runs {(e.revision or '-')[:12]:<12} config "
                           f"{e.config_hash or '-'}, restarts {e.restarts}, failed {e.failed_restarts}, crashes "
                           f"{e.crashes}{pair}{error}")
