"""The Diff page: reference stats | candidate stats | metrics, aligned per op,
and the N-run view with one column group per run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd

from .common import absmax_sql, cosine_text, frame, rows, severity_sql
from .ops import name_pattern_sql
from .overview import ACCUMULATED_KINDS, session_runs

__all__ = ["DiffPage", "pair_options", "diff_page", "nrun_page", "base_run", "SHOW_OPTIONS"]

# which rows a diff shows
SHOW_OPTIONS = ("all", "problems", "unmatched")

_STAT_COLS = ("dtype", "shape", "min", "max", "absmax", "mean", "l2norm", "nan_count", "inf_count")


def _stat_sql(table: str, column: str) -> str:
    """A stored statistic as shown: absmax counts Inf (``absmax_sql``), the others as stored."""
    return absmax_sql(table) if column == "absmax" else f'{table}."{column}"'


@dataclass
class DiffPage:
    rows: pd.DataFrame
    total: int
    page: int
    page_size: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.page_size))


def pair_options(store, session_id: str) -> list[dict]:
    """(reference, candidate) run pairs that have comparisons, with labels."""
    names = {r["run_id"]: r["name"] for r in session_runs(store, session_id)}
    pairs = rows(store, """SELECT ref_run_id, cand_run_id, count(*) AS n FROM comparisons
                           WHERE session_id = ? AND kind IN ('accumulated', 'stats')
                           GROUP BY ref_run_id, cand_run_id ORDER BY min(rowid)""", [session_id])
    return [{"ref_run_id": p["ref_run_id"], "cand_run_id": p["cand_run_id"], "rows": p["n"],
             "label": f"{names.get(p['cand_run_id'], p['cand_run_id'])} vs {names.get(p['ref_run_id'], p['ref_run_id'])}"}
            for p in pairs]


def _page_bounds(total: int, page: int, page_size: int) -> int:
    if page_size <= 0:
        raise ValueError(f"invalid page size {page_size}")
    return max(0, min(page, -(-total // page_size) - 1))


def diff_page(store, session_id: str, ref_run_id: str, cand_run_id: str, *, show: str = "all",
              pattern: str = "", page: int = 0, page_size: int = 50) -> DiffPage:
    """Aligned rows of one reference/candidate pair in execution order.

    Unmatched records appear with the other side empty and ``match``
    ``unmatched_ref`` / ``unmatched_cand``; they carry no metrics.
    """
    if show not in SHOW_OPTIONS:
        raise ValueError(f"unknown diff filter {show!r}; choose one of {', '.join(SHOW_OPTIONS)}")
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
    page = _page_bounds(total, page, page_size)
    ids = [r["id"] for r in rows(
        store, f"""SELECT c.rowid AS id FROM comparisons c WHERE {where_sql}
                   ORDER BY c.step, c.rank, c.seq, c.rowid LIMIT ? OFFSET ?""",
        params + [page_size, page * page_size])]
    ref_cols = ", ".join(f'{_stat_sql("r", c)} AS "ref {c}"' for c in _STAT_COLS)
    cand_cols = ", ".join(f'{_stat_sql("t", c)} AS "cand {c}"' for c in _STAT_COLS)
    df = frame(store, 
        f"""SELECT {severity_sql('t.nonfinite', 'c.verdict')} AS severity, c.seq, c.step, c.rank, c.op, c.role,
                   c."index", c."match", {ref_cols}, {cand_cols},
                   c.max_abs_err, c.max_rel_err, c.cosine, c.cosine_deficit, c.sqnr_db, c.verdict, c.basis,
                   c.reason, c.ref_rid, c.cand_rid, r.nonfinite AS ref_nonfinite, t.nonfinite AS cand_nonfinite
            FROM (SELECT rowid AS id, * FROM comparisons WHERE rowid IN ({', '.join('?' * len(ids)) or 'NULL'})) c
            LEFT JOIN tensors r ON r.run_id = c.ref_run_id AND r.rid = c.ref_rid
            LEFT JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
            ORDER BY c.step, c.rank, c.seq, c.id""",
        ids,
    )
    df.insert(df.columns.get_loc("sqnr_db"), "cosine (1-cos)",
              [cosine_text(c, d) for c, d in zip(df["cosine"], df["cosine_deficit"])])
    df = df.drop(columns=["cosine", "cosine_deficit"])
    return DiffPage(df, total, page, page_size)


def base_run(store, session_id: str) -> Optional[dict]:
    """The run the N-run view aligns on: the (first) reference run, else the first run."""
    runs = session_runs(store, session_id)
    if not runs:
        return None
    return next((r for r in runs if r["kind"] == "reference"), runs[0])


def nrun_page(store, session_id: str, run_ids: Sequence[str], *, base_run_id: Optional[str] = None,
              show: str = "all", pattern: str = "", page: int = 0, page_size: int = 50) -> DiffPage:
    """One row per record of the base run, one column group per other run.

    Each group holds that run's matching record (by the stored comparison
    with the base run when there is one, else by identical step, rank and
    name): its absmax, whether it is non-finite, and its metrics against the
    base run.  A run with no counterpart for a row shows empty cells and
    ``unmatched`` in its match column.
    """
    if show not in SHOW_OPTIONS:
        raise ValueError(f"unknown diff filter {show!r}; choose one of {', '.join(SHOW_OPTIONS)}")
    runs = {r["run_id"]: r for r in session_runs(store, session_id)}
    base = runs.get(base_run_id) if base_run_id else base_run(store, session_id)
    if base is None:
        raise ValueError("the session has no runs")
    others = [runs[r] for r in run_ids if r in runs and r != base["run_id"]]
    if not others:
        raise ValueError("choose at least one run besides the base run to compare")
    compared = {}
    for r in others:
        compared[r["run_id"]] = rows(store, """SELECT count(*) AS n FROM comparisons WHERE session_id = ?
                                            AND ref_run_id = ? AND cand_run_id = ? AND kind IN ('accumulated', 'stats')""",
                                     [session_id, base["run_id"], r["run_id"]])[0]["n"] > 0

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
    page = _page_bounds(total, page, page_size)
    rids = [r["rid"] for r in rows(store, f"""SELECT b.rid FROM tensors b WHERE {where_sql}
                                             ORDER BY b.step, b.rank, b.seq, b.rid LIMIT ? OFFSET ?""",
                                   wparams + [page_size, page * page_size])]

    # step 2: each run's counterpart of those records only
    ids = ", ".join("?" * len(rids)) or "NULL"
    ctes, selects, joins, params, jparams = [], [], [], [], []
    for i, r in enumerate(others):
        if compared[r["run_id"]]:
            ctes.append(f"""m{i} AS (SELECT DISTINCT ON (ref_rid) ref_rid, cand_rid, "match", max_rel_err,
                                   sqnr_db, verdict
                            FROM comparisons WHERE session_id = ? AND ref_run_id = ? AND cand_run_id = ?
                              AND kind IN ('accumulated', 'stats') AND ref_rid IN ({ids}) ORDER BY ref_rid)""")
            params += [session_id, base["run_id"], r["run_id"], *rids]
        else:
            ctes.append(f"""m{i} AS (SELECT DISTINCT ON (b.rid) b.rid AS ref_rid, o.rid AS cand_rid,
                                   'name' AS "match", NULL::DOUBLE AS max_rel_err, NULL::DOUBLE AS sqnr_db,
                                   NULL::VARCHAR AS verdict
                            FROM tensors b JOIN tensors o ON o.run_id = ? AND o.step = b.step AND o.rank = b.rank
                                 AND o.name = b.name
                            WHERE b.run_id = ? AND b.rid IN ({ids}) ORDER BY b.rid, o.rid)""")
            params += [r["run_id"], base["run_id"], *rids]
        joins.append(f"LEFT JOIN m{i} ON m{i}.ref_rid = b.rid "
                     f"LEFT JOIN tensors t{i} ON t{i}.run_id = ? AND t{i}.rid = m{i}.cand_rid")
        jparams.append(r["run_id"])
        name = r["name"].replace('"', "'")
        selects.append(
            f"""{absmax_sql(f"t{i}")} AS "{name}: absmax", t{i}.nonfinite AS "{name}: nonfinite",
                m{i}.max_rel_err AS "{name}: max_rel_err", m{i}.sqnr_db AS "{name}: sqnr_db",
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
    return DiffPage(df, total, page, page_size)


def unmatched_counts(store, session_id: str) -> pd.DataFrame:
    """Per compared pair: how many records matched exactly, by alignment, or not at all."""
    return store.df(
        """SELECT rc.name AS candidate, rr.name AS reference, c."match", count(*) AS records
           FROM comparisons c JOIN runs rc ON rc.run_id = c.cand_run_id JOIN runs rr ON rr.run_id = c.ref_run_id
           WHERE c.session_id = ? AND c.kind IN ('accumulated', 'stats')
           GROUP BY rc.name, rr.name, c."match" ORDER BY rc.name, rr.name, c."match" """,
        [session_id],
    )
