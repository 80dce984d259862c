"""View-models of the Timeline page: a long run's heatmap of ops x steps, the series of chosen ops, the alerts,
and the model as a tree.  Figures are plotly; the numbers come from ``services.timeline``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import pandas as pd

from ..alerts import ALERT_RULES, Alert
from ..formats import get_format
from ..records import tensor_name
from ..services import timeline as svc
from ..services.tree import ROOT, ModuleNode, tree_modules_of
from ..store.rows import RankStepCell, StepRow, TimelineOp, TimelineRun
from ..store.timeline import first_nonfinite_step, rank_step_cells, step_rows, timeline_runs
from .common import Choices, plot_text

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["LongRuns", "RunSteps", "METRICS", "series_label", "heatmap_figure", "series_figure", "tree_figure", "alerts_frame",
           "steps_frame", "step_figure", "rank_step_figure", "rules_frame", "cell_target", "default_ops",
           "op_series_by_label", "tree_modules", "long_runs_by_name", "run_steps", "ranks_figure"]

METRICS = {"headroom": "headroom (bits below the format's max)",
           "low": "low end (share rounding to zero or a subnormal)"}


@dataclass(frozen=True, slots=True)
class LongRuns:
    """The session's runs with a timeline (``store.timeline.timeline_runs`` rows), picked by name: the Timeline
    page's run picker."""

    runs: tuple[TimelineRun, ...]

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.runs]

    def run(self, name: str) -> TimelineRun:
        """The run named ``name``."""
        return next(r for r in self.runs if r.name == name)

    def label(self, name: str) -> str:
        """How the picker shows a run: its name, steps and ops."""
        r = self.run(name)
        return f"{name} ({r.steps} steps, {r.ops} ops)"


def long_runs_by_name(store, session_id: str) -> LongRuns:
    """The session's runs with a timeline, by name."""
    return LongRuns(tuple(timeline_runs(store, session_id)))


@dataclass(frozen=True, slots=True)
class RunSteps:
    """A long run's headline numbers: its first non-finite step (None: every step finite), its alerts
    (``services.timeline.run_alerts``) and one row per step (``store.timeline.step_rows``: loss, gradient norm,
    NaN/Inf counts)."""

    first_nonfinite_step: Optional[int]
    alerts: list[Alert]
    steps: list[StepRow]


def run_steps(store, run_id: str) -> RunSteps:
    """The Timeline page's headline numbers of a long run."""
    return RunSteps(first_nonfinite_step(store, run_id), svc.run_alerts(store, run_id), step_rows(store, run_id))


def ranks_figure(store, run_id: str, first: Optional[int]) -> Optional[go.Figure]:
    """``rank_step_figure`` of a run's ranks x steps cells (``store.timeline.rank_step_cells``); None for a run of
    one rank."""
    return rank_step_figure(rank_step_cells(store, run_id), first)


def series_label(op: str, role: str, index: str) -> str:
    """An op's output is named by the op; any other series by its tensor name."""
    return op if (role, str(index)) == ("output", "0") else tensor_name(op, role, index)


def _heatmap_grid(hm: svc.TimelineHeatmap) -> tuple[dict, list[int], np.ndarray]:
    """The heatmap's row of each series (op, role, index), its bucket starts ascending, and its values as a
    rows x buckets array (NaN where a cell has no finite value)."""
    row_of = {(o.op, o.role, str(o.index)): i for i, o in enumerate(hm.ops)}
    buckets = sorted({c.bucket for c in hm.cells})
    col_of = {b: j for j, b in enumerate(buckets)}
    z = np.full((len(hm.ops), len(buckets)), np.nan)
    for c in hm.cells:
        i = row_of.get((c.op, c.role, str(c.index)))
        v = c.value
        if i is not None and v is not None and math.isfinite(v):
            z[i, col_of[c.bucket]] = v
    return row_of, buckets, z


def _cell_points(z: np.ndarray, xs: np.ndarray, names: np.ndarray, width: int, title: str) -> go.Scatter:
    """One invisible point per heatmap cell with a value, carrying its hover text and what a click opens:
    Streamlit reports clicks on scatter points only (not on heatmap cells); WebGL draws them when there are
    many."""
    import plotly.graph_objects as go

    ii, jj = np.nonzero(np.isfinite(z))
    step_text = "step %{x}" if width == 1 else f"steps %{{x}}-+{width - 1}"
    many = len(ii) > 5000  # then WebGL, and no per-point names (the row's label is beside it)
    return (go.Scattergl if many else go.Scatter)(
        x=xs[jj].astype(np.int32), y=ii.astype(np.int32), mode="markers", name="cell",
        text=None if many or not len(ii) else names[ii],
        customdata=np.stack([ii, xs[jj], z[ii, jj]], axis=1).astype(np.float32) if len(ii) else None,
        marker={"symbol": "square", "size": 14, "opacity": 0},
        hovertemplate=("" if many else "%{text}<br>") + f"{step_text}<br>{title}: %{{customdata[2]:.3g}}"
                      "<extra></extra>")


def _alert_points(alerts: Sequence, row_of: dict, lo: int, width: int) -> Optional[go.Scatter]:
    """The alerts on the heatmap's rows, each at the bucket of its step (None without any)."""
    import plotly.graph_objects as go

    pts = [(a.step, a.rule, row_of.get(_alert_key(a))) for a in alerts if a.op is not None]
    pts = [(st, rule, i) for st, rule, i in pts if i is not None]
    if not pts:
        return None
    at = [lo + width * ((st - lo) // width) for st, _, _ in pts]
    return go.Scatter(x=at, y=[i for _, _, i in pts], mode="markers", name="alert", text=[r for _, r, _ in pts],
                      customdata=[[i, b, float("nan")] for (_, _, i), b in zip(pts, at)],
                      marker={"symbol": "x", "size": 10, "color": "black"},
                      hovertemplate="%{text} alert at step %{x}<extra></extra>")


def heatmap_figure(hm: svc.TimelineHeatmap, *, metric: str, fmt: str, first_nonfinite: Optional[int] = None,
                   alerts: Sequence = ()) -> go.Figure:
    """Ops (rows, execution order) x step buckets (columns); red is little headroom / much underflow.

    Rows are numbered (labelled with the op), so every array is numeric and travels compactly; a click on a
    cell reports ``customdata`` = (row, bucket start, value), which ``cell_target`` turns into (op, step).
    """
    import plotly.graph_objects as go

    labels = [series_label(o.op, o.role, o.index) for o in hm.ops]
    row_of, buckets, z = _heatmap_grid(hm)
    if metric == "headroom":
        finite = z[np.isfinite(z)]
        scale, zmax, title = "RdYlGn", max(8.0, float(finite.max()) if finite.size else 8.0), \
            f"bits below {fmt}'s max"
    else:
        scale, zmax, title = "RdYlGn_r", 1.0, f"share low in {fmt}"
    rows = np.arange(len(hm.ops))
    xs = np.asarray(buckets, dtype=np.int64)
    fig = go.Figure(go.Heatmap(z=z.astype(np.float32), x=xs, y=rows, colorscale=scale, zmin=0, zmax=zmax,
                               colorbar={"title": {"text": title}}, hoverongaps=False, hoverinfo="skip"))
    names = np.asarray([plot_text(x) for x in labels], dtype=object)
    fig.add_trace(_cell_points(z, xs, names, hm.width, title))
    if first_nonfinite is not None:
        fig.add_vline(x=first_nonfinite, line={"color": "crimson", "dash": "dash"},
                      annotation_text=f"first non-finite (step {first_nonfinite})", annotation_position="top")
    marks = _alert_points(alerts, row_of, buckets[0] if buckets else 0, hm.width)
    if marks is not None:
        fig.add_trace(marks)
    fig.update_layout(height=max(260, 22 * len(labels) + 120), margin={"l": 10, "r": 10, "t": 40, "b": 40},
                      xaxis_title="step", showlegend=False,
                      yaxis={"autorange": "reversed", "tickvals": list(rows), "ticktext": list(names),
                             "showgrid": False, "zeroline": False})
    return fig


def _alert_key(a) -> tuple:
    # the heatmap's rows are forward outputs; an alert on a gradient names its op's backward, never a row
    return a.op, "output", "0"


def cell_target(point: dict, ops: list[TimelineOp]) -> Optional[tuple[str, int]]:
    """(op, step) a clicked heatmap cell or alert stands for (``ops``: the heatmap's rows), or None."""
    cd = point.get("customdata")
    if isinstance(cd, dict):  # a typed array's row arrives from the browser as {"0": ..., "1": ...}
        cd = [cd.get(str(k), cd.get(k)) for k in range(len(cd))]
    try:
        row, step = int(cd[0]), int(cd[1])
    except (TypeError, ValueError, IndexError):
        return None
    return (ops[row].op, step) if 0 <= row < len(ops) else None


def default_ops(hm: svc.TimelineHeatmap, alerts: Sequence, limit: int = 3) -> list[str]:
    """Series labels to plot first: the ops with alerts, else the ones with the least headroom."""
    labels = [series_label(o.op, o.role, o.index) for o in hm.ops]
    chosen = []
    for a in alerts:
        if a.op is not None:
            lab = series_label(*_alert_key(a))
            if lab in labels and lab not in chosen:
                chosen.append(lab)
    if not chosen:
        worst: dict = {}
        for c in hm.cells:
            lab = series_label(c.op, c.role, c.index)
            v = c.value
            if v is not None and math.isfinite(v):
                worst[lab] = min(worst.get(lab, math.inf), v)
        chosen = sorted(worst, key=worst.get)
    return chosen[:limit]


def series_figure(series: list[svc.OpSeries], *, fmt: str, first_nonfinite: Optional[int] = None,
                  alerts: Sequence = ()) -> go.Figure:
    """log2 |x| max of each chosen op against the step, with the format's max and the alerts' steps."""
    import plotly.graph_objects as go

    f = get_format(fmt)
    fig = go.Figure()
    for one in series:
        pts = one.points
        xs = [p.step for p in pts]
        ys = [math.log2(p.absmax) if p.absmax and p.absmax > 0 and math.isfinite(p.absmax) else None for p in pts]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=plot_text(one.label),
                                 hovertemplate="step %{x}: log2 |x| max %{y:.2f}<extra></extra>"))
        bad = [p.step for p in pts if (p.nan_count or 0) + (p.inf_count or 0) > 0]
        if bad:
            fig.add_trace(go.Scatter(x=bad, y=[math.log2(f.max)] * len(bad), mode="markers", showlegend=False,
                                     marker={"symbol": "x", "color": "crimson", "size": 9},
                                     hovertemplate="step %{x}: NaN/Inf<extra></extra>"))
    fig.add_hline(y=math.log2(f.max), line={"color": "crimson", "dash": "dot"},
                  annotation_text=f"{f.name} max", annotation_position="bottom right")
    fig.add_hline(y=math.log2(f.smallest_normal), line={"color": "grey", "dash": "dot"},
                  annotation_text=f"{f.name} smallest normal", annotation_position="top right")
    if first_nonfinite is not None:
        fig.add_vline(x=first_nonfinite, line={"color": "crimson", "dash": "dash"})
    shown = {one.label for one in series}
    for a in alerts:
        if a.op is not None and series_label(*_alert_key(a)) in shown:
            fig.add_vline(x=a.step, line={"color": "orange", "width": 1})
    fig.update_layout(height=360, margin={"l": 10, "r": 10, "t": 30, "b": 40}, xaxis_title="step",
                      yaxis_title="log2 |x| max", legend={"orientation": "h"})
    return fig


def tree_figure(nodes: list[ModuleNode]) -> go.Figure:
    """The module hierarchy as an icicle, coloured by worst headroom; the path to the first failure outlined."""
    import plotly.graph_objects as go

    heads = [n.headroom for n in nodes]
    finite = [h for h in heads if h is not None]
    top = max(8.0, max(finite, default=8.0))
    colors = [h if h is not None else top for h in heads]
    line_w = [3 if n.on_path else 0.5 for n in nodes]
    line_c = ["crimson" if n.on_path else "white" for n in nodes]
    text = [("NaN/Inf · " if n.nonfinite else "") + (f"{n.headroom:.1f} bits" if n.headroom is not None
                                                     else "-") for n in nodes]
    fig = go.Figure(go.Icicle(
        ids=[plot_text(n.id) for n in nodes], labels=[plot_text(n.label) for n in nodes],
        parents=[plot_text(n.parent) for n in nodes], text=text,
        marker={"colors": colors, "colorscale": "RdYlGn", "cmin": 0, "cmax": top,
                "line": {"width": line_w, "color": line_c}, "colorbar": {"title": {"text": "worst headroom (bits)"}}},
        texttemplate="%{label}<br>%{text}", hovertemplate="%{id}<br>%{text}<extra></extra>", branchvalues="remainder",
        tiling={"orientation": "v"}))
    fig.update_layout(height=420, margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


def tree_modules(nodes: list[ModuleNode]) -> Choices:
    """The tree's modules as a picker offers them, by the op each opens: the path to the first failure first,
    then by worst headroom."""
    return Choices.of((n.op, f"{n.id if n.parent else ROOT}  ({'NaN/Inf, ' if n.nonfinite else ''}"
                             f"{'-' if n.headroom is None else format(n.headroom, '.1f')} bits)")
                      for n in tree_modules_of(nodes))


def alerts_frame(alerts: Sequence) -> pd.DataFrame:
    return pd.DataFrame([{"step": a.step, "rule": a.rule, "op": a.op or "(whole step)", "message": a.message,
                          "steps firing": a.steps_firing} for a in alerts],
                        columns=["step", "rule", "op", "message", "steps firing"])


def step_figure(steps: list[StepRow], first: Optional[int]) -> go.Figure:
    """Loss, gradient norm (with a GradScaler given to the capture: unscaled) and non-finite values per step
    (log y), the first non-finite step marked: the Timeline page's curves and the HTML report's."""
    import plotly.graph_objects as go

    fig = go.Figure()
    x = [r.step for r in steps]
    for key, label in (("loss", "loss"), ("grad_norm", "gradient norm"), ("nonfinite_values", "NaN/Inf values")):
        vals = [getattr(r, key) for r in steps]
        y = [None if v is None or (isinstance(v, float) and math.isnan(v)) else abs(v) for v in vals]
        if any(v is not None for v in y):
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=label,
                                     hovertemplate=f"step %{{x}}<br>{label} %{{y:.4g}}<extra></extra>"))
    if first is not None:
        fig.add_vline(x=first, line_color="#dc2626", line_dash="dash",
                      annotation_text=f"first non-finite value: step {first}", annotation_position="top left")
    fig.update_layout(height=340, margin={"l": 60, "r": 20, "t": 40, "b": 50}, xaxis_title="step",
                      yaxis={"type": "log", "title": "|value|"}, legend={"orientation": "h", "y": -0.25})
    return fig


def rank_step_figure(cells: list[RankStepCell], first: Optional[int]) -> Optional[go.Figure]:
    """A distributed run's ranks x steps: each cell the unexpected NaN/Inf values that rank's summaries counted at
    that step (white where none; GradScaler-skipped steps outlined), the first non-finite step marked; None for a
    run of one rank."""
    import plotly.graph_objects as go

    ranks = sorted({int(c.rank) for c in cells})
    steps = sorted({int(c.step) for c in cells})
    if len(ranks) < 2:
        return None
    at = {(int(c.rank), int(c.step)): c for c in cells}
    nonfinite = {k: c.nonfinite or 0 for k, c in at.items()}
    z = [[nonfinite.get((r, s), 0) for s in steps] for r in ranks]
    text = [[f"rank {r}, step {s}: {int(nonfinite.get((r, s), 0))} unexpected NaN/Inf values"
             + (" (GradScaler skipped it)" if (r, s) in at and at[r, s].skipped else "") for s in steps]
            for r in ranks]
    fig = go.Figure(go.Heatmap(x=steps, y=[f"rank {r}" for r in ranks], z=[[math.log10(1 + v) for v in row]
                                                                            for row in z],
                               text=text, hovertemplate="%{text}<extra></extra>", zmin=0,
                               colorscale=[[0, "#ffffff"], [1e-9, "#fecaca"], [1, "#991b1b"]],
                               colorbar={"title": "log10(1+n)"}))
    if first is not None:
        fig.add_vline(x=first, line_color="#dc2626", line_dash="dash",
                      annotation_text=f"first non-finite value: step {first}", annotation_position="top left")
    fig.update_layout(height=max(200, 40 + 28 * len(ranks)), margin={"l": 70, "r": 20, "t": 40, "b": 40},
                      xaxis_title="step")
    return fig


def steps_frame(steps: list[StepRow]) -> pd.DataFrame:
    return pd.DataFrame([dataclasses.asdict(s) for s in steps],
                        columns=["step", "loss", "loss_scale", "grad_norm", "nonfinite_values", "tensors"])


def rules_frame() -> pd.DataFrame:
    """The alert rules and their thresholds, as the page lists them."""
    return pd.DataFrame([{"rule": r.name, "fires when": r.what.format(**r.params),
                          "applies to": "each op" if r.scope == "op" else "each step"} for r in ALERT_RULES])


def op_series_by_label(store, run_id: str, labels: Sequence[str], ops: list[TimelineOp],
                       fmt: str) -> list[svc.OpSeries]:
    """The series of the chosen labels (``ops``: the heatmap's rows), in the order chosen."""
    by_label = {series_label(o.op, o.role, o.index): o for o in ops}
    return [svc.OpSeries(lab, svc.op_series(store, run_id, by_label[lab].op, by_label[lab].role,
                                            str(by_label[lab].index), fmt=fmt))
            for lab in dict.fromkeys(labels) if lab in by_label]
