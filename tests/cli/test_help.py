"""Every `megatrain … --help` screen: each command and group renders, and flags show no `<bool>`
type (they take no value; megatrain.cli.common._flags_without_a_type)."""

from __future__ import annotations

from typing import Any

import typer.main
from typer.testing import CliRunner

from megatrain.cli import app


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [path]
    if getattr(cmd, "commands", None) is not None:  # a group (typer's is no click.Group)
        for name, sub in cmd.commands.items():
            found += _commands(sub, (*path, name))
    return found


def test_no_help_screen_shows_a_type_for_a_flag() -> None:
    paths = _commands(typer.main.get_command(app))
    assert ("demo",) in paths and ("pools", "apply") in paths
    for path in paths:
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "160"})
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output, (path, result.output)
        assert "--help" in result.output


def test_a_flag_still_shows_its_default_and_a_valued_option_its_type() -> None:
    out = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "160"}).output
    assert "--sequence-parallel" in out and "[default: no-sequence-parallel]" in out
    assert "<path>" in out and "<int range>" in out
