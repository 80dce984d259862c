"""The database files this process has open: one connection per file, taken by each operation and let go after it.

DuckDB lets one process write a file, or any number of processes read it, never both.  So no process holds
the file between operations: each operation (a query, a batch of reads, a write transaction) takes the
file's connection, and the connection is closed again as soon as no operation of this process uses it.
Reads open the file read-only, so dashboards and `report`s read side by side; a write opens it read-write
for its transaction only.  An open that meets another process's lock is retried with backoff for up to
``config.env_lock_wait()`` seconds, then refused in one sentence naming the process that holds it.  ``Store.held()``
keeps a read-only connection between operations for a bounded stretch (one dashboard page run), since an
open costs ~10 ms and a page asks dozens of questions.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import ContextManager, Iterator, Optional

from ..config import LOCK_WAIT_ENV
from ..display import visible
from ..paths import resolve_db_path
from ..tokens import MemoryTokens
from .connect import connect_duckdb


class DatabaseLocked(RuntimeError):
    """Another process holds the database file (DuckDB allows one per file)."""


_WRITER_FIRST_S = 1.0  # how long a new read waits for a write of its own process that is waiting to start
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
    return _opened(path, lambda: connect_duckdb(path, read_only=read_only), wait, deadline)


def attach(cur, path: str, alias: str, wait: float) -> None:
    """``ATTACH`` the database file at ``path`` as ``alias`` to the DuckDB database of ``cur`` (one whose
    ``readable`` files include it), retried like an open while another process holds the file: an attach to a
    database this process keeps costs a millisecond where opening the file costs a DuckDB instance (~15 ms)."""
    quoted = "'" + path.replace("'", "''") + "'"
    _opened(path, lambda: cur.execute(f"ATTACH {quoted} AS {alias}"), wait, None)


def _opened(path: str, open_it, wait: float, deadline: Optional[float]):
    """``open_it()``, retried with backoff while another process holds the file at ``path``."""
    import duckdb

    deadline = time.monotonic() + wait if deadline is None else deadline
    _check_header(path)
    delay = 0.002
    while True:
        try:
            return open_it()
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


def rollback(cur) -> None:
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

    def __init__(self, path: str, readable: tuple = (), threads: Optional[int] = None):
        self.path = path
        self.memory = path == ":memory:"
        self.readable = readable  # files an in-memory database of its own may read (``Store(readable=...)``)
        self.threads = threads  # DuckDB's threads for such a database (None: DuckDB's default)
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
        self.lent_out = False  # lent to another DuckDB database of this process (``lent``)
        self.tx = threading.local()  # the cursor of this thread's open transaction
        self.commits = 0  # transactions committed by this process (the version of an in-memory database)
        self.write_held_s = 0.0  # seconds this process has held the file read-write (benches)
        self._rw_since: Optional[float] = None
        # the file as this process last found it holding no code (Store._refuse_foreign) or left it after its own
        # write (identity): another Store of the file, unchanged since, skips the check (a listing of every
        # function, some 15 ms)
        self.vetted: Optional[tuple] = None
        # the same for its schema found at this version (Store._init_schema): unchanged since, a new Store of the
        # file opens nothing
        self.current: Optional[tuple] = None

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
                    self.con, self.read_only = connect_duckdb(readable=self.readable, threads=self.threads), False
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

    @contextmanager
    def lent(self, wait: float):
        """The file lent to another DuckDB database of this process for the block (``attach``): this process's
        own connection to it is closed first, once no operation uses it, and no operation opens it again until
        the block ends, so the file is never open twice in one process.  The block counts as a write."""
        deadline = time.monotonic() + wait
        with self.cond:
            while self.opening or self.active:
                left = deadline - time.monotonic()
                if left <= 0 or not self.cond.wait(left):
                    raise DatabaseLocked(f"database {self.path} is being used by this process for longer than "
                                         f"{wait:g} s; a write could not start")
            current = self.current  # what closing a connection to it forgets: the block's write keeps the schema
            self._close()
            self.opening = True  # operations of other threads wait for the block, as for an open
            self.lent_out = True
        since = time.monotonic()
        try:
            yield
        finally:
            with self.cond:
                self.opening = self.lent_out = False
                self.write_held_s += time.monotonic() - since
                self._left_after_write(current is not None)
                self.cond.notify_all()

    def wait_returned(self, wait: float) -> None:
        """Wait (up to ``wait`` s) until the file is no longer lent (``lent``): a write of this process that runs
        on a thread of its own has let it go."""
        deadline = time.monotonic() + wait
        with self.cond:
            while self.lent_out and self.cond.wait(max(0.0, deadline - time.monotonic())):
                pass

    def _left_after_write(self, same_schema: bool = False) -> None:
        """This process's own write holds no code: the mark follows the file; the schema's (``same_schema``:
        the write only added rows) too, else it is checked again by the next ``Store`` of the file."""
        if self.memory:
            return
        now = identity(self.path)
        if self.vetted is not None:
            self.vetted = now
        self.current = now if same_schema else None

    def _close(self) -> None:
        con, self.con = self.con, None
        if con is not None:
            try:
                con.close()  # a read-write connection checkpoints as it closes: part of the hold
            except Exception:
                pass
            if not self.read_only:
                self._left_after_write()
        if self._rw_since is not None:
            self.write_held_s += time.monotonic() - self._rw_since
            self._rw_since = None

    @property
    def is_open(self) -> bool:
        return self.con is not None


_FILES: dict[str, _File] = {}
_GLOBAL = threading.Lock()


def private_file(readable, threads: Optional[int] = None) -> _File:
    """A database in memory of its own (never shared with the process's ``:memory:``) whose queries may read
    the files ``readable`` names, and no other; ``threads``: DuckDB's threads for it."""
    return _File(":memory:", tuple(str(p) for p in readable), threads)


def file_of(path: str) -> _File:
    with _GLOBAL:
        f = _FILES.get(path)
        if f is None:
            f = _FILES[path] = _File(path)
        return f


@contextmanager
def _holding(path, write: bool) -> Iterator[None]:
    f = file_of(resolve_db_path(path))
    hold = f.hold_write if write else f.hold
    hold(1)
    try:
        yield
    finally:
        hold(-1)


def writing(path: Optional[os.PathLike | str] = None) -> ContextManager[None]:
    """``Store.writing()`` for the database at ``path``, begun before any ``Store`` of it is made (whose
    schema check is then part of the block)."""
    return _holding(path, True)


def held(path: Optional[os.PathLike | str] = None) -> ContextManager[None]:
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


def identity(path: str) -> Optional[tuple]:
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
