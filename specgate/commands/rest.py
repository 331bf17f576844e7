"""What every REST command shares: the control plane's URL and key, the client, failing and printing.

Exit codes: 0 done, 1 the control plane refused (4xx/5xx, message printed),
2 bad usage or input file, 3 the control plane could not be reached.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import typer
import yaml

from apiclient import ApiClient, ApiError

UrlOpt = Annotated[str, typer.Option("--url", envvar="SPECGATE_URL", help="control plane base URL")]
KeyOpt = Annotated[str, typer.Option("--key", envvar="SPECGATE_KEY", help="API key (sgk_...)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the raw JSON answer")]
DEFAULT_URL = "http://127.0.0.1:8080"
TIMEOUT_S = 30.0


def fail(message: str, code: int) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


@contextmanager
def control_plane(url: str, key: str) -> Iterator[ApiClient]:
    """The client for one command; a refusal or an unreachable control plane ends the command (exit 1 or 3)."""
    if not key:
        fail("no API key: pass --key or set SPECGATE_KEY", 2)
    with ApiClient(url, key, timeout_s=TIMEOUT_S) as api:
        try:
            yield api
        except ApiError as exc:
            if exc.unreachable:
                fail(exc.problem.detail, 3)
            fail(refusal_text(exc), 1)


def refusal_text(exc: ApiError) -> str:
    """The problem's title, detail and field errors, and the state that made a transition illegal."""
    text = exc.problem.text()
    if "state" in exc.problem.extra:
        text += f"\n  current state: {exc.problem.extra['state']}"
    if "current_step" in exc.problem.extra:
        text += f"\n  current step: {exc.problem.extra['current_step']}"
    return text


def show(data: Any, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        typer.echo(yaml.safe_dump(data, sort_keys=False, default_flow_style=False).rstrip())
