"""Reading one shard file with the hostile-input checks: metadata against the limits before any row is read,
text and binary values measured before rows become Python objects, a kept tensor's ``.npy`` header before its
data, and each row turned into a ``TensorRecord``."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Iterator

import numpy as np

from .base import ReadError
from .safeio import check_regular, limits, npy_header, relname
from .shardformat import _OPTIONAL, ShardError, _columns
from ..records import TensorRecord
from ..stats import N_BINS, HistogramError, TensorStats, decode_hist


_BATCH_ROWS = 1024


TEXT_MAX = 64 << 10  # longest name, dtype or shape text a record may carry
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
                bound = _TEXT_COLUMNS_LARGE.get(name, TEXT_MAX)
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

