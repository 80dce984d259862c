"""Small commands: where the database is, which formats, recipes and fixes exist."""

from __future__ import annotations

from typing import Optional

import typer

from ._app import app
from ._common import DB_HELP, open_store
from ._common import fail as _fail
from ..display import num_text
from ..fixes.catalogue import FIXES, parse_fix
from ..fixes.recipes import RecipeError, list_recipes
from ..formats import FORMATS
from ..store import queries as q


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
    for row in q.session_list(store):
        typer.echo(f"  {row['name']}  ({row['runs']} runs, {row['created']})")


@app.command("recipes")
def recipes_cmd() -> None:
    """List the recipes: built-in ones and those registered through $PRECISION_LAB_RECIPES."""

    try:
        recipes = list_recipes()
    except RecipeError as e:
        _fail(str(e))
    for r in recipes:
        typer.echo(r.name)
        typer.echo(f"  {r.description}")
        typer.echo(f"  fails under: {r.default_policy.name} ({r.default_policy.describe()})")
        if r.fixes:
            typer.echo(f"  fixed by:    {', '.join(r.fixes)}")


@app.command("fixes")
def fixes_cmd() -> None:
    """List the fix catalogue with each fix's reason."""

    for name in sorted(FIXES):
        d = FIXES[name]
        typer.echo(f"{d.example:<36} {parse_fix(d.example).reason}")
