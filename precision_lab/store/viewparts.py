"""What the read model's tables share: a window of rows (``Window``), the frame a query is read into (NULL kept
apart from NaN), the SQL of what every table shows of a record (its severity, its absmax with Inf counted, a
name pattern), and ``Clause``, a piece of SQL with its parameters, that a long query is put together from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import pandas as pd

from ..enums import Verdict, worst_first
from .queries import rows


def severity_sql(nonfinite: str, *verdicts: str) -> str:
    """SQL expression giving a record's severity, as a ``Verdict`` value, from its non-finite flag and the verdicts
    of its comparisons (NULL when it has neither problem nor comparison)."""
    def any_is(v: str) -> str:
        return " OR ".join(f"{c} = '{v}'" for c in verdicts) or "false"

    nf = Verdict.NONFINITE
    whens = [f"WHEN coalesce({nonfinite}, false) OR {any_is(nf.value)} THEN '{nf.value}'"]
    whens += [f"WHEN {any_is(v.value)} THEN '{v.value}'" for v in worst_first(Verdict) if v is not nf]
    return f"CASE {' '.join(whens)} ELSE NULL END"


def frame(store, sql: str, params: Optional[list] = None):
    """Query -> DataFrame that keeps NULL (None) apart from NaN.

    ``Store.df`` turns a NULL in a DOUBLE column into NaN, so a metric that
    was never computed would read as a NaN result.  A column holding any
    NULL stays an object column with None there; the others get their usual
    dtypes.
    """
    cur = store.sql(sql, params or [])
    cols = [d[0] for d in cur.description]
    data = cur.fetchall()
    out = {}
    for i, c in enumerate(cols):
        col = pd.Series([r[i] for r in data], dtype=object)
        out[c] = col if col.map(lambda v: v is None).any() else col.infer_objects()
    return pd.DataFrame(out, columns=cols)


def absmax_sql(table: str) -> str:
    """SQL for the largest magnitude a stored record holds, Inf included.

    The store keeps ``absmax`` over the finite values and counts Inf apart
    (``TensorStats``); a record with ``inf_count > 0`` holds an infinite
    magnitude whatever its finite values are, and is shown so.
    """
    return f"CASE WHEN coalesce({table}.inf_count, 0) > 0 THEN 'inf'::DOUBLE ELSE {table}.absmax END"


@dataclass(frozen=True)
class Window:
    """Rows ``offset .. offset + limit`` of a table, and how many rows it has in all."""

    rows: pd.DataFrame
    total: int
    stats_basis: bool = False  # some comparison of the table is on summary statistics (summary_*_err, no max_*_err)


def check_window(offset: int, limit: int) -> None:
    if offset < 0 or limit <= 0:
        raise ValueError(f"invalid window of {limit} rows from row {offset}")


def name_pattern_sql(pattern: str) -> str:
    """A LIKE pattern (escape character ``\\``): ``*``/``?`` are wildcards,
    anything else matches as a substring."""
    esc = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    if "*" in pattern or "?" in pattern:
        return esc.replace("*", "%").replace("?", "_")
    return f"%{esc}%"


def has_stats_basis(store, where: str, params: list) -> bool:
    """Whether any comparison ``where`` selects was made on summary statistics alone."""
    return bool(rows(store, f"SELECT 1 AS x FROM comparisons WHERE {where} AND basis = 'stats' LIMIT 1", params))


@dataclass(frozen=True)
class Clause:
    """A piece of SQL and its parameters, in the order its placeholders come."""

    sql: str
    params: tuple = ()

    @staticmethod
    def joined(parts: Iterable["Clause"], sep: str) -> "Clause":
        """The pieces one after another, ``sep`` between them; their parameters in the same order."""
        parts = list(parts)
        return Clause(sep.join(p.sql for p in parts), tuple(v for p in parts for v in p.params))
