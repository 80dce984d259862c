"""A long run's timeline in a shard folder: one Parquet file per table, rank and run
(``<root>/<run>/rank<R>/{timeline,timeline_formats,step_scalars}.parquet``), written by a capture and read back as
Arrow tables with the checks a record shard gets."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .base import ReadError, natural_key
from .safeio import check_regular, limits, relname
from .shardcheck import _TYPE_OK, _TYPE_WORD, _batches, _text_type
from .shardformat import _SHARD_RE, ShardError, _check_run_name
from .shardmanifest import _run_meta, read_manifest
from ..records import StepScalar, TimelineRow, TimelineShare, dataclass_columns

if TYPE_CHECKING:
    import pyarrow as pa


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


@dataclass(frozen=True, slots=True)
class RankTimeline:
    """One rank's timeline of a run in a shard folder: the run's id (the manifest's, else its name), the rank, and
    Arrow tables of the ``TimelineRow``, ``TimelineShare`` and ``StepScalar`` columns."""

    run_id: str
    rank: int
    rows: pa.Table
    shares: pa.Table
    scalars: pa.Table


def read_timeline(root) -> Iterator[RankTimeline]:
    """The timeline of every rank folder holding one."""
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
                yield RankTimeline(meta["run_id"], int(m.group(1)), got["timeline"], got["timeline_formats"],
                                   got["step_scalars"])
