"""``specgate check-pair``: whether a draft model's tokenizer is aligned with its target's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pairs import TokenizerUnreadable
from pairs import check_pair as check
from specgate.commands.rest import JsonOpt, fail


def check_pair(target: Annotated[Path, typer.Option(help="the target model's directory (Hugging Face layout)")],
               draft: Annotated[Path, typer.Option(help="the draft model's directory")],
               use_transformers: Annotated[bool, typer.Option(
                   "--transformers", help="load the tokenizers with transformers (where it is installed, e.g. the "
                                          "engine environment) instead of reading their files")] = False,
               as_json: JsonOpt = False) -> None:
    """Compare the two tokenizers: vocabulary size, token-to-id map, special tokens, chat template.

    Exit 0 when aligned, 1 when they differ (each difference printed), 2 when a directory cannot be read.
    """
    try:
        report = check(target, draft, use_transformers=use_transformers)
    except TokenizerUnreadable as exc:
        fail(str(exc), 2)
    except ImportError:
        fail("--transformers: transformers is not installed in this environment", 2)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    elif report.aligned:
        typer.echo(report.describe())
    else:
        typer.echo("misaligned: the draft's tokens would not mean what the target reads them as")
        for difference in report.differences:
            typer.echo(f"  - {difference}")
        for example in report.examples:
            typer.echo(f"    e.g. {example['token']!r}: target id {example['target']}, draft id {example['draft']}")
        for note in report.notes:
            typer.echo(f"  note: {note}")
    raise typer.Exit(0 if report.aligned else 1)
