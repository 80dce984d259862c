"""A user's model named by entry points on the command line: resolved for ``capture``, and checked against a
session for the commands that run a session's model again (the session's own record is never run)."""

from __future__ import annotations

from typing import Optional

import typer

from ._common import fail as _fail
from ..allowed import record_entry_points
from ..fixes.recipes import MODEL_PREFIX, entry_point_recipe, get_recipe, parse_entry_point_recipe, register_recipe
from ..services.sessions import recipe_name as session_recipe_name
from ..store import SessionNotFound

__all__ = ["MODEL_HELP", "INPUTS_HELP", "LOSS_HELP", "resolve_recipe", "model_entry_points", "MODEL_OPTION",
           "INPUTS_OPTION", "LOSS_OPTION"]

MODEL_HELP = ("your model: FILE.py:FUNCTION or package.module:FUNCTION returning a fresh fp32 torch.nn.Module "
              "(instead of --recipe)")
INPUTS_HELP = "with --model: FILE.py:FUNCTION returning the inputs (a tensor, a tuple of arguments or a dict)"
LOSS_HELP = "with --model: FILE.py:FUNCTION mapping the output to a scalar loss, for a backward pass too"


def resolve_recipe(recipe: Optional[str], model: Optional[str], inputs: Optional[str], loss: Optional[str]):
    """The recipe a command runs: a registered one by name, or the user's model from ``--model``/``--inputs``
    (registered in this process under the name its session records)."""
    if (recipe is None) == (model is None):
        raise ValueError("give --recipe NAME or --model FILE.py:FUNCTION (with --inputs), not both or neither")
    if model is not None:
        if not inputs:
            raise ValueError("--model needs --inputs FILE.py:FUNCTION returning the model's inputs")
        rec = register_recipe(entry_point_recipe(model, inputs, loss), replace=True)
        try:  # a dashboard this user serves on localhost may now re-run the sessions made from them
            record_entry_points(parse_entry_point_recipe(rec.name).values())
        except OSError:  # no writable data folder: re-runs from the dashboard then need PRECISION_LAB_MODELS
            pass
        return rec
    if inputs or loss:
        raise ValueError("--inputs and --loss go with --model")
    return get_recipe(recipe)


# the options every command that runs a session's model again takes
MODEL_OPTION = typer.Option(None, "--model", help="a session captured with --model: the same entry point, to run it "
                                                  "again")
INPUTS_OPTION = typer.Option(None, "--inputs", help="with --model: the same inputs entry point")
LOSS_OPTION = typer.Option(None, "--loss", help="with --model: the same loss entry point")


def model_entry_points(store, session: str, model: Optional[str], inputs: Optional[str],
                       loss: Optional[str]) -> None:
    """Make the model a session was captured from runnable in this process, from the entry points given on the
    command line (a session's own record of them is never run); they must be the ones it was captured with."""
    if model is None:
        if inputs or loss:
            _fail("--inputs and --loss go with --model")
        return
    try:
        info = store.session(session)
        rec = resolve_recipe(None, model, inputs, loss)
    except (SessionNotFound, ValueError) as e:
        _fail(str(e))
    recorded = session_recipe_name(store, info)
    if recorded != rec.name:
        what = (f"the model entry points {parse_entry_point_recipe(recorded)}" if recorded and
                recorded.startswith(MODEL_PREFIX) else f"recipe {recorded!r}" if recorded else "dumps, not a model")
        _fail(f"session {info.name!r} was captured from {what}; --model/--inputs/--loss name "
              f"{parse_entry_point_recipe(rec.name)}")
