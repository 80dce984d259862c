"""Small commands: where the database is, which formats, recipes and fixes exist."""

from __future__ import annotations

from typing import Optional

import typer

from ._app import app
from ._common import DB_HELP, open_store
from ._common import fail as _fail
from ..display import num_text
from ._models import INPUTS_OPTION, LOSS_OPTION, MODEL_OPTION, model_entry_points
from ..fixes.catalogue import FIXES, parse_fix
from ..services.applicable import applicable_fixes
from ..services.rerun import RerunError
from ..store import SessionNotFound
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
def fixes_cmd(
    session: Optional[str] = typer.Option(None, "--session", "-s", help="list the fixes that apply to this "
                                                                        "session's model, and why the others do not"),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    model: Optional[str] = MODEL_OPTION,
    inputs: Optional[str] = INPUTS_OPTION,
    loss: Optional[str] = LOSS_OPTION,
) -> None:
    """List the fix catalogue with each fix's reason (with --session: which apply to that session's model)."""

    if session is None:
        if model or inputs or loss or db:
            _fail("--model, --inputs, --loss and --db go with --session")
        for name in sorted(FIXES):
            d = FIXES[name]
            typer.echo(f"{d.example:<36} {parse_fix(d.example).reason}")
        return
    store = open_store(db)
    model_entry_points(store, session, model, inputs, loss)
    try:
        rows = applicable_fixes(store, session)
    except (SessionNotFound, RerunError) as e:
        _fail(str(e))
    for r in rows:
        typer.echo(f"{'applies' if r['applies'] else 'no':<8} {r['fix']:<36} {r['reason']}")
