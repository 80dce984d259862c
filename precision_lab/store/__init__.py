"""The DuckDB store: schema derived from the records, transactional writes.

One connection per database file per process (DuckDB is single-writer per
file); each thread gets its own cursor.  Every session is written inside one
transaction, so a failure (or a killed process) leaves no half session.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import random
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from ..display import few, visible
from ..paths import default_data_dir, default_db_path, replay_kit_path, resolve_db_path
from ..records import (Diagnosis, RunInfo, StepScalar, TensorRecord, TimelineRow, TimelineShare, dataclass_columns, free_name, npy_bytes, npy_load,
                       record_columns, stats_columns)
from ..enums import RunOrder, Verdict
from ..metrics import Comparison
from ..tokens import MemoryTokens, TokenFileError, token_file_for
from ..config import LOCK_WAIT_ENV, env_lock_wait
from ..scratch import scratch_dir, sweep
from .connect import SAFE_CONFIG, connect_duckdb
from .transfer import insert_staged_session, move_summary_errors_sql
from ..stats import HIST_EDGES_ID, HistogramError, TensorStats, decode_hist, encode_hist
from .queries import run_order

__all__ = ["Store", "Result", "held", "is_open", "close_all", "locked_message", "LOCK_WAIT_ENV", "default_db_path", "default_data_dir", "resolve_db_path", "open_store", "SessionNotFound",
           "DatabaseLocked", "ForeignDatabase", "SCHEMA_VERSION", "TENSOR_COLUMNS", "SAFE_CONFIG", "connect_duckdb"]

SCHEMA_VERSION = 7


class SessionNotFound(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; we want a sentence
        return str(self.args[0]) if self.args else "session not found"


class DatabaseLocked(RuntimeError):
    """Another process holds the database file (DuckDB allows one per file)."""


_ORDERS = RunOrder.words()


class ForeignDatabase(RuntimeError):
    """A database file this package did not make: it holds views or macros (code that would run as it is read) or
    another program's tables.  The message names the file and what it holds."""


# what a database holds beside tables: views and macros run when they are read, so a file holding them is refused
_FOREIGN_SQL = """SELECT (SELECT list(view_name ORDER BY view_name) FROM duckdb_views() WHERE NOT internal),
                         (SELECT list(function_name ORDER BY function_name) FROM duckdb_functions()
                          WHERE function_type IN ('macro', 'table_macro') AND NOT internal),
                         (SELECT list(table_name ORDER BY table_name) FROM duckdb_tables() WHERE NOT internal)"""


# ---- schema derived from the dataclasses ---------------------------------

_SQL = {"int": "BIGINT", "float": "DOUBLE", "str": "VARCHAR", "bool": "BOOLEAN"}


def tensor_columns() -> list[tuple[str, str]]:
    """(name, SQL type) of the ``tensors`` table: rid, record fields, stats fields, derived flags."""
    return [(n, _SQL[k]) for n, k in record_columns()]


def _stats_fields() -> list[tuple[str, str]]:
    return [(n, _SQL[k]) for n, k in stats_columns()]


def _dataclass_columns(cls, skip=()) -> list[tuple[str, str]]:
    return [(n, _SQL[k]) for n, k in dataclass_columns(cls, skip)]


TENSOR_COLUMNS: list[str] = []  # filled on first Store() (stats module may import late)


def _comparison_columns() -> list[tuple[str, str]]:
    return (
        [("session_id", "VARCHAR"), ("kind", "VARCHAR"), ("ref_run_id", "VARCHAR"), ("ref_rid", "BIGINT"),
         ("cand_run_id", "VARCHAR"), ("cand_rid", "BIGINT"), ("step", "BIGINT"), ("rank", "BIGINT"),
         ("seq", "BIGINT"), ("op", "VARCHAR"), ("role", "VARCHAR"), ("index", "VARCHAR"),
         ("match", "VARCHAR")]
        + _dataclass_columns(Comparison)
    )


def _schema_sql() -> list[str]:
    tcols = tensor_columns()
    ccols = _comparison_columns()
    rcols = _dataclass_columns(RunInfo)
    dcols = _dataclass_columns(Diagnosis, skip=("fixes",)) + [("fixes", "VARCHAR")]

    def cols(spec):
        return ", ".join(f'"{n}" {t}' for n, t in spec)

    return [
        "CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
        "CREATE TABLE IF NOT EXISTS sessions (session_id VARCHAR PRIMARY KEY, name VARCHAR UNIQUE, "
        "created VARCHAR, source VARCHAR, recipe VARCHAR, notes VARCHAR)",
        f"CREATE TABLE IF NOT EXISTS runs ({cols(rcols)})",
        f"CREATE TABLE IF NOT EXISTS tensors ({cols(tcols)})",
        "CREATE TABLE IF NOT EXISTS histograms (run_id VARCHAR, rid BIGINT, edges_id VARCHAR, "
        "bins INTEGER[], counts BIGINT[])",
        "CREATE TABLE IF NOT EXISTS tensor_data (run_id VARCHAR, rid BIGINT, npy BLOB)",
        f"CREATE TABLE IF NOT EXISTS comparisons ({cols(ccols)})",
        f"CREATE TABLE IF NOT EXISTS diagnoses ({cols(dcols)})",
        "CREATE TABLE IF NOT EXISTS warnings (session_id VARCHAR, run_id VARCHAR, file VARCHAR, message VARCHAR)",
        f"CREATE TABLE IF NOT EXISTS timeline ({cols(_dataclass_columns(TimelineRow))})",
        f"CREATE TABLE IF NOT EXISTS timeline_formats ({cols(_dataclass_columns(TimelineShare))})",
        f"CREATE TABLE IF NOT EXISTS step_scalars ({cols(_dataclass_columns(StepScalar))})",
    ]


def _move_share_tokens_out(store: "Store", cur) -> None:
    """Before schema 7 the sessions table kept a copy of each share token beside the token file; the file is
    now their one record.  A database that has no token file yet gets one from its column (a file that
    exists was already the source of truth, and stays as it is)."""
    tokens = store._tokens
    columns = [r[0] for r in cur.execute("DESCRIBE sessions").fetchall()]
    if "share_token" not in columns or tokens.exists():
        return
    held = {sid: {"name": name, "token": tok} for sid, name, tok in
            cur.execute("SELECT session_id, name, share_token FROM sessions WHERE share_token IS NOT NULL "
                        "AND share_token <> ''").fetchall()}
    if held:
        try:
            tokens.update(lambda s: s.update(held))
        except OSError as e:  # the upgrade is rolled back: the database keeps its tokens and schema 6
            raise RuntimeError(f"cannot upgrade database {store.path}: its share links could not be written "
                               f"to {tokens.path} ({e.strerror or e})") from None


# Migrations from version N-1 to N, applied in order by _migrate(): SQL, or a function of (store, cursor).
MIGRATIONS: dict[int, list] = {
    2: ['ALTER TABLE tensors ADD COLUMN IF NOT EXISTS "neg_inf_count" BIGINT'],  # signed inf counts
    3: ['ALTER TABLE tensors ADD COLUMN IF NOT EXISTS "parent" VARCHAR'],  # the module call an op ran inside
    # the user code that called an op; the timeline tables are created by _schema_sql()
    4: ['ALTER TABLE tensors ADD COLUMN IF NOT EXISTS "location" VARCHAR'],
    # a statistics-only comparison's errors in their own columns, apart from the element-wise ones
    5: ['ALTER TABLE comparisons ADD COLUMN IF NOT EXISTS "summary_abs_err" DOUBLE',
        'ALTER TABLE comparisons ADD COLUMN IF NOT EXISTS "summary_rel_err" DOUBLE',
        move_summary_errors_sql()],
    # positions masked in both runs, compared as equal (metrics.Comparison.masked)
    6: ['ALTER TABLE comparisons ADD COLUMN IF NOT EXISTS "masked" BIGINT'],
    # share tokens in the token file only (precision_lab.tokens)
    7: [_move_share_tokens_out, "ALTER TABLE sessions DROP COLUMN IF EXISTS share_token"],
}


# ---- connections ------------------------------------------------------------
#
# DuckDB lets one process write a file, or any number of processes read it, never both.  So no process holds
# the file between operations: each operation (a query, a batch of reads, a write transaction) takes the
# file's connection, and the connection is closed again as soon as no operation of this process uses it.
# Reads open the file read-only, so dashboards and `report`s read side by side; a write opens it read-write
# for its transaction only.  An open that meets another process's lock is retried with backoff for up to
# ``config.env_lock_wait()`` seconds, then refused in one sentence naming the process that holds it.  ``Store.held()``
# keeps a read-only connection between operations for a bounded stretch (one dashboard page run), since an
# open costs ~10 ms and a page asks dozens of questions.

_WRITER_FIRST_S = 1.0  # how long a new read waits for a write of its own process that is waiting to start
_READ = re.compile(r"\s*(\(|SELECT|WITH|FROM|VALUES|TABLE|DESCRIBE|SHOW|SUMMARIZE|EXPLAIN)\b", re.I)
_HOLDER = re.compile(r"Conflicting lock is held in (?P<exe>.*?) \(PID (?P<pid>\d+)\)")


_ABS_DIRS = re.compile(r"(?:(?<=^)|(?<=[=:,\s]))/(?:[^/\s]*/)+")


def _holder(message: str) -> str:
    """Who holds the file, from DuckDB's lock message: ``process 123 (streamlit run app.py)``."""
    m = _HOLDER.search(message)
    if m is None:
        return "another process"
    pid = m.group("pid")
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        argv = [m.group("exe")]
    # an absolute path by its last name (where it starts a word or follows "=", ":" or ","); other slashes stay
    words = [_ABS_DIRS.sub("", a) for a in argv[:4]]
    what = visible(" ".join(" ".join(w.split()) for w in words))  # one line, whatever the command line held
    what = what if len(what) <= 80 else what[:79] + "…"
    return f"process {pid}" + (f" ({what})" if what else "")


def locked_message(path: str, message: str, waited: float) -> str:
    """The one sentence for a database another process held longer than we waited."""
    return (f"database {path} is in use by {_holder(message)} and did not become free within {waited:g} s; "
            f"try again when it is done, or wait longer with {LOCK_WAIT_ENV}=SECONDS")


def _is_lock_error(e: BaseException) -> bool:
    return "lock" in str(e).lower()


def _check_header(path: str) -> None:
    """Refuse an existing file that is not a DuckDB database (DuckDB's files say ``DUCK`` at byte 8) before
    DuckDB reads it: a SQLite file would make it look for an extension."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return  # a new file, or one DuckDB will name the problem of
    if head and head[8:12] != b"DUCK":
        kind = " (it is a SQLite database)" if head.startswith(b"SQLite format 3") else ""
        raise RuntimeError(f"cannot open database {path}: not a DuckDB database file{kind}")


def _connect(path: str, read_only: bool, wait: float, deadline: Optional[float] = None):
    """``duckdb.connect``, retried with backoff while another process holds the file (up to ``wait`` s, or until
    ``deadline`` on ``time.monotonic()``'s clock where the wait began earlier)."""
    import duckdb

    deadline = time.monotonic() + wait if deadline is None else deadline
    _check_header(path)
    delay = 0.002
    while True:
        try:
            return connect_duckdb(path, read_only=read_only)
        except duckdb.IOException as e:
            if not _is_lock_error(e):
                reason = str(e).split("\n")[0].removeprefix("IO Error: ")
                raise RuntimeError(f"cannot open database {path}: {reason}") from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise DatabaseLocked(locked_message(path, str(e), wait)) from None
            time.sleep(min(left, delay * (0.5 + random.random())))
            delay = min(delay * 2, 0.1)
        except duckdb.Error as e:
            raise RuntimeError(f"cannot open database {path}: {str(e).splitlines()[0]}") from None


def _rollback(cur) -> None:
    """End a transaction that failed or only read; a connection DuckDB has already invalidated (disk full, out of
    memory) refuses the rollback too, and the error that matters is the one before it."""
    import duckdb

    try:
        cur.execute("ROLLBACK")
    except duckdb.Error:
        pass


class _File:
    """One database file's connection in this process: opened when an operation needs it, closed when the
    last operation is done (unless held), read-only unless a write needs it."""

    def __init__(self, path: str, readable: tuple = ()):
        self.path = path
        self.memory = path == ":memory:"
        self.readable = readable  # files an in-memory database of its own may read (``Store(readable=...)``)
        self.cond = threading.Condition(threading.Lock())
        self.write_lock = threading.RLock()  # writers of this process, one at a time
        self.con = None
        self.read_only = False
        self.active = 0  # operations using the connection now
        self.holds = 0  # Store.held() blocks: keep a read-only connection between operations
        self.write_holds = 0  # Store.writing() blocks: keep a read-write connection between operations
        self.writers_waiting = 0  # writes of this process waiting for its reads to end (new reads wait a little)
        self.memory_tokens = MemoryTokens() if self.memory else None  # share tokens of a database in memory
        self.opening = False  # a thread is opening the file (outside the lock, retrying while another process holds it)
        self.tx = threading.local()  # the cursor of this thread's open transaction
        self.commits = 0  # transactions committed by this process (the version of an in-memory database)
        self.write_held_s = 0.0  # seconds this process has held the file read-write (benches)
        self._rw_since: Optional[float] = None
        # the file as this process last found it holding no code (Store._refuse_foreign) or left it after its own
        # write (_identity): another Store of the file, unchanged since, skips the check (a listing of every
        # function, some 15 ms)
        self.vetted: Optional[tuple] = None

    def acquire(self, write: bool, wait: float):
        deadline = time.monotonic() + wait
        with self.cond:
            polite = time.monotonic() + _WRITER_FIRST_S
            while True:
                if self.con is not None and (self.memory or not write or not self.read_only):
                    if (not write and self.read_only and self.writers_waiting and not self.memory
                            and self.cond.wait(max(0.0, polite - time.monotonic()))):
                        continue  # a write of this process is waiting for the reads to end: let it go first
                    self.active += 1
                    return self.con
                if self.opening or (self.con is not None and self.active):
                    # another thread is opening the file, or it is read-only now and a write waits for the reads
                    left = deadline - time.monotonic()
                    self.writers_waiting += write
                    try:
                        woke = left > 0 and self.cond.wait(left)
                    finally:
                        self.writers_waiting -= write
                    if not woke and self.opening:
                        raise DatabaseLocked(locked_message(self.path, "", wait))
                    if not woke:
                        raise DatabaseLocked(f"database {self.path} is being read by this process for longer "
                                             f"than {wait:g} s; a write could not start")
                    continue
                self._close()
                if self.memory:
                    self.con, self.read_only = connect_duckdb(readable=self.readable), False
                    self.active += 1
                    return self.con
                exists = os.path.exists(self.path)
                ro = exists and not write and not self.write_holds  # a writing() block opens read-write
                self.opening = True  # the open (and its retries) runs outside the lock: other threads go on
                self.active += 1
                break
        con = None
        try:
            if not exists:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            con = _connect(self.path, ro, wait, deadline)
        finally:
            with self.cond:
                self.opening = False
                if con is None:
                    self.active -= 1
                else:
                    self.con, self.read_only = con, ro
                    self._rw_since = None if ro else time.monotonic()
                self.cond.notify_all()  # waiting threads may use this connection (or try the open themselves)
        return con

    def release(self) -> None:
        with self.cond:
            self.active -= 1
            if not self.active:
                # a write's connection goes at once (other processes wait on it) unless a writing() block
                # holds it; a read's when nothing holds it
                if not self.memory and self.write_holds == 0 and (self.holds == 0 or not self.read_only):
                    self._close()
                self.cond.notify_all()

    def hold(self, delta: int) -> None:
        with self.cond:
            self.holds += delta
            if not self.holds and not self.write_holds and not self.active and not self.memory:
                self._close()

    def hold_write(self, delta: int) -> None:
        with self.cond:
            self.write_holds += delta
            if not self.write_holds and not self.active and not self.memory and (self.holds == 0 or
                                                                                 not self.read_only):
                self._close()

    def close(self) -> bool:
        with self.cond:
            if self.active:
                return False
            self._close()
            return True

    def _close(self) -> None:
        con, self.con = self.con, None
        if con is not None:
            try:
                con.close()  # a read-write connection checkpoints as it closes: part of the hold
            except Exception:
                pass
            if not self.read_only and self.vetted is not None and not self.memory:
                self.vetted = _identity(self.path)  # this process's own writes hold no code
        if self._rw_since is not None:
            self.write_held_s += time.monotonic() - self._rw_since
            self._rw_since = None

    @property
    def is_open(self) -> bool:
        return self.con is not None


class Result:
    """A query's result, read once: ``fetchall``, ``fetchone``, ``df``, ``fetchnumpy``, ``description``.

    Outside a transaction a read runs when it is read: the connection is taken, the query run, its rows
    converted and the connection let go, all in that call.  An unread ``Result`` holds nothing (a traceback
    that keeps one alive keeps no file open), and there is nothing to let go when it is dropped.  Inside a
    transaction the query ran on the transaction's cursor and is read from it."""

    def __init__(self, run):
        self._run = run  # how -> (description, value): runs the query (or reads the transaction's cursor)
        self._description: Optional[list] = None
        self._rows: Optional[list] = None

    def _get(self, how: str):
        self._description, value = self._run(how)
        return value

    @property
    def description(self):
        if self._description is None and self._rows is None:
            self._rows = self._get("fetchall")
        return self._description

    def fetchall(self) -> list:
        if self._rows is None:
            self._rows = self._get("fetchall")
        rows, self._rows = self._rows, []
        return rows

    def fetchone(self):
        if self._rows is None:
            self._rows = self._get("fetchall")
        return self._rows.pop(0) if self._rows else None

    def __iter__(self):
        return iter(self.fetchall())

    def df(self):
        return self._get("df")

    def fetchnumpy(self):
        return self._get("fetchnumpy")


def _written(rows: list, how: str) -> list:
    if how != "fetchall":
        raise TypeError("a statement that writes returns its rows to fetchall or fetchone only")
    return rows


def _read_cursor(cur):
    """``Result``'s reader of a cursor that has run its query (a transaction's)."""
    return lambda how: (cur.description, getattr(cur, how)())


_FILES: dict[str, _File] = {}
_GLOBAL = threading.Lock()


def _file(path: str) -> _File:
    with _GLOBAL:
        f = _FILES.get(path)
        if f is None:
            f = _FILES[path] = _File(path)
        return f


@contextmanager
def _holding(path, write: bool):
    f = _file(resolve_db_path(path))
    hold = f.hold_write if write else f.hold
    hold(1)
    try:
        yield
    finally:
        hold(-1)


def writing(path: Optional[os.PathLike | str] = None):
    """``Store.writing()`` for the database at ``path``, begun before any ``Store`` of it is made (whose
    schema check is then part of the block)."""
    return _holding(path, True)


def held(path: Optional[os.PathLike | str] = None):
    """``Store.held()`` for the database at ``path``, before any ``Store`` of it exists (a dashboard page run)."""
    return _holding(path, False)


def is_open(path: Optional[os.PathLike | str]) -> bool:
    """Whether this process has the database at ``path`` open right now (between operations it has not,
    unless ``Store.held()`` keeps it)."""
    with _GLOBAL:
        f = _FILES.get(resolve_db_path(path))
    return f is not None and f.is_open


def close_all() -> None:
    """Close every connection no operation is using (tests, shutdown).  A file in use stays open for its
    operations; every file stays known, so a ``Store`` made afterwards shares its connection and locks with
    the ``Store``s made before (two per file in one process would open it twice)."""
    with _GLOBAL:
        files = list(_FILES.values())
    for f in files:
        f.close()


def _identity(path: str) -> Optional[tuple]:
    """(device, inode, modification time, size) of a file and its write-ahead log, None when the file is not
    there: a write, or another file put in its place, changes it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    try:
        wal = os.stat(path + ".wal")
        log = (wal.st_mtime_ns, wal.st_size)
    except OSError:
        log = None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, log


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


_DERIVED = ("nonfinite", "has_hist")  # tensors columns worked out from a record's statistics


def _shape_json(shape) -> str:
    return json.dumps([int(s) for s in shape]) if shape is not None else "null"


class Store:
    """A DuckDB database of sessions.  ``Store(":memory:")`` for a throwaway one (kept open while the process
    runs); a file is opened per operation and let go after it (see "connections" above)."""

    def __init__(self, path: Optional[os.PathLike | str] = None, *, lock_wait: Optional[float] = None,
                 staged: bool = True, readable: tuple = ()):
        """``staged=False`` writes a new session straight into the file, holding it for the whole write (the
        baseline of bench/concurrency.py --staging); see ``new_session``.  ``readable`` (with
        ``path=":memory:"``): a database in memory of this ``Store``'s own, not the process's shared one, whose
        queries may read those files where they lie (``store.parquet``)."""
        self.path = resolve_db_path(path)
        self.staged = staged
        self.lock_wait = env_lock_wait() if lock_wait is None else float(lock_wait)
        if readable and self.path != ":memory:":
            raise ValueError("Store(readable=...) is a database in memory: give path=':memory:'")
        self._file = _File(self.path, tuple(str(p) for p in readable)) if readable else _file(self.path)
        self._lock = self._file.write_lock
        if not TENSOR_COLUMNS:
            TENSOR_COLUMNS[:] = [n for n, _ in tensor_columns()]
        # share links: the token file beside the database (precision_lab.tokens), or the in-memory database's own
        self._tokens = token_file_for(self.path) or self._file.memory_tokens
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

    # -- connection plumbing
    @property
    def write_held_s(self) -> float:
        """Seconds this process has held the database file read-write so far (every ``Store`` of it)."""
        return self._file.write_held_s

    @contextmanager
    def held(self):
        """Keep the database open between the operations of this block (read-only; a write in it still takes
        the file for its transaction only).  For a bounded stretch such as one dashboard page run: other
        processes' writes wait while it lasts."""
        with held(self.path):
            yield self

    @contextmanager
    def writing(self):
        """Keep the database open between the operations of this block, read-write from its first write on (a
        write and the reads and writes that follow it, such as a capture's session and its diagnosis): one
        open instead of one per operation.  Other processes wait while it lasts: keep it to one short stretch
        of work."""
        with writing(self.path):
            yield self

    def data_version(self) -> tuple:
        """A cheap token that changes whenever a write commits: the database file's and its write-ahead log's
        modification time and size (no query, the file is not opened)."""
        if self._file.memory:
            return (id(self._file), self._file.commits)
        out = []
        for p in (self.path, self.path + ".wal"):
            try:
                st = os.stat(p)
                out += [st.st_mtime_ns, st.st_size]
            except OSError:
                out += [None, None]
        return tuple(out)

    @contextmanager
    def reading(self):
        """A cursor for several reads that must see one state of the database (one read transaction)."""
        tx = getattr(self._file.tx, "cur", None)
        if tx is not None:
            yield tx
            return
        with self._cursor() as cur:
            cur.execute("BEGIN TRANSACTION")
            try:
                yield cur
            finally:
                _rollback(cur)

    @contextmanager
    def _cursor(self):
        """A cursor of the file's connection, taken read-only for this block and given back after it."""
        con = self._file.acquire(False, self.lock_wait)
        cur = None
        try:  # the connection is given back whatever fails, the cursor's creation included
            cur = con.cursor()
            yield cur
        finally:
            if cur is not None:
                cur.close()
            self._file.release()

    def sql(self, query: str, params: Optional[list] = None) -> "Result":
        """Run a query; returns a ``Result`` (``.df()``, ``.fetchall()``, ``.fetchone()``), read once.  Inside
        a transaction of this thread, the query runs in it (it sees what the transaction wrote)."""
        tx = getattr(self._file.tx, "cur", None)
        if tx is not None:
            return Result(_read_cursor(tx.execute(query, params or [])))
        if not _READ.match(query):  # a statement that writes: a transaction of its own, run now
            with self.transaction() as cur:
                rows = cur.execute(query, params or []).fetchall()
                description = cur.description
            return Result(lambda how: (description, _written(rows, how)))
        params = list(params or [])

        def run(how: str):
            with self._cursor() as cur:
                cur.execute(query, params)
                return cur.description, getattr(cur, how)()

        return Result(run)

    def df(self, query: str, params: Optional[list] = None):
        return self.sql(query, params).df()

    def _refuse_foreign(self) -> None:
        """Refuse a file that holds views or macros, or tables but none of ours (``ForeignDatabase``)."""
        if self._file.memory:
            return
        f = self._file
        if f.vetted is not None and ((f.con is not None and not f.read_only) or f.vetted == _identity(self.path)):
            return  # unchanged since it was found clean, or open read-write here (no other process writes it)
        views, macros, tables = self.sql(_FOREIGN_SQL).fetchone()
        held = []
        if views:
            held.append(f"views ({few(views)})")
        if macros:
            held.append(f"macros ({few(macros)})")
        if tables and "meta" not in tables:
            held.append(f"another program's tables ({few(tables)})")
        if held:
            raise ForeignDatabase(f"database {self.path} was not made by Precision Lab: it holds {' and '.join(held)}; "
                                  "a database is opened as data only, and one holding code or another "
                                  "program's tables is refused")
        self._file.vetted = _identity(self.path)

    def _init_schema(self) -> None:
        try:
            self._refuse_foreign()
        except (DatabaseLocked, ForeignDatabase):
            raise
        except RuntimeError as e:
            if "cannot open database" in str(e):
                raise
        try:  # a database at this version has every table: one query instead of a dozen CREATEs
            row = self.sql("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is not None and row[0] == str(SCHEMA_VERSION):
                return
        except DatabaseLocked:
            raise
        except RuntimeError as e:
            if "cannot open database" in str(e):
                raise
        except Exception:  # no meta table yet: a new database
            pass
        with self.transaction() as cur:
            for stmt in _schema_sql():
                cur.execute(stmt)
            row = cur.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                cur.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
            else:
                self._migrate(cur, int(row[0]))

    def _migrate(self, cur, version: int) -> None:
        """Inside the schema's transaction: all versions or none, so an interrupted upgrade leaves the old
        database."""
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"database {self.path} has schema version {version}, newer than this Precision Lab "
                f"({SCHEMA_VERSION}); upgrade precision-lab"
            )
        for v in range(version + 1, SCHEMA_VERSION + 1):
            for stmt in MIGRATIONS.get(v, []):
                if callable(stmt):
                    stmt(self, cur)
                else:
                    cur.execute(stmt)
            cur.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(v)])

    def schema_version(self) -> int:
        return int(self.sql("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])

    @contextmanager
    def transaction(self):
        """One atomic write: the file is opened read-write for it (waiting, within ``lock_wait``, for other
        processes to let go), writers of this process take turns, and the file is let go when it commits.
        A failure or a killed process leaves nothing of it."""
        tx = getattr(self._file.tx, "cur", None)
        if tx is not None:  # nested in this thread's transaction: part of it
            yield tx
            return
        with self._lock:
            con = self._file.acquire(True, self.lock_wait)
            cur = None
            try:  # the read-write connection is given back whatever fails, the cursor's creation included
                cur = con.cursor()
                self._file.tx.cur = cur
                cur.execute("BEGIN TRANSACTION")
                try:
                    yield cur
                except BaseException:
                    _rollback(cur)  # the error that ended the work is the one raised, not the rollback's
                    raise
                else:
                    cur.execute("COMMIT")
                    self._file.commits += 1
            finally:
                self._file.tx.cur = None
                try:
                    if cur is not None:
                        cur.close()
                finally:
                    self._file.release()

    # -- writing
    @contextmanager
    def new_session(self, name: Optional[str] = None, *, source: str = "", recipe: Optional[str] = None,
                    notes: Optional[dict] = None, exist_ok_rename: bool = True) -> Iterator["SessionWriter"]:
        """Write one session atomically: ``with store.new_session("x") as w: w.add_run(...)``; ``w.name`` after
        the block is the name it got (made unique unless ``exist_ok_rename`` is false: then a taken name is a
        ``ValueError``).

        A file database's session is first written to a private staging database in the scratch folder and then
        inserted into the shared file in one short transaction, so a long ingest or capture holds the file (and
        keeps other processes' writes, and dashboards' reads, waiting) only for that insert.  A failure or a
        killed process before it leaves the shared file as it was; the staging folder goes with the block (a
        killed process's is swept by the next writer)."""
        if self.staged and not self._file.memory:
            with self._staged_session(name or _default_session_name(source), source=source, recipe=recipe,
                                      notes=notes, rename=exist_ok_rename) as w:
                yield w
            return
        with self.transaction() as cur:
            name = self._unique_name(cur, name or _default_session_name(source), rename=exist_ok_rename)
            sid = uuid.uuid4().hex[:12]
            cur.execute(
                "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?)",
                [sid, name, _now(), source, recipe, json.dumps(notes or {})],
            )
            w = SessionWriter(self, cur, sid, name)
            yield w
            w.flush()

    @contextmanager
    def _staged_session(self, name: str, *, source: str, recipe: Optional[str], notes: Optional[dict],
                        rename: bool) -> Iterator["SessionWriter"]:
        if not rename:  # a taken name fails before the work, not only at the insert
            with self.reading() as cur:
                self._unique_name(cur, name, rename=False)
        sweep()
        with scratch_dir("stage") as folder:
            con = connect_duckdb(str(folder / "session.duckdb"))
            try:
                for stmt in _schema_sql():
                    con.execute(stmt)
                cur = con.cursor()
                cur.execute("BEGIN TRANSACTION")
                sid = uuid.uuid4().hex[:12]
                cur.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?)",
                            [sid, name, _now(), source, recipe, json.dumps(notes or {})])
                w = SessionWriter(self, cur, sid, name)
                yield w
                w.flush()
                cur.execute("COMMIT")
                w.name, w.session_id = insert_staged_session(self, con, sid, name, rename=rename)
            finally:
                con.close()

    @contextmanager
    def extend_session(self, session: str) -> Iterator["SessionWriter"]:
        """Add runs/records to an existing session atomically (re-runs)."""
        info = self.session(session)
        with self.transaction() as cur:
            w = SessionWriter(self, cur, info["session_id"], info["name"])
            yield w
            w.flush()

    def _unique_name(self, cur, name: str, rename: bool) -> str:
        existing = {r[0] for r in cur.execute("SELECT name FROM sessions").fetchall()}
        if name not in existing:
            return name
        if not rename:
            raise ValueError(f"a session named {name!r} already exists")
        return free_name(name, existing)

    # -- reading
    def undiagnosed_sessions(self) -> list[str]:
        """Names of the sessions whose diagnoses were never computed (no ``diagnosed`` mark in their notes)."""
        out = []
        for name, notes in self.sql("SELECT name, notes FROM sessions ORDER BY created, name").fetchall():
            try:
                doc = json.loads(notes or "{}")
            except ValueError:
                doc = {}
            if not (isinstance(doc, dict) and doc.get("diagnosed")):
                out.append(name)
        return out

    def sessions(self):
        """All sessions with run counts, newest first (DataFrame)."""
        return self.df(
            "SELECT s.session_id, s.name, s.created, s.source, s.recipe, "
            "(SELECT count(*) FROM runs r WHERE r.session_id = s.session_id) AS runs "
            "FROM sessions s ORDER BY s.created DESC, s.name"
        )

    def session(self, session: str) -> dict:
        """A session by name or id; raises SessionNotFound with the known names."""
        row = self.sql(
            "SELECT session_id, name, created, source, recipe, notes FROM sessions "
            "WHERE name = ? OR session_id = ?", [session, session]
        ).fetchone()
        if row is None:
            names = [r[0] for r in self.sql("SELECT name FROM sessions ORDER BY name").fetchall()]
            known = ", ".join(names[:20]) if names else "none yet"
            raise SessionNotFound(f"no session named {session!r} (known sessions: {known})")
        keys = ["session_id", "name", "created", "source", "recipe", "notes"]
        d = dict(zip(keys, row))
        d["notes"] = json.loads(d["notes"] or "{}")
        return d

    def runs(self, session_id: str):
        return self.df(f"SELECT * FROM runs WHERE session_id = ? ORDER BY {run_order()}", [session_id])

    def run(self, run_id: str) -> dict:
        df = self.df("SELECT * FROM runs WHERE run_id = ?", [run_id])
        if df.empty:
            raise KeyError(f"no run {run_id!r}")
        return df.iloc[0].to_dict()

    def rename_session(self, session: str, new_name: str) -> None:
        new_name = new_name.strip()
        if not new_name:
            raise ValueError("a session name cannot be empty")
        info = self.session(session)
        with self.transaction() as cur:
            if cur.execute("SELECT 1 FROM sessions WHERE name = ? AND session_id <> ?",
                           [new_name, info["session_id"]]).fetchone():
                raise ValueError(f"a session named {new_name!r} already exists")
            cur.execute("UPDATE sessions SET name = ? WHERE session_id = ?", [new_name, info["session_id"]])
            self._rename_token(info["session_id"], new_name)

    def delete_session(self, session: str) -> None:
        info = self.session(session)
        sid = info["session_id"]
        with self.transaction() as cur:
            run_ids = [r[0] for r in cur.execute("SELECT run_id FROM runs WHERE session_id = ?", [sid]).fetchall()]
            for t in ("tensors", "histograms", "tensor_data", "timeline", "timeline_formats", "step_scalars"):
                for rid in run_ids:
                    cur.execute(f"DELETE FROM {t} WHERE run_id = ?", [rid])
            for t in ("comparisons", "diagnoses", "warnings", "runs", "sessions"):
                cur.execute(f"DELETE FROM {t} WHERE session_id = ?", [sid])
            self._drop_token(sid)
        for rid in run_ids:  # a training capture's replay kit goes with its run
            try:
                kit = replay_kit_path(self.path, rid)
                if kit is not None:
                    kit.unlink(missing_ok=True)
            except (ValueError, OSError):
                pass

    def _drop_token(self, session_id: str) -> None:
        """A session deleted (or a new one given an id a deleted one had) has no link.  A token file that cannot
        be read or written does not stop that write: a token of a session that no longer exists opens nothing,
        and a damaged file opens nothing at all."""
        try:
            if session_id in (self._tokens.sessions() or {}):
                self._tokens.set(session_id, "", None)
        except (TokenFileError, OSError):
            pass

    def _rename_token(self, session_id: str, new_name: str) -> None:
        """Keep the name recorded beside a session's token current (revocation by name uses it)."""

        try:
            if session_id not in (self._tokens.sessions() or {}):
                return
        except TokenFileError:
            return

        def rename(s: dict) -> None:
            if session_id in s:
                s[session_id]["name"] = new_name

        self._tokens.update(rename)

    # -- share links: the token file beside the database is their one record (precision_lab.tokens)
    def set_share_token(self, session: str, token: Optional[str]) -> None:
        """Give ``session`` the share token ``token`` (None: revoke it)."""
        info = self.session(session)
        self._tokens.set(info["session_id"], info["name"], token)

    def session_by_token(self, token: str) -> Optional[dict]:
        """The session ``token`` opens, or None: the token file is read per call (a revocation written by
        another process counts from the next call), without the database's lock; a token file that cannot be
        read opens nothing."""
        if not token:
            return None
        try:
            sid = self._tokens.lookup(token)
        except TokenFileError:
            return None
        if sid is None:
            return None
        try:
            return self.session(sid)
        except SessionNotFound:
            return None

    def histogram(self, run_id: str, rid: int) -> Optional[np.ndarray]:
        """Dense histogram counts of one record, or None (stats-only record)."""

        row = self.sql("SELECT edges_id, bins, counts FROM histograms WHERE run_id = ? AND rid = ?",
                       [run_id, int(rid)]).fetchone()
        if row is None:
            return None
        edges_id, bins, counts = row
        try:
            return decode_hist(bins, counts, edges_id=edges_id)
        except HistogramError as e:
            raise ValueError(f"histogram of run {run_id} record {rid}: {e}; re-ingest the dump") from None

    def tensor(self, run_id: str, rid: int):
        """A kept tensor as a numpy array, or None."""
        row = self.sql("SELECT npy FROM tensor_data WHERE run_id = ? AND rid = ?", [run_id, int(rid)]).fetchone()
        if row is None:
            return None
        return npy_load(row[0])

    def record_stats(self, run_id: str, rid: int):
        """Rebuild the TensorStats (with histogram) of one stored record."""

        df = self.df("SELECT * FROM tensors WHERE run_id = ? AND rid = ?", [run_id, int(rid)])
        if df.empty:
            raise KeyError(f"no record {rid} in run {run_id}")
        return TensorStats.from_row(df.iloc[0].to_dict(), self.histogram(run_id, rid))


def _default_session_name(source: str) -> str:
    base = Path(str(source)).name if source else "session"
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-") or "session"
    return base[:60]


class SessionWriter:
    """Buffers rows and appends them in batches inside the session's transaction."""

    BATCH = 20_000

    def __init__(self, store: Store, cur, session_id: str, name: str):
        self.store, self.cur, self.session_id, self.name = store, cur, session_id, name
        self._rows: list[list] = []  # tensors rows, in self._cols order
        self._hists: list[tuple] = []
        self._cmps: list[list] = []  # comparison rows, inserted in batches (one INSERT per row costs ~5 ms)
        # warning rows, batched too: a dump can warn once per record (one INSERT per row costs ~0.6 ms)
        self._warns: list[tuple] = []
        self._timeline: dict[str, list] = {"timeline": [], "timeline_formats": [], "step_scalars": []}
        self._next_rid: dict[str, int] = {}
        # each tensors column's source, worked out once: the record's field, the statistics' field, or derived
        rec_fields = {f.name for f in dataclasses.fields(TensorRecord)} - {"stats", "tensor"}
        stat_cols = {n for n, _ in _stats_fields()}
        self._cols = [n for n, _ in tensor_columns()]
        self._sources = [("rid" if c == "rid" else "name" if c == "name" else "derived" if c in _DERIVED
                          else "stats" if c in stat_cols else "record" if c in rec_fields else "none", c)
                         for c in self._cols]

    def free_run_name(self, base: str) -> str:
        """``base``, or ``base (2)``, ``(3)``... when a run of this session has it: read inside this write's
        transaction, so two writers that ran the same fix at once still get two names."""
        taken = {r[0] for r in self.cur.execute("SELECT name FROM runs WHERE session_id = ?",
                                                [self.session_id]).fetchall()}
        return free_name(base, taken, "{base} ({i})")

    def add_run(self, run: RunInfo | None = None, **kw) -> str:
        if run is None:
            run = RunInfo(run_id=kw.pop("run_id", None) or uuid.uuid4().hex[:12], session_id=self.session_id, **kw)
        run = dataclasses.replace(run, session_id=self.session_id, created=run.created or _now())
        if run.order is not None and run.order not in _ORDERS:  # every reader checks; the store holds no other
            raise ValueError(f"run {visible(str(run.name))[:80]!r}: order {visible(str(run.order))[:40]!r} is not one "
                             f"of {', '.join(_ORDERS)}")
        self._undiagnosed()
        cols = [f.name for f in dataclasses.fields(RunInfo)]
        self.cur.execute(
            f"INSERT INTO runs ({', '.join(chr(34) + c + chr(34) for c in cols)}) VALUES ({', '.join('?' * len(cols))})",
            [getattr(run, c) for c in cols],
        )
        self._next_rid.setdefault(run.run_id, int(self.cur.execute(
            # fetchall: a half-read result would block the cursor's next register() in flush()
            "SELECT coalesce(max(rid) + 1, 0) FROM tensors WHERE run_id = ?", [run.run_id]).fetchall()[0][0]))
        return run.run_id

    def add_record(self, rec: TensorRecord, *, keep_tensor=None) -> int:
        """Append one record; returns its rid (unique within the run)."""
        if rec.run_id not in self._next_rid:
            raise KeyError(f"run {rec.run_id!r} was not added to session {self.name!r}")
        rid = self._next_rid[rec.run_id]
        self._next_rid[rec.run_id] = rid + 1
        s = rec.stats
        derived = {"nonfinite": s.has_nonfinite, "has_hist": s.hist is not None}
        row = []
        for kind, c in self._sources:
            if kind == "record":
                row.append(getattr(rec, c))
            elif kind == "stats":
                v = getattr(s, c)
                row.append(_shape_json(v) if c == "shape" else v)
            elif kind == "rid":
                row.append(rid)
            elif kind == "name":
                row.append(rec.name)
            elif kind == "derived":
                row.append(derived[c])
            else:
                row.append(None)
        self._rows.append(row)
        if s.hist is not None:
            self._hists.append((rec.run_id, rid, HIST_EDGES_ID, *encode_hist(s.hist)))
        tensor = keep_tensor if keep_tensor is not None else rec.tensor
        if tensor is not None:
            self.cur.execute("INSERT INTO tensor_data VALUES (?, ?, ?)",
                             [rec.run_id, rid, npy_bytes(tensor)])
        if len(self._rows) >= self.BATCH:
            self.flush()
        return rid

    def flush(self) -> None:
        import pyarrow as pa

        if self._rows:
            cols = self._cols
            table = pa.table({c: list(v) for c, v in zip(cols, zip(*self._rows))})
            self.cur.register("_pl_rows", table)
            names = ', '.join(chr(34) + c + chr(34) for c in cols)
            self.cur.execute(f"INSERT INTO tensors ({names}) SELECT {names} FROM _pl_rows")
            self.cur.unregister("_pl_rows")
            self._rows.clear()
        if self._hists:
            table = pa.table({
                "run_id": [h[0] for h in self._hists], "rid": [h[1] for h in self._hists],
                "edges_id": [h[2] for h in self._hists],
                "bins": pa.array([h[3] for h in self._hists], type=pa.list_(pa.int32())),
                "counts": pa.array([h[4] for h in self._hists], type=pa.list_(pa.int64())),
            })
            self.cur.register("_pl_h", table)
            self.cur.execute("INSERT INTO histograms SELECT * FROM _pl_h")
            self.cur.unregister("_pl_h")
            self._hists.clear()
        if self._cmps:
            cols = [n for n, _ in _comparison_columns()]
            table = pa.table({c: [r[i] for r in self._cmps] for i, c in enumerate(cols)})
            self.cur.register("_pl_c", table)
            names = ', '.join(chr(34) + c + chr(34) for c in cols)
            self.cur.execute(f"INSERT INTO comparisons ({names}) SELECT {names} FROM _pl_c")
            self.cur.unregister("_pl_c")
            self._cmps.clear()
        if self._warns:
            table = pa.table({c: [r[i] for r in self._warns]
                              for i, c in enumerate(("session_id", "run_id", "file", "message"))},
                             schema=pa.schema([(c, pa.string()) for c in ("session_id", "run_id", "file", "message")]))
            self.cur.register("_pl_w", table)
            self.cur.execute("INSERT INTO warnings SELECT session_id, run_id, file, message FROM _pl_w")
            self.cur.unregister("_pl_w")
            self._warns.clear()
        self._flush_timeline()

    def add_timeline(self, rows: Iterable[TimelineRow] = (), shares: Iterable[TimelineShare] = (),
                     scalars: Iterable[StepScalar] = ()) -> None:
        """Append a long run's per-step summaries (see ``TimelineRow``)."""
        for table, items in (("timeline", rows), ("timeline_formats", shares), ("step_scalars", scalars)):
            self._timeline[table].extend(items)
        if sum(len(v) for v in self._timeline.values()) >= self.BATCH:
            self.flush()

    def add_timeline_tables(self, **tables) -> None:
        """Append a long run's per-step summaries given as Arrow tables (``timeline``, ``timeline_formats``,
        ``step_scalars``: each with its dataclass's columns), inserted as they are: a run of many ranks holds
        millions of rows, never made into objects."""
        self._flush_timeline()  # rows added as objects before these go first
        for table, cls in (("timeline", TimelineRow), ("timeline_formats", TimelineShare),
                           ("step_scalars", StepScalar)):
            t = tables.get(table)
            if t is None or not t.num_rows:
                continue
            names = ", ".join(chr(34) + n + chr(34) for n, _ in dataclass_columns(cls))
            self.cur.register("_pl_tl", t)
            self.cur.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM _pl_tl")
            self.cur.unregister("_pl_tl")

    def _flush_timeline(self) -> None:
        import pyarrow as pa

        kinds = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}
        for table, cls in (("timeline", TimelineRow), ("timeline_formats", TimelineShare),
                           ("step_scalars", StepScalar)):
            items = self._timeline[table]
            if not items:
                continue
            cols = dataclass_columns(cls)
            t = pa.table({n: pa.array([getattr(x, n) for x in items], type=kinds[k]) for n, k in cols})
            self.cur.register("_pl_tl", t)
            names = ", ".join(chr(34) + n + chr(34) for n, _ in cols)
            self.cur.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM _pl_tl")
            self.cur.unregister("_pl_tl")
            items.clear()

    def add_comparison(self, *, kind: str, ref_run_id: str, ref_rid: Optional[int], cand_run_id: str,
                       cand_rid: Optional[int], step: int, rank: int, seq: int, op: str, role: str,
                       index: str, match: str, comparison) -> None:
        cols = [n for n, _ in _comparison_columns()]
        vals = [self.session_id, kind, ref_run_id, ref_rid, cand_run_id, cand_rid, step, rank, seq, op, role,
                index, match]
        if comparison is None:
            vals += [None] * (len(cols) - len(vals))
        else:
            vals += [getattr(comparison, f.name) for f in dataclasses.fields(comparison)]
        self._cmps.append(vals)
        if len(self._cmps) >= self.BATCH:
            self.flush()

    def set_run_dtype(self, run_id: str, dtype: str) -> None:
        """Record a run's compute dtype once its records have been read."""
        self.cur.execute("UPDATE runs SET dtype = ? WHERE run_id = ?", [dtype, run_id])

    def set_run_lineage(self, run_id: str, *, parent_run_id: Optional[str], fix: Optional[str],
                        kind: Optional[str]) -> None:
        """Record the run a re-run was made from, the fix that made it and (when given) its kind."""
        self.cur.execute("UPDATE runs SET parent_run_id = ?, fix = ?, kind = coalesce(?, kind) WHERE run_id = ?",
                         [parent_run_id, fix, kind, run_id])

    def set_run_order(self, run_id: str, order: str, seqs: dict[int, int]) -> None:
        """Renumber a run's records (``seqs``: rid -> new seq) and say where its order came from."""
        import pyarrow as pa

        self.flush()
        if seqs:
            table = pa.table({"rid": list(seqs), "seq": list(seqs.values())})
            self.cur.register("_pl_seq", table)
            self.cur.execute("UPDATE tensors SET seq = s.seq FROM _pl_seq s WHERE tensors.run_id = ? "
                             "AND tensors.rid = s.rid", [run_id])
            self.cur.unregister("_pl_seq")
        self.cur.execute("UPDATE runs SET \"order\" = ? WHERE run_id = ?", [order, run_id])

    def set_op_parents(self, run_id: str, parents: dict[str, str]) -> None:
        """Record the module call each op ran inside (``parents``: op -> enclosing op) where the dump did not."""
        import pyarrow as pa

        self.flush()
        table = pa.table({"op": list(parents), "parent": list(parents.values())})
        self.cur.register("_pl_parent", table)
        self.cur.execute("UPDATE tensors SET parent = p.parent FROM _pl_parent p WHERE tensors.run_id = ? "
                         "AND tensors.op = p.op AND tensors.parent IS NULL", [run_id])
        self.cur.unregister("_pl_parent")

    def set_run_parent(self, run_id: str, parent_run_id: str) -> None:
        """Record the run a re-run was made from."""
        self.cur.execute("UPDATE runs SET parent_run_id = ? WHERE run_id = ?", [parent_run_id, run_id])

    def clear_diagnoses(self) -> None:
        """Drop the session's diagnoses (they are recomputed as a whole)."""
        self.cur.execute("DELETE FROM diagnoses WHERE session_id = ?", [self.session_id])

    def add_diagnosis(self, d: Diagnosis) -> None:
        d = dataclasses.replace(d, session_id=self.session_id)
        cols = [f.name for f in dataclasses.fields(Diagnosis)]
        vals = [d.fixes_json() if c == "fixes" else getattr(d, c) for c in cols]
        self.cur.execute(f"INSERT INTO diagnoses ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", vals)

    def worsen_verdicts(self, run_id: str, op: str, step: int, rank: int, verdict: str, reason: str) -> None:
        """Judge the output comparisons of one op call of ``run_id`` ``verdict`` (with ``reason``) where they
        were judged better or not at all (no reference record to compare with): a finding made from more than
        the comparison (a quantise op judged against its own input)."""
        better = [v.value for v in Verdict if v.rank < Verdict(verdict).rank]
        self.cur.execute(f"""UPDATE comparisons SET verdict = ?, reason = ? WHERE session_id = ? AND cand_run_id = ?
                             AND op = ? AND step = ? AND rank = ? AND role = 'output'
                             AND (verdict IS NULL OR verdict IN ({', '.join('?' * len(better))}))""",
                         [verdict, reason, self.session_id, run_id, op, int(step), int(rank), *better])

    def add_warning(self, file: str, message: str, run_id: Optional[str] = None) -> None:
        self._warns.append((self.session_id, run_id, str(file), str(message)))
        if len(self._warns) >= self.BATCH:
            self.flush()

    def set_notes(self, notes: dict) -> None:
        self.cur.execute("UPDATE sessions SET notes = ? WHERE session_id = ?", [json.dumps(notes), self.session_id])

    def _notes(self) -> dict:
        row = self.cur.execute("SELECT notes FROM sessions WHERE session_id = ?", [self.session_id]).fetchone()
        try:
            notes = json.loads(row[0] or "{}") if row else {}
        except ValueError:
            notes = {}
        return notes if isinstance(notes, dict) else {}

    def _undiagnosed(self) -> None:
        """A new run takes the session's ``diagnosed`` mark away until its diagnoses are computed again."""
        notes = self._notes()
        if notes.pop("diagnosed", None) is not None:
            self.set_notes(notes)

    def mark_diagnosed(self) -> None:
        """Note in the session's notes (``diagnosed``: when) that its diagnoses were computed, in this
        transaction: a session without the mark was cut off between its write and its diagnosis."""
        notes = self._notes()
        notes["diagnosed"] = _now()
        self.set_notes(notes)


def open_store(db: Optional[os.PathLike | str] = None) -> Store:
    return Store(db)
