"""A whole session in and out of the database, table by table (for export, import and sharing).

``copy_session_tables`` writes one Parquet file per table in one read
transaction; ``insert_session_tables`` inserts checked Arrow tables in one
write transaction, giving fresh ids where the database already holds them.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import Optional
from pathlib import Path

from ..stats import HIST_EDGES_ID
from .connect import connect_duckdb
from .files import attach, rollback
from .rows import TableColumns

__all__ = ["move_summary_errors_sql", "insert_staged_session", "insert_attached_session", "AttachedTarget", "clear_tables", "TABLES", "TABLE_SINCE", "ROW_UPGRADES", "RUN_ID_COLUMNS", "ImportRefused", "copy_session_tables",
           "TableFile", "ImportedSession", "table_columns", "insert_session_tables", "ArchiveQueries"]

def move_summary_errors_sql(where: str = "") -> str:
    """Rows written before schema 5 kept a statistics-only comparison's summary errors in
    max_abs_err/max_rel_err: move them to summary_abs_err/summary_rel_err (``where``: more conditions).
    A row already moved has NULL there, so running it twice changes nothing."""
    return ("UPDATE comparisons SET summary_abs_err = max_abs_err, summary_rel_err = max_rel_err, "
            "max_abs_err = NULL, max_rel_err = NULL "
            "WHERE basis = 'stats' AND (max_abs_err IS NOT NULL OR max_rel_err IS NOT NULL)"
            + (f" AND {where}" if where else ""))


# Tables of one session, in insertion order (parents before children).
TABLES = ("sessions", "runs", "tensors", "histograms", "tensor_data", "comparisons", "diagnoses", "warnings",
          "timeline", "timeline_formats", "step_scalars")

# The schema version that added a table: an archive written before it has none (read as empty).
TABLE_SINCE = {"timeline": 4, "timeline_formats": 4, "step_scalars": 4}

# Schema versions that changed what a column means, with the statement that brings the rows of one imported
# session (parameter: session_id) written before that version up to it; columns an archive lacks are NULL.
ROW_UPGRADES = {5: move_summary_errors_sql("session_id = ?")}

# How each table's rows are selected for one session (parameter: session_id).
_RUNS_OF = "SELECT run_id FROM runs WHERE session_id = $sid"
_SELECT = {
    "sessions": "SELECT * FROM sessions WHERE session_id = $sid",
    "runs": "SELECT * FROM runs WHERE session_id = $sid",
    "tensors": f"SELECT * FROM tensors WHERE run_id IN ({_RUNS_OF})",
    "histograms": f"SELECT * FROM histograms WHERE run_id IN ({_RUNS_OF})",
    "tensor_data": f"SELECT * FROM tensor_data WHERE run_id IN ({_RUNS_OF})",
    "comparisons": "SELECT * FROM comparisons WHERE session_id = $sid",
    "diagnoses": "SELECT * FROM diagnoses WHERE session_id = $sid",
    "warnings": "SELECT * FROM warnings WHERE session_id = $sid",
    "timeline": f"SELECT * FROM timeline WHERE run_id IN ({_RUNS_OF})",
    "timeline_formats": f"SELECT * FROM timeline_formats WHERE run_id IN ({_RUNS_OF})",
    "step_scalars": f"SELECT * FROM step_scalars WHERE run_id IN ({_RUNS_OF})",
}

# Columns that hold a run id, per table (remapped on import when they clash).
RUN_ID_COLUMNS = {
    "runs": ("run_id", "parent_run_id"),
    "tensors": ("run_id",),
    "histograms": ("run_id",),
    "tensor_data": ("run_id",),
    "comparisons": ("ref_run_id", "cand_run_id"),
    "diagnoses": ("run_id",),
    "warnings": ("run_id",),
    "timeline": ("run_id",),
    "timeline_formats": ("run_id",),
    "step_scalars": ("run_id",),
}


class ImportRefused(ValueError):
    """The database cannot take a table as given; the message names the table."""


@dataclass(frozen=True, slots=True)
class TableFile:
    """One table's rows of a session, written as a Parquet file: how many rows and where."""

    table: str
    rows: int
    path: Path


def copy_session_tables(store, session_id: str, folder: Path, rewrite=None,
                        pattern: str = "", replacement: str = "") -> list[TableFile]:
    """Each table's rows of the session as ``<folder>/<table>.parquet``, written by DuckDB (streaming) in one
    read transaction, so a re-run committing meanwhile cannot make them disagree; in ``TABLES`` order.

    ``rowid`` order keeps insertion order through the round trip (the report lists runs and warnings in it).
    ``rewrite``: ``{table: (text column, ...)}`` whose values have the RE2 ``pattern`` replaced by
    ``replacement`` as they are written (pyarrow.compute: no Python object per value).
    """
    import pyarrow.compute as pc  # deferred with DuckDB (see ArchiveQueries)
    import pyarrow.parquet as pq

    out = []
    with store.reading() as cur:
        for table in TABLES:
            path = Path(folder) / f"{table}.parquet"
            # streamed as Arrow batches and written here: the database's connection reads and writes no file
            # but its own (external access is off, see store._connect)
            reader = cur.sql(f"{_SELECT[table]} ORDER BY rowid", params={"sid": session_id}).to_arrow_reader()
            rows = 0
            with pq.ParquetWriter(path, reader.schema, compression="zstd") as w:
                for batch in reader:
                    for col in ((rewrite or {}).get(table) or ()):  # text columns, rewritten as written
                        i = batch.schema.get_field_index(col)
                        if i >= 0:
                            batch = batch.set_column(i, batch.schema.field(i), pc.replace_substring_regex(
                                batch.column(i), pattern, replacement))
                    w.write_batch(batch)
                    rows += batch.num_rows
            out.append(TableFile(table, rows, path))
    return out


def table_columns(store, tables) -> TableColumns:
    """The columns of the named tables, in order, with their DuckDB types (one query for all)."""
    tables = list(tables)
    out: dict = {t: {} for t in tables}
    got = store.sql("SELECT table_name, column_name, data_type FROM information_schema.columns "
                    "WHERE list_contains(?, table_name) ORDER BY table_name, ordinal_position", [tables]).fetchall()
    for table, name, kind in got:
        out[table][name] = kind
    return TableColumns(out)


def _quoted(c: str) -> str:
    return '"' + c.replace('"', '""') + '"'


def _select_list(table: str, columns: list, *, session_id: str, name: str, run_map: dict) -> tuple[str, list]:
    """What an imported table's rows become: the session id and (sessions) name this database gives them, run
    ids through ``run_map``; the rest as archived.  SQL, not Arrow: building Arrow arrays
    from Python values imports pandas, which an import does not otherwise need."""
    exprs, params = [], []
    for c in columns:
        q = _quoted(c)
        if c == "session_id":
            exprs.append("?")
            params.append(session_id)
        elif table == "sessions" and c == "name":
            exprs.append("?")
            params.append(name)
        elif c in RUN_ID_COLUMNS.get(table, ()) and run_map:
            whens = " ".join("WHEN ? THEN ?" for _ in run_map)
            exprs.append(f"CASE CAST({q} AS VARCHAR) {whens} ELSE CAST({q} AS VARCHAR) END")
            for old, new in run_map.items():
                params += [old, new]
        else:
            exprs.append(q)
    return ", ".join(exprs), params


@dataclass(frozen=True)
class ImportedSession:
    """A session inserted from an archive: its name and id in this database, the fresh id each run that clashed
    was given (``{archived run id: new run id}``, empty when none clashed) and notes on what was changed."""

    name: str
    session_id: str
    run_map: dict
    notes: list


def insert_session_tables(store, tables: dict, *, session_id: str, name: str, where: str,
                          hist_edges_id, schema_version: int, rename: bool = True) -> ImportedSession:
    """Insert one session's checked Arrow tables in one transaction.

    Ids the database already holds are replaced by fresh ones, the name is
    made unique (``rename`` false: a taken name is a ``ValueError``); the
    session has no share link (one a deleted session of the same id left
    behind is dropped).  A table is an Arrow table or, read as it is inserted,
    an Arrow record batch reader (``runs`` must be a table).  Rows written at an older
    ``schema_version`` are brought up to this one (``ROW_UPGRADES``).
    ``ImportRefused`` names a
    table DuckDB cannot store; the rollback leaves the database as it was.
    """
    notes: list[str] = []
    # the transaction's cursor, and the views registered on it, are closed when it ends
    with store.transaction() as cur:
        final_name, new_sid, run_map = _insert_tables(cur, store, _ArrowSource(cur, tables), session_id=session_id,
                                                      name=name, where=where, rename=rename)
        for version, stmt in sorted(ROW_UPGRADES.items()):
            if schema_version < version:
                cur.execute(stmt, [new_sid])
        if hist_edges_id not in (None, HIST_EDGES_ID):
            note = (f"its histograms use bin edges {hist_edges_id}, this version uses {HIST_EDGES_ID}; "
                    "format overlays for it need a re-ingest")
            cur.execute("INSERT INTO warnings VALUES (?, NULL, ?, ?)", [new_sid, where, note])
            notes.append(note)
    return ImportedSession(final_name, new_sid, run_map, notes)


class _ArrowSource:
    """One session's tables as Arrow tables (or record batch readers), registered on ``cur`` as they are
    inserted."""

    def __init__(self, cur, tables: dict):
        self.cur, self.tables = cur, tables

    def run_ids(self) -> list:
        runs = self.tables["runs"]
        return runs.column("run_id").to_pylist() if "run_id" in runs.column_names else []

    def parts(self):
        """``(table, its columns, what to select them from)`` of each table with rows, in ``TABLES`` order; the
        source is let go after its insert."""
        for table in TABLES:
            t = self.tables.get(table)
            if t is None or getattr(t, "num_rows", None) == 0:  # an archive older than the table; no rows
                continue
            view = f"_pl_import_{table}"
            self.cur.register(view, t)
            yield table, t.schema.names, view
            self.cur.unregister(view)


class _AttachedSource:
    """One session's tables in the database ``alias`` (a staging database holding that session only), read by
    the insert where they lie: its run ids and each table's row count in one query."""

    def __init__(self, cur, alias: str):
        self.cur, self.alias = cur, alias
        counts = ", ".join(f"(SELECT count(*) FROM {alias}.{t})" for t in TABLES)
        got = cur.execute(f"SELECT (SELECT coalesce(list(run_id ORDER BY rowid), []) FROM {alias}.runs), "
                          f"{counts}").fetchall()[0]
        self._run_ids, self._counts = list(got[0]), dict(zip(TABLES, got[1:]))

    def run_ids(self) -> list:
        return self._run_ids

    def parts(self):
        columns = _staged_columns(self.cur, self.alias)
        for table in TABLES:
            if self._counts.get(table):
                yield table, columns[table], f"(SELECT * FROM {self.alias}.{table} ORDER BY rowid)"


_STAGED_COLUMNS: dict = {}  # a staging database's columns per table: this version's schema, the same for every one


def _staged_columns(cur, alias: str) -> dict:
    """The columns of each table of the staging database ``alias`` (made by this version's ``schema_sql``), read
    once per process."""
    if not _STAGED_COLUMNS:
        columns: dict = {}
        for table, column in cur.execute(
                "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = ? "
                "ORDER BY table_name, column_index", [alias]).fetchall():
            columns.setdefault(table, []).append(column)
        _STAGED_COLUMNS.update(columns)
    return _STAGED_COLUMNS


def _insert_tables(cur, store, source, *, session_id: str, name: str, where: str,
                   rename: bool) -> tuple[str, str, dict]:
    """Inside ``cur``'s transaction: insert one session's tables from ``source`` (``_ArrowSource``,
    ``_AttachedSource``), with fresh ids where the database holds them and a unique name; (name, session id,
    run id map)."""
    run_ids = source.run_ids()
    # one query: whether the id, a run id (only these are looked for: the whole tensors table is not read) or
    # the name is taken
    marks = ", ".join("?" * len(run_ids)) or "NULL"
    taken, clash, name_taken = cur.execute(
        "SELECT (SELECT count(*) FROM sessions WHERE session_id = ?), "
        f"(SELECT count(*) FROM (SELECT run_id FROM runs WHERE run_id IN ({marks}) UNION ALL "
        f"SELECT run_id FROM tensors WHERE run_id IN ({marks}))), "
        "(SELECT count(*) FROM sessions WHERE name = ?)", [session_id, *run_ids, *run_ids, name]).fetchall()[0]
    new_sid = uuid.uuid4().hex[:12] if taken else session_id
    run_map = {r: uuid.uuid4().hex[:12] for r in run_ids} if clash else {}
    final_name = store._unique_name(cur, name, rename=rename) if name_taken else name
    store._drop_token(new_sid)
    for table, names, view in source.parts():
        cols = ", ".join(_quoted(c) for c in names)
        exprs, params = _select_list(table, names, session_id=new_sid, name=final_name, run_map=run_map)
        try:
            cur.execute(f"INSERT INTO {table} ({cols}) SELECT {exprs} FROM {view}", params)
        except Exception as e:  # a type DuckDB cannot cast: name the file; the rollback undoes the rest
            raise ImportRefused(f"{where}: {table}.parquet cannot be stored in table {table} ({e})") from None
    return final_name, new_sid, run_map


def clear_tables(store) -> None:
    """Empty every table of a session in ``store`` (a staging database, once its session is inserted)."""
    with store.transaction() as cur:
        cur.execute("; ".join(f"DELETE FROM {t}" for t in TABLES))


def insert_attached_session(store, staging, session_id: str, name: str, *, rename: bool) -> tuple[str, str]:
    """Insert the session ``session_id`` that ``staging`` (a ``Store`` in memory of this process whose
    ``readable`` files include ``store``'s, holding that session only) holds into ``store``'s file in one
    transaction, the file attached to the staging database for it: the rows go from one to the other inside
    DuckDB, and no DuckDB instance is opened for the file.  Returns the (name, session id) it got there."""
    with store._lock, staging._lock:
        return AttachedTarget(store, staging).insert(session_id, name, rename=rename)


class AttachedTarget:
    """``store``'s file lent to the staging database of this process (``staging``) and attached to it, from
    the moment it is made: this process's other operations on the file wait until ``insert`` has let it go,
    and other processes' opens wait for DuckDB's lock on it.  ``insert`` may run on another thread than the
    one that made it (a capture's write behind its step)."""

    def __init__(self, store, staging):
        self.store, self.staging = store, staging
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(store._file.lent(store.lock_wait))
            con = staging._file.acquire(True, staging.lock_wait)
            self._stack.callback(staging._file.release)
            self.cur = con.cursor()
            self._stack.callback(self.cur.close)
            attach(self.cur, store.path, "_pl_target", store.lock_wait)
        except BaseException:
            self._stack.close()
            raise

    def insert(self, session_id: str, name: str, *, rename: bool) -> tuple[str, str]:
        """Insert the session in one transaction, then let the file go (a checkpoint, then the detach);
        (name, session id) it got there."""
        cur = self.cur
        with self._stack:
            try:
                cur.execute("USE _pl_target")
                cur.execute("BEGIN TRANSACTION")
                try:
                    got, new_sid, _runs = _insert_tables(cur, self.store, _AttachedSource(cur, "memory"),
                                                         session_id=session_id, name=name,
                                                         where=f"session {name}", rename=rename)
                except BaseException:
                    rollback(cur)
                    raise
                cur.execute("COMMIT")
                self.store._file.commits += 1
            finally:
                cur.execute("USE memory")
                cur.execute("DETACH _pl_target")  # a checkpoint, then the file is let go
        return got, new_sid


def insert_staged_session(store, staged, session_id: str, name: str, *, rename: bool) -> tuple[str, str]:
    """Insert the session ``session_id`` that a private staging database (``staged``: its DuckDB connection,
    committed) holds into ``store``, in one transaction (``insert_session_tables``), so the shared file is held
    for the copy only; returns the (name, session id) it got there.  The small tables are read into memory
    first, tensors' data streams from the staging file as it is inserted."""
    tables: dict = {}
    for table in TABLES:
        query = f"{_SELECT[table]} ORDER BY rowid"
        if table == "tensor_data":
            if staged.execute(f"SELECT count(*) FROM ({_SELECT[table]})", {"sid": session_id}).fetchall()[0][0]:
                tables[table] = staged.cursor().sql(query, params={"sid": session_id}).to_arrow_reader()
        else:
            tables[table] = staged.sql(query, params={"sid": session_id}).to_arrow_table()
    # rows written by this version: no upgrade applies, and histograms use this version's bin edges
    got = insert_session_tables(
        store, tables, session_id=session_id, name=name, where=f"session {name}", hist_edges_id=HIST_EDGES_ID,
        schema_version=max(ROW_UPGRADES), rename=rename)
    return got.name, got.session_id


class ArchiveQueries:
    """Questions asked of an archive's tables before they are imported: SQL over the Arrow tables, which DuckDB
    reads in place, registered on a cursor of their own (only reads; nothing of the database is touched, and
    the names go with the cursor).  Each answer is a value or None; the caller says what is wrong with which
    file."""

    def __init__(self, store, tables: dict):
        self._con = connect_duckdb()  # in memory: the archive's tables only, never the database
        self._views = {}
        try:
            for name, t in tables.items():
                view = f"a_{name}"
                self._con.register(view, t)
                self._views[name] = view
        except BaseException:
            self._con.close()
            raise

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> "ArchiveQueries":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _all(self, sql: str, params=()) -> list:
        return self._con.execute(sql, list(params)).fetchall()

    def other_sessions(self, tables, session_id: str) -> dict:
        """``{table: distinct session_id values other than session_id}`` (a null is one), tables that have
        any; one query for all."""
        parts = [f"SELECT {i} AS k, CAST(session_id AS VARCHAR) AS v FROM {self._views[t]}"
                 for i, t in enumerate(tables)]
        out: dict = {}
        for k, v in self._all(f"SELECT DISTINCT k, v FROM ({' UNION ALL '.join(parts)}) WHERE v IS NULL OR v <> ?",
                              [session_id]):
            out.setdefault(tables[k], []).append(v)
        return out

    def unknown_runs(self, columns) -> dict:
        """``{(table, column): distinct values that are no run_id of the archive's runs}`` for ``columns``,
        ``(table, column, nullable)`` triples (nulls count unless nullable); one query for all."""
        runs = f"(SELECT CAST(run_id AS VARCHAR) FROM {self._views['runs']} WHERE run_id IS NOT NULL)"
        parts = []
        for i, (table, column, nullable) in enumerate(columns):
            q = _quoted(column)
            nulls = "FALSE" if nullable else f"{q} IS NULL"
            parts.append(f"SELECT DISTINCT {i} AS k, CAST({q} AS VARCHAR) AS v FROM {self._views[table]} "
                         f"WHERE {nulls} OR ({q} IS NOT NULL AND CAST({q} AS VARCHAR) NOT IN {runs})")
        out: dict = {}
        if parts:
            for k, v in self._all(" UNION ALL ".join(parts)):
                out.setdefault(columns[k][:2], []).append(v)
        return out

    def repeats_a_record(self, table: str) -> bool:
        """Whether two rows of ``table`` name the same (run_id, rid)."""
        return bool(self._all(
            f"SELECT count(*) <> count(DISTINCT (CAST(run_id AS VARCHAR), CAST(rid AS VARCHAR))) "
            f"FROM {self._views[table]}")[0][0])

    def record_not_in_tensors(self, table: str) -> Optional[tuple]:
        """(run_id, rid) of a row of ``table`` naming a record ``tensors`` does not hold, or None."""
        got = self._all(
            f"SELECT x.run_id, x.rid FROM {self._views[table]} x WHERE NOT EXISTS (SELECT 1 FROM "
            f"{self._views['tensors']} t WHERE CAST(t.run_id AS VARCHAR) = CAST(x.run_id AS VARCHAR) "
            "AND CAST(t.rid AS VARCHAR) = CAST(x.rid AS VARCHAR)) LIMIT 1")
        return tuple(got[0]) if got else None

    def histograms_disagree(self) -> bool:
        """A histogram without bins or counts, or with more of one than of the other."""
        return bool(self._all(
            f"SELECT coalesce(bool_or(bins IS NULL OR counts IS NULL OR len(bins) <> len(counts)), FALSE) "
            f"FROM {self._views['histograms']}")[0][0])

    def histogram_out_of_range(self, n_bins: int) -> bool:
        """A null bin or count, a bin index outside 0..n_bins-1, or a negative count."""
        return bool(self._all(
            "SELECT coalesce(bool_or(list_count(bins) <> len(bins) OR list_count(counts) <> len(counts) "
            "OR list_min(bins) < 0 OR list_max(bins) >= ? OR list_min(counts) < 0), FALSE) "
            f"FROM {self._views['histograms']}", [n_bins])[0][0])

