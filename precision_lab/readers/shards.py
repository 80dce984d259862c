"""Parquet shards: how a capture in another process (or another rank) hands over its records.

Layout under a root folder::

    <root>/manifest.json
    <root>/<run name>/rank<R>/step<S>.parquet

One file per run, rank and step, written whole (to a temporary name, then
renamed) so a reader never sees half a file.  ``manifest.json`` is::

    {"format": "precision-lab-shards", "version": 1,
     "runs": [{"run_id", "name", "dtype", "kind", "parent_run_id", "fix",
               "policy", "source", "order", "ranks", "steps", "files",
               "hist_edges_id", "warnings"}, ...]}

Each rank merges its run entry into the manifest under a file lock, so ranks
of one job can finish in any order.

Columns of a shard are the ``tensors`` table's (record fields, stats fields,
``name``, ``nonfinite``), plus the sparse magnitude histogram
(``hist_edges_id``, ``hist_bins``, ``hist_counts``), an optional kept tensor
(``tensor_npy``, ``.npy`` bytes) and an optional local-error comparison of an
output with its own fp32 re-run (``local_json``).  DuckDB reads every shard
at once: ``read_parquet('<root>/*/rank*/step*.parquet', filename=true)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from .base import ReadError, natural_key
from .safeio import check_regular, contained, limits, npy_header, read_json, relname
from ..records import StepScalar, TensorRecord, TimelineRow, TimelineShare, dataclass_columns, npy_bytes, record_columns
from ..jsoncodec import decode_nonfinite, dumps
from ..display import visible
from ..enums import RunOrder
from ..stats import HIST_EDGES_ID, N_BINS, HistogramError, TensorStats, decode_hist, encode_hist
from ..metrics import Comparison

__all__ = ["write_shard", "write_manifest", "read_shards", "read_manifest", "read_local_comparisons",
           "write_timeline", "read_timeline", "kept_tensor", "checked_runs",
           "ShardError", "SHARD_FORMAT", "SHARD_VERSION", "shard_path", "shard_glob"]

SHARD_FORMAT = "precision-lab-shards"
SHARD_VERSION = 1
MANIFEST = "manifest.json"
_RUN_KEYS = ("run_id", "name", "dtype", "kind", "parent_run_id", "fix", "policy", "source", "order")
_ORDERS = RunOrder.words()
_NAME_OK = re.compile(r"^[A-Za-z0-9_.+=@-][A-Za-z0-9 _.+=@-]*$")
_SHARD_RE = re.compile(r"^rank(\d+)$"), re.compile(r"^step(\d+)\.parquet$")


class ShardError(ValueError):
    """A shard folder that cannot be read; the message names the file and the problem."""


def _check_run_name(name: str) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or not _NAME_OK.match(name):
        raise ShardError(
            f"run name {name!r} cannot be a shard folder name: use letters, digits, spaces and _ . + = @ -"
        )
    return name


def shard_path(root, run_name: str, rank: int, step: int) -> Path:
    return Path(root) / _check_run_name(run_name) / f"rank{int(rank)}" / f"step{int(step)}.parquet"


def shard_glob(root) -> str:
    """The glob DuckDB's ``read_parquet`` takes to read every shard under ``root``."""
    return str(Path(root) / "*" / "rank*" / "step*.parquet")


# ---- schema -------------------------------------------------------------------

# columns a shard written by an earlier version may lack (read as unknown)
_OPTIONAL = frozenset({"neg_inf_count", "parent", "location"})
_ARROW = {"int": "int64", "float": "float64", "str": "string", "bool": "bool_"}


def _columns() -> list[tuple[str, str]]:
    """(name, kind) of the record+stats columns, the store's own definition."""
    return [(n, k) for n, k in record_columns() if n not in ("rid", "has_hist")]


def _schema():
    import pyarrow as pa

    fields = []
    for n, t in _columns():
        fields.append(pa.field(n, getattr(pa, _ARROW[t])()))
    fields += [
        pa.field("hist_edges_id", pa.string()),
        pa.field("hist_bins", pa.list_(pa.int32())),
        pa.field("hist_counts", pa.list_(pa.int64())),
        pa.field("tensor_npy", pa.binary()),
        pa.field("local_json", pa.string()),
    ]
    return pa.schema(fields)


def write_shard(root, run_meta: dict, records, *, rank: int, step: int,
                local_comparisons: Optional[dict] = None) -> Path:
    """Write one run's records of one rank and step to ``<root>/<run>/rank<R>/step<S>.parquet``.

    ``local_comparisons`` maps a position in ``records`` to the
    :class:`~precision_lab.metrics.Comparison` of that output with its own fp32
    re-run.  Returns the file written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = run_meta.get("name")
    path = shard_path(root, name, rank, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = _columns()
    stat_names = {f.name for f in dataclasses.fields(_stats_cls())}
    rec_names = {f.name for f in dataclasses.fields(TensorRecord)}
    data: dict[str, list] = {n: [] for n, _ in cols}
    extra = {"hist_edges_id": [], "hist_bins": [], "hist_counts": [], "tensor_npy": [], "local_json": []}
    local_comparisons = local_comparisons or {}
    for i, rec in enumerate(records):
        s = rec.stats
        if s is None:
            raise ShardError(f"record {rec.name} of run {name!r} has no statistics; nothing to write")
        for n, _ in cols:
            if n in rec_names:
                v = getattr(rec, n)
                if n in ("rank", "step"):
                    v = int(v)
            elif n == "shape":
                v = json.dumps([int(x) for x in s.shape])
            elif n in stat_names:
                v = getattr(s, n)
            elif n == "name":
                v = rec.name
            elif n == "nonfinite":
                v = s.has_nonfinite
            else:
                v = None
            data[n].append(v)
        if s.hist is not None:
            bins, counts = encode_hist(s.hist)
            extra["hist_edges_id"].append(HIST_EDGES_ID)
            extra["hist_bins"].append(bins)
            extra["hist_counts"].append(counts)
        else:
            extra["hist_edges_id"].append(None)
            extra["hist_bins"].append(None)
            extra["hist_counts"].append(None)
        extra["tensor_npy"].append(npy_bytes(rec.tensor) if rec.tensor is not None else None)
        cmp = local_comparisons.get(i)
        extra["local_json"].append(dumps(cmp.to_dict()) if cmp is not None else None)
    table = pa.table({**data, **extra}, schema=_schema())
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)
    return path


def _stats_cls():
    return TensorStats


# ---- manifest ------------------------------------------------------------------

@contextlib.contextmanager
def _locked(root: Path):
    """An exclusive lock on ``<root>/.manifest.lock`` (ranks merge the manifest one at a time)."""
    lock = root / ".manifest.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - non-POSIX: best effort
            pass
        yield
    finally:
        os.close(fd)


def _scan_run(root: Path, name: str) -> tuple[list[int], list[int], list[str]]:
    ranks, steps, files = set(), set(), []
    run_dir = root / name
    for d in (run_dir, *(sorted(run_dir.iterdir()) if run_dir.is_dir() and not run_dir.is_symlink() else ())):
        if d.is_symlink():  # linked folders are never followed
            raise ShardError(f"{d.relative_to(root).as_posix()}: is a symbolic link; dumps are read without "
                             "following links")
    if run_dir.is_dir():
        for rdir in sorted(run_dir.iterdir()):
            m = _SHARD_RE[0].match(rdir.name)
            if not m or not rdir.is_dir():
                continue
            for f in sorted(rdir.iterdir()):
                ms = _SHARD_RE[1].match(f.name)
                if ms:
                    ranks.add(int(m.group(1)))
                    steps.add(int(ms.group(1)))
                    files.append(f.relative_to(root).as_posix())
    return sorted(ranks), sorted(steps), files


def write_manifest(root, runs, *, running_rank: Optional[int] = None, finished_rank: Optional[int] = None) -> Path:
    """Merge ``runs`` (run-meta dicts) into ``<root>/manifest.json``; returns its path.

    Runs are keyed by name: an entry already there (another rank's) keeps
    its fields and gains this call's ranks, steps and files, which are read
    from the folder itself.  A capture writes it as each step's shard is
    written (``running_rank``: listed in ``running_ranks``) and once more as
    it ends (``finished_rank``: taken off that list); a rank still listed
    when the folder is read was cut off.
    """

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / MANIFEST
    with _locked(root):
        if path.exists():
            doc = read_manifest(root)
        else:
            doc = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "runs": []}
        by_name = {r["name"]: r for r in doc["runs"]}
        for meta in runs:
            name = _check_run_name(meta.get("name"))
            entry = by_name.get(name)
            if entry is None:
                entry = {k: meta.get(k) for k in _RUN_KEYS}
                entry["warnings"] = []
                doc["runs"].append(entry)
                by_name[name] = entry
            else:
                for k in _RUN_KEYS:
                    if entry.get(k) in (None, "") and meta.get(k) not in (None, ""):
                        entry[k] = meta[k]
            for w in meta.get("warnings") or []:
                if w not in entry["warnings"]:
                    entry["warnings"].append(w)
            entry["ranks"], entry["steps"], entry["files"] = _scan_run(root, name)
            entry["hist_edges_id"] = HIST_EDGES_ID
            running = set(entry.get("running_ranks") or [])
            if running_rank is not None:
                running.add(int(running_rank))
            if finished_rank is not None:
                running.discard(int(finished_rank))
            entry["running_ranks"] = sorted(running)
        doc["created"] = doc.get("created") or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        tmp = path.with_name(f"{MANIFEST}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
    return path


def read_manifest(root) -> dict:
    """The validated manifest of a shard folder.

    Messages name files relative to ``root``; every file the manifest lists
    must stay inside ``root`` (see ``precision_lab.readers.safeio``).
    """
    root = Path(root)
    path = Path(MANIFEST)  # as named in messages
    if not os.path.lexists(root / MANIFEST):
        doc = _rebuilt_manifest(root)
        if doc is None:
            raise ShardError(f"{root / MANIFEST}: no manifest.json; not a Precision Lab shard folder")
    else:
        try:
            doc = read_json(root / MANIFEST, MANIFEST, root, what="manifest")
        except ReadError as e:
            raise ShardError(str(e)) from None
    if not isinstance(doc, dict) or doc.get("format") != SHARD_FORMAT:
        raise ShardError(f"{path}: \"format\" is {doc.get('format') if isinstance(doc, dict) else doc!r}, "
                         f"expected {SHARD_FORMAT!r}")
    v = doc.get("version")
    if not isinstance(v, int) or v < 1:
        raise ShardError(f"{path}: \"version\" must be a positive integer, got {v!r}")
    if v > SHARD_VERSION:
        raise ShardError(f"{path}: shard format version {v} is newer than this Precision Lab reads "
                         f"({SHARD_VERSION}); upgrade precision-lab")
    runs = doc.get("runs")
    if not isinstance(runs, list):
        raise ShardError(f"{path}: \"runs\" must be a list")
    seen = set()
    for i, r in enumerate(runs):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str):
            raise ShardError(f"{path}: runs[{i}] must be an object with a \"name\"")
        try:
            _check_run_name(r["name"])
        except ShardError as e:
            raise ShardError(f"{path}: runs[{i}]: {e}") from None
        if r["name"] in seen:
            raise ShardError(f"{path}: run {r['name']!r} is listed twice")
        seen.add(r["name"])
        for key in _RUN_KEYS:  # what is stored as text is text (a policy may be an object)
            if key != "policy" and r.get(key) is not None and not isinstance(r[key], str):
                raise ShardError(f"{path}: runs[{i}] \"{key}\" must be a string, got {type(r[key]).__name__}")
        if r.get("order") and r["order"] not in _ORDERS:
            raise ShardError(f"{path}: runs[{i}] \"order\" is {visible(r['order'])[:40]!r}, not one of "
                             f"{', '.join(_ORDERS)}")
        files = r.get("files") or []
        if not isinstance(files, list):
            raise ShardError(f"{path}: runs[{i}] \"files\" must be a list")
        for f in files:
            if not isinstance(f, str) or f.startswith(("/", "\\")) or ".." in Path(f).parts:
                raise ShardError(f"{path}: runs[{i}] lists file {f!r} outside the shard folder")
    return doc


def _rebuilt_manifest(root: Path) -> Optional[dict]:
    """A manifest for a shard folder that has none (its capture was killed before a step's manifest was
    written, or by a version that wrote it only at the end): each folder holding ``rank<R>/step<S>.parquet`` is
    a run of that name, none of its ranks finished.  None where no folder holds shards."""
    runs = []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if d.is_dir() and not d.is_symlink() and _NAME_OK.match(d.name) and any(d.glob("rank*/step*.parquet")):
            runs.append({"name": d.name, "warnings": [
                ["manifest.json", "the folder had no manifest.json (its capture was cut off): rebuilt from the "
                                  "shards, with the run's name from its folder and no kind, policy or order"]]})
    if not runs:
        return None
    return {"format": SHARD_FORMAT, "version": SHARD_VERSION, "runs": runs}


def _run_meta(entry: dict) -> dict:
    meta = {k: entry.get(k) for k in _RUN_KEYS}
    meta["run_id"] = meta["run_id"] or entry["name"]
    meta["kind"] = meta["kind"] or "candidate"
    meta["order"] = meta["order"] or "execution"
    meta["source"] = meta["source"] or "capture"
    meta["dtype"] = meta["dtype"] or ""
    meta["warnings"] = list(entry.get("warnings") or [])
    running = entry.get("running_ranks")
    if isinstance(running, list):  # a rank whose capture wrote steps and never ended was cut off
        for r in sorted({x for x in running if isinstance(x, int) and not isinstance(x, bool)}):
            meta["warnings"].append(["manifest.json", f"rank {r} of run {entry['name']!r} did not finish (its "
                                     "capture was cut off): the steps it wrote are read; its timeline, warnings "
                                     "and any later step are missing"])
    return meta


def _run_files(root: Path, entry: dict) -> list[Path]:

    try:
        listed = [contained(root, root, f, what="shard file", where=MANIFEST) for f in entry.get("files") or []]
    except ReadError as e:
        raise ShardError(str(e)) from None
    for p in listed:
        if not os.path.lexists(p):
            raise ShardError(f"{relname(root, p)}: listed in {MANIFEST} but missing")
    found = [root / f for f in _scan_run(root, entry["name"])[2]]
    files = {os.path.normpath(p): p for p in listed + found}
    for p in files.values():
        try:
            check_regular(p, relname(root, p))
        except ReadError as e:
            raise ShardError(str(e)) from None
    return sorted(files.values(), key=_file_order)


def _file_order(p: Path):
    r = _SHARD_RE[0].match(p.parent.name)
    s = _SHARD_RE[1].match(p.name)
    return (int(r.group(1)) if r else 0, int(s.group(1)) if s else 0, str(p))


_BATCH_ROWS = 1024


_TEXT_MAX = 64 << 10  # longest name, dtype or shape text a record may carry
_LOCAL_JSON_MAX = 1 << 20  # longest local-comparison JSON
_TEXT_COLUMNS_LARGE = {"tensor_npy": None, "local_json": _LOCAL_JSON_MAX}  # None: bounded by max_tensor_mb


def _open_shard(path: Path, shown: str):
    """The shard's ParquetFile, checked from metadata before any row is read.

    Rows and row-group bytes against the limits, and the leaf values of the
    histogram lists against ``N_BINS`` per row (run-length encoding can pack
    a billion values in a few bytes).  Text and binary columns are read
    dictionary-encoded, so a repeated huge value is held once and measured
    (``_rows``) before any row is turned into Python objects.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    lim = limits()
    try:
        schema = pq.read_schema(path)
        text = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_binary(f.type)
                or pa.types.is_large_string(f.type) or pa.types.is_large_binary(f.type)]
        pf = pq.ParquetFile(path, read_dictionary=text)
        md = pf.metadata
        groups = [md.row_group(i) for i in range(md.num_row_groups)]
        leaf = {}
        for g in groups:
            for j in range(g.num_columns):
                c = g.column(j)
                top = c.path_in_schema.split(".")[0]
                leaf[top] = max(leaf.get(top, 0), c.num_values / max(g.num_rows, 1))
    except ReadError as e:
        raise ShardError(str(e)) from None
    except Exception as e:
        raise ShardError(f"{shown}: not a readable Parquet shard ({type(e).__name__}: {e})") from None
    if md.num_rows > lim.max_file_records:
        raise ShardError(f"{shown}: {md.num_rows} rows, more than the limit of {lim.max_file_records} records per "
                         "file (max_file_records)")
    big = max((g.total_byte_size for g in groups), default=0)
    if big > lim.max_tensor_bytes:
        raise ShardError(f"{shown}: a row group expands to {big} bytes, more than the limit of "
                         f"{lim.max_tensor_bytes} bytes (max_tensor_mb)")
    for col in ("hist_bins", "hist_counts"):
        if leaf.get(col, 0) > N_BINS:
            raise ShardError(f"{shown}: column {col} holds more values per record than the {N_BINS} histogram "
                             "bins; refusing the shard")
    need = [n for n, _ in _columns() if n not in _OPTIONAL] + ["hist_bins", "hist_counts"]
    missing = [n for n in need if n not in schema.names]
    if missing:
        raise ShardError(f"{shown}: shard lacks column(s) {', '.join(missing)}")
    for name, kind in _columns():  # each column of the type the store's column has: nothing fails at insert
        if name in schema.names and not _TYPE_OK[kind](schema.field(name).type):
            raise ShardError(f"{shown}: column {name} holds {schema.field(name).type}, not {_TYPE_WORD[kind]}")
    return pf


def _text_type(t) -> bool:
    import pyarrow as pa

    t = t.value_type if pa.types.is_dictionary(t) else t
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def _type_check(*preds):
    def ok(t) -> bool:
        import pyarrow as pa

        return pa.types.is_null(t) or any(getattr(pa.types, p)(t) for p in preds)

    return ok


_TYPE_OK = {"int": _type_check("is_integer"), "float": _type_check("is_floating", "is_integer"),
            "str": _text_type, "bool": _type_check("is_boolean")}
_TYPE_WORD = {"int": "integers", "float": "numbers", "str": "text", "bool": "true/false values"}


def _value_lengths(col):
    """Bytes of each row's value of a text/binary column (dictionary-encoded or not), nulls as 0."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(col.type):
        lengths = pc.binary_length(col.dictionary).take(col.indices)
    else:
        lengths = pc.binary_length(col)
    return np.asarray(lengths.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)


def _rows(pf, shown: str) -> Iterator[dict]:
    """Rows of a shard as dicts (``_batches``)."""
    for batch in _batches(pf, shown):
        yield from batch.to_pylist()


def _batches(pf, shown: str):
    """Record batches of a shard, a few rows at a time: memory bounded by one slice of rows, not the file.

    Before rows become Python objects, every text value is measured: names
    over 64 KiB, a local comparison over 1 MiB or a kept tensor over
    ``max_tensor_mb`` refuse the shard, and so does a batch of rows whose
    values add up to more than ``max_tensor_mb`` (the same bound the
    metadata check puts on a row group, applied after dictionary decoding).
    """
    import pyarrow as pa

    lim = limits()
    cap, n = lim.max_file_records, 0
    try:
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS):
            n += batch.num_rows
            if n > cap:  # metadata that understated the rows
                raise ShardError(f"{shown}: more than the limit of {cap} records per file (max_file_records)")
            sizes = np.zeros(batch.num_rows, dtype=np.int64)
            for name, col in zip(batch.schema.names, batch.columns):
                t = col.type.value_type if pa.types.is_dictionary(col.type) else col.type
                if not (pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t)
                        or pa.types.is_large_binary(t)):
                    continue
                lengths = _value_lengths(col)
                bound = _TEXT_COLUMNS_LARGE.get(name, _TEXT_MAX)
                bound = lim.max_tensor_bytes if bound is None else bound
                if lengths.size and lengths.max() > bound:
                    raise ShardError(f"{shown}: a record's {name} holds {int(lengths.max())} bytes, more than the "
                                     f"limit of {bound} bytes")
                sizes += lengths
            if int(sizes.sum()) > lim.max_tensor_bytes:  # repeated dictionary values, decoded
                raise ShardError(f"{shown}: {batch.num_rows} records expand to {int(sizes.sum())} bytes when read, "
                                 f"more than the limit of {lim.max_tensor_bytes} bytes (max_tensor_mb)")
            yield batch
    except ShardError:
        raise
    except Exception as e:
        raise ShardError(f"{shown}: not a readable Parquet shard ({type(e).__name__}: {e})") from None


def _kept_tensor(data: bytes, where: str):
    """A kept tensor's ``.npy`` bytes, its header checked against the limits before the array is built."""

    buf = io.BytesIO(data)
    try:
        shape, fortran, dtype, offset = npy_header(buf, where)
    except ReadError as e:
        raise ShardError(f"{where} is not a valid .npy: {str(e)[len(where) + 2:]}") from None
    n = int(np.prod(shape, dtype=object)) if shape else 1
    if len(data) - offset != n * dtype.itemsize:
        raise ShardError(f"{where}: the header says shape {list(shape)} of {dtype} but {len(data) - offset} bytes "
                         "follow it")
    arr = np.frombuffer(data, dtype=dtype, count=n, offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")


def kept_tensor(root, path: Path, name: str, step: int, rank: int):
    """The kept tensor of record ``name`` at ``step`` and ``rank`` in shard ``path``, read with the checks
    ``read_shards`` makes (metadata and value sizes within the limits, the ``.npy`` header before the data);
    None when the shard keeps no tensor of that record."""
    shown = relname(Path(root), path)
    try:
        check_regular(path, shown)
    except ReadError as e:
        raise ShardError(str(e)) from None
    for row in _rows(_open_shard(path, shown), shown):
        if row.get("name") == name and row.get("step") == step and row.get("rank") == rank \
                and row.get("tensor_npy") is not None:
            return _kept_tensor(row["tensor_npy"], f"{shown}: kept tensor of {name!r}")
    return None


def _row_stats(path, row: dict):
    bins, counts = row.get("hist_bins"), row.get("hist_counts")
    hist = None
    if bins is not None:
        try:
            hist = decode_hist(bins, counts, edges_id=row.get("hist_edges_id"))
        except HistogramError as e:
            raise ShardError(f"{path}: histogram of {row.get('name')!r}: {e}") from None
    try:
        return TensorStats.from_row(row, hist)
    except (TypeError, ValueError) as e:
        raise ShardError(f"{path}: record {row.get('name')!r} has {e}" if str(e).startswith("shape")
                         else f"{path}: record {row.get('name')!r}: {e}") from None


def _iter_file(root: Path, path: Path, meta: dict, with_local: bool = False):
    shown = relname(root, path)
    pf = _open_shard(path, shown)
    rec_fields = [f.name for f in dataclasses.fields(TensorRecord) if f.name not in ("stats", "tensor")]
    for row in _rows(pf, shown):
        for n in ("op", "role", "index"):
            if not isinstance(row.get(n), str):
                raise ShardError(f"{shown}: a record has no {n!r}")
        stats = _row_stats(shown, row)
        tensor = None
        if row.get("tensor_npy") is not None:
            tensor = _kept_tensor(row["tensor_npy"], f"{shown}: kept tensor of {row.get('name')!r}")
        kw = {n: row.get(n) for n in rec_fields}
        kw["run_id"] = meta["run_id"]
        kw["source"] = shown  # the file it was read from, relative to the shard folder
        rec = TensorRecord(stats=stats, tensor=tensor, **kw)
        if with_local:
            yield rec, row.get("local_json")
        else:
            yield rec


def read_shards(root) -> Iterator[tuple[dict, TensorRecord]]:
    """Every record of every run in a shard folder, as ``(run_meta, TensorRecord)``.

    Runs in manifest order; within a run, files in (rank, step) order and
    records in the order written (execution order).  ``run_meta`` has
    run_id, name, dtype, kind, parent_run_id, fix, policy, source, order and
    warnings.  Raises :class:`ShardError` naming the file on bad input.
    """
    root = Path(root)
    doc = read_manifest(root)
    for entry in doc["runs"]:
        meta = _run_meta(entry)
        for path in _run_files(root, entry):
            for rec in _iter_file(root, path, meta):
                yield meta, rec


def checked_runs(root) -> list[tuple[dict, list[Path], frozenset]]:
    """Every run of a shard folder as ``(run_meta, files, columns)``, for readers that query the files where
    they lie (DuckDB's ``read_parquet``) instead of reading them here: the manifest read (or rebuilt), each
    file listed or found checked from its metadata as ``read_shards`` checks it (a regular file inside the
    folder, rows and row-group bytes within the limits, every column of its type) and ``columns`` the
    record columns any of the run's files holds.  Raises :class:`ShardError` naming the file."""
    root = Path(root)
    out = []
    for entry in read_manifest(root)["runs"]:
        files = _run_files(root, entry)
        names: set = set()
        for path in files:
            names.update(_open_shard(path, relname(root, path)).schema_arrow.names)
        out.append((_run_meta(entry), files, frozenset(names)))
    return out


def read_local_comparisons(root) -> Iterator[tuple[dict, TensorRecord, object]]:
    """``(run_meta, output record, Comparison)`` for every stored local-error comparison."""

    root = Path(root)
    doc = read_manifest(root)
    names = {f.name for f in dataclasses.fields(Comparison)}
    for entry in doc["runs"]:
        meta = _run_meta(entry)
        for path in _run_files(root, entry):
            for rec, js in _iter_file(root, path, meta, with_local=True):
                if js is None:
                    continue
                try:
                    d = json.loads(js)
                    d = {k: decode_nonfinite(v) for k, v in d.items() if k in names}
                    if d.get("basis") == "stats" and "summary_rel_err" not in d:
                        # written before the summary fields: its max_*_err compared the summaries
                        for f in ("abs", "rel"):
                            d[f"summary_{f}_err"], d[f"max_{f}_err"] = d.get(f"max_{f}_err"), None
                    cmp = Comparison(**d)
                except (TypeError, ValueError) as e:
                    raise ShardError(f"{relname(root, path)}: local comparison of {rec.name!r} is malformed "
                                     f"({e})") from None
                yield meta, rec, cmp


# ---- a long run's timeline: one file per table, rank and run -------------------------------------------

_TIMELINE = {"timeline": TimelineRow, "timeline_formats": TimelineShare, "step_scalars": StepScalar}


def _arrow_type(kind: str):
    """The Arrow type a column of this kind is stored as."""
    import pyarrow as pa

    return {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}[kind]


def _timeline_schema(cls):
    import pyarrow as pa

    arrow = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}
    return pa.schema([(n, arrow[k]) for n, k in dataclass_columns(cls)])


def write_timeline(root, run_meta: dict, *, rank: int, rows, shares, scalars) -> list[Path]:
    """Write one rank's timeline of a run to ``<root>/<run>/rank<R>/{timeline,timeline_formats,step_scalars}.parquet``
    (``tid`` numbers are the rank's own; ingest makes them unique per run)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    for table, items in (("timeline", rows), ("timeline_formats", shares), ("step_scalars", scalars)):
        cls = _TIMELINE[table]
        path = Path(root) / _check_run_name(run_meta.get("name")) / f"rank{int(rank)}" / f"{table}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        schema = _timeline_schema(cls)
        t = pa.table({f.name: [getattr(x, f.name) for x in items] for f in schema}, schema=schema)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        pq.write_table(t, tmp, compression="zstd")
        os.replace(tmp, path)
        out.append(path)
    return out


def _timeline_table(root: Path, path: Path, cls):
    """A timeline file as an Arrow table of ``cls``'s columns, each of the store's type: checked as a record
    shard is (a regular file, rows and text sizes within the limits, every column of its type), never turned
    into Python objects (a long run of 64 ranks holds millions of rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shown = relname(root, path)
    try:
        check_regular(path, shown)
    except ReadError as e:
        raise ShardError(str(e)) from None
    cols = dataclass_columns(cls)
    try:
        schema = pq.read_schema(path)
        text = [f.name for f in schema if _text_type(f.type) and not pa.types.is_null(f.type)]
        pf = pq.ParquetFile(path, read_dictionary=text)
        md = pf.metadata
    except Exception as e:
        raise ShardError(f"{shown}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    if md.num_rows > limits().max_file_records:
        raise ShardError(f"{shown}: {md.num_rows} rows, more than the limit of {limits().max_file_records} "
                         "records per file (max_file_records)")
    missing = [n for n, _ in cols if n not in schema.names]
    if missing:
        raise ShardError(f"{shown}: lacks column(s) {', '.join(missing)}")
    for n, k in cols:
        if not _TYPE_OK[k](schema.field(n).type):
            raise ShardError(f"{shown}: column {n} holds {schema.field(n).type}, not {_TYPE_WORD[k]}")
    batches = list(_batches(pf, shown))
    t = pa.Table.from_batches(batches) if batches else pf.schema_arrow.empty_table()
    return pa.table({n: t.column(n).cast(_arrow_type(k)) for n, k in cols})


def _empty_timeline(cls):
    import pyarrow as pa

    return pa.table({n: pa.array([], _arrow_type(k)) for n, k in dataclass_columns(cls)})


def read_timeline(root) -> Iterator[tuple[dict, int, object, object, object]]:
    """``(run_meta, rank, rows, shares, scalars)`` of every rank folder holding a timeline: Arrow tables of the
    ``TimelineRow``, ``TimelineShare`` and ``StepScalar`` columns."""
    root = Path(root)
    doc = read_manifest(root)
    for entry in doc["runs"]:
        meta = _run_meta(entry)
        run_dir = root / entry["name"]
        if not run_dir.is_dir() or run_dir.is_symlink():
            continue
        for rdir in sorted(run_dir.iterdir(), key=lambda p: natural_key(p.name)):
            m = _SHARD_RE[0].match(rdir.name)
            if not m or rdir.is_symlink() or not rdir.is_dir():
                continue
            got = {t: (_timeline_table(root, rdir / f"{t}.parquet", cls) if os.path.lexists(rdir / f"{t}.parquet")
                       else _empty_timeline(cls)) for t, cls in _TIMELINE.items()}
            if any(g.num_rows for g in got.values()):
                yield meta, int(m.group(1)), got["timeline"], got["timeline_formats"], got["step_scalars"]
