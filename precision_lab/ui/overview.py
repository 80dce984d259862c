"""Overview of one session: runs, first non-finite producers, top offenders,
diagnosis cards, and error against execution order."""

from __future__ import annotations

import json
import math
from typing import Optional

import pandas as pd

from ..services.report import order_text
from .common import frame, num_text, plot_text, public_source, rows, run_label

__all__ = ["ACCUMULATED_KINDS", "LOCAL_KINDS", "ERROR_METRICS", "runs_table", "session_runs",
           "first_nonfinite_by_run", "norm_artefacts", "top_offenders", "diagnosis_cards",
           "error_series", "error_figure", "session_headline"]

# comparison kinds: candidate vs reference run (element-wise, or on summary
# statistics where a dump holds only those), and the op re-computed in fp32
# from the candidate's own inputs
ACCUMULATED_KINDS = ("accumulated", "stats")
LOCAL_KINDS = ("local",)

# metric -> (axis title, log axis, worse is larger)
ERROR_METRICS = {
    "max_rel_err": ("max relative error (|c - r| / max(|r|, floor))", True, True),
    "sqnr_db": ("SQNR (dB, higher is better)", False, False),
    "rounding_units": ("relative RMS error / unit roundoff of the candidate format", True, True),
    "max_abs_err": ("max absolute error", True, True),
}

_VERDICT_RANK = "CASE verdict WHEN 'nonfinite' THEN 0 WHEN 'error' THEN 1 WHEN 'warn' THEN 2 ELSE 3 END"


def session_runs(store, session_id: str) -> list[dict]:
    """The session's runs as dicts, in creation order."""
    return rows(store, "SELECT * FROM runs WHERE session_id = ? ORDER BY created, run_id", [session_id])


def runs_table(store, session_id: str, *, public: bool = True) -> pd.DataFrame:
    """One row per run: kind, dtype, parent and fix, order in words ("order unknown: by name" for a
    dump numbered by name), record counts, source.

    ``public``: sources as a browser may see them (``common.public_source``:
    names relative to the upload, never a server folder).
    """
    df = store.df(
        """SELECT r.name AS run, r.kind, r.dtype, p.name AS parent, r.fix, r."order" AS "order",
                  (SELECT count(*) FROM tensors t WHERE t.run_id = r.run_id) AS records,
                  (SELECT count(*) FROM tensors t WHERE t.run_id = r.run_id AND t.nonfinite) AS nonfinite_records,
                  r.source, r.created, r.run_id
           FROM runs r LEFT JOIN runs p ON p.run_id = r.parent_run_id
           WHERE r.session_id = ? ORDER BY r.created, r.run_id""",
        [session_id],
    )
    if public:
        df["source"] = [public_source(v) for v in df["source"]]
    df["order"] = [order_text(v) if isinstance(v, str) and v else v for v in df["order"]]
    return df


def first_nonfinite_by_run(store, session_id: str) -> list[dict]:
    """For each run: ``{"run": RunInfo dict, "first": services.report.first_nonfinite(...) or None}``."""
    from ..services.report import first_nonfinite

    return [{"run": r, "first": first_nonfinite(store, r["run_id"])} for r in session_runs(store, session_id)]


def norm_artefacts(store, session_id: str) -> list[dict]:
    """Records whose Norm/Mean is non-finite while the values are finite (see services.report)."""
    from ..services.report import norm_artefacts as _na

    return _na(store, session_id)


def top_offenders(store, session_id: str, *, kinds=ACCUMULATED_KINDS, n: int = 10,
                  include_nonfinite: bool = False, run_id: Optional[str] = None) -> pd.DataFrame:
    """The comparisons with the largest error, worst verdict first.

    Ordered by verdict, then by error in units of the candidate format's
    rounding (element-wise comparisons) or by max relative error (summary
    statistics).  Non-finite comparisons are left out unless asked for: the
    first non-finite producer says more than the ops that pass NaN on.
    """
    kinds = tuple(kinds)
    where = ["c.session_id = ?", f"c.kind IN ({', '.join('?' * len(kinds))})", "c.verdict IS NOT NULL"]
    params: list = [session_id, *kinds]
    if not include_nonfinite:
        where.append("c.verdict <> 'nonfinite'")
    if run_id:
        where.append("c.cand_run_id = ?")
        params.append(run_id)
    params.append(int(n))
    return frame(store, 
        f"""SELECT r.name AS run, c.seq, c.op, c.role, c."index", c.kind, c.basis, c.verdict,
                   c.max_abs_err, c.max_rel_err, c.cosine, c.cosine_deficit, c.sqnr_db, c.rounding_units,
                   c.reason, c.cand_run_id AS run_id, c.cand_rid AS rid, c.ref_run_id, c.ref_rid
            FROM comparisons c JOIN runs r ON r.run_id = c.cand_run_id
            WHERE {' AND '.join(where)}
            ORDER BY {_VERDICT_RANK},
                     CASE WHEN isfinite(c.rounding_units) THEN c.rounding_units END DESC NULLS LAST,
                     CASE WHEN isfinite(c.max_rel_err) THEN c.max_rel_err END DESC NULLS LAST,
                     c.seq, c.op
            LIMIT ?""",
        params,
    )


def diagnosis_cards(store, session_id: str) -> list[dict]:
    """Diagnoses as cards: ``run, run_id, op, rule, message, fixes (list), severity, seq``,
    errors first, then by execution order."""
    out = []
    for d in rows(store, """SELECT d.*, r.name AS run FROM diagnoses d LEFT JOIN runs r ON r.run_id = d.run_id
                            WHERE d.session_id = ?
                            ORDER BY CASE d.severity WHEN 'error' THEN 0 WHEN 'warn' THEN 1 ELSE 2 END,
                                     d.seq, d.op""", [session_id]):
        try:
            fixes = json.loads(d["fixes"] or "[]")
        except json.JSONDecodeError:
            fixes = [d["fixes"]]
        out.append({"run": d["run"], "run_id": d["run_id"], "op": d["op"], "rule": d["rule"],
                    "message": d["message"], "fixes": list(fixes), "severity": d["severity"] or "info",
                    "seq": d["seq"]})
    return out


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
                   CASE WHEN bool_or(c.verdict = 'nonfinite') THEN 'nonfinite'
                        WHEN bool_or(c.verdict = 'error') THEN 'error'
                        WHEN bool_or(c.verdict = 'warn') THEN 'warn' ELSE 'expected' END AS verdict,
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


def error_figure(df: pd.DataFrame, metric: str = "max_rel_err", *, first_nonfinite: Optional[list] = None):
    """Plotly figure of ``error_series``: one line per series, non-finite
    comparisons as red crosses along the top, the first non-finite producer
    of each run as a dashed vertical line."""
    import plotly.graph_objects as go

    title, log_y, larger_worse = ERROR_METRICS[metric]
    fig = go.Figure()
    finite = df["value"].dropna()
    if log_y:
        finite = finite[finite > 0]
    if len(finite):
        worst = finite.max() if larger_worse else finite.min()
        flag_y = worst * 10 if log_y and larger_worse else (worst + 10 if larger_worse else worst - 10)
    else:
        flag_y = 1.0
    # names from dumps are shown as typed, never as plotly label markup
    df = df.assign(op=df["op"].map(plot_text), series=df["series"].map(plot_text))
    for series, g in df.groupby("series", sort=False):
        # a log axis has no place for an exact (zero) error: leave a gap
        y = g["value"].where(g["value"] > 0) if log_y else g["value"]
        fig.add_trace(go.Scatter(
            x=g["seq"], y=y, mode="lines+markers", name=str(series), marker={"size": 5},
            customdata=g[["op", "verdict", "run_id", "rid"]].to_numpy(), connectgaps=False,
            hovertemplate="seq %{x}<br>%{customdata[0]}<br>" + metric + " %{y:.4g}<br>%{customdata[1]}<extra></extra>",
        ))
        nf = g[g["verdict"] == "nonfinite"]
        if len(nf):
            fig.add_trace(go.Scatter(
                x=nf["seq"], y=[flag_y] * len(nf), mode="markers", name=f"{series}: NaN/Inf introduced",
                marker={"symbol": "x", "size": 8, "color": "#dc2626"},
                customdata=nf[["op", "verdict", "run_id", "rid"]].to_numpy(),
                hovertemplate="seq %{x}<br>%{customdata[0]}<br>NaN/Inf introduced<extra></extra>",
            ))
    for item in first_nonfinite or []:
        if item:
            fig.add_vline(x=item["seq"], line_dash="dash", line_color="#dc2626", opacity=0.8,
                          annotation_text=f"first NaN/Inf: {plot_text(item['op'])}", annotation_position="top left")
    fig.update_layout(
        xaxis_title="execution order (seq)", yaxis_title=title, legend_title_text="run",
        margin={"l": 10, "r": 10, "t": 30, "b": 10}, height=380, hovermode="closest",
    )
    if log_y:
        fig.update_yaxes(type="log", dtick=1, exponentformat="power")
    return fig


def session_headline(store, session_id: str) -> dict:
    """One line per session for the Sessions list: first non-finite op and worst op."""
    firsts = []
    for item in first_nonfinite_by_run(store, session_id):
        f = item["first"]
        if f is not None:
            firsts.append(f"{item['run']['name']}: {f['op']}")
    worst = top_offenders(store, session_id, n=1)
    worst_text = ""
    if len(worst):
        w = worst.iloc[0]
        worst_text = f"{w['run']}: {w['op']} ({w['role']} {w['index']}, {w['verdict']}, max rel err {num_text(w['max_rel_err'], 3)})"
    return {"first_nonfinite": "; ".join(firsts) or "none", "worst": worst_text or "-"}


def run_options(store, session_id: str) -> list[dict]:
    """Runs with a display label, for pickers."""
    return [{**r, "label": run_label(r)} for r in session_runs(store, session_id)]
