"""``report``: a stored session's findings, as text, JSON or HTML; ``--fail-on`` conditions for CI.

Exit status: 0 success; 1 a ``--fail-on`` condition tripped; 2 the input
cannot be used (unknown session, a condition that cannot be evaluated on this
data).
"""

from __future__ import annotations

from typing import List, Optional

import typer

from ._app import app, echo
from ._common import html_report, open_store
from ._common import fail as _fail
from ._conditions import CONDITIONS, exit_on, parse_condition
from ..services.report import build_report, render_text, to_json
from ..services.shards import ShardError, open_shards
from ..store import SessionNotFound


@app.command("report")
def report_cmd(
    session: Optional[str] = typer.Option(None, "--session", "-s", help="session name"),
    shards: Optional[str] = typer.Option(None, "--shards", help="instead of a session: a capture's shard folder, "
                                         "answered straight from its Parquet files (nothing ingested)"),
    db: Optional[str] = typer.Option(None, "--db", help="database file"),
    as_json: bool = typer.Option(False, "--json", help="print the stable JSON document instead of a table"),
    html_file: Optional[str] = typer.Option(None, "--html", help="also write a self-contained HTML page (opens "
                                            "offline) to this file"),
    fail_on: Optional[List[str]] = typer.Option(
        None, "--fail-on", help=f"exit 1 when this holds: {CONDITIONS} (repeatable)"),
) -> None:
    """Report a session: first non-finite producer per run, comparisons, diagnoses, alerts (exit 1 when
    --fail-on trips)."""
    conditions = [parse_condition(c) for c in (fail_on or [])]
    if (session is None) == (shards is None):
        _fail("give a session (--session) or a shard folder (--shards), one of them")
    if shards is not None:
        try:
            store, session = open_shards(shards)
        except ShardError as e:
            _fail(str(e))
    else:
        store = open_store(db)
    try:
        with store.held():  # one read-only open for the report's questions, let go before printing
            rep = build_report(store, session)
    except SessionNotFound as e:
        _fail(str(e))
    echo(to_json(rep) if as_json else render_text(rep), nl=False)
    if as_json:
        echo()
    if html_file:
        echo(f"wrote {html_report().write_html(store, session, html_file)}", err=True)  # stderr keeps --json clean
    exit_on(rep, conditions)
