"""Op detail: one record's magnitude histogram against number formats, the
exact per-format counts, the summary-only overlay, and its comparisons.

Every count shown comes from ``TensorStats.representability`` (exact sums over
the stored histogram) and every limit from ``precision_lab.formats``; this
module only arranges them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from ..formats import FORMATS, Format, format_for_dtype, get_format
from ..store import views
from ..store.rows import Counterpart, RecordChoice, RecordOfRun
from ..store.timeline import full_steps
from ..store.views import counterparts, find_records, has_record, record
from ..display import MISSING, num_text
from .common import Choices, cosine_text, plot_text
from ..stats import HIST_EDGES, TensorStats

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["op_label", "op_choices", "step_choices", "record_named", "op_record", "load_stats", "default_formats",
           "binade_counts", "histogram_figure", "representability_table", "what_if_table", "headroom_table",
           "headroom_tables", "shown_absmax",
           "summary_values_table", "summary_figure", "metrics_table", "stats_table", "value_region",
           "WHAT_IF_FORMATS", "FORMAT_COLORS"]

# Formats the "what if" view lists: every registered format but fp32, which
# is the reference itself.
WHAT_IF_FORMATS = tuple(n for n in FORMATS if n != "fp32")

# One colour per overlaid format (lines, labels); chosen to read on white
# and on Streamlit's dark background.
FORMAT_COLORS = ("#2563eb", "#d97706", "#9333ea", "#0f766e", "#92400e", "#475569")
# Region shading: overflow, subnormal, underflow-to-zero.
REGION_COLORS = {"overflow": "rgba(220, 38, 38, {a})", "subnormal": "rgba(234, 179, 8, {a})",
                 "underflow": "rgba(100, 116, 139, {a})"}
# Data series (this record, its reference/candidates): distinct from the format colours.
SERIES_COLORS = ("#06b6d4", "#84cc16", "#f472b6", "#a3a3a3")


def op_label(rec: RecordChoice, *, steps: bool) -> str:
    """An op picker's entry: its name and seq, with its step when the run has several (the same op is listed once
    per step)."""
    return f"{rec.name}  (" + (f"step {rec.step}, " if steps else "") + f"seq {rec.seq})"


def load_stats(store, run_id: str, rid: int) -> Optional[TensorStats]:
    """The record's ``TensorStats`` with its histogram (None for summary-only records)."""
    return store.record_stats(run_id, int(rid))


def op_choices(store, run_id: str, text: str = "", *, step: Optional[int] = None, include_rid: Optional[int] = None,
               steps: bool = False) -> Choices:
    """The op picker's entries, record ids labelled by ``op_label``: the run's records whose name contains ``text`` (or matches it
    as a glob), of ``step`` when given, ``include_rid`` always among them (``store.views.find_records``); ``steps``:
    the run has several steps, so each entry names its own."""
    return Choices.of((r.rid, op_label(r, steps=steps))
                      for r in find_records(store, run_id, text, step=step, include_rid=include_rid))


def step_choices(store, run_id: str) -> list[int]:
    """What the step picker offers: the run's steps with full records (``store.timeline.full_steps``) when there
    are several; none for a run of one step, which has no step to choose."""
    steps = full_steps(store, run_id)
    return steps if len(steps) > 1 else []


def record_named(store, run_id: str, rid) -> Optional[RecordOfRun]:
    """The record (``store.views.record``) that ``rid`` names in the run, a record id or its text from a link or
    a picker; None when it names none (``store.views.has_record``)."""
    return record(store, run_id, int(str(rid).strip())) if has_record(store, run_id, rid) else None


def op_record(store, run_id: str, rid: int) -> tuple[RecordOfRun, Optional[TensorStats], list[Counterpart]]:
    """``(record, stats, counterparts)`` of the op the page shows: the stored record (``store.views.record``), its
    ``load_stats`` and the records it was compared with (``store.views.counterparts``)."""
    return record(store, run_id, rid), load_stats(store, run_id, rid), counterparts(store, run_id, rid)


def default_formats(dtype: Optional[str]) -> list[str]:
    """Formats to overlay first: the record's own low-precision format, or
    for an fp32 (or wider) record the usual targets."""
    fmt = format_for_dtype(dtype) if dtype else None
    if fmt is not None and fmt.name != "fp32":
        return [fmt.name]
    return ["fp16", "bf16", "fp8_e4m3fn"]


# ---- histogram ----------------------------------------------------------------

def _bin_exponents() -> np.ndarray:
    """For each histogram bin, the binade it lies in: e with 2^e <= lo < 2^(e+1).

    Every power of two is a bin edge, so no bin straddles two binades.  The
    first bin [0, 2^-150) is drawn as binade -151, the last [2^128, inf) as 128.
    """

    lo = HIST_EDGES[:-1]
    exps = np.empty(len(lo), dtype=np.int64)
    for i, v in enumerate(lo):
        exps[i] = math.frexp(v)[1] - 1 if v > 0 else math.frexp(float(HIST_EDGES[1]))[1] - 2
    return exps


_BIN_EXP: Optional[np.ndarray] = None


def binade_counts(hist: np.ndarray) -> pd.DataFrame:
    """Histogram counts summed per binade: columns ``exp`` (e), ``count`` for
    2^e <= |x| < 2^(e+1), nonzero finite values only, empty binades dropped."""
    global _BIN_EXP
    if _BIN_EXP is None:
        _BIN_EXP = _bin_exponents()
    h = np.asarray(hist, dtype=np.int64)
    if h.sum() == 0:
        return pd.DataFrame({"exp": pd.Series([], dtype="int64"), "count": pd.Series([], dtype="int64")})
    lo = int(_BIN_EXP.min())
    counts = np.bincount(_BIN_EXP - lo, weights=h).astype(np.int64)
    idx = np.flatnonzero(counts)
    return pd.DataFrame({"exp": idx + lo, "count": counts[idx]})


def _log2(v: float) -> float:
    return math.log2(v)


def _format_overlays(fig, formats: Sequence[str], x_range: tuple[float, float], *, shade: bool = True) -> None:
    """Shaded overflow / subnormal / underflow regions and lines at max,
    smallest normal and smallest subnormal for each format."""
    import plotly.graph_objects as go

    alpha = 0.16 if len(formats) <= 1 else 0.10
    lo_x, hi_x = x_range
    off = {"left": 0, "right": 0}  # limits named at an edge so far, to stack their labels
    for k, name in enumerate(formats):
        fmt = get_format(name)
        color = FORMAT_COLORS[k % len(FORMAT_COLORS)]
        if shade:
            regions = [("overflow", _log2(fmt.overflow_threshold), hi_x)]
            if fmt.underflow_threshold > 0:
                regions.append(("underflow", lo_x, _log2(fmt.underflow_threshold)))
                if fmt.normal_threshold > fmt.underflow_threshold:
                    regions.append(("subnormal", _log2(fmt.underflow_threshold), _log2(fmt.normal_threshold)))
            for region, x0, x1 in regions:
                if x1 > x0:
                    fig.add_vrect(x0=x0, x1=x1, fillcolor=REGION_COLORS[region].format(a=alpha), line_width=0,
                                  layer="below")
        lines = [("max", fmt.max, "solid"), ("smallest normal", fmt.smallest_normal, "dash")]
        if fmt.smallest_subnormal is not None:
            lines.append(("smallest subnormal", fmt.smallest_subnormal, "dot"))
        for label, v, dash in lines:
            x = _log2(v)
            if not lo_x <= x <= hi_x:  # off the axis: named at its edge, with its value
                side = "right" if x > hi_x else "left"
                fig.add_annotation(x=hi_x if side == "right" else lo_x, xanchor=side, y=0.98 - 0.06 * off[side],
                                   yref="paper", showarrow=False, font={"color": color, "size": 11},
                                   text=(f"{fmt.name} {label} 2^{x:.0f} \u2192" if side == "right"
                                         else f"\u2190 {fmt.name} {label} 2^{x:.0f}"))
                off[side] += 1
                continue
            fig.add_vline(x=x, line_color=color, line_dash=dash, line_width=1.5)
            fig.add_trace(go.Scatter(
                x=[x], y=[0], mode="markers", marker={"opacity": 0, "color": color}, showlegend=False,
                hovertemplate=f"{fmt.name} {label}: {v:.6g} (2^{x:.3f})<extra></extra>",
                yaxis="y2",
            ))
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line={"color": color},
                                 name=f"{fmt.name}: max / normal / subnormal (solid / dash / dot)"))
    if formats and shade:
        for region, label in (("overflow", "overflow (cast gives inf/NaN or clamps)"),
                              ("subnormal", "subnormal (reduced precision)"),
                              ("underflow", "underflows to zero")):
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                     marker={"symbol": "square", "size": 12,
                                             "color": REGION_COLORS[region].format(a=0.45)}))


# how far below / above the data a format's limits still widen the axis
_LOW_REACH = 24.0
_HIGH_REACH = 24.0


def _x_range(exps: Iterable[float], formats: Sequence[str]) -> tuple[float, float]:
    """The data's binades, each format's max when it lies within ``_HIGH_REACH``
    binades above the data (overflow is the usual question), and its smallest
    normal/subnormal when they lie within ``_LOW_REACH`` binades below it
    (bf16's 2^128 or 2^-133 would squeeze the plot into a line; a limit off
    the axis is named at its edge, and zooming out still shows it)."""
    data = [float(e) for e in exps]
    pts = list(data)
    for name in formats:
        fmt = get_format(name)
        if not data or _log2(fmt.max) <= max(data) + _HIGH_REACH:
            pts.append(_log2(fmt.max))
        for v in (fmt.smallest_normal, fmt.smallest_positive):
            if not data or _log2(v) >= min(data) - _LOW_REACH:
                pts.append(_log2(v))
    if not pts:
        return (-30.0, 20.0)
    return (math.floor(min(pts)) - 2.0, math.ceil(max(pts)) + 2.0)


def histogram_figure(series: Sequence[tuple[str, object]], formats: Sequence[str], *, log_y: bool = True
                     ) -> go.Figure:
    """Magnitude histogram(s) on a log2 |x| axis with format overlays.

    ``series``: ``(label, TensorStats)`` pairs with histograms (e.g. the
    reference and the candidate), overlaid.  Zeros, NaN and Inf are not on a
    log axis; they are counted in the representability table.
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    all_exps: list[float] = []
    ymax = 1
    for k, (label, st) in enumerate(series):
        if st is None or st.hist is None:
            continue
        b = binade_counts(st.hist)
        all_exps += [float(e) for e in b["exp"]] + [float(e) + 1 for e in b["exp"]]
        ymax = max(ymax, int(b["count"].max()) if len(b) else 0)
        fig.add_trace(go.Bar(
            x=b["exp"] + 0.5, y=b["count"], name=plot_text(label), opacity=0.9,
            marker={"color": SERIES_COLORS[k % len(SERIES_COLORS)], "line": {"width": 0}},
            customdata=np.stack([b["exp"], b["exp"] + 1], axis=1) if len(b) else None,
            hovertemplate="2^%{customdata[0]} ≤ |x| < 2^%{customdata[1]}<br>%{y:,} values<extra>" + plot_text(label) + "</extra>",
        ))
    x_range = _x_range(all_exps, formats)
    _format_overlays(fig, formats, x_range)
    # a log axis starts below one value so a binade holding a single value shows
    y_range = [-0.15, math.log10(ymax) + 0.15] if log_y else [0, ymax * 1.05]
    fig.update_layout(
        barmode="group", bargap=0.08, bargroupgap=0.0, height=420, margin={"l": 10, "r": 10, "t": 30, "b": 10},
        xaxis={"title": {"text": "log2 |x|  (binade: 2^e ≤ |x| < 2^(e+1))"}, "range": list(x_range),
               "zeroline": False},
        yaxis={"title": {"text": "values per binade (count)"}, "type": "log" if log_y else "linear",
               "range": y_range, **({"dtick": 1} if log_y else {})},
        yaxis2={"overlaying": "y", "visible": False, "range": [0, 1]},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
    )
    return fig


def _repr_row(rep, label: Optional[str] = None) -> dict:
    row = {"format": rep.fmt} if label is None else {"record": label, "format": rep.fmt}
    for f in ("overflow", "underflow", "subnormal", "normal", "zero", "nan", "inf"):
        row[f] = getattr(rep, f)
        row[f"{f} %"] = 100.0 * rep.fraction(f)
    row["total"] = rep.total
    return row


def representability_table(stats, formats: Sequence[str]) -> pd.DataFrame:
    """Exact counts and percentages per format (``TensorStats.representability``)."""
    cols = ["format"] + [c for f in ("overflow", "underflow", "subnormal", "normal", "zero", "nan", "inf")
                         for c in (f, f"{f} %")] + ["total"]
    if stats is None or stats.hist is None:
        return pd.DataFrame(columns=cols)
    return pd.DataFrame([_repr_row(stats.representability(f)) for f in formats], columns=cols)


def what_if_table(stats) -> pd.DataFrame:
    """``representability_table`` for every registered format at once, plus the
    format's range, so an fp32 record shows where it would break."""
    df = representability_table(stats, WHAT_IF_FORMATS)
    if len(df):
        df.insert(1, "max finite", [FORMATS[f].max for f in df["format"]])
        df.insert(2, "smallest normal", [FORMATS[f].smallest_normal for f in df["format"]])
    return df


# ---- summary-only records ----------------------------------------------------------

SUMMARY_FIELDS = (("max", "Max"), ("min", "Min"), ("absmax", "absmax"), ("mean", "Mean"), ("l2norm", "Norm"))


def value_region(v: Optional[float], fmt: Format) -> str:
    """Where a single value lands in ``fmt`` (round-to-nearest-even)."""
    if v is None:
        return MISSING
    if math.isnan(v) or math.isinf(v):
        return "non-finite"
    a = abs(v)
    if a == 0:
        return "zero"
    if a >= fmt.overflow_threshold:
        return "overflow"
    if a < fmt.underflow_threshold:
        return "rounds to 0"
    if a < fmt.normal_threshold:
        return "subnormal"
    return "normal"


def shown_absmax(stats) -> Optional[float]:
    """The largest magnitude the record holds, Inf included.

    ``TensorStats`` keeps ``absmax`` over the finite values and counts Inf
    apart (``inf_count``); a record holding any Inf has an infinite largest
    magnitude, whatever its finite values are.  NaN (no finite value and no
    Inf) and unknown give None.
    """
    if (stats.inf_count or 0) > 0:
        return math.inf
    am = stats.absmax
    if am is None and stats.min is not None and stats.max is not None:
        am = max(abs(stats.min), abs(stats.max))
    if am is None or math.isnan(am):
        return None
    return float(am)


def headroom_table(stats, formats: Sequence[str]) -> pd.DataFrame:
    """Per format: max finite, the record's absmax, headroom in bits
    (log2(max / absmax); negative means it overflows) and footroom where the
    smallest nonzero magnitude is known (``TensorStats.summary_headroom``).

    A record holding Inf (``inf_count > 0``) has absmax inf, headroom -inf
    and overflows every format: its finite-only ``absmax`` would hide them."""
    out = []
    am = shown_absmax(stats)
    already_inf = am is not None and math.isinf(am)
    for name in formats:
        fmt = get_format(name)
        h = stats.summary_headroom(name)
        if already_inf:  # the values themselves are infinite: no headroom to speak of
            overflows = "yes: already inf"
        else:
            overflows = None if h.any_overflow is None else ("yes" if h.any_overflow else "no")
        out.append({
            "format": fmt.name, "max finite": fmt.max, "absmax": am if already_inf else h.absmax,
            "headroom (bits)": -math.inf if already_inf else h.headroom_bits, "overflows": overflows,
            "min |x| > 0": h.min_abs_nonzero, "footroom (bits)": h.footroom_bits,
            "underflows": None if h.any_underflow is None else ("yes" if h.any_underflow else "no"),
        })
    return pd.DataFrame(out, columns=["format", "max finite", "absmax", "headroom (bits)", "overflows",
                                      "min |x| > 0", "footroom (bits)", "underflows"])


def headroom_tables(series: Sequence[tuple[str, object]], formats: Sequence[str]) -> pd.DataFrame:
    """``headroom_table`` of every ``(label, stats)`` in one table, a ``record`` column first: one full-width
    table keeps every column on screen where side-by-side tables would cut them."""
    parts = [headroom_table(s, formats).assign(record=str(label)) for label, s in series if s is not None]
    if not parts:
        return pd.DataFrame()
    df = pd.concat(parts, ignore_index=True)
    return df[["record"] + [c for c in df.columns if c != "record"]]


def summary_values_table(stats, formats: Sequence[str]) -> pd.DataFrame:
    """Each summary statistic, its log2 magnitude, and where it lands in each format.

    The norm is not an element: "overflow" there means a norm computed in
    that format overflows (msprobe computes norms in the tensor's dtype),
    not that any value does.
    """
    out = []
    for field, label in SUMMARY_FIELDS:
        v = getattr(stats, field)
        row = {"statistic": label, "value": v,
               "log2 |value|": (math.log2(abs(v)) if v is not None and math.isfinite(v) and v != 0 else None)}
        for name in formats:
            row[get_format(name).name] = value_region(v, get_format(name))
        out.append(row)
    return pd.DataFrame(out)


def summary_figure(series: Sequence[tuple[str, object]], formats: Sequence[str]) -> go.Figure:
    """Summary statistics (|Max|, |Min|, absmax, |Mean|, Norm) as points on the
    log2 |x| axis against the formats' limits: the overlay for records that
    carry no histogram.  A NaN/Inf statistic is drawn as a cross at the
    right edge."""
    import plotly.graph_objects as go

    points = []  # (k, label, statistic, value)
    for k, (label, st) in enumerate(series):
        if st is None:
            continue
        for field, flabel in SUMMARY_FIELDS:
            v = getattr(st, field)
            if v is not None and v != 0:
                points.append((k, str(label), flabel, float(v)))
    x_range = _x_range([math.log2(abs(v)) for *_, v in points if math.isfinite(v)], formats)
    fig = go.Figure()
    for k, (label, _st) in enumerate(series):
        mine = [p for p in points if p[0] == k]
        fin = [p for p in mine if math.isfinite(p[3])]
        bad = [p for p in mine if not math.isfinite(p[3])]
        color = SERIES_COLORS[k % len(SERIES_COLORS)]
        fig.add_trace(go.Scatter(
            x=[math.log2(abs(p[3])) for p in fin], y=[p[2] for p in fin], mode="markers", name=plot_text(label),
            text=[num_text(p[3]) for p in fin], offsetgroup=str(k),
            marker={"size": 13, "symbol": ("circle", "diamond", "square", "triangle-up")[k % 4], "color": color,
                    "line": {"width": 1}},
            hovertemplate="%{y} = %{text}<br>log2 |value| = %{x:.3f}<extra>" + plot_text(label) + "</extra>",
        ))
        if bad:
            fig.add_trace(go.Scatter(
                x=[x_range[1] - 0.5] * len(bad), y=[p[2] for p in bad], mode="markers+text",
                name=f"{plot_text(label)}: NaN/Inf", text=[num_text(p[3]) for p in bad], textposition="middle left",
                offsetgroup=str(k), marker={"size": 13, "symbol": "x", "color": "#dc2626"},
                hovertemplate="%{y} = %{text}<extra>" + plot_text(label) + "</extra>",
            ))
    _format_overlays(fig, formats, x_range)
    fig.update_layout(
        height=340, margin={"l": 10, "r": 10, "t": 30, "b": 10}, scattermode="group",
        xaxis={"title": {"text": "log2 |value|"}, "range": list(x_range), "zeroline": False},
        yaxis={"title": {"text": "summary statistic"}, "categoryorder": "array",
               "categoryarray": [lab for _, lab in SUMMARY_FIELDS][::-1]},
        yaxis2={"overlaying": "y", "visible": False, "range": [0, 1]},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
    )
    return fig


# ---- comparisons and stats -----------------------------------------------------------

_METRIC_ROWS = (
    ("basis", "basis"), ("match", "match"), ("verdict", "verdict"), ("reason", "reason"),
    ("cand_format", "judged against format"), ("max_abs_err", "max abs error"),
    ("mean_abs_err", "mean abs error"), ("rmse", "RMSE"), ("max_rel_err", "max rel error"),
    # a comparison on summary statistics (basis "stats"): how far max, min and norm moved, not an element's error
    ("summary_abs_err", "summary abs error"), ("summary_rel_err", "summary rel error"),
    ("rel_floor", "rel error floor"), ("cosine", "cosine"), ("sqnr_db", "SQNR (dB)"),
    ("rounding_units", "error / unit roundoff"), ("max_ulp_err", "max error (ulps)"),
    ("nonfinite_introduced", "NaN/Inf introduced"), ("nonfinite_in_ref", "NaN/Inf in reference"),
    ("compared", "positions compared"),
)


_STAT_ROWS = ("dtype", "shape", "numel", "nan_count", "inf_count", "zero_count", "min", "max", "absmax",
              "min_abs_nonzero", "mean", "std", "l2norm")


def metrics_table(store, run_id: str, rid: int) -> pd.DataFrame:
    """The record's comparisons, one column each ("accumulated vs <run>",
    "local"), one row per metric, as text with enough digits (cosine also as
    1 - cos)."""
    data = {}
    for c in views.record_comparisons(store, run_id, rid):
        if c.kind == "local":
            col = "local (op re-run in fp32 on this run's inputs)"
        elif c.this_side == "candidate":
            col = f"accumulated vs reference {c.other}"
        else:
            col = f"candidate {c.other} vs this"
        vals = []
        for key, _ in _METRIC_ROWS:
            v = getattr(c, key)
            if key == "cosine":
                vals.append(cosine_text(v, c.cosine_deficit))
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                vals.append(num_text(v, 8))
            else:
                vals.append(MISSING if v is None else str(v))
        data[col] = vals
    return pd.DataFrame(data, index=[label for _, label in _METRIC_ROWS])


def _extreme_text(stats, field: str) -> str:
    """min, max or absmax as the Statistics table shows it.

    The stored values cover the finite elements only; Inf is counted apart.
    absmax with any Inf is ``inf``; with the signs counted, min is ``-inf``
    when a -inf is there and max ``inf`` when a +inf is; without them, min/max
    say when Inf lies beyond them and when there is no finite value at all,
    instead of showing the stored ``nan``.
    """
    if field == "absmax" and (stats.inf_count or 0) > 0:
        return num_text(math.inf)
    n_inf = stats.inf_count or 0
    neg = stats.neg_inf_count
    if n_inf and neg is not None and field in ("min", "max"):
        # with the signs counted the extremes over every non-NaN value are known exactly (numpy's nanmin/nanmax)
        pos = n_inf - neg
        if field == "min" and (neg or not stats.finite_count):
            return num_text(-math.inf if neg else math.inf)
        if field == "max" and (pos or not stats.finite_count):
            return num_text(math.inf if pos else -math.inf)
        n_inf = 0  # the Inf lie on the other side: the finite extreme is the true one
    v = getattr(stats, field)
    if v is not None and math.isnan(v) and stats.finite_count == 0:
        return f"no finite value ({n_inf} Inf)" if n_inf else "no finite value"
    text = num_text(v, 8)
    if n_inf and field in ("min", "max"):
        text += f" (finite values; {n_inf} Inf not included)"
    return text


def stats_table(records: Sequence[tuple[str, object]]) -> pd.DataFrame:
    """TensorStats side by side as text: one column per ``(label, stats)``."""
    data = {}
    for label, st in records:
        if st is None:
            continue
        vals = []
        for f in _STAT_ROWS:
            v = getattr(st, f)
            if f == "shape":
                vals.append(str(list(v)))
            elif f == "dtype":
                vals.append(str(v))
            elif f in ("min", "max", "absmax"):
                vals.append(_extreme_text(st, f))
            elif isinstance(v, float) and math.isnan(v):
                vals.append(MISSING)  # not recorded (a statistics-only record), like the counts it lacks
            else:
                vals.append(num_text(v, 8))
        data[str(label)] = vals
    return pd.DataFrame(data, index=list(_STAT_ROWS))


def not_drawn(stats) -> str:
    """Which of a record's values a log2 |x| axis cannot show, as a phrase."""
    parts = [f"{n} {what}" for n, what in ((stats.zero_count, "zero"), (stats.nan_count, "NaN"),
                                            (stats.inf_count, "Inf")) if n]
    return ", ".join(parts)
