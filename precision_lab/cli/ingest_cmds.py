"""``ingest`` and ``compare``: dump folders in, findings out (``report`` is in ``report_cmds``).

Exit status: 0 success; 1 a ``compare --fail-on`` condition tripped; 2 the
input cannot be used (missing or corrupt dump, unsafe zip, unknown session,
a condition that cannot be evaluated on this data).
"""

from __future__ import annotations

from typing import List, Optional

import typer

from ._app import app, echo
from ._common import DB_HELP, end_progress, open_store, tty_progress
from ._common import fail as _fail
from ..config import ConfigError, load_config
from ..services.ingest import IngestError, ingest
from ..services.report import build_report, render_text, to_json
from ..store import Store
from ._conditions import CONDITIONS, exit_on, parse_condition


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
