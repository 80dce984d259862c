"""Alerts over a long run's timeline: rules as data, evaluated causally.

Every rule at step ``s`` reads only steps ``<= s``, so the step an alert
names is the step a live run would have raised it at.  An alert is reported
once per (run, op, rule): at the first step it fires, with how many steps it
held.

The rules (``ALERT_RULES``; thresholds are their ``params``):

- ``headroom``: |x| max is less than ``bits`` bits below the max of the op's
  format (log2(max / absmax) < bits).
- ``underflow``: more than ``share`` of the op's finite values round to zero
  or to a subnormal in the op's format, or were flushed to zero (nonzero in
  the fp32 reference, zero in the run, where the reference reaches below half
  the format's smallest subnormal: ``quantisation.flushed_by_underflow``);
  Transformer Engine's fp8 autoswitch default is 5%.
- ``growth``: a least-squares fit of log2(absmax) against the step over the
  last ``window`` steps (r^2 >= ``min_r2``) reaches log2(format max) within
  ``steps`` steps.
- ``loss_scale``: a GradScaler's scale fell ``factor`` times below the
  largest it has been (repeated overflow skips).
- ``grad_spike``: the global gradient norm is ``factor`` times the median of
  the previous ``window`` steps (at least ``min_history`` of them).

The op's format is its own dtype when that is a low-precision format (fp16,
bf16, fp8...); for fp32 ops it is the ``target`` format asked for, if any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from .display import num_text
from .formats import Format, format_for_dtype, get_format

__all__ = ["AlertRule", "Alert", "ALERT_RULES", "RULES_BY_NAME", "op_alerts", "loss_scale_alerts",
           "grad_spike_alerts", "op_format", "headroom_bits"]


@dataclass(frozen=True)
class AlertRule:
    name: str
    scope: str  # "op" (per op's series) or "step" (per run)
    what: str  # one line, for the rules table
    params: dict = field(default_factory=dict, hash=False, compare=False)


ALERT_RULES: tuple[AlertRule, ...] = (
    AlertRule("headroom", "op", "|x| max within {bits} bits of the format's max", {"bits": 2.0}),
    AlertRule("underflow", "op", "more than {share:.0%} of finite values round to zero or a subnormal, or were "
              "flushed to zero", {"share": 0.05}),
    AlertRule("growth", "op", "log2 |x| max, fitted over the last {window} steps, reaches the format's max "
              "within {steps} steps", {"window": 6, "steps": 50, "min_r2": 0.6}),
    AlertRule("loss_scale", "step", "the loss scale fell {factor:g}x below its peak", {"factor": 64.0}),
    AlertRule("grad_spike", "step", "gradient norm {factor:g}x the median of the previous {window} steps",
              {"factor": 10.0, "window": 20, "min_history": 5}),
)
RULES_BY_NAME = {r.name: r for r in ALERT_RULES}


@dataclass(frozen=True)
class Alert:
    run: str
    op: Optional[str]  # None for a whole-step rule
    step: int  # the first step it fired at
    rule: str
    message: str
    value: float
    threshold: float
    steps_firing: int  # how many steps it held (causally, up to the run's last step)


_FULL = 31  # formats with a 31+ bit range (fp32 and wider) are not judged without a target


def op_format(dtype: Optional[str], target: Optional[str] = None) -> Optional[Format]:
    """The format an op's values are judged in: its own low-precision format, else ``target``."""
    f = format_for_dtype(dtype) if dtype else None
    if f is not None and f.bits < 32 and f.name != "tf32":
        return f
    return get_format(target) if target else None


def headroom_bits(absmax, fmt: Format) -> np.ndarray | np.floating:
    """log2(fmt.max / absmax): how many doublings the largest magnitude has left (numpy-aware)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log2(fmt.max / np.asarray(absmax, dtype=np.float64))


def _params(rule: str, overrides: Optional[dict]) -> dict:
    p = dict(RULES_BY_NAME[rule].params)
    if overrides and rule in overrides:
        p.update(overrides[rule])
    return p


def _first(mask: np.ndarray) -> Optional[int]:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def _rolling_fit(x: np.ndarray, y: np.ndarray, w: int):
    """Slope and r^2 of y against x over each window of ``w`` consecutive points ending at i (nan before)."""
    n = len(x)
    slope = np.full(n, np.nan)
    r2 = np.full(n, np.nan)
    if n < w:
        return slope, r2
    c = lambda v: np.concatenate(([0.0], np.cumsum(v)))  # noqa: E731
    sx, sy, sxx, syy, sxy = c(x), c(y), c(x * x), c(y * y), c(x * y)
    i = np.arange(w, n + 1)
    Sx, Sy = sx[i] - sx[i - w], sy[i] - sy[i - w]
    Sxx, Syy, Sxy = sxx[i] - sxx[i - w], syy[i] - syy[i - w], sxy[i] - sxy[i - w]
    vx, vy, cxy = w * Sxx - Sx * Sx, w * Syy - Sy * Sy, w * Sxy - Sx * Sy
    with np.errstate(divide="ignore", invalid="ignore"):
        slope[w - 1:] = cxy / vx
        r2[w - 1:] = np.where(vy > 0, cxy * cxy / (vx * vy), 1.0)
    return slope, r2


def op_alerts(run: str, op: str, steps: Sequence[int], absmax: Sequence[float], fmt: Format,
              low_share: Optional[Sequence[float]] = None, overrides: Optional[dict] = None,
              flushed_share: Optional[Sequence[float]] = None) -> list[Alert]:
    """Alerts of one op's series (steps ascending; ``absmax`` over finite values, NaN where none;
    ``low_share``: share of finite values that round to zero or a subnormal in ``fmt``, NaN where unknown;
    ``flushed_share``: share of its values that are zero where the reference's are not, NaN where unknown)."""
    steps = np.asarray(steps, dtype=np.int64)
    a = np.asarray(absmax, dtype=np.float64)
    out: list[Alert] = []
    fmax = fmt.max
    head = headroom_bits(a, fmt)
    ok = np.isfinite(a) & (a > 0)

    p = _params("headroom", overrides)
    fire = ok & (head < p["bits"])
    i = _first(fire)
    if i is not None:
        out.append(Alert(run, op, int(steps[i]), "headroom",
                         f"{op}: |x| max {num_text(a[i])} is {head[i]:.2f} bits below {fmt.name}'s max "
                         f"{num_text(fmax)} at step {steps[i]} (alert below {p['bits']:g} bits)",
                         float(head[i]), float(p["bits"]), int(fire.sum())))

    if low_share is not None or flushed_share is not None:
        under = _underflow_alert(run, op, steps, fmt, low_share, flushed_share, overrides)
        if under is not None:
            out.append(under)

    p = _params("growth", overrides)
    w = int(p["window"])
    if ok.sum() >= w:
        xs, ys, at = steps[ok].astype(np.float64), np.log2(a[ok]), np.flatnonzero(ok)
        slope, r2 = _rolling_fit(xs, ys, w)
        with np.errstate(divide="ignore", invalid="ignore"):
            left = (math.log2(fmax) - ys) / slope
        fire = (slope > 0) & (r2 >= p["min_r2"]) & (left <= p["steps"]) & (left >= 0)
        i = _first(fire)
        if i is not None:
            j = at[i]
            eta = int(steps[j] + math.ceil(left[i]))
            out.append(Alert(run, op, int(steps[j]), "growth",
                             f"{op}: |x| max {num_text(a[j])} grows {slope[i]:.2f} bits/step (fit over steps "
                             f"{int(xs[i - w + 1])}-{int(xs[i])}, r\u00b2 {r2[i]:.2f}); at this rate it passes "
                             f"{fmt.name}'s max {num_text(fmax)} in ~{left[i]:.0f} steps (step {eta})",
                             float(left[i]), float(p["steps"]), int(fire.sum())))
    return out


def _underflow_alert(run: str, op: str, steps: np.ndarray, fmt: Format, low_share: Optional[Sequence[float]],
                     flushed_share: Optional[Sequence[float]], overrides: Optional[dict]) -> Optional[Alert]:
    """The ``underflow`` alert of one op's series: the first step where the share of values lost to underflow
    (rounded to zero or a subnormal, or flushed to zero where the reference's are not) passes the rule's share."""
    p = _params("underflow", overrides)
    low = np.asarray(low_share if low_share is not None else np.full(len(steps), np.nan), dtype=np.float64)
    gone = np.asarray(flushed_share if flushed_share is not None else np.full(len(steps), np.nan),
                      dtype=np.float64)
    known = np.isfinite(low) | np.isfinite(gone)
    s = np.where(known, np.nan_to_num(low) + np.nan_to_num(gone), np.nan)
    fire = np.isfinite(s) & (s > p["share"])
    i = _first(fire)
    if i is None:
        return None
    parts = []
    if np.isfinite(low[i]) and (low[i] > 0 or not gone[i] > 0):
        parts.append(f"{low[i]:.1%} of its finite values round to zero or a subnormal in {fmt.name} (below "
                     f"its smallest normal {num_text(fmt.smallest_normal)})")
    if np.isfinite(gone[i]) and gone[i] > 0:
        parts.append(f"{gone[i]:.1%} of its values were flushed to zero in {fmt.name} (nonzero in the "
                     f"reference; below half its smallest subnormal {num_text(fmt.smallest_positive)})")
    return Alert(run, op, int(steps[i]), "underflow",
                 f"{op}: {' and '.join(parts)} at step {steps[i]} (alert above {p['share']:.0%})",
                 float(s[i]), float(p["share"]), int(fire.sum()))


def loss_scale_alerts(run: str, steps: Sequence[int], scales: Sequence[float],
                      overrides: Optional[dict] = None) -> list[Alert]:
    p = _params("loss_scale", overrides)
    steps = np.asarray(steps, dtype=np.int64)
    s = np.asarray(scales, dtype=np.float64)
    if not s.size:
        return []
    peak = np.fmax.accumulate(s)
    with np.errstate(divide="ignore", invalid="ignore"):
        drop = peak / s
    fire = np.isfinite(drop) & (drop >= p["factor"])
    i = _first(fire)
    if i is None:
        return []
    return [Alert(run, None, int(steps[i]), "loss_scale",
                  f"loss scale {num_text(s[i])} at step {steps[i]} is {drop[i]:g}x below its peak {num_text(peak[i])}: "
                  "the scaler keeps skipping steps because gradients overflow", float(drop[i]), float(p["factor"]),
                  int(fire.sum()))]


def grad_spike_alerts(run: str, steps: Sequence[int], norms: Sequence[float],
                      overrides: Optional[dict] = None) -> list[Alert]:
    p = _params("grad_spike", overrides)
    steps = np.asarray(steps, dtype=np.int64)
    g = np.asarray(norms, dtype=np.float64)
    w, need = int(p["window"]), int(p["min_history"])
    ratio = np.full(len(g), np.nan)
    for i in range(need, len(g)):
        hist = g[max(0, i - w):i]
        hist = hist[np.isfinite(hist)]
        if len(hist) >= need:
            med = float(np.median(hist))
            if med > 0:
                ratio[i] = g[i] / med if np.isfinite(g[i]) else np.inf
    fire = np.isfinite(ratio) & (ratio >= p["factor"]) | np.isinf(ratio)
    i = _first(fire)
    if i is None:
        return []
    n = min(w, i)
    if np.isfinite(ratio[i]):
        msg = f"gradient norm {num_text(g[i])} at step {steps[i]} is {ratio[i]:.3g}x the median of the previous {n} steps"
    else:  # a non-finite norm is no multiple of anything
        prev = g[max(0, i - w):i]
        msg = (f"gradient norm at step {steps[i]} is not finite (the median of the previous {n} steps: "
               f"{num_text(float(np.median(prev[np.isfinite(prev)])))})")
    return [Alert(run, None, int(steps[i]), "grad_spike", msg,
                  float(ratio[i]), float(p["factor"]), int(fire.sum()))]
