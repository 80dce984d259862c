"""The one ``typer`` application every command module registers on."""

from __future__ import annotations

import errno
import sys
from typing import NoReturn

import typer
from typer.core import TyperGroup

from ..display import visible

EXIT_UNUSABLE = 2  # the request cannot be carried out


def echo(text: object = "", *, err: bool = False, nl: bool = True) -> None:
    """``typer.echo`` of text that may carry names from files: control characters shown escaped
    (``display.visible``), so a session or op name cannot drive the terminal."""
    typer.echo(visible(str(text)), err=err, nl=nl)


def fail(msg: str, code: int = EXIT_UNUSABLE) -> NoReturn:
    """Print ``error: msg`` on stderr, as one line, and exit with ``code``.

    Control characters (a file name may hold a newline) are shown escaped,
    so a name cannot forge a second line of output.
    """
    msg = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(msg))
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


class _Commands(TyperGroup):
    """The command group: a store opens its file for each operation, so any command may meet another
    process's lock held past the wait; that ends it in one sentence naming the holder, exit 2, whether the
    command runs from the console script or in-process (``typer.testing.CliRunner``, an embedding).  So do a
    database another program made (``ForeignDatabase``) and a file that fails as it is read (cut short)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except RuntimeError as e:
            store = sys.modules.get("precision_lab.store")  # loaded when it raised: none is imported here
            if store is None or not isinstance(e, (store.DatabaseLocked, store.ForeignDatabase)):
                raise
            fail(str(e))
        except Exception as e:
            duckdb = sys.modules.get("duckdb")
            reason = str(e).split("\n")[0]
            if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or (
                    duckdb is not None and isinstance(e, duckdb.Error) and "No space left on device" in reason):
                # a write is one transaction: what the database held before this command is what it holds now
                fail(f"the disk is full, so nothing of this command was stored ({reason[:300]})")
            if duckdb is None or not isinstance(e, duckdb.IOException):
                raise
            # a truncated or damaged database file fails when a page of it is read, not when it opens
            fail(f"the database file could not be read (damaged or cut short?): {reason.removeprefix('IO Error: ')}")


app = typer.Typer(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    help="Precision Lab: find where a model's numbers go wrong in low precision, and why.",
)


@app.callback()
def _commands() -> None:
    """Precision Lab: find where a model's numbers go wrong in low precision, and why."""
    # a callback keeps the app a group of commands when main() has loaded only one of them
