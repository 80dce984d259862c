"""The Ops table: every record of a run with its comparison, filtered, sorted
and paginated inside DuckDB (LIMIT/OFFSET), so a session of a million
records costs one page of rows in pandas, not the whole table."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import pandas as pd

from .common import absmax_sql, frame, rows, severity_sql

__all__ = ["OpsFilter", "OpsPage", "ops_page", "filter_options", "SORTABLE", "PROBLEM_SEVERITIES",
           "name_pattern_sql"]

# column -> SQL expression; the only columns a visitor may sort by
SORTABLE = {
    "seq": "seq", "op": "op", "op_type": "op_type", "role": "role", "dtype": "dtype", "numel": "numel",
    "nan": "nan_count", "inf": "inf_count", "zero": "zero_count", "absmax": "absmax",
    "max_abs_err": "max_abs_err", "max_rel_err": "max_rel_err", "cosine": "cosine", "sqnr_db": "sqnr_db",
    "severity": "severity_rank", "local_max_rel_err": "local_max_rel_err", "local_sqnr_db": "local_sqnr_db",
    "step": "step", "rank": "rank",
}

# what "only problems" keeps
PROBLEM_SEVERITIES = ("nonfinite", "error")

_SEVERITY_RANK = ("CASE severity WHEN 'nonfinite' THEN 3 WHEN 'error' THEN 2 WHEN 'warn' THEN 1 "
                  "WHEN 'ok' THEN 0 END")
_VERDICT_RANK = ("CASE verdict WHEN 'nonfinite' THEN 3 WHEN 'error' THEN 2 WHEN 'warn' THEN 1 "
                 "WHEN 'expected' THEN 0 END")


@dataclass(frozen=True)
class OpsFilter:
    """What the Ops table shows.  Empty tuples / None mean "all"."""

    run_id: str
    steps: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    roles: tuple[str, ...] = ()
    op_types: tuple[str, ...] = ()
    pattern: str = ""  # substring of the record name, or a glob with * and ?
    only_problems: bool = False
    sort: str = "seq"
    descending: bool = False
    page: int = 0  # zero-based
    page_size: int = 50

    def __post_init__(self) -> None:
        if self.sort not in SORTABLE:
            raise ValueError(f"cannot sort the op table by {self.sort!r}; choose one of {', '.join(SORTABLE)}")
        if self.page < 0 or self.page_size <= 0:
            raise ValueError(f"invalid page {self.page} of size {self.page_size}")


@dataclass
class OpsPage:
    rows: pd.DataFrame
    total: int  # rows matching the filter, over all pages
    filter: OpsFilter
    pages: int = field(init=False)

    def __post_init__(self) -> None:
        self.pages = max(1, -(-self.total // self.filter.page_size))


def name_pattern_sql(pattern: str) -> str:
    """A LIKE pattern (escape character ``\\``): ``*``/``?`` are wildcards,
    anything else matches as a substring."""
    esc = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    if "*" in pattern or "?" in pattern:
        return esc.replace("*", "%").replace("?", "_")
    return f"%{esc}%"


def _where(f: OpsFilter) -> tuple[list[str], list]:
    where, params = ["t.run_id = ?"], [f.run_id]
    for col, vals in (("t.step", f.steps), ("t.rank", f.ranks), ("t.role", f.roles), ("t.op_type", f.op_types)):
        if vals:
            where.append(f"{col} IN ({', '.join('?' * len(vals))})")
            params += list(vals)
    if f.pattern.strip():
        where.append("t.name ILIKE ? ESCAPE '\\'")
        params.append(name_pattern_sql(f.pattern.strip()))
    return where, params


# sort columns that live in the tensors table; the others need the comparisons
_TENSOR_SORTS = {"seq", "op", "op_type", "role", "dtype", "numel", "nan", "inf", "zero", "absmax", "step", "rank"}
_CMP_SORT_SQL = {
    "max_abs_err": "acc.max_abs_err", "max_rel_err": "acc.max_rel_err", "cosine": "acc.cosine",
    "sqnr_db": "acc.sqnr_db", "local_max_rel_err": "loc.max_rel_err", "local_sqnr_db": "loc.sqnr_db",
}
_ACC = "kind IN ('accumulated', 'stats')"
_LOC = "kind = 'local'"


def _problem_sql(f: OpsFilter) -> tuple[str, list]:
    """Records whose severity is in PROBLEM_SEVERITIES, as a semi-join on the
    (few) problem comparisons rather than a join of every record."""
    verdicts = ", ".join(repr(v) for v in PROBLEM_SEVERITIES)
    return (f"(coalesce(t.nonfinite, false) OR t.rid IN (SELECT cand_rid FROM comparisons "
            f"WHERE cand_run_id = ? AND verdict IN ({verdicts})))", [f.run_id])


def _keys_sql(f: OpsFilter) -> tuple[str, list, str, list]:
    """(rid page query, params, count query, params): the filter, sort and
    page work on as few columns as possible; a tensor-column sort never
    touches the comparisons."""
    where, wparams = _where(f)
    if f.only_problems:
        psql, pparams = _problem_sql(f)
        where.append(psql)
        wparams += pparams
    where_sql = " AND ".join(where)
    count = f"SELECT count(*) AS n FROM tensors t WHERE {where_sql}"
    direction = "DESC" if f.descending else "ASC"
    if f.sort in _TENSOR_SORTS:
        keys = (f"SELECT t.rid FROM tensors t WHERE {where_sql} "
                f"ORDER BY t.{SORTABLE[f.sort]} {direction} NULLS LAST, t.seq, t.rid LIMIT ? OFFSET ?")
        return keys, wparams, count, wparams
    if f.sort == "severity":
        # problems rank by semi-joins on the (few) non-passing comparisons;
        # every other record ranks 0, in execution order
        def verdict_in(v: str) -> str:
            return f"t.rid IN (SELECT cand_rid FROM comparisons WHERE cand_run_id = ? AND verdict = '{v}')"

        key = (f"CASE WHEN coalesce(t.nonfinite, false) OR {verdict_in('nonfinite')} THEN 3 "
               f"WHEN {verdict_in('error')} THEN 2 WHEN {verdict_in('warn')} THEN 1 ELSE 0 END")
        keys = (f"SELECT t.rid FROM tensors t WHERE {where_sql} "
                f"ORDER BY {key} {direction}, t.seq, t.rid LIMIT ? OFFSET ?")
        return keys, wparams + [f.run_id] * 3, count, wparams
    key = _CMP_SORT_SQL[f.sort]
    alias, col = key.split(".")
    joins = [(alias, _ACC if alias == "acc" else _LOC, col)]
    join_sql = " ".join(
        f"LEFT JOIN (SELECT cand_rid, {col} FROM comparisons WHERE cand_run_id = ? AND {kind}) {alias} "
        f"ON {alias}.cand_rid = t.rid" for alias, kind, col in joins)
    keys = (f"SELECT t.rid FROM tensors t {join_sql} "
            f"WHERE {where_sql} ORDER BY {key} {direction} NULLS LAST, t.seq, t.rid LIMIT ? OFFSET ?")
    return keys, [f.run_id] * len(joins) + wparams, count, wparams


def _only_run(f: OpsFilter) -> bool:
    return not (f.steps or f.ranks or f.roles or f.op_types or f.pattern.strip() or f.only_problems)


def _metric_page(store, f: OpsFilter) -> list[int]:
    """A page sorted by a reference-comparison metric over a whole run,
    ordered inside the comparisons table alone (no join of every record):
    records with a value first, by the metric; then the rest (no value, or
    not compared) in execution order -- the order the join would give."""
    col = SORTABLE[f.sort]
    direction = "DESC" if f.descending else "ASC"
    valued = (f"FROM comparisons WHERE cand_run_id = ? AND {_ACC} AND cand_rid IS NOT NULL "
              f"AND {col} IS NOT NULL")
    n = int(rows(store, f"SELECT count(*) AS n {valued}", [f.run_id])[0]["n"])
    start, stop = f.page * f.page_size, (f.page + 1) * f.page_size
    rids: list[int] = []
    if start < n:
        rids += [r["rid"] for r in rows(
            store, f"SELECT cand_rid AS rid {valued} ORDER BY {col} {direction}, seq, cand_rid LIMIT ? OFFSET ?",
            [f.run_id, min(stop, n) - start, start])]
    if stop > n:
        rids += [r["rid"] for r in rows(
            store, f"""SELECT t.rid FROM tensors t WHERE t.run_id = ?
                       AND t.rid NOT IN (SELECT cand_rid {valued})
                       ORDER BY t.seq, t.rid LIMIT ? OFFSET ?""",
            [f.run_id, f.run_id, stop - max(start, n), max(0, start - n)])]
    return rids


def _rows_sql(n: int) -> str:
    """Every column the table shows, for ``n`` given rids of one run.

    Parameters: (run_id, lo, hi, *rids) three times; the BETWEEN lets DuckDB
    skip row groups by their min/max before testing the IN list.
    """
    ids = "BETWEEN ? AND ? AND {col} IN (" + ", ".join("?" * n) + ")"
    # one comparison per record and kind: DISTINCT ON keeps the worst verdict
    # should a record have been compared twice
    return f"""
        WITH acc AS (
            SELECT DISTINCT ON (cand_rid) cand_rid, kind, "match", basis, max_abs_err, max_rel_err, cosine,
                   cosine_deficit, sqnr_db, rounding_units, nonfinite_introduced, verdict, reason,
                   ref_run_id, ref_rid
            FROM comparisons WHERE cand_run_id = ? AND {_ACC} AND cand_rid {ids.format(col="cand_rid")}
            ORDER BY cand_rid, {_VERDICT_RANK} DESC NULLS LAST
        ), loc AS (
            SELECT DISTINCT ON (cand_rid) cand_rid, max_rel_err AS local_max_rel_err, sqnr_db AS local_sqnr_db,
                   verdict AS local_verdict
            FROM comparisons WHERE cand_run_id = ? AND {_LOC} AND cand_rid {ids.format(col="cand_rid")}
            ORDER BY cand_rid, {_VERDICT_RANK} DESC NULLS LAST
        )
        SELECT t.rid, t.seq, t.step, t.rank, t.direction, t.op, t.op_type, t.role, t."index", t.name,
               t.dtype, t.shape, t.numel, t.nan_count, t.inf_count, t.zero_count, t.min, t.max,
               {absmax_sql('t')} AS absmax,
               t.nonfinite, acc."match", acc.basis, acc.max_abs_err, acc.max_rel_err, acc.cosine,
               acc.cosine_deficit, acc.sqnr_db, acc.rounding_units, acc.verdict, acc.reason,
               loc.local_max_rel_err, loc.local_sqnr_db, loc.local_verdict,
               {severity_sql('t.nonfinite', 'acc.verdict', 'loc.local_verdict')} AS severity
        FROM tensors t LEFT JOIN acc ON acc.cand_rid = t.rid LEFT JOIN loc ON loc.cand_rid = t.rid
        WHERE t.run_id = ? AND t.rid {ids.format(col="t.rid")}"""


_COLUMNS = ["rid", "seq", "step", "rank", "direction", "op", "op_type", "role", "index", "name", "dtype", "shape",
            "numel", "nan_count", "inf_count", "zero_count", "min", "max", "absmax", "nonfinite", "match", "basis",
            "max_abs_err", "max_rel_err", "cosine", "cosine_deficit", "sqnr_db", "rounding_units", "verdict",
            "reason", "local_max_rel_err", "local_sqnr_db", "local_verdict", "severity"]


def ops_page(store, f: OpsFilter) -> OpsPage:
    """One page of the op table for ``f``, with the total count of matching rows.

    Two steps: the filter/sort/LIMIT/OFFSET picks one page of record ids
    (narrow columns, inside DuckDB), then the page's rows are fetched with
    their comparisons.
    """
    keys_sql, kparams, count_sql, cparams = _keys_sql(f)
    total = int(rows(store, count_sql, cparams)[0]["n"])
    page = min(f.page, max(0, -(-total // f.page_size) - 1))
    if page != f.page:
        f = replace(f, page=page)
    if f.sort in _CMP_SORT_SQL and not f.sort.startswith("local") and _only_run(f):
        found = _metric_page(store, f)
    else:
        found = [r["rid"] for r in rows(store, keys_sql, kparams + [f.page_size, f.page * f.page_size])]
    rids = list(dict.fromkeys(found))  # a record compared twice would show up twice
    if not rids:
        return OpsPage(pd.DataFrame(columns=_COLUMNS), total, f)
    one = [f.run_id, min(rids), max(rids), *rids]
    df = frame(store, _rows_sql(len(rids)), one * 3)
    df = df.set_index("rid").loc[rids].reset_index()
    return OpsPage(df[_COLUMNS], total, f)


def filter_options(store, run_id: str) -> dict[str, list]:
    """Distinct steps, ranks, roles and op types of a run, for the filter widgets."""
    out = {}
    for key, col in (("steps", "step"), ("ranks", "rank"), ("roles", "role"), ("op_types", "op_type")):
        out[key] = [r["v"] for r in rows(store, f"SELECT DISTINCT {col} AS v FROM tensors WHERE run_id = ? "
                                                f"AND {col} IS NOT NULL ORDER BY v", [run_id])]
    return out


def display_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The columns the Ops page shows, in reading order (rid stays for selection).

    Numbers are text by ``num_text``: NaN reads ``nan``, infinities ``inf``,
    a value that was never computed (no comparison) ``MISSING``."""
    from .common import cosine_text, text_columns

    out = pd.DataFrame({
        "severity": df["severity"].fillna(""),
        "seq": df["seq"], "op": df["op"], "type": df["op_type"], "role": df["role"], "index": df["index"],
        "dtype": df["dtype"], "shape": df["shape"], "nan": df["nan_count"], "inf": df["inf_count"],
        "zero": df["zero_count"], "absmax": df["absmax"],
        "max_abs_err": df["max_abs_err"], "max_rel_err": df["max_rel_err"],
        "cosine": [cosine_text(c, d) for c, d in zip(df["cosine"], df["cosine_deficit"])],
        "sqnr_db": df["sqnr_db"], "verdict": df["verdict"].fillna(""),
        "local_max_rel_err": df["local_max_rel_err"], "match": df["match"].fillna(""),
        "step": df["step"], "rank": df["rank"], "rid": df["rid"],
    })
    numbers = ["nan", "inf", "zero", "absmax", "max_abs_err", "max_rel_err", "sqnr_db", "local_max_rel_err"]
    return text_columns(out, numbers, 4)
