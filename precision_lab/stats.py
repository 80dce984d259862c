"""Tensor -> TensorStats: exact counts, float64 moments and a magnitude histogram.

What is computed (``tensor_stats``):

* counts of NaN, +/-Inf and zeros (``-0.0`` counts as zero);
* ``min``, ``max``, ``absmax``, ``min_abs_nonzero`` over the *finite* values;
* ``mean``, population ``std`` (ddof=0) and ``l2norm`` over the finite values,
  accumulated in float64 whatever the input dtype (an fp16 tensor whose norm
  exceeds fp16's largest finite value reports its true norm);
* a histogram of ``|x|`` for the nonzero finite values over the fixed edges
  ``HIST_EDGES``.

The edges contain every power of two from 2^-150 to 2^128 and every
registered format's rounding thresholds (``Format.thresholds()``), so for
*any* registered format the number of values that overflow, underflow to
zero, become subnormal or stay normal is an exact sum over bins
(``TensorStats.representability``), also for records read back from the
store, without the tensor.

Rounding model for ``representability``: round-to-nearest-even of the exact
value (single rounding).  For float32 and narrower inputs this is exactly what
``torch`` and ``ml_dtypes`` casts do (checked exhaustively in the tests).
float64 inputs are classified by their exact value; note that torch and
ml_dtypes convert float64 to fp8/fp16 *through float32*, so a float64 value
within half a float32 ulp of a rounding tie can be cast differently by them.

Performance: on CPU, float32 (and anything converted exactly to float32 per
chunk: fp16, bf16, fp8, fp6, fp4, e8m0, 8/16-bit ints, bool) goes through a
one-pass numba kernel (``parallel=True``) that reads each element once;
everything else, every CUDA tensor and every CPU run without numba uses a
pure-torch path in float64 (``backend="torch"``) that gives the same counts,
extrema and histogram and moments equal to rounding.  Inputs are processed in
chunks of ``chunk_elems`` elements, so a memory-mapped file larger than RAM
works in bounded memory.  numba is imported and the kernel compiled (or
loaded from numba's cache) on first use; ``PRECISION_LAB_NO_NUMBA=1`` forces
the torch path everywhere.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Optional

import numpy as np

from precision_lab.formats import FORMATS, Format, get_format

__all__ = [
    "HIST_EDGES",
    "HIST_EDGES_ID",
    "N_BINS",
    "Representability",
    "SummaryHeadroom",
    "TensorStats",
    "tensor_stats",
    "histogram_counts",
    "merge_stats",
    "numba_available",
    "canonical_dtype",
    "json_float",
    "from_json_float",
]


# ---------------------------------------------------------------------------
# histogram edges
# ---------------------------------------------------------------------------

def _build_edges() -> np.ndarray:
    vals = {0.0, math.inf}
    vals.update(math.ldexp(1.0, k) for k in range(-150, 129))
    for fmt in FORMATS.values():
        vals.update(fmt.thresholds())
    return np.array(sorted(vals), dtype=np.float64)


HIST_EDGES: np.ndarray = _build_edges()
HIST_EDGES.setflags(write=False)
HIST_EDGES_ID: str = hashlib.sha256(HIST_EDGES.tobytes()).hexdigest()[:12]
N_BINS: int = len(HIST_EDGES) - 1


def _edge_index(value: float) -> int:
    """Index of ``value`` in HIST_EDGES; every format threshold is an edge."""
    i = int(np.searchsorted(HIST_EDGES, value))
    if i >= len(HIST_EDGES) or HIST_EDGES[i] != value:  # pragma: no cover - guarded by tests
        raise AssertionError(f"{value!r} is not a histogram edge")
    return i


def histogram_counts(absvals) -> np.ndarray:
    """Counts of the nonzero finite magnitudes of ``absvals`` over HIST_EDGES.

    A plain float64 ``np.searchsorted`` (exact; slow but simple).  Signs are
    ignored, zeros and non-finite values are not counted.
    """
    a = np.abs(np.asarray(absvals, dtype=np.float64).ravel())
    a = a[np.isfinite(a) & (a > 0)]
    idx = np.searchsorted(HIST_EDGES, a, side="right") - 1
    return np.bincount(idx, minlength=N_BINS).astype(np.int64)


# ---------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------

_REPR_FIELDS = ("total", "finite", "zero", "nan", "inf", "overflow", "underflow", "subnormal", "normal")


@dataclass(frozen=True)
class Representability:
    """How a tensor's values would land in ``fmt`` under round-to-nearest-even.

    ``overflow``: finite values whose rounded magnitude exceeds the format's
    max finite (the cast gives inf/NaN, or clamps to max for saturating
    casts).  ``underflow``: nonzero finite values that round to zero.
    ``subnormal``: values that round to a nonzero subnormal.  ``normal``: the
    other nonzero finite values.  ``overflow + underflow + subnormal +
    normal`` is the nonzero finite count; ``zero``, ``nan`` and ``inf`` are the
    tensor's own counts.  Classification uses ``|x|``.

    e8m0 (an unsigned power-of-two scale format) has no zero and no
    subnormals: magnitudes below 2^-127 are clamped up to 2^-127 by
    ml_dtypes and torch, so ``underflow`` and ``subnormal`` are always 0 and
    ``overflow`` counts magnitudes >= 1.5 * 2^127 (the cast gives NaN; the tie
    rounds up there).  int8 is the symmetric grid [-127, 127]: ``overflow``
    counts |x| >= 127.5, ``underflow`` counts 0 < |x| <= 0.5.
    """

    fmt: str
    total: int
    finite: int
    zero: int
    nan: int
    inf: int
    overflow: int
    underflow: int
    subnormal: int
    normal: int
    exact: bool = True

    def fraction(self, field: str) -> float:
        """``getattr(self, field) / total``; 0.0 for an empty tensor."""
        if field not in _REPR_FIELDS or field == "total":
            raise ValueError(f"unknown count {field!r}; choose one of {', '.join(_REPR_FIELDS[1:])}")
        return getattr(self, field) / self.total if self.total else 0.0


@dataclass(frozen=True)
class SummaryHeadroom:
    """What summary statistics alone say about ``fmt`` (no histogram needed).

    ``headroom_bits`` = log2(fmt.max / absmax) (negative: absmax is above the
    format's max); ``footroom_bits`` = log2(min_abs_nonzero / smallest
    positive value of the format).  ``any_overflow`` / ``any_underflow`` are
    exact yes/no answers when ``absmax`` / ``min_abs_nonzero`` are known
    (they are attained by an element), else None.  Counts need the histogram.
    """

    fmt: str
    absmax: Optional[float]
    headroom_bits: Optional[float]
    any_overflow: Optional[bool]
    min_abs_nonzero: Optional[float]
    footroom_bits: Optional[float]
    any_underflow: Optional[bool]


def json_float(v: Optional[float]):
    """A float for strict JSON: non-finite values become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if v is None:
        return None
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def from_json_float(v) -> Optional[float]:
    """The inverse of ``json_float``."""
    if v is None:
        return None
    return float(v)  # float("nan") / float("inf") / float("-inf") parse the strings


_FLOAT_FIELDS = ("min", "max", "absmax", "min_abs_nonzero", "mean", "std", "l2norm")
_COUNT_FIELDS = ("nan_count", "inf_count", "zero_count")


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor.

    ``min/max/absmax/min_abs_nonzero/mean/std/l2norm`` are over the finite
    values (NaN/Inf are counted, not included) and are ``nan`` when there is
    no such value (``min_abs_nonzero`` is ``nan`` when no finite value is
    nonzero).  ``std`` is the population std (ddof=0).  Optional fields are
    None only in summary-only records (``TensorStats.summary_only``), e.g.
    msprobe statistics dumps carrying Max/Min/Mean/Norm; those carry the
    source's own values as given.  ``hist``: int64 counts over HIST_EDGES
    (length N_BINS) of the nonzero finite ``|x|``, or None.
    """

    numel: int
    dtype: str
    shape: tuple
    nan_count: Optional[int]
    inf_count: Optional[int]
    zero_count: Optional[int]
    min: Optional[float]
    max: Optional[float]
    absmax: Optional[float]
    min_abs_nonzero: Optional[float]
    mean: Optional[float]
    std: Optional[float]
    l2norm: Optional[float]
    hist: Optional[np.ndarray] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.hist is not None:
            h = np.asarray(self.hist, dtype=np.int64)
            if h.shape != (N_BINS,):
                raise ValueError(
                    f"histogram has {h.size} bins but HIST_EDGES ({HIST_EDGES_ID}) has {N_BINS}; "
                    "it was recorded with different edges"
                )
            h.setflags(write=False)
            object.__setattr__(self, "hist", h)

    def __eq__(self, other) -> bool:
        if not isinstance(other, TensorStats):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "hist":
                if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
                    return False
            elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
                continue
            elif a != b:
                return False
        return True

    __hash__ = None  # mutable-looking numpy payload; not hashable

    # ---- derived counts -----------------------------------------------------
    @property
    def has_nonfinite(self) -> bool:
        """Whether the tensor holds NaN or Inf: by the counts, else by a non-finite Min/Max.

        A non-finite Norm or Mean alone does not count (it can overflow while
        every value is finite).  When NaN/Inf were counted, a NaN Min/Max only
        means "no finite value" (an empty tensor).
        """
        if (self.nan_count or 0) > 0 or (self.inf_count or 0) > 0:
            return True
        if self.nan_count is not None and self.inf_count is not None:
            return False
        return any(v is not None and not math.isfinite(v) for v in (self.min, self.max))

    @property
    def finite_count(self) -> Optional[int]:
        if self.nan_count is None or self.inf_count is None:
            return None
        return self.numel - self.nan_count - self.inf_count

    @property
    def nonzero_finite_count(self) -> Optional[int]:
        fc = self.finite_count
        return None if fc is None or self.zero_count is None else fc - self.zero_count

    @property
    def is_summary_only(self) -> bool:
        return any(getattr(self, n) is None for n in _COUNT_FIELDS + _FLOAT_FIELDS)

    # ---- format questions -------------------------------------------------------
    def representability(self, fmt_name: str) -> Representability:
        """Exact overflow/underflow/subnormal/normal counts for a format, from the histogram."""
        fmt = get_format(fmt_name)
        if self.hist is None:
            raise ValueError(
                f"cannot count representability in {fmt.name}: this {self.dtype} record has no "
                "magnitude histogram (a summary-only record, e.g. from an msprobe statistics dump, or "
                "stats computed with histogram=False); use summary_headroom() for what min/max allow"
            )
        return _representability(self.hist, fmt, self.numel, self.nan_count, self.inf_count, self.zero_count)

    def summary_headroom(self, fmt_name: str) -> SummaryHeadroom:
        """Headroom/footroom of this record against ``fmt`` from absmax/min_abs_nonzero alone."""
        fmt = get_format(fmt_name)
        am = self.absmax
        if am is None and self.min is not None and self.max is not None:
            am = max(abs(self.min), abs(self.max))
        if am is not None and math.isnan(am):
            am = None
        if am is None:
            head = None
        elif am == 0:
            head = math.inf
        elif math.isinf(am):
            head = -math.inf  # the values are already infinite: no headroom at all
        else:
            head = math.log2(fmt.max / am)
        any_ovf = None if am is None else am >= fmt.overflow_threshold
        mn = self.min_abs_nonzero
        if mn is not None and math.isnan(mn):
            mn = None
        foot = None if mn is None else math.log2(mn / fmt.smallest_positive)
        any_unf = None if mn is None else (0 < mn < fmt.underflow_threshold)
        return SummaryHeadroom(fmt.name, am, head, any_ovf, mn, foot, any_unf)

    # ---- serialisation ------------------------------------------------------------
    def to_dict(self, *, sparse_hist: bool = True) -> dict:
        """A strict-JSON-safe dict (non-finite floats as "nan"/"inf"/"-inf").

        The histogram is stored sparse (``{"bins": [...], "counts": [...]}``)
        or dense (a list), with ``hist_edges_id`` so a change of edges is
        detected on load.
        """
        d: dict[str, Any] = {
            "numel": int(self.numel),
            "dtype": self.dtype,
            "shape": list(self.shape),
        }
        for n in _COUNT_FIELDS:
            v = getattr(self, n)
            d[n] = None if v is None else int(v)
        for n in _FLOAT_FIELDS:
            d[n] = json_float(getattr(self, n))
        if self.hist is None:
            d["hist"] = None
        else:
            if sparse_hist:
                nz = np.flatnonzero(self.hist)
                d["hist"] = {"bins": nz.tolist(), "counts": self.hist[nz].tolist()}
            else:
                d["hist"] = self.hist.tolist()
            d["hist_edges_id"] = HIST_EDGES_ID
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TensorStats":
        h = d.get("hist")
        hist = None
        if h is not None:
            eid = d.get("hist_edges_id")
            if eid is not None and eid != HIST_EDGES_ID:
                raise ValueError(
                    f"histogram was recorded with edges {eid}, this version uses {HIST_EDGES_ID}; "
                    "its bins cannot be interpreted"
                )
            if isinstance(h, dict):
                hist = np.zeros(N_BINS, dtype=np.int64)
                hist[np.asarray(h["bins"], dtype=np.int64)] = np.asarray(h["counts"], dtype=np.int64)
            else:
                hist = np.asarray(h, dtype=np.int64)
        kw: dict[str, Any] = {
            "numel": int(d["numel"]),
            "dtype": str(d["dtype"]),
            "shape": tuple(d["shape"]),
            "hist": hist,
        }
        for n in _COUNT_FIELDS:
            kw[n] = None if d.get(n) is None else int(d[n])
        for n in _FLOAT_FIELDS:
            kw[n] = from_json_float(d.get(n))
        return cls(**kw)

    @classmethod
    def summary_only(
        cls,
        *,
        dtype,
        shape,
        min: Optional[float] = None,
        max: Optional[float] = None,
        mean: Optional[float] = None,
        l2norm: Optional[float] = None,
        std: Optional[float] = None,
        absmax: Optional[float] = None,
        min_abs_nonzero: Optional[float] = None,
        nan_count: Optional[int] = None,
        inf_count: Optional[int] = None,
        zero_count: Optional[int] = None,
        numel: Optional[int] = None,
    ) -> "TensorStats":
        """A record from summary numbers only (no histogram), e.g. msprobe Max/Min/Mean/Norm.

        ``absmax`` defaults to max(|min|, |max|) when both are given.
        """
        shape = tuple(int(s) for s in shape)
        if numel is None:
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        f = lambda v: None if v is None else float(v)  # noqa: E731
        if absmax is None and min is not None and max is not None:
            absmax = builtins_max(abs(float(min)), abs(float(max)))
        return cls(
            numel=int(numel), dtype=canonical_dtype(dtype), shape=shape,
            nan_count=nan_count, inf_count=inf_count, zero_count=zero_count,
            min=f(min), max=f(max), absmax=f(absmax), min_abs_nonzero=f(min_abs_nonzero),
            mean=f(mean), std=f(std), l2norm=f(l2norm), hist=None,
        )


builtins_max = max  # TensorStats.summary_only shadows max with a parameter


def _representability(hist: np.ndarray, fmt: Format, total: int, nan, inf, zero) -> Representability:
    nonzero = int(hist.sum())
    i_ovf = _edge_index(fmt.overflow_threshold)
    overflow = int(hist[i_ovf:].sum())
    if fmt.underflow_threshold > 0:
        i_unf = _edge_index(fmt.underflow_threshold)
        underflow = int(hist[:i_unf].sum())
    else:
        i_unf = 0
        underflow = 0
    if fmt.normal_threshold > fmt.underflow_threshold:
        i_nrm = _edge_index(fmt.normal_threshold)
        subnormal = int(hist[i_unf:i_nrm].sum())
    else:
        subnormal = 0
    normal = nonzero - overflow - underflow - subnormal
    nan = 0 if nan is None else int(nan)
    inf = 0 if inf is None else int(inf)
    zero = 0 if zero is None else int(zero)
    return Representability(
        fmt=fmt.name, total=int(total), finite=int(total) - nan - inf, zero=zero, nan=nan, inf=inf,
        overflow=overflow, underflow=underflow, subnormal=subnormal, normal=normal, exact=True,
    )


def canonical_dtype(dtype) -> str:
    """'torch.float16' / np.dtype('float16') / torch.float16 -> 'float16'."""
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        return np.dtype(dtype).name
    s = str(dtype)
    return s[len("torch."):] if s.startswith("torch.") else s


# ---------------------------------------------------------------------------
# accumulation (shared by both backends and by merge_stats)
# ---------------------------------------------------------------------------

class _Acc:
    """Running totals.  M2 and the sum of squares are kept as ``m2s * 4**k`` and
    ``ssqs * 4**k`` so float64 inputs near 1e308 do not overflow."""

    __slots__ = ("nan", "inf", "zero", "nfin", "vmin", "vmax", "absmax", "minabs",
                 "mean", "m2s", "ssqs", "k", "hist")

    def __init__(self, histogram: bool) -> None:
        self.nan = self.inf = self.zero = self.nfin = 0
        self.vmin, self.vmax = math.inf, -math.inf
        self.absmax, self.minabs = -math.inf, math.inf
        self.mean = self.m2s = self.ssqs = 0.0
        self.k = 0
        self.hist = np.zeros(N_BINS, dtype=np.int64) if histogram else None

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
            hist=self.hist,
        )


def _ldexp(m: float, k: int) -> float:
    """math.ldexp that returns inf (a norm of float64 values can exceed float64's range)."""
    try:
        return math.ldexp(m, k)
    except OverflowError:
        return math.inf


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

    def ext(fn, x, y, nx, ny):
        # a side with no finite values carries nan: ignore it
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

    vmin = ext(min, a.min, b.min, na, nb)
    vmax = ext(max, a.max, b.max, na, nb)
    amax = ext(max, a.absmax, b.absmax, na, nb)
    minabs = ext(min, a.min_abs_nonzero, b.min_abs_nonzero, na, nb)

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

    hist = None if a.hist is None or b.hist is None else a.hist + b.hist
    return TensorStats(
        numel=numel, dtype=dtype, shape=shape, nan_count=nan_c, inf_count=inf_c, zero_count=zero_c,
        min=vmin, max=vmax, absmax=amax, min_abs_nonzero=minabs, mean=mean, std=std, l2norm=l2, hist=hist,
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


# ---------------------------------------------------------------------------
# numba kernel (float32 bit patterns)
# ---------------------------------------------------------------------------
#
# Bin lookup: for a float32 magnitude with bits ``a`` the bin is the largest i
# with HIST_EDGES[i] <= x, i.e. with C[i] <= a where C[i] is the bit pattern of
# the smallest float32 >= HIST_EDGES[i].  A table over ``a >> 16`` (32768
# entries) gives the bin at the start of each 2^16-pattern range; the few
# ranges with an edge strictly inside are flagged and resolved with up to
# four compares against a small table (float32 subnormals: binary search).
# Zero, Inf and NaN map to three extra bins, so there are no data-dependent
# branches on the common path.

_ZERO_BIN, _INF_BIN, _NAN_BIN = N_BINS, N_BINS + 1, N_BINS + 2
_NB2 = N_BINS + 3
_LUT_SHIFT = 16
_FLAG = -0x80000000
_SLOT_SEARCH = 0x7FFF


def _ceil_f32_bits(v: float) -> int:
    if v > float(np.finfo(np.float32).max):
        return 0x7F800000
    f = np.float32(v)
    if float(f) < v:
        f = np.nextafter(f, np.float32(np.inf))
    return int(np.array(f, dtype=np.float32).view(np.uint32))


def _build_lut():
    cbits = np.array([_ceil_f32_bits(v) for v in HIST_EDGES], dtype=np.int64)
    n_sub = 1 << (31 - _LUT_SHIFT)
    lo = np.arange(n_sub, dtype=np.int64) << _LUT_SHIFT
    lut = (np.searchsorted(cbits, lo, side="right") - 1).astype(np.int64)
    thr_rows: list[list[int]] = []
    normal = (cbits >= (1 << 23)) & (cbits < 0x7F800000) & ((cbits & ((1 << _LUT_SHIFT) - 1)) != 0)
    inner = cbits[normal]
    for sub in np.unique(inner >> _LUT_SHIFT):
        inside = inner[(inner >> _LUT_SHIFT) == sub].tolist()
        if len(inside) > 4:  # pragma: no cover - would need a wider table
            raise AssertionError("more than 4 histogram edges inside one 2^16 float32 range")
        lut[sub] = _FLAG | (len(thr_rows) << 16) | lut[sub]
        thr_rows.append(inside + [0x7FFFFFFF] * (4 - len(inside)))
    lut[: (1 << 23) >> _LUT_SHIFT] = _FLAG | (_SLOT_SEARCH << 16)  # float32 subnormals
    lut[0x7F800000 >> _LUT_SHIFT:] = _NAN_BIN  # Inf is picked out before the lookup
    thr = np.array(thr_rows or [[0x7FFFFFFF] * 4], dtype=np.int64).ravel().astype(np.uint32)
    return lut.astype(np.int32), thr, cbits


_LUT, _LUT_THR, _CBITS = _build_lut()

_numba_kernels = None
_NUMBA_DISABLED = os.environ.get("PRECISION_LAB_NO_NUMBA", "") not in ("", "0")


def numba_available() -> bool:
    """Whether the compiled CPU kernel can be used (numba importable and not disabled)."""
    return _get_kernels() is not None


def _get_kernels():
    global _numba_kernels
    if _NUMBA_DISABLED:
        return None
    if _numba_kernels is None:
        try:
            _numba_kernels = _build_kernels()
        except ImportError:
            _numba_kernels = False
    return _numba_kernels or None


class _Kernels:
    def __init__(self, scan, num_threads) -> None:
        self.scan = scan
        self.num_threads = num_threads


# The kernels are plain module-level functions (so numba's on-disk cache works)
# that _build_kernels() compiles and rebinds on first use; numba is imported
# only then.  ``_prange`` becomes numba.prange at that point.
_prange = range


# Per-block helpers loop over a block *slice* from 0: LLVM vectorises and
# interleaves those loops, not the same loops over range(lo, hi).

def _nb_block_extrema(sb):
    """Max |bits|, min (|bits| - 1) over nonzero, min/max order keys, zero count."""
    bam = np.int32(0)
    bmin1 = np.int32(0x7FFFFFFF)
    bkmin = np.int32(0x7FFFFFFF)
    bkmax = np.int32(-0x80000000)
    bz = np.int32(0)
    for i in range(sb.size):
        w = sb[i]
        a = w & np.int32(0x7FFFFFFF)
        bam = max(bam, a)
        m1 = a - np.int32(1)
        m1 = m1 if m1 >= 0 else np.int32(0x7FFFFFFF)
        bmin1 = min(bmin1, m1)
        # monotone int32 key of the float: order of keys == order of values
        k = w ^ ((w >> np.int32(31)) & np.int32(0x7FFFFFFF))
        bkmin = min(bkmin, k)
        bkmax = max(bkmax, k)
        bz += np.int32(a == 0)
    return bam, bmin1, bkmin, bkmax, bz


def _nb_block_moments(xb, shift):
    s1 = 0.0
    s2 = 0.0
    q = 0.0
    for i in range(xb.size):
        x = np.float64(xb[i])
        d = x - shift
        s1 += d
        s2 += d * d
        q += x * x
    return s1, s2, q


def _nb_search_bin(a, cbits):
    lo = 0
    hi = cbits.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if cbits[mid] <= a:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


def _nb_flagged_bin(a, lv, thr, cbits):
    """Bin inside a flagged 2^16 range: up to four compares, or a search for float32 subnormals."""
    slot = (lv >> 16) & 0x7FFF
    if slot == 0x7FFF:
        return np.int32(_nb_search_bin(np.int64(a), cbits))
    t4 = np.uint32(slot * 4)
    return ((lv & np.int32(0xFFFF)) + np.int32(a >= thr[t4])
            + np.int32(a >= thr[t4 + np.uint32(1)]) + np.int32(a >= thr[t4 + np.uint32(2)])
            + np.int32(a >= thr[t4 + np.uint32(3)]))


def _nb_block_bins(ub, buf, lut, thr, cbits, nb2):
    """Bin of each element: a table lookup; rarely (kept out of line) a few compares or a search."""
    for j in range(ub.size):
        a = ub[j] & np.uint32(0x7FFFFFFF)
        lv = lut[a >> np.uint32(16)]
        lv = np.int32(nb2 - 3) if a == 0 else lv
        lv = np.int32(nb2 - 2) if a == np.uint32(0x7F800000) else lv
        if lv < 0:
            lv = _nb_flagged_bin(a, lv, thr, cbits)
        buf[j] = np.uint32(lv)


def _nb_block_count(buf, m, h, nb2):
    # four interleaved copies break the store->load chain on repeated bins
    nbu = np.uint32(nb2)
    for j in range(0, m - 3, 4):
        h[buf[j]] += 1
        h[nbu + buf[j + 1]] += 1
        h[np.uint32(2) * nbu + buf[j + 2]] += 1
        h[np.uint32(3) * nbu + buf[j + 3]] += 1
    for j in range(m - (m & 3), m):
        h[buf[j]] += 1


def _nb_scan_range(xf, s, lo, hi, lut, thr, cbits, do_hist, h, nb2, ri, rf, row):
    blk = 2048
    u = s.view(np.uint32)
    buf = np.empty(blk, np.uint32)
    amax = np.int32(0)
    aminm1 = np.int32(0x7FFFFFFF)
    kmin = np.int32(0x7FFFFFFF)
    kmax = np.int32(-0x80000000)
    nzero = 0
    nnan = 0
    ninf = 0
    nf = 0
    mean = 0.0
    m2 = 0.0
    ssq = 0.0
    for b0 in range(lo, hi, blk):
        b1 = min(b0 + blk, hi)
        bam, bmin1, bkmin, bkmax, bz = _nb_block_extrema(s[b0:b1])
        nzero += bz
        if bam < np.int32(0x7F800000):
            # all finite: vectorised float64 moments, shifted by the block's first value
            amax = max(amax, bam)
            aminm1 = min(aminm1, bmin1)
            kmin = min(kmin, bkmin)
            kmax = max(kmax, bkmax)
            shift = np.float64(xf[b0])
            s1, s2, q = _nb_block_moments(xf[b0:b1], shift)
            nb = b1 - b0
        else:
            s1 = 0.0
            s2 = 0.0
            q = 0.0
            nb = 0
            shift = 0.0
            for i in range(b0, b1):
                w = s[i]
                a = w & np.int32(0x7FFFFFFF)
                if a >= np.int32(0x7F800000):
                    if a == np.int32(0x7F800000):
                        ninf += 1
                    else:
                        nnan += 1
                    continue
                amax = max(amax, a)
                m1 = a - np.int32(1)
                if m1 >= 0 and m1 < aminm1:
                    aminm1 = m1
                k = w ^ ((w >> np.int32(31)) & np.int32(0x7FFFFFFF))
                kmin = min(kmin, k)
                kmax = max(kmax, k)
                x = np.float64(xf[i])
                if nb == 0:
                    shift = x
                d = x - shift
                s1 += d
                s2 += d * d
                q += x * x
                nb += 1
        if nb > 0:
            bmean = shift + s1 / nb
            bm2 = s2 - s1 * (s1 / nb)
            if bm2 < 0.0:
                bm2 = 0.0
            if nf == 0:
                mean = bmean
                m2 = bm2
            else:
                tot = nf + nb
                delta = bmean - mean
                mean += delta * (nb / tot)
                m2 += bm2 + delta * delta * (nf * (nb / tot))
            nf += nb
            ssq += q
        if do_hist:
            _nb_block_bins(u[b0:b1], buf, lut, thr, cbits, nb2)
            _nb_block_count(buf, b1 - b0, h, nb2)
    ri[row, 0] = amax
    ri[row, 1] = aminm1
    ri[row, 2] = kmin
    ri[row, 3] = kmax
    ri[row, 4] = nf
    ri[row, 5] = nzero
    ri[row, 6] = nnan
    ri[row, 7] = ninf
    rf[row, 0] = mean
    rf[row, 1] = m2
    rf[row, 2] = ssq


def _nb_fold(hs, nb2):
    hist = np.zeros(nb2, np.int64)
    for p in range(hs.shape[0]):
        for r in range(4):
            for c in range(nb2):
                hist[c] += hs[p, r * nb2 + c]
    return hist


def _nb_scan_parallel(xf, lut, thr, cbits, do_hist, nparts, nb2):
    s = xf.view(np.int32)
    n = s.size
    hs = np.zeros((nparts, 4 * nb2), np.int64)
    ri = np.zeros((nparts, 8), np.int64)
    rf = np.zeros((nparts, 3), np.float64)
    for p in _prange(nparts):
        _nb_scan_range(xf, s, (n * p) // nparts, (n * (p + 1)) // nparts, lut, thr, cbits, do_hist,
                       hs[p], nb2, ri, rf, p)
    return _nb_fold(hs, nb2), ri, rf


def _nb_scan_serial(xf, lut, thr, cbits, do_hist, nb2):
    s = xf.view(np.int32)
    hs = np.zeros((1, 4 * nb2), np.int64)
    ri = np.zeros((1, 8), np.int64)
    rf = np.zeros((1, 3), np.float64)
    _nb_scan_range(xf, s, 0, s.size, lut, thr, cbits, do_hist, hs[0], nb2, ri, rf, 0)
    return _nb_fold(hs, nb2), ri, rf


def _build_kernels() -> _Kernels:
    """Compile (or load from numba's cache) the float32 scan; numba is imported here."""
    import numba

    g = globals()
    g["_prange"] = numba.prange
    # reassociation lets LLVM vectorise the float64 sums; only finite values reach them
    fm = {"reassoc", "contract", "nsz", "arcp", "nnan", "ninf"}
    plain = dict(cache=True, nogil=True)
    g["_nb_block_moments"] = numba.njit(fastmath=fm, **plain)(_nb_block_moments)
    g["_nb_flagged_bin"] = numba.njit(inline="never", **plain)(_nb_flagged_bin)
    for name in ("_nb_block_extrema", "_nb_search_bin", "_nb_block_bins", "_nb_block_count", "_nb_scan_range",
                 "_nb_fold", "_nb_scan_serial"):
        g[name] = numba.njit(**plain)(g[name])
    g["_nb_scan_parallel"] = numba.njit(parallel=True, **plain)(_nb_scan_parallel)
    serial, parallel = g["_nb_scan_serial"], g["_nb_scan_parallel"]
    # numba's workqueue threading layer must not run two parallel regions at once
    # (e.g. two dashboard sessions); each call uses every core anyway
    lock = threading.Lock()

    def scan(xf, lut, thr, cbits, do_hist, nparts, nb2):
        if nparts <= 1:
            return serial(xf, lut, thr, cbits, do_hist, nb2)
        with lock:
            return parallel(xf, lut, thr, cbits, do_hist, nparts, nb2)

    return _Kernels(scan, numba.get_num_threads)


_PAR_MIN = 1 << 18  # below this a parallel launch costs more than it saves


def _numba_chunk(acc: _Acc, xf: np.ndarray, histogram: bool) -> None:
    """Accumulate one contiguous float32 chunk with the compiled kernel."""
    kern = _get_kernels()
    n = xf.size
    if n == 0:
        return
    nthreads = kern.num_threads() if n >= _PAR_MIN else 1
    nparts = max(1, min(nthreads, n // (_PAR_MIN // 4) or 1))
    hist, ri, rf = kern.scan(xf, _LUT, _LUT_THR, _CBITS, histogram, nparts, _NB2)
    # ri: amax bits, (min |x| bits) - 1, min key, max key, n_finite, n_zero, n_nan, n_inf
    nfin = int(ri[:, 4].sum())
    acc.zero += int(ri[:, 5].sum())
    acc.nan += int(ri[:, 6].sum())
    acc.inf += int(ri[:, 7].sum())
    if nfin:
        amax_bits = int(ri[:, 0].max())
        minabs_m1 = int(ri[:, 1].min())
        kmin = int(ri[:, 2].min())
        kmax = int(ri[:, 3].max())
        absmax = float(np.array(amax_bits, np.uint32).view(np.float32))
        minabs = math.inf if minabs_m1 >= 0x7F7FFFFF else float(np.array(minabs_m1 + 1, np.uint32).view(np.float32))
        acc.add_extrema(_key_to_f32(kmin), _key_to_f32(kmax), absmax, minabs)
        for p in range(nparts):
            if ri[p, 4]:
                acc.add_moments(int(ri[p, 4]), float(rf[p, 0]), float(rf[p, 1]), float(rf[p, 2]), 0)
    if histogram:
        acc.hist += hist[:N_BINS]


def _key_to_f32(key: int) -> float:
    """Inverse of the monotone int32 key ``b ^ ((b >> 31) & 0x7FFFFFFF)``."""
    b = key ^ ((key >> 31) & 0x7FFFFFFF)
    return float(np.array(b, dtype=np.int64).astype(np.int32).view(np.float32))


# ---------------------------------------------------------------------------
# pure-torch kernel (any device; float64)
# ---------------------------------------------------------------------------

_edges_cache: dict = {}


def _torch_edges(torch, device):
    key = str(device)
    e = _edges_cache.get(key)
    if e is None:
        e = torch.tensor(HIST_EDGES.tolist(), dtype=torch.float64, device=device)
        _edges_cache[key] = e
    return e


def _torch_chunk_partial(torch, x, histogram: bool):
    """Device tensors for one chunk; nothing is copied to the host here."""
    x64 = x.to(torch.float64)
    a = x64.abs()
    isnan = torch.isnan(x64)
    fin = torch.isfinite(x64)
    nz = fin & (a > 0)
    # torch.full is a device fill; torch.tensor(scalar, device=cuda) is a blocking host copy
    inf = torch.full((), math.inf, dtype=torch.float64, device=x64.device)
    nfin = fin.sum()
    absmax = torch.where(fin, a, 0.0).amax()
    minabs = torch.where(nz, a, inf).amin()
    vmin = torch.where(fin, x64, inf).amin()
    vmax = torch.where(fin, x64, -inf).amax()
    # scale by 2**-k (exact; in two halves so the power itself cannot overflow) so the
    # squares of float64 values near 1e308 stay finite and those near 1e-308 do not vanish
    k = torch.frexp(absmax).exponent.to(torch.float64)
    k1 = torch.floor(k / 2)
    y = torch.where(fin, torch.ldexp(torch.ldexp(x64, -k1), k1 - k), 0.0)
    nf = nfin.to(torch.float64).clamp(min=1.0)
    mean_y = y.sum() / nf
    d = torch.where(fin, y - mean_y, 0.0)
    vec = torch.stack([
        isnan.sum().to(torch.float64),
        (~fin & ~isnan).sum().to(torch.float64),
        (x64 == 0).sum().to(torch.float64),
        nfin.to(torch.float64),
        vmin, vmax, absmax, minabs,
        mean_y, (d * d).sum(), (y * y).sum(), k,
    ])
    hist = None
    if histogram:
        idx = torch.bucketize(a, _torch_edges(torch, x64.device), right=True) - 1
        idx = torch.where(nz, idx, N_BINS)
        if x64.is_cuda:  # bincount reads max(idx) back to the host; index_add_ does not
            hist = torch.zeros(N_BINS + 1, dtype=torch.int64, device=x64.device).index_add_(
                0, idx, torch.ones_like(idx))[:N_BINS]
        else:
            hist = torch.bincount(idx, minlength=N_BINS + 1)[:N_BINS]
    return vec, hist


def _torch_finish(torch, acc: _Acc, parts) -> None:
    if not parts:
        return
    vecs = torch.stack([v for v, _ in parts]).cpu().numpy()
    if acc.hist is not None:
        acc.hist += torch.stack([h for _, h in parts]).sum(0).cpu().numpy().astype(np.int64)
    for row in vecs:
        nan_c, inf_c, zero_c, nfin = (int(v) for v in row[:4])
        acc.nan += nan_c
        acc.inf += inf_c
        acc.zero += zero_c
        if nfin:
            acc.add_extrema(float(row[4]), float(row[5]), float(row[6]), float(row[7]))
            k = int(row[11])
            # mean, M2 and the sum of squares were computed on y = x * 2**-k
            acc.add_moments(nfin, math.ldexp(float(row[8]), k), float(row[9]), float(row[10]), k)


# ---------------------------------------------------------------------------
# input normalisation and chunking
# ---------------------------------------------------------------------------

# numpy dtypes that convert exactly to float32 (numba path)
_NP_F32_EXACT = {"float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                 "float8_e4m3", "float8_e3m4", "float8_e4m3b11fnuz", "float8_e8m0fnu", "float6_e2m3fn",
                 "float6_e3m2fn", "float4_e2m1fn", "int8", "uint8", "int16", "uint16", "bool", "int4", "uint4",
                 "int2", "uint2"}
_F32_EXACT_INT = 1 << 24  # every integer of magnitude <= 2^24 is a float32
_TORCH_F32_EXACT = {"float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                    "float8_e8m0fnu", "int8", "uint8", "int16", "uint16", "bool"}


def _iter_np_chunks(arr: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
    """1-D chunks of ``arr`` (views where possible), in memory order."""
    if arr.ndim == 0:
        yield arr.reshape(1)
        return
    if arr.size == 0:
        return
    flat = _np_dense_flat(arr)
    if flat is not None:
        for s in range(0, flat.size, chunk):
            yield flat[s:s + chunk]
        return
    row = arr[0].size
    if row <= chunk:
        step = max(1, chunk // max(row, 1))
        for s in range(0, arr.shape[0], step):
            yield np.ascontiguousarray(arr[s:s + step]).reshape(-1)
    else:
        for i in range(arr.shape[0]):
            yield from _iter_np_chunks(arr[i], chunk)


def _np_dense_flat(arr: np.ndarray) -> Optional[np.ndarray]:
    if arr.flags.c_contiguous:
        return arr.reshape(-1)
    order = sorted(range(arr.ndim), key=lambda d: -abs(arr.strides[d]))
    t = arr.transpose(order)
    if t.flags.c_contiguous:
        return t.reshape(-1)
    return None


def _iter_torch_chunks(t, chunk: int):
    if t.dim() == 0:
        yield t.reshape(1)
        return
    if t.numel() == 0:
        return
    flat = _torch_dense_flat(t)
    if flat is not None:
        for s in range(0, flat.numel(), chunk):
            yield flat[s:s + chunk]
        return
    row = t[0].numel()
    if row <= chunk:
        step = max(1, chunk // max(row, 1))
        for s in range(0, t.shape[0], step):
            yield t[s:s + step].reshape(-1)
    else:
        for i in range(t.shape[0]):
            yield from _iter_torch_chunks(t[i], chunk)


def _torch_dense_flat(t):
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: -abs(t.stride(d)))
    p = t.permute(order)
    if p.is_contiguous():
        return p.view(-1)
    return None


def _fp4x2_to_f32(torch, chunk):
    """Unpack torch.float4_e2m1fn_x2 bytes (two e2m1 values each) to float32."""
    fmt = FORMATS["fp4_e2m1"]
    codes = torch.arange(16, dtype=torch.float64)
    sign = torch.where(codes >= 8, -1.0, 1.0)
    e = (codes.long() >> fmt.man_bits) & ((1 << fmt.exp_bits) - 1)
    m = codes.long() & ((1 << fmt.man_bits) - 1)
    mag = torch.where(e == 0, torch.ldexp(m.double(), torch.tensor(fmt.emin - fmt.man_bits)),
                      torch.ldexp(1.0 + m.double() / (1 << fmt.man_bits), e.double() - fmt.bias))
    table = (sign * mag).to(torch.float32).to(chunk.device)
    b = chunk.view(torch.uint8).long()
    return torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).reshape(-1)


def tensor_stats(x, *, histogram: bool = True, chunk_elems: int = 1 << 24, backend: str = "auto") -> TensorStats:
    """Statistics (and magnitude histogram) of a torch tensor or numpy array.

    Torch tensors are processed on their own device (CUDA tensors stay on
    the GPU; only the small per-chunk results are copied back, once).
    Accepted: float (incl. fp16/bf16/fp8/e8m0; ``float4_e2m1fn_x2`` is
    unpacked, so ``numel`` is twice the packed element count), integer and
    bool dtypes, numpy arrays incl. ``ml_dtypes`` dtypes and ``np.memmap``.
    Sparse torch tensors are summarised from their stored values plus the
    implicit zeros (nothing is densified).  Complex and meta tensors raise
    ValueError.  Integers wider than 2^53 are rounded to float64 first.

    ``chunk_elems`` bounds the elements converted/held at a time.
    ``backend``: "auto" (numba on CPU where possible), "numba", or "torch".
    """
    if backend not in ("auto", "numba", "torch"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'torch', not {backend!r}")
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    use_numba = backend != "torch" and _get_kernels() is not None
    if backend == "numba" and not use_numba:
        raise ValueError("backend='numba' requested but numba is not available (or PRECISION_LAB_NO_NUMBA is set)")

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _stats_torch(torch, x, histogram, chunk_elems, use_numba, backend)
    if isinstance(x, (np.ndarray, np.generic, int, float, list, tuple)):
        return _stats_numpy(np.asarray(x), histogram, chunk_elems, use_numba, backend)
    raise TypeError(f"tensor_stats expects a torch.Tensor or numpy array, not {type(x).__name__}")


def _check_kind_np(arr: np.ndarray) -> None:
    k = arr.dtype.kind
    if k == "c":
        raise ValueError(
            f"complex arrays are not supported (dtype {arr.dtype.name}): "
            "pass x.real and x.imag (or abs(x)) separately"
        )
    if k not in "biuf" and arr.dtype.name not in _NP_F32_EXACT:
        raise ValueError(f"cannot compute numeric statistics of a {arr.dtype.name} array")


def _stats_numpy(arr: np.ndarray, histogram: bool, chunk: int, use_numba: bool, backend: str) -> TensorStats:
    _check_kind_np(arr)
    # casting a signalling NaN raises "invalid"; NaNs are counted, not an error
    with np.errstate(invalid="ignore", over="ignore"):
        return _stats_numpy_inner(arr, histogram, chunk, use_numba, backend)


def _stats_numpy_inner(arr: np.ndarray, histogram: bool, chunk: int, use_numba: bool, backend: str) -> TensorStats:
    name = arr.dtype.name
    acc = _Acc(histogram)
    if use_numba and (name == "float32" or name in _NP_F32_EXACT):
        for c in _iter_np_chunks(arr, chunk):
            xf = c if c.dtype == np.float32 else c.astype(np.float32)
            _numba_chunk(acc, np.ascontiguousarray(xf), histogram)
    elif use_numba and arr.dtype.kind in "iu":
        # wide integers: chunks whose values fit in +/-2^24 are exact in float32
        import torch

        parts = []
        for c in _iter_np_chunks(arr, min(chunk, 1 << 22)):
            if c.size and max(abs(int(c.min())), abs(int(c.max()))) <= _F32_EXACT_INT:
                _numba_chunk(acc, np.ascontiguousarray(c.astype(np.float32)), histogram)
            else:
                parts.append(_torch_chunk_partial(torch, torch.from_numpy(c.astype(np.float64)), histogram))
        _torch_finish(torch, acc, parts)
    else:
        import torch

        if backend == "numba":
            raise ValueError(f"backend='numba' handles only dtypes exact in float32, not {name}")
        parts = []
        sub = min(chunk, 1 << 22)
        for c in _iter_np_chunks(arr, sub):
            c64 = np.ascontiguousarray(c.astype(np.float64, copy=False))
            parts.append(_torch_chunk_partial(torch, torch.from_numpy(c64), histogram))
            if len(parts) >= 64:
                _torch_finish(torch, acc, parts)
                parts = []
        _torch_finish(torch, acc, parts)
    return acc.result(numel=arr.size, dtype=name, shape=arr.shape)


def _stats_torch(torch, t, histogram: bool, chunk: int, use_numba: bool, backend: str) -> TensorStats:
    dtype = canonical_dtype(t.dtype)
    if t.is_complex():
        raise ValueError(
            f"complex tensors are not supported (dtype {dtype}): "
            "pass x.real and x.imag (or x.abs()) separately"
        )
    if t.device.type == "meta":
        raise ValueError("meta tensors have no values: materialise the tensor before computing statistics")
    t = t.detach()
    shape = tuple(t.shape)
    if t.layout != torch.strided:
        return _stats_torch_sparse(torch, t, histogram, chunk, use_numba, backend, dtype, shape)
    numel = t.numel()
    packed_fp4 = dtype == "float4_e2m1fn_x2"
    if packed_fp4:
        numel *= 2
    if not (t.dtype.is_floating_point or packed_fp4 or dtype in _TORCH_F32_EXACT
            or dtype.startswith(("int", "uint"))):
        raise ValueError(f"cannot compute numeric statistics of a {dtype} tensor")
    acc = _Acc(histogram)
    cpu = t.device.type == "cpu"
    if cpu and use_numba and (dtype == "float32" or dtype in _TORCH_F32_EXACT or packed_fp4):
        for c in _iter_torch_chunks(t, chunk if not packed_fp4 else max(1, chunk // 2)):
            if packed_fp4:
                c = _fp4x2_to_f32(torch, c)
            elif c.dtype != torch.float32:
                c = c.to(torch.float32)
            _numba_chunk(acc, c.contiguous().numpy(), histogram)
    elif cpu and use_numba and dtype.startswith(("int", "uint")):
        # int32/int64 (token ids, indices): chunks within +/-2^24 are exact in float32
        parts = []
        for c in _iter_torch_chunks(t, min(chunk, 1 << 22)):
            lo, hi = torch.aminmax(c)
            if max(abs(int(lo)), abs(int(hi))) <= _F32_EXACT_INT:
                _numba_chunk(acc, c.to(torch.float32).numpy(), histogram)
            else:
                parts.append(_torch_chunk_partial(torch, c, histogram))
        _torch_finish(torch, acc, parts)
    else:
        if backend == "numba":
            raise ValueError(f"backend='numba' handles only CPU tensors with dtypes exact in float32, not {dtype} "
                             f"on {t.device}")
        sub = chunk if not cpu else min(chunk, 1 << 22)
        parts = []
        for c in _iter_torch_chunks(t, sub if not packed_fp4 else max(1, sub // 2)):
            if packed_fp4:
                c = _fp4x2_to_f32(torch, c)
            parts.append(_torch_chunk_partial(torch, c, histogram))
            if len(parts) >= 64:  # keep the pending per-chunk results small
                _torch_finish(torch, acc, parts)
                parts = []
        _torch_finish(torch, acc, parts)
    return acc.result(numel=numel, dtype=dtype, shape=shape)


def _stats_torch_sparse(torch, t, histogram, chunk, use_numba, backend, dtype, shape) -> TensorStats:
    """Stored values plus (numel - nnz) implicit zeros; no densifying."""
    if t.layout == torch.sparse_coo:
        vals = t.coalesce().values()
    elif t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        vals = t.values()
    else:
        raise ValueError(f"unsupported tensor layout {t.layout}: convert with .to_dense() first")
    s = tensor_stats(vals, histogram=histogram, chunk_elems=chunk, backend=backend)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    n_implicit = numel - vals.numel()
    if n_implicit:
        z = TensorStats(
            numel=n_implicit, dtype=dtype, shape=(n_implicit,), nan_count=0, inf_count=0, zero_count=n_implicit,
            min=0.0, max=0.0, absmax=0.0, min_abs_nonzero=float("nan"), mean=0.0, std=0.0, l2norm=0.0,
            hist=np.zeros(N_BINS, np.int64) if histogram else None,
        )
        s = merge_stats(s, z)
    return TensorStats(**{**{f.name: getattr(s, f.name) for f in fields(s)}, "numel": numel,
                          "dtype": dtype, "shape": shape})
