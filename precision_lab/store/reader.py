"""The store's reads: a query's ``Result``, read cursors and read transactions, and the sessions, runs and
records a ``Store`` answers for by itself (the named questions of the dashboard and the use cases are the read
model: ``views``, ``queries``, ``timeline``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np

from ..records import RunInfo, npy_load
from ..stats import HistogramError, TensorStats, decode_hist
from ..tokens import TokenFileError
from .files import held, rollback
from .queries import run_order
from .rows import SessionRow, one_as

if TYPE_CHECKING:
    import pandas as pd
    from duckdb import DuckDBPyConnection


class SessionNotFound(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; we want a sentence
        return str(self.args[0]) if self.args else "session not found"


# a statement that only reads; any other runs in a transaction of its own
_READ = re.compile(r"\s*(\(|SELECT|WITH|FROM|VALUES|TABLE|DESCRIBE|SHOW|SUMMARIZE|EXPLAIN)\b", re.I)


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


class StoreReads:
    """``Store``'s reads: a query runs on the file's connection, taken for it and let go after it (see ``files``)."""

    @contextmanager
    def held(self) -> Iterator["StoreReads"]:
        """Keep the database open between the operations of this block (read-only; a write in it still takes
        the file for its transaction only).  For a bounded stretch such as one dashboard page run: other
        processes' writes wait while it lasts."""
        with held(self.path):
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
    def reading(self) -> Iterator[DuckDBPyConnection]:
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
                rollback(cur)

    @contextmanager
    def _cursor(self) -> Iterator[DuckDBPyConnection]:
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

    def df(self, query: str, params: Optional[list] = None) -> pd.DataFrame:
        return self.sql(query, params).df()

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

    def sessions(self) -> pd.DataFrame:
        """All sessions with run counts, newest first (DataFrame)."""
        return self.df(
            "SELECT s.session_id, s.name, s.created, s.source, s.recipe, "
            "(SELECT count(*) FROM runs r WHERE r.session_id = s.session_id) AS runs "
            "FROM sessions s ORDER BY s.created DESC, s.name"
        )

    def session(self, session: str) -> SessionRow:
        """A session by name or id; raises SessionNotFound with the known names."""
        row = one_as(SessionRow, self.sql(
            "SELECT session_id, name, created, source, recipe, notes FROM sessions "
            "WHERE name = ? OR session_id = ?", [session, session]))
        if row is None:
            names = [r[0] for r in self.sql("SELECT name FROM sessions ORDER BY name").fetchall()]
            known = ", ".join(names[:20]) if names else "none yet"
            raise SessionNotFound(f"no session named {session!r} (known sessions: {known})")
        return dataclasses.replace(row, notes=json.loads(row.notes or "{}"))

    def runs(self, session_id: str) -> pd.DataFrame:
        return self.df(f"SELECT * FROM runs WHERE session_id = ? ORDER BY {run_order()}", [session_id])

    def run(self, run_id: str) -> RunInfo:
        """A run by id; raises KeyError."""
        row = one_as(RunInfo, self.sql("SELECT * FROM runs WHERE run_id = ?", [run_id]))
        if row is None:
            raise KeyError(f"no run {run_id!r}")
        return row

    def session_by_token(self, token: str) -> Optional[SessionRow]:
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

    def tensor(self, run_id: str, rid: int) -> Optional[np.ndarray]:
        """A kept tensor as a numpy array, or None."""
        row = self.sql("SELECT npy FROM tensor_data WHERE run_id = ? AND rid = ?", [run_id, int(rid)]).fetchone()
        if row is None:
            return None
        return npy_load(row[0])

    def record_stats(self, run_id: str, rid: int) -> TensorStats:
        """Rebuild the TensorStats (with histogram) of one stored record."""

        df = self.df("SELECT * FROM tensors WHERE run_id = ? AND rid = ?", [run_id, int(rid)])
        if df.empty:
            raise KeyError(f"no record {rid} in run {run_id}")
        return TensorStats.from_row(df.iloc[0].to_dict(), self.histogram(run_id, rid))
