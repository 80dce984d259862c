"""The read model: the questions the dashboard and the CLI ask of a session (op tables, diffs, run tables, error
series, record lookups), answered in SQL.

Every function takes a ``Store`` first and returns plain values or a
DataFrame; ``precision_lab.ui`` reads them directly and decides how they are
shown (page numbers, labels, colours, decoded cards).  A table that is read a
window at a time takes ``offset`` and ``limit`` and returns a ``Window``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd

from ..enums import Severity, Verdict, worst_first
from .queries import (ACCUMULATED_KINDS, LOCAL_KINDS, rank_case as _rank_case, ranked_comparisons_sql,  # noqa: F401
                      diagnosis_rows, rows, run_order, session_runs)

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


_VERDICT_RANK = _rank_case("verdict", Verdict)
# the worst verdict of a group of comparisons ``c``
_WORST_VERDICT = ("CASE " + " ".join(f"WHEN bool_or(c.verdict = '{v.value}') THEN '{v.value}'"
                                     for v in worst_first(Verdict) if v.rank > 0)
                  + f" ELSE '{min(Verdict, key=lambda v: v.rank).value}' END")


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


# which rows a diff shows
SHOW_OPTIONS = ("all", "problems", "unmatched")


_STAT_COLS = ("dtype", "shape", "min", "max", "absmax", "mean", "l2norm", "nan_count", "inf_count")




# metric -> (axis title, log axis, worse is larger)
ERROR_METRICS = {
    "max_rel_err": ("max relative error (|c - r| / max(|r|, floor))", True, True),
    "sqnr_db": ("SQNR (dB, higher is better)", False, False),
    "rounding_units": ("relative RMS error / unit roundoff of the candidate format", True, True),
    "max_abs_err": ("max absolute error", True, True),
    # statistics-only comparisons: how far the summaries (max, min, norm) moved, not an element's error
    "summary_rel_err": ("summary relative error (max, min, norm: |c - r| / max(|r|, floor))", True, True),
}


_VERDICT_WORST_FIRST = _rank_case("verdict", Verdict, worst_first_order=True)


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


@dataclass(frozen=True)
class Window:
    """Rows ``offset .. offset + limit`` of a table, and how many rows it has in all."""

    rows: pd.DataFrame
    total: int
    stats_basis: bool = False  # some comparison of the table is on summary statistics (summary_*_err, no max_*_err)


def _window(offset: int, limit: int) -> None:
    if offset < 0 or limit <= 0:
        raise ValueError(f"invalid window of {limit} rows from row {offset}")


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
        # problems rank by semi-joins on the (few) non-passing comparisons;
        # every other record ranks 0, in execution order
        def verdict_in(v: str) -> str:
            return f"t.rid IN (SELECT cand_rid FROM comparisons WHERE cand_run_id = ? AND verdict = '{v}')"

        ranked = [v for v in worst_first(Verdict) if v.rank > 0]  # the best verdict is every other record's
        key = "CASE " + " ".join(
            f"WHEN {'coalesce(t.nonfinite, false) OR ' if v is Verdict.NONFINITE else ''}{verdict_in(v.value)} "
            f"THEN {v.rank}" for v in ranked) + " ELSE 0 END"
        keys = (f"SELECT t.rid FROM tensors t WHERE {where_sql} "
                f"ORDER BY {key} {direction}, t.seq, t.rid LIMIT ? OFFSET ?")
        return keys, wparams + [f.run_id] * len(ranked), count, wparams
    key = _CMP_SORT_SQL[f.sort]
    alias, col = key.split(".")
    then = _SORT_THEN.get(f.sort)
    joins = [(alias, _ACC if alias == "acc" else _LOC, col + (f", {then}" if then else ""))]
    join_sql = " ".join(
        f"LEFT JOIN (SELECT cand_rid, {cols} FROM comparisons WHERE cand_run_id = ? AND {kind}) {alias} "
        f"ON {alias}.cand_rid = t.rid" for alias, kind, cols in joins)
    order = f"{key} {direction} NULLS LAST" + (f", {alias}.{then} {direction} NULLS LAST" if then else "")
    keys = (f"SELECT t.rid FROM tensors t {join_sql} "
            f"WHERE {where_sql} ORDER BY {order}, t.seq, t.rid LIMIT ? OFFSET ?")
    return keys, [f.run_id] * len(joins) + wparams, count, wparams


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


def _has_stats_basis(store, where: str, params: list) -> bool:
    """Whether any comparison ``where`` selects was made on summary statistics alone."""
    return bool(rows(store, f"SELECT 1 AS x FROM comparisons WHERE {where} AND basis = 'stats' LIMIT 1", params))


def ops_rows(store, f: OpsFilter, *, offset: int = 0, limit: int = 50) -> Window:
    """Rows ``offset .. offset + limit`` of the op table for ``f``, with the count of matching rows.

    Two steps: the filter/sort/LIMIT/OFFSET picks the window's record ids
    (narrow columns, inside DuckDB), then their rows are fetched with
    their comparisons.
    """
    _window(offset, limit)
    keys_sql, kparams, count_sql, cparams = _keys_sql(f)
    total = int(rows(store, count_sql, cparams)[0]["n"])
    if f.sort in _CMP_SORT_SQL and not f.sort.startswith("local") and _only_run(f):
        found = _metric_page(store, f, offset, limit)
    else:
        found = [r["rid"] for r in rows(store, keys_sql, kparams + [limit, offset])]
    rids = list(dict.fromkeys(found))  # a record compared twice would show up twice
    stats_basis = _has_stats_basis(store, f"cand_run_id = ? AND {_ACC}", [f.run_id])
    if not rids:
        return Window(pd.DataFrame(columns=_COLUMNS), total, stats_basis)
    one = [f.run_id, min(rids), max(rids), *rids]
    df = frame(store, _rows_sql(len(rids)), one * 3)
    df = df.set_index("rid").loc[rids].reset_index()
    return Window(df[_COLUMNS], total, stats_basis)


def filter_options(store, run_id: str) -> dict[str, list]:
    """Distinct steps, ranks, roles and op types of a run, for the filter widgets."""
    out = {}
    for key, col in (("steps", "step"), ("ranks", "rank"), ("roles", "role"), ("op_types", "op_type")):
        out[key] = [r["v"] for r in rows(store, f"SELECT DISTINCT {col} AS v FROM tensors WHERE run_id = ? "
                                                f"AND {col} IS NOT NULL ORDER BY v", [run_id])]
    return out


def _stat_sql(table: str, column: str) -> str:
    """A stored statistic as shown: absmax counts Inf (``absmax_sql``), the others as stored."""
    return absmax_sql(table) if column == "absmax" else f'{table}."{column}"'


def pair_options(store, session_id: str) -> list[dict]:
    """(reference, candidate) run pairs that have comparisons, with labels."""
    names = {r["run_id"]: r["name"] for r in session_runs(store, session_id)}
    pairs = rows(store, """SELECT ref_run_id, cand_run_id, count(*) AS n FROM comparisons
                           WHERE session_id = ? AND kind IN ('accumulated', 'stats')
                           GROUP BY ref_run_id, cand_run_id ORDER BY min(rowid)""", [session_id])
    return [{"ref_run_id": p["ref_run_id"], "cand_run_id": p["cand_run_id"], "rows": p["n"],
             "label": f"{names.get(p['cand_run_id'], p['cand_run_id'])} vs {names.get(p['ref_run_id'], p['ref_run_id'])}"}
            for p in pairs]


def diff_rows(store, session_id: str, ref_run_id: str, cand_run_id: str, *, show: str = "all",
              pattern: str = "", offset: int = 0, limit: int = 50) -> Window:
    """Aligned rows of one reference/candidate pair in execution order.

    Unmatched records appear with the other side empty and ``match``
    ``unmatched_ref`` / ``unmatched_cand``; they carry no metrics.  A
    comparison on summary statistics has ``summary_abs_err`` /
    ``summary_rel_err`` and no ``max_*_err``; ``stats_basis`` says whether
    the pair has any.
    """
    if show not in SHOW_OPTIONS:
        raise ValueError(f"unknown diff filter {show!r}; choose one of {', '.join(SHOW_OPTIONS)}")
    _window(offset, limit)
    # step 1: the page's comparison rows (rowid), filtered and ordered on
    # the comparisons table alone; step 2: their records, for those rows only
    where = ["c.session_id = ?", "c.ref_run_id = ?", "c.cand_run_id = ?",
             f"c.kind IN ({', '.join(repr(k) for k in ACCUMULATED_KINDS)})"]
    params: list = [session_id, ref_run_id, cand_run_id]
    if show == "problems":
        where.append("(c.verdict IN ('nonfinite', 'error') "
                     "OR c.ref_rid IN (SELECT rid FROM tensors WHERE run_id = ? AND nonfinite) "
                     "OR c.cand_rid IN (SELECT rid FROM tensors WHERE run_id = ? AND nonfinite))")
        params += [ref_run_id, cand_run_id]
    elif show == "unmatched":
        where.append("c.\"match\" LIKE 'unmatched%'")
    if pattern.strip():
        # the comparison row carries the candidate's op/role/index (the reference's when unmatched)
        where.append("(c.op || '.' || c.role || '.' || c.\"index\") ILIKE ? ESCAPE '\\'")
        params.append(name_pattern_sql(pattern.strip()))
    where_sql = " AND ".join(where)
    total = int(rows(store, f"SELECT count(*) AS n FROM comparisons c WHERE {where_sql}", params)[0]["n"])
    ids = [r["id"] for r in rows(
        store, f"""SELECT c.rowid AS id FROM comparisons c WHERE {where_sql}
                   ORDER BY c.step, c.rank, c.seq, c.rowid LIMIT ? OFFSET ?""",
        params + [limit, offset])]
    ref_cols = ", ".join(f'{_stat_sql("r", c)} AS "ref {c}"' for c in _STAT_COLS)
    cand_cols = ", ".join(f'{_stat_sql("t", c)} AS "cand {c}"' for c in _STAT_COLS)
    df = frame(
        store,
        f"""SELECT {severity_sql('t.nonfinite', 'c.verdict')} AS severity, c.seq, c.step, c.rank, c.op, c.role,
                   c."index", c."match", {ref_cols}, {cand_cols},
                   c.max_abs_err, c.max_rel_err, c.summary_abs_err, c.summary_rel_err, c.cosine, c.cosine_deficit,
                   c.sqnr_db, c.verdict, c.basis, c.reason, c.ref_rid, c.cand_rid, r.nonfinite AS ref_nonfinite,
                   t.nonfinite AS cand_nonfinite
            FROM (SELECT rowid AS id, * FROM comparisons WHERE rowid IN ({', '.join('?' * len(ids)) or 'NULL'})) c
            LEFT JOIN tensors r ON r.run_id = c.ref_run_id AND r.rid = c.ref_rid
            LEFT JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
            ORDER BY c.step, c.rank, c.seq, c.id""",
        ids,
    )
    stats_basis = _has_stats_basis(store, "session_id = ? AND ref_run_id = ? AND cand_run_id = ?",
                                   [session_id, ref_run_id, cand_run_id])
    return Window(df, total, stats_basis)


def base_run(store, session_id: str) -> Optional[dict]:
    """The run the N-run view aligns on: the (first) reference run, else the first run."""
    runs = session_runs(store, session_id)
    if not runs:
        return None
    return next((r for r in runs if r["kind"] == "reference"), runs[0])


def nrun_rows(store, session_id: str, run_ids: Sequence[str], *, base_run_id: Optional[str] = None,
              show: str = "all", pattern: str = "", offset: int = 0, limit: int = 50) -> Window:
    """One row per record of the base run, one column group per other run.

    Each group holds that run's matching record (by the stored comparison
    with the base run when there is one, else by identical step, rank and
    name): its absmax, whether it is non-finite, and its metrics against the
    base run (``summary_rel_err`` as well for a run compared on summary
    statistics).  A run with no counterpart for a row shows empty cells and
    ``unmatched`` in its match column.
    """
    if show not in SHOW_OPTIONS:
        raise ValueError(f"unknown diff filter {show!r}; choose one of {', '.join(SHOW_OPTIONS)}")
    _window(offset, limit)
    runs = {r["run_id"]: r for r in session_runs(store, session_id)}
    base = runs.get(base_run_id) if base_run_id else base_run(store, session_id)
    if base is None:
        raise ValueError("the session has no runs")
    others = [runs[r] for r in run_ids if r in runs and r != base["run_id"]]
    if not others:
        raise ValueError("choose at least one run besides the base run to compare")
    compared, by_summary = {}, {}
    for r in others:
        got = rows(store, """SELECT count(*) AS n, coalesce(bool_or(basis = 'stats'), false) AS s FROM comparisons
                             WHERE session_id = ? AND ref_run_id = ? AND cand_run_id = ?
                               AND kind IN ('accumulated', 'stats')""",
                   [session_id, base["run_id"], r["run_id"]])[0]
        compared[r["run_id"]], by_summary[r["run_id"]] = got["n"] > 0, bool(got["s"])

    # step 1: the page's base records, filtered with semi-joins on the base run
    where, wparams = ["b.run_id = ?"], [base["run_id"]]
    if pattern.strip():
        where.append("b.name ILIKE ? ESCAPE '\\'")
        wparams.append(name_pattern_sql(pattern.strip()))
    def per_run(conds: list, by_comparison: str, by_name: str) -> None:
        # one condition per other run: through its stored comparisons with the
        # base when there are any, else by tensor name
        for r in others:
            if compared[r["run_id"]]:
                conds.append(by_comparison)
                wparams.extend([session_id, base["run_id"], r["run_id"]])
            else:
                conds.append(by_name)
                wparams.append(r["run_id"])
        where.append("(" + " OR ".join(conds) + ")")

    if show == "problems":
        per_run(["b.nonfinite"],
                "b.rid IN (SELECT ref_rid FROM comparisons WHERE session_id = ? AND ref_run_id = ? "
                "AND cand_run_id = ? AND kind IN ('accumulated', 'stats') AND verdict IN ('nonfinite', 'error'))",
                "b.name IN (SELECT name FROM tensors WHERE run_id = ? AND nonfinite)")
    elif show == "unmatched":
        per_run([],
                "b.rid NOT IN (SELECT ref_rid FROM comparisons WHERE session_id = ? AND ref_run_id = ? "
                "AND cand_run_id = ? AND kind IN ('accumulated', 'stats') AND ref_rid IS NOT NULL "
                "AND cand_rid IS NOT NULL)",
                "NOT EXISTS (SELECT 1 FROM tensors o WHERE o.run_id = ? AND o.name = b.name "
                "AND o.step = b.step AND o.rank = b.rank)")
    where_sql = " AND ".join(where)
    total = int(rows(store, f"SELECT count(*) AS n FROM tensors b WHERE {where_sql}", wparams)[0]["n"])
    rids = [r["rid"] for r in rows(store, f"""SELECT b.rid FROM tensors b WHERE {where_sql}
                                             ORDER BY b.step, b.rank, b.seq, b.rid LIMIT ? OFFSET ?""",
                                   wparams + [limit, offset])]

    # step 2: each run's counterpart of those records only
    ids = ", ".join("?" * len(rids)) or "NULL"
    ctes, selects, joins, params, jparams = [], [], [], [], []
    for i, r in enumerate(others):
        if compared[r["run_id"]]:
            ctes.append(f"""m{i} AS (SELECT DISTINCT ON (ref_rid) ref_rid, cand_rid, "match", max_rel_err,
                                   summary_rel_err, sqnr_db, verdict
                            FROM comparisons WHERE session_id = ? AND ref_run_id = ? AND cand_run_id = ?
                              AND kind IN ('accumulated', 'stats') AND ref_rid IN ({ids}) ORDER BY ref_rid)""")
            params += [session_id, base["run_id"], r["run_id"], *rids]
        else:
            ctes.append(f"""m{i} AS (SELECT DISTINCT ON (b.rid) b.rid AS ref_rid, o.rid AS cand_rid,
                                   'name' AS "match", NULL::DOUBLE AS max_rel_err,
                                   NULL::DOUBLE AS summary_rel_err, NULL::DOUBLE AS sqnr_db, NULL::VARCHAR AS verdict
                            FROM tensors b JOIN tensors o ON o.run_id = ? AND o.step = b.step AND o.rank = b.rank
                                 AND o.name = b.name
                            WHERE b.run_id = ? AND b.rid IN ({ids}) ORDER BY b.rid, o.rid)""")
            params += [r["run_id"], base["run_id"], *rids]
        joins.append(f"LEFT JOIN m{i} ON m{i}.ref_rid = b.rid "
                     f"LEFT JOIN tensors t{i} ON t{i}.run_id = ? AND t{i}.rid = m{i}.cand_rid")
        jparams.append(r["run_id"])
        name = r["name"].replace('"', "'")
        # a run compared on summary statistics has their error beside the element-wise one, never in it
        summary = f'm{i}.summary_rel_err AS "{name}: summary_rel_err", ' if by_summary[r["run_id"]] else ""
        selects.append(
            f"""{absmax_sql(f"t{i}")} AS "{name}: absmax", t{i}.nonfinite AS "{name}: nonfinite",
                m{i}.max_rel_err AS "{name}: max_rel_err", {summary}m{i}.sqnr_db AS "{name}: sqnr_db",
                m{i}.verdict AS "{name}: verdict",
                CASE WHEN m{i}.cand_rid IS NULL THEN 'unmatched' ELSE coalesce(m{i}."match", '') END AS "{name}: match" """)
    bname = base["name"].replace('"', "'")
    sql = f"""WITH {', '.join(ctes)}
              SELECT b.seq, b.step, b.rank, b.op, b.role, b."index", b.rid,
                     b.dtype AS "{bname}: dtype", {absmax_sql("b")} AS "{bname}: absmax", b.nonfinite AS "{bname}: nonfinite",
                     {', '.join(selects)}
              FROM tensors b {' '.join(joins)}
              WHERE b.run_id = ? AND b.rid IN ({ids})
              ORDER BY b.step, b.rank, b.seq, b.rid"""
    df = frame(store, sql, params + jparams + [base["run_id"], *rids])
    df.attrs["base_run"] = base["name"]
    df.attrs["runs"] = [r["name"] for r in others]
    return Window(df, total, any(by_summary.values()))


def unmatched_counts(store, session_id: str) -> pd.DataFrame:
    """Per compared pair: how many records matched exactly, by alignment, or not at all."""
    return store.df(
        """SELECT rc.name AS candidate, rr.name AS reference, c."match", count(*) AS records
           FROM comparisons c JOIN runs rc ON rc.run_id = c.cand_run_id JOIN runs rr ON rr.run_id = c.ref_run_id
           WHERE c.session_id = ? AND c.kind IN ('accumulated', 'stats')
           GROUP BY rc.name, rr.name, c."match" ORDER BY rc.name, rr.name, c."match" """,
        [session_id],
    )


def runs_table(store, session_id: str) -> pd.DataFrame:
    """One row per run: kind, dtype, parent and fix, stored order, record counts, source (as stored)."""
    return store.df(
        f"""SELECT r.name AS run, r.kind, r.dtype, p.name AS parent, r.fix, r."order" AS "order",
                  (SELECT count(*) FROM tensors t WHERE t.run_id = r.run_id) AS records,
                  (SELECT count(*) FROM tensors t WHERE t.run_id = r.run_id AND t.nonfinite) AS nonfinite_records,
                  r.source, r.created, r.run_id
           FROM runs r LEFT JOIN runs p ON p.run_id = r.parent_run_id
           WHERE r.session_id = ? ORDER BY {run_order("r")}""",
        [session_id],
    )


def top_offenders(store, session_id: str, *, kinds=ACCUMULATED_KINDS, n: int = 10,
                  include_nonfinite: bool = False, run_id: Optional[str] = None) -> pd.DataFrame:
    """The comparisons with the largest error, worst first: the one ranking every table of the worst
    comparisons shows (Top offenders, the report's worst comparisons, the Sessions list's worst op).

    1. What an ``error`` or ``warn`` diagnosis names (``records.NAMING_SEVERITIES``: where the failure
       was introduced or amplified, a quantiser that flushed values, the op a non-finite value started
       at), ahead of the ops that only carry its error on: worst diagnosis first, then a non-finite
       origin, then each rule's first finding before its second (the rules rank their
       own: a quantiser by the share it flushed or saturated), then the first in order.  A diagnosis names
       an op call by its place in the order (``seq``), or by name.
    2. Then by verdict.  Within a verdict, an error carried on is not a new one: the comparisons whose
       error (in units of the candidate format's rounding) is within a factor 2 of the largest of their
       run and verdict (``queries.CARRIED_WITHIN``) rank by where they come in the order, the first first; the
       others by error in rounding units, max relative error (element-wise comparisons), then by the
       summary statistics' relative error (``summary_rel_err``; statistics-only comparisons, ranked
       after the element-wise ones of their verdict, never as the same number).

    Non-finite comparisons are left out unless asked for: the first non-finite producer says more than the
    ops that pass NaN on.  Asked for, a named op call that holds NaN/inf with no record to compare with
    (the reference runs no such op) is a row of kind ``uncompared``, whatever ``kinds`` says.
    """
    return frame(store, *ranked_comparisons_sql(session_id, kinds, n=n, include_nonfinite=include_nonfinite,
                                                run_id=run_id))


def diagnoses_worst_first(store, session_id: str) -> list[dict]:
    """A session's stored diagnoses (every ``diagnoses`` column, ``fixes`` a tuple) and their run's name
    (``run``), errors first, then by execution order."""
    return diagnosis_rows(store, f"""SELECT d.*, r.name AS run FROM diagnoses d LEFT JOIN runs r ON r.run_id = d.run_id
                           WHERE d.session_id = ?
                           ORDER BY {_rank_case("d.severity", Severity, worst_first_order=True)}, d.seq, d.op""",
                [session_id])


def comparison_bases(store, session_id: str) -> set[str]:
    """The bases (``tensor``: element-wise, ``stats``: summary statistics only) of a session's judged
    comparisons."""
    return {r["basis"] for r in rows(store, """SELECT DISTINCT basis FROM comparisons
                                              WHERE session_id = ? AND verdict IS NOT NULL AND basis IS NOT NULL""",
                                     [session_id])}


def error_series(store, session_id: str, metric: str = "max_rel_err", *, roles=("output",),
                 max_points: int = 5000) -> pd.DataFrame:
    """Error of each compared record against execution order, one series per
    candidate run and kind (accumulated / local).

    Columns: ``series, run, run_id, kind, seq, value, op, rid, verdict``.  With more than
    ``max_points`` points in a series, consecutive records are bucketed and
    the worst value of each bucket is kept, so a spike stays visible.
    """
    if metric not in ERROR_METRICS:
        raise ValueError(f"unknown error metric {metric!r}; choose one of {', '.join(ERROR_METRICS)}")
    _, _, larger_worse = ERROR_METRICS[metric]
    role_sql, params = "", [session_id]
    if roles:
        role_sql = f"AND c.role IN ({', '.join('?' * len(roles))})"
        params += list(roles)
    n = rows(store, f"""SELECT max(cnt) AS n FROM (SELECT count(*) AS cnt FROM comparisons c
                        WHERE c.session_id = ? {role_sql} AND c.verdict IS NOT NULL
                        GROUP BY c.cand_run_id, c.kind)""", params)[0]["n"] or 0
    bucket = max(1, math.ceil(n / max_points))
    agg = "max" if larger_worse else "min"
    # a non-finite comparison has no finite error: it is drawn at the worst
    # end of the axis by the figure, flagged here
    df = store.df(
        f"""WITH c AS (
                SELECT c.cand_run_id, c.cand_rid, c.kind, c.seq, c.op, c.verdict,
                       CASE WHEN isfinite(c.{metric}) THEN c.{metric} END AS value,
                       c.seq // {bucket} AS b
                FROM comparisons c WHERE c.session_id = ? {role_sql} AND c.verdict IS NOT NULL)
            SELECT r.name AS run, c.cand_run_id AS run_id, c.kind, min(c.seq) AS seq,
                   {agg}(c.value) AS value,
                   arg_{agg}(c.op, c.value) AS op,
                   coalesce(arg_{agg}(c.cand_rid, c.value), min(c.cand_rid)) AS rid,
                   {_WORST_VERDICT} AS verdict,
                   any_value(c.op) AS any_op
            FROM c JOIN runs r ON r.run_id = c.cand_run_id
            GROUP BY r.name, c.cand_run_id, c.kind, c.b ORDER BY r.name, c.kind, seq""",
        params,
    )
    df["op"] = df["op"].where(df["op"].notna(), df["any_op"])
    df = df.drop(columns=["any_op"])
    df["series"] = df["run"] + " (" + df["kind"].map(lambda k: "local" if k in LOCAL_KINDS else "vs reference") + ")"
    df.attrs["bucket"] = bucket
    df.attrs["metric"] = metric
    return df


def record(store, run_id: str, rid: int) -> dict:
    """The stored record (all ``tensors`` columns) plus its run's name, kind and dtype."""
    got = rows(store, """SELECT t.*, r.name AS run, r.kind AS run_kind, r.dtype AS run_dtype, r.session_id
                         FROM tensors t JOIN runs r ON r.run_id = t.run_id
                         WHERE t.run_id = ? AND t.rid = ?""", [run_id, int(rid)])
    if not got:
        raise KeyError(f"run {run_id} has no record {rid}")
    return got[0]


def has_record(store, run_id: str, rid) -> bool:
    """Whether ``rid`` (a record id, possibly as text from a URL) names a record of the run."""
    text = str(rid).strip()
    if not text.isdigit() or len(text) > 18:
        return False
    return bool(rows(store, "SELECT 1 AS x FROM tensors WHERE run_id = ? AND rid = ?", [run_id, int(text)]))


def find_records(store, run_id: str, text: str = "", *, limit: int = 200, include_rid: Optional[int] = None,
                 step: Optional[int] = None) -> list[dict]:
    """Records of a run whose name contains ``text`` (execution order), of one ``step`` when given, for
    the op picker; ``include_rid`` is always among them."""
    where, params = ["run_id = ?"], [run_id]
    if step is not None:
        where.append("step = ?")
        params.append(int(step))
    if text.strip():
        where.append("name ILIKE ? ESCAPE '\\'")
        params.append(name_pattern_sql(text.strip()))
    got = rows(store, f"""SELECT rid, name, seq, step, rank, nonfinite FROM tensors WHERE {' AND '.join(where)}
                          ORDER BY step, rank, seq, rid LIMIT ?""", params + [int(limit)])
    if include_rid is not None and not any(r["rid"] == include_rid for r in got):
        extra = rows(store, "SELECT rid, name, seq, step, rank, nonfinite FROM tensors WHERE run_id = ? AND rid = ?",
                     [run_id, int(include_rid)])
        got = extra + got
    return got


def counterparts(store, run_id: str, rid: int) -> list[dict]:
    """The records this one was compared with: its reference (if it is a
    candidate) and its candidates (if it is a reference).  Keys: ``side``
    (what the other record is), ``run_id``, ``run``, ``rid``, ``name``,
    ``kind``, ``match``."""
    out = []
    for r in rows(store, """SELECT c.kind, c."match", c.ref_run_id AS run_id, c.ref_rid AS rid, r.name AS run,
                                   t.name
                            FROM comparisons c JOIN runs r ON r.run_id = c.ref_run_id
                            LEFT JOIN tensors t ON t.run_id = c.ref_run_id AND t.rid = c.ref_rid
                            WHERE c.cand_run_id = ? AND c.cand_rid = ? AND c.ref_rid IS NOT NULL
                              AND c.kind IN ('accumulated', 'stats')""", [run_id, int(rid)]):
        out.append({"side": "reference", **r})
    for r in rows(store, f"""SELECT c.kind, c."match", c.cand_run_id AS run_id, c.cand_rid AS rid, r.name AS run,
                                   t.name
                            FROM comparisons c JOIN runs r ON r.run_id = c.cand_run_id
                            LEFT JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
                            WHERE c.ref_run_id = ? AND c.ref_rid = ? AND c.cand_rid IS NOT NULL
                              AND c.kind IN ('accumulated', 'stats')
                            ORDER BY {run_order("r")}""", [run_id, int(rid)]):
        out.append({"side": "candidate", **r})
    return out


def record_comparisons(store, run_id: str, rid: int) -> list[dict]:
    """Every comparison a record takes part in: as the candidate (``this_side`` ``candidate``, ``other`` the
    reference run's name) or as the reference of another run (``this_side`` ``reference``; local ones excluded)."""
    return rows(store, """SELECT c.*, r.name AS other, 'candidate' AS this_side FROM comparisons c
                          JOIN runs r ON r.run_id = c.ref_run_id
                          WHERE c.cand_run_id = ? AND c.cand_rid = ?
                          UNION ALL BY NAME
                          SELECT c.*, r.name AS other, 'reference' AS this_side FROM comparisons c
                          JOIN runs r ON r.run_id = c.cand_run_id
                          WHERE c.ref_run_id = ? AND c.ref_rid = ? AND c.kind <> 'local'""",
                [run_id, int(rid), run_id, int(rid)])


def all_runs(store) -> list[dict]:
    """Every run of every session, oldest first: ``{session_id, run_id, name, dtype, kind, fix, created}``."""
    return rows(store, f"SELECT session_id, run_id, name, dtype, kind, fix, created FROM runs ORDER BY {run_order()}")


def session_exists(store, name: str) -> bool:
    """Whether a session of that name is stored."""
    return bool(rows(store, "SELECT 1 FROM sessions WHERE name = ?", [name]))


def session_warnings(store, session_id: str, *, limit: int) -> list[dict]:
    """Up to ``limit`` warnings of a session, by file: ``{run, file, message}``."""
    return rows(store, """SELECT r.name AS run, w.file, w.message FROM warnings w
                          LEFT JOIN runs r ON r.run_id = w.run_id WHERE w.session_id = ?
                          ORDER BY w.file, w.message LIMIT ?""", [session_id, int(limit)])
