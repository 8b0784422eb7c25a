"""Every command's ``--help`` at 80 columns, as in a pipe: it exits 0 and names every option
whole (so ``steerserve serve --help | grep tool`` finds the tool options); ``--version``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from steerserve import __version__
from steerserve.cli import app

ROOT = typer.main.get_command(app)


def commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command's path (typer's click-like objects: a group has ``commands``)."""
    yield path
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from commands(sub, (*path, name))


def command(path: tuple[str, ...]) -> Any:
    cmd = ROOT
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return cmd


@pytest.mark.parametrize("path", list(commands(ROOT)), ids=lambda p: " ".join(p) or "root")
def test_help_exits_0_at_80_columns_with_whole_option_names(path: tuple[str, ...]) -> None:
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80", "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    for param in command(path).params:
        if param.param_type_name == "option" and not getattr(param, "hidden", False):
            for opt in param.opts:
                assert opt in r.output, (path, opt)


def test_version() -> None:
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"steerserve {__version__}"
