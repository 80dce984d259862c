"""``capture``: run a registered recipe, or your own model named by entry points, under live capture, fp32
reference included.

Exit status: 0 success (whatever the candidate's numbers); 2 the request
cannot be carried out (unknown recipe or format, bad fix spec, database
locked, recipe registry missing).
"""

from __future__ import annotations

from typing import List, Optional

import typer

from ._app import app, echo
from ._common import DB_HELP, open_store
from ._common import fail as _fail
from ._models import INPUTS_HELP, LOSS_HELP, MODEL_HELP, resolve_recipe
from ..fixes.policy import POLICIES, PolicyError, PrecisionPolicy, QuantConfig
from ..formats import FORMATS, get_format
from ..fixes.recipes import RecipeNotFound
from ..fixes.catalogue import apply_fixes
from ..store.queries import count_records
from ..services.origins import first_nonfinite
from ..services.cards import diagnosis_cards


def candidate_policy(recipe, dtype: Optional[str]):
    """The candidate policy for ``--dtype``: a named preset, a compute format, or an fp8 format.

    Without ``--dtype`` it is the recipe's own (failing) default policy.  An
    fp8 format means fp16 compute with per-tensor fp8 fake-quantisation of the
    linear layers, scales in fp32.
    """
    if dtype is None:
        return recipe.default_policy
    if dtype in POLICIES:
        return POLICIES[dtype]
    try:
        fmt = get_format(dtype)
    except KeyError as e:
        raise PolicyError(f"--dtype {dtype!r}: {e.args[0]}; presets: {', '.join(POLICIES)}") from None
    if fmt.bits <= 8 and fmt.kind == "float":
        return PrecisionPolicy(name=fmt.name, dtype="fp16", quant=QuantConfig(fmt.name, "tensor", "fp32"))
    if fmt.name not in FORMATS or fmt.torch_dtype() is None:
        raise PolicyError(f"--dtype {dtype!r}: torch cannot compute in {fmt.name}")
    return PrecisionPolicy(name=fmt.name, dtype=fmt.name)


@app.command("capture")
def capture_cmd(
    recipe: Optional[str] = typer.Option(None, "--recipe", help="registered recipe to run (see `precision-lab "
                                                                 "recipes`)"),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    inputs: Optional[str] = typer.Option(None, "--inputs", help=INPUTS_HELP),
    loss: Optional[str] = typer.Option(None, "--loss", help=LOSS_HELP),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="candidate format or policy preset: fp16, bf16, autocast-fp16, autocast-bf16, fp8_e4m3fn, "
                              "fp8_e5m2, fp8-e4m3-row, ... (default: the recipe's own failing policy)"),
    fix: Optional[List[str]] = typer.Option(None, "--fix", help="fix spec applied to the candidate policy "
                                                                "(repeatable; see `precision-lab fixes`)"),
    session: Optional[str] = typer.Option(None, "--session", help="name of the new session (default: the recipe's; a suffix is added if taken)"),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    no_local: bool = typer.Option(False, "--no-local", help="skip the per-op fp32 re-runs (local error)"),
    compile: Optional[str] = typer.Option(
        None, "--compile", help="run the candidate under torch.compile: 'model' (whole) or a module pattern "
                                "compiled per block (e.g. 'layers.*'); recorded numbers are the compiled ones"),
    reference: str = typer.Option("fp32", "--reference", help="fp32 (the model as built) or eager (the "
                                                               "candidate's format without --compile)"),
) -> None:
    """Capture a recipe's (or your model's) fp32 reference and low-precision candidate, compare them op by op,
    store the session."""
    try:
        rec = resolve_recipe(recipe, model, inputs, loss)
    except (RecipeNotFound, KeyError, ValueError) as e:
        _fail(str(e) if not isinstance(e, KeyError) or isinstance(e, RecipeNotFound) else str(e.args[0]))
    default_name = rec.name
    if model is not None:
        default_name = model.rpartition(":")[2]
    try:
        policy = candidate_policy(rec, dtype)
        if compile is not None:
            policy = policy.replace(compile=compile)
        if fix:
            policy = apply_fixes(policy, fix)
        if reference not in ("fp32", "eager"):
            raise ValueError(f"--reference {reference!r}: give fp32 or eager")
        if reference == "eager" and policy.compile is None:
            raise ValueError("--reference eager compares with the compiled candidate: give --compile too")
        ref_policy = policy.replace(compile=None, emulate_precision_casts=False) if reference == "eager" else None
    except ValueError as e:
        _fail(str(e))
    store = open_store(db)
    from ..services.capture import PairOptions, capture_pair  # deferred: it loads torch

    pair = PairOptions(reference_name="fp32 reference" if ref_policy is None else "eager reference",
                       candidate_name=f"candidate ({policy.name}{', compiled' if policy.compile else ''})",
                       reference_policy=ref_policy, seed=rec.seed, loss_fn=rec.loss_fn, local_error=not no_local,
                       source=f"recipe:{rec.name}", recipe=rec.name)
    try:
        name = capture_pair(rec.build_model, rec.inputs(), policy, store=store, pair=pair,
                            name=session or default_name)
    except ValueError as e:
        _fail(str(e))
    _summary(store, name)


def _summary(store, name: str) -> None:
    info = store.session(name)
    runs = store.runs(info.session_id)
    echo(f"session {name!r} in {store.path}")
    for _, r in runs.iterrows():
        n = count_records(store, r["run_id"])
        echo(f"  {r['kind']:<10} {r['name']}: {n} records, dtype {r['dtype']}")
    for _, r in runs.iterrows():
        hit = first_nonfinite(store, r["run_id"])
        if hit is None:
            echo(f"  {r['name']}: no NaN/Inf")
        else:
            echo(f"  {r['name']}: first non-finite at {hit.op} ({hit.direction}, step {hit.step}, "
                       f"rank {hit.rank}): {hit.reason}")
    for d in diagnosis_cards(store, info.session_id):
        echo(f"  diagnosis [{d.severity}] {d.run}: {d.op}: {d.message}")
        if d.fixes:
            echo(f"    fixes (best first): {', '.join(d.fixes)}")
