"""Comparison metrics against independent float64 numpy computations."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from precision_lab.formats import FORMATS
from precision_lab.metrics import compare, compare_stats, scaled_worst
from precision_lab.stats import tensor_stats


def _ref_metrics(r, c, floor):
    r = r.astype(np.float64).ravel()
    c = c.astype(np.float64).ravel()
    both = np.isfinite(r) & np.isfinite(c)
    rr, cc = r[both], c[both]
    d = cc - rr
    return {
        "max_abs_err": np.max(np.abs(d)),
        "mean_abs_err": np.mean(np.abs(d)),
        "rmse": np.sqrt(np.mean(d * d)),
        "max_rel_err": np.max(np.abs(d) / np.maximum(np.abs(rr), floor)),
        "cosine": float(np.dot(rr, cc) / (np.linalg.norm(rr) * np.linalg.norm(cc))),
        "sqnr_db": 10 * np.log10(np.sum(rr * rr) / np.sum(d * d)) if np.any(d) else math.inf,
        "nonfinite_introduced": int(np.sum(np.isfinite(r) & ~np.isfinite(c))),
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compare_matches_float64_reference(dtype):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, 37, generator=g) * 3
    cand = ref.to(dtype)
    cmp = compare(ref, cand)
    fmt = FORMATS["fp16" if dtype == torch.float16 else "bf16"]
    exp = _ref_metrics(ref.numpy(), cand.float().numpy(), fmt.smallest_normal)
    for k, v in exp.items():
        assert getattr(cmp, k) == pytest.approx(v, rel=1e-12, abs=0), k
    assert cmp.cand_format == fmt.name
    # a single correctly rounded cast is within half an ulp everywhere
    assert cmp.max_ulp_err <= 0.5
    assert cmp.verdict == "expected"


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_numpy_path_matches_float64_reference(name):
    """The path numpy inputs take while the compiled kernel is not there yet (and without numba)."""
    rng = np.random.default_rng(3)
    ref = (rng.standard_normal((1000, 37)) * 3).astype(np.float32)
    ref[0, :5] = np.float32(np.finfo(np.float32).min)  # a mask, in both runs below
    with np.errstate(over="ignore"):  # the mask overflows to -inf in fp16, as a cast gives
        cand = ref.astype(np.float16 if name == "float16" else ml_dtypes.bfloat16)
    cand[1, 0] = np.inf  # introduced
    ref[2, 0] = np.nan  # in the reference
    fmt = FORMATS["fp16" if name == "float16" else "bf16"]
    cmp = compare(ref, cand, backend="numpy", chunk=4099)
    r64, c64 = ref.astype(np.float64), cand.astype(np.float64)
    keep = ~(r64 <= np.finfo(np.float32).min / 2)
    exp = _ref_metrics(r64[keep], c64[keep], fmt.smallest_normal)
    for k, v in exp.items():
        assert getattr(cmp, k) == pytest.approx(v, rel=1e-12, abs=0), k
    assert cmp.masked == 5 and cmp.nonfinite_in_ref == 1 and cmp.cand_format == fmt.name
    with pytest.raises(ValueError, match="numpy arrays"):
        compare(torch.from_numpy(ref), torch.from_numpy(ref), backend="numpy")


def test_cosine_deficit_resolves_near_one():
    x = np.linspace(1, 2, 100_000)
    y = x * (1 + 1e-9 * np.sin(np.arange(x.size)))
    cmp = compare(x, y, cand_format="fp32")
    # independent: 1 - cos via the angle between the vectors in float64 with extended care
    xn = x / np.linalg.norm(x)
    yn = y / np.linalg.norm(y)
    expected = np.sum((xn - yn) ** 2) / 2
    assert cmp.cosine_deficit == pytest.approx(expected, rel=1e-6)
    assert 0 < cmp.cosine_deficit < 1e-15  # float64 cosine alone would print as 1.0


def test_nonfinite_introduced_and_excluded_from_moments():
    ref = np.array([1.0, 2.0, 70000.0, np.nan, 5.0], dtype=np.float32)
    with np.errstate(over="ignore"):
        cand = ref.astype(np.float16)  # 70000 -> inf in fp16
    cmp = compare(ref, cand)
    assert cmp.nonfinite_introduced == 1
    assert cmp.nonfinite_in_ref == 1
    assert cmp.compared == 3
    assert cmp.verdict == "nonfinite"
    exp = _ref_metrics(ref, cand.astype(np.float32), FORMATS["fp16"].smallest_normal)
    assert cmp.max_abs_err == exp["max_abs_err"]


def test_fp16_norm_does_not_overflow_in_metrics():
    ref = np.full(10_000, 60000.0, dtype=np.float32)
    cand = ref.astype(np.float16)
    cmp = compare(ref, cand)
    assert cmp.sqnr_db == math.inf or cmp.sqnr_db > 60
    assert cmp.nonfinite_introduced == 0


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 3\)"):
        compare(np.zeros((2, 3)), np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        compare(np.zeros((2, 3)), np.zeros((3, 2)))


def test_real_bug_flagged_but_rounding_not():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal(4096).astype(np.float32)
    bf = ref.astype(ml_dtypes.bfloat16)
    assert compare(ref, bf).verdict == "expected"
    # a 5% systematic error is ~13 bf16 unit roundoffs: not explained by rounding
    assert compare(ref, (ref * 1.05).astype(ml_dtypes.bfloat16)).verdict == "warn"
    assert compare(ref, (ref * 1.5).astype(ml_dtypes.bfloat16)).verdict == "error"


def test_chunking_gives_same_answer():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal(10_001)
    cand = ref + rng.standard_normal(10_001) * 1e-3
    a = compare(ref, cand, cand_format="fp16")
    b = compare(ref, cand, cand_format="fp16", chunk=997)
    assert a.max_abs_err == b.max_abs_err
    assert a.max_rel_err == b.max_rel_err
    assert a.rmse == pytest.approx(b.rmse, rel=1e-12)
    assert a.sqnr_db == pytest.approx(b.sqnr_db, rel=1e-12)


def test_max_ulp_err_counts_format_spacing():
    # candidate one fp16 ulp above the reference at 1.0 (ulp = 2^-10)
    ref = np.ones(8, dtype=np.float32)
    cand = np.full(8, 1 + 2**-10, dtype=np.float32)
    assert compare(ref, cand, cand_format="fp16").max_ulp_err == 1.0
    assert compare(ref, cand, cand_format="bf16").max_ulp_err == pytest.approx(2**-10 / 2**-7)


def test_cosine_deficit_against_exact_rationals():
    from fractions import Fraction

    rng = np.random.default_rng(5)
    r = rng.standard_normal(300)
    c = r + rng.standard_normal(300) * 1e-7
    cmp = compare(r, c, cand_format="fp32")
    R = [Fraction(float(v)) for v in r]
    C = [Fraction(float(v)) for v in c]
    rr = sum(a * a for a in R)
    cc = sum(b * b for b in C)
    rc = sum(a * b for a, b in zip(R, C))
    num = rr * cc - rc * rc  # exact: |r|^2|c|^2 - (r.c)^2
    nrnc = math.sqrt(float(rr)) * math.sqrt(float(cc))
    exact = float(num) / (nrnc * (nrnc + float(rc)))
    assert cmp.cosine_deficit == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("other", ["torch", "numpy"])
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3fn", "int8"])
def test_numba_and_float64_accumulators_agree(fmt, other):
    rng = np.random.default_rng(6)
    r = (rng.standard_normal(200_003) * np.exp(rng.uniform(-12, 12, 200_003))).astype(np.float32)
    c = (r * (1 + rng.standard_normal(r.size).astype(np.float32) * 1e-3)).astype(np.float32)
    r[::1000] = np.nan
    c[5::997] = np.inf
    r[7::501] = 0.0
    a = compare(r, c, cand_format=fmt, backend="numba")
    b = compare(r, c, cand_format=fmt, backend=other)
    for f in ("compared", "nonfinite_introduced", "nonfinite_in_ref", "max_abs_err", "max_rel_err", "max_ulp_err"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("mean_abs_err", "rmse", "sqnr_db", "cosine_deficit", "rounding_units"):
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-9), f
    # and the ulp error agrees with a per-element float64 numpy computation
    both = np.isfinite(r) & np.isfinite(c)
    rr, cc = r[both].astype(np.float64), c[both].astype(np.float64)
    F = FORMATS[fmt]
    if F.kind == "int":
        ulp = np.ones_like(rr)
    else:
        _, e = np.frexp(np.abs(rr))
        e = np.where(rr != 0, np.maximum(e - 1, F.emin), F.emin)  # frexp(0) gives 0
        ulp = np.ldexp(1.0, e - F.man_bits)
    assert a.max_ulp_err == np.max(np.abs(cc - rr) / ulp)
    assert b.max_ulp_err == np.max(np.abs(cc - rr) / ulp)


def test_stats_comparison_counts_only_what_the_candidate_adds():
    """A -inf mask in both runs is not introduced; extra NaN and +inf are, counted apart."""
    mask = np.triu(np.ones((16, 16), bool), 1)
    scores = np.random.default_rng(0).standard_normal((16, 16))
    ref = np.where(mask, -np.inf, scores).astype(np.float32)
    same = compare_stats(tensor_stats(ref), tensor_stats(ref.astype(np.float16)))
    assert same.nonfinite_introduced == 0 and same.verdict != "nonfinite"
    cand = ref.astype(np.float16)
    cand[0, 0], cand[1, 0], cand[2, 0] = np.inf, np.nan, np.nan
    got = compare_stats(tensor_stats(ref), tensor_stats(cand))
    # independent count: positions finite in the reference and not in the candidate
    assert got.nonfinite_introduced == int((np.isfinite(ref) & ~np.isfinite(cand)).sum()) == 3
    assert got.verdict == "nonfinite"
    # a candidate -inf where the reference had +inf is not hidden by equal totals
    flip_ref = np.array([np.inf, 1.0], np.float32)
    flip_cand = np.array([-np.inf, 1.0], np.float16)
    assert compare_stats(tensor_stats(flip_ref), tensor_stats(flip_cand)).nonfinite_introduced == 1


def test_stats_comparison_keeps_its_summary_errors_apart_from_element_errors():
    """compare_stats compares max, min and l2norm: their largest absolute and relative differences (float64 by
    hand from the summaries) land in summary_abs_err/summary_rel_err, and the element-wise fields stay None."""
    rng = np.random.default_rng(7)
    ref = (rng.standard_normal(4096) * 3).astype(np.float32)
    cand = (ref * 1.01).astype(np.float16)
    got = compare_stats(tensor_stats(ref), tensor_stats(cand))
    r, c = ref.astype(np.float64), cand.astype(np.float64)
    floor = float(np.finfo(np.float16).smallest_normal)
    sums = [(r.max(), c.max()), (r.min(), c.min()), (np.sqrt(np.sum(r * r)), np.sqrt(np.sum(c * c)))]
    want_abs = max(abs(b - a) for a, b in sums)
    want_rel = max(abs(b - a) / max(abs(a), floor) for a, b in sums)
    assert got.basis == "stats"
    assert got.summary_abs_err == pytest.approx(want_abs, rel=1e-9)
    assert got.summary_rel_err == pytest.approx(want_rel, rel=1e-9)
    assert 0.009 < got.summary_rel_err < 0.011  # the 1 % scaling, seen through fp16 rounding
    for f in ("max_abs_err", "mean_abs_err", "rmse", "max_rel_err", "cosine", "sqnr_db", "rounding_units",
              "max_ulp_err"):
        assert getattr(got, f) is None, f
    # the verdict is still judged from the summaries' relative error, in unit roundoffs of fp16
    units = want_rel / (FORMATS["fp16"].eps / 2)
    assert 8 < units <= 64 and got.verdict == "warn" and got.reason.startswith("summary statistics: ")
    assert f"{units:.3g}x" in got.reason
    # nothing comparable: no summary error either
    from precision_lab.stats import TensorStats

    blank = TensorStats.summary_only(dtype="float16", shape=(2,), min=None, max=None, mean=None, l2norm=None)
    none = compare_stats(blank, blank)
    assert none.summary_abs_err is None and none.summary_rel_err is None and none.verdict == "warn"
    # an element-wise comparison has no summary errors
    elem = compare(ref, cand)
    assert elem.summary_abs_err is None and elem.summary_rel_err is None and elem.max_rel_err is not None


def test_torch_comparison_brings_its_sums_to_the_host_once():
    """The torch path (every GPU tensor) makes no host conversion per chunk and no boolean-mask indexing: on a
    GPU each of those is a sync.  Counted on CPU tensors: one transfer for a comparison of three chunks, and
    the same numbers as the compiled kernel."""
    g = torch.Generator().manual_seed(3)
    r = torch.randn(3 * 4096 + 5, generator=g) * 100
    c = (r * (1 + torch.randn(r.shape, generator=g) * 1e-3)).to(torch.float16)
    r[::700] = float("nan")
    calls = []
    saved = {}
    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)
        saved[name] = real

        def counting(self, *a, _name=name, _real=real, **k):
            calls.append(_name)
            return _real(self, *a, **k)

        setattr(torch.Tensor, name, counting)
    real_getitem = torch.Tensor.__getitem__

    def getitem(self, idx):
        if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool:
            calls.append("mask index")
        return real_getitem(self, idx)

    torch.Tensor.__getitem__ = getitem
    try:
        got = compare(r, c, backend="torch", chunk=4096)
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)
        torch.Tensor.__getitem__ = real_getitem
    assert calls.count("cpu") == 1 and "mask index" not in calls, calls
    assert not {"item", "__float__", "__int__", "__bool__"} & set(calls), calls
    want = compare(r.numpy(), c.float().numpy(), cand_format="fp16", backend="auto")
    for f in ("compared", "nonfinite_in_ref", "max_abs_err", "max_rel_err", "max_ulp_err"):
        assert getattr(got, f) == getattr(want, f), f
    assert got.rmse == pytest.approx(want.rmse, rel=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_comparison_synchronises_once():
    g = torch.Generator(device="cuda").manual_seed(0)
    r = torch.randn(5_000_000, device="cuda", generator=g)
    c = (r * 1.001).half()
    compare(r, c, backend="torch")  # warm-up: kernels and allocator
    torch.cuda.synchronize()
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got = compare(r, c, backend="torch", chunk=1 << 20)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # the first set_sync_debug_mode of a process also warns that the mode is a prototype: not a sync
    syncs = [x for x in w if "called a synchronizing" in str(x.message)]
    assert len(syncs) <= 1, [str(x.message) for x in syncs]
    want = compare(r.cpu().numpy(), c.float().cpu().numpy(), cand_format="fp16")
    assert got.compared == want.compared and got.max_abs_err == pytest.approx(want.max_abs_err, rel=1e-12)


def test_a_near_zero_element_is_judged_against_the_tensor_scale():
    """A bf16 attention score that is near zero carries the absolute rounding of its 64-wide dot product: judged
    against its own value it is "off by" thousands of percent, against max(|value|, the tensor's RMS) it is
    rounding.  The worst-element bound is at least the exact float64 figure and at most max_rel_err; one large
    element really off still withdraws "expected"."""
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((64, 64)), rng.standard_normal((64, 64))
    ref = (q @ k.T).astype(np.float32)
    ref[0, 0] = 1e-6  # a score that is zero up to rounding noise
    cand = (q.astype(ml_dtypes.bfloat16).astype(np.float32) @ k.astype(ml_dtypes.bfloat16).astype(np.float32).T)
    cand[0, 0] = ref[0, 0] + 0.05  # what a bf16 product of 64 terms of size ~1 leaves at a zero
    cand = cand.astype(ml_dtypes.bfloat16)
    got = compare(torch.from_numpy(ref), torch.from_numpy(cand.astype(np.float32)), cand_format="bf16")
    r, c = ref.astype(np.float64), cand.astype(np.float64)
    rms = np.sqrt(np.mean(r * r))
    exact = np.max(np.abs(c - r) / np.maximum(np.abs(r), rms))
    bound = scaled_worst(got.max_rel_err, got.max_abs_err, rms)
    assert exact <= bound * (1 + 1e-12) and bound <= got.max_rel_err
    assert got.max_rel_err > 1000  # the old reading: "off by 1e5 %"
    assert got.verdict == "expected", got.reason
    big = cand.astype(np.float32)
    i = np.unravel_index(np.argmax(np.abs(ref)), ref.shape)
    big[i] = ref[i] * 1.1  # the largest score 10 % off: no rounding explains it
    worse = compare(torch.from_numpy(ref), torch.from_numpy(big), cand_format="bf16")
    assert worse.verdict == "warn" and "one element is off by" in worse.reason
