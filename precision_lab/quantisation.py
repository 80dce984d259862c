"""What one fake-quantise op did to its tensor, in the narrow format's terms: facts in, a frozen verdict out.

A quantise op (``ops`` type ``quantise``: ``FakeQuant``, ``fake_quant``, ...) scales a tensor so its amax
lands on the format's max, rounds it to the format and scales back.  One outlier sets the scale for every
value: the smaller ones fall below the format's smallest subnormal times the scale and *flush to zero*.  A
comparison against the op re-run in fp32 cannot see that (the re-run quantises too), so the op is judged
against its own input:

- ``flushed``: values nonzero in the input and zero in the output (exact, from the two zero counts);
- ``outlier_ratio``: amax over the 99.9th percentile of |x| (from the input's magnitude histogram, whose bins
  are powers of two: the percentile is the upper edge of its bin, so the ratio is a lower bound within 2x);
- ``saturated``: values above the amax the scale was built from (a clipped or calibrated amax), at least the
  input histogram's count of bins wholly above it.

``verdict``: ``error`` when at least ``FLUSH_ERROR`` of the values flush to zero, ``warn`` from
``FLUSH_WARN`` or when ``SATURATE_WARN`` of them saturate, else ``expected``.  ``message`` says it in the
format's terms ("one value of 1.0e+04 sets the fp8_e4m3fn scale: 32% of values (657 of 2,048) round to 0").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .formats import FORMATS
from .stats import TensorStats
from .stats.edges import HIST_EDGES

__all__ = ["QuantFacts", "quant_facts", "flushed_count", "flushed_by_underflow", "percentile_of", "FLUSH_ERROR", "FLUSH_WARN", "SATURATE_WARN",
           "QUANT_FIXES"]

FLUSH_ERROR = 0.05  # share of the values that flush to zero before a quantise op's verdict is "error"
FLUSH_WARN = 0.01
SATURATE_WARN = 0.001
# fixes that address a scale set by outliers: one scale per row, a clipped (percentile) amax
QUANT_FIXES = ("scaling:row", "amax-percentile:99.9")


@dataclass(frozen=True)
class QuantFacts:
    op: str
    fmt: str
    numel: int
    flushed: int  # nonzero in the input, zero after quantisation
    saturated: Optional[int]  # above the amax the scale was built from (None: unknown)
    amax: Optional[float]
    p999: Optional[float]  # 99.9th percentile of |x| (upper edge of its histogram bin)
    verdict: str
    message: str

    @property
    def flushed_share(self) -> float:
        return self.flushed / self.numel if self.numel else 0.0

    @property
    def outlier_ratio(self) -> Optional[float]:
        if self.amax is None or not self.p999:
            return None
        return self.amax / self.p999


def flushed_count(before_zeros, after_zeros) -> int:
    """Values flushed to zero: zero after (a cast, a quantisation, the low-precision run) and nonzero before (the
    input, the fp32 reference), from the two zero counts of the same tensor (None counts as none)."""
    return max(0, int(after_zeros or 0) - int(before_zeros or 0))


def flushed_by_underflow(ref_zeros, zeros, ref_smallest, fmt) -> int:
    """Values of a run flushed to zero by its format ``fmt``: zero in the run and nonzero in the reference
    (``flushed_count``), counted only where the reference holds magnitudes ``fmt`` rounds to zero (its
    smallest nonzero |x| below ``fmt.underflow_threshold``); zeros the run made otherwise (a difference
    that cancels exactly) are no underflow."""
    if ref_smallest is None or not math.isfinite(ref_smallest) or not 0 < ref_smallest < fmt.underflow_threshold:
        return 0
    return flushed_count(ref_zeros, zeros)


def percentile_of(hist: Optional[np.ndarray], q: float, zeros: int = 0) -> Optional[float]:
    """The upper edge of the histogram bin holding the ``q``-th percentile of |x| (zeros, not in the
    histogram, counted below every bin); None without a histogram or values."""
    if hist is None:
        return None
    counts = np.asarray(hist, dtype=np.float64)
    total = counts.sum() + zeros
    if total <= 0:
        return None
    need = q / 100.0 * total - zeros
    if need <= 0:
        return 0.0
    i = int(np.searchsorted(np.cumsum(counts), need))
    return float(HIST_EDGES[min(i + 1, len(HIST_EDGES) - 1)])


def _count_above(hist: Optional[np.ndarray], level: float) -> Optional[int]:
    if hist is None:
        return None
    lo = int(np.searchsorted(HIST_EDGES, level, side="right"))  # bins whose lower edge is above the level
    return int(np.asarray(hist)[lo:].sum()) if lo < len(hist) else 0


def quant_facts(op: str, fmt_name: str, x: TensorStats, y: TensorStats, amax: Optional[float] = None) -> QuantFacts:
    """What quantising ``x`` (the op's input) to ``fmt_name`` into ``y`` (its dequantised output) did;
    ``amax``: the value the scale was built from (default: |x|'s max)."""
    fmt = FORMATS[fmt_name]
    n = int(x.numel or 0)
    flushed = flushed_count(x.zero_count, y.zero_count)
    if amax is None or not math.isfinite(amax):
        amax = x.absmax if x.absmax is not None and math.isfinite(x.absmax) else None
    p999 = percentile_of(x.hist, 99.9, int(x.zero_count or 0))
    saturated = None
    if amax is not None and x.hist is not None:
        saturated = _count_above(x.hist, amax)
    share = flushed / n if n else 0.0
    sat_share = (saturated or 0) / n if n else 0.0
    verdict = "error" if share >= FLUSH_ERROR else (
        "warn" if share >= FLUSH_WARN or sat_share >= SATURATE_WARN else "expected")
    parts = []
    if amax is not None:
        scale = amax / fmt.max
        cut = scale * fmt.underflow_threshold
        lead = f"amax {amax:.3g} sets the {fmt.name} scale to {scale:.3g} (amax / {fmt.max:g})"
        if p999 and amax > 8 * p999:
            lead = (f"one outlier sets the {fmt.name} scale: amax {amax:.3g} is {amax / p999:.0f}x or more the "
                    f"99.9th percentile of |x| (below {p999:.3g}), scale {scale:.3g}")
        parts.append(lead)
        parts.append(f"{share:.0%} of values ({flushed:,} of {n:,}) round to 0 in {fmt.name} (every |x| below "
                     f"{cut:.3g}: the scale times half the smallest subnormal, {fmt.smallest_subnormal:.3g} / 2)")
    else:
        parts.append(f"{share:.0%} of values ({flushed:,} of {n:,}) round to 0 in {fmt.name}")
    if saturated:
        parts.append(f"at least {saturated:,} value(s) above amax saturate at {fmt.max:g} x scale")
    return QuantFacts(op, fmt.name, n, flushed, saturated, amax, p999, verdict, ": ".join(parts[:2])
                      + ("; " + parts[2] if len(parts) > 2 else ""))
