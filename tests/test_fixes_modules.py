"""Kernels and policy-aware modules, checked against float64 numpy and real ml_dtypes casts."""

import ml_dtypes
import numpy as np
import pytest
import torch

from precision_lab.fixes import modules as M
from precision_lab.fixes.policy import PrecisionPolicy, QuantConfig

F16 = np.finfo(np.float16)
E4M3 = ml_dtypes.finfo(ml_dtypes.float8_e4m3fn)
E5M2 = ml_dtypes.finfo(ml_dtypes.float8_e5m2)


def test_flush_subnormals_matches_numpy_threshold():
    vals = np.array([0.0, 1e-8, 6e-8, 1e-5, 6.09e-5, float(F16.tiny), 1.0, np.inf, -1e-5, np.nan], np.float16)
    out = M.flush_subnormals(torch.from_numpy(vals)).numpy()
    expect = np.where(np.abs(vals) < F16.tiny, np.float16(0), vals)
    np.testing.assert_array_equal(out, expect)
    # fp32 tensors keep fp16-subnormal magnitudes: the threshold is the tensor's own format
    assert M.flush_subnormals(torch.tensor([1e-5])).item() == pytest.approx(1e-5)


def _np_layer_norm(x, eps):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps)


@pytest.mark.parametrize("two_pass", [False, True])
def test_layer_norm_fp32_matches_float64(two_pass):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 33, generator=g) * 3 + 1
    y = M.layer_norm(x, 33, eps=1e-5, two_pass=two_pass).numpy()
    np.testing.assert_allclose(y, _np_layer_norm(x.numpy(), 1e-5), rtol=1e-4, atol=1e-4)


def test_one_pass_fp16_overflows_where_numpy_fp16_does():
    x = torch.full((1, 8), 300.0, dtype=torch.float16)
    # independent: 300^2 in numpy fp16 is inf, so E[x^2] - E[x]^2 = inf - inf
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(300) * np.float16(300))
    assert torch.isnan(M.layer_norm(x, 8)).all()
    assert torch.isfinite(M.layer_norm(x, 8, two_pass=True)).all()
    assert torch.isfinite(M.layer_norm(x, 8, stats_dtype=torch.float32)).all()


def test_ftz_flushes_small_eps_only_when_subnormal():
    x = torch.full((1, 8), 10.0, dtype=torch.float16)  # zero variance
    assert np.float16(1e-5) != 0 and abs(np.float16(1e-5)) < F16.tiny  # subnormal, not zero
    assert torch.isfinite(M.layer_norm(x, 8, eps=1e-5)).all()  # CPU keeps the subnormal eps
    assert torch.isnan(M.layer_norm(x, 8, eps=1e-5, ftz=True)).all()  # 0 * rsqrt(0) = 0 * inf
    assert torch.isfinite(M.layer_norm(x, 8, eps=1e-3, ftz=True)).all()  # 1e-3 is normal in fp16


def test_rms_norm_matches_float64():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    w = torch.rand(16, generator=torch.Generator().manual_seed(2))
    xn = x.numpy().astype(np.float64)
    expect = xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-6) * w.numpy()
    np.testing.assert_allclose(M.rms_norm(x, w, 1e-6).numpy(), expect, rtol=1e-5, atol=1e-6)


def test_softmax_stable_matches_float64_and_unstable_fp16_overflows():
    x = torch.tensor([[1.0, 12.0, 3.0]])
    e = np.exp(x.numpy().astype(np.float64))
    np.testing.assert_allclose(M.softmax(x).numpy(), e / e.sum(-1, keepdims=True), rtol=1e-6)
    h = x.half()
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(np.float16(12)))  # exp(12) = 162755 > 65504
    y = M.softmax(h)
    assert torch.isnan(y[0, 1])  # inf / inf
    ys = M.softmax(h, stable=True)
    np.testing.assert_allclose(ys.float().numpy(), e / e.sum(-1, keepdims=True), rtol=2e-3)


def test_l2_normalize_zero_row_is_nan_without_eps():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    y = M.l2_normalize(x)
    np.testing.assert_allclose(y[0].numpy(), [0.6, 0.8], rtol=1e-6)
    assert torch.isnan(y[1]).all()
    assert (M.l2_normalize(x, eps=1e-6)[1] == 0).all()


def test_fake_quant_per_tensor_matches_ml_dtypes_cast():
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(3))
    cfg = QuantConfig("fp8_e4m3fn", "tensor", "fp32")
    got = M.fake_quant(x, cfg).numpy()
    xn = x.numpy()
    amax = np.float32(np.abs(xn).max())
    scale = np.float32(amax / np.float32(E4M3.max))
    inv = np.float32(1) / scale
    q = (xn * inv).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, q * scale)


def test_fake_quant_per_row_matches_ml_dtypes_cast():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    x[2] *= 100
    got = M.fake_quant(x, QuantConfig("fp8_e5m2", "row", "fp32")).numpy()
    xn = x.numpy()
    scale = (np.abs(xn).max(-1, keepdims=True) / np.float32(E5M2.max)).astype(np.float32)
    q = (xn * (np.float32(1) / scale)).astype(ml_dtypes.float8_e5m2).astype(np.float32)
    np.testing.assert_array_equal(got, q * scale)


def test_fp16_scale_underflows_and_its_reciprocal_overflows():
    x = torch.tensor([0.0975, 0.0, -0.05], dtype=torch.float16)
    amax = M.amax_dynamic(x, dtype=torch.float16)
    scale = M.scale_from_amax(amax, "fp8_e5m2")
    expect = np.float16(np.float16(0.0975) / np.float32(E5M2.max))
    assert scale.item() == float(expect)
    assert 0 < float(expect) < F16.tiny  # subnormal in fp16
    assert torch.isinf(torch.reciprocal(scale))
    y = M.fake_quant(x, QuantConfig("fp8_e5m2", "tensor", "fp16"))
    assert torch.isnan(y[1])  # 0 x inf
    assert torch.isfinite(M.fake_quant(x, QuantConfig("fp8_e5m2", "tensor", "fp32"))).all()


def test_amax_floor_is_applied_in_the_scale_format():
    z = torch.zeros(4, dtype=torch.float16)
    assert np.float16(1e-12) == 0
    assert M.amax_dynamic(z, floor=1e-12, dtype=torch.float16).item() == 0.0  # clamp at fp16(1e-12) = 0
    assert M.amax_dynamic(z, floor=1e-12, dtype=torch.float32).item() == pytest.approx(1e-12)


def test_histogram_amax_nan_error_and_finite_only():
    x = torch.tensor([1.0, -3.0, float("nan"), 2.0])
    amax, err = M.histogram_amax(x)
    assert torch.isnan(amax) and "not finite" in err
    amax, err = M.histogram_amax(x, finite_only=True)
    assert err is None and amax.item() == 3.0
    # percentile: the upper edge of the bin holding the 50th percentile of |x|
    v = torch.arange(1, 101, dtype=torch.float32)
    amax, _ = M.histogram_amax(v, bins=100, percentile=50.0)
    assert amax.item() == pytest.approx(np.percentile(np.arange(1, 101), 50), abs=1.0)


def test_compute_dtype_follows_module_casts():
    lin = M.Linear(3, 2)
    assert lin.compute_dtype == torch.float32
    lin.half()
    assert lin.compute_dtype == torch.float16
    out = lin(torch.randn(1, 3))  # fp32 input cast on entry
    assert out.dtype == torch.float16


def test_quant_linear_scale_modules_run_in_scale_format():
    q = M.QuantLinear(4, 4)
    PrecisionPolicy("p", "fp16", quant=QuantConfig("fp8_e4m3fn", "row", "fp32")).prepare(q)
    assert q.compute_dtype == torch.float16
    assert q.act_quant.inv_scale.compute_dtype == torch.float32
    assert q.act_quant.enabled and q.weight_quant.enabled
    plain = M.QuantLinear(4, 4)
    x = torch.randn(2, 4)
    assert torch.equal(plain(x), torch.nn.functional.linear(x, plain.weight, plain.bias))  # no policy: no quant


def test_swiglu_and_attention_shapes():
    torch.manual_seed(0)
    m = M.SwiGLU(8, 16)
    assert m(torch.randn(2, 3, 8)).shape == (2, 3, 8)
    a = M.Attention(8, 2)
    x = torch.randn(2, 5, 8)
    out = a(x)
    assert out.shape == (2, 5, 8)
    # against torch's own attention on the same projections
    q, k, v = a._split(a.q_proj(x)), a._split(a.k_proj(x)), a._split(a.v_proj(x))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ref = a.o_proj(ref.transpose(1, 2).reshape(2, 5, 8))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
