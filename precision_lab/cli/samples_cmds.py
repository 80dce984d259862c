"""``samples``: write the seeded sample dumps, one shard folder per built-in recipe.

Exit status: 0 success; 2 an unknown recipe.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from ._app import app
from ._common import fail as _fail
from ._common import print_table
from ..fixes.recipes import RecipeNotFound
from ..services.samples import DEFAULT_ROOT, generate


@app.command("samples", hidden=True)
def samples_cmd(
    recipes: Optional[List[str]] = typer.Argument(None, help="recipe names (default: every built-in recipe)"),
    out: str = typer.Option(str(DEFAULT_ROOT), "--out", help="folder to write into"),
) -> None:
    """Write sample_dumps/<recipe>/ for the built-in recipes (the dashboard's samples)."""
    try:
        written = generate(out, recipes or None)
    except RecipeNotFound as e:
        _fail(str(e.args[0]) if e.args else str(e))
    print_table(("folder", "KiB"), [(p, f"{sum(f.stat().st_size for f in p.rglob('*') if f.is_file()) / 1024:.0f}")
                                    for p in written], right=("KiB",))
