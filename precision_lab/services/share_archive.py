"""Reading an exported session archive (``share``) without trusting it: the manifest, each table (its checksum,
row count, columns and their types, and bounds on what it expands to), then every row's place in the declared
session and its runs, and every kept tensor's ``.npy`` header."""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from pathlib import Path

from ..config import load_config
from ..display import few, visible
from ..enums import RunOrder
from ..readers import first_line
from ..safezip import UnsafeZip, check_zip
from ..stats import N_BINS
from ..store import SCHEMA_VERSION
from ..store.transfer import RUN_ID_COLUMNS, TABLE_SINCE, TABLES, ArchiveQueries

FORMAT_NAME = "precision-lab-session"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Largest manifest accepted: a real one is a few kB; a huge one is an attack on the JSON parser.
_MANIFEST_MAX_BYTES = 1 << 20
RUN_ORDERS = RunOrder.words()


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


def _sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


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
    _check_columns(where, fname, table, schema, store_cols)
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


def _check_columns(where: str, fname: str, table: str, schema, store_cols: dict) -> None:
    """An archived table's columns (``schema``) must be ones of the store's table (``store_cols``: name -> type),
    each once, of its type, with the columns that place its rows in the session."""
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
