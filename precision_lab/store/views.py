"""The read model: the questions the dashboard and the CLI ask of a session (op tables, diffs, run tables, error
series, record lookups), answered in SQL.

Every function takes a ``Store`` first and returns plain values or a
DataFrame; ``precision_lab.ui`` reads them directly and decides how they are
shown (page numbers, labels, colours, decoded cards).  A table that is read a
window at a time takes ``offset`` and ``limit`` and returns a ``Window``.

This module is the read model's one address for these questions: the op table is asked in ``optable``, the
diffs and the N-run view in ``diffs``, and what they share in ``viewparts``; their names are published here.
"""

from __future__ import annotations

import math
from typing import Optional

import pandas as pd

from ..enums import Verdict, worst_first
from ..records import RunInfo
from .diffs import SHOW_OPTIONS, base_run, diff_rows, nrun_rows, pair_options  # noqa: F401
from .optable import PROBLEM_VERDICTS, SORTABLE, OpsFilter, filter_options, ops_rows  # noqa: F401
from .queries import rows, run_order
from .ranking import ACCUMULATED_KINDS, LOCAL_KINDS, ranked_comparisons_sql  # noqa: F401
from .viewparts import Window, absmax_sql, frame, name_pattern_sql, severity_sql  # noqa: F401
from .rows import Counterpart, RecordChoice, RecordComparison, RecordOfRun, RunWarning, records_as, rows_as


# the worst verdict of a group of comparisons ``c``
_WORST_VERDICT = ("CASE " + " ".join(f"WHEN bool_or(c.verdict = '{v.value}') THEN '{v.value}'"
                                     for v in worst_first(Verdict) if v.rank > 0)
                  + f" ELSE '{min(Verdict, key=lambda v: v.rank).value}' END")


# metric -> (axis title, log axis, worse is larger)
ERROR_METRICS = {
    "max_rel_err": ("max relative error (|c - r| / max(|r|, floor))", True, True),
    "sqnr_db": ("SQNR (dB, higher is better)", False, False),
    "rounding_units": ("relative RMS error / unit roundoff of the candidate format", True, True),
    "max_abs_err": ("max absolute error", True, True),
    # statistics-only comparisons: how far the summaries (max, min, norm) moved, not an element's error
    "summary_rel_err": ("summary relative error (max, min, norm: |c - r| / max(|r|, floor))", True, True),
}


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
       run and verdict (``ranking.CARRIED_WITHIN``) rank by where they come in the order, the first first; the
       others by error in rounding units, max relative error (element-wise comparisons), then by the
       summary statistics' relative error (``summary_rel_err``; statistics-only comparisons, ranked
       after the element-wise ones of their verdict, never as the same number).

    Non-finite comparisons are left out unless asked for: the first non-finite producer says more than the
    ops that pass NaN on.  Asked for, a named op call that holds NaN/inf with no record to compare with
    (the reference runs no such op) is a row of kind ``uncompared``, whatever ``kinds`` says.
    """
    return frame(store, *ranked_comparisons_sql(session_id, kinds, n=n, include_nonfinite=include_nonfinite,
                                                run_id=run_id))


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


def record(store, run_id: str, rid: int) -> RecordOfRun:
    """The stored record plus its run's name, kind and dtype."""
    got = records_as(RecordOfRun, store.sql("""SELECT t.*, r.name AS run, r.kind AS run_kind, r.dtype AS run_dtype,
                                                      r.session_id
                                               FROM tensors t JOIN runs r ON r.run_id = t.run_id
                                               WHERE t.run_id = ? AND t.rid = ?""", [run_id, int(rid)]))
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
                 step: Optional[int] = None) -> list[RecordChoice]:
    """Records of a run whose name contains ``text`` (execution order), of one ``step`` when given, for
    the op picker; ``include_rid`` is always among them."""
    where, params = ["run_id = ?"], [run_id]
    if step is not None:
        where.append("step = ?")
        params.append(int(step))
    if text.strip():
        where.append("name ILIKE ? ESCAPE '\\'")
        params.append(name_pattern_sql(text.strip()))
    got = rows_as(RecordChoice, store.sql(f"""SELECT rid, name, seq, step, rank, nonfinite FROM tensors
                                              WHERE {' AND '.join(where)}
                                              ORDER BY step, rank, seq, rid LIMIT ?""", params + [int(limit)]))
    if include_rid is not None and not any(r.rid == include_rid for r in got):
        extra = rows_as(RecordChoice, store.sql("SELECT rid, name, seq, step, rank, nonfinite FROM tensors "
                                                "WHERE run_id = ? AND rid = ?", [run_id, int(include_rid)]))
        got = extra + got
    return got


def counterparts(store, run_id: str, rid: int) -> list[Counterpart]:
    """The records this one was compared with: its reference (if it is a candidate) and its candidates (if it is
    a reference)."""
    references = rows_as(Counterpart, store.sql("""
        SELECT 'reference' AS side, c.kind, c."match", c.ref_run_id AS run_id, c.ref_rid AS rid, r.name AS run, t.name
        FROM comparisons c JOIN runs r ON r.run_id = c.ref_run_id
        LEFT JOIN tensors t ON t.run_id = c.ref_run_id AND t.rid = c.ref_rid
        WHERE c.cand_run_id = ? AND c.cand_rid = ? AND c.ref_rid IS NOT NULL
          AND c.kind IN ('accumulated', 'stats')""", [run_id, int(rid)]))
    candidates = rows_as(Counterpart, store.sql(f"""
        SELECT 'candidate' AS side, c.kind, c."match", c.cand_run_id AS run_id, c.cand_rid AS rid, r.name AS run, t.name
        FROM comparisons c JOIN runs r ON r.run_id = c.cand_run_id
        LEFT JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
        WHERE c.ref_run_id = ? AND c.ref_rid = ? AND c.cand_rid IS NOT NULL
          AND c.kind IN ('accumulated', 'stats')
        ORDER BY {run_order("r")}""", [run_id, int(rid)]))
    return references + candidates


def record_comparisons(store, run_id: str, rid: int) -> list[RecordComparison]:
    """Every comparison a record takes part in: as the candidate (``this_side`` ``candidate``, ``other`` the
    reference run's name) or as the reference of another run (``this_side`` ``reference``; local ones excluded)."""
    return rows_as(RecordComparison, store.sql("""SELECT c.*, r.name AS other, 'candidate' AS this_side FROM comparisons c
                          JOIN runs r ON r.run_id = c.ref_run_id
                          WHERE c.cand_run_id = ? AND c.cand_rid = ?
                          UNION ALL BY NAME
                          SELECT c.*, r.name AS other, 'reference' AS this_side FROM comparisons c
                          JOIN runs r ON r.run_id = c.cand_run_id
                          WHERE c.ref_run_id = ? AND c.ref_rid = ? AND c.kind <> 'local'""",
                [run_id, int(rid), run_id, int(rid)]))


def all_runs(store) -> list[RunInfo]:
    """Every run of every session, oldest first."""
    return rows_as(RunInfo, store.sql(f"SELECT * FROM runs ORDER BY {run_order()}"))


def session_exists(store, name: str) -> bool:
    """Whether a session of that name is stored."""
    return bool(rows(store, "SELECT 1 FROM sessions WHERE name = ?", [name]))


def session_warnings(store, session_id: str, *, limit: int) -> list[RunWarning]:
    """Up to ``limit`` warnings of a session, by file."""
    return rows_as(RunWarning, store.sql("""SELECT r.name AS run, w.file, w.message FROM warnings w
                          LEFT JOIN runs r ON r.run_id = w.run_id WHERE w.session_id = ?
                          ORDER BY w.file, w.message LIMIT ?""", [session_id, int(limit)]))
