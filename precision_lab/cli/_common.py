"""What every command module shares: failing with a message, opening the store, progress on a terminal."""

from __future__ import annotations

import io
import sys
from typing import Optional

from ..store import Store
from ..config import ConfigError, load_config
from ._app import EXIT_UNUSABLE, fail, echo
from ..display import visible

DB_HELP = "database file (default: $PRECISION_LAB_DB or the user data directory)"


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


class RichProgress:
    """A progress bar on stderr (``rich``), started at the first report and gone when stopped."""

    def __init__(self, console=None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                  MofNCompleteColumn(), console=console or Console(stderr=True), transient=True)
        self._task = None

    def __call__(self, done: int, total: int, label: str) -> None:
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task(label[-60:], total=max(total, 1))
        self._progress.update(self._task, completed=done, total=max(total, 1), description=label[-60:])

    def stop(self) -> None:
        if self._task is not None:
            self._progress.stop()
            self._task = None


def tty_progress() -> Optional[RichProgress]:
    """A progress bar on stderr, only when stderr is a terminal."""
    return RichProgress() if sys.stderr.isatty() else None


def end_progress(show) -> None:
    """Take the progress bar away, if one was shown."""
    if show is not None:
        show.stop()




def print_table(columns, rows, *, right=()) -> None:
    """Rows as aligned columns through rich (no borders, never wrapped, so each row stays one line a script can
    split); ``right``: the columns aligned right (numbers)."""
    from rich.console import Console  # deferred: commands that print no table start without it
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, show_edge=False, pad_edge=False, header_style="bold")
    for c in columns:
        table.add_column(c, justify="right" if c in right else "left", no_wrap=True)
    for r in rows:  # cells are text, never rich markup: a name "[bold]x" prints as itself
        table.add_row(*(Text(visible(str(v))) for v in r))
    out = Console(width=100_000, highlight=False, no_color=True, file=io.StringIO())
    out.print(table)
    for line in out.file.getvalue().splitlines():
        echo(line.rstrip())


def html_report():
    """The HTML report's module (``ui.html_report``), loaded only for ``--html``: its figures need pandas and
    plotly, which the other commands start without."""
    from ..ui import html_report as module  # deferred: pandas and plotly, only for --html

    return module
