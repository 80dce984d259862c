"""Overview of one session: runs, first non-finite producers, top offenders,
diagnosis cards, and error against execution order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import pandas as pd

from ..services.origins import RankState, first_nonfinite, nonfinite_origin, rank_spread
from ..services.report import order_notes, order_text
from ..services import timeline as _timeline
from ..services.tree import ModuleNode, run_tree
from ..store import timeline as tl
from ..store import views
from ..store.queries import op_output_rid, session_runs
from ..store.views import ACCUMULATED_KINDS, ERROR_METRICS, LOCAL_KINDS, error_series, top_offenders
from ..public import public_source
from ..records import OUTPUT_ROLES, RunInfo
from ..display import num_text
from .common import plot_text, text_columns
from ..metrics import ELEMENTWISE, relative_error
from ..origin import Intended, Origin

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["LongRun", "RunOrigin", "ModelTree", "ModuleLink", "long_runs", "model_tree", "module_link", "runs_table", "first_nonfinite_by_run",
           "error_figure", "error_along_run", "default_error_metric", "worst_error_text", "session_headline",
           "warnings_table", "order_caveat", "offenders_table", "MAX_WARNINGS", "ERROR_METRIC_LABELS"]

# the errors the Overview draws along the run (the read model's ERROR_METRICS, in its order), as its picker names them
ERROR_METRIC_LABELS = {m: {"max_rel_err": "max rel error", "sqnr_db": "SQNR dB", "rounding_units": "error / roundoff",
                           "max_abs_err": "max abs error", "summary_rel_err": "summary rel error (statistics only)"}[m]
                       for m in ERROR_METRICS}


def runs_table(store, session_id: str, *, public: bool = True) -> pd.DataFrame:
    """One row per run: kind, dtype, parent and fix, order in words ("order unknown: by name" for a
    dump numbered by name) and ``order_used`` (where the order came from and which parts are certain, as
    ingest said), record counts, source.

    ``public``: sources as a browser may see them (``common.public_source``:
    names relative to the upload, never a server folder).
    """
    df = views.runs_table(store, session_id)
    if public:
        df["source"] = [public_source(v) for v in df["source"]]
    df["order"] = [order_text(v) if isinstance(v, str) and v else v for v in df["order"]]
    notes = order_notes(store, session_id)
    df["order_used"] = [notes.get(r, "") for r in df["run_id"]]
    return df


MAX_WARNINGS = 200  # shown on the Overview; the HTML report and `report --json` carry them too


def warnings_table(store, session_id: str) -> pd.DataFrame:
    """The session's warnings (from reading its dumps or capturing it): run, file as a browser may see it,
    message; at most ``MAX_WARNINGS`` rows."""
    rows = views.session_warnings(store, session_id, limit=MAX_WARNINGS)
    return pd.DataFrame([{"run": r.run or "", "file": public_source(r.file), "message": r.message}
                         for r in rows], columns=["run", "file", "message"])


def order_caveat(store, session_id: str) -> Optional[str]:
    """A sentence when some run's order is unknown (numbered by name): the order it used and which parts are
    certain, as ingest recorded (``order_notes``), else None."""
    unknown = [r for r in session_runs(store, session_id) if (r.order or "") == "name"]
    if not unknown:
        return None
    notes = order_notes(store, session_id)
    said = "; ".join(f"{r.name}: {notes.get(r.run_id) or order_text('name')}" for r in unknown)
    return (f"Order used for {said}. 'First' means first in that order: where it is not certain, an op placed "
            "later may have run earlier.")


@dataclass(frozen=True, slots=True)
class RunOrigin:
    """Where a run first went non-finite: the run , its first unexpected non-finite
    origin (None: none), the ops that wrote -inf that is no error by itself (masks, shown quietly), and with
    several ranks which made their own NaN/Inf and which received it (``services.report.rank_spread``)."""

    run: RunInfo
    first: Optional[Origin]
    intended: list[Intended]
    ranks: list[RankState]


def first_nonfinite_by_run(store, session_id: str) -> list[RunOrigin]:
    """Each run's first non-finite origin, in the session's order of runs."""
    out = []
    for r in session_runs(store, session_id):
        first, intended = nonfinite_origin(store, r.run_id)  # one pass gives both
        out.append(RunOrigin(r, first, intended, rank_spread(store, r.run_id, first)))
    return out


def default_error_metric(store, session_id: str) -> str:
    """The error to draw first: ``max_rel_err``, or ``summary_rel_err`` for a session whose comparisons are all
    on summary statistics (it has no element-wise error to draw)."""
    return "summary_rel_err" if views.comparison_bases(store, session_id) == {"stats"} else "max_rel_err"


def offenders_table(store, session_id: str, *, local: bool = False, n: int = 10) -> pd.DataFrame:
    """The Overview's Top offenders (``store.views.top_offenders``): the comparisons against the reference, or with
    ``local`` the local ones (each op re-run in fp32), in the columns shown, errors as text; a comparison on summary
    statistics has no element-wise error, so the summaries' relative error gets a column of its own when one is
    there.  ``rid`` comes last, to open a selected row."""
    df = top_offenders(store, session_id, kinds=LOCAL_KINDS if local else ACCUMULATED_KINDS, n=n)
    if df.empty:
        return df
    rel = ["max_rel_err"] + (["summary_rel_err"] if (df["basis"] == "stats").any() else [])
    shown = df[["run", "seq", "op", "role", "index", "verdict", *rel, "sqnr_db", "rounding_units", "reason", "rid"]]
    return text_columns(shown, (*rel, "sqnr_db", "rounding_units"), 4)


def worst_error_text(row) -> str:
    """A comparison's relative error in words: element-wise ("max rel err"), or for one on summary statistics
    the summaries' ("summary rel err"); ``row`` as ``top_offenders`` gives it."""
    err, how = relative_error(row.get("max_rel_err"), row.get("summary_rel_err"))
    return f"{'max' if how == ELEMENTWISE else 'summary'} rel err {num_text(err, 3)}"


def error_along_run(store, session_id: str, metric: str, *, outputs_only: bool = True
                    ) -> tuple[pd.DataFrame, Optional[str]]:
    """``(series, note)`` of the Overview's error plot: ``store.views.error_series`` of ``metric`` over the outputs
    (``records.OUTPUT_ROLES``) or, without ``outputs_only``, every role; ``note`` says why an element-wise error
    has nothing to draw in a session of summary statistics only (None otherwise)."""
    series = error_series(store, session_id, metric, roles=OUTPUT_ROLES if outputs_only else ())
    stats_only = not series.empty and series["value"].isna().all() and metric != "summary_rel_err" \
        and default_error_metric(store, session_id) == "summary_rel_err"
    return series, ("This error needs element-wise data; this session holds summary statistics only. "
                    "Choose summary rel error: how far each record's max, min and norm moved." if stats_only else None)


def error_figure(df: pd.DataFrame, metric: str = "max_rel_err", *, first_nonfinite: Optional[list] = None
                 ) -> go.Figure:
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
            fig.add_vline(x=item.seq, line_dash="dash", line_color="#dc2626", opacity=0.8,
                          annotation_text=f"first NaN/Inf: {plot_text(item.op)}", annotation_position="top left")
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
    for run in session_runs(store, session_id):
        f = first_nonfinite(store, run.run_id)
        if f is not None:
            firsts.append(f"{run.name}: {f.op}")
    worst = top_offenders(store, session_id, n=1)
    worst_text = ""
    if len(worst):
        w = worst.iloc[0]
        worst_text = f"{w['run']}: {w['op']} ({w['role']} {w['index']}, {w['verdict']}, {worst_error_text(w)})"
    return {"first_nonfinite": "; ".join(firsts) or "none", "worst": worst_text or "-"}


@dataclass(frozen=True, slots=True)
class LongRun:
    """A run with a timeline as the Overview and the HTML report show it: its name, how many steps, its first
    non-finite step (None: every step finite) and its alerts as a table (step, rule, message)."""

    run: str
    steps: int
    first_nonfinite_step: Optional[int]
    alerts: pd.DataFrame


def long_runs(store, session_id: str) -> list[LongRun]:
    """The session's runs with a timeline, each with its alerts."""
    out = []
    for r in tl.timeline_runs(store, session_id):
        alerts = _timeline.run_alerts(store, r.run_id)
        table = pd.DataFrame([{"step": a.step, "rule": a.rule, "message": a.message} for a in alerts],
                             columns=["step", "rule", "message"])
        out.append(LongRun(r.name, r.steps, tl.first_nonfinite_step(store, r.run_id), table))
    return out


@dataclass(frozen=True, slots=True)
class ModelTree:
    """The run drawn as a tree  and its modules' nodes."""

    run: RunInfo
    nodes: list[ModuleNode]


def model_tree(store, firsts: list[RunOrigin]) -> Optional[ModelTree]:
    """The run to draw as a tree: the first run with a non-finite producer, else the first candidate; None for a
    session with no run."""
    pick = next((f for f in firsts if f.first is not None), None) or next(
        (f for f in firsts if f.run.kind != "reference"), None) or (firsts[0] if firsts else None)
    if pick is None:
        return None
    first = pick.first
    return ModelTree(pick.run, run_tree(store, pick.run.run_id, failing_op=first.op if first else None,
                                        failing_parent=first.parent if first else None))


@dataclass(frozen=True, slots=True)
class ModuleLink:
    """Where "Open on Op detail" of the model tree goes: the run's name and the record id of the module's
    output (``page.navigate``'s ``run`` and ``op``)."""

    run: str
    op: int


def module_link(store, run: RunInfo, module: str) -> Optional[ModuleLink]:
    """The link of ``module`` of ``run`` ; None when the module recorded no output."""
    rid = op_output_rid(store, run.run_id, module)
    return None if rid is None else ModuleLink(run.name, rid)
