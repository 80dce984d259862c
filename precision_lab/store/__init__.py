"""The DuckDB store: schema derived from the records, transactional writes.

One connection per database file per process (DuckDB is single-writer per
file); each thread gets its own cursor.  Every session is written inside one
transaction, so a failure (or a killed process) leaves no half session.

``Store`` is made of its parts: ``schema`` (tables, migrations, the foreign-file check), ``writer`` (transactions
and sessions; ``session_writer`` appends one session's rows), ``reader`` (queries, results, the sessions and
records it answers for by itself), over ``files`` (each database file's one connection in this process).
"""

from __future__ import annotations

import os
from typing import Optional

from ..config import LOCK_WAIT_ENV, env_lock_wait
from ..paths import default_data_dir, default_db_path, resolve_db_path
from ..tokens import token_file_for
from .connect import SAFE_CONFIG, connect_duckdb
from .files import DatabaseLocked, close_all, private_file, file_of, held, is_open, locked_message, writing  # noqa: F401
from .reader import Result, SessionNotFound, StoreReads
from .schema import (MIGRATIONS, SCHEMA_VERSION, TENSOR_COLUMNS, ForeignDatabase, StoreSchema,  # noqa: F401
                     tensor_columns)
from .session_writer import SessionWriter  # noqa: F401
from .transfer import move_summary_errors_sql  # noqa: F401
from .writer import StoreWrites

__all__ = ["Store", "Result", "held", "is_open", "close_all", "locked_message", "LOCK_WAIT_ENV", "default_db_path", "default_data_dir", "resolve_db_path", "open_store", "SessionNotFound",
           "DatabaseLocked", "ForeignDatabase", "SCHEMA_VERSION", "TENSOR_COLUMNS", "SAFE_CONFIG", "connect_duckdb"]


class Store(StoreReads, StoreWrites, StoreSchema):
    """A DuckDB database of sessions.  ``Store(":memory:")`` for a throwaway one (kept open while the process
    runs); a file is opened per operation and let go after it (see ``files``)."""

    def __init__(self, path: Optional[os.PathLike | str] = None, *, lock_wait: Optional[float] = None,
                 staged: bool = True, readable: tuple = (), known: bool = False, threads: Optional[int] = None):
        """``staged=False`` writes a new session straight into the file, holding it for the whole write (the
        baseline of bench/concurrency.py --staging); see ``new_session``.  ``readable`` (with
        ``path=":memory:"``): a database in memory of this ``Store``'s own, not the process's shared one, whose
        queries may read those files where they lie (``store.parquet``).  ``known``: a file this process has found
        current (or left so after its own write), unchanged since, is not opened to check it again (a capture
        makes a ``Store`` for each write).  ``threads`` (with ``readable``): DuckDB's threads for that database."""
        self.path = resolve_db_path(path)
        self.staged = staged
        self.lock_wait = env_lock_wait() if lock_wait is None else float(lock_wait)
        if readable and self.path != ":memory:":
            raise ValueError("Store(readable=...) is a database in memory: give path=':memory:'")
        self._file = private_file(readable, threads) if readable else file_of(self.path)
        self._lock = self._file.write_lock
        if not TENSOR_COLUMNS:
            TENSOR_COLUMNS[:] = [n for n, _ in tensor_columns()]
        # share links: the token file beside the database (precision_lab.tokens), or the in-memory database's own
        self._tokens = token_file_for(self.path) or self._file.memory_tokens
        if known and self._known_current():
            return
        with self.held():
            self._init_schema()

    def close(self) -> None:
        """Let go of the file now if no operation of this process is using it (it is let go after each
        operation anyway; kept for callers that close what they open)."""
        self._file.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def write_held_s(self) -> float:
        """Seconds this process has held the database file read-write so far (every ``Store`` of it)."""
        return self._file.write_held_s


def open_store(db: Optional[os.PathLike | str] = None) -> Store:
    return Store(db)
