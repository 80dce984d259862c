"""The diffs of a session: one reference/candidate pair aligned record by record, and the N-run view (every
record of a base run beside its counterpart in each other run), read a window at a time in two steps: the
window's ids, filtered and ordered on one table, then their rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..records import RunInfo
from .queries import rows, session_runs
from .ranking import ACCUMULATED_KINDS
from .rows import ComparedPair
from .viewparts import Clause, Window, absmax_sql, check_window, frame, has_stats_basis, name_pattern_sql, severity_sql

# which rows a diff shows
SHOW_OPTIONS = ("all", "problems", "unmatched")


_STAT_COLS = ("dtype", "shape", "min", "max", "absmax", "mean", "l2norm", "nan_count", "inf_count")


def _check_show(show: str) -> None:
    if show not in SHOW_OPTIONS:
        raise ValueError(f"unknown diff filter {show!r}; choose one of {', '.join(SHOW_OPTIONS)}")


def _page(store, source: str, key: str, column: str, where: Clause, order: str, offset: int,
          limit: int) -> tuple[int, list]:
    """How many rows of ``source`` ``where`` keeps, and the ``key`` (read as ``column``) of those in the window
    ``offset .. offset + limit`` by ``order``."""
    params = list(where.params)
    total = int(rows(store, f"SELECT count(*) AS n FROM {source} WHERE {where.sql}", params)[0]["n"])
    got = rows(store, f"""SELECT {key} FROM {source} WHERE {where.sql}
                          ORDER BY {order} LIMIT ? OFFSET ?""", params + [limit, offset])
    return total, [r[column] for r in got]


def _stat_sql(table: str, column: str) -> str:
    """A stored statistic as shown: absmax counts Inf (``absmax_sql``), the others as stored."""
    return absmax_sql(table) if column == "absmax" else f'{table}."{column}"'


def pair_options(store, session_id: str) -> list[ComparedPair]:
    """(reference, candidate) run pairs that have comparisons, with labels."""
    names = {r.run_id: r.name for r in session_runs(store, session_id)}
    pairs = rows(store, """SELECT ref_run_id, cand_run_id, count(*) AS n FROM comparisons
                           WHERE session_id = ? AND kind IN ('accumulated', 'stats')
                           GROUP BY ref_run_id, cand_run_id ORDER BY min(rowid)""", [session_id])
    label = lambda run_id: names.get(run_id, run_id)  # noqa: E731
    return [ComparedPair(p["ref_run_id"], p["cand_run_id"], p["n"], f"{label(p['cand_run_id'])} vs {label(p['ref_run_id'])}")
            for p in pairs]


def _diff_filter(session_id: str, ref_run_id: str, cand_run_id: str, show: str, pattern: str) -> Clause:
    """The comparisons of one pair a diff shows: all, those with a problem, or the unmatched ones, of an op
    whose name matches ``pattern``."""
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
    return Clause(" AND ".join(where), tuple(params))


def _diff_rows_sql(n: int) -> str:
    """The rows of ``n`` given comparisons (rowids) with both sides' records."""
    ref_cols = ", ".join(f'{_stat_sql("r", c)} AS "ref {c}"' for c in _STAT_COLS)
    cand_cols = ", ".join(f'{_stat_sql("t", c)} AS "cand {c}"' for c in _STAT_COLS)
    return f"""SELECT {severity_sql('t.nonfinite', 'c.verdict')} AS severity, c.seq, c.step, c.rank, c.op, c.role,
                   c."index", c."match", {ref_cols}, {cand_cols},
                   c.max_abs_err, c.max_rel_err, c.summary_abs_err, c.summary_rel_err, c.cosine, c.cosine_deficit,
                   c.sqnr_db, c.verdict, c.basis, c.reason, c.ref_rid, c.cand_rid, r.nonfinite AS ref_nonfinite,
                   t.nonfinite AS cand_nonfinite
            FROM (SELECT rowid AS id, * FROM comparisons WHERE rowid IN ({', '.join('?' * n) or 'NULL'})) c
            LEFT JOIN tensors r ON r.run_id = c.ref_run_id AND r.rid = c.ref_rid
            LEFT JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
            ORDER BY c.step, c.rank, c.seq, c.id"""


def diff_rows(store, session_id: str, ref_run_id: str, cand_run_id: str, *, show: str = "all",
              pattern: str = "", offset: int = 0, limit: int = 50) -> Window:
    """Aligned rows of one reference/candidate pair in execution order.

    Unmatched records appear with the other side empty and ``match``
    ``unmatched_ref`` / ``unmatched_cand``; they carry no metrics.  A
    comparison on summary statistics has ``summary_abs_err`` /
    ``summary_rel_err`` and no ``max_*_err``; ``stats_basis`` says whether
    the pair has any.
    """
    _check_show(show)
    check_window(offset, limit)
    # step 1: the page's comparison rows (rowid), filtered and ordered on
    # the comparisons table alone; step 2: their records, for those rows only
    total, ids = _page(store, "comparisons c", "c.rowid AS id", "id",
                       _diff_filter(session_id, ref_run_id, cand_run_id, show, pattern),
                       "c.step, c.rank, c.seq, c.rowid", offset, limit)
    df = frame(store, _diff_rows_sql(len(ids)), ids)
    stats_basis = has_stats_basis(store, "session_id = ? AND ref_run_id = ? AND cand_run_id = ?",
                                  [session_id, ref_run_id, cand_run_id])
    return Window(df, total, stats_basis)


def base_run(store, session_id: str) -> Optional[RunInfo]:
    """The run the N-run view aligns on: the (first) reference run, else the first run."""
    runs = session_runs(store, session_id)
    if not runs:
        return None
    return next((r for r in runs if r.kind == "reference"), runs[0])


# ---- the N-run view, put together from named clauses ------------------------------------------------------


@dataclass(frozen=True)
class _OtherRun:
    """A run the N-run view sets beside the base run: its records matched through its stored comparisons with
    the base when it has any (``compared``), else by step, rank and name; ``by_summary``: some of those
    comparisons are on summary statistics."""

    run: RunInfo
    compared: bool
    by_summary: bool

    @property
    def run_id(self) -> str:
        return self.run.run_id


def _nrun_runs(store, session_id: str, run_ids: Sequence[str], base_run_id: Optional[str]) -> tuple[RunInfo, list]:
    """The base run and the other chosen runs (``_OtherRun``) of the N-run view."""
    runs = {r.run_id: r for r in session_runs(store, session_id)}
    base = runs.get(base_run_id) if base_run_id else base_run(store, session_id)
    if base is None:
        raise ValueError("the session has no runs")
    others = [runs[r] for r in run_ids if r in runs and r != base.run_id]
    if not others:
        raise ValueError("choose at least one run besides the base run to compare")
    return base, [_other_run(store, session_id, base, r) for r in others]


def _other_run(store, session_id: str, base: RunInfo, run: RunInfo) -> _OtherRun:
    got = rows(store, """SELECT count(*) AS n, coalesce(bool_or(basis = 'stats'), false) AS s FROM comparisons
                         WHERE session_id = ? AND ref_run_id = ? AND cand_run_id = ?
                           AND kind IN ('accumulated', 'stats')""",
               [session_id, base.run_id, run.run_id])[0]
    return _OtherRun(run, got["n"] > 0, bool(got["s"]))


# what the N-run view's "problems" and "unmatched" keep of the base run: (a condition on the base record itself,
# the condition through a run's stored comparisons with the base, the condition by tensor name), a record kept
# when its own condition or that of some other run holds
_NRUN_SHOW = {
    "problems": ("b.nonfinite",
                 "b.rid IN (SELECT ref_rid FROM comparisons WHERE session_id = ? AND ref_run_id = ? "
                 "AND cand_run_id = ? AND kind IN ('accumulated', 'stats') AND verdict IN ('nonfinite', 'error'))",
                 "b.name IN (SELECT name FROM tensors WHERE run_id = ? AND nonfinite)"),
    "unmatched": (None,
                  "b.rid NOT IN (SELECT ref_rid FROM comparisons WHERE session_id = ? AND ref_run_id = ? "
                  "AND cand_run_id = ? AND kind IN ('accumulated', 'stats') AND ref_rid IS NOT NULL "
                  "AND cand_rid IS NOT NULL)",
                  "NOT EXISTS (SELECT 1 FROM tensors o WHERE o.run_id = ? AND o.name = b.name "
                  "AND o.step = b.step AND o.rank = b.rank)"),
}


def _in_any_run(session_id: str, base: RunInfo, others: list, own: Optional[str], by_comparison: str,
                by_name: str) -> Clause:
    """``(own OR <one condition per other run>)``: through the run's stored comparisons with the base when it
    has any, else by tensor name."""
    conds = [Clause(own)] if own else []
    conds += [Clause(by_comparison, (session_id, base.run_id, o.run_id)) if o.compared
              else Clause(by_name, (o.run_id,)) for o in others]
    inner = Clause.joined(conds, " OR ")
    return Clause(f"({inner.sql})", inner.params)


def _nrun_filter(session_id: str, base: RunInfo, others: list, show: str, pattern: str) -> Clause:
    """The base run's records the view shows: by name pattern, and (``show``) with a problem or unmatched in
    some run."""
    where = [Clause("b.run_id = ?", (base.run_id,))]
    if pattern.strip():
        where.append(Clause("b.name ILIKE ? ESCAPE '\\'", (name_pattern_sql(pattern.strip()),)))
    if show in _NRUN_SHOW:
        where.append(_in_any_run(session_id, base, others, *_NRUN_SHOW[show]))
    return Clause.joined(where, " AND ")


def _counterpart_cte(i: int, other: _OtherRun, session_id: str, base: RunInfo, ids: str, rids: list) -> Clause:
    """``m{i}``: run ``other``'s record matching each base record of the page (``ref_rid`` -> ``cand_rid``) with
    the stored comparison's metrics, or, where the run was not compared with the base, by identical step, rank
    and name (no metrics)."""
    if other.compared:
        return Clause(f"""m{i} AS (SELECT DISTINCT ON (ref_rid) ref_rid, cand_rid, "match", max_rel_err,
                                   summary_rel_err, sqnr_db, verdict
                            FROM comparisons WHERE session_id = ? AND ref_run_id = ? AND cand_run_id = ?
                              AND kind IN ('accumulated', 'stats') AND ref_rid IN ({ids}) ORDER BY ref_rid)""",
                      (session_id, base.run_id, other.run_id, *rids))
    return Clause(f"""m{i} AS (SELECT DISTINCT ON (b.rid) b.rid AS ref_rid, o.rid AS cand_rid,
                                   'name' AS "match", NULL::DOUBLE AS max_rel_err,
                                   NULL::DOUBLE AS summary_rel_err, NULL::DOUBLE AS sqnr_db, NULL::VARCHAR AS verdict
                            FROM tensors b JOIN tensors o ON o.run_id = ? AND o.step = b.step AND o.rank = b.rank
                                 AND o.name = b.name
                            WHERE b.run_id = ? AND b.rid IN ({ids}) ORDER BY b.rid, o.rid)""",
                  (other.run_id, base.run_id, *rids))


def _counterpart_join(i: int, other: _OtherRun) -> Clause:
    """The match ``m{i}`` of each base record and run ``other``'s record it names (``t{i}``)."""
    return Clause(f"LEFT JOIN m{i} ON m{i}.ref_rid = b.rid "
                  f"LEFT JOIN tensors t{i} ON t{i}.run_id = ? AND t{i}.rid = m{i}.cand_rid", (other.run_id,))


def _counterpart_columns(i: int, other: _OtherRun) -> str:
    """Run ``other``'s column group: its record's absmax and non-finite flag, its metrics against the base, and
    how it was matched."""
    name = other.run.name.replace('"', "'")
    # a run compared on summary statistics has their error beside the element-wise one, never in it
    summary = f'm{i}.summary_rel_err AS "{name}: summary_rel_err", ' if other.by_summary else ""
    return f"""{absmax_sql(f"t{i}")} AS "{name}: absmax", t{i}.nonfinite AS "{name}: nonfinite",
                m{i}.max_rel_err AS "{name}: max_rel_err", {summary}m{i}.sqnr_db AS "{name}: sqnr_db",
                m{i}.verdict AS "{name}: verdict",
                CASE WHEN m{i}.cand_rid IS NULL THEN 'unmatched' ELSE coalesce(m{i}."match", '') END AS "{name}: match" """


def _nrun_query(session_id: str, base: RunInfo, others: list, rids: list) -> Clause:
    """The page's rows: each base record of ``rids`` and its counterpart in every other run."""
    ids = ", ".join("?" * len(rids)) or "NULL"
    ctes = Clause.joined((_counterpart_cte(i, o, session_id, base, ids, rids) for i, o in enumerate(others)), ", ")
    joins = Clause.joined((_counterpart_join(i, o) for i, o in enumerate(others)), " ")
    selects = ", ".join(_counterpart_columns(i, o) for i, o in enumerate(others))
    bname = base.name.replace('"', "'")
    sql = f"""WITH {ctes.sql}
              SELECT b.seq, b.step, b.rank, b.op, b.role, b."index", b.rid,
                     b.dtype AS "{bname}: dtype", {absmax_sql("b")} AS "{bname}: absmax", b.nonfinite AS "{bname}: nonfinite",
                     {selects}
              FROM tensors b {joins.sql}
              WHERE b.run_id = ? AND b.rid IN ({ids})
              ORDER BY b.step, b.rank, b.seq, b.rid"""
    return Clause(sql, ctes.params + joins.params + (base.run_id, *rids))


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
    _check_show(show)
    check_window(offset, limit)
    base, others = _nrun_runs(store, session_id, run_ids, base_run_id)
    # step 1: the page's base records, filtered with semi-joins on the base run;
    # step 2: each run's counterpart of those records only
    total, rids = _page(store, "tensors b", "b.rid", "rid", _nrun_filter(session_id, base, others, show, pattern),
                        "b.step, b.rank, b.seq, b.rid", offset, limit)
    query = _nrun_query(session_id, base, others, rids)
    df = frame(store, query.sql, list(query.params))
    df.attrs["base_run"] = base.name
    df.attrs["runs"] = [o.run.name for o in others]
    return Window(df, total, any(o.by_summary for o in others))
