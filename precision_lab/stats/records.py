"""TensorStats and what is read off it (representability in a format, headroom), with its JSON form."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import numpy as np

from ..formats import Format, canonical_dtype, get_format
from ..jsoncodec import from_json_float, json_float
from .codec import HistogramError, decode_hist, encode_hist
from .edges import HIST_EDGES_ID, N_BINS, _edge_index


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
    neg_inf_count: Optional[int] = None  # how many of inf_count are -inf; None where the source did not say

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
    def negative_inf_only(self) -> Optional[bool]:
        """Whether every non-finite value is ``-inf`` (a masked score, not an overflow or a NaN): from the
        signed counts, else from a summary's Min (``-inf``) and Max (finite); None when nothing says."""
        if not self.has_nonfinite or (self.nan_count or 0) > 0:
            return False
        if self.neg_inf_count is not None and self.inf_count is not None:
            return self.neg_inf_count == self.inf_count
        if self.nan_count is None and self.min is not None and self.max is not None:
            return self.min == -math.inf and math.isfinite(self.max)
        return None

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
        if self.neg_inf_count is not None:
            d["neg_inf_count"] = int(self.neg_inf_count)
        if self.hist is None:
            d["hist"] = None
        else:
            if sparse_hist:
                bins, counts = encode_hist(self.hist)
                d["hist"] = {"bins": bins, "counts": counts}
            else:
                d["hist"] = self.hist.tolist()
            d["hist_edges_id"] = HIST_EDGES_ID
        return d

    @classmethod
    def from_row(cls, row: dict, hist: Optional[np.ndarray] = None) -> "TensorStats":
        """The statistics of one stored record (a row of the tensors table or of a shard): the shape as JSON
        text, NULL or NaN counts as unknown, numpy scalars as Python numbers.  ``ValueError`` says what is
        wrong with a row no tensor could have."""
        kw: dict[str, Any] = {"hist": hist}
        for f in fields(cls):
            if f.name == "hist":
                continue
            v = row.get(f.name)
            if f.name == "shape":
                try:
                    v = tuple(json.loads(v)) if isinstance(v, str) else tuple(v or ())
                except (TypeError, ValueError, RecursionError):
                    raise ValueError(f"shape {v!r}, not a JSON list") from None
                if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < (1 << 63) for d in v) \
                        or math.prod(v) >= (1 << 63):
                    raise ValueError(f"shape {list(v)!r}, not sizes a tensor can have")
            elif f.name.endswith("_count") or f.name == "numel":
                v = None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)
            elif isinstance(v, np.generic):
                v = v.item()
            kw[f.name] = v
        return cls(**kw)

    @classmethod
    def from_dict(cls, d: dict) -> "TensorStats":
        h = d.get("hist")
        hist = None
        if h is not None:
            eid = d.get("hist_edges_id")
            try:
                if isinstance(h, dict):
                    hist = decode_hist(h.get("bins"), h.get("counts"), edges_id=eid)
                else:
                    dense = np.asarray(h, dtype=np.int64)
                    if dense.shape != (N_BINS,):
                        raise HistogramError(f"it has {dense.size} bins, not {N_BINS}")
                    hist = decode_hist(*encode_hist(dense), edges_id=eid)
            except HistogramError as e:
                raise ValueError(f"histogram: {e}; its bins cannot be interpreted") from None
        kw: dict[str, Any] = {
            "numel": int(d["numel"]),
            "dtype": str(d["dtype"]),
            "shape": tuple(d["shape"]),
            "hist": hist,
        }
        for n in _COUNT_FIELDS + ("neg_inf_count",):
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


@functools.cache  # formats are frozen: read for every summarised tensor and format, worked out once each
def format_edges(fmt: Format) -> tuple[int, Optional[int], Optional[int]]:
    """The ``HIST_EDGES`` indices ``fmt``'s counts are read at: its overflow threshold, its underflow threshold
    (None where it has none) and its smallest normal (None where it has no subnormals)."""
    i_unf = _edge_index(fmt.underflow_threshold) if fmt.underflow_threshold > 0 else None
    i_norm = _edge_index(fmt.normal_threshold) if fmt.normal_threshold > fmt.underflow_threshold else None
    return _edge_index(fmt.overflow_threshold), i_unf, i_norm


def _format_counts(below, total, fmt: Format):
    """``(overflow, underflow, subnormal)`` from ``below(i)``, the nonzero finite magnitudes under edge i, and
    ``total``, all of them."""
    i_ovf, i_unf, i_norm = format_edges(fmt)
    overflow = total - below(i_ovf)
    underflow = below(i_unf) if i_unf is not None else total * 0
    subnormal = below(i_norm) - underflow if i_norm is not None else total * 0
    return overflow, underflow, subnormal


def format_counts(hists: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(overflow, underflow, subnormal)`` in ``fmt`` of each row of ``hists`` (histograms over HIST_EDGES,
    one per row): nonzero finite magnitudes that round past the max, to zero, and to a subnormal."""
    c = np.zeros((hists.shape[0], hists.shape[1] + 1), dtype=np.int64)
    np.cumsum(hists, axis=1, out=c[:, 1:])
    return _format_counts(lambda i: c[:, i], c[:, -1], fmt)


def format_counts_above(above: dict, total: int, fmt: Format) -> tuple[int, int, int]:
    """``format_counts`` of one tensor from ``above[i]``, its nonzero finite magnitudes at or above edge i
    (``summary_stats``' counts, keyed by the edges of ``format_edges``), and ``total``, all of them."""
    return _format_counts(lambda i: total - above[i], total, fmt)


def _representability(hist: np.ndarray, fmt: Format, total: int, nan, inf, zero) -> Representability:
    nonzero = int(hist.sum())
    ovf, unf, sub = format_counts(np.asarray(hist)[None, :], fmt)
    overflow, underflow, subnormal = int(ovf[0]), int(unf[0]), int(sub[0])
    normal = nonzero - overflow - underflow - subnormal
    nan = 0 if nan is None else int(nan)
    inf = 0 if inf is None else int(inf)
    zero = 0 if zero is None else int(zero)
    return Representability(
        fmt=fmt.name, total=int(total), finite=int(total) - nan - inf, zero=zero, nan=nan, inf=inf,
        overflow=overflow, underflow=underflow, subnormal=subnormal, normal=normal, exact=True,
    )
