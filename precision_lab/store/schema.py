"""The store's schema: its tables derived from the records' dataclasses, the migrations from each older version,
and the check that refuses a database file this package did not make."""

from __future__ import annotations

from ..display import few
from ..metrics import Comparison
from ..records import (Diagnosis, RunInfo, StepScalar, TimelineRow, TimelineShare, dataclass_columns,
                       record_columns)
from .files import DatabaseLocked, identity
from .transfer import move_summary_errors_sql

SCHEMA_VERSION = 7


class ForeignDatabase(RuntimeError):
    """A database file this package did not make: it holds views or macros (code that would run as it is read) or
    another program's tables.  The message names the file and what it holds."""


# what a database holds beside tables: views and macros run when they are read, so a file holding them is refused
_FOREIGN_SQL = """SELECT (SELECT list(view_name ORDER BY view_name) FROM duckdb_views() WHERE NOT internal),
                         (SELECT list(function_name ORDER BY function_name) FROM duckdb_functions()
                          WHERE function_type IN ('macro', 'table_macro') AND NOT internal),
                         (SELECT list(table_name ORDER BY table_name) FROM duckdb_tables() WHERE NOT internal)"""


_SQL = {"int": "BIGINT", "float": "DOUBLE", "str": "VARCHAR", "bool": "BOOLEAN"}


def tensor_columns() -> list[tuple[str, str]]:
    """(name, SQL type) of the ``tensors`` table: rid, record fields, stats fields, derived flags."""
    return [(n, _SQL[k]) for n, k in record_columns()]


def _dataclass_columns(cls, skip=()) -> list[tuple[str, str]]:
    return [(n, _SQL[k]) for n, k in dataclass_columns(cls, skip)]


TENSOR_COLUMNS: list[str] = []  # filled on first Store() (stats module may import late)


def comparison_columns() -> list[tuple[str, str]]:
    return (
        [("session_id", "VARCHAR"), ("kind", "VARCHAR"), ("ref_run_id", "VARCHAR"), ("ref_rid", "BIGINT"),
         ("cand_run_id", "VARCHAR"), ("cand_rid", "BIGINT"), ("step", "BIGINT"), ("rank", "BIGINT"),
         ("seq", "BIGINT"), ("op", "VARCHAR"), ("role", "VARCHAR"), ("index", "VARCHAR"),
         ("match", "VARCHAR")]
        + _dataclass_columns(Comparison)
    )


def schema_sql() -> list[str]:
    tcols = tensor_columns()
    ccols = comparison_columns()
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


def _move_share_tokens_out(store: "StoreSchema", cur) -> None:
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
    # the user code that called an op; the timeline tables are created by schema_sql()
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


class StoreSchema:
    """``Store``'s schema: made or brought up to ``SCHEMA_VERSION`` as a ``Store`` is opened."""

    def _refuse_foreign(self) -> None:
        """Refuse a file that holds views or macros, or tables but none of ours (``ForeignDatabase``)."""
        if self._file.memory:
            return
        f = self._file
        if f.vetted is not None and ((f.con is not None and not f.read_only) or f.vetted == identity(self.path)):
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
        self._file.vetted = identity(self.path)

    def _known_current(self) -> bool:
        """Whether this process found the file at this schema version holding no code (or left it so after its
        own write), and it is unchanged since (a write of this process still running is waited for)."""
        f = self._file
        if f.memory:
            return False
        f.wait_returned(self.lock_wait)
        return f.current is not None and f.current == identity(self.path)

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
                self._found_current()
                return
        except DatabaseLocked:
            raise
        except RuntimeError as e:
            if "cannot open database" in str(e):
                raise
        except Exception:  # no meta table yet: a new database
            pass
        with self.transaction() as cur:
            for stmt in schema_sql():
                cur.execute(stmt)
            row = cur.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                cur.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
            else:
                self._migrate(cur, int(row[0]))
        self._found_current()

    def _found_current(self) -> None:
        """Mark the file as found at this schema version (and holding no code: ``_refuse_foreign`` ran first)."""
        f = self._file
        if not f.memory and f.vetted is not None:
            f.current = identity(self.path)

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
