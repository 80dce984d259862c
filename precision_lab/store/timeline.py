"""Reads of a long run's timeline (tables ``timeline``, ``timeline_formats``, ``step_scalars``).

Aggregation happens here, in DuckDB: a heatmap of thousands of steps and
hundreds of ops comes back as at most ``max_steps`` columns per op.  Ranks
are merged per (op, step): the largest magnitude, the summed counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .queries import run_order
from .rows import (HeatmapBuckets, HeatmapCell, OpStepValues, OpWorst, OutputRecord, RankStepCell, StepOp, StepRow,
                   TimelineOp, TimelineRun, one_as, rows_as)

__all__ = ["timeline_runs", "timeline_dtypes", "series_rows", "full_steps", "op_steps_at", "output_record", "step_rows", "first_nonfinite_step", "heatmap_cells", "op_steps",
           "op_worst", "timeline_ops", "rank_step_cells", "SeriesColumns"]

_KEY = "op, role, \"index\""
# the low end of a format: values that round to zero or to a subnormal
_LOW = "(f.underflow + f.subnormal)"


def timeline_runs(store, session_id: str) -> list[TimelineRun]:
    """Runs of the session that have a timeline, in the order they were added."""
    return rows_as(TimelineRun, store.sql("SELECT r.run_id, r.name, r.dtype, count(DISTINCT t.step) AS steps, min(t.step) AS first_step, "
                       "max(t.step) AS last_step, count(DISTINCT t.op) AS ops FROM runs r JOIN timeline t "
                       "ON t.run_id = r.run_id WHERE r.session_id = ? GROUP BY r.run_id, r.name, r.dtype, r.created, r.rowid "
                       f"ORDER BY {run_order('r')}", [session_id]))


def timeline_dtypes(store, run_id: str) -> list[str]:
    return [r[0] for r in store.sql("SELECT DISTINCT dtype FROM timeline WHERE run_id = ? ORDER BY dtype",
                                    [run_id]).fetchall()]


@dataclass(frozen=True, slots=True)
class SeriesColumns:
    """Every (op, role, index, step) of a long run, ranks merged, in series order, as numpy columns of equal
    length: the series' key, op type and dtype, the step, the largest magnitude, the finite values and ``low``,
    those of them that round to zero or a subnormal in the row's format (NaN where unknown)."""

    op: np.ndarray
    op_type: np.ndarray
    role: np.ndarray
    index: np.ndarray
    dtype: np.ndarray
    step: np.ndarray
    absmax: np.ndarray
    finite: np.ndarray
    low: np.ndarray


def series_rows(store, run_id: str, fmt_of_dtype: dict, roles: Sequence[str] = ("output",)) -> SeriesColumns:
    """Every (op, role, index, step) of a run's ``roles`` as ``SeriesColumns``, ``low`` counted in the format
    ``fmt_of_dtype`` names for the row's dtype."""
    marks = ", ".join("?" * len(roles))
    return SeriesColumns(**store.sql(f"""
        WITH m AS (SELECT unnest(?::VARCHAR[]) AS dtype, unnest(?::VARCHAR[]) AS fmt)
        SELECT t.op, any_value(t.op_type) AS op_type, t.role, t."index", any_value(t.dtype) AS dtype, t.step,
               coalesce(max(t.absmax), 'nan'::DOUBLE) AS absmax, coalesce(sum(f.finite), 0)::DOUBLE AS finite,
               coalesce(sum({_LOW}), 'nan'::DOUBLE)::DOUBLE AS low
        FROM timeline t LEFT JOIN m ON m.dtype = t.dtype
        LEFT JOIN timeline_formats f ON f.run_id = t.run_id AND f.tid = t.tid AND f.fmt = m.fmt
        WHERE t.run_id = ? AND t.role IN ({marks})
        GROUP BY t.op, t.role, t."index", t.step ORDER BY t.op, t.role, t."index", t.step""",
                     [list(fmt_of_dtype), list(fmt_of_dtype.values()), run_id, *roles]).fetchnumpy())


def full_steps(store, run_id: str, op: Optional[str] = None) -> list[int]:
    """The steps a run (or one ``op`` of it) has full records of, ascending."""
    where, args = ("AND op = ?", [run_id, op]) if op is not None else ("", [run_id])
    return [r[0] for r in store.sql(f"SELECT DISTINCT step FROM tensors WHERE run_id = ? {where} ORDER BY step",
                                    args).fetchall()]


def op_steps_at(store, run_id: str, step: int) -> list[StepOp]:
    """The timeline ops of one step, forward outputs first, in execution order (ranks merged)."""
    return rows_as(StepOp, store.sql("""
        SELECT op, role, sum(nan_count) AS nan_count, sum(inf_count) AS inf_count, max(absmax) AS absmax,
               min(seq) AS seq
        FROM timeline WHERE run_id = ? AND step = ? GROUP BY op, role
        ORDER BY role <> 'output', seq, op""",
                [run_id, step]))


def output_record(store, run_id: str, op: str, step: int) -> Optional[OutputRecord]:
    """``op``'s first output record at ``step``."""
    return one_as(OutputRecord, store.sql("SELECT rid, step, rank, name FROM tensors WHERE run_id = ? AND op = ? "
                                          "AND step = ? AND role = 'output' ORDER BY rank, \"index\" LIMIT 1",
                                          [run_id, op, step]))


def step_rows(store, run_id: str) -> list[StepRow]:
    """One row per step: loss, loss_scale, nonfinite_values (unexpected ones), grad_norm (global L2 norm of the
    parameter gradients, ranks merged), ops summarised."""
    return rows_as(StepRow, store.sql("""
        WITH s AS (SELECT step, max(CASE WHEN name = 'loss' THEN value END) AS loss,
                          max(CASE WHEN name = 'loss_scale' THEN value END) AS loss_scale,
                          sum(CASE WHEN name = 'nonfinite_values' THEN value END) AS nonfinite_values
                   FROM step_scalars WHERE run_id = ? GROUP BY step),
             g AS (SELECT step, sqrt(sum(l2norm * l2norm) FILTER (WHERE role = 'param_grad')) AS grad_norm,
                          count(*) AS tensors
                   FROM timeline WHERE run_id = ? GROUP BY step)
        SELECT coalesce(s.step, g.step) AS step, s.loss, s.loss_scale, s.nonfinite_values, g.grad_norm,
               coalesce(g.tensors, 0) AS tensors
        FROM s FULL OUTER JOIN g ON s.step = g.step ORDER BY step""", [run_id, run_id]))


def rank_step_cells(store, run_id: str) -> list[RankStepCell]:
    """Every rank at every step of a run's timeline, by rank then step."""
    return rows_as(RankStepCell, store.sql("""
        SELECT rank, step, sum(CASE WHEN name = 'nonfinite_values' THEN value ELSE 0 END) AS nonfinite,
               bool_or(name = 'scaler_skipped') AS skipped
        FROM step_scalars WHERE run_id = ? AND name IN ('nonfinite_values', 'scaler_skipped')
        GROUP BY rank, step ORDER BY rank, step""", [run_id]))


def first_nonfinite_step(store, run_id: str) -> Optional[int]:
    """The first step whose summaries hold an unexpected non-finite value (or whose loss is non-finite)."""
    got = store.sql("SELECT min(step) FROM step_scalars WHERE run_id = ? AND name = 'nonfinite_values' "
                    "AND value > 0", [run_id]).fetchone()
    return None if got is None or got[0] is None else int(got[0])


def timeline_ops(store, run_id: str, roles: Sequence[str] = ("output",)) -> list[TimelineOp]:
    """The run's timeline series (op, role, index, op_type, location) in execution order of their first step."""
    marks = ", ".join("?" * len(roles))
    return rows_as(TimelineOp, store.sql(f"""
        SELECT op, role, "index", any_value(op_type) AS op_type, any_value(location) AS location,
               min(step) AS first_step, arg_min(seq, step) AS seq
        FROM timeline WHERE run_id = ? AND role IN ({marks}) GROUP BY {_KEY} ORDER BY first_step, seq, op""",
                [run_id, *roles]))


def heatmap_cells(store, run_id: str, *, metric: str, fmt: str, fmt_max: float, roles: Sequence[str] = ("output",),
                  max_steps: int = 400) -> HeatmapBuckets:
    """Cells of the ops x steps heatmap, aggregated in DuckDB over buckets of consecutive steps.

    ``metric``: ``headroom`` (log2(fmt_max / absmax), the bucket's smallest) or ``low`` (share of finite
    values that round to zero or a subnormal in ``fmt``, the bucket's largest).  ``width`` is the steps per
    bucket; a cell's ``bucket`` is its bucket's first step.
    """
    span = store.sql("SELECT min(step), max(step) FROM timeline WHERE run_id = ?", [run_id]).fetchone()
    if span is None or span[0] is None:
        return HeatmapBuckets(1, [])
    lo, hi = int(span[0]), int(span[1])
    width = max(1, -(-(hi - lo + 1) // max(1, int(max_steps))))
    marks = ", ".join("?" * len(roles))
    if metric == "headroom":
        value, join, params = "min(log2(? / nullif(t.absmax, 0)))", "", [fmt_max]
    elif metric == "low":
        value = f"max(CASE WHEN f.finite > 0 THEN {_LOW}::DOUBLE / f.finite END)"
        join = "LEFT JOIN timeline_formats f ON f.run_id = t.run_id AND f.tid = t.tid AND f.fmt = ?"
        params = [fmt]
    else:
        raise ValueError(f"unknown heatmap metric {metric!r}; choose headroom or low")
    sql = f"""
        SELECT t.op, t.role, t."index", {lo} + ((t.step - {lo}) // {width}) * {width} AS bucket, {value} AS value
        FROM timeline t {join} WHERE t.run_id = ? AND t.role IN ({marks})
        GROUP BY t.op, t.role, t."index", bucket"""
    # parameters in the order their markers appear: the value's or the join's, then the filter's
    return HeatmapBuckets(width, rows_as(HeatmapCell, store.sql(sql, params + [run_id, *roles])))


def op_steps(store, run_id: str, op: str, role: str, index: str, fmt: str) -> list[OpStepValues]:
    """One op's series, step by step (ranks merged): absmax, min_abs_nonzero, counts and ``fmt``'s counts."""
    return rows_as(OpStepValues, store.sql(f"""
        SELECT t.step, max(t.absmax) AS absmax, min(t.min_abs_nonzero) AS min_abs_nonzero,
               sum(t.nan_count) AS nan_count, sum(t.inf_count) AS inf_count, sum(t.numel) AS numel,
               sum(f.finite) AS finite, sum(f.overflow) AS overflow, sum({_LOW}) AS low,
               any_value(t.dtype) AS dtype, any_value(t.location) AS location
        FROM timeline t LEFT JOIN timeline_formats f ON f.run_id = t.run_id AND f.tid = t.tid AND f.fmt = ?
        WHERE t.run_id = ? AND t.op = ? AND t.role = ? AND t."index" = ? GROUP BY t.step ORDER BY t.step""",
                [fmt, run_id, op, role, str(index)]))


def op_worst(store, run_id: str, fmt_max: float, roles: Sequence[str] = ("output",)) -> list[OpWorst]:
    """Per op: the smallest headroom (bits below ``fmt_max``) over every step, the step of the largest
    magnitude, and whether it ever held a non-finite value."""
    marks = ", ".join("?" * len(roles))
    return rows_as(OpWorst, store.sql(f"""
        SELECT op, min(log2(? / nullif(absmax, 0))) AS headroom, arg_max(step, absmax) AS worst_step,
               max(coalesce(nan_count, 0) + coalesce(inf_count, 0)) > 0 AS nonfinite,
               any_value(op_type) AS op_type, min(seq) AS seq
        FROM timeline WHERE run_id = ? AND role IN ({marks}) GROUP BY op ORDER BY op""",
                [fmt_max, run_id, *roles]))
