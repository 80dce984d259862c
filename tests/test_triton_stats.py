"""The fused Triton statistics kernel (precision_lab/stats/triton_stats.py).

Without a GPU it runs on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``, set per test by the
``interpret`` fixture, read when the kernel is launched) and is checked against float64 numpy: counts, extremes,
moments, the histogram over HIST_EDGES and every registered format's overflow/underflow/subnormal counts, on
tensors holding NaN, +/-Inf, zeros, subnormals and values past the narrow formats' limits, for every input
dtype and sizes around the block.  The capture's choice of path is checked on the CPU; the CUDA tests (skipped
where no CUDA device exists) run the compiled kernel and count host syncs with
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import precision_lab
from precision_lab.formats import FORMATS
from precision_lab.live import CaptureOptions, PairOptions
from precision_lab.live.engine import StatsEngine
from precision_lab.stats import HIST_EDGES, N_BINS, finish_partials, tensor_stats
from precision_lab.stats import triton_stats
from precision_lab.store import Store

ROOT = Path(__file__).resolve().parents[1]
TEST_BLOCK = 32  # a small block: the interpreter runs each program's steps in turn
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def _triton_cache(tmp_path_factory):
    """Compiled kernels go to a folder of this test run, not the user's ~/.triton."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        yield


@pytest.fixture
def interpret(monkeypatch):
    """Triton's interpreter for this test only (the kernels are built per mode, when launched)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---- inputs and an independent float64 reference ------------------------------------------------

def _limits() -> list[float]:
    """Magnitudes at and around every registered format's limits and rounding thresholds."""
    out = []
    with np.errstate(over="ignore"):  # fp32's own overflow threshold is past float32: inf, kept
        for fmt in FORMATS.values():
            _around(fmt, out)
    f32 = np.finfo(np.float32)
    out += [float(f32.max), float(f32.tiny), float(f32.smallest_subnormal), float(f32.smallest_subnormal) * 7,
            float(f32.tiny) / 2 + float(f32.smallest_subnormal)]
    return out


def _around(fmt, out: list) -> None:
    for v in (fmt.max, fmt.overflow_threshold, fmt.underflow_threshold, fmt.normal_threshold, fmt.smallest_normal,
              fmt.smallest_subnormal or 0.0):
        if v > 0:
            v32 = np.float32(v)  # and the float32 values on either side, where float32 inputs land
            out += [v, float(np.nextafter(v, 0.0)), float(np.nextafter(v, np.inf)), v * 1.5, v / 3,
                    float(np.nextafter(v32, np.float32(0))), float(np.nextafter(v32, np.float32(np.inf)))]


def hostile(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` float64 values, shuffled: NaN, +/-Inf, 0 and -0.0 first, then limits of formats.py with either sign,
    then random values over a wide exponent range."""
    rng = np.random.default_rng(seed)
    limits = np.array(_limits())
    limits = rng.permutation(np.concatenate([limits, -limits]))
    vals = np.concatenate([[math.nan, math.inf, -math.inf, 0.0, -0.0], limits,
                           rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))])[:n]
    return torch.from_numpy(rng.permutation(vals))


def reference(t: torch.Tensor) -> dict:
    """float64 numpy statistics of a tensor's values (widened through torch's exact cast to float32)."""
    with np.errstate(invalid="ignore"):  # a signalling NaN's payload
        a = t.detach().cpu().to(torch.float32).numpy().astype(np.float64).ravel()
    fin = np.isfinite(a)
    f = a[fin]
    mag = np.abs(f[f != 0])
    out = {"numel": a.size, "nan_count": int(np.isnan(a).sum()), "inf_count": int(np.isinf(a).sum()),
           "neg_inf_count": int((a == -np.inf).sum()), "zero_count": int((a == 0).sum()),
           "hist": np.bincount(np.searchsorted(HIST_EDGES, mag, side="right") - 1, minlength=N_BINS)}
    if f.size:
        out.update(min=f.min(), max=f.max(), absmax=np.abs(f).max(), mean=f.mean(), std=f.std(),
                   l2norm=math.sqrt(float(np.sum(f * f))), min_abs_nonzero=mag.min() if mag.size else math.nan)
    else:
        out.update({k: math.nan for k in ("min", "max", "absmax", "mean", "std", "l2norm", "min_abs_nonzero")})
    out["formats"] = {name: _format_counts(mag, fmt) for name, fmt in FORMATS.items()}
    return out


def _format_counts(mag: np.ndarray, fmt) -> tuple[int, int, int]:
    """(overflow, underflow, subnormal) of nonzero finite magnitudes by the format's thresholds (formats.py)."""
    overflow = int((mag >= fmt.overflow_threshold).sum())
    underflow = int((mag < fmt.underflow_threshold).sum())
    sub = int(((mag >= fmt.underflow_threshold) & (mag < fmt.normal_threshold)).sum()) \
        if fmt.normal_threshold > fmt.underflow_threshold else 0
    return overflow, underflow, sub


def assert_matches(stats, t: torch.Tensor, *, hist: bool = True) -> None:
    ref = reference(t)
    assert stats.numel == ref["numel"]
    for k in ("nan_count", "inf_count", "neg_inf_count", "zero_count"):
        assert getattr(stats, k) == ref[k], k
    for k in ("min", "max", "absmax", "min_abs_nonzero"):
        a, b = getattr(stats, k), float(ref[k])
        assert (math.isnan(a) and math.isnan(b)) or a == b, (k, a, b)
    scale = ref["absmax"] if math.isfinite(ref["absmax"]) else 0.0
    for k in ("mean", "std", "l2norm"):
        a, b = getattr(stats, k), float(ref[k])
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-15 * scale), (k, a, b)
    if not hist:
        assert stats.hist is None
        return
    np.testing.assert_array_equal(stats.hist, ref["hist"])
    for name, (overflow, underflow, sub) in ref["formats"].items():
        r = stats.representability(name)
        assert (r.overflow, r.underflow, r.subnormal) == (overflow, underflow, sub), name


def run_kernel(t: torch.Tensor, *, histogram: bool = True, block: int = TEST_BLOCK, programs=None):
    parts = triton_stats.device_partials(t, histogram=histogram, block=block, programs=programs)
    numel = t.numel()
    return finish_partials(parts, histogram=histogram, numel=numel, dtype=str(t.dtype).replace("torch.", ""),
                           shape=tuple(t.shape))


# ---- the kernel through the interpreter -------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("n", [1, TEST_BLOCK + 1, pytest.param(TEST_BLOCK - 1, marks=pytest.mark.slow),
                               pytest.param(5 * TEST_BLOCK + 3, marks=pytest.mark.slow)])
def test_kernel_matches_float64_reference(interpret, dtype, n):
    t = hostile(max(n, 1), seed=n).to(dtype)
    for programs in ((1, 3) if n > TEST_BLOCK else (None,)):
        assert_matches(run_kernel(t, programs=programs), t)


def test_hostile_tensor_reaches_every_class(interpret):
    """The inputs do what the tests rely on: past fp16's and e4m3's limits, fp16 subnormals, float32
    subnormals, NaN, both infinities and -0.0, all in one float32 tensor the kernel reads exactly."""
    t = hostile(5 * TEST_BLOCK + 3, seed=5 * TEST_BLOCK + 3).to(torch.float32)
    s = run_kernel(t, programs=3)
    assert_matches(s, t)
    fp16, e4m3 = s.representability("fp16"), s.representability("fp8_e4m3fn")
    assert fp16.overflow and fp16.underflow and fp16.subnormal and e4m3.overflow
    assert s.representability("fp32").subnormal > 0  # float32 subnormals in the input
    assert s.nan_count and s.neg_inf_count and s.inf_count > s.neg_inf_count and s.zero_count >= 2


def test_without_histogram_the_totals_are_the_same(interpret):
    t = hostile(3 * TEST_BLOCK, seed=3).to(torch.bfloat16)
    assert_matches(run_kernel(t, histogram=False, programs=2), t, hist=False)


def test_the_kernel_agrees_with_the_cpu_kernel(interpret):
    """The same TensorStats as tensor_stats on the CPU (the capture's own CPU path)."""
    t = hostile(4 * TEST_BLOCK + 7, seed=11).to(torch.float16)
    got, want = run_kernel(t, programs=2), tensor_stats(t)
    for k in ("nan_count", "inf_count", "neg_inf_count", "zero_count", "min", "max", "absmax", "min_abs_nonzero"):
        assert getattr(got, k) == getattr(want, k), k
    np.testing.assert_array_equal(got.hist, want.hist)
    for k in ("mean", "std", "l2norm"):
        assert getattr(got, k) == pytest.approx(getattr(want, k), rel=1e-12)


@pytest.mark.slow
def test_layouts_views_and_empty(interpret):
    base = hostile(6 * 10, seed=2).to(torch.float32).reshape(6, 10)
    for t in (base.t(), base[:, ::3], base[1:4, 2:9], torch._neg_view(base), base[2, 3]):
        assert_matches(run_kernel(t, programs=2), t.resolve_neg() if t.is_neg() else t)
    assert triton_stats.device_partials(base[:0], histogram=True) == []


def test_values_only_past_the_formats(interpret):
    """No finite value (min/max/mean are NaN, min_abs_nonzero too) and only zeros (min_abs_nonzero NaN)."""
    nonfinite = torch.tensor([math.nan, math.inf, -math.inf] * 20, dtype=torch.float32)
    s = run_kernel(nonfinite, programs=2)
    assert_matches(s, nonfinite)
    assert math.isnan(s.min) and math.isnan(s.mean) and s.hist.sum() == 0
    zeros = torch.tensor([0.0, -0.0] * 20, dtype=torch.bfloat16)
    s = run_kernel(zeros, programs=2)
    assert_matches(s, zeros)
    assert s.zero_count == 40 and s.absmax == 0.0 and math.isnan(s.min_abs_nonzero)


@pytest.mark.slow
def test_every_code_of_the_8_bit_formats(interpret):
    """Each of the 256 codes of every fp8 dtype, decoded by the kernel, against torch's own cast."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dtype in DTYPES:
        if torch.finfo(dtype).bits != 8:
            continue
        t = codes.view(dtype)
        assert_matches(run_kernel(t, programs=3), t)


def test_rejects_what_it_does_not_read(interpret):
    with pytest.raises(ValueError, match="float64"):
        triton_stats.device_partials(torch.zeros(3, dtype=torch.float64), histogram=True)
    with pytest.raises(ValueError, match="int32"):
        triton_stats.device_partials(torch.zeros(3, dtype=torch.int32), histogram=True)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA tensors"):
        triton_stats.device_partials(torch.ones(4), histogram=True)


# ---- which path the capture takes -----------------------------------------------------------------------

def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _step(model, x):
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()


def test_cpu_tensors_never_take_the_triton_path(interpret, monkeypatch):
    calls = []
    monkeypatch.setattr(triton_stats, "device_partials", lambda *a, **k: calls.append(1) or [])
    model, x = _tiny(), torch.randn(2, 8)
    assert not triton_stats.takes(x)
    with precision_lab.capture(model, run="cpu", store=Store(":memory:")) as cap:
        cap._engine.deferred_cpu = True  # the device path's bookkeeping, on CPU tensors
        _step(model, x)
    assert len(cap.records) > 5 and all(r.stats.hist is not None for r in cap.records)
    assert calls == []


def test_without_triton_the_kernel_is_not_available(monkeypatch):
    monkeypatch.setattr(triton_stats, "_state", {"failed": None, "installed": None})
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton fails, find_spec says None
    assert not triton_stats.available()


@pytest.mark.slow
def test_the_package_works_without_triton(tmp_path):
    """Triton is optional: with its import blocked, the package imports, measures and captures (CPU), and says
    the kernel is not available; nothing imports triton on the way."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, precision_lab\n"
            "from precision_lab.stats import tensor_stats, triton_stats\n"
            "from precision_lab.store import Store\n"
            "m = torch.nn.Linear(4, 2)\n"
            "with precision_lab.capture(m, run='r', store=Store(':memory:')) as cap:\n"
            "    m(torch.randn(3, 4)).sum().backward()\n"
            "print(triton_stats.available(), len(cap.records) > 3, tensor_stats(torch.arange(4.0)).max)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "3.0"]


@pytest.mark.slow
def test_capture_takes_the_kernel_where_it_applies(interpret, monkeypatch):
    """The engine's hook on the CPU: with the kernel made to take CPU tensors (the interpreter runs it), every
    tensor the capture measures goes to it (none to the torch device path), and the records match float64."""
    calls, torch_path = [], []
    real = triton_stats.device_partials

    def spy(t, **kw):
        calls.append(t.dtype)
        return real(t, **kw)

    monkeypatch.setattr(triton_stats, "takes", lambda t: True)
    monkeypatch.setattr(triton_stats, "device_partials", spy)
    monkeypatch.setattr(precision_lab.stats, "device_partials", lambda *a, **k: torch_path.append(1) or [])
    model, x = _tiny(), torch.randn(3, 8)
    with precision_lab.capture(model, run="hook", store=Store(":memory:"),
                               options=CaptureOptions(keep_tensors=("*",))) as cap:
        cap._engine.deferred_cpu = True
        _step(model, x)
    assert not cap.warnings, cap.warnings
    assert len(calls) > 5 and not torch_path and len(cap.records) > 5
    for r in cap.records:
        assert_matches(r.stats, r.tensor)


def test_a_failing_kernel_leaves_the_torch_path(monkeypatch):
    """A kernel that cannot run (no compiler for the GPU) is given up once, with a warning; the tensor is still
    measured, by the torch device path."""
    monkeypatch.setattr(triton_stats, "_state", {"failed": None})
    monkeypatch.setattr(triton_stats, "takes", lambda t: triton_stats._state["failed"] is None)

    def broken(t, **kw):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(triton_stats, "device_partials", broken)
    warned = []
    eng = StatsEngine(CaptureOptions(), warn=lambda where, msg: warned.append(msg), deferred_cpu=True)
    t = hostile(100, seed=1).to(torch.float32)
    for _ in range(2):
        h = eng.measure(t.clone(), "op")
        eng.resolve()
        assert_matches(h.stats, t)
    assert len(warned) == 1 and "no compiler here" in warned[0]
    assert "no compiler here" in triton_stats._state["failed"]


# ---- CUDA: the compiled kernel, no host sync per op ------------------------------------------------------

@pytest.fixture
def sync_errors():
    """``set_sync_debug_mode("error")`` for the block the test opens, reset afterwards."""
    class _Mode:
        def __enter__(self):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc):
            torch.cuda.set_sync_debug_mode(0)
            return False

    yield _Mode
    torch.cuda.set_sync_debug_mode(0)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cuda_kernel_matches_reference_without_a_sync(dtype, sync_errors):
    t = hostile(300_001, seed=7).to(dtype)
    dev = t.cuda()
    assert triton_stats.takes(dev)
    run_kernel(dev, block=triton_stats.BLOCK)  # compiles, uploads the lookup table
    with sync_errors():
        parts = triton_stats.device_partials(dev, histogram=True)
    s = finish_partials(parts, histogram=True, numel=t.numel(), dtype=str(dtype).replace("torch.", ""),
                        shape=tuple(t.shape))
    assert_matches(s, t)


def _spy_on_kernel(monkeypatch) -> list:
    calls = []
    real = triton_stats.device_partials

    def spy(t, **kw):
        calls.append(t.device.type)
        return real(t, **kw)

    monkeypatch.setattr(triton_stats, "device_partials", spy)
    return calls


@needs_cuda
def test_cuda_capture_uses_the_kernel_without_a_sync_per_op(monkeypatch, sync_errors):
    calls = _spy_on_kernel(monkeypatch)
    model, x = _tiny().cuda(), torch.randn(4, 8, device="cuda")
    with precision_lab.capture(model, run="cuda", store=Store(":memory:"),
                               options=CaptureOptions(keep_tensors=("*",))) as cap:
        _step(model, x)  # warm-up: compilation, the lookup table, lazy initialisation
        cap.step()
        calls.clear()
        with sync_errors():
            _step(model, x)  # a sync inside a hook raises there and is turned into a warning
        cap.step()
    assert not cap.warnings, cap.warnings
    recs = [r for r in cap.records if r.step == 1]
    assert len(recs) > 5 and calls and set(calls) == {"cuda"}
    for r in recs:
        assert_matches(r.stats, r.tensor)


@needs_cuda
def test_cuda_summary_mode_uses_the_kernel_without_a_sync_per_op(monkeypatch, sync_errors):
    calls = _spy_on_kernel(monkeypatch)
    model, x = _tiny().cuda(), torch.randn(4, 8, device="cuda")
    seen = {}
    with precision_lab.capture(model, run="cuda-long", store=Store(":memory:"),
                               options=CaptureOptions(every=10)) as cap:
        _step(model, x)  # step 0: full records, warm-up
        cap.step()
        calls.clear()
        hook = model[2].register_forward_hook(lambda m, a, out: seen.__setitem__("out", out.detach().clone()))
        with sync_errors():
            _step(model, x)  # step 1: a summary step
        hook.remove()
        cap.step()
    assert not cap.warnings, cap.warnings
    assert calls and set(calls) == {"cuda"}
    row = next(r for r in cap.timeline_rows if r.step == 1 and r.op == "2.forward.0" and r.role == "output")
    ref = reference(seen["out"])
    assert (row.numel, row.nan_count, row.absmax, row.min_abs_nonzero) == \
        (ref["numel"], ref["nan_count"], ref["absmax"], ref["min_abs_nonzero"])
    assert row.l2norm == pytest.approx(ref["l2norm"], rel=1e-12)


@needs_cuda
def test_cuda_capture_pair_measures_each_op_without_a_sync(monkeypatch, sync_errors):
    """capture_pair runs two models, compares and writes in one call, so the sync check covers what runs per
    op for statistics: every measurement runs with sync errors on."""
    calls = _spy_on_kernel(monkeypatch)
    real = StatsEngine.measure

    def strict(self, *a, **k):
        with sync_errors():
            return real(self, *a, **k)

    base = _tiny().cuda()
    x = torch.randn(4, 8, device="cuda")
    pair = PairOptions(loss_fn=lambda y: y.float().pow(2).mean(), local_error=False)
    precision_lab.capture_pair(lambda: copy.deepcopy(base), x, torch.float16, store=Store(":memory:"),
                               pair=pair)  # warm-up
    calls.clear()
    monkeypatch.setattr(StatsEngine, "measure", strict)
    store = Store(":memory:")
    session = precision_lab.capture_pair(lambda: copy.deepcopy(base), x, torch.float16, store=store, pair=pair)
    assert session and calls and set(calls) == {"cuda"}


@pytest.mark.slow
def test_the_kernels_compile_for_a_gpu_without_one():
    """What the interpreter cannot check: the kernels lower through Triton's CUDA compiler (to a cubin for
    sm_90, with the bundled ptxas) for a 16-bit, an 8-bit and the float32 input, with and without the histogram."""
    import triton  # the optional dependency, in the test requirements
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    stats_k, finish_k = triton_stats._build()
    width = triton_stats._bin_table().shape[1]
    target = GPUTarget("cuda", 90, 32)
    consts = ("KIND", "EXP", "MAN", "BIAS", "SPECIAL", "SUB_SCALE", "HIST", "BLOCK", "NB", "W", "LOGW", "SUB_ROW")
    for dtype, hist in (("float32", True), ("float16", False), ("float8_e4m3fn", True)):
        view, kind, exp, man, bias, special, sub_scale = triton_stats._DECODE[dtype]
        assert sub_scale == 2.0 ** (1 - bias - man)
        sig = {"x_ptr": {"int32": "*i32", "int16": "*i16", "uint8": "*u8"}[view], "n": "i64", "ints_ptr": "*i64", "flts_ptr": "*fp64", "hist_ptr": "*i64",
               "table_ptr": "*i32", **{k: "constexpr" for k in consts}}
        values = dict(zip(consts, (kind, exp, man, bias, special, sub_scale, hist, triton_stats.BLOCK,
                                   triton_stats._NB, width, width.bit_length() - 1, triton_stats._SUB_ROW)))
        src = ASTSource(fn=stats_k, signature=sig,
                        constexprs={(stats_k.arg_names.index(k),): v for k, v in values.items()})
        compiled = triton.compile(src, target=target, options={"num_warps": triton_stats._NUM_WARPS,
                                                                "enable_fp_fusion": False})
        assert compiled.asm["cubin"] and ("atom.global" in compiled.asm["ptx"]) == hist
    src = ASTSource(fn=finish_k, signature={"ints_ptr": "*i64", "flts_ptr": "*fp64", "nprog": "i32",
                                            "out_ptr": "*fp64", "P": "constexpr"},
                    constexprs={(finish_k.arg_names.index("P"),): triton_stats.MAX_PROGRAMS})
    assert triton.compile(src, target=target, options={"enable_fp_fusion": False}).asm["cubin"]
