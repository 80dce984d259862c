"""A session as one self-contained HTML page, for attaching to an issue.

The page holds the tables and key plots the dashboard's Overview shows —
runs, first non-finite producer per run, error along execution order, the
magnitude histogram of the op that went wrong against its format's range,
the worst comparisons, norm artefacts, diagnoses and warnings, and for a long
run (a capture over many steps) its timeline and alerts, as ``report`` lists them — with
plotly.js embedded, so it opens from disk with no server and no network.
A Content-Security-Policy forbids every fetch.

Every name (op, file, run, session, message) is HTML-escaped before it is
written: in tables as text, and in plot labels as entities
(``ui.common.plot_text``), because plotly renders a subset of HTML (links,
bold) in hover text and annotations.
"""

from __future__ import annotations

import dataclasses
import html
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

from .. import __version__
from ..jsoncodec import fields_tree
from ..store import views
from ..services import timeline as _timeline
from ..services.cards import DiagnosisCard, diagnosis_cards
from ..services.xdiff import diff_rows
from ..services.origins import finite_text, producer_text
from ..services.report import norm_artefacts, order_text
from ..services.verdicts import Verification, verification
from ..public import public_source
from ..display import num_text
from .common import cosine_text, plot_text
from ..store.views import counterparts, error_series, record, top_offenders
from .timeline import step_figure
from .detail import default_formats, histogram_figure, load_stats, summary_figure
from .overview import RunOrigin, error_figure, first_nonfinite_by_run, long_runs, runs_table

__all__ = ["render_html", "write_html", "render_diff_html", "write_diff_html"]

TOP_COMPARISONS = 25
MAX_WARNINGS = 200
MAX_STEP_ROWS = 500  # a long run's step table; its plot shows every step

# No network at all; inline scripts and styles only (plotly.js is inlined).
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src data:; font-src data:")

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       color: #1f2937; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.25em; margin-top: 2em;
     border-bottom: 1px solid #e5e7eb; padding-bottom: 0.2em; }
.meta { color: #6b7280; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; width: 100%; }
th, td { border: 1px solid #e5e7eb; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f9fafb; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.name, code { font-family: ui-monospace, Menlo, Consolas, monospace; word-break: break-all; }
tr.nonfinite td { background: rgba(220, 38, 38, 0.12); } tr.error td { background: rgba(234, 88, 12, 0.10); }
tr.warn td { background: rgba(202, 138, 4, 0.08); }
.none { color: #6b7280; font-style: italic; }
"""


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def _num(v: Any) -> str:
    return num_text(v)


def _table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]], *, row_class: Optional[str] = None,
           empty: str = "none") -> str:
    """``columns``: (key, header, kind) with kind "num", "name" or "text"; every cell is escaped."""
    if not rows:
        return f'<p class="none">{_e(empty)}</p>'
    out = ["<table><thead><tr>"]
    out += [f"<th>{_e(h)}</th>" for _, h, _ in columns]
    out.append("</tr></thead><tbody>")
    for r in rows:
        cls = r.get(row_class) if row_class else None
        out.append(f'<tr class="{_e(cls)}">' if cls else "<tr>")
        for key, _, kind in columns:
            v = r.get(key)
            if kind == "num":
                out.append(f'<td class="num">{_e(_num(v))}</td>')
            elif kind == "name":
                out.append(f'<td class="name">{_e(v)}</td>')
            else:
                out.append(f"<td>{_e(v)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _records(df) -> list[dict]:
    """DataFrame rows as dicts with None for missing values (not pandas' NaN/NA)."""
    import pandas as pd

    out = []
    for rec in df.to_dict("records"):
        out.append({k: (None if (v is None or (not isinstance(v, (list, tuple, dict, str)) and pd.isna(v)))
                        else v) for k, v in rec.items()})
    return out


def _figure_div(fig, div_id: str) -> str:
    import plotly.io as pio

    # the page has no Streamlit theme: plotly's own template, whatever default the process holds (importing
    # streamlit, as the dashboard's download button does, makes its own template the default, and that one
    # leaves no room for axis titles and tick labels outside Streamlit)
    fig.update_layout(template="plotly")
    return pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def _error_plot(store, sid: str, firsts: list[RunOrigin]) -> Optional[str]:
    metric = "rounding_units"
    df = error_series(store, sid, metric)
    if df["value"].notna().sum() == 0:
        # statistics-only sessions have no element-wise error: how far their summaries moved, labelled so
        metric = "summary_rel_err"
        df = error_series(store, sid, metric)
    if df.empty:
        return None
    # error_figure escapes the names it draws
    marks = [f.first for f in firsts if f.first is not None and f.run.kind != "reference"]
    fig = error_figure(df, metric, first_nonfinite=marks)
    fig.update_layout(title={"text": "Error along execution order"})
    return _figure_div(fig, "plot-error")


def _focus_record(store, sid: str, firsts: list[RunOrigin]) -> Optional[tuple[str, int, str]]:
    """The record to show against its format: the first non-finite producer's
    output in a non-reference run, else the worst comparison."""

    for f in firsts:
        if f.first is not None and f.run.kind != "reference":
            return f.run.run_id, f.first.rid, "first non-finite producer"
    worst = top_offenders(store, sid, n=1)
    if len(worst) and worst.iloc[0]["rid"] is not None and not _isnan(worst.iloc[0]["rid"]):
        return str(worst.iloc[0]["run_id"]), int(worst.iloc[0]["rid"]), "largest error"
    return None


def _isnan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _focus_plot(store, sid: str, firsts: list[RunOrigin]) -> tuple[Optional[str], str]:
    focus = _focus_record(store, sid, firsts)
    if focus is None:
        return None, ""
    run_id, rid, why = focus
    rec = record(store, run_id, rid)
    series = [(str(rec.run), load_stats(store, run_id, rid))]
    for c in counterparts(store, run_id, rid)[:1]:
        if c.run_id and c.rid is not None:
            series.insert(0, (str(c.run or "reference"), load_stats(store, c.run_id, c.rid)))
    formats = default_formats(rec.dtype or rec.run_dtype)
    if any(s is not None and s.hist is not None for _, s in series):
        fig = histogram_figure(series, formats)
    else:
        fig = summary_figure(series, formats)
    # a static page has no room to spare above the plot: the title on top, the legend under the axis title
    height = (fig.layout.height or 420) + 110
    fig.update_layout(title={"text": plot_text(f"{rec.name} ({why})"), "y": 0.98, "yanchor": "top"},
                      margin={"t": 50, "b": 150, "l": 70}, height=height,
                      legend={"orientation": "h", "yanchor": "top", "y": -110 / height - 0.12, "x": 0})
    caption = f"{rec.name} in run {rec.run} — the {why}, against the limits of {', '.join(formats) or 'its format'}"
    return _figure_div(fig, "plot-focus"), caption


def _long_runs(store, sid: str) -> list[str]:
    """Per long run (a timeline): its steps in a line, a plot and a table of the per-step values, and its
    alerts -- what ``report`` lists."""
    out = []
    alerts = {r.run: r.alerts for r in long_runs(store, sid)}
    for i, t in enumerate(_timeline.timeline_report(store, sid)):
        run, first, steps = t.run, t.first_nonfinite_step, t.steps
        out.append(f"<h2>Timeline of <code>{_e(run)}</code></h2>")
        out.append(f"<p>{len(steps)} steps, full records at {len(t.full_steps)}; "
                   + (f"first non-finite value at step {first}" if first is not None else "every step finite")
                   + "</p>")
        if len(steps) > 1:  # a line needs two steps
            out.append(_figure_div(step_figure(steps, first), f"plot-timeline-{i}"))
        table = _records(alerts.get(run)) if run in alerts else []
        out.append(f"<h3>Alerts of {_e(run)} ({len(table)})</h3>")
        out.append(_table(table, [("step", "step", "num"), ("rule", "rule", "text"), ("message", "message", "text")],
                          empty="no alerts"))
        shown = steps[:MAX_STEP_ROWS]
        out.append(f"<h3>Steps of {_e(run)}" + (f" (the first {MAX_STEP_ROWS} of {len(steps)})"
                                                if len(steps) > MAX_STEP_ROWS else "") + "</h3>")
        out.append(_table(fields_tree(shown), [("step", "step", "num"), ("loss", "loss", "num"),
                                  ("loss_scale", "loss scale", "num"), ("grad_norm", "gradient norm", "num"),
                                  ("nonfinite_values", "NaN/Inf values", "num"),
                                  ("tensors", "tensors summarised", "num")], empty="no steps"))
    return out


def _head(info, source: str) -> list[str]:
    """The page's head (its policy, style and plotly.js) and the session's name, source and dates."""
    import plotly.offline

    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Precision Lab report: {_e(info.name)}</title>",
        f"<style>{_STYLE}</style>",
        f'<script type="text/javascript">{plotly.offline.get_plotlyjs()}</script>',
        "</head><body>",
        f'<h1>Session <code id="session-name">{_e(info.name)}</code></h1>',
        f'<p class="meta">source: <code>{_e(source)}</code> · created {_e(info.created)} · '
        f'written {_e(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))} by Precision Lab '
        f"{_e(__version__)}</p>",
    ]


def _runs(runs: list[dict]) -> list[str]:
    return ["<h2>Runs</h2>",
            _table(runs, [("run", "run", "name"), ("kind", "kind", "text"), ("dtype", "dtype", "text"),
                          ("parent", "parent", "name"), ("fix", "fix", "name"), ("order", "order", "text"),
                          ("order_used", "order used", "text"), ("records", "records", "num"),
                          ("nonfinite_records", "non-finite records", "num"), ("source", "source", "name")])]


def _first_nonfinite_row(f: RunOrigin) -> dict:
    """A run's first non-finite producer as a row: the op (or parameter), where, why, how sure (with a distributed
    run's other ranks) and the ops before it."""
    first, masks = f.first, f.intended
    if first is None:
        return {"run": f.run.name, "op": f"none: {finite_text(masks)}"}
    return {"run": f.run.name, "op": producer_text(first), "op_type": first.op_type, "where": first.where,
            "tensor": f"{first.role} {first.index}", "reason": first.reason,
            "certainty": first.certainty_text + "".join(f"; {r.text}" for r in f.ranks),
            "path": " → ".join(p.op for p in first.path)}


def _first_nonfinite(firsts: list[RunOrigin]) -> list[str]:
    return ["<h2>First non-finite producer</h2>",
            _table([_first_nonfinite_row(f) for f in firsts],
                   [("run", "run", "name"), ("op", "op", "name"), ("op_type", "op type", "text"),
                    ("where", "where", "text"), ("tensor", "tensor", "text"), ("reason", "why", "text"),
                    ("certainty", "how sure", "text"), ("path", "ops before it", "name")], empty="no runs")]


def _error_section(store, sid: str, runs: list[dict], firsts: list[RunOrigin]) -> list[str]:
    """The error along execution order, saying where seq follows the names rather than the execution."""
    err = _error_plot(store, sid, firsts)
    unknown = [r["run"] for r in runs if r.get("order") == order_text("name")]
    out = ["<h2>Error along execution order</h2>"]
    if unknown:
        out.append(f'<p class="none">{_e(order_text("name"))} for {_e(", ".join(unknown))}: seq follows '
                   "the names, not the execution</p>")
    return out + [err if err else '<p class="none">no comparisons in this session</p>']


def _focus_section(store, sid: str, firsts: list[RunOrigin]) -> list[str]:
    focus, caption = _focus_plot(store, sid, firsts)
    return ["<h2>Values against the format's range</h2>", f"<p>{_e(caption)}</p>", focus] if focus else []


def _worst(store, sid: str) -> list[str]:
    """The ``TOP_COMPARISONS`` largest errors, non-finite records included."""
    worst = _records(top_offenders(store, sid, n=TOP_COMPARISONS, include_nonfinite=True))
    for w in worst:
        w["tensor"] = f"{w['role']} {w['index']}"
        w["cosine_text"] = cosine_text(w.get("cosine"), w.get("cosine_deficit"))
    # a comparison on summary statistics has no element-wise error: its summaries' errors in columns of their own
    summary = [("summary_abs_err", "summary abs err", "num"), ("summary_rel_err", "summary rel err", "num")] \
        if any(w.get("basis") == "stats" for w in worst) else []
    return [f"<h2>Largest errors (top {TOP_COMPARISONS})</h2>",
            _table(worst, [("run", "run", "name"), ("seq", "seq", "num"), ("op", "op", "name"),
                           ("tensor", "tensor", "text"), ("kind", "kind", "text"), ("basis", "basis", "text"),
                           ("verdict", "verdict", "text"), ("max_abs_err", "max abs err", "num"),
                           ("max_rel_err", "max rel err", "num"), *summary, ("cosine_text", "cosine", "text"),
                           ("sqnr_db", "SQNR dB", "num"), ("rounding_units", "err / unit roundoff", "num"),
                           ("reason", "reason", "text")], row_class="verdict", empty="no comparisons")]


def _norm_artefacts(store, sid: str) -> list[str]:
    arts = fields_tree(norm_artefacts(store, sid))
    return [f"<h2>Norm artefacts ({len(arts)})</h2>",
            _table(arts, [("run", "run", "name"), ("op", "op", "name"), ("role", "role", "text"),
                          ("index", "index", "text"), ("reason", "why this is not a non-finite value", "text")])
            ] if arts else []


def _diagnoses(cards: list[DiagnosisCard]) -> list[str]:
    rows = [{"severity": c.severity, "run": c.run, "op": c.op, "rule": c.rule, "message": c.message,
             "fixes_text": ", ".join(c.fixes)} for c in cards]
    return ["<h2>Diagnoses</h2>",
            _table(rows, [("severity", "severity", "text"), ("run", "run", "name"), ("op", "op", "name"),
                          ("rule", "rule", "text"), ("message", "message", "text"), ("fixes_text", "fixes", "name")],
                   empty="no diagnoses")]


def _fixes_tried(tried: Sequence[Verification]) -> list[str]:
    """Each re-run judged against the run it fixes, as the text report and the Overview's fix buttons say it."""
    rows = [{"parent": v.parent, "fix": v.fix, "run": v.run, "works": "yes" if v.works else "no",
             "outcome": v.outcome()} for v in tried]
    return [f"<h2>Fixes tried ({len(rows)})</h2>",
            _table(rows, [("parent", "run it fixes", "name"), ("fix", "fix", "name"), ("run", "re-run", "name"),
                          ("works", "works", "text"), ("outcome", "what it gave", "text")])] if rows else []


def _warnings(store, sid: str) -> list[str]:
    """Up to ``MAX_WARNINGS`` warnings, and whether there are more."""
    warns = views.session_warnings(store, sid, limit=MAX_WARNINGS + 1)
    shown = [dataclasses.asdict(w) for w in warns[:MAX_WARNINGS]]
    return [f"<h2>Warnings ({len(warns) if len(warns) <= MAX_WARNINGS else f'more than {MAX_WARNINGS}'})</h2>",
            _table(shown, [("run", "run", "name"), ("file", "file", "name"), ("message", "message", "text")],
                   empty="no warnings")]


def render_html(store, session: str, *, public: bool = True) -> str:
    """The page as a string (see the module doc).

    ``public`` (the default: a report is made to be passed on): sources name
    files relative to the upload or by their name, never a folder of the
    server or the sharer (``public.public_source``).
    """
    info = store.session(session)
    sid = info.session_id
    runs = _records(runs_table(store, sid, public=public))
    firsts = first_nonfinite_by_run(store, sid)
    parts = _head(info, public_source(info.source) if public else info.source) + _runs(runs)
    parts += _first_nonfinite(firsts) + _long_runs(store, sid)
    parts += _error_section(store, sid, runs, firsts) + _focus_section(store, sid, firsts)
    parts += _worst(store, sid) + _norm_artefacts(store, sid)
    parts += _diagnoses(diagnosis_cards(store, sid)) + _fixes_tried(verification(store, session).all())
    parts += _warnings(store, sid)
    return "\n".join(parts + ["</body></html>"])


def render_diff_html(result, ref_label: str, cand_label: str) -> str:
    """Two implementations diffed (``services.xdiff.DiffResult``) as a self-contained page: the first divergent
    pair in a sentence, every pair with how it was matched, how sure, and the metrics side by side, and the calls
    left unpaired."""
    f = result.first
    rows = [{**fields_tree(r), "row_class": "error" if r.diverges else None, "ref_text": r.ref_text,
             "cand_text": r.cand_text} for r in diff_rows(result)]
    if f is None:
        verdict = "No pair diverges beyond what the formats explain."
    else:
        verdict = (f"First divergent pair: {f.pair.label} ({f.pair.how}, confidence {f.pair.confidence:.2f}): "
                   f"output error {_num(f.out_error)} where {_num(f.expected)} is explained by inputs that agree "
                   f"to {_num(f.in_error)}.")
    unpaired = [{"run": side, "op": c.op, "op_type": c.op_type}
                for side, calls in (("reference", result.pairing.unpaired_ref),
                                    ("candidate", result.pairing.unpaired_cand)) for c in calls]
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        f"<title>Precision Lab diff: {_e(ref_label)} vs {_e(cand_label)}</title>", f"<style>{_STYLE}</style>",
        "</head><body>",
        f"<h1>Diff <code>{_e(ref_label)}</code> vs <code>{_e(cand_label)}</code></h1>",
        f'<p class="meta">written {_e(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))} by Precision '
        f"Lab {_e(__version__)}</p>",
        f'<p id="verdict">{_e(verdict)}</p>',
        f"<h2>Pairs ({len(rows)})</h2>",
        _table(rows, [("ref_text", "reference", "name"), ("cand_text", "candidate", "name"), ("how", "how", "text"),
                      ("confidence", "confidence", "num"), ("out_error", "output error", "num"),
                      ("in_error", "input error", "num"), ("expected", "band", "num"),
                      ("sqnr_db", "SQNR dB", "num"), ("max_abs_err", "max abs", "num"),
                      ("max_rel_err", "max rel", "num"), ("cosine", "cosine", "num")], row_class="row_class"),
        f"<h2>Unpaired calls ({len(unpaired)})</h2>",
        _table(unpaired, [("run", "run", "text"), ("op", "op", "name"), ("op_type", "op type", "text")]),
        "</body></html>",
    ]
    return "\n".join(parts)


def write_diff_html(result, ref_label: str, cand_label: str, path: os.PathLike | str) -> Path:
    """Write ``render_diff_html`` to ``path`` (complete or not at all); returns the path."""
    return _write_whole(Path(path), render_diff_html(result, ref_label, cand_label))


def write_html(store, session: str, path: os.PathLike | str) -> Path:
    """Write the page to ``path`` (complete or not at all); returns the path."""
    return _write_whole(Path(path), render_html(store, session))


def _write_whole(path: Path, text: str) -> Path:
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
