"""What every REST command shares: the control plane's URL and key, its client, failing and printing.

Exit codes: 0 done, 1 the control plane refused (4xx/5xx, message printed),
2 bad usage or input file, 3 the control plane could not be reached.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, NoReturn

import httpx
import typer
import yaml

UrlOpt = Annotated[str, typer.Option("--url", envvar="SPECGATE_URL", help="control plane base URL")]
KeyOpt = Annotated[str, typer.Option("--key", envvar="SPECGATE_KEY", help="API key (sgk_...)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the raw JSON answer")]
DEFAULT_URL = "http://127.0.0.1:8080"


def fail(message: str, code: int) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


class Api:
    def __init__(self, url: str, key: str) -> None:
        if not key:
            fail("no API key: pass --key or set SPECGATE_KEY", 2)
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=30.0,
                                   headers={"Authorization": f"Bearer {key}"})

    def call(self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201), **kwargs: Any) -> httpx.Response:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            fail(f"cannot reach the control plane at {self.client.base_url}: {exc}", 3)
        if response.status_code not in ok:
            fail(problem_text(response), 1)
        return response


def problem_text(response: httpx.Response) -> str:
    try:
        problem = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:500]}"
    text = f"{problem.get('title', 'HTTP ' + str(response.status_code))}: {problem.get('detail', '')}"
    for err in problem.get("errors", []) or []:
        line = f" (line {err['line']})" if err.get("line") else ""
        text += f"\n  {err.get('path') or '<document>'}{line}: {err.get('message')} [{err.get('code')}]"
    if "state" in problem:
        text += f"\n  current state: {problem['state']}"
    return text


def show(data: Any, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        typer.echo(yaml.safe_dump(data, sort_keys=False, default_flow_style=False).rstrip())
