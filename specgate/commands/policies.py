"""``specgate apply`` and ``specgate rollback``: policy revisions from files (GitOps) and back."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from apiclient import ApiError, calls
from specgate.commands.rest import DEFAULT_URL, JsonOpt, KeyOpt, UrlOpt, control_plane, fail, show


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
    name = document.name
    with control_plane(url, key) as api:
        try:
            head = api.send(calls.policy(name)).data.head_revision_id
        except ApiError as exc:
            if exc.status != 404:
                raise
            api.send(calls.create_policy(name, pool=pool, description=document.description))
            typer.echo(f"created policy {name}")
            head = None
        # Without a head nothing can be overwritten; with one, a revision saved since is a conflict (412).
        created = api.send(calls.create_revision(name, text, message=message,
                                                 if_match=f'"{head}"' if head else None))
        revision = created.data
        if created.status == 200:
            typer.echo(f"unchanged: {name} is already at revision {revision.id[:12]}")
            return
        typer.echo(f"revision {revision.id[:12]} (#{revision.seq}) of {name} created")
        if head:
            diff = api.send(calls.diff(name, from_revision=head, to_revision=revision.id)).data
            typer.echo(diff.unified.rstrip())


def rollback(policy: str, revision: str, reason: Annotated[str, typer.Option()],
             as_json: JsonOpt = False, url: UrlOpt = DEFAULT_URL, key: KeyOpt = "") -> None:
    """Make REVISION the active revision of POLICY now (ends any rollout of it)."""
    with control_plane(url, key) as api:
        show(api.send(calls.rollback(policy, revision, reason=reason)).json, as_json)
