"""``specgate apply`` and ``specgate rollback``: policy revisions from files (GitOps) and back."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specgate.commands.rest import DEFAULT_URL, Api, JsonOpt, KeyOpt, UrlOpt, fail, show


def apply(file: Annotated[Path, typer.Option("-f", "--file", help="policy document (YAML or JSON)")],
          message: Annotated[str, typer.Option("-m", "--message")] = "",
          pool: Annotated[str | None, typer.Option(help="pool, when the policy is created")] = None,
          url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Create a revision if the document changed, and print the diff (GitOps)."""
    from policies import PolicyValidationError, load_policy

    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"cannot read {file}: {exc}", 2)
    try:
        document = load_policy(text)
    except PolicyValidationError as exc:
        lines = "\n".join(f"  {e}" for e in exc.errors)
        fail(f"{file} is invalid:\n{lines}", 2)
    api = Api(url, key)
    name = document.name
    found = api.call("GET", f"/v1/policies/{name}", ok=(200, 404))
    if found.status_code == 404:
        api.call("POST", "/v1/policies", json={"name": name, "pool": pool, "description": document.description})
        typer.echo(f"created policy {name}")
        head = None
    else:
        head = found.json().get("head_revision_id")
    headers = {"Content-Type": "application/yaml"}
    if head:
        headers["If-Match"] = f'"{head}"'
    created = api.call("POST", f"/v1/policies/{name}/revisions", content=text.encode(), headers=headers,
                       params={"message": message} if message else None)
    revision = created.json()
    if created.status_code == 200:
        typer.echo(f"unchanged: {name} is already at revision {revision['id'][:12]}")
        return
    typer.echo(f"revision {revision['id'][:12]} (#{revision['seq']}) of {name} created")
    if head:
        diff = api.call("GET", f"/v1/policies/{name}/diff", params={"from": head, "to": revision["id"]}).json()
        typer.echo(diff["unified"].rstrip())


def rollback(policy: str, revision: str, reason: Annotated[str, typer.Option()],
             as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Make REVISION the active revision of POLICY now (ends any rollout of it)."""
    show(Api(url, key).call("POST", f"/v1/policies/{policy}/rollback",
                              json={"revision": revision, "reason": reason}).json(), as_json)
