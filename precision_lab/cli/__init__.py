"""The ``precision-lab`` command line.

Each group of commands lives in its own module and registers on ``app``;
this file only assembles them.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Precision Lab: find where a model's numbers go wrong in low precision, and why.",
)

# command modules, in help order; each does `from . import app` and decorates
_COMMAND_MODULES = ("ingest_cmds", "capture_cmds", "fix_cmds", "share_cmds", "serve_cmds", "misc_cmds")


def _load_commands() -> None:
    for mod in _COMMAND_MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{mod}":
                raise


_load_commands()


def main() -> None:
    app()
