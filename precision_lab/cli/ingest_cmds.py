"""``ingest`` and ``compare``: dump folders in, findings out (``report`` is in ``report_cmds``).

Exit status: 0 success; 1 a ``compare --fail-on`` condition tripped; 2 the
input cannot be used (missing or corrupt dump, unsafe zip, unknown session,
a condition that cannot be evaluated on this data).
"""

from __future__ import annotations

from typing import List, Optional

import typer

from ._app import app, echo
from ._common import DB_HELP, end_progress, html_report, open_store, tty_progress
from ._common import fail as _fail
from ..config import ConfigError, load_config
from ..services.ingest import IngestError, ingest
from ..services.report import build_report, render_text, to_json
from ..store import Store
from ._conditions import CONDITIONS, exit_on, parse_condition
from ..services.xdiff import DiffInputError, diff_records, diff_rows, render_diff_text, resolve_run, run_records
from ..jsoncodec import fields_tree


def _ingest(paths, reference, session, store, keep_tensors=False) -> str:
    try:  # the limits on what a dump may expand to come from the settings (`precision-lab config`)
        cfg = load_config()
    except ConfigError as e:
        _fail(str(e))
    progress = tty_progress()
    try:
        name = ingest(paths, reference=reference, session=session, store=store, progress=progress,
                      keep_tensors=keep_tensors, zip_limits=cfg.zip_limits(), read_limits=cfg.read_limits())
    except IngestError as e:
        end_progress(progress)
        _fail(str(e))
    end_progress(progress)
    return name


@app.command("ingest")
def ingest_cmd(
    paths: List[str] = typer.Argument(..., help="dump folder(s) or .zip archive(s) to ingest"),
    reference: Optional[List[str]] = typer.Option(None, "--reference", "-r",
                                                  help="fp32 reference dump (folder or .zip) to compare against"),
    session: Optional[str] = typer.Option(None, "--session", "-s", help="session name (default: from the paths)"),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    keep_tensors: bool = typer.Option(False, "--keep-tensors", help="also store the tensors themselves"),
) -> None:
    """Ingest dump folders (msprobe, precision-lab shards, .npy/.npz/.pt/.safetensors/.bin); print the session name."""
    store = open_store(db)
    echo(_ingest(paths, reference or None, session, store, keep_tensors))


@app.command("compare")
def compare_cmd(
    ref: str = typer.Argument(..., help="reference dump (folder or .zip), usually fp32"),
    cand: str = typer.Argument(..., help="candidate dump (folder or .zip)"),
    fail_on: Optional[List[str]] = typer.Option(
        None, "--fail-on", help=f"exit 1 when this holds: {CONDITIONS} (repeatable)"),
    db: Optional[str] = typer.Option(None, "--db", help="keep the session in this database (default: none kept)"),
    session: Optional[str] = typer.Option(None, "--session", "-s", help="session name"),
    as_json: bool = typer.Option(False, "--json", help="print the JSON report"),
) -> None:
    """Ingest REF and CAND, compare them op by op; for CI (exit 1 when --fail-on trips, 2 for unusable input)."""
    conditions = [parse_condition(c) for c in (fail_on or [])]
    store = open_store(db) if db else Store(":memory:")
    name = _ingest([cand], [ref], session, store)
    rep = build_report(store, name)
    echo(to_json(rep) if as_json else render_text(rep), nl=not as_json)
    exit_on(rep, conditions)


DIFF_CONDITIONS = ("diverged", "unpaired")


def _diff_run(spec: str, store, scratch) -> tuple[list, str]:
    """The records of one ``diff`` input: a dump folder or .zip (read into ``scratch``, tensors kept; ``PATH:RUN``
    picks one run of a dump that holds several), else ``SESSION`` or ``SESSION:RUN`` in ``store``."""
    from pathlib import Path  # noqa: PLC0415  (cheap; kept next to its one use)

    path, _, run = spec.rpartition(":") if not Path(spec).exists() and ":" in spec else (spec, "", "")
    try:
        if Path(path).exists():
            name = _ingest([path], None, None, scratch, keep_tensors=True)
            run_id, label = resolve_run(scratch, f"{name}:{run}" if run else name, path)
            return run_records(scratch, run_id), f"{path}" + (f":{run}" if run else "")
        if store is None:
            _fail(f"{spec}: no such dump folder or file (give --db to name a session)")
        run_id, label = resolve_run(store, spec)
        return run_records(store, run_id), label
    except DiffInputError as e:
        _fail(str(e))


@app.command("diff")
def diff_cmd(
    a: str = typer.Argument(..., help="reference: a dump folder or .zip, SESSION or SESSION:RUN (with --db)"),
    b: str = typer.Argument(..., help="candidate: the same kinds as A"),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    fail_on: Optional[List[str]] = typer.Option(
        None, "--fail-on", help=f"exit 1 when this holds: {', '.join(DIFF_CONDITIONS)} (repeatable)"),
    benign: Optional[str] = typer.Option(None, "--benign", help="a run of A's code that differs only in "
                                         "reduction order or kernels: its error widens each op's band"),
    ref_format: Optional[str] = typer.Option(None, "--ref-format", help="format A computed in (default: dtypes)"),
    cand_format: Optional[str] = typer.Option(None, "--cand-format", help="format B computed in (fp8 held in fp32)"),
    rows: int = typer.Option(40, "--rows", help="table rows to print around the first divergent pair"),
    as_json: bool = typer.Option(False, "--json", help="print every pair as JSON"),
    html_out: Optional[str] = typer.Option(None, "--html", help="also write a self-contained HTML page here"),
) -> None:
    """Pair the ops of two implementations by their data and name the first pair that diverges beyond what the
    formats explain (exit 1 when a --fail-on condition holds, 2 for unusable input)."""
    import json  # noqa: PLC0415

    for c in fail_on or []:
        if c not in DIFF_CONDITIONS:
            _fail(f"--fail-on {c!r}: give one of {', '.join(DIFF_CONDITIONS)}")
    scratch = Store(":memory:")
    store = open_store(db) if db else None
    ref, ref_label = _diff_run(a, store, scratch)
    cand, cand_label = _diff_run(b, store, scratch)
    bench = _diff_run(benign, store, scratch)[0] if benign else None
    try:
        result = diff_records(ref, cand, ref_format=ref_format, cand_format=cand_format, benign=bench)
    except KeyError as e:
        _fail(f"unknown format: {e.args[0]}")
    if as_json:
        first = result.first.pair.label if result.first else None
        echo(json.dumps({"reference": ref_label, "candidate": cand_label, "first_divergent": first,
                         "first_divergent_ops": ({"reference": list(result.first.pair.ref_ops),
                                                  "candidate": list(result.first.pair.cand_ops)}
                                                 if result.first else None),
                         "pairs": fields_tree(diff_rows(result)),
                         "unpaired_reference": [c.op for c in result.pairing.unpaired_ref],
                         "unpaired_candidate": [c.op for c in result.pairing.unpaired_cand]}, default=str))
    else:
        echo(render_diff_text(result, ref_label, cand_label, limit=rows))
    if html_out:
        try:
            html_report().write_diff_html(result, ref_label, cand_label, html_out)
        except OSError as e:
            _fail(f"--html {html_out}: {e.strerror or e}")
    tripped = [c for c in fail_on or [] if (c == "diverged" and result.diverged)
               or (c == "unpaired" and (result.pairing.unpaired_ref or result.pairing.unpaired_cand))]
    if tripped:
        raise typer.Exit(1)
