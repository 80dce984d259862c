"""Small commands: where the database is, which formats exist."""

from __future__ import annotations

from typing import Optional

import typer

from . import app
from ._common import DB_HELP, open_store
from ..display import num_text
from ..formats import FORMATS


@app.command("formats")
def formats_cmd() -> None:
    """List the registered number formats and their limits."""

    typer.echo(f"{'format':<14}{'bits':>5}{'max':>14}{'min normal':>14}{'min subnormal':>15}{'eps':>12}")
    for f in FORMATS.values():
        typer.echo(f"{f.name:<14}{f.bits:>5}{num_text(f.max):>14}{num_text(f.smallest_normal, 4):>14}"
                   f"{num_text(f.smallest_subnormal, 4):>15}{num_text(f.eps, 4):>12}")


@app.command("db")
def db_cmd(db: Optional[str] = typer.Option(None, "--db", help=DB_HELP)) -> None:
    """Print the database path in use and its sessions."""
    store = open_store(db)
    typer.echo(store.path)
    for _, row in store.sessions().iterrows():
        typer.echo(f"  {row['name']}  ({row['runs']} runs, {row['created']})")
