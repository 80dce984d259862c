"""A shard folder's records queried where they lie.

``over_shards`` makes a ``Store`` in memory of its own whose ``tensors``, ``histograms`` and ``tensor_data``
are views over DuckDB's ``read_parquet`` of a capture's shard files: every question the store answers (the
origin analysis, the report, the diagnoses) then reads the Parquet files themselves, columns and row groups
as the query needs them, with no copy made.  The connection may read those files and no other
(``connect_duckdb(readable=...)``).  The same SQL over ``read_parquet`` of a glob serves a job whose shards
sit on object storage, or an engine beside DuckDB (Spark, Trino) once one machine is outgrown.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

from . import Store, tensor_columns

__all__ = ["over_shards", "ShardRun"]

# rid of a row read in place: (step, rank, row in its file) packed in one BIGINT
_RANK_BITS, _ROW_BITS = 16, 24


class ShardRun(NamedTuple):
    """A run's shard files and the record columns any of them holds."""

    run_id: str
    files: tuple
    columns: frozenset


def _text(s: str) -> str:
    """``s`` as an SQL string literal."""
    return "'" + str(s).replace("'", "''") + "'"


def _rows(run: ShardRun, root: Path) -> str:
    """The ``tensors`` rows of one run's files: its columns cast to the table's types, a missing one null."""
    run_id, files, have = run
    listed = ", ".join(_text(f) for f in files)
    cols = []
    for name, sql_type in tensor_columns():
        if name == "rid":
            expr = (f"CASE WHEN file_row_number < {1 << _ROW_BITS} THEN (CAST(step AS BIGINT) << "
                    f"{_RANK_BITS + _ROW_BITS}) + (CAST(rank AS BIGINT) << {_ROW_BITS}) + file_row_number "
                    f"ELSE error(filename || ': more than {1 << _ROW_BITS} records in one file') END")
        elif name == "run_id":
            expr = _text(run_id)
        elif name == "source":  # the file, relative to the shard folder, as ingest records it
            expr = f"replace(filename, {_text(str(root) + '/')}, '')"
        elif name == "has_hist":
            expr = "hist_bins IS NOT NULL"
        elif name in have:
            expr = f'CAST("{name}" AS {sql_type})'
        else:
            expr = f"CAST(NULL AS {sql_type})"
        cols.append(f'{expr} AS "{name}"')
    extra = ["hist_edges_id", "hist_bins", "hist_counts", "tensor_npy"]
    cols += [f'"{c}"' if c in have else f"NULL AS {c}" for c in extra]
    return (f"SELECT {', '.join(cols)} FROM read_parquet([{listed}], filename = true, file_row_number = true, "
            "union_by_name = true)")


def over_shards(root, runs: Sequence[ShardRun], write, *, text_max: int) -> Store:
    """A ``Store`` in memory whose tensors are ``runs``' shard files, read in place.  ``write(store)`` first
    writes the session and its runs (and anything else kept in tables, such as a timeline) through the store's
    own writer; the record tables are then replaced by views over the files.  ``text_max``: the longest
    name, dtype or shape text a record may carry (the readers' bound).  Raises ``ValueError`` where a run
    has no file (a view over nothing) or a file is not a path."""
    root = Path(root)
    files = [f for r in runs for f in r.files]
    if not files:
        raise ValueError(f"{root}: no shard file to read")
    store = Store(":memory:", readable=tuple(str(f) for f in files))
    write(store)
    body = " UNION ALL ".join(_rows(r, root) for r in runs if r.files)
    with store.transaction() as cur:
        for table in ("tensors", "histograms", "tensor_data"):
            cur.execute(f"DROP TABLE {table}")
        cur.execute(f"CREATE VIEW _pl_shard_rows AS {body}")
        names = ", ".join(f'"{n}"' for n, _ in tensor_columns())
        cur.execute(f"CREATE VIEW tensors AS SELECT {names} FROM _pl_shard_rows")
        cur.execute("CREATE VIEW histograms AS SELECT run_id, rid, hist_edges_id AS edges_id, "
                    "CAST(hist_bins AS INTEGER[]) AS bins, CAST(hist_counts AS BIGINT[]) AS counts "
                    "FROM _pl_shard_rows WHERE hist_bins IS NOT NULL")
        cur.execute("CREATE VIEW tensor_data AS SELECT run_id, rid, tensor_npy AS npy FROM _pl_shard_rows "
                    "WHERE tensor_npy IS NOT NULL")
    _check(store, root, text_max)
    return store


def _check(store, root: Path, text_max: int) -> None:
    """Read every row's texts, step and rank once: a file whose pages cannot be decoded, a step or rank outside
    what a record id packs, or a text longer than ``text_max`` is refused now, by name, not halfway through a
    report.  ``ValueError`` naming the file."""
    texts = [n for n, t in tensor_columns() if t == "VARCHAR" and n not in ("run_id", "source")]
    longest = " + ".join(f'(length(coalesce("{n}", \'\')) > {text_max})::INT' for n in texts)
    try:
        bad = store.sql(f"""SELECT source, step, rank FROM (
                                SELECT source, step, rank, ({longest}) AS long_texts
                                FROM tensors)
                            WHERE long_texts > 0 OR step < 0 OR step >= {1 << (63 - _RANK_BITS - _ROW_BITS)}
                               OR rank < 0 OR rank >= {1 << _RANK_BITS} LIMIT 1""").fetchone()
    except Exception as e:  # DuckDB's own message names the file it could not read
        raise ValueError(f"{root}: the shards cannot be read where they lie "
                         f"({str(e).splitlines()[0][:300]})") from None
    if bad is not None:
        raise ValueError(f"{bad[0]}: a record (step {bad[1]}, rank {bad[2]}) has a step or rank outside "
                         f"0..{(1 << (63 - _RANK_BITS - _ROW_BITS)) - 1} and 0..{(1 << _RANK_BITS) - 1}, or a "
                         f"text longer than {text_max} bytes")
