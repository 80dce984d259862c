"""The one ``typer`` application every command module registers on."""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Precision Lab: find where a model's numbers go wrong in low precision, and why.",
)


@app.callback()
def _commands() -> None:
    """Precision Lab: find where a model's numbers go wrong in low precision, and why."""
    # a callback keeps the app a group of commands when main() has loaded only one of them
