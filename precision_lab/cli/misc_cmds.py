"""Small commands: where the database is, which formats, recipes and fixes exist."""

from __future__ import annotations

from typing import Optional

import typer

from ._app import app, echo
from ._common import DB_HELP, open_store, print_table
from ._common import fail as _fail
from ..display import num_text
from ._models import INPUTS_OPTION, LOSS_OPTION, MODEL_OPTION, model_entry_points
from ..fixes.catalogue import FIXES, parse_fix
from ..services.applicable import applicable_fixes
from ..services.diagnose import check_sessions
from ..store.queries import session_list
from ..services.rerun import RerunError
from ..store import SessionNotFound
from ..fixes.recipes import RecipeError, list_recipes
from ..formats import FORMATS


@app.command("formats")
def formats_cmd() -> None:
    """List the registered number formats and their limits."""

    print_table(("format", "bits", "max", "min normal", "min subnormal", "eps"),
                [(f.name, f.bits, num_text(f.max), num_text(f.smallest_normal, 4), num_text(f.smallest_subnormal, 4),
                  num_text(f.eps, 4)) for f in FORMATS.values()],
                right=("bits", "max", "min normal", "min subnormal", "eps"))


@app.command("db")
def db_cmd(db: Optional[str] = typer.Option(None, "--db", help=DB_HELP)) -> None:
    """Print the database path in use and its sessions."""
    store = open_store(db)
    echo(store.path)
    for row in session_list(store):
        echo(f"  {row.name}  ({row.runs} runs, {row.created})")


@app.command("delete")
def delete_cmd(session: str = typer.Option(..., "--session", "-s", help="the session to delete (name or id)"),
               db: Optional[str] = typer.Option(None, "--db", help=DB_HELP)) -> None:
    """Delete a session: its runs, records, comparisons, diagnoses, timeline, share link and replay kits, in one
    transaction."""
    store = open_store(db)
    try:
        name = store.session(session).name
        store.delete_session(session)
    except SessionNotFound as e:
        _fail(str(e))
    echo(f"deleted session {name!r} from {store.path}")


@app.command("check")
def check_cmd(db: Optional[str] = typer.Option(None, "--db", help=DB_HELP)) -> None:
    """Find and repair what an interrupted write left: a session stored without its diagnoses gets them (or a
    warning saying why the rules failed)."""
    store = open_store(db)
    done = check_sessions(store)
    for name, what in done:
        echo(f"  {name}: {what}")
    echo(f"{store.path}: {len(done)} session(s) repaired" if done else f"{store.path}: nothing to repair")


@app.command("recipes")
def recipes_cmd() -> None:
    """List the recipes: built-in ones and those registered through $PRECISION_LAB_RECIPES."""

    try:
        recipes = list_recipes()
    except RecipeError as e:
        _fail(str(e))
    for r in recipes:
        echo(r.name)
        echo(f"  {r.description}")
        echo(f"  fails under: {r.default_policy.name} ({r.default_policy.describe()})")
        if r.fixes:
            echo(f"  fixed by:    {', '.join(r.fixes)}")


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
        print_table(("fix", "what it does"), [(FIXES[n].example, parse_fix(FIXES[n].example).reason)
                                              for n in sorted(FIXES)])
        return
    store = open_store(db)
    model_entry_points(store, session, model, inputs, loss)
    try:
        rows = applicable_fixes(store, session)
    except (SessionNotFound, RerunError) as e:
        _fail(str(e))
    print_table(("applies", "fix", "what it does, or why not"),
                [("applies" if r.applies else "no", r.fix, r.reason) for r in rows])
