"""What the deployment tests share: Compose-style interpolation, the real command line, settings as a container
would get them (tests/deploy/)."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import typer

from sidecar.settings import SidecarSettings
from specgate.cli import app

# Compose variable interpolation (the subset the deployment files may use)
VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])"
                       r"(?P<arg>[^}]*))?\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*)|(?P<invalid>))")


def interpolate_text(text: str, env: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        if match.group("invalid") is not None:
            raise AssertionError(f"invalid interpolation in {text!r}")
        name = match.group("braced") or match.group("named")
        op, arg = match.group("op"), match.group("arg") or ""
        value = env.get(name)
        if op in (":-", "-"):
            if value is None or (op == ":-" and value == ""):
                return arg
            return value
        if op in (":?", "?"):
            if value is None or (op == ":?" and value == ""):
                raise AssertionError(f"${{{name}}} is required: {arg}")
            return value
        if op in (":+", "+"):
            return arg if value else ""
        return value or ""

    return VARIABLE.sub(one, text)


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose interpolates every string value (not keys), after YAML parsing."""
    if isinstance(node, str):
        return interpolate_text(node, env)
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    return node


def parse_cli(args: list[str]) -> Any:
    """Parse ``specgate ARGS`` with the real command line, as far as the command; raises on a bad line."""
    root: Any = typer.main.get_command(app)
    ctx = typer.Context(root, info_name="specgate")
    command = root
    rest = list(args)
    name = "specgate"
    while hasattr(command, "resolve_command"):  # a group: descend to the subcommand
        resolved_name, resolved, rest = command.resolve_command(ctx, rest)
        assert resolved is not None
        assert resolved_name is not None
        name, command = resolved_name, resolved
        ctx = typer.Context(command, info_name=name, parent=ctx)
    command.make_context(name, rest, parent=ctx.parent)
    return command


def flags_of(command: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, word in enumerate(command):
        if word.startswith("--"):
            following = command[i + 1] if i + 1 < len(command) else None
            out[word] = None if following is None or following.startswith("--") else following
    return out


def sidecar_settings_of(command: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> SidecarSettings:
    """The settings ``specgate sidecar ...`` runs with, given its command line and environment (the real CLI;
    the key file, which is not here, is stood in for by a key)."""
    from typer.testing import CliRunner

    import sidecar.main

    assert command[:2] == ["specgate", "sidecar"], command
    for variable in list(os.environ):
        if variable.startswith("SPECGATE_"):
            monkeypatch.delenv(variable)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SPECGATE_KEY", "sgk_stand_in")
    seen: list[SidecarSettings] = []
    monkeypatch.setattr(sidecar.main, "run", lambda settings, log_level="info": seen.append(settings))
    result = CliRunner().invoke(app, command[1:])
    assert result.exit_code == 0, result.output
    return seen[0]
