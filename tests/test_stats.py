"""precision_lab.stats against independent references.

References are float64 numpy computations, ``np.searchsorted`` over the
edges, and -- for representability -- real casts through ml_dtypes / numpy /
torch.  Nothing here compares a function with itself.
"""

from __future__ import annotations

import json
import math
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from precision_lab import stats as S
from precision_lab.formats import FORMATS
from precision_lab.stats import (
    HIST_EDGES,
    HIST_EDGES_ID,
    N_BINS,
    TensorStats,
    merge_stats,
    tensor_stats,
)

BACKENDS = ["numba", "torch"] if S.numba_available() else ["torch"]
CLASSES = ("overflow", "underflow", "subnormal", "normal")


# ---------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------

def ref_stats(x) -> dict:
    """All fields from float64 numpy, written out longhand."""
    a = np.asarray(x, dtype=np.float64).ravel()
    fin = a[np.isfinite(a)]
    nz = np.abs(fin[fin != 0])
    nan = float("nan")
    return {
        "numel": a.size,
        "nan_count": int(np.isnan(a).sum()),
        "inf_count": int(np.isinf(a).sum()),
        "zero_count": int((a == 0).sum()),
        "min": fin.min() if fin.size else nan,
        "max": fin.max() if fin.size else nan,
        "absmax": np.abs(fin).max() if fin.size else nan,
        "min_abs_nonzero": nz.min() if nz.size else nan,
        "mean": fin.mean() if fin.size else nan,
        "std": fin.std() if fin.size else nan,
        "l2norm": math.sqrt(math.fsum(fin * fin)) if fin.size else nan,
        "hist": np.bincount(np.searchsorted(HIST_EDGES, nz, side="right") - 1, minlength=N_BINS),
    }


def assert_matches(s: TensorStats, ref: dict, rel: float = 1e-12) -> None:
    assert s.numel == ref["numel"]
    for k in ("nan_count", "inf_count", "zero_count"):
        assert getattr(s, k) == ref[k], k
    for k in ("min", "max", "absmax", "min_abs_nonzero"):  # exact: they are elements
        got, want = getattr(s, k), float(ref[k])
        assert (math.isnan(got) and math.isnan(want)) or got == want, (k, got, want)
    for k in ("mean", "std", "l2norm"):
        got, want = getattr(s, k), float(ref[k])
        if math.isnan(want):
            assert math.isnan(got), k
        else:
            assert got == pytest.approx(want, rel=rel, abs=1e-300), (k, got, want)
    if s.hist is not None:
        assert np.array_equal(s.hist, ref["hist"])


# ---- ground-truth classification by real casts --------------------------------

def _classify(y: np.ndarray, overflow: np.ndarray, smallest_normal: float) -> np.ndarray:
    """0 overflow, 1 underflow, 2 subnormal, 3 normal from cast results y (float64, >= 0)."""
    cls = np.full(y.shape, 3, np.int8)
    cls[(y == 0)] = 1
    cls[(y > 0) & (y < smallest_normal)] = 2
    cls[overflow] = 0
    return cls


def _ml_cast(a32: np.ndarray, name: str) -> np.ndarray:
    dt = getattr(ml_dtypes, name, None) or np.dtype(name)
    with np.errstate(over="ignore", invalid="ignore"):
        return a32.astype(dt).astype(np.float64)


def ref_round(a: np.ndarray, fmt) -> np.ndarray:
    """Exact round-to-nearest-even of float64 magnitudes onto fmt's grid, unbounded exponent above.

    Only the bit layout (man_bits, emin) is used: frexp gives the binade,
    np.round (half to even) rounds the scaled value, scaling by powers of
    two is exact.
    """
    a = np.asarray(a, np.float64)
    _, e = np.frexp(a)
    exp = np.maximum(e - 1, fmt.emin)
    q = np.ldexp(1.0, exp - fmt.man_bits)
    return np.round(a / q) * q


def true_classes(x32: np.ndarray, name: str) -> np.ndarray:
    """Per-element class of |x| (float32 input) in format ``name`` from an actual cast.

    Non-finite and zero inputs get -1.
    """
    fmt = FORMATS[name]
    a = np.abs(x32.astype(np.float32))
    ok = np.isfinite(a) & (a != 0)
    a = np.where(ok, a, np.float32(1))
    if name == "fp32":
        y = a.astype(np.float64)
        cls = _classify(y, np.zeros(a.shape, bool), float(np.finfo(np.float32).smallest_normal))
    elif name == "tf32":
        # no tf32 cast exists on CPU: exact float64 RNE (validated against real casts below)
        y = ref_round(a, fmt)
        cls = _classify(y, y > fmt.max, 2.0**-126)
    elif name == "fp16":
        with np.errstate(over="ignore"):
            y = a.astype(np.float16).astype(np.float64)
        cls = _classify(y, np.isinf(y), float(np.finfo(np.float16).smallest_normal))
    elif name == "int8":
        r = torch.round(torch.from_numpy(a.astype(np.float64))).numpy()
        cls = _classify(r, r > 127, 1.0)
    elif name == "e8m0":
        y = _ml_cast(a, "float8_e8m0fnu")
        assert not np.any(y == 0)  # e8m0 has no zero: nothing underflows
        cls = _classify(y, np.isnan(y), 0.0)
    else:
        mname = fmt.ml_dtypes_name
        fi = ml_dtypes.finfo(getattr(ml_dtypes, mname))
        y = _ml_cast(a, mname)
        if mname.startswith(("float6", "float4")):
            # ml_dtypes saturates these: halve (exact in float32 here) so rounding
            # past max shows up as a value above max/2
            half = _ml_cast(a / np.float32(2), mname) * 2
            overflow = half > float(fi.max)
        else:
            overflow = ~np.isfinite(y)
        cls = _classify(y, overflow, float(fi.smallest_normal))
    cls[~ok] = -1
    return cls


def check_stratified(x32: np.ndarray, name: str, backend: str) -> None:
    """For each true class, stats over exactly those values must report them all in that class.

    Stratifying makes this an element-by-element check: a misclassified value
    cannot be hidden by another one misclassified the other way.
    """
    cls = true_classes(x32, name)
    for c, field in enumerate(CLASSES):
        sub = x32[cls == c]
        r = tensor_stats(sub, backend=backend).representability(name)
        got = {f: getattr(r, f) for f in CLASSES}
        want = {f: (sub.size if f == field else 0) for f in CLASSES}
        assert got == want, (name, field, backend)


# ---------------------------------------------------------------------------
# histogram edges
# ---------------------------------------------------------------------------

def test_edges_contain_powers_of_two_and_every_threshold():
    e = HIST_EDGES
    assert e.dtype == np.float64 and e[0] == 0.0 and e[-1] == np.inf
    assert np.all(np.diff(e) > 0)
    edges = set(e.tolist())
    for k in range(-150, 129):
        assert math.ldexp(1.0, k) in edges
    for fmt in FORMATS.values():
        for t in (fmt.max, fmt.smallest_normal, fmt.overflow_threshold, fmt.normal_threshold):
            assert t == 0 or t in edges
        if fmt.smallest_subnormal:
            assert fmt.smallest_subnormal in edges
        assert fmt.underflow_threshold == 0 or fmt.underflow_threshold in edges
    assert N_BINS == len(e) - 1
    assert isinstance(HIST_EDGES_ID, str) and len(HIST_EDGES_ID) >= 8


def test_ref_round_agrees_with_real_casts():
    """The float64 reference used for tf32 agrees with ml_dtypes on every format it can cast."""
    rng = np.random.default_rng(0)
    for name in ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp6_e2m3", "fp4_e2m1"):
        fmt = FORMATS[name]
        e = rng.integers(fmt.emin - fmt.man_bits - 3, fmt.emax, 200_000)
        a = np.ldexp(rng.random(200_000) + 1.0, e).astype(np.float32)
        a = np.concatenate([a, _near_edges_f32()])
        a = a[np.isfinite(a) & (a > 0)]
        r = ref_round(a, fmt)
        y = _ml_cast(a, fmt.ml_dtypes_name)
        inside = r <= fmt.max
        assert np.array_equal(r[inside], y[inside]), name


# ---------------------------------------------------------------------------
# the exactness tests (issue 2)
# ---------------------------------------------------------------------------

def _near_edges_f32() -> np.ndarray:
    """Every float32 within 3 ulps of every histogram edge (hence of every format threshold)."""
    out = []
    fmax = np.float32(np.finfo(np.float32).max)
    err = np.seterr(over="ignore")
    for t in HIST_EDGES[1:-1]:
        if t > float(fmax):
            f = fmax
        else:
            f = np.float32(t)
            if not np.isfinite(f):
                f = fmax
        for _ in range(3):
            f = np.nextafter(f, np.float32(0))
        for _ in range(7):
            out.append(f)
            f = np.nextafter(f, np.float32(np.inf))
    np.seterr(**err)
    v = np.array(out, np.float32)
    v = v[np.isfinite(v)]
    return np.concatenate([v, -v])


@pytest.fixture(scope="module")
def all16():
    bits = np.arange(65536, dtype=np.uint16)
    return {
        "fp16": bits.view(np.float16).astype(np.float32),
        "bf16": bits.view(ml_dtypes.bfloat16).astype(np.float32),
    }


@pytest.mark.parametrize("src", ["fp16", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_exhaustive_16bit_patterns_every_format(all16, src, backend):
    """All 65,536 fp16 / bf16 bit patterns, classified for every registered format."""
    x = all16[src]
    s = tensor_stats(x, backend=backend)
    assert s.nan_count == int(np.isnan(x).sum())
    assert s.inf_count == int(np.isinf(x).sum()) == 2
    assert s.zero_count == 2
    for name in FORMATS:
        check_stratified(x, name, backend)
        r = s.representability(name)
        cls = true_classes(x, name)
        assert [getattr(r, f) for f in CLASSES] == [int((cls == c).sum()) for c in range(4)], name


SMALL = [n for n, f in FORMATS.items() if f.bits <= 8]


def _random_f32(fmt, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    half = n // 2
    # (1) uniform random bit patterns: every float32 exponent, subnormals included
    u = rng.integers(1, 0x7F800000, half, dtype=np.uint32)
    whole = u.view(np.float32)
    # (2) concentrated on the format's own binades and a little around them
    lo = (fmt.emin - fmt.man_bits - 3) if fmt.kind != "int" else -3
    e = rng.integers(lo, fmt.emax + 3, n - half)
    with np.errstate(over="ignore"):  # e8m0's top binades pass float32's max: inf, dropped below
        local = np.ldexp(1.0 + rng.random(n - half), e).astype(np.float32)
    x = np.concatenate([whole, local[np.isfinite(local)], _near_edges_f32()])
    signs = rng.integers(0, 2, x.size).astype(bool)
    x[signs] = -x[signs]
    return x


@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL)
def test_exactness_small_formats_10M_random(name):
    """10 million random float32 values plus every value within 3 ulps of every threshold."""
    fmt = FORMATS[name]
    x = _random_f32(fmt, 10_000_000, seed=hash(name) % 2**32)
    check_stratified(x, name, BACKENDS[0])


@pytest.mark.parametrize("name", SMALL)
def test_exactness_small_formats_torch_backend(name):
    """The pure-torch path (used on CUDA and without numba) is exact too."""
    x = _random_f32(FORMATS[name], 150_000, seed=1 + hash(name) % 2**32)
    check_stratified(x, name, "torch")


def test_torch_casts_agree_with_ground_truth():
    """torch's own casts classify like ml_dtypes (e4m3fn saturates in torch: use the halving trick)."""
    rng = np.random.default_rng(3)
    for name in ("fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e5m2fnuz", "bf16", "fp16", "e8m0"):
        fmt = FORMATS[name]
        x = np.abs(_random_f32(fmt, 200_000, seed=int(rng.integers(1 << 30))))
        x = x[np.isfinite(x) & (x > 0)]
        t = torch.from_numpy(x)
        y = t.to(fmt.torch_dtype()).double().numpy()
        if fmt.saturating:
            overflow = t.div(2).to(fmt.torch_dtype()).double().numpy() * 2 > fmt.max
        else:
            overflow = ~np.isfinite(y)
        if name == "e8m0":
            cls = _classify(y, overflow, 0.0)
        else:
            cls = _classify(y, overflow, torch.finfo(fmt.torch_dtype()).smallest_normal)
        assert np.array_equal(cls, true_classes(x, name)), name


def test_float64_inputs_single_rounding():
    """float64 values near every edge, classified by exact RNE (numpy's direct float64->float16 cast)."""
    vals = []
    for t in HIST_EDGES[1:-1]:
        f = t
        for _ in range(3):
            f = np.nextafter(f, 0.0)
        for _ in range(7):
            vals.append(f)
            f = np.nextafter(f, np.inf)
    x = np.array(vals)
    x = x[np.isfinite(x) & (x > 0)]
    backend = "auto"  # float64 always takes the float64 (torch) path
    with np.errstate(over="ignore"):
        y = x.astype(np.float16).astype(np.float64)
    cls = _classify(y, np.isinf(y), 2.0**-14)
    for c, field in enumerate(CLASSES):
        r = tensor_stats(x[cls == c], backend=backend).representability("fp16")
        assert getattr(r, field) == (cls == c).sum()
    for name in ("fp8_e4m3fn", "fp8_e5m2", "bf16", "tf32", "fp4_e2m1"):
        fmt = FORMATS[name]
        r_ = ref_round(x, fmt)
        cls = _classify(r_, r_ > fmt.max, fmt.smallest_normal)
        for c, field in enumerate(CLASSES):
            r = tensor_stats(x[cls == c], backend=backend).representability(name)
            assert getattr(r, field) == (cls == c).sum(), (name, field)


# ---------------------------------------------------------------------------
# statistics vs float64 reference
# ---------------------------------------------------------------------------

def _mixture(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
    idx = rng.choice(n, n // 20, replace=False)
    x[idx[: n // 80]] = np.nan
    x[idx[n // 80: n // 50]] = np.inf
    x[idx[n // 50: n // 40]] = -np.inf
    x[idx[n // 40:]] = 0.0
    x[: 50] = np.float32(1e-42)  # float32 subnormals
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 7, 2047, 2049, 100_003, 1 << 20])
def test_float32_against_float64_reference(backend, n):
    x = _mixture(n, seed=n)
    s = tensor_stats(x, backend=backend)
    assert s.dtype == "float32" and s.shape == (n,)
    assert_matches(s, ref_stats(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_tensor_against_reference(backend):
    x = torch.from_numpy(_mixture(300_000, seed=5)).reshape(300, 1000)
    s = tensor_stats(x, backend=backend)
    assert s.shape == (300, 1000) and s.dtype == "float32"
    assert_matches(s, ref_stats(x.numpy()))


def test_shifted_data_keeps_variance_precision():
    rng = np.random.default_rng(1)
    x = (1e6 + rng.standard_normal(1 << 20)).astype(np.float32)
    for b in BACKENDS:
        assert_matches(tensor_stats(x, backend=b), ref_stats(x), rel=1e-11)


def test_all_nonfinite_and_all_zero():
    for b in BACKENDS:
        s = tensor_stats(np.array([np.nan, np.inf, -np.inf], np.float32), backend=b)
        assert (s.nan_count, s.inf_count, s.zero_count) == (1, 2, 0)
        assert all(math.isnan(getattr(s, k)) for k in ("min", "max", "absmax", "mean", "std", "l2norm",
                                                        "min_abs_nonzero"))
        z = tensor_stats(np.zeros(5000, np.float32), backend=b)
        assert (z.zero_count, z.min, z.max, z.absmax, z.mean, z.std, z.l2norm) == (5000, 0, 0, 0, 0, 0, 0)
        assert math.isnan(z.min_abs_nonzero) and z.hist.sum() == 0


def test_fp16_norm_above_fp16_max_is_true_norm():
    x = torch.full((10_000,), 1000.0, dtype=torch.float16)
    s = tensor_stats(x)
    assert s.dtype == "float16"
    assert s.l2norm == pytest.approx(1000.0 * 100.0, rel=1e-15)  # 1e5 > 65504
    assert s.l2norm > FORMATS["fp16"].max
    assert math.isinf(torch.linalg.vector_norm(x).item())  # what an fp16 norm would say
    y = torch.randn(100_000).mul(300).to(torch.float16)
    assert_matches(tensor_stats(y), ref_stats(y.double().numpy()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
                                   torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_torch_dtypes(dtype, backend):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(50_000, generator=g) * 30).to(dtype)
    if dtype in (torch.bfloat16, torch.float16, torch.float64):
        x[::97] = float("nan")
        x[::101] = float("inf")
    if backend == "numba" and dtype == torch.float64:
        with pytest.raises(ValueError, match="numba"):
            tensor_stats(x, backend=backend)
        return
    s = tensor_stats(x, backend=backend)
    assert s.dtype == str(dtype).replace("torch.", "")
    assert_matches(s, ref_stats(x.double().numpy()))


def test_e8m0_and_packed_fp4_tensors():
    e = torch.tensor([2.0**-127, 1.0, 4.0, 2.0**127], dtype=torch.float32).to(torch.float8_e8m0fnu)
    s = tensor_stats(e)
    assert s.dtype == "float8_e8m0fnu" and s.min == 2.0**-127 and s.max == 2.0**127
    raw = np.arange(256, dtype=np.uint8)
    packed = torch.from_numpy(raw.copy()).view(torch.float4_e2m1fn_x2)
    s = tensor_stats(packed)
    lo = (raw & 0xF).view(ml_dtypes.float4_e2m1fn)  # low nibble, then high nibble
    hi = (raw >> 4).view(ml_dtypes.float4_e2m1fn)
    vals = np.concatenate([lo.astype(np.float64), hi.astype(np.float64)])
    assert s.numel == 512 and s.dtype == "float4_e2m1fn_x2"
    assert_matches(s, {**ref_stats(vals), "numel": 512})


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_ml_dtypes_arrays(backend):
    rng = np.random.default_rng(2)
    base = rng.standard_normal(10_000).astype(np.float32) * 50
    for dt in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float6_e3m2fn, ml_dtypes.float4_e2m1fn,
               np.float16):
        with np.errstate(over="ignore"):
            x = base.astype(dt)
        s = tensor_stats(x, backend=backend)
        assert s.dtype == np.dtype(dt).name
        assert_matches(s, ref_stats(x.astype(np.float64)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int_and_bool(backend):
    rng = np.random.default_rng(4)
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool):
        if dtype == torch.bool:
            t = torch.from_numpy(rng.integers(0, 2, 1000).astype(bool))
        else:
            info = torch.iinfo(dtype)
            t = torch.from_numpy(rng.integers(max(info.min, -10**6), min(info.max, 10**6), 1000)).to(dtype)
        s = tensor_stats(t, backend=backend)
        assert s.dtype == str(dtype).replace("torch.", "")
        assert_matches(s, ref_stats(t.double().numpy()))
    # wide integers: small chunks go through float32, a chunk beyond 2^24 through float64
    arr = np.array([-3, 0, 5, 2**40, 7, 2**24, -(2**24) - 1, 9], np.int64)
    for chunk in (2, 3, 100):
        assert_matches(tensor_stats(arr, chunk_elems=chunk, backend=backend), ref_stats(arr))
        assert_matches(tensor_stats(torch.from_numpy(arr), chunk_elems=chunk, backend=backend), ref_stats(arr))
    u = np.array([0, 2**63 + 5, 3], np.uint64)
    assert_matches(tensor_stats(u, backend=backend), ref_stats(u))


def test_empty_and_zero_dim():
    for x in (torch.empty(0), np.zeros((3, 0), np.float32), torch.empty(0, 5, dtype=torch.float16)):
        s = tensor_stats(x)
        assert s.numel == 0 and (s.nan_count, s.inf_count, s.zero_count) == (0, 0, 0)
        assert math.isnan(s.min) and math.isnan(s.mean) and s.hist.sum() == 0
        assert s.representability("fp8_e4m3fn").fraction("overflow") == 0.0
    s = tensor_stats(torch.tensor(-2.5))
    assert s.shape == () and s.numel == 1 and s.min == s.max == -2.5 and s.absmax == 2.5
    assert s.std == 0.0 and s.l2norm == 2.5
    assert tensor_stats(np.float32(3.0)).max == 3.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_equals_unchunked(backend):
    x = _mixture(300_001 if backend == "numba" else 100_001, seed=9)
    whole = tensor_stats(x, backend=backend)
    for chunk in (1, 1000, 4097, 65_536):
        if chunk == 1 and backend == "torch":
            continue  # 300k per-element chunks: correct but slow
        c = tensor_stats(x if chunk > 1 else x[:5000], chunk_elems=chunk, backend=backend)
        ref = whole if chunk > 1 else tensor_stats(x[:5000], backend=backend)
        for k in ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "absmax", "min_abs_nonzero"):
            assert getattr(c, k) == getattr(ref, k)
        assert np.array_equal(c.hist, ref.hist)
        for k in ("mean", "std", "l2norm"):
            assert getattr(c, k) == pytest.approx(getattr(ref, k), rel=1e-12)


def test_noncontiguous_views():
    base = torch.randn(64, 32, 8, 8)
    ref = ref_stats(base.numpy())
    for v in (base.transpose(0, 1), base.to(memory_format=torch.channels_last), base.permute(3, 2, 1, 0)):
        assert_matches(tensor_stats(v), ref)
    sl = base[:, ::2, :, 1:]
    assert_matches(tensor_stats(sl, chunk_elems=100), ref_stats(sl.numpy()))
    arr = np.asfortranarray(base.numpy())
    assert_matches(tensor_stats(arr[::3, :, ::2], chunk_elems=1000), ref_stats(arr[::3, :, ::2]))


def test_numba_and_torch_backends_agree():
    if "numba" not in BACKENDS:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(11)
    for x in (_mixture(500_000, 12), rng.standard_normal(1 << 20).astype(np.float32),
              (rng.random(100_000) * 1e-40).astype(np.float32)):
        a = tensor_stats(x, backend="numba")
        b = tensor_stats(x, backend="torch")
        for k in ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "absmax"):
            assert getattr(a, k) == getattr(b, k)
        ma, mb = a.min_abs_nonzero, b.min_abs_nonzero
        assert ma == mb or (math.isnan(ma) and math.isnan(mb))
        assert np.array_equal(a.hist, b.hist)
        for k in ("mean", "std", "l2norm"):
            assert getattr(a, k) == pytest.approx(getattr(b, k), rel=1e-12)


def test_memmap_input_bounded_memory(tmp_path):
    path = tmp_path / "big.npy"
    n = 3_000_000
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n,))
    rng = np.random.default_rng(5)
    for s in range(0, n, 1_000_000):
        mm[s:s + 1_000_000] = rng.standard_normal(1_000_000).astype(np.float16)
    mm.flush()
    del mm
    ro = np.load(path, mmap_mode="r")
    # compile (or load) the 16-bit scans and allocate the per-thread counters (1 MiB a part, kept) outside it
    tensor_stats(ro[:1 << 18])
    tracemalloc.start()
    s = tensor_stats(ro, chunk_elems=1 << 18)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 16 * (1 << 18) * 4  # a few float32 chunks, not the 24 MB file as float32
    assert_matches(s, ref_stats(np.load(path).astype(np.float64)), rel=1e-11)
    f64 = np.lib.format.open_memmap(tmp_path / "f64.npy", mode="w+", dtype=np.float64, shape=(300_000,))
    f64[:] = rng.standard_normal(300_000) * 1e150
    assert_matches(tensor_stats(f64, chunk_elems=70_000), ref_stats(np.asarray(f64)), rel=1e-11)


def test_float64_near_overflow_moments():
    x = np.array([1e308, -0.9e308, 0.5e308, 3.0], np.float64)
    s = tensor_stats(x)
    assert s.mean == pytest.approx(math.fsum(x.tolist()) / 4, rel=1e-15)
    assert math.isfinite(s.std) and math.isfinite(s.l2norm)
    dev = [(v - s.mean) / 1e308 for v in x.tolist()]
    assert s.std == pytest.approx(1e308 * math.sqrt(math.fsum(d * d for d in dev) / 4), rel=1e-14)
    assert s.l2norm == pytest.approx(1e308 * math.sqrt(math.fsum((v / 1e308) ** 2 for v in x.tolist())), rel=1e-14)
    tiny = np.array([3e-310, -1e-320, 2e-309, 0.0])  # float64 subnormals: squares would underflow
    t = tensor_stats(tiny)
    assert t.l2norm == pytest.approx(math.sqrt(math.fsum((v * 2.0**600) ** 2 for v in tiny.tolist())) / 2.0**600,
                                     rel=1e-6)
    assert t.mean == pytest.approx(math.fsum(tiny.tolist()) / 4, rel=1e-6) and t.std > 0
    # a norm beyond float64's range is reported as inf, not an error
    assert tensor_stats(np.array([1.5e308, 1.5e308])).l2norm == math.inf


def test_rejections():
    with pytest.raises(ValueError, match="complex tensors are not supported"):
        tensor_stats(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex arrays are not supported"):
        tensor_stats(np.zeros(3, np.complex128))
    with pytest.raises(ValueError, match="meta tensors"):
        tensor_stats(torch.empty(3, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor or numpy"):
        tensor_stats("abc")
    with pytest.raises(ValueError, match="cannot compute numeric statistics"):
        tensor_stats(np.array(["a", "b"]))
    with pytest.raises(ValueError, match="backend"):
        tensor_stats(np.zeros(3), backend="gpu")


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensor_counts_implicit_zeros():
    dense = torch.zeros(50, 40)
    dense[3, 4] = 2.5
    dense[10, 1] = -7.0
    dense[49, 39] = float("nan")
    for sp in (dense.to_sparse(), dense.to_sparse_csr()):
        s = tensor_stats(sp)
        assert s.shape == (50, 40) and s.numel == 2000
        assert_matches(s, ref_stats(dense.numpy()))


def test_requires_grad_tensor():
    w = torch.randn(100, requires_grad=True)
    assert_matches(tensor_stats(w * 2), ref_stats((w * 2).detach().numpy()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    x = torch.from_numpy(_mixture(1 << 20, seed=21))
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        xc = x.to(dtype)
        g = tensor_stats(xc.cuda())
        assert_matches(g, ref_stats(xc.double().numpy()))


# ---------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------

def test_representability_counts_and_fraction():
    x = np.array([0.0, 1.0, 500.0, 1e-4, 1e-9, np.nan, -np.inf, -448.0], np.float32)
    r = tensor_stats(x).representability("fp8_e4m3fn")
    # by hand: 500 overflows (> 464), 1e-9 underflows, 1e-4 is below e4m3fn's 2^-10 half-step -> 0
    assert (r.total, r.finite, r.zero, r.nan, r.inf) == (8, 6, 1, 1, 1)
    assert (r.overflow, r.underflow, r.subnormal, r.normal) == (1, 2, 0, 2)
    assert r.exact and r.fraction("overflow") == 1 / 8
    with pytest.raises(ValueError, match="unknown count"):
        r.fraction("bogus")
    r16 = tensor_stats(x).representability("float16")  # dtype spellings work
    # fp16: 1e-4 is normal (> 2^-14), 1e-9 is below half of 2^-24
    assert (r16.overflow, r16.underflow, r16.subnormal, r16.normal) == (0, 1, 0, 4)
    # 1e-5 is an fp16 subnormal (FIELD_NOTES), 7e5 overflows to inf
    r = tensor_stats(torch.tensor([1e-5, 7e5, 65519.0, 65520.0])).representability("fp16")
    assert (r.overflow, r.underflow, r.subnormal, r.normal) == (2, 0, 1, 1)


def test_summary_only_record():
    s = TensorStats.summary_only(dtype="torch.float16", shape=(4, 8), min=-70000.0, max=3.0, mean=0.1, l2norm=9.0)
    assert s.dtype == "float16" and s.numel == 32 and s.absmax == 70000.0 and s.hist is None
    assert s.is_summary_only and s.nan_count is None
    with pytest.raises(ValueError, match="no magnitude histogram"):
        s.representability("fp16")
    h = s.summary_headroom("fp16")
    assert h.any_overflow is True and h.headroom_bits == pytest.approx(math.log2(65504 / 70000))
    assert h.any_underflow is None
    ok = tensor_stats(np.array([1e-3, 2.0], np.float32)).summary_headroom("fp8_e4m3fn")
    assert ok.any_overflow is False and ok.any_underflow is False
    assert ok.footroom_bits == pytest.approx(math.log2(np.float32(1e-3) / 2.0**-9))
    assert TensorStats.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_to_dict_round_trip_is_strict_json():
    s = tensor_stats(_mixture(10_000, 3))
    for sparse in (True, False):
        d = json.loads(json.dumps(s.to_dict(sparse_hist=sparse), allow_nan=False))
        assert TensorStats.from_dict(d) == s
    empty = tensor_stats(np.zeros(0, np.float32))
    assert TensorStats.from_dict(json.loads(json.dumps(empty.to_dict(), allow_nan=False))) == empty
    bad = s.to_dict()
    bad["hist_edges_id"] = "0123456789ab"
    with pytest.raises(ValueError, match="different|edges"):
        TensorStats.from_dict(bad)


def test_merge_stats_matches_concatenation():
    a = _mixture(12_345, 1).reshape(-1, 5)
    b = _mixture(6_000, 2).reshape(-1, 5)
    m = merge_stats(tensor_stats(a), tensor_stats(b))
    assert m.shape == (3669, 5)
    assert_matches(m, ref_stats(np.concatenate([a, b])), rel=1e-12)
    only_nan = tensor_stats(np.array([np.nan], np.float32))
    m2 = merge_stats(only_nan, tensor_stats(np.array([2.0, -1.0], np.float32)))
    assert (m2.min, m2.max, m2.nan_count, m2.mean) == (-1.0, 2.0, 1, 0.5)
    summ = TensorStats.summary_only(dtype="float32", shape=(3,), min=0.0, max=1.0)
    ms = merge_stats(summ, tensor_stats(np.array([5.0], np.float32)))
    assert ms.hist is None and ms.max == 5.0 and ms.mean is None and ms.nan_count is None


# ---------------------------------------------------------------------------
# property test
# ---------------------------------------------------------------------------

@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=3, max_side=40),
                  elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)))
def test_property_counts_and_histogram(x):
    for backend in BACKENDS:
        s = tensor_stats(x, backend=backend)
        fin = s.numel - s.nan_count - s.inf_count
        assert s.numel == x.size
        assert s.nan_count + s.inf_count + fin == s.numel
        assert int(s.hist.sum()) == fin - s.zero_count
        ref = ref_stats(x)
        assert np.array_equal(s.hist, ref["hist"])
        for k in ("nan_count", "inf_count", "zero_count"):
            assert getattr(s, k) == ref[k]
        for k in ("min", "max", "absmax", "min_abs_nonzero"):
            got, want = getattr(s, k), float(ref[k])
            assert (math.isnan(got) and math.isnan(want)) or got == want
        for name in ("fp16", "fp8_e4m3fn", "e8m0", "int8"):
            r = s.representability(name)
            assert r.overflow + r.underflow + r.subnormal + r.normal == fin - s.zero_count


def test_has_nonfinite_from_counts_else_from_min_max():
    from precision_lab.stats import TensorStats, tensor_stats

    assert tensor_stats(np.array([1.0, np.inf], np.float32)).has_nonfinite
    assert tensor_stats(np.array([np.nan], np.float32)).has_nonfinite
    assert not tensor_stats(np.array([1.0, -2.0], np.float32)).has_nonfinite
    # counted and empty: the NaN Min/Max only say "no finite value"
    empty = tensor_stats(torch.zeros(0))
    assert np.isnan(empty.max) and not empty.has_nonfinite
    # summary only (no counts): a non-finite Max/Min counts, a non-finite Norm alone does not
    assert TensorStats.summary_only(dtype="float16", shape=(4,), min=-1.0, max=float("inf")).has_nonfinite
    assert not TensorStats.summary_only(dtype="float16", shape=(4,), min=-1.0, max=1.0,
                                        l2norm=float("inf")).has_nonfinite


def test_histogram_codec_round_trips_and_refuses_what_no_histogram_is():
    from precision_lab.stats import HIST_EDGES, HistogramError, decode_hist, encode_hist

    x = np.concatenate([np.zeros(3), np.logspace(-40, 38, 1001), -np.logspace(-10, 4, 77)]).astype(np.float64)
    h = S.tensor_stats(x).hist
    # independent: counts of |x| over the edges by numpy's own searchsorted
    a = np.abs(x[x != 0])
    want = np.bincount(np.searchsorted(HIST_EDGES, a, side="right") - 1, minlength=N_BINS)[:N_BINS]
    assert np.array_equal(h, want)
    bins, counts = encode_hist(h)
    assert np.array_equal(decode_hist(bins, counts), h) and sum(counts) == a.size
    for bad_bins, bad_counts, why in (([N_BINS], [1], "outside"), ([-1], [1], "outside"), ([1, 2], [1], "counts"),
                                      ([3], [-2], "negative"), ([5, 5], [1, 1], "order"), ([7, 2], [1, 1], "order"),
                                      (["x"], [1], "integers")):
        with pytest.raises(HistogramError, match=why):
            decode_hist(bad_bins, bad_counts)
    with pytest.raises(HistogramError, match="bin edges"):
        decode_hist(bins, counts, edges_id="other-edges")


def test_many_histograms_encode_at_once_as_each_would_alone_with_nulls_kept():
    from precision_lab.stats import decode_hist, encode_hists, hist_list_arrays

    rng = np.random.default_rng(3)
    # independent: each dense histogram's nonzero bins by a plain Python scan
    hists = [rng.integers(0, 3, N_BINS) * (rng.random(N_BINS) < p) for p in (0.0, 0.02, 0.5, 1.0)]
    offsets, bins, counts = encode_hists(hists)
    for i, h in enumerate(hists):
        want = [(j, int(c)) for j, c in enumerate(h) if c]
        got = list(zip(bins[offsets[i]:offsets[i + 1]].tolist(), counts[offsets[i]:offsets[i + 1]].tolist()))
        assert got == want
    assert bins.dtype == np.int32 and counts.dtype == np.int64
    # histograms of other lengths (an older writer's) take one pass each, with the same answer
    short = [np.array([0, 4, 0, 1]), np.array([2, 0, 0, 0, 0, 7])]
    o2, b2, c2 = encode_hists(short)
    assert o2.tolist() == [0, 2, 4] and b2.tolist() == [1, 3, 0, 5] and c2.tolist() == [4, 1, 2, 7]
    assert [len(x) for x in encode_hists([])] == [1, 0, 0]
    # as Arrow lists: a record without a histogram is a null, the others decode to what they were
    lb, lc = hist_list_arrays([hists[1], None, hists[2], None])
    assert lb.to_pylist()[1] is None and lb.to_pylist()[3] is None and lc.null_count == 2
    for i, h in ((0, hists[1]), (2, hists[2])):
        assert np.array_equal(decode_hist(lb[i].as_py(), lc[i].as_py()), h)
    assert str(lb.type) == "list<item: int32>" and str(lc.type) == "list<item: int64>"


# ---------------------------------------------------------------------------
# signed infinities: a -inf mask is told apart from an overflow
# ---------------------------------------------------------------------------

# the compiled kernel reads float32-exact inputs; float64 always runs the torch kernel
@pytest.mark.parametrize("backend,dtype", [(b, d) for b in BACKENDS for d in (np.float32, np.float16)]
                         + [("torch", np.float64)])
def test_negative_inf_count_matches_numpy(backend, dtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(300_001).astype(dtype)
    x[::997] = -np.inf
    x[3::4001] = np.inf
    x[5::7919] = np.nan
    s = tensor_stats(x, backend=backend)
    assert s.inf_count == int(np.isinf(x).sum())
    assert s.neg_inf_count == int(np.count_nonzero(x == -np.inf))
    assert s.negative_inf_only is False


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_inf_only_for_a_mask(backend):
    scores = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    masked = np.where(np.triu(np.ones((64, 64), bool), 1), -np.inf, scores).astype(np.float32)
    s = tensor_stats(masked, backend=backend)
    assert s.neg_inf_count == s.inf_count == int(np.triu(np.ones((64, 64)), 1).sum())
    assert s.negative_inf_only is True
    assert tensor_stats(-masked, backend=backend).negative_inf_only is False  # +inf: an overflow, not a mask
    assert tensor_stats(scores, backend=backend).negative_inf_only is False  # nothing non-finite


def test_negative_inf_count_through_torch_low_precision_and_merge():
    t = torch.zeros(1000, dtype=torch.bfloat16)
    t[:30] = float("-inf")
    t[30:35] = float("inf")
    s = tensor_stats(t)
    assert (s.inf_count, s.neg_inf_count) == (35, 30)
    a = tensor_stats(np.array([-np.inf, 1.0, np.inf], np.float32))
    b = tensor_stats(np.array([-np.inf, -np.inf, 2.0], np.float32))
    m = merge_stats(a, b)
    assert (m.inf_count, m.neg_inf_count) == (4, 3)
    assert TensorStats.from_dict(json.loads(json.dumps(m.to_dict()))).neg_inf_count == 3


def test_summary_records_infer_the_sign_from_min_and_max():
    mask = TensorStats.summary_only(dtype="float16", shape=(4, 4), min=float("-inf"), max=3.0)
    assert mask.negative_inf_only is True
    ovf = TensorStats.summary_only(dtype="float16", shape=(4, 4), min=-1.0, max=float("inf"))
    assert ovf.negative_inf_only is False
    both = TensorStats.summary_only(dtype="float16", shape=(4, 4), min=float("-inf"), max=float("inf"))
    assert both.negative_inf_only is False


@pytest.mark.slow
def test_narrow_floats_widened_piece_by_piece_match_float64():
    """fp16/bf16 tensors are widened a 1M-element piece at a time into one reused buffer: values at the
    piece boundaries, specials in several pieces and a ragged last piece are all counted exactly."""
    from precision_lab.stats import chunks

    n = 3 * chunks._WIDEN_ELEMS + 5
    x = torch.from_numpy(_mixture(n, seed=5))
    for i in (0, chunks._WIDEN_ELEMS - 1, chunks._WIDEN_ELEMS, 2 * chunks._WIDEN_ELEMS + 1, n - 1):
        x[i] = (float("nan"), float("inf"), -float("inf"), 0.0, 7e4)[i % 5]
    for dtype in (torch.float16, torch.bfloat16):
        xc = x.to(dtype)
        for chunk in (1 << 24, chunks._WIDEN_ELEMS + 3):  # one torch chunk, or chunks that straddle the pieces
            assert_matches(tensor_stats(xc, chunk_elems=chunk), ref_stats(xc.double().numpy()))


@pytest.mark.skipif("numba" not in BACKENDS, reason="the compiled kernel needs numba")
def test_key_counting_scan_is_exact_block_by_block_and_leaves_no_counts_behind():
    """The compiled scan counts keys and bins them at the end, fixing up only the blocks that hold a float32
    subnormal or a value in a range split by a format threshold (fp16's 65504/65520, bf16's overflow): such
    values scattered through a large normal tensor, runs of one value, and a call after a call on other data
    all give numpy's float64 histogram exactly, and the per-thread counters are all zero after each call."""
    from precision_lab.stats import kernels as K, scan
    from precision_lab.stats.edges import histogram_counts

    rng = np.random.default_rng(11)
    big = rng.standard_normal(3_000_000).astype(np.float32)
    near = np.array([65504, 65520, np.nextafter(np.float32(65520), np.float32(0)), 65519.5, 65280,
                     np.float32(6.1005353927612305e-05), np.nextafter(np.float32(6.1005353927612305e-05), np.float32(0)),
                     3.3961775e38, 3.4028235e38, 1e-40, 1e-45, 0.5, np.nextafter(np.float32(0.5), np.float32(1))],
                    np.float32)
    pos = rng.choice(big.size, 40 * near.size, replace=False)
    big[pos] = np.tile(near, 40) * np.where(rng.random(pos.size) < 0.5, -1, 1).astype(np.float32)
    cases = [
        big,                                                        # parallel parts, span fold
        big[:100_000],                                              # one part
        np.full(1_000_000, 0.5, np.float32),                        # one key, over and over
        np.tile(np.array([0.5, np.nextafter(np.float32(0.5), np.float32(1)), 0.0], np.float32), 70_001),
        np.concatenate([big[:5000], [np.inf, -np.inf, np.nan]]).astype(np.float32),  # non-finite: element fold
        near,                                                       # fewer elements than keys
        # every pattern of every split range, both signs, shuffled: each inner edge and both its neighbours
        rng.permutation(np.concatenate([
            ((K._SPLIT[:, :1].astype(np.uint32) << 16) | np.arange(1 << 16, dtype=np.uint32)).ravel().view(np.float32),
            -((K._SPLIT[:, :1].astype(np.uint32) << 16) | np.arange(1 << 16, dtype=np.uint32)).ravel().view(np.float32)])),
        # a masked attention score: half of it float32's most negative value, in every block
        np.where(rng.random(600_000) < 0.5, np.float32(-3.4028235e38), big[:600_000]).astype(np.float32),
    ]
    for x in cases + cases[::-1]:
        s = tensor_stats(x, backend="numba")
        expect = histogram_counts(x[np.isfinite(x)].astype(np.float64))
        assert np.array_equal(s.hist, expect), np.nonzero(s.hist != expect)
        assert s.zero_count == int((x == 0).sum())
        table = scan._SCRATCH.table
        assert table is not None and not table.any()


@pytest.mark.skipif("numba" not in BACKENDS, reason="the compiled kernel needs numba")
@pytest.mark.parametrize("src", ["fp16", "bf16"])
def test_sixteen_bit_floats_are_widened_inside_the_scan_exactly(all16, src):
    """fp16 and bf16 reach the compiled scan as their bit patterns and are widened there block by block: every
    one of the 65,536 patterns (subnormals, signed zeros, Inf, NaN), as numpy and torch arrays, in one block,
    in many and split across threads, gives the statistics of the same values already in float32."""
    wide = all16[src]
    bits = np.arange(65536, dtype=np.uint16)
    narrow = bits.view(np.float16) if src == "fp16" else bits.view(ml_dtypes.bfloat16)
    tdtype = torch.float16 if src == "fp16" else torch.bfloat16
    rng = np.random.default_rng(3)
    order = rng.permutation(65536)
    for backend_input, expect_input in (
        (narrow, wide),
        (torch.from_numpy(bits.view(np.int16).copy()).view(tdtype), wide),
        (np.tile(narrow[order], 9), np.tile(wide[order], 9)),           # 590k elements: parallel parts
        (narrow[:3000], wide[:3000]),                                    # one part, fewer elements than keys
    ):
        got, want = tensor_stats(backend_input, backend="numba"), tensor_stats(expect_input, backend="numba")
        assert np.array_equal(got.hist, want.hist)
        for f in ("nan_count", "inf_count", "neg_inf_count", "zero_count", "min", "max", "absmax",
                  "min_abs_nonzero", "mean", "std", "l2norm"):
            a, b = getattr(got, f), getattr(want, f)
            assert a == b or (a != a and b != b), (f, a, b)
    assert got.dtype == ("float16" if src == "fp16" else "bfloat16")
    # short runs of signalling NaNs (the scalar tail of the widening loop): counted, and no counter left behind
    from precision_lab.stats import scan

    snan = 0x7C01 if src == "fp16" else 0x7F81
    for n in (1, 7, 17, 33):
        got = tensor_stats(narrow[snan:snan + n], backend="numba")
        assert got.nan_count == n and not scan._SCRATCH.table.any()


@pytest.mark.parametrize("kind", ["float32", "float64-extremes", "float16", "bfloat16", "float8_e4m3fn", "int64",
                                  "bool"])
def test_numpy_path_against_reference_and_kernel(kind):
    """The float64 numpy path (numpy inputs while the kernel is not compiled yet, or without numba): the float64
    reference to rounding, and the kernel's counts, extrema and histogram exactly."""
    x = _mixture(100_003, seed=11)
    if kind == "float64-extremes":
        x = x.astype(np.float64)
        x[100:110] = [1e150, -1.7e150, 5e-324, -1e-320, 1e-310, 3.0, -3.0, 1e140, 2e-300, 0.0]
    elif kind == "int64":
        x = np.random.default_rng(2).integers(-(1 << 40), 1 << 40, 50_001)
    elif kind == "bool":
        x = np.random.default_rng(2).random(50_001) < 0.3
    elif kind != "float32":
        with np.errstate(over="ignore"):  # beyond the format: Inf, as a cast gives
            x = x.astype(getattr(ml_dtypes, kind) if kind != "float16" else np.float16)
    s = tensor_stats(x, backend="numpy", chunk_elems=30_011)
    assert s.dtype == kind.split("-")[0] and s.numel == x.size
    assert_matches(s, ref_stats(x), rel=1e-12)
    if "numba" in BACKENDS and kind not in ("float64-extremes", "int64"):
        k = tensor_stats(x, backend="numba")
        for f in ("nan_count", "inf_count", "neg_inf_count", "zero_count", "min", "max", "absmax",
                  "min_abs_nonzero"):
            assert getattr(s, f) == getattr(k, f) or (math.isnan(getattr(s, f)) and math.isnan(getattr(k, f))), f
        assert np.array_equal(s.hist, k.hist)
        for f in ("mean", "std", "l2norm"):  # two float64 summation orders; this mean cancels 5 digits
            assert getattr(s, f) == pytest.approx(getattr(k, f), rel=1e-10), f
    with pytest.raises(ValueError, match="numpy arrays"):
        tensor_stats(torch.zeros(3), backend="numpy")


@pytest.mark.slow
def test_summary_stats_counts_at_edges_equal_the_histograms_tail():
    """``summary_stats``: the statistics without the histogram, and the nonzero finite magnitudes at or above
    chosen edges -- against float64 numpy, on the compiled kernel (float32/bf16/fp16, in parts on several
    threads, strided) and on the histogram path it falls back to (float64, fp8); edge 0 (which would count
    zeros) and edges past the last are refused."""
    from precision_lab.stats import HIST_EDGES, N_BINS, summary_stats

    rng = np.random.default_rng(21)
    x = _mixture(300_001, seed=21)
    edges = np.unique(np.concatenate([[1, N_BINS], rng.integers(1, N_BINS + 1, 40)]))
    ties = np.asarray(HIST_EDGES[edges[(HIST_EDGES[edges] > 0) & np.isfinite(HIST_EDGES[edges])]], np.float32)
    x[:ties.size] = ties  # values exactly at edges count as at or above them
    cases = [x, torch.from_numpy(x), torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(x).to(torch.float16),
             torch.from_numpy(x[:300_000]).reshape(300, 1000).t(), torch.from_numpy(x)[::3],
             x.astype(np.float64), torch.from_numpy(x[:5000]).to(torch.float8_e5m2), x[:0]]
    for c in cases:
        s, above = summary_stats(c, edges)
        v = (c.float().numpy() if isinstance(c, torch.Tensor) else c).astype(np.float64).ravel()
        mag = np.abs(v[np.isfinite(v) & (v != 0)])
        want = np.array([(mag >= HIST_EDGES[e]).sum() for e in edges])
        assert s.hist is None and np.array_equal(above, want), getattr(c, "dtype", None)
        assert_matches(s, ref_stats(v))
    for bad in ([0], [N_BINS + 1]):
        with pytest.raises(ValueError, match="edge"):
            summary_stats(x, bad)
