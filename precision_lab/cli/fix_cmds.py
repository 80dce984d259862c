"""``recipes``, ``rerun``, ``bisect`` and ``replay``: prove a fix by running it.

Exit status: 0 success; 1 the re-run (or bisect) still fails its check;
2 the request cannot be carried out (unknown session or run, dump-only
session, bad fix spec, a pattern that names no module).
"""

from __future__ import annotations

from typing import List, Optional

import typer

from ._app import app, echo
from ._common import DB_HELP, end_progress, open_store, print_table, tty_progress
from ._common import fail as _fail
from ._models import INPUTS_OPTION as _INPUTS, LOSS_OPTION as _LOSS, MODEL_OPTION as _MODEL
from ._models import model_entry_points as _model_entry_points
from ..config import load_config
from ..store import queries as q
from ..services.origins import first_nonfinite
from ..services.islands import bisect_fp32_islands
from ..services.rerun import rerun_session
from ..store import SessionNotFound
from ..fixes.rules import fmt_num
from ..services.jobs import rerun_blocker
from ..services.replay import replay_op, replayable_ops
from ..services.verify import verify_session

EXIT_FAILED = 1

_DB = typer.Option(None, "--db", help=DB_HELP)
# what an fp32 island must reach (bisect, verify --grow)
_TOLERANCE = typer.Option(None, "--tolerance", "-t", help="30 or sqnr>=30 (dB, and no NaN/Inf); nonfinite (only no "
                                                          "NaN/Inf); default: the recipe's own bound")


def _print_run_summary(store, session: str, run_id: str) -> bool:
    """Print the run's first non-finite producer and diagnoses; True when the run is clean."""

    run = store.run(run_id)
    fn = first_nonfinite(store, run_id)
    echo(f"run {run.name} ({run_id}) in session {session}: parent {run.parent_run_id or '-'}, "
               f"fix {run.fix or '-'}")
    last = q.last_accumulated_output(store, run_id)
    if fn is None:
        echo("  no NaN or inf anywhere in the run")
    else:
        echo(f"  first non-finite: {fn.op} ({fn.reason})")
    if last is not None:
        sqnr = "none (the output holds NaN/Inf)" if last.sqnr_db is None else f"{last.sqnr_db:.1f} dB"
        echo(f"  output SQNR against the fp32 reference: {sqnr} ({last.verdict})")
    for d in q.run_diagnoses(store, run_id):
        echo(f"  [{d.severity}] {d.rule} at {d.op}: {d.message}")
        if d.fixes:
            echo(f"      fixes: {', '.join(d.fixes)}")
    return fn is None


@app.command("rerun")
def rerun_cmd(
    session: str = typer.Option(..., "--session", "-s", help="session made from a recipe"),
    fix: List[str] = typer.Option(..., "--fix", "-f", help="fix spec, e.g. scale-fp32 or keep-fp32:<module>; "
                                                           "repeat or join with + to apply several"),
    parent: Optional[str] = typer.Option(None, "--from-run", help="run to edit (default: the session's candidate)"),
    model: Optional[str] = _MODEL,
    inputs: Optional[str] = _INPUTS,
    loss: Optional[str] = _LOSS,
    db: Optional[str] = _DB,
) -> None:
    """Re-run a session's recipe (or model) under a fix: a new run whose parent is the old one, compared with
    fp32."""
    store = open_store(db)
    _model_entry_points(store, session, model, inputs, loss)
    progress = tty_progress()
    try:
        run_id = rerun_session(store, session, list(fix), progress, parent=parent)
    except (SessionNotFound, ValueError) as e:
        end_progress(progress)
        _fail(str(e))
    end_progress(progress)
    name = store.session(session).name
    if not _print_run_summary(store, name, run_id):
        raise typer.Exit(EXIT_FAILED)


@app.command("verify")
def verify_cmd(
    session: str = typer.Option(..., "--session", "-s", help="session made from a recipe or a model"),
    top: int = typer.Option(3, "--top", help="how many of the suggested fixes to try, in the order proposed"),
    grow: bool = typer.Option(False, "--grow", help="when none of them works, grow an fp32 island along the data "
                                                    "flow from the first non-finite producer until the run meets "
                                                    "--tolerance (every try is stored)"),
    tolerance: Optional[str] = _TOLERANCE,
    model: Optional[str] = _MODEL,
    inputs: Optional[str] = _INPUTS,
    loss: Optional[str] = _LOSS,
    db: Optional[str] = _DB,
) -> None:
    """Re-run the session's suggested fixes not tried yet and say which leave the run finite (exit 1 if none)."""
    store = open_store(db)
    _model_entry_points(store, session, model, inputs, loss)
    try:
        blocker = rerun_blocker(store, session)
    except SessionNotFound as e:
        _fail(str(e))
    if blocker:
        _fail(blocker)
    progress = tty_progress()
    try:
        rows = verify_session(store, session, top=top, progress=progress, grow=grow, tolerance=tolerance)
    except (SessionNotFound, ValueError) as e:
        end_progress(progress)
        _fail(str(e))
    end_progress(progress)
    if not rows:
        echo("no fix is suggested for this session")
        return
    for r in rows:
        if r.error:
            echo(f"  cannot  {r.label}: {r.error}")
            continue
        v = r.result
        sq = f"{v.sqnr_db:.1f} dB" if v.sqnr_db is not None else "-"
        state = "works " if v.works else "fails "
        where = f" ({v.why})" if v.why else ""
        grown = " (grown along the data flow)" if r.grown else ""
        echo(f"  {state}  {r.label}{grown}  output SQNR {sq}{where}  [run {v.run}]")
    if not any(r.result.works for r in rows):
        raise typer.Exit(EXIT_FAILED)


@app.command("bisect")
def bisect_cmd(
    session: str = typer.Option(..., "--session", "-s", help="session made from a recipe"),
    tolerance: Optional[str] = _TOLERANCE,
    max_runs: int = typer.Option(16, "--max-runs", help="most runs to try"),
    parent: Optional[str] = typer.Option(None, "--from-run", help="run to start from (default: the candidate)"),
    model: Optional[str] = _MODEL,
    inputs: Optional[str] = _INPUTS,
    loss: Optional[str] = _LOSS,
    db: Optional[str] = _DB,
) -> None:
    """Find a small set of modules to keep in fp32 so the run meets a tolerance; every try is stored."""
    store = open_store(db)
    _model_entry_points(store, session, model, inputs, loss)
    progress = tty_progress()
    try:
        res = bisect_fp32_islands(store, session, tolerance=tolerance, max_runs=max_runs, parent=parent,
                                  progress=progress)
    except (SessionNotFound, ValueError) as e:
        end_progress(progress)
        _fail(str(e))
    end_progress(progress)
    echo(f"tolerance: {res.tolerance.describe()}")
    for a in res.attempts:
        sq = f"{a.sqnr_db:.1f} dB" if a.sqnr_db is not None else "-"
        if not a.run_id:  # the model could not run with this island (res.message says why)
            echo(f"  fail  {a.fix}  the model does not run with it")
            continue
        echo(f"  {'pass' if a.passed else 'fail'}  {a.fix or '(no fp32 island)'}  non-finite records "
                   f"{a.nonfinite}, output SQNR {sq}  [run {a.run_id}]")
    echo(res.message)
    if res.passed:
        echo("fp32 island: " + (", ".join(res.modules) if res.modules else "(none needed)"))
        echo(f"fix: {res.fix}" if res.modules else "fix: none needed")
    else:
        raise typer.Exit(EXIT_FAILED)


@app.command("replay")
def replay_cmd(
    session: str = typer.Option(..., "--session", "-s", help="dump session holding the op's tensors"),
    op: Optional[str] = typer.Option(None, "--op", help="op name as stored (e.g. Functional.layer_norm.0.forward); "
                                                        "omit to list the replayable ops"),
    fix: Optional[List[str]] = typer.Option(None, "--fix", "-f", help="fix to replay under (repeatable)"),
    run: Optional[str] = typer.Option(None, "--run", help="run holding the op (default: the candidate)"),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
) -> None:
    """Replay one dumped op from its dumped inputs in fp32 and in the candidate format (under a fix)."""
    store = open_store(db)
    try:
        if op is None:
            for o in replayable_ops(store, session, run):
                echo(f"{o.op}  ({o.op_type} -> {o.replay_as})" + ("  non-finite" if o.nonfinite else ""))
            return
        # a dump file is read within the limits ingest used (`precision-lab config`); ConfigError is a ValueError
        res = replay_op(store, session, op, fixes=list(fix or []), run=run, read_limits=load_config().read_limits())
    except (SessionNotFound, ValueError) as e:
        _fail(str(e))
    echo(f"{res.op}: {res.op_type} replayed as {res.replay_as}; candidate {res.cand_format} "
               f"({res.policy})" + (f"; fix {res.fix}" if res.fix else ""))
    for n in res.notes:
        echo(f"  note: {n}")
    print_table(("output", "dtype", "NaN", "inf", "absmax", "SQNR vs fp32", "verdict"),
                [(r["output"], r["dtype"], r["nan"], r["inf"], fmt_num(r["absmax"]),
                  "-" if r["sqnr_db_vs_fp32"] is None else f"{r['sqnr_db_vs_fp32']:.1f} dB",
                  r["verdict_vs_fp32"] or "-") for r in res.rows()],
                right=("NaN", "inf", "absmax", "SQNR vs fp32"))
    c = res.comparisons.get("candidate vs dumped")
    if res.reproduces_dump:
        echo(f"  replay reproduces the dumped output {res.dump_match}")
    elif c is not None:
        echo(f"  replay differs from the dumped output: max abs difference {fmt_num(c.max_abs_err)}, "
                   f"{c.nonfinite_introduced} non-finite where the dump is finite")
    if res.fix and not res.fixed_is_finite:
        raise typer.Exit(EXIT_FAILED)
