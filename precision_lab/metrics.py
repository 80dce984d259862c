"""Reference-vs-candidate comparison metrics: one definition each.

Everything is accumulated in float64 over chunks, so a pair of fp16 tensors
is compared exactly as their float64 images.  Positions where either side is
non-finite are excluded from the error moments and counted instead.

Definitions (r = reference, c = candidate, over positions finite in both):
  max_abs_err   max |c - r|
  mean_abs_err  mean |c - r|
  rmse          sqrt(mean (c - r)^2)
  max_rel_err   max |c - r| / max(|r|, rel_floor); ``rel_floor`` is the
                candidate format's smallest normal (fp32's when unknown):
                below it a format cannot hold full relative precision, so
                relative error there would measure underflow, not error.
  cosine        <r, c> / (|r| |c|); ``cosine_deficit`` = 1 - cosine computed
                as |r/|r| - c/|c||^2 / 2, accurate where cosine rounds to 1.
  sqnr_db       10 log10(sum r^2 / sum (c - r)^2); +inf when c == r.
  rounding_units  relative RMS error divided by the candidate format's unit
                roundoff (eps/2): ~1 is what one correctly rounded cast
                costs, so ordinary bf16 rounding is not flagged as a bug.
  max_ulp_err   max |c - r| / ulp_fmt(r), the candidate format's spacing at
                r (subnormal spacing below the normal range).
  nonfinite_introduced  positions finite in r and not finite in c.
  masked        positions masked in both runs: r at or below half the
                reference format's most negative value (``finfo.min`` of a
                mask) and c ``-inf`` or at or below half its own format's;
                they compare as equal and are left out of every error
                (a ``finfo(float32).min`` mask is -inf in fp16, and fp16's
                own ``finfo.min`` is finite: neither is an error).

Where only summary statistics exist (``compare_stats``, basis "stats"), the
element-wise metrics stay None and the summaries s in (max, min, l2norm)
finite on both sides give instead:
  summary_abs_err  max |c_s - r_s|
  summary_rel_err  max |c_s - r_s| / max(|r_s|, rel_floor)
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from .formats import FORMATS, Format, format_for_dtype
from .metric_sums import (KERNEL, _acc_of_rows, _np_flat, _numba_accumulate, _numba_kernel, _numpy_accumulate,
                          _torch_accumulate, _torch_rows)
from .numba_loader import SMALL_NUMPY, note_fallback, over_budget

__all__ = ["Comparison", "compare", "compare_later", "finish_all", "PendingComparison", "compare_stats", "verdict_for",
           "VERDICT_THRESHOLDS", "SUMMARY_ERRORS", "ELEMENTWISE", "ON_SUMMARIES", "relative_error"]

# rounding_units at or below which a difference is what the candidate format's
# own rounding explains (accumulated over a network it grows with depth).
VERDICT_THRESHOLDS = {"expected": 8.0, "warn": 64.0}
# the worst single element may drift further than the RMS before "expected" is
# withdrawn: its relative error in unit roundoffs of the candidate format ...
WORST_ELEMENT_UNITS = VERDICT_THRESHOLDS["warn"]
# ... and never by as much as the value itself (100 %): no rounding explains that
WORST_ELEMENT_REL = 1.0

_CHUNK = 1 << 22


@dataclass(frozen=True)
class Comparison:
    basis: str  # "tensor" (element-wise) or "stats" (summary statistics only)
    numel: int
    compared: int  # positions finite on both sides
    max_abs_err: Optional[float]
    mean_abs_err: Optional[float]
    rmse: Optional[float]
    max_rel_err: Optional[float]
    rel_floor: Optional[float]
    cosine: Optional[float]
    cosine_deficit: Optional[float]
    sqnr_db: Optional[float]
    rounding_units: Optional[float]
    max_ulp_err: Optional[float]
    nonfinite_introduced: int
    nonfinite_in_ref: int
    cand_format: Optional[str]
    verdict: str  # "expected" | "warn" | "error" | "nonfinite"
    reason: str
    # basis "stats" only: how far the summaries (max, min, l2norm) differ, never an element's error
    summary_abs_err: Optional[float] = None
    summary_rel_err: Optional[float] = None
    masked: int = 0  # positions masked in both runs, compared as equal (see the module doc)

    def to_dict(self) -> dict:
        return asdict(self)


# a comparison on summary statistics alone (basis "stats"): how far its summaries moved, never an element's error
SUMMARY_ERRORS = ("summary_abs_err", "summary_rel_err")
ELEMENTWISE, ON_SUMMARIES = "element-wise", "on summary statistics"


def relative_error(max_rel_err: Optional[float], summary_rel_err: Optional[float]) -> tuple[Optional[float], str]:
    """``(relative error, how it was measured)`` of a comparison: its element-wise ``max_rel_err``, else its
    summaries' ``summary_rel_err``; (None, ...) when it has neither (a table row's NaN counts as none)."""
    if max_rel_err is not None and max_rel_err == max_rel_err:
        return max_rel_err, ELEMENTWISE
    v = summary_rel_err
    return (v if v is not None and v == v else None), ON_SUMMARIES


def _numel(x) -> int:
    return int(x.size) if isinstance(x, np.ndarray) else int(x.numel())


def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def _judged_format(cand_dtype, cand_format: Optional[str]) -> tuple[Format, float]:
    """The format a candidate is judged against (``cand_format``, else its dtype's, else fp32) and the floor of
    the relative error's denominator (its smallest normal; 1 on an integer grid)."""
    fmt = FORMATS[cand_format] if cand_format else (format_for_dtype(cand_dtype) or FORMATS["fp32"])
    return fmt, (fmt.smallest_normal if fmt.kind != "int" else 1.0)


def _mask_levels(ref_dtype, fmt: Format) -> tuple[float, float]:
    """(reference, candidate) levels at or below which a value is a mask's: half each format's most negative
    finite value (the reference's format from its dtype, fp32 when unknown); -inf for an integer format."""
    rf = format_for_dtype(ref_dtype) or FORMATS["fp32"]
    level = lambda f: -f.max / 2 if f.kind == "float" else -math.inf  # noqa: E731
    return level(rf), level(fmt)


def _ulp_params(fmt: Format) -> tuple[int, int]:
    """(smallest normal exponent, mantissa bits) for the ulp of ``fmt``; int grid: spacing 1."""
    if fmt.kind == "int":
        return 0, 0
    return fmt.emin, fmt.man_bits


class PendingComparison:
    """An element-wise comparison whose sums are still on the device (``compare_later``); ``finish_all``
    brings many to the host in one transfer."""

    __slots__ = ("rows", "n", "rel_floor", "fmt")

    def __init__(self, rows, n: int, rel_floor: float, fmt: Format):
        self.rows, self.n, self.rel_floor, self.fmt = rows, n, rel_floor, fmt


_DEVICE_CHUNK = 1 << 20  # float64 temporaries of about 10 x 8 MiB per chunk on the device


def compare_later(reference, candidate, *, cand_format: Optional[str] = None, chunk: int = _DEVICE_CHUNK
                  ) -> PendingComparison:
    """``compare`` on the torch path, its sums left on the tensors' device: no host sync until ``finish_all``.
    Chunks of ``chunk`` elements bound the float64 temporaries; each leaves one row of 11 sums."""
    _check_shapes(reference, candidate)
    fmt, rel_floor = _judged_format(candidate.dtype, cand_format)
    emin, man_bits = _ulp_params(fmt)
    rows = _torch_rows(reference, candidate, rel_floor, emin, man_bits, chunk, *_mask_levels(reference.dtype, fmt))
    return PendingComparison(rows, _numel(reference), rel_floor, fmt)


def finish_all(pending) -> list[Comparison]:
    """The ``Comparison`` of each pending one, in order: their sums brought to the host in one transfer per
    device."""
    import torch

    by_device: dict = {}
    for i, p in enumerate(pending):
        if p.rows is not None:
            by_device.setdefault(p.rows.device, []).append(i)
    host: dict = {}
    for idx in by_device.values():
        stacked = torch.cat([pending[i].rows for i in idx]).cpu().tolist()  # the one transfer of this device
        k = 0
        for i in idx:
            m = pending[i].rows.shape[0]
            host[i] = stacked[k:k + m]
            k += m
    return [_finish(_acc_of_rows(host.get(i, [])), p.n, p.rel_floor, p.fmt) for i, p in enumerate(pending)]


def _cosine_deficit(s_rr: float, s_cc: float, s_rd: float, s_dd: float) -> float:
    """1 - cos(r, c) without cancellation, from one-pass sums with d = c - r.

    1 - cos = (|r||c| - r.c) / (|r||c|), r.c = |r|^2 + r.d, and
    |c| - |r| = (2 r.d + |d|^2) / (|c| + |r|), so the numerator is
    (|r||d|^2 (|c|+|r|) - r.d (2 r.d + |d|^2)) / (|c|+|r|)^2: no difference of
    nearly equal large numbers, so a deficit of 1e-15 is resolved.
    """
    nr, nc = math.sqrt(s_rr), math.sqrt(s_cc)
    t = nc + nr
    num = (nr * s_dd * t - s_rd * (2.0 * s_rd + s_dd)) / (t * t)
    return max(0.0, num / (nr * nc))


def _finish(acc: dict, n: int, rel_floor: float, fmt: Format) -> Comparison:
    cnt = int(acc["count"])
    nf_intro, nf_ref, masked = int(acc["nf_intro"]), int(acc["nf_ref"]), int(acc.get("masked", 0))
    said = (f"; {masked} position(s) masked in both runs compare as equal" if masked else "")
    if cnt == 0:
        if masked and not nf_intro:
            verdict, reason = "expected", "every finite position is masked in both runs"
        else:
            verdict, reason = verdict_for(nonfinite_introduced=nf_intro, rounding_units=None)
            reason += said
        return Comparison("tensor", n, 0, None, None, None, None, rel_floor, None, None, None, None, None,
                          nf_intro, nf_ref, fmt.name, verdict, reason, masked=masked)
    s_rr, s_cc, s_rd, s_dd = acc["s_rr"], acc["s_cc"], acc["s_rd"], acc["s_dd"]
    if s_rr > 0 and s_cc > 0:
        deficit = _cosine_deficit(s_rr, s_cc, s_rd, s_dd)
        cosine = 1.0 - deficit
    elif s_rr == 0 and s_cc == 0:
        cosine, deficit = 1.0, 0.0
    else:
        cosine, deficit = 0.0, 1.0
    sqnr = math.inf if s_dd == 0 else (10.0 * math.log10(s_rr / s_dd) if s_rr > 0 else -math.inf)
    rmse = math.sqrt(s_dd / cnt)
    rms_ref = math.sqrt(s_rr / cnt)
    unit_roundoff = fmt.eps / 2 if fmt.kind != "int" else 0.5
    if rms_ref > 0:
        rounding_units = (rmse / rms_ref) / unit_roundoff
    else:
        rounding_units = 0.0 if rmse == 0 else math.inf
    verdict, reason = verdict_for(nonfinite_introduced=nf_intro, rounding_units=rounding_units,
                                  max_rel_err=scaled_worst(acc["max_rel"], acc["max_ad"], rms_ref),
                                  unit_roundoff=unit_roundoff)
    return Comparison(
        "tensor", n, cnt, acc["max_ad"], acc["s_ad"] / cnt, rmse, acc["max_rel"], rel_floor, cosine, deficit, sqnr,
        rounding_units, acc["max_ulp"], nf_intro, nf_ref, fmt.name, verdict, reason + said, masked=masked,
    )


def scaled_worst(max_rel_err: Optional[float], max_abs_err: Optional[float], rms_ref: float) -> Optional[float]:
    """The worst element's error relative to max(|its reference value|, the reference's RMS), bounded from the
    pass's own sums: ``min(max_rel_err, max_abs_err / rms)`` (each is at least that error for every element).  A
    value near zero in a sum of large terms carries the absolute rounding of those terms (a near-zero attention
    score of a 64-wide dot product), so below the tensor's RMS an element is judged against the RMS: its error
    is what it does to the tensor, not a percentage of a value that is rounding noise."""
    if max_rel_err is None or max_abs_err is None or not rms_ref > 0:
        return max_rel_err
    return min(max_rel_err, max_abs_err / rms_ref)


def verdict_for(*, nonfinite_introduced: int, rounding_units: Optional[float],
                max_rel_err: Optional[float] = None, unit_roundoff: Optional[float] = None) -> tuple[str, str]:
    """The verdict of a comparison, judged against the candidate format's own rounding.

    * ``nonfinite``: a value finite in the reference is NaN/Inf in the candidate.
    * By ``rounding_units`` (relative RMS error / unit roundoff u = eps/2 of
      the candidate format): ``expected`` up to ``VERDICT_THRESHOLDS["expected"]``
      (8 u: rounding accumulated over a few ops), ``warn`` up to
      ``VERDICT_THRESHOLDS["warn"]`` (64 u), ``error`` above.
    * An RMS inside rounding can hide a few elements that are far off (values
      near zero, a sign flip): "expected" is withdrawn (``warn``) when the
      worst element's relative error (``max_rel_err``: tensor comparisons pass
      ``scaled_worst``, against max(|r|, the reference's RMS)) exceeds
      ``WORST_ELEMENT_UNITS`` (64) unit roundoffs of the format, or
      ``WORST_ELEMENT_REL`` (100 %) whatever the format: no rounding of the
      values involved explains it.
      Summary-statistics comparisons pass ``summary_rel_err / u`` as
      ``rounding_units`` and are judged by it alone.
    """
    if nonfinite_introduced:
        return "nonfinite", f"{nonfinite_introduced} value(s) finite in the reference are NaN/Inf in the candidate"
    if rounding_units is None or math.isnan(rounding_units):
        return "warn", "no finite positions to compare"
    text = f"error is {rounding_units:.3g}x the format's unit roundoff"
    if rounding_units <= VERDICT_THRESHOLDS["expected"]:
        worst = _worst_element(max_rel_err, unit_roundoff)
        if worst is not None:
            return "warn", f"{text} (RMS), but {worst}"
        return "expected", text
    if rounding_units <= VERDICT_THRESHOLDS["warn"]:
        return "warn", text
    return "error", text


def _worst_element(max_rel_err: Optional[float], unit_roundoff: Optional[float]) -> Optional[str]:
    """Why the worst element is beyond the format's rounding, or None when it is not."""
    if max_rel_err is None or math.isnan(max_rel_err):
        return None
    units = max_rel_err / unit_roundoff if unit_roundoff else math.inf
    if max_rel_err > WORST_ELEMENT_REL or units > WORST_ELEMENT_UNITS:
        return (f"one element is off by {100.0 * max_rel_err:.3g}% of its value (or of the tensor's RMS, where "
                f"it is smaller) ({units:.3g}x the unit roundoff)")
    return None


def _check_shapes(reference, candidate) -> None:
    if _shape(reference) != _shape(candidate):
        if _numel(reference) != _numel(candidate):
            raise ValueError(
                f"cannot compare tensors of shapes {_shape(reference)} (reference) and "
                f"{_shape(candidate)} (candidate): numel {_numel(reference)} != {_numel(candidate)}"
            )
        raise ValueError(
            f"cannot compare tensors of shapes {_shape(reference)} (reference) and {_shape(candidate)} (candidate)"
        )


def compare(reference, candidate, *, cand_format: Optional[str] = None, chunk: int = _CHUNK,
            backend: str = "auto") -> Comparison:
    """Compare two tensors/arrays of the same shape element by element.

    ``cand_format`` names the format whose rounding the candidate went
    through; by default it is inferred from the candidate's dtype (fp32 if it
    is not a registered format).  ``backend``: "auto" (the compiled kernel for
    CPU inputs once it is compiled or cached, else float64 numpy for two
    numpy arrays and torch for tensors), "numba", "torch" or "numpy" (numpy
    arrays only).
    """
    if backend not in ("auto", "numba", "torch", "numpy"):
        raise ValueError(f"backend must be 'auto', 'numba', 'torch' or 'numpy', not {backend!r}")
    _check_shapes(reference, candidate)
    fmt, rel_floor = _judged_format(candidate.dtype, cand_format)
    n = _numel(reference)
    emin, man_bits = _ulp_params(fmt)
    levels = _mask_levels(reference.dtype, fmt)
    acc = None
    small = (isinstance(reference, np.ndarray) and isinstance(candidate, np.ndarray) and reference.size < SMALL_NUMPY
             and not KERNEL.loaded() and not over_budget())  # loading the kernel would cost more (numba_loader)
    if (backend == "numba" and _numba_kernel(wait=True) is not None) or (
            backend == "auto" and not small and _numba_kernel() is not None):
        r, c = _np_flat(reference), _np_flat(candidate)
        if r is not None and c is not None:
            acc = _numba_accumulate(r, c, rel_floor, emin, man_bits, chunk, *levels)
    if acc is None:
        if backend == "numba":
            raise RuntimeError("the numba comparison kernel is unavailable for these inputs")
        t0 = time.thread_time()  # the fallback's time only: a thread's CPU clock is a system call
        numpy_inputs = isinstance(reference, np.ndarray) and isinstance(candidate, np.ndarray)
        if backend == "numpy" and not numpy_inputs:
            raise ValueError("backend='numpy' takes numpy arrays, not torch tensors")
        if numpy_inputs and backend != "torch":
            acc = _numpy_accumulate(reference, candidate, rel_floor, emin, man_bits, chunk, *levels)
        else:
            acc = _torch_accumulate(reference, candidate, rel_floor, emin, man_bits, chunk, *levels)
        if backend == "auto":
            note_fallback(time.thread_time() - t0)  # counted against numba_loader.FALLBACK_BUDGET_S
    return _finish(acc, n, rel_floor, fmt)


def _introduced_by_counts(r, c) -> int:
    """Non-finite values the candidate has beyond the reference's, from statistics alone: NaN, +inf and -inf
    counted apart where both sides counted them (a mask's -inf in both is not introduced), else 1 when the
    candidate is non-finite and the reference is not, or its Min/Max went non-finite where the reference's
    did not."""
    if None not in (r.nan_count, r.inf_count, c.nan_count, c.inf_count):
        n = max(0, c.nan_count - r.nan_count)
        if r.neg_inf_count is not None and c.neg_inf_count is not None:
            n += max(0, c.neg_inf_count - r.neg_inf_count)
            n += max(0, (c.inf_count - c.neg_inf_count) - (r.inf_count - r.neg_inf_count))
        else:
            n += max(0, c.inf_count - r.inf_count)
        return n
    if not c.has_nonfinite:
        return 0
    if not r.has_nonfinite:
        return 1
    worse = [f for f in ("min", "max") if getattr(c, f) is not None and not math.isfinite(getattr(c, f))
             and getattr(r, f) is not None and math.isfinite(getattr(r, f))]
    return 1 if worse else 0


def compare_stats(ref_stats, cand_stats, *, cand_format: Optional[str] = None) -> Comparison:
    """A stats-level comparison where only summary statistics exist on a side.

    It compares the summaries (max, min, l2norm; the mean cancels and is
    left out), not elements, so the element-wise fields (``max_abs_err``,
    ``max_rel_err``, ...) stay None: ``summary_abs_err`` is the largest
    absolute difference among the summaries, ``summary_rel_err`` the largest
    relative one (against max(|reference summary|, rel_floor)); the verdict
    is judged from ``summary_rel_err``.  A non-finite ``l2norm`` with finite
    max/min is a norm-arithmetic artefact (msprobe computes norms in the
    tensor's dtype), not a non-finite value.
    """
    fmt, rel_floor = _judged_format(cand_stats.dtype, cand_format)
    nonfinite_ref = ref_stats.has_nonfinite
    nf_intro = _introduced_by_counts(ref_stats, cand_stats)
    masked = 0
    ref_level = _mask_levels(ref_stats.dtype, fmt)[0]
    if nf_intro and cand_stats.negative_inf_only and ref_stats.min is not None and ref_stats.min <= ref_level:
        # the candidate's new -inf sit where the reference holds a mask's finfo.min: masked in both runs
        masked, nf_intro = nf_intro, 0
    diffs, rels = [], []
    # the mean is left out: it cancels, so its relative change says little
    for f in ("max", "min", "l2norm"):
        a, b = getattr(ref_stats, f), getattr(cand_stats, f)
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            continue
        diffs.append(abs(b - a))
        rels.append(abs(b - a) / max(abs(a), rel_floor))
    max_abs = max(diffs) if diffs else None
    max_rel = max(rels) if rels else None
    if nf_intro:
        verdict, reason = "nonfinite", ("candidate summary shows NaN/Inf where the reference is finite"
                                        if not nonfinite_ref else
                                        f"candidate holds {nf_intro} more NaN/Inf than the reference")
    elif max_rel is None:
        verdict, reason = "warn", "no comparable summary statistics"
    else:
        units = max_rel / (fmt.eps / 2 if fmt.kind != "int" else 0.5)
        verdict, reason = verdict_for(nonfinite_introduced=0, rounding_units=units)
        reason = "summary statistics: " + reason
    if masked:
        reason += "; its -inf sit where the reference holds a mask's most negative value (masked in both runs)"
    return Comparison(
        "stats", int(cand_stats.numel), 0, None, None, None, None, rel_floor, None, None, None,
        None, None, nf_intro, int(nonfinite_ref), fmt.name, verdict, reason,
        summary_abs_err=max_abs, summary_rel_err=max_rel, masked=masked,
    )
