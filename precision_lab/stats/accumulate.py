"""Running totals of one tensor's statistics, merged across chunks and across tensors (float64, exact counts)."""

from __future__ import annotations

import math
import sys

import numpy as np

from .edges import N_BINS
from .records import TensorStats, canonical_dtype


# ---------------------------------------------------------------------------
# accumulation (shared by both backends and by merge_stats)
# ---------------------------------------------------------------------------

class _Acc:
    """Running totals.  M2 and the sum of squares are kept as ``m2s * 4**k`` and
    ``ssqs * 4**k`` so float64 inputs near 1e308 do not overflow."""

    __slots__ = ("nan", "inf", "neginf", "zero", "nfin", "vmin", "vmax", "absmax", "minabs",
                 "mean", "m2s", "ssqs", "k", "hist", "thr", "above")

    def __init__(self, histogram: bool, thr=None) -> None:
        """``thr``: float32 bit patterns (uint32, read-only) whose counts at or above the compiled scan keeps in
        ``above``, without the histogram."""
        self.nan = self.inf = self.neginf = self.zero = self.nfin = 0
        self.vmin, self.vmax = math.inf, -math.inf
        self.absmax, self.minabs = -math.inf, math.inf
        self.mean = self.m2s = self.ssqs = 0.0
        self.k = 0
        self.hist = np.zeros(N_BINS, dtype=np.int64) if histogram else None
        self.thr = thr
        self.above = np.zeros(len(thr), dtype=np.int64) if thr is not None else None

    def add_extrema(self, vmin, vmax, absmax, minabs) -> None:
        self.vmin = min(self.vmin, vmin)
        self.vmax = max(self.vmax, vmax)
        self.absmax = max(self.absmax, absmax)
        self.minabs = min(self.minabs, minabs)

    def add_moments(self, n: int, mean: float, m2s: float, ssqs: float, k: int) -> None:
        """Chan et al.'s parallel merge of (count, mean, M2), scaled by 2**k."""
        if n == 0:
            return
        if self.nfin == 0:
            self.nfin, self.mean, self.m2s, self.ssqs, self.k = n, mean, m2s, ssqs, k
            return
        kk = max(self.k, k)
        a_m2 = math.ldexp(self.m2s, 2 * (self.k - kk))
        a_ss = math.ldexp(self.ssqs, 2 * (self.k - kk))
        b_m2 = math.ldexp(m2s, 2 * (k - kk))
        b_ss = math.ldexp(ssqs, 2 * (k - kk))
        na, nb = self.nfin, n
        tot = na + nb
        d = math.ldexp(mean, -kk) - math.ldexp(self.mean, -kk)  # scaled delta, cannot overflow
        self.mean = self.mean + math.ldexp(d * (nb / tot), kk)
        self.m2s = a_m2 + b_m2 + d * d * (na * (nb / tot))
        self.ssqs = a_ss + b_ss
        self.k = kk
        self.nfin = tot

    def result(self, *, numel: int, dtype: str, shape: tuple) -> TensorStats:
        nan = float("nan")
        fin = self.nfin > 0
        return TensorStats(
            numel=int(numel), dtype=dtype, shape=tuple(shape),
            nan_count=int(self.nan), inf_count=int(self.inf), zero_count=int(self.zero),
            min=float(self.vmin) if fin else nan,
            max=float(self.vmax) if fin else nan,
            absmax=float(self.absmax) if fin else nan,
            min_abs_nonzero=float(self.minabs) if fin and self.minabs < math.inf else nan,
            mean=float(self.mean) if fin else nan,
            std=_ldexp(math.sqrt(max(self.m2s, 0.0) / self.nfin), self.k) if fin else nan,
            l2norm=_ldexp(math.sqrt(self.ssqs), self.k) if fin else nan,
            hist=self.hist, neg_inf_count=int(self.neginf),
        )


def _ldexp(m: float, k: int) -> float:
    """math.ldexp that returns inf (a norm of float64 values can exceed float64's range)."""
    try:
        return math.ldexp(m, k)
    except OverflowError:
        return math.inf


def _extreme(fn, x, y, nx, ny):
    """``fn`` (min or max) of two sides' extrema; a side with no finite values carries nan and is ignored."""
    if x is None or y is None:
        if nx == 0 and y is not None:
            return y
        if ny == 0 and x is not None:
            return x
        return None
    xs = [v for v, n in ((x, nx), (y, ny)) if not (isinstance(v, float) and math.isnan(v)) and n != 0]
    if not xs:
        return float("nan")
    return float(fn(xs))


def _merged_moments(a: TensorStats, b: TensorStats, na, nb) -> tuple:
    """(mean, std, l2norm) of both sides' finite values by Chan's formula, each side scaled by a power of two
    first (a norm of float64 values can exceed float64's range); None where a side's are unknown."""
    mean = std = l2 = None
    if None not in (na, nb, a.mean, b.mean, a.std, b.std, a.l2norm, b.l2norm):
        acc = _Acc(False)
        for s, n in ((a, na), (b, nb)):
            if n:
                scale = max(abs(s.mean), s.std, s.l2norm)
                k = math.frexp(scale)[1] if scale > 0 and math.isfinite(scale) else 0
                acc.add_moments(n, s.mean, math.ldexp(s.std, -k) ** 2 * n, math.ldexp(s.l2norm, -k) ** 2, k)
        if acc.nfin:
            mean = acc.mean
            std = _ldexp(math.sqrt(max(acc.m2s, 0.0) / acc.nfin), acc.k)
            l2 = _ldexp(math.sqrt(acc.ssqs), acc.k)
        else:
            mean = std = l2 = float("nan")
    elif na is not None and nb is not None and na + nb == 0:
        mean = std = l2 = float("nan")
    return mean, std, l2


def merge_stats(a: TensorStats, b: TensorStats) -> TensorStats:
    """Statistics of the concatenation of the tensors behind ``a`` and ``b``.

    Counts and histograms add exactly; extrema combine exactly; mean, std and
    l2norm combine with Chan's parallel formula (equal to the one-shot values
    up to float64 rounding).  Fields unknown in either input are None
    (histogram None unless both have one).  The shape is ``(a0 + b0, *rest)``
    when the trailing dimensions agree, else flat.
    """
    numel = a.numel + b.numel
    if a.shape[1:] == b.shape[1:] and len(a.shape) >= 1 and len(b.shape) >= 1:
        shape = (a.shape[0] + b.shape[0],) + tuple(a.shape[1:])
    else:
        shape = (numel,)
    dtype = a.dtype if a.dtype == b.dtype else _promote_dtype_name(a.dtype, b.dtype)

    def add(x, y):
        return None if x is None or y is None else x + y

    nan_c, inf_c, zero_c = add(a.nan_count, b.nan_count), add(a.inf_count, b.inf_count), add(a.zero_count, b.zero_count)
    na, nb = a.finite_count, b.finite_count

    vmin = _extreme(min, a.min, b.min, na, nb)
    vmax = _extreme(max, a.max, b.max, na, nb)
    amax = _extreme(max, a.absmax, b.absmax, na, nb)
    minabs = _extreme(min, a.min_abs_nonzero, b.min_abs_nonzero, na, nb)

    mean, std, l2 = _merged_moments(a, b, na, nb)

    hist = None if a.hist is None or b.hist is None else a.hist + b.hist
    return TensorStats(
        numel=numel, dtype=dtype, shape=shape, nan_count=nan_c, inf_count=inf_c, zero_count=zero_c,
        min=vmin, max=vmax, absmax=amax, min_abs_nonzero=minabs, mean=mean, std=std, l2norm=l2, hist=hist,
        neg_inf_count=add(a.neg_inf_count, b.neg_inf_count),
    )


def _promote_dtype_name(a: str, b: str) -> str:
    torch = sys.modules.get("torch")
    if torch is not None:
        ta, tb = getattr(torch, a, None), getattr(torch, b, None)
        if isinstance(ta, torch.dtype) and isinstance(tb, torch.dtype):
            try:
                return canonical_dtype(torch.promote_types(ta, tb))
            except Exception:  # pragma: no cover - exotic pairs
                pass
    try:
        return np.promote_types(a, b).name
    except Exception:
        return "mixed"
