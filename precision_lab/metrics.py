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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from .formats import FORMATS, Format, format_for_dtype

__all__ = ["Comparison", "compare", "compare_stats", "verdict_for", "VERDICT_THRESHOLDS"]

# rounding_units at or below which a difference is what the candidate format's
# own rounding explains (accumulated over a network it grows with depth).
VERDICT_THRESHOLDS = {"expected": 8.0, "warn": 64.0}

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

    def to_dict(self) -> dict:
        return asdict(self)


def _as_torch_f64_chunks(x, chunk: int):
    """Yield float64 torch chunks of a flattened tensor/array, on its own device."""
    import torch

    if isinstance(x, np.ndarray):
        flat = x.reshape(-1)
        for i in range(0, flat.size, chunk):
            yield torch.from_numpy(np.asarray(flat[i : i + chunk]).astype(np.float64))
    else:
        flat = x.reshape(-1)
        for i in range(0, flat.numel(), chunk):
            yield flat[i : i + chunk].to(torch.float64)


def _numel(x) -> int:
    return int(x.size) if isinstance(x, np.ndarray) else int(x.numel())


def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def _dtype_name(x) -> str:
    return str(x.dtype).replace("torch.", "")


def _ulp(absr, fmt: Format):
    """Spacing of ``fmt`` at magnitude |r| (float64 torch tensor)."""
    import torch

    if fmt.kind == "int":
        return torch.ones_like(absr)
    floor = fmt.smallest_normal
    e = torch.floor(torch.log2(torch.clamp(absr, min=floor)))
    return torch.exp2(e - fmt.man_bits)


def verdict_for(*, nonfinite_introduced: int, rounding_units: Optional[float]) -> tuple[str, str]:
    if nonfinite_introduced:
        return "nonfinite", f"{nonfinite_introduced} value(s) finite in the reference are NaN/Inf in the candidate"
    if rounding_units is None or math.isnan(rounding_units):
        return "warn", "no finite positions to compare"
    if rounding_units <= VERDICT_THRESHOLDS["expected"]:
        return "expected", f"error is {rounding_units:.3g}x the format's unit roundoff"
    if rounding_units <= VERDICT_THRESHOLDS["warn"]:
        return "warn", f"error is {rounding_units:.3g}x the format's unit roundoff"
    return "error", f"error is {rounding_units:.3g}x the format's unit roundoff"


def compare(reference, candidate, *, cand_format: Optional[str] = None, chunk: int = _CHUNK) -> Comparison:
    """Compare two tensors/arrays of the same shape element by element.

    ``cand_format`` names the format whose rounding the candidate went
    through; by default it is inferred from the candidate's dtype (fp32 if it
    is not a registered format).
    """
    import torch

    if _shape(reference) != _shape(candidate):
        if _numel(reference) != _numel(candidate):
            raise ValueError(
                f"cannot compare tensors of shapes {_shape(reference)} (reference) and "
                f"{_shape(candidate)} (candidate): numel {_numel(reference)} != {_numel(candidate)}"
            )
        raise ValueError(
            f"cannot compare tensors of shapes {_shape(reference)} (reference) and {_shape(candidate)} (candidate)"
        )
    fmt = FORMATS[cand_format] if cand_format else (format_for_dtype(_dtype_name(candidate)) or FORMATS["fp32"])
    n = _numel(reference)
    rel_floor = fmt.smallest_normal if fmt.kind != "int" else 1.0
    cnt = 0
    s_rr = s_cc = s_rc = s_dd = s_ad = 0.0
    max_ad = max_rel = max_ulp = 0.0
    nf_intro = nf_ref = 0
    # unit vectors for the cosine deficit need the norms first: accumulate
    # sum (r/|r| - c/|c|)^2 in a second pass only when needed.
    for r, c in zip(_as_torch_f64_chunks(reference, chunk), _as_torch_f64_chunks(candidate, chunk)):
        fr, fc = torch.isfinite(r), torch.isfinite(c)
        nf_intro += int((fr & ~fc).sum())
        nf_ref += int((~fr).sum())
        both = fr & fc
        r, c = r[both], c[both]
        if r.numel() == 0:
            continue
        cnt += r.numel()
        d = c - r
        ad = d.abs()
        s_rr += float((r * r).sum())
        s_cc += float((c * c).sum())
        s_rc += float((r * c).sum())
        s_dd += float((d * d).sum())
        s_ad += float(ad.sum())
        max_ad = max(max_ad, float(ad.max()))
        absr = r.abs()
        max_rel = max(max_rel, float((ad / torch.clamp(absr, min=rel_floor)).max()))
        max_ulp = max(max_ulp, float((ad / _ulp(absr, fmt)).max()))
    if cnt == 0:
        verdict, reason = verdict_for(nonfinite_introduced=nf_intro, rounding_units=None)
        return Comparison("tensor", n, 0, None, None, None, None, rel_floor, None, None, None, None, None,
                          nf_intro, nf_ref, fmt.name, verdict, reason)
    nr, nc = math.sqrt(s_rr), math.sqrt(s_cc)
    if nr > 0 and nc > 0:
        cosine = s_rc / (nr * nc)
        s_u = 0.0
        for r, c in zip(_as_torch_f64_chunks(reference, chunk), _as_torch_f64_chunks(candidate, chunk)):
            both = torch.isfinite(r) & torch.isfinite(c)
            u = r[both] / nr - c[both] / nc
            s_u += float((u * u).sum())
        deficit = s_u / 2.0
    elif nr == 0 and nc == 0:
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
    verdict, reason = verdict_for(nonfinite_introduced=nf_intro, rounding_units=rounding_units)
    return Comparison(
        "tensor", n, cnt, max_ad, s_ad / cnt, rmse, max_rel, rel_floor, cosine, deficit, sqnr,
        rounding_units, max_ulp, nf_intro, nf_ref, fmt.name, verdict, reason,
    )


def _nonfinite_flag(stats) -> bool:
    """Whether summary stats show non-finite values (counts, or Max/Min themselves)."""
    if (stats.nan_count or 0) > 0 or (stats.inf_count or 0) > 0:
        return True
    for v in (stats.max, stats.min):
        if v is not None and not math.isfinite(v):
            return True
    return False


def compare_stats(ref_stats, cand_stats, *, cand_format: Optional[str] = None) -> Comparison:
    """A stats-level comparison where only summary statistics exist on a side.

    max_abs_err/max_rel_err here compare the summaries (max, min, mean,
    norm), not elements: ``max_abs_err`` is the largest absolute difference
    among them and ``max_rel_err`` the largest relative one.  A non-finite
    ``l2norm`` with finite max/min is a norm-arithmetic artefact (msprobe
    computes norms in the tensor's dtype), not a non-finite value.
    """
    fmt = FORMATS[cand_format] if cand_format else (format_for_dtype(cand_stats.dtype) or FORMATS["fp32"])
    rel_floor = fmt.smallest_normal if fmt.kind != "int" else 1.0
    nonfinite_cand = _nonfinite_flag(cand_stats)
    nonfinite_ref = _nonfinite_flag(ref_stats)
    nf_intro = 1 if (nonfinite_cand and not nonfinite_ref) else 0
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
        verdict, reason = "nonfinite", "candidate summary shows NaN/Inf where the reference is finite"
    elif max_rel is None:
        verdict, reason = "warn", "no comparable summary statistics"
    else:
        units = max_rel / (fmt.eps / 2 if fmt.kind != "int" else 0.5)
        verdict, reason = verdict_for(nonfinite_introduced=0, rounding_units=units)
        reason = "summary statistics: " + reason
    return Comparison(
        "stats", int(cand_stats.numel), 0, max_abs, None, None, max_rel, rel_floor, None, None, None,
        None, None, nf_intro, int(nonfinite_ref), fmt.name, verdict, reason,
    )
