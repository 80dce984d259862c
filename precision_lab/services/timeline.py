"""A long run over many steps: its alerts, its per-step data, the cells of its heatmaps, the model as a tree.

Alerts are computed from the stored timeline by the rules of
``precision_lab.alerts`` whenever they are asked for, so a changed
threshold applies to every stored run at once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np

from ..alerts import Alert, grad_spike_alerts, headroom_bits, loss_scale_alerts, op_alerts, op_format
from ..formats import Format, get_format
from ..ops import module_path
from ..quantisation import flushed_by_underflow
from ..records import tensor_name
from ..store import queries as q
from ..store import timeline as tl
from ..store.rows import OutputRecord, TimelineRun
from .tree import ModuleNode, build_tree

__all__ = ["run_format", "run_alerts", "session_alerts", "RunTimeline", "TimelineHeatmap", "OpStep", "OpSeries",
           "timeline_report", "heatmap", "op_series", "module_tree", "record_at", "first_failing_op",
           "pair_alerts"]


@dataclass(frozen=True, slots=True)
class RunTimeline:
    """A long run in brief: its name, its first non-finite step (None: every step finite), the steps it holds
    full records of, and one row per step (``store.timeline.step_rows``)."""

    run: str
    first_nonfinite_step: Optional[int]
    full_steps: list[int]
    steps: list


@dataclass(frozen=True, slots=True)
class TimelineHeatmap:
    """The ops x steps heatmap of a long run: ``width`` steps per bucket, the cells
    (``store.timeline.heatmap_cells``: op, role, index, bucket, value) and the rows, the ops in execution order
    (``store.timeline.timeline_ops``)."""

    width: int
    cells: list
    ops: list


@dataclass(frozen=True, slots=True)
class OpStep:
    """One op's values at one step, ranks merged (``store.timeline.op_steps``), with its headroom below the
    format's max (bits; None without a finite nonzero max) and the share of its finite values at the format's
    low end (None without a count)."""

    step: int
    absmax: Optional[float]
    min_abs_nonzero: Optional[float]
    nan_count: Optional[int]
    inf_count: Optional[int]
    numel: Optional[int]
    finite: Optional[int]
    overflow: Optional[int]
    low: Optional[int]
    dtype: Optional[str]
    location: Optional[str]
    headroom_bits: Optional[float]
    low_share: Optional[float]


@dataclass(frozen=True, slots=True)
class OpSeries:
    """A chosen series of the Timeline: its label and its values step by step."""

    label: str
    points: list[OpStep]


# op alerts judge forward outputs; gradients of parameters are judged for underflow only
# (a GradScaler overflows them on purpose, and skips those steps)
_OUTPUT = ("output",)


def run_format(run: TimelineRun, target: Optional[str] = None) -> Format:
    """The format a run's heatmaps are drawn against: its own low-precision dtype, else ``target``, else fp16."""
    return op_format(run.dtype, target) or get_format(target or "fp16")


def run_alerts(store, run_id: str, *, target: Optional[str] = None, overrides: Optional[dict] = None) -> list[Alert]:
    """Every alert of one run, by step then op."""
    run = q.run_row(store, run_id)
    if run is None:
        raise KeyError(f"no run {run_id!r}")
    name = run.name
    out: list[Alert] = []
    fmts = {d: op_format(d, target) for d in tl.timeline_dtypes(store, run_id)}
    cols = tl.series_rows(store, run_id, {d: f.name for d, f in fmts.items() if f is not None},
                          roles=("output", "param_grad"))
    n = len(cols["step"])
    if n:
        new = np.zeros(n, dtype=bool)
        new[0] = True
        for c in ("op", "role", "index"):  # rows come sorted by series: a series starts where a key changes
            new[1:] |= cols[c][1:] != cols[c][:-1]
        starts = np.flatnonzero(new)
        ends = np.r_[starts[1:], n]
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(cols["finite"] > 0, cols["low"] / cols["finite"], np.nan)
        for a, b in zip(starts, ends):
            op, role, index = str(cols["op"][a]), str(cols["role"][a]), str(cols["index"][a])
            fmt = fmts.get(cols["dtype"][a])
            if fmt is None:
                continue
            shown = op if (role, index) == ("output", "0") else tensor_name(op, role, index)
            got = op_alerts(name, shown, cols["step"][a:b], cols["absmax"][a:b], fmt, share[a:b], overrides)
            if role == "param_grad":
                got = [x for x in got if x.rule == "underflow"]
            out.extend(dataclasses.replace(x, op=op) for x in got)
    steps = tl.step_rows(store, run_id)
    scaled = [(s["step"], s["loss_scale"]) for s in steps if s["loss_scale"] is not None]
    if scaled:
        out.extend(loss_scale_alerts(name, [s for s, _ in scaled], [v for _, v in scaled], overrides))
    normed = [(s["step"], s["grad_norm"]) for s in steps if s["grad_norm"] is not None]
    if normed:
        out.extend(grad_spike_alerts(name, [s for s, _ in normed], [v for _, v in normed], overrides))
    out.sort(key=lambda a: (a.step, a.op or "", a.rule))
    return out


# what a compared run's flushed-to-zero alert reads: forward outputs and the gradients backward ops write
_FLUSH_ROLES = ("output", "grad_input", "param_grad")


def pair_alerts(store, run_id: str, *, overrides: Optional[dict] = None) -> list[Alert]:
    """The underflow alerts of a run compared with a reference: per op output or gradient, by step, the share
    of its values flushed to zero (zero in the run, nonzero in the reference, where the reference holds
    magnitudes the format rounds to zero: ``quantisation.flushed_by_underflow``), in the record's own
    low-precision format."""
    run = q.run_row(store, run_id)
    series: dict[tuple, list] = {}
    for r in q.paired_values(store, run_id, _FLUSH_ROLES):
        series.setdefault((r.op, r.role, r.index, r.dtype), []).append(r)
    out: list[Alert] = []
    for (op, role, index, dtype), rs in series.items():
        fmt = op_format(dtype)
        if fmt is None:
            continue
        rs.sort(key=lambda r: r.step)
        share = [flushed_by_underflow(r.ref_zero_count, r.zero_count, r.ref_min_abs_nonzero, fmt)
                 / r.numel if r.numel else np.nan for r in rs]
        shown = op if (role, index) == ("output", "0") else tensor_name(op, role, index)
        got = op_alerts(run.name, shown, [r.step for r in rs], [r.absmax for r in rs], fmt,
                        overrides=overrides, flushed_share=share)
        out.extend(dataclasses.replace(x, op=op) for x in got if x.rule == "underflow")
    out.sort(key=lambda a: (a.step, a.op or "", a.rule))
    return out


def session_alerts(store, session: str, *, target: Optional[str] = None,
                   overrides: Optional[dict] = None) -> list[Alert]:
    """Every alert of a session: its long runs' (``run_alerts``), then its compared runs' values flushed to
    zero (``pair_alerts``)."""
    info = store.session(session)
    out: list[Alert] = []
    timed = set()
    for r in tl.timeline_runs(store, info.session_id):
        timed.add(r.run_id)
        out.extend(run_alerts(store, r.run_id, target=target, overrides=overrides))
    for r in q.session_runs(store, info.session_id):
        if r.kind != "reference" and r.run_id not in timed:
            out.extend(pair_alerts(store, r.run_id, overrides=overrides))
    return out


def first_failing_op(store, run_id: str) -> Optional[dict]:
    """The first timeline op holding a non-finite value at the run's first non-finite step (forward outputs
    first, in execution order, then gradients)."""
    step = tl.first_nonfinite_step(store, run_id)
    if step is None:
        return None
    got = [r for r in tl.op_steps_at(store, run_id, step) if (r.nan_count or 0) + (r.inf_count or 0) > 0]
    return {"step": step, **dataclasses.asdict(got[0])} if got else {"step": step, "op": None}


def timeline_report(store, session_id: str) -> list[RunTimeline]:
    """Per timeline run: the first non-finite step, the steps with full records, and one row per step."""
    return [RunTimeline(r.name, tl.first_nonfinite_step(store, r.run_id), tl.full_steps(store, r.run_id),
                        tl.step_rows(store, r.run_id))
            for r in tl.timeline_runs(store, session_id)]


def heatmap(store, run_id: str, *, metric: str, fmt: str, roles=_OUTPUT, max_steps: int = 400) -> TimelineHeatmap:
    """Cells of the ops x steps heatmap (see ``store.timeline.heatmap_cells``) and the ops in execution order."""
    f = get_format(fmt)
    got = tl.heatmap_cells(store, run_id, metric=metric, fmt=f.name, fmt_max=f.max, roles=roles,
                           max_steps=max_steps)
    return TimelineHeatmap(got["width"], got["cells"], tl.timeline_ops(store, run_id, roles))


def op_series(store, run_id: str, op: str, role: str = "output", index: str = "0", *, fmt: str) -> list[OpStep]:
    """One op's values step by step, with its headroom below ``fmt``'s max and its low-end share."""
    f = get_format(fmt)
    out = []
    for r in tl.op_steps(store, run_id, op, role, index, f.name):
        a = r["absmax"]
        out.append(OpStep(r["step"], a, r["min_abs_nonzero"], r["nan_count"], r["inf_count"], r["numel"],
                          r["finite"], r["overflow"], r["low"], r["dtype"], r["location"],
                          float(headroom_bits(a, f)) if a and a > 0 and math.isfinite(a) else None,
                          r["low"] / r["finite"] if r["low"] is not None and r["finite"] else None))
    return out


def module_tree(store, run_id: str, *, fmt: str) -> list[ModuleNode]:
    """The module hierarchy of a long run (see ``services.tree``): each module's worst headroom below
    ``fmt``'s max over every step; the path to the first op that went non-finite marked."""
    first = first_failing_op(store, run_id)
    failing = module_path(first["op"]) if first and first.get("op") else None
    worst = tl.op_worst(store, run_id, get_format(fmt).max)
    return build_tree([SimpleNamespace(**w) for w in worst], failing)


def record_at(store, run_id: str, op: str, step: int) -> Optional[OutputRecord]:
    """The full record (output 0) of ``op`` nearest to ``step`` (at or before it when there is one)."""
    steps = tl.full_steps(store, run_id, op)
    if not steps:
        return None
    before = [s for s in steps if s <= step]
    at = before[-1] if before else steps[0]
    got = tl.output_record(store, run_id, op, at)
    return got
