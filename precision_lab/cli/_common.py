"""What every command module shares: failing with a message, opening the store, progress on a terminal."""

from __future__ import annotations

import sys
from typing import Callable, NoReturn, Optional

import typer
from ..store import Store
from ..config import ConfigError, load_config

EXIT_UNUSABLE = 2  # the request cannot be carried out

DB_HELP = "database file (default: $PRECISION_LAB_DB or the user data directory)"


def fail(msg: str, code: int = EXIT_UNUSABLE) -> NoReturn:
    """Print ``error: msg`` on stderr, as one line, and exit with ``code``.

    Control characters (a file name may hold a newline) are shown escaped,
    so a name cannot forge a second line of output.
    """
    msg = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(msg))
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def open_store(db: Optional[str], *, use_config: bool = False, code: int = EXIT_UNUSABLE):
    """The store at ``db``; with ``use_config`` an unset ``db`` is taken from the server config file.

    A database locked by another process, or a config file that cannot be
    read, ends the command with ``code`` and the reason.
    """

    db = db_setting(db, use_config=use_config, code=code)
    try:
        return Store(db)
    except RuntimeError as e:  # another process holds the file
        fail(str(e), code)


def db_setting(db: Optional[str], *, use_config: bool = False, code: int = EXIT_UNUSABLE) -> Optional[str]:
    """``db``, or with ``use_config`` and ``db`` unset the server config's ``db_path`` (None: the default)."""
    if db is None and use_config:
        try:
            db = load_config().db_path
        except ConfigError as e:
            fail(str(e), code)
    return db


def tty_progress() -> Optional[Callable[[int, int, str], None]]:
    """A one-line progress display on stderr, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int, label: str) -> None:
        pct = 100.0 * done / total if total else 100.0
        sys.stderr.write(f"\r{pct:5.1f}% [{done}/{total}] {label[-60:]:<60}")
        sys.stderr.flush()

    return show


def end_progress(show) -> None:
    """Clear the progress line, if one was shown."""
    if show is not None:
        sys.stderr.write("\r" + " " * 80 + "\r")
        sys.stderr.flush()
