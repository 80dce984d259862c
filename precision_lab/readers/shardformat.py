"""What a Parquet shard folder is made of: the manifest's format and version, run and file names, and the
record columns every shard holds (see ``precision_lab.readers.shards`` for the layout)."""

from __future__ import annotations

import re
from pathlib import Path

from ..enums import RunOrder
from ..records import record_columns

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
