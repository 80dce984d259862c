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

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from .shardcheck import TEXT_MAX, _iter_file, _open_shard, kept_tensor
from .shardformat import SHARD_FORMAT, SHARD_VERSION, ShardError, _columns, _schema, shard_glob, shard_path
from .shardmanifest import _run_files, _run_meta, read_manifest, write_manifest
from .shardtimeline import read_timeline, write_timeline
from .safeio import relname
from ..records import TensorRecord, npy_bytes, record_column_values
from ..jsoncodec import decode_nonfinite, dumps
from ..stats import HIST_EDGES_ID, hist_list_arrays
from ..metrics import Comparison

__all__ = ["write_shard", "write_manifest", "read_shards", "read_manifest", "read_local_comparisons",
           "write_timeline", "read_timeline", "kept_tensor", "CheckedRun", "checked_runs",
           "ShardError", "SHARD_FORMAT", "SHARD_VERSION", "shard_path", "shard_glob", "TEXT_MAX"]


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
    records = list(records)
    for rec in records:
        if rec.stats is None:
            raise ShardError(f"record {rec.name} of run {name!r} has no statistics; nothing to write")
    data = record_column_values(records, [n for n, _ in _columns()]).by_name
    for n in ("rank", "step"):
        data[n] = [int(v) for v in data[n]]
    bins, counts = hist_list_arrays([rec.stats.hist for rec in records])
    local_comparisons = local_comparisons or {}
    extra = {
        "hist_edges_id": [HIST_EDGES_ID if rec.stats.hist is not None else None for rec in records],
        "hist_bins": bins, "hist_counts": counts,
        "tensor_npy": [npy_bytes(rec.tensor) if rec.tensor is not None else None for rec in records],
        "local_json": [dumps(c.to_dict()) if (c := local_comparisons.get(i)) is not None else None
                       for i in range(len(records))],
    }
    table = pa.table({**data, **extra}, schema=_schema())
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)
    return path


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


@dataclass(frozen=True, slots=True)
class CheckedRun:
    """One run of a shard folder, checked (``checked_runs``): its ``meta`` (as ``read_shards`` gives it), its
    shard ``files`` and the record ``columns`` any of them holds."""

    meta: dict
    files: tuple[Path, ...]
    columns: frozenset


def checked_runs(root) -> list[CheckedRun]:
    """Every run of a shard folder (``CheckedRun``: its meta, files and columns), for readers that query the files where
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
        out.append(CheckedRun(_run_meta(entry), tuple(files), frozenset(names)))
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

