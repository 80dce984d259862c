"""The op table of one run: its rows filtered, sorted and read a window at a time inside DuckDB (the ids of the
window's records first, on as few columns as possible, then their rows with their comparisons)."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ..enums import Verdict, worst_first
from .queries import rows
from .ranking import rank_case
from .rows import RunValues
from .viewparts import Window, absmax_sql, check_window, frame, has_stats_basis, name_pattern_sql, severity_sql

# column -> SQL expression; the only columns a visitor may sort by
SORTABLE = {
    "seq": "seq", "op": "op", "op_type": "op_type", "role": "role", "dtype": "dtype", "numel": "numel",
    "nan": "nan_count", "inf": "inf_count", "zero": "zero_count", "absmax": "absmax",
    "max_abs_err": "max_abs_err", "max_rel_err": "max_rel_err", "summary_rel_err": "summary_rel_err",
    "cosine": "cosine", "sqnr_db": "sqnr_db", "severity": "severity_rank", "local_max_rel_err": "local_max_rel_err",
    "local_sqnr_db": "local_sqnr_db", "step": "step", "rank": "rank",
}


# what "only problems" keeps: these verdicts, or NaN/Inf in the record
PROBLEM_VERDICTS = tuple(v.value for v in worst_first(Verdict) if v.problem)


# a comparison's verdict as a number, the worse the larger (the one of two comparisons of a record that is shown)
_VERDICT_RANK = rank_case("verdict", Verdict)


# sort columns that live in the tensors table; the others need the comparisons
_TENSOR_SORTS = {"seq", "op", "op_type", "role", "dtype", "numel", "nan", "inf", "zero", "absmax", "step", "rank"}


_CMP_SORT_SQL = {
    "max_abs_err": "acc.max_abs_err", "max_rel_err": "acc.max_rel_err", "summary_rel_err": "acc.summary_rel_err",
    "cosine": "acc.cosine", "sqnr_db": "acc.sqnr_db", "local_max_rel_err": "loc.max_rel_err",
    "local_sqnr_db": "loc.sqnr_db",
}


# an element-wise error sort goes on with the summary statistics' error of the same kind: records compared on
# summaries only (no element-wise error) follow the element-wise ones, ranked among themselves, never mixed in
_SORT_THEN = {"max_abs_err": "summary_abs_err", "max_rel_err": "summary_rel_err"}


_ACC = "kind IN ('accumulated', 'stats')"


_LOC = "kind = 'local'"


_COLUMNS = ["rid", "seq", "step", "rank", "direction", "op", "op_type", "role", "index", "name", "dtype", "shape",
            "numel", "nan_count", "inf_count", "zero_count", "min", "max", "absmax", "nonfinite", "match", "basis",
            "max_abs_err", "max_rel_err", "summary_abs_err", "summary_rel_err", "cosine", "cosine_deficit", "sqnr_db",
            "rounding_units", "verdict", "reason", "local_max_rel_err", "local_sqnr_db", "local_verdict", "severity"]


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
    # what "only problems" leaves out: the ops whose NaN/Inf were written on purpose, and, where the run has no
    # failure (``failed`` False), NaN/Inf by themselves (a record is then a problem only by its verdict)
    intended: tuple[str, ...] = ()
    failed: bool = True
    sort: str = "seq"
    descending: bool = False

    def __post_init__(self) -> None:
        if self.sort not in SORTABLE:
            raise ValueError(f"cannot sort the op table by {self.sort!r}; choose one of {', '.join(SORTABLE)}")


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


def _problem_sql(f: OpsFilter) -> tuple[str, list]:
    """Records with NaN/Inf (not of an intended op, and only in a run with a failure) or a verdict in
    PROBLEM_VERDICTS, as a semi-join on the (few) problem comparisons rather than a join of every record."""
    verdicts = ", ".join(repr(v) for v in PROBLEM_VERDICTS)
    by_verdict = f"t.rid IN (SELECT cand_rid FROM comparisons WHERE cand_run_id = ? AND verdict IN ({verdicts}))"
    if not f.failed:
        return f"({by_verdict})", [f.run_id]
    if f.intended:
        return (f"((coalesce(t.nonfinite, false) AND t.op NOT IN ({', '.join('?' * len(f.intended))})) "
                f"OR {by_verdict})", [*f.intended, f.run_id])
    return f"(coalesce(t.nonfinite, false) OR {by_verdict})", [f.run_id]


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
        key, kparams = _severity_key(f)
        keys = (f"SELECT t.rid FROM tensors t WHERE {where_sql} "
                f"ORDER BY {key} {direction}, t.seq, t.rid LIMIT ? OFFSET ?")
        return keys, wparams + kparams, count, wparams
    join, order, jparams = _comparison_order(f, direction)
    keys = (f"SELECT t.rid FROM tensors t {join} "
            f"WHERE {where_sql} ORDER BY {order}, t.seq, t.rid LIMIT ? OFFSET ?")
    return keys, jparams + wparams, count, wparams


def _severity_key(f: OpsFilter) -> tuple[str, list]:
    """(sort key, params) of the severity sort: problems rank by semi-joins on the (few) non-passing
    comparisons; every other record ranks 0, in execution order."""
    def verdict_in(v: str) -> str:
        return f"t.rid IN (SELECT cand_rid FROM comparisons WHERE cand_run_id = ? AND verdict = '{v}')"

    ranked = [v for v in worst_first(Verdict) if v.rank > 0]  # the best verdict is every other record's
    key = "CASE " + " ".join(
        f"WHEN {'coalesce(t.nonfinite, false) OR ' if v is Verdict.NONFINITE else ''}{verdict_in(v.value)} "
        f"THEN {v.rank}" for v in ranked) + " ELSE 0 END"
    return key, [f.run_id] * len(ranked)


def _comparison_order(f: OpsFilter, direction: str) -> tuple[str, str, list]:
    """(LEFT JOIN, ORDER BY, params) of a sort by a comparison metric: the run's comparisons of the metric's kind
    (against the reference ``acc``, local ``loc``), by the metric, then by the summaries' error (``_SORT_THEN``)."""
    key = _CMP_SORT_SQL[f.sort]
    alias, col = key.split(".")
    then = _SORT_THEN.get(f.sort)
    kind, cols = _ACC if alias == "acc" else _LOC, col + (f", {then}" if then else "")
    join = (f"LEFT JOIN (SELECT cand_rid, {cols} FROM comparisons WHERE cand_run_id = ? AND {kind}) {alias} "
            f"ON {alias}.cand_rid = t.rid")
    order = f"{key} {direction} NULLS LAST" + (f", {alias}.{then} {direction} NULLS LAST" if then else "")
    return join, order, [f.run_id]


def _only_run(f: OpsFilter) -> bool:
    return not (f.steps or f.ranks or f.roles or f.op_types or f.pattern.strip() or f.only_problems)


def _metric_page(store, f: OpsFilter, offset: int, limit: int) -> list[int]:
    """A page sorted by a reference-comparison metric over a whole run,
    ordered inside the comparisons table alone (no join of every record):
    records with a value first, by the metric (an element-wise error, then
    by the summaries' error: ``_SORT_THEN``); then the rest (no value, or
    not compared) in execution order -- the order the join would give."""
    col = SORTABLE[f.sort]
    then = _SORT_THEN.get(f.sort)
    direction = "DESC" if f.descending else "ASC"
    valued = (f"FROM comparisons WHERE cand_run_id = ? AND {_ACC} AND cand_rid IS NOT NULL "
              f"AND ({col} IS NOT NULL" + (f" OR {then} IS NOT NULL)" if then else ")"))
    order = f"{col} {direction} NULLS LAST" + (f", {then} {direction} NULLS LAST" if then else "")
    n = int(rows(store, f"SELECT count(*) AS n {valued}", [f.run_id])[0]["n"])
    start, stop = offset, offset + limit
    rids: list[int] = []
    if start < n:
        rids += [r["rid"] for r in rows(
            store, f"SELECT cand_rid AS rid {valued} ORDER BY {order}, seq, cand_rid LIMIT ? OFFSET ?",
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
            SELECT DISTINCT ON (cand_rid) cand_rid, kind, "match", basis, max_abs_err, max_rel_err,
                   summary_abs_err, summary_rel_err, cosine, cosine_deficit, sqnr_db, rounding_units,
                   nonfinite_introduced, verdict, reason, ref_run_id, ref_rid
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
               t.nonfinite, acc."match", acc.basis, acc.max_abs_err, acc.max_rel_err, acc.summary_abs_err,
               acc.summary_rel_err, acc.cosine, acc.cosine_deficit, acc.sqnr_db, acc.rounding_units, acc.verdict,
               acc.reason,
               loc.local_max_rel_err, loc.local_sqnr_db, loc.local_verdict,
               {severity_sql('t.nonfinite', 'acc.verdict', 'loc.local_verdict')} AS severity
        FROM tensors t LEFT JOIN acc ON acc.cand_rid = t.rid LEFT JOIN loc ON loc.cand_rid = t.rid
        WHERE t.run_id = ? AND t.rid {ids.format(col="t.rid")}"""


def ops_rows(store, f: OpsFilter, *, offset: int = 0, limit: int = 50) -> Window:
    """Rows ``offset .. offset + limit`` of the op table for ``f``, with the count of matching rows.

    Two steps: the filter/sort/LIMIT/OFFSET picks the window's record ids
    (narrow columns, inside DuckDB), then their rows are fetched with
    their comparisons.
    """
    check_window(offset, limit)
    keys_sql, kparams, count_sql, cparams = _keys_sql(f)
    total = int(rows(store, count_sql, cparams)[0]["n"])
    if f.sort in _CMP_SORT_SQL and not f.sort.startswith("local") and _only_run(f):
        found = _metric_page(store, f, offset, limit)
    else:
        found = [r["rid"] for r in rows(store, keys_sql, kparams + [limit, offset])]
    rids = list(dict.fromkeys(found))  # a record compared twice would show up twice
    stats_basis = has_stats_basis(store, f"cand_run_id = ? AND {_ACC}", [f.run_id])
    if not rids:
        return Window(pd.DataFrame(columns=_COLUMNS), total, stats_basis)
    one = [f.run_id, min(rids), max(rids), *rids]
    df = frame(store, _rows_sql(len(rids)), one * 3)
    df = df.set_index("rid").loc[rids].reset_index()
    return Window(df[_COLUMNS], total, stats_basis)


def filter_options(store, run_id: str) -> RunValues:
    """Distinct steps, ranks, roles and op types of a run, for the filter widgets."""
    out = {}
    for key, col in (("steps", "step"), ("ranks", "rank"), ("roles", "role"), ("op_types", "op_type")):
        out[key] = [r["v"] for r in rows(store, f"SELECT DISTINCT {col} AS v FROM tensors WHERE run_id = ? "
                                                f"AND {col} IS NOT NULL ORDER BY v", [run_id])]
    return RunValues(**out)
