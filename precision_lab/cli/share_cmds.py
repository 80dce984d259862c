"""Sharing: export/import a session as one file, share links, server settings.

Exit status: 0 success; 2 the request cannot be carried out (no such
session, a refused or unreadable file, an output that cannot be written, a
bad server setting), as for every other command.
"""

from __future__ import annotations

from typing import Optional

import typer

from ._app import app, echo
from ._common import db_setting, fail, open_store
from ..services.share import ShareError, create_share_token, export_session, import_session, revoke_recorded_token, revoke_share_token, share_url
from ..store import DatabaseLocked, SessionNotFound, Store
from ..config import ConfigError, SETTINGS, load_config
from ..tokens import TokenFileError


def _store(db: Optional[str]):
    # the server's TOML file may name the database these commands act on
    return open_store(db, use_config=True)


@app.command("export")
def export_cmd(
    session: str = typer.Option(..., "--session", "-s", help="session name or id"),
    output: str = typer.Option(..., "--output", "-o", help="file to write (a .zip)"),
    db: Optional[str] = typer.Option(None, "--db", help="database file"),
) -> None:
    """Write a session (runs, records, histograms, comparisons, diagnoses, kept tensors) to one file."""
    store = _store(db)
    try:
        res = export_session(store, session, output)
    except (SessionNotFound, ShareError) as e:
        fail(str(e))
    except OSError as e:  # the output folder cannot be created or written
        fail(f"{output}: cannot write the export ({e.strerror or e})")
    echo(f"exported session {res.session!r} to {res.path} ({res.rows['runs']} runs, "
               f"{res.rows['tensors']} tensor records, {res.bytes} bytes)")


@app.command("import")
def import_cmd(
    file: str = typer.Argument(..., help="an exported session (.zip)"),
    as_name: Optional[str] = typer.Option(None, "--as", help="name for the imported session"),
    db: Optional[str] = typer.Option(None, "--db", help="database file"),
) -> None:
    """Import an exported session; an existing session is never replaced (the new one gets a suffix).

    A read-only server refuses imports from the browser; the command line is
    how whoever runs the server adds sessions to it, so it imports anyway.
    """
    try:
        config = load_config()  # the zip and upload limits apply here too
    except ConfigError as e:
        fail(str(e))
    store = _store(db)
    try:
        res = import_session(store, file, name=as_name, config=config)
    except ShareError as e:
        fail(str(e))
    echo(res.message)


@app.command("share-link")
def share_link_cmd(
    session: str = typer.Option(..., "--session", "-s", help="session name or id"),
    base_url: str = typer.Option("http://localhost:8501/", "--base-url", help="where the dashboard is served"),
    revoke: bool = typer.Option(False, "--revoke", help="make the session's current link stop working"),
    db: Optional[str] = typer.Option(None, "--db", help="database file"),
) -> None:
    """Give a session a read-only share link (a new token replaces the old one), or revoke it.

    Revoking works while a server holds the database: the tokens live in
    ``<database>.tokens.json``, which the server reads on every request.
    """
    path = db_setting(db, use_config=True)
    try:
        store = Store(path)
    except DatabaseLocked as e:
        if not revoke:
            fail(f"{e}. Creating a link needs the database: use the Overview page's share button of the "
                 "running server, or stop it first. Revoking works while it runs.")
        try:
            removed = revoke_recorded_token(path, session)
        except (TokenFileError, OSError) as e:
            fail(f"cannot revoke: {e}")
        if not removed:
            fail(f"no share link of a session named {session!r} is recorded; nothing was revoked (the database is "
                 "held by another process, so only recorded links can be looked up)")
        for r in removed:
            echo(f"share link of session {r.name!r} revoked; the server refuses it from its next "
                       "request")
        return
    except RuntimeError as e:
        fail(str(e))
    try:
        if revoke:
            revoke_share_token(store, session)
            echo(f"share link of session {session!r} revoked; a server refuses it from its next request")
            return
        token = create_share_token(store, session)
    except SessionNotFound as e:
        fail(str(e))
    except (TokenFileError, OSError) as e:
        fail(f"cannot {'revoke' if revoke else 'create'} the link: {e}")
    echo(share_url(base_url, token))


@app.command("config")
def config_cmd(
    config_file: Optional[str] = typer.Option(None, "--config", help="TOML file (default $PRECISION_LAB_CONFIG)"),
) -> None:
    """Print the server settings in effect and where they came from."""

    try:
        cfg = load_config(config_file)
    except ConfigError as e:
        fail(str(e))
    echo(f"settings from: {cfg.source}")
    for s in SETTINGS:
        v = getattr(cfg, s.name)
        if s.name == "list_sessions":
            v = cfg.can_list_sessions
        echo(f"  {s.name:<18} {str(v):<12} ({s.env})")
