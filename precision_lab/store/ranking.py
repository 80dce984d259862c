"""The ranking of a session's comparisons: which kinds are compared, each verdict's and severity's rank, and the
query that puts the op where a failure starts ahead of the ops that only carry it on (``ranked_comparisons_sql``,
read by ``views.top_offenders``, and as typed rows by the report: ``ranked_comparisons``)."""

from __future__ import annotations

from typing import Optional, Sequence

from ..enums import Severity, Verdict
from ..records import INPUT_ROLES, NAMING_SEVERITIES
from .rows import RankedComparison, rows_as

__all__ = ["ACCUMULATED_KINDS", "LOCAL_KINDS", "CARRIED_WITHIN", "rank_case", "ranked_comparisons_sql",
           "ranked_comparisons"]


# comparison kinds: candidate vs reference run (element-wise, or on summary
# statistics where a dump holds only those), and the op re-computed in fp32
# from the candidate's own inputs
ACCUMULATED_KINDS = ("accumulated", "stats")
LOCAL_KINDS = ("local",)


def rank_case(column: str, kind, *, worst_first_order: bool = False) -> str:
    """SQL ``CASE`` giving each member of ``kind`` (Verdict, Severity) its rank (worse is higher; with
    ``worst_first_order`` worse is lower, and unknown values or NULL rank with the best)."""
    n = len(kind)
    whens = " ".join(f"WHEN '{m.value}' THEN {n - 1 - m.rank if worst_first_order else m.rank}" for m in kind)
    return f"CASE {column} {whens} {'ELSE ' + str(n - 1) + ' ' if worst_first_order else ''}END"



# an error within this factor of the largest of its run and verdict is the same error carried on: the
# ranking puts the first of them first (``ranked_comparisons_sql``)
CARRIED_WITHIN = 2.0


# the comparison columns the ranking carries, in the order its rows give them
_RANKED_COLS = ("seq", "op", "role", '"index"', "kind", "basis", "verdict", '"match"', "nonfinite_introduced",
                "max_abs_err", "max_rel_err", "summary_abs_err", "summary_rel_err", "cosine", "cosine_deficit",
                "sqnr_db", "rounding_units", "reason", "cand_run_id", "cand_rid", "ref_run_id", "ref_rid")


def _naming_diagnoses_sql() -> str:
    """The CTEs ``each`` and ``d``: per run and op (and seq) the best severity rank of the diagnoses that name it
    and its first place among its rule's findings (parameters: the session id, then ``NAMING_SEVERITIES``)."""
    return f"""each AS (SELECT run_id, op, seq, {rank_case("severity", Severity, worst_first_order=True)} AS sev,
                                 row_number() OVER (PARTITION BY run_id, rule ORDER BY rowid) AS nth
                          FROM diagnoses WHERE session_id = ?
                          AND severity IN ({', '.join('?' * len(NAMING_SEVERITIES))})),
                 d AS (SELECT run_id, op, seq, min(sev) AS sev, min(nth) AS nth FROM each GROUP BY run_id, op, seq)"""


def _uncompared_sql(lone: Sequence[str]) -> str:
    """A row of its own for each named op call's record holding NaN/inf with no judged comparison, where ``lone``
    holds (the reference runs no such op: a quantiser's own reciprocal), as kind ``uncompared``."""
    return f"""SELECT t.seq, t.op, t.role, t."index", 'uncompared', NULL, 'nonfinite', NULL, NULL, NULL,
                                  NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                  'holds NaN/inf; the reference has no record to compare it with',
                                  t.run_id, t.rid, NULL, NULL, min(d.sev), min(d.nth)
                           FROM tensors t JOIN d ON d.run_id = t.run_id
                                AND (d.op = t.op OR (d.seq >= 0 AND d.seq = t.seq))
                           WHERE {' AND '.join(lone)}
                           GROUP BY ALL"""


# worst first: the diagnosed ops in the order their diagnoses rank them, then by verdict, then the first of an
# error carried on (``CARRIED_WITHIN``), then the largest errors
_RANKED_ORDER = f"""c.d_sev NULLS LAST, c.d_sev IS NOT NULL AND c.verdict = 'nonfinite' DESC, c.d_nth NULLS LAST,
                     CASE WHEN c.d_sev IS NOT NULL THEN c.seq END,
                     {rank_case("c.verdict", Verdict, worst_first_order=True)},
                     CASE WHEN c.ru >= c.ru_max / {CARRIED_WITHIN} THEN c.seq END NULLS LAST,
                     c.ru DESC NULLS LAST,
                     CASE WHEN isfinite(c.max_rel_err) THEN c.max_rel_err END DESC NULLS LAST,
                     CASE WHEN isfinite(c.summary_rel_err) THEN c.summary_rel_err END DESC NULLS LAST,
                     c.seq, c.op, c.role, c."index", c.kind, r.name"""


def ranked_comparisons_sql(session_id: str, kinds: Sequence[str], *, n: int = 10, include_nonfinite: bool = False,
                           run_id: Optional[str] = None) -> tuple[str, list]:
    """The query (and its parameters) of a session's comparisons, worst first: the one ranking every table of
    the worst comparisons shows (``views.top_offenders`` says how it ranks)."""
    kinds = tuple(kinds)
    where = ["c.session_id = ?", f"c.kind IN ({', '.join('?' * len(kinds))})", "c.verdict IS NOT NULL"]
    roles = ", ".join("?" * len(INPUT_ROLES))
    params: list = [session_id, *NAMING_SEVERITIES, *INPUT_ROLES, session_id, *kinds]
    if not include_nonfinite:
        where.append("c.verdict <> 'nonfinite'")
    if run_id:
        where.append("c.cand_run_id = ?")
        params.append(run_id)
    lone = ["t.run_id IN (SELECT run_id FROM runs WHERE session_id = ?)", "t.nonfinite",
            f"t.role NOT IN ({roles})", "NOT EXISTS (SELECT 1 FROM comparisons c2 WHERE c2.cand_run_id = t.run_id "
            "AND c2.cand_rid = t.rid AND c2.verdict IS NOT NULL)", "true" if include_nonfinite else "false"]
    params += [session_id, *INPUT_ROLES]
    if run_id:
        lone.append("t.run_id = ?")
        params.append(run_id)
    params.append(int(n))
    sql = (
        f"""WITH {_naming_diagnoses_sql()},
                 named AS (SELECT {', '.join('c.' + x for x in _RANKED_COLS)},
                                  min(d.sev) AS d_sev, min(d.nth) AS d_nth
                           FROM comparisons c LEFT JOIN d ON d.run_id = c.cand_run_id
                                AND c.role NOT IN ({roles})
                                AND (d.op = c.op OR (d.seq >= 0 AND d.seq = c.seq))
                           WHERE {' AND '.join(where)}
                           GROUP BY ALL
                           UNION ALL
                           {_uncompared_sql(lone)}),
                 ranked AS (SELECT *, CASE WHEN isfinite(rounding_units) THEN rounding_units END AS ru,
                                   max(CASE WHEN isfinite(rounding_units) THEN rounding_units END)
                                       OVER (PARTITION BY cand_run_id, verdict) AS ru_max
                            FROM named)
            SELECT r.name AS run, c.seq, c.op, c.role, c."index", c.kind, c.basis, c.verdict, c."match",
                   c.nonfinite_introduced, c.max_abs_err, c.max_rel_err, c.summary_abs_err, c.summary_rel_err,
                   c.cosine, c.cosine_deficit, c.sqnr_db, c.rounding_units, c.reason, c.cand_run_id AS run_id,
                   c.cand_rid AS rid, c.ref_run_id, c.ref_rid
            FROM ranked c JOIN runs r ON r.run_id = c.cand_run_id
            ORDER BY {_RANKED_ORDER}
            LIMIT ?""")
    return sql, params


def ranked_comparisons(store, session_id: str, kinds: Sequence[str], *, n: int = 10, include_nonfinite: bool = False,
                       run_id: Optional[str] = None) -> list[RankedComparison]:
    """The ``n`` worst comparisons of a session, worst first (``ranked_comparisons_sql``), as typed rows."""
    return rows_as(RankedComparison, store.sql(*ranked_comparisons_sql(session_id, kinds, n=n,
                                                                       include_nonfinite=include_nonfinite,
                                                                       run_id=run_id)))
