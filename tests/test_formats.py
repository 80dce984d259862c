"""Format limits and rounding thresholds, checked against ml_dtypes, torch and real casts.

Every expected number here comes from somewhere other than
``precision_lab.formats``: ``ml_dtypes.finfo``, ``torch.finfo``, the code
points of the format enumerated through ml_dtypes, or a cast.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from precision_lab.formats import FORMATS, format_for_dtype, get_format

ML_FORMATS = [n for n, f in FORMATS.items() if f.ml_dtypes_name and f.kind == "float"]
TORCH_FORMATS = [n for n, f in FORMATS.items() if f.torch_name and f.kind != "int"]
SMALL_FLOATS = [n for n, f in FORMATS.items() if f.bits <= 8 and f.kind != "int"]


def test_table_has_the_required_names():
    required = {"fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e5m2fnuz",
                "fp6_e2m3", "fp6_e3m2", "fp4_e2m1", "e8m0", "int8"}
    assert required <= set(FORMATS)


@pytest.mark.parametrize("name", ML_FORMATS)
def test_limits_match_ml_dtypes_finfo(name):
    fmt = FORMATS[name]
    fi = ml_dtypes.finfo(fmt.numpy_dtype())
    assert fmt.max == float(fi.max)
    assert fmt.smallest_normal == float(fi.smallest_normal)
    assert fmt.smallest_subnormal == float(fi.smallest_subnormal)
    assert fmt.eps == float(fi.eps)


def test_e8m0_limits_match_ml_dtypes():
    fmt = FORMATS["e8m0"]
    fi = ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu)
    assert fmt.max == float(fi.max) == 2.0**127
    assert fmt.smallest_normal == float(fi.smallest_normal) == 2.0**-127
    assert fmt.eps == float(fi.eps) == 1.0
    # ml_dtypes reports smallest_subnormal == smallest_normal: there are no subnormals
    assert float(fi.smallest_subnormal) == float(fi.smallest_normal)
    assert fmt.smallest_subnormal is None


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_limits_match_torch_finfo(name):
    fmt = FORMATS[name]
    fi = torch.finfo(fmt.torch_dtype())
    assert fmt.max == fi.max
    assert fmt.smallest_normal == fi.smallest_normal
    if name == "fp8_e5m2fnuz":
        # torch says 0.125, but 1.0's neighbour is 1.25 (two mantissa bits): ml_dtypes and we say 0.25
        assert fi.eps == 0.125
        assert fmt.eps == 0.25 == float(ml_dtypes.finfo(ml_dtypes.float8_e5m2fnuz).eps)
        one = torch.tensor([1.0, 1.125, 1.25], dtype=torch.float32).to(torch.float8_e5m2fnuz).float()
        assert one.tolist() == [1.0, 1.0, 1.25]  # 1.125 is a tie that rounds to even (1.0)
    else:
        assert fmt.eps == fi.eps


def test_fp32_and_int8_and_tf32_limits():
    fi = np.finfo(np.float32)
    f = FORMATS["fp32"]
    assert (f.max, f.smallest_normal, f.smallest_subnormal, f.eps) == (
        float(fi.max), float(fi.smallest_normal), float(fi.smallest_subnormal), float(fi.eps))
    i8 = FORMATS["int8"]
    assert i8.max == np.iinfo(np.int8).max == 127 and i8.smallest_normal == 1.0 and i8.smallest_subnormal is None
    # tf32: fp32's 8-bit exponent with a 10-bit mantissa (NVIDIA A100 whitepaper)
    t = FORMATS["tf32"]
    assert t.max == (2 - 2.0**-10) * 2.0**127
    assert t.smallest_normal == float(fi.smallest_normal)
    assert t.smallest_subnormal == 2.0**-136
    assert t.eps == 2.0**-10


def _code_points(fmt):
    dt = fmt.numpy_dtype()
    codes = np.arange(2**fmt.bits, dtype=np.uint8)
    return codes, codes.view(dt).astype(np.float64)


@pytest.mark.parametrize("name", SMALL_FLOATS)
def test_every_code_point_derives_the_limits(name):
    """Enumerate all 2^bits codes through ml_dtypes and re-derive max / normal / subnormal / eps."""
    fmt = FORMATS[name]
    codes, vals = _code_points(fmt)
    finite = np.isfinite(vals)
    pos = vals[finite & (vals > 0)]
    assert fmt.max == pos.max()
    if fmt.kind == "e8m0":
        assert fmt.smallest_normal == pos.min()
        assert len(np.unique(pos)) == 255 and np.isnan(vals[255])
        assert np.all(np.log2(pos) == np.round(np.log2(pos)))  # powers of two only
        return
    # exponent field of each code, from the bit layout
    exp_field = (codes.astype(np.int64) >> fmt.man_bits) & ((1 << fmt.exp_bits) - 1)
    normal = finite & (vals > 0) & (exp_field != 0)
    sub = finite & (vals > 0) & (exp_field == 0)
    assert fmt.smallest_normal == vals[normal].min()
    assert fmt.smallest_subnormal == vals[sub].min()
    assert vals[sub].max() < fmt.smallest_normal
    ordered = np.unique(pos)
    assert fmt.eps == ordered[np.searchsorted(ordered, 1.0) + 1] - 1.0
    # special values as the table says
    has_inf = bool(np.isinf(vals).any())
    has_nan = bool(np.isnan(vals).any())
    assert has_inf == fmt.has_inf
    assert has_nan == fmt.has_nan


def test_int8_grid():
    fmt = FORMATS["int8"]
    grid = torch.arange(-128, 128, dtype=torch.int16).clamp(-127, 127)
    assert fmt.max == grid.max().item() == -grid.min().item()


# ---------------------------------------------------------------------------
# rounding thresholds, by real casts of the float32 values on each side
# ---------------------------------------------------------------------------

def _f32_around(t: float) -> tuple[np.float32, np.float32]:
    """(largest float32 < t, smallest float32 >= t)."""
    f = np.float32(t) if t <= float(np.finfo(np.float32).max) else np.float32(np.finfo(np.float32).max)
    if float(f) < t:
        f = np.nextafter(f, np.float32(np.inf))
    while float(f) >= t and f > 0:
        f = np.nextafter(f, np.float32(0))
    lo = f
    return lo, np.nextafter(lo, np.float32(np.inf))


def _cast_f32(x: np.ndarray, fmt) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(fmt.numpy_dtype()).astype(np.float64)


CAST_FORMATS = [n for n in ML_FORMATS if n != "fp32"]


@pytest.mark.parametrize("name", CAST_FORMATS)
def test_overflow_threshold_by_cast(name):
    fmt = FORMATS[name]
    lo, hi = _f32_around(fmt.overflow_threshold)
    if fmt.saturating and fmt.torch_name is None:
        # ml_dtypes saturates fp6/fp4: scale by 1/2 (exact) so the overflow shows as > max/2
        below, above = _cast_f32(np.array([lo, hi]) / 2, fmt) * 2
        assert below <= fmt.max < above
    else:
        below, above = _cast_f32(np.array([lo, hi]), fmt)
        assert below == fmt.max
        assert not np.isfinite(above)


@pytest.mark.parametrize("name", CAST_FORMATS)
def test_underflow_and_normal_thresholds_by_cast(name):
    fmt = FORMATS[name]
    lo, hi = _f32_around(fmt.underflow_threshold)
    below, above = _cast_f32(np.array([lo, hi]), fmt)
    assert below == 0.0 and above == fmt.smallest_subnormal
    lo, hi = _f32_around(fmt.normal_threshold)
    below, above = _cast_f32(np.array([lo, hi]), fmt)
    assert below < fmt.smallest_normal and above == fmt.smallest_normal


def test_e8m0_thresholds_by_cast():
    fmt = FORMATS["e8m0"]
    lo, hi = _f32_around(fmt.overflow_threshold)
    below, above = _cast_f32(np.array([lo, hi]), fmt)
    assert below == fmt.max and np.isnan(above)
    tiny = np.array([np.float32(1e-45), np.float32(2.0**-140)])
    assert np.all(_cast_f32(tiny, fmt) == 2.0**-127)  # clamped up, never zero
    assert fmt.underflow_threshold == 0.0


def test_int8_thresholds_by_round():
    fmt = FORMATS["int8"]
    for t in (fmt.overflow_threshold, fmt.underflow_threshold):
        lo, hi = _f32_around(t)
        r = torch.round(torch.tensor([lo, hi], dtype=torch.float32)).tolist()
        if t == fmt.overflow_threshold:
            assert r[0] <= 127 < r[1]
        else:
            assert r[0] == 0 < r[1]


def test_fnuz_and_e4m3fn_saturation_flags_match_torch():
    for name in ("fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e5m2fnuz"):
        fmt = FORMATS[name]
        big = torch.tensor([fmt.max * 4], dtype=torch.float32).to(fmt.torch_dtype()).float()
        saturated = bool(torch.isfinite(big).all())
        assert saturated == fmt.saturating, name


def test_dtype_lookup():
    assert format_for_dtype(torch.float16).name == "fp16"
    assert format_for_dtype("torch.bfloat16").name == "bf16"
    assert format_for_dtype(np.dtype(ml_dtypes.float8_e4m3fn)).name == "fp8_e4m3fn"
    assert format_for_dtype(torch.float64) is None
    assert get_format("float8_e5m2").name == "fp8_e5m2"
    with pytest.raises(KeyError, match="known formats"):
        get_format("fp7")


def test_thresholds_are_ordered():
    for fmt in FORMATS.values():
        assert 0 <= fmt.underflow_threshold <= fmt.normal_threshold <= fmt.smallest_normal
        assert fmt.max < fmt.overflow_threshold
        if fmt.smallest_subnormal:
            assert fmt.underflow_threshold < fmt.smallest_subnormal
        assert all(t > 0 and math.isfinite(t) for t in fmt.thresholds())
