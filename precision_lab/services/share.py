"""Move a session between databases as one file, and give it a share link.

An exported session is a zip holding one Parquet file per table (sessions,
runs, tensors, histograms, tensor_data, comparisons, diagnoses, warnings),
restricted to that session's rows, plus ``manifest.json``::

    {"format": "precision-lab-session", "format_version": 1,
     "schema_version": <store schema>, "hist_edges_id": ..., "session": {"session_id", "name"},
     "tables": {"runs": {"file": "runs.parquet", "rows": 3, "sha256": "...", "bytes": 1234}, ...}}

Import trusts nothing in the file: the zip passes ``safezip.check_zip``, every
table's checksum and row count must match the manifest, columns must be ones
the store knows, and every row must belong to the declared session and its
runs.  The whole import is one transaction, so a refused or failed import
leaves the database as it was.  An import never replaces an existing session:
a clashing name gets a suffix and the result says so; clashing ids are
replaced by fresh ones.  An archive written at an older schema version
imports too: the tables and columns it lacks read as empty, and rows whose
meaning changed since are brought up to this version (a statistics-only
comparison's errors move to their summary columns, schema 5).

Share tokens are not exported: a token is a capability on one server (an
archive written before schema 7 has a ``share_token`` column in
sessions.parquet, always empty; it is dropped on import).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union
from urllib.parse import urlencode, urlsplit, urlunsplit, parse_qsl

from ..readers import first_line
from ..scratch import scratch_dir
from ..display import few, visible
from ..public import PATH_DIRS, PATH_DIRS_KEEP
from ..enums import RunOrder
from ..store.transfer import (RUN_ID_COLUMNS, TABLE_SINCE, TABLES, ArchiveQueries, ImportRefused, copy_session_tables,
                              insert_session_tables, table_columns)
from .. import __version__
from ..stats import HIST_EDGES_ID, N_BINS
from ..store import SCHEMA_VERSION, resolve_db_path
from ..config import SHARE_PARAM, load_config
from ..safezip import UnsafeZip, check_zip
from ..tokens import token_file_for

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "TABLES",
    "ShareError",
    "ExportResult",
    "ImportResult",
    "export_session",
    "export_bytes",
    "import_session",
    "read_manifest",
    "create_share_token",
    "revoke_share_token",
    "revoke_recorded_token",
    "share_url",
]

FORMAT_NAME = "precision-lab-session"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Largest manifest accepted: a real one is a few kB; a huge one is an attack on the JSON parser.
_MANIFEST_MAX_BYTES = 1 << 20
# A fixed zip timestamp makes two exports of the same session byte-identical.
_ZIP_DATE = (2020, 1, 1, 0, 0, 0)


# Columns without which a table's rows cannot be placed in the session.
_REQUIRED = {
    "sessions": ("session_id", "name"),
    "runs": ("run_id", "session_id"),
    "tensors": ("run_id", "rid"),
    "histograms": ("run_id", "rid", "edges_id", "bins", "counts"),
    "tensor_data": ("run_id", "rid", "npy"),
    "comparisons": ("session_id", "cand_run_id"),
    "diagnoses": ("session_id", "run_id"),
    "warnings": ("session_id",),
    "timeline": ("run_id", "tid", "step", "op"),
    "timeline_formats": ("run_id", "tid", "fmt"),
    "step_scalars": ("run_id", "step", "name"),
}


class ShareError(ValueError):
    """An export or import was refused; the message names the file and the problem."""


@dataclass(frozen=True)
class ExportResult:
    path: Optional[str]
    session: str
    rows: dict
    bytes: int


@dataclass(frozen=True)
class ImportResult:
    session: str  # name in this database
    session_id: str
    original_name: str
    rows: dict
    renamed: bool = False
    new_ids: bool = False  # session or run ids were replaced because they already existed here
    notes: tuple = field(default=())

    @property
    def message(self) -> str:
        n = self.rows.get("tensors", 0)
        runs = self.rows.get("runs", 0)
        msg = f"imported session {self.session!r} ({runs} runs, {n} tensor records)"
        if self.renamed:
            msg += f"; a session named {self.original_name!r} already exists, so it was imported as {self.session!r}"
        for note in self.notes:
            msg += f"; {note}"
        return msg


# ---- export -----------------------------------------------------------------

def _sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


_COPY_CHUNK = 1 << 20


def _file_digest(path: Path) -> tuple[str, int]:
    """(sha256, size) of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest(), path.stat().st_size


def export_bytes(store, session: str) -> bytes:
    """The exported session as zip bytes (for a download button)."""
    out = io.BytesIO()
    _export(store, session, out)
    return out.getvalue()


def _export(store, session: str, out) -> dict:
    """Write the zip to the binary file object ``out``; returns rows per table.

    Tables go to temporary Parquet files first, so memory stays bounded by
    DuckDB's buffers whatever the size of the kept tensors; the manifest,
    which needs their checksums, is the zip's last entry.
    """
    info = store.session(session)
    sid = info["session_id"]
    tables: dict[str, dict] = {}
    with scratch_dir("export") as tmp:
        # what the file carries of the sharer's machine: no path, each file or folder by its name
        public = {"runs": ("source",), "sessions": ("source", "recipe"), "warnings": ("file", "message")}
        for table, (rows, path) in copy_session_tables(store, sid, Path(tmp), rewrite=public, pattern=PATH_DIRS,
                                                        replacement=PATH_DIRS_KEEP).items():
            digest, size = _file_digest(path)
            tables[table] = {"file": path.name, "rows": rows, "sha256": digest, "bytes": size}
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "schema_version": SCHEMA_VERSION,
            "precision_lab_version": __version__,
            "hist_edges_id": HIST_EDGES_ID,
            "session": {"session_id": sid, "name": info["name"]},
            "tables": tables,
        }
        with zipfile.ZipFile(out, "w", allowZip64=True) as zf:
            for table in TABLES:
                zi = zipfile.ZipInfo(tables[table]["file"], date_time=_ZIP_DATE)
                zi.compress_type = zipfile.ZIP_STORED  # Parquet is already compressed
                with open(Path(tmp) / tables[table]["file"], "rb") as src, zf.open(zi, "w", force_zip64=True) as dst:
                    while chunk := src.read(_COPY_CHUNK):
                        dst.write(chunk)
            zi = zipfile.ZipInfo(MANIFEST, date_time=_ZIP_DATE)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, json.dumps(manifest, indent=2, sort_keys=True))
    return {t: v["rows"] for t, v in tables.items()}


def export_session(store, session: str, path: os.PathLike | str) -> ExportResult:
    """Write ``session`` to ``path`` (a zip); the file appears complete or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".zip", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            rows = _export(store, session, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return ExportResult(path=str(path), session=store.session(session)["name"], rows=rows,
                        bytes=path.stat().st_size)


# ---- import -----------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate_manifest(m, where: str) -> dict:
    if not isinstance(m, dict):
        raise ShareError(f"{where}: {MANIFEST} must hold a JSON object, not {type(m).__name__}")
    if m.get("format") != FORMAT_NAME:
        raise ShareError(f"{where}: {MANIFEST} says format {m.get('format')!r}; this is not an exported "
                         f"Precision Lab session (expected {FORMAT_NAME!r})")
    v = m.get("format_version")
    if not _is_int(v):
        raise ShareError(f"{where}: {MANIFEST} has no integer format_version")
    if v > FORMAT_VERSION:
        raise ShareError(f"{where}: {MANIFEST} says format version {v}, newer than this Precision Lab reads "
                         f"({FORMAT_VERSION}); upgrade precision-lab")
    if v < 1:
        raise ShareError(f"{where}: format_version {v} is not valid")

    sv = m.get("schema_version")
    if not _is_int(sv) or sv < 1:
        raise ShareError(f"{where}: {MANIFEST} has no valid schema_version")
    if sv > SCHEMA_VERSION:
        raise ShareError(f"{where}: {MANIFEST} says database schema version {sv}, newer than this "
                         f"Precision Lab ({SCHEMA_VERSION}); upgrade precision-lab")
    s = m.get("session")
    if not isinstance(s, dict) or not isinstance(s.get("session_id"), str) or not isinstance(s.get("name"), str) \
            or not s["session_id"] or not s["name"].strip():
        raise ShareError(f"{where}: {MANIFEST} must name the session (session.session_id and session.name)")
    t = m.get("tables")
    if not isinstance(t, dict):
        raise ShareError(f"{where}: {MANIFEST} has no 'tables' object")
    # a table newer than the archive's schema is absent from it (read as empty)
    missing = [x for x in TABLES if x not in t and TABLE_SINCE.get(x, 1) <= sv]
    unknown = sorted(x for x in t if x not in TABLES)
    if missing:
        raise ShareError(f"{where}: {MANIFEST} does not list table(s) {', '.join(missing)}")
    if unknown:
        raise ShareError(f"{where}: {MANIFEST} lists unknown table(s) {', '.join(map(repr, unknown))}")
    for name in (x for x in TABLES if x in t):
        e = t[name]
        if not isinstance(e, dict):
            raise ShareError(f"{where}: {MANIFEST} entry for table {name} is not an object")
        if e.get("file") != f"{name}.parquet":
            raise ShareError(f"{where}: {MANIFEST} says table {name} is in {e.get('file')!r}; "
                             f"expected '{name}.parquet'")
        if not _is_int(e.get("rows")) or e["rows"] < 0:
            raise ShareError(f"{where}: {MANIFEST} entry for table {name} has no valid row count")
        if not isinstance(e.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", e["sha256"]):
            raise ShareError(f"{where}: {MANIFEST} entry for table {name} has no valid sha256 checksum")
    return m


def read_manifest(path: os.PathLike | str) -> dict:
    """The validated manifest of an exported session (no table is read)."""
    path = Path(path)
    with _open_zip(path, None) as zf:
        return _load_manifest(zf, str(path))


def _load_manifest(zf: zipfile.ZipFile, where: str) -> dict:
    try:
        info = zf.getinfo(MANIFEST)
    except KeyError:
        raise ShareError(f"{where}: no {MANIFEST} inside; this is not an exported Precision Lab session") from None
    if info.file_size > _MANIFEST_MAX_BYTES:
        raise ShareError(f"{where}: {MANIFEST} is {info.file_size} bytes, more than a manifest can be")
    try:
        raw = zf.read(info)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        raise ShareError(f"{where}: {MANIFEST} is corrupt ({e})") from None
    try:
        m = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ShareError(f"{where}: {MANIFEST} is not UTF-8 text") from None
    except ValueError as e:
        raise ShareError(f"{where}: {MANIFEST} is not valid JSON ({e})") from None
    return _validate_manifest(m, where)


def _no_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


class _open_zip:
    """Check an archive with ``safezip`` under the config's limits, then open it."""

    def __init__(self, path: Path, config):
        self.path = path
        config = config or load_config()
        if not path.is_file():
            raise ShareError(f"{path}: no such file")
        size = path.stat().st_size
        if size > config.max_upload_bytes:
            raise ShareError(f"{path}: {size} bytes is more than the upload limit of {config.max_upload_mb} MiB")
        try:
            check_zip(path, config.zip_limits())
        except UnsafeZip as e:
            raise ShareError(str(e)) from None
        try:
            self.zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as e:
            raise ShareError(f"{path}: not a readable zip archive ({e})") from None

    def __enter__(self) -> zipfile.ZipFile:
        return self.zf

    def __exit__(self, *exc) -> None:
        self.zf.close()


_PARQUET_RATIO = 200  # what one exported table may expand to, relative to its stored size ...
_PARQUET_FREE_BYTES = 64 << 20  # ... once past this many bytes


def _read_table(zf: zipfile.ZipFile, where: str, table: str, entry: dict, store_cols: dict):
    import pyarrow as pa
    import pyarrow.parquet as pq

    fname = entry["file"]
    try:
        b = zf.read(fname)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        raise ShareError(f"{where}: {fname} is corrupt inside the zip ({e})") from None
    if _sha256(b) != entry["sha256"]:
        raise ShareError(f"{where}: {fname} does not match the checksum in {MANIFEST}; the file was changed "
                         "after export or the manifest lies")
    try:
        pf = pq.ParquetFile(io.BytesIO(b))
        md, schema = pf.metadata, pf.schema_arrow
        inflated = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ShareError(f"{where}: {fname} is not a readable Parquet file ({first_line(e)[:300]})") from None
    # what the file declares is checked before a value is read: columns, rows, sizes
    cols = list(schema.names)
    if len(cols) > len(store_cols) + 1:
        raise ShareError(f"{where}: {fname} has {len(cols)} columns; table {table} has {len(store_cols)}")
    if table == "sessions" and "share_token" in cols and "share_token" not in store_cols:
        cols.remove("share_token")  # exported before schema 7, always empty: tokens are not exported
    if len(set(cols)) != len(cols):
        raise ShareError(f"{where}: {fname} repeats a column name")
    unknown = [c for c in cols if c not in store_cols]
    if unknown:
        raise ShareError(f"{where}: {fname} has column(s) {few(unknown, quoted=True)} that table {table} does not have "
                         "(exported by a newer or different program?)")
    missing = [c for c in _REQUIRED[table] if c not in cols]
    if missing:
        raise ShareError(f"{where}: {fname} lacks required column(s) {', '.join(missing)}")
    # the checks read values as archived and the database as its own types ('0' and '00' are one rid once
    # stored): each column must already be of its table's type
    for col in schema:
        if col.name in store_cols and not _arrow_fits(col.type, store_cols[col.name]):
            raise ShareError(f"{where}: {fname} column {col.name!r} holds {col.type} where table {table} keeps "
                             f"{store_cols[col.name]}; refusing it")
    if md.num_rows != entry["rows"]:
        raise ShareError(f"{where}: {MANIFEST} says {fname} holds {entry['rows']} rows, the file holds "
                         f"{md.num_rows}; refusing a manifest that does not describe its files")
    # Parquet compresses inside the zip too: bound what it may expand to before reading it, and again as it is
    # decoded (dictionary and run-length encoding pack repeated values below what the metadata counts)
    budget = max(_PARQUET_RATIO * len(b), _PARQUET_FREE_BYTES)
    if inflated > budget:
        raise ShareError(f"{where}: {fname} declares {inflated} bytes of data in {len(b)} bytes, more than "
                         f"{_PARQUET_RATIO}x; refusing it (compression bomb protection)")
    per_row = {f.name: (N_BINS if pa.types.is_list(f.type) or pa.types.is_large_list(f.type) else 1)
               for f in schema}
    for i in range(md.num_row_groups):
        g = md.row_group(i)
        for j in range(g.num_columns):
            c = g.column(j)
            top = c.path_in_schema.split(".")[0]
            if c.num_values > per_row.get(top, 1) * max(g.num_rows, 1):
                raise ShareError(f"{where}: {fname} column {top!r} packs {c.num_values} values into {g.num_rows} "
                                 "rows; refusing it (compression bomb protection)")
    t = _bounded_read(b, schema, where, fname, budget)
    if table == "sessions" and "share_token" in t.column_names and "share_token" not in store_cols:
        t = t.drop_columns(["share_token"])
    return t


def _bounded_read(data: bytes, schema, where: str, fname: str, budget: int):
    """The table, read a batch at a time with text and binary columns kept dictionary-encoded until what they
    decode to is measured: refused (``ShareError``) as soon as the decoded bytes pass ``budget``."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    text = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_binary(f.type)
            or pa.types.is_large_string(f.type) or pa.types.is_large_binary(f.type)]
    used, batches = 0, []
    try:
        pf = pq.ParquetFile(io.BytesIO(data), read_dictionary=text)
        for batch in pf.iter_batches(batch_size=1024):  # small: what one batch decodes to stays small too
            for name, col in zip(batch.schema.names, batch.columns):
                if pa.types.is_dictionary(col.type):
                    n = pc.sum(pc.binary_length(col.dictionary).take(col.indices)).as_py() or 0
                    used += int(n) + 8 * len(col)
                else:
                    used += col.nbytes
                if used > budget:
                    raise ShareError(f"{where}: {fname} expands to more than {budget} bytes when read; refusing "
                                     "it (compression bomb protection)")
            batches.append(batch)
        t = pa.Table.from_batches(batches, schema=pf.schema_arrow) if not batches else pa.Table.from_batches(batches)
    except ShareError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ShareError(f"{where}: {fname} is not a readable Parquet file ({first_line(e)[:300]})") from None
    # decoded now that their size is known: the checks and the insert read plain columns
    for i, f in enumerate(t.schema):
        if pa.types.is_dictionary(f.type):
            t = t.set_column(i, f.name, pc.cast(t.column(i), f.type.value_type))
    return t


def _arrow_fits(arrow_type, duck_type: str) -> bool:
    """Whether an archive column's Arrow type is what this database's column type is written as (or NULLs)."""
    import pyarrow.types as pt

    if pt.is_null(arrow_type):
        return True
    if pt.is_dictionary(arrow_type):  # a dictionary-encoded column is its values (decoded once measured)
        return _arrow_fits(arrow_type.value_type, duck_type)
    if duck_type.endswith("[]"):
        return ((pt.is_list(arrow_type) or pt.is_large_list(arrow_type))
                and _arrow_fits(arrow_type.value_type, duck_type[:-2]))
    return {"BIGINT": pt.is_integer, "INTEGER": pt.is_integer,
            "DOUBLE": lambda x: pt.is_floating(x) or pt.is_integer(x),
            "VARCHAR": lambda x: pt.is_string(x) or pt.is_large_string(x),
            "BOOLEAN": pt.is_boolean,
            "BLOB": lambda x: pt.is_binary(x) or pt.is_large_binary(x)}.get(duck_type, lambda x: False)(arrow_type)


def _col(t, name):
    return t.column(name).to_pylist() if name in t.column_names else []


def _check_consistency(store, where: str, sid: str, name: str, tables: dict) -> None:
    """Every row must belong to the declared session and to runs that the file holds.

    Asked in SQL over the Arrow tables (``store.transfer.ArchiveQueries``): a
    session of a million records is checked in well under a second, and no
    Arrow compute module is loaded for it.
    """
    s = tables["sessions"]
    if s.num_rows != 1:
        raise ShareError(f"{where}: sessions.parquet must hold exactly one session, it holds {s.num_rows}")
    if _col(s, "session_id")[0] != sid or _col(s, "name")[0] != name:
        raise ShareError(f"{where}: sessions.parquet describes session {_col(s, 'name')[0]!r} "
                         f"({_col(s, 'session_id')[0]}), but {MANIFEST} says {name!r} ({sid})")
    runs = tables["runs"]
    run_ids = _col(runs, "run_id")
    if any(r is None or not isinstance(r, str) or not r for r in run_ids):
        raise ShareError(f"{where}: runs.parquet has a run without a run_id")
    if len(set(run_ids)) != len(run_ids):
        raise ShareError(f"{where}: runs.parquet lists a run_id more than once")
    if "order" in runs.column_names:  # the words the pages read back as an enum: no other is stored
        bad = sorted({str(o) for o in _col(runs, "order") if o is not None and o not in RUN_ORDERS})
        if bad:
            raise ShareError(f"{where}: runs.parquet gives a run the order {visible(bad[0])[:40]!r}, not one of "
                             f"{', '.join(RUN_ORDERS)}")
    if tables["tensors"].column("rid").null_count:
        raise ShareError(f"{where}: tensors.parquet has a record without a rid")
    try:
        with ArchiveQueries(store, tables) as q:
            _check_rows(where, sid, tables, q)
    except ShareError:
        raise
    except Exception as e:  # a column of a type the checks cannot read: named, never a traceback
        raise ShareError(f"{where}: its tables cannot be checked ({first_line(e)})") from None
    td = tables["tensor_data"]
    for run, rid, blob in zip(_col(td, "run_id"), _col(td, "rid"), _col(td, "npy")):
        _check_npy(where, run, rid, blob)


def _check_rows(where: str, sid: str, tables: dict, q: ArchiveQueries) -> None:
    session_tables = ("runs", "comparisons", "diagnoses", "warnings")
    others = q.other_sessions(session_tables, sid)
    for table in session_tables:
        if table in others:
            raise ShareError(f"{where}: {table}.parquet holds rows of another session "
                             f"({sorted(map(str, others[table]))[0]}); the file should hold only session {sid}")
    columns = [(table, c, c == "parent_run_id" or table == "warnings" or c == "ref_run_id")
               for table, cols in RUN_ID_COLUMNS.items() if table in tables
               for c in cols if c in tables[table].column_names]
    stray = q.unknown_runs(columns)
    for table, c, _ in columns:
        if (table, c) in stray:
            raise ShareError(f"{where}: {table}.parquet refers to run {sorted(map(str, stray[table, c]))[0]!r} "
                             f"({c}) that runs.parquet does not hold")
    if q.repeats_a_record("tensors"):
        raise ShareError(f"{where}: tensors.parquet lists a (run_id, rid) more than once")
    for table in ("histograms", "tensor_data"):
        if q.repeats_a_record(table):
            raise ShareError(f"{where}: {table}.parquet lists a record more than once")
        missing = q.record_not_in_tensors(table)
        if missing is not None:
            run, rid = missing
            raise ShareError(f"{where}: {table}.parquet refers to record {rid} of run {run!r} that "
                             "tensors.parquet does not hold")
    if q.histograms_disagree():
        raise ShareError(f"{where}: histograms.parquet has a histogram whose bins and counts disagree")
    if q.histogram_out_of_range(N_BINS):
        raise ShareError(f"{where}: histograms.parquet has a bin index outside 0..{N_BINS - 1} or a "
                         "negative count")


def _check_npy(where: str, run, rid, blob) -> None:
    """A kept tensor must be a plain .npy whose header matches its length (never a pickle)."""
    import numpy as np

    problem = None
    if not isinstance(blob, (bytes, bytearray)):
        problem = "is empty"
    else:
        f = io.BytesIO(blob)
        try:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _fortran, dtype = read_header(f, max_header_size=10000)
            if dtype.hasobject:
                problem = "holds Python objects (a pickle), which are never loaded"
            else:
                n = 1
                for d in shape:
                    n *= int(d)
                if len(blob) - f.tell() != n * dtype.itemsize:
                    problem = f"header says shape {list(shape)} {dtype} but the data has a different length"
        except (ValueError, OSError, EOFError, SyntaxError, TypeError) as e:
            problem = f"is not a valid .npy array ({e})"
    if problem:
        raise ShareError(f"{where}: tensor_data.parquet: kept tensor of record {rid} in run {run!r} {problem}")


def import_session(store, source: Union[os.PathLike, str, bytes], *, name: Optional[str] = None,
                   config=None, filename: Optional[str] = None) -> ImportResult:
    """Import an exported session into ``store`` in one transaction.

    ``source``: a path, or the file's bytes (an upload; ``filename`` names it
    in messages).  ``name``: the session's name here (default: its exported
    name); a name already taken gets a ``-2``, ``-3``... suffix, reported in
    ``ImportResult.message``.  Raises ShareError naming the file and the
    problem; the database is unchanged then.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        label = filename or "uploaded file"
        with scratch_dir("import", config) as d:
            p = d / "session.zip"
            p.write_bytes(bytes(source))
            try:
                return _import_path(store, p, name=name, config=config, where=label)
            except ShareError as e:
                # messages name the upload, not the temporary copy
                raise ShareError(str(e).replace(str(p), label)) from None
    p = Path(source)
    return _import_path(store, p, name=name, config=config, where=str(p))


SHARED_SOURCE = "shared archive: "


def _sources_as_text(tables: dict) -> dict:
    """An archive's run sources name folders on the machine that exported it, and replay reads a run's tensors
    from its source folder.  Imported, each becomes ``shared archive: <source>``: kept as text to show, never a
    folder this machine reads (a crafted archive could otherwise point replay at any local dump)."""
    import pyarrow.compute as pc

    runs = tables.get("runs")
    if runs is None or "source" not in runs.column_names:
        return tables
    i = runs.column_names.index("source")
    col = pc.utf8_replace_slice(runs.column(i).cast("string"), start=0, stop=0, replacement=SHARED_SOURCE)
    return {**tables, "runs": runs.set_column(i, "source", col)}


def _import_path(store, path: Path, *, name, config, where: str) -> ImportResult:
    if name is not None:
        name = name.strip()
        if not name:
            raise ShareError(f"{where}: the name to import as cannot be empty")
    with _open_zip(path, config) as zf:
        m = _load_manifest(zf, where)
        held = [t for t in TABLES if t in m["tables"]]
        listed = {MANIFEST} | {m["tables"][t]["file"] for t in held}
        for info in zf.infolist():
            if info.is_dir():
                continue
            if info.filename not in listed:
                raise ShareError(f"{where}: entry {info.filename!r} is not listed in {MANIFEST}; refusing a file "
                                 "that carries more than it declares")
        present = {i.filename for i in zf.infolist()}
        for t in held:
            if m["tables"][t]["file"] not in present:
                raise ShareError(f"{where}: {MANIFEST} lists {m['tables'][t]['file']} but the zip does not hold it")
        columns = table_columns(store, held)
        tables = {t: _read_table(zf, where, t, m["tables"][t], columns[t]) for t in held}
    tables = _sources_as_text(tables)
    sid, orig_name = m["session"]["session_id"], m["session"]["name"]
    _check_consistency(store, where, sid, orig_name, tables)

    wanted = name or orig_name
    try:
        final_name, new_sid, run_map, notes = insert_session_tables(
            store, tables, session_id=sid, name=wanted, where=where, hist_edges_id=m.get("hist_edges_id"),
            schema_version=m["schema_version"])
    except ImportRefused as e:
        raise ShareError(str(e)) from None
    if new_sid != sid or run_map:
        notes.append("its ids already existed in this database, so fresh ones were given")
    rows = {t: tables[t].num_rows if t in tables else 0 for t in TABLES}
    return ImportResult(session=final_name, session_id=new_sid, original_name=wanted, rows=rows,
                        renamed=final_name != wanted, new_ids=bool(new_sid != sid or run_map), notes=tuple(notes))


RUN_ORDERS = RunOrder.words()


# ---- share links ------------------------------------------------------------

def create_share_token(store, session: str) -> str:
    """Give ``session`` a fresh unguessable token (replacing any old one) and return it."""
    token = secrets.token_urlsafe(16)  # 128 random bits
    store.set_share_token(session, token)
    return token


def revoke_share_token(store, session: str) -> None:
    """Make the session's share link stop working (from the server's next request)."""
    store.set_share_token(session, None)


def revoke_recorded_token(db_path, session: str) -> list[dict]:
    """Revoke ``session``'s link in the token file beside the database at ``db_path``,
    without opening the database (a running server holds it).

    ``session``: the name or id recorded with the token.  Returns the
    entries removed (``session_id``, ``name``, ``token``); empty when no link
    of that session is recorded.  A server reading the same file refuses the
    token from its next request.
    """
    tf = token_file_for(resolve_db_path(db_path))
    if tf is None or not tf.exists():
        return []
    return tf.revoke(session)


def share_url(base_url: str, token: str) -> str:
    """``base_url`` with ``?share=<token>`` added (other query parameters kept)."""

    parts = urlsplit(base_url)
    q = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in (SHARE_PARAM, "session")]
    q.append((SHARE_PARAM, token))
    return urlunsplit((parts.scheme, parts.netloc, parts.path or "/", urlencode(q), parts.fragment))
