"""The ``precision-lab`` command line.

Each group of commands lives in its own module and registers on the one
``typer`` app (``cli/_app.py``).  ``main()`` imports only the module of the
command asked for, so a command that needs no tensors starts without torch,
numba or pandas; ``precision_lab.cli.app`` (and ``--help``) loads them all.
"""

from __future__ import annotations

import importlib
import sys

from . import _app

# command modules, in help order; each does `from ._app import app` and decorates
_COMMAND_MODULES = ("ingest_cmds", "report_cmds", "capture_cmds", "fix_cmds", "share_cmds", "serve_cmds",
                    "misc_cmds", "samples_cmds")
# the module each command lives in
COMMANDS = {
    "ingest": "ingest_cmds", "compare": "ingest_cmds", "diff": "ingest_cmds", "report": "report_cmds", "capture": "capture_cmds",
    "recipes": "misc_cmds", "fixes": "misc_cmds", "rerun": "fix_cmds", "verify": "fix_cmds", "bisect": "fix_cmds", "replay": "fix_cmds",
    "export": "share_cmds", "import": "share_cmds", "share-link": "share_cmds", "config": "share_cmds",
    "serve": "serve_cmds", "formats": "misc_cmds", "db": "misc_cmds", "delete": "misc_cmds", "check": "misc_cmds",
    "samples": "samples_cmds",
}


def _load_commands(modules=_COMMAND_MODULES) -> None:
    for mod in modules:
        importlib.import_module(f"{__name__}.{mod}")


def __getattr__(name: str):
    if name == "app":  # the whole command line, for callers that invoke any command (tests, embedding)
        _load_commands()
        return _app.app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    words = [a for a in sys.argv[1:] if not a.startswith("-")]
    wanted = COMMANDS.get(words[0]) if words else None
    _load_commands((wanted,) if wanted else _COMMAND_MODULES)
    _app.app()
