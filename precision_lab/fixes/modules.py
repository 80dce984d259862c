"""Policy-aware building blocks for recipes, and the kernels they compute with.

Each module computes in its own compute format, which is the dtype of a
marker buffer: ``module.half()`` / ``.float()`` / ``.to(dtype)`` move it like
any parameter, so a float copy of a module recomputes in fp32 and
``PrecisionPolicy.prepare`` can give every module its own format.  Inputs are
cast to the module's format on entry (inside ``forward``, so hooks see what
the previous module produced) and outputs stay in it.

Without a policy every option is off: the module computes exactly what its
plain fp32 definition says (one-pass variance, softmax without max
subtraction, no quantisation), which is what the fp32 reference run does.

The kernels (``layer_norm``, ``rms_norm``, ``softmax``, ``fake_quant`` ...)
are plain functions of tensors; the modules call them and op replay calls the
same ones, so a replayed op and a captured one compute the same thing.

Flush-to-zero emulation: with ``ftz`` set, every operand and intermediate
result whose magnitude is below the compute format's smallest normal becomes
0 (FTZ + DAZ), the regime of GPUs and compilers that disable subnormals.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import FORMATS, format_for_dtype

__all__ = [
    "PolicyModule", "Linear", "QuantLinear", "FakeQuant", "Amax", "QuantScale", "Reciprocal",
    "RMSNorm", "LayerNorm", "L2Normalize", "Softmax", "SiLU", "GELU", "ReLU", "Add", "Mul", "MatMul",
    "SwiGLU", "Attention",
    "flush_subnormals", "sanitize_nonfinite", "rms_norm", "layer_norm", "l2_normalize", "softmax",
    "amax_dynamic", "histogram_amax", "scale_from_amax", "quant_dequant", "fake_quant",
]


# ---- elementwise helpers -----------------------------------------------------

def flush_subnormals(x: torch.Tensor) -> torch.Tensor:
    """Values whose magnitude is below the format's smallest normal become 0 (NaN/Inf kept)."""
    if not x.is_floating_point():
        return x
    fmt = format_for_dtype(x.dtype)
    if fmt is None or not fmt.has_subnormals:
        return x
    return torch.where(x.abs() < fmt.smallest_normal, torch.zeros_like(x), x)


def _f(x: torch.Tensor, ftz: bool) -> torch.Tensor:
    return flush_subnormals(x) if ftz else x


def sanitize_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """NaN -> 0 and +/-inf -> +/-max of the tensor's format."""
    if not x.is_floating_point():
        return x
    fmt = format_for_dtype(x.dtype) or FORMATS["fp32"]
    return torch.nan_to_num(x, nan=0.0, posinf=fmt.max, neginf=-fmt.max)


def _scalar(value: float, dtype, ftz: bool) -> torch.Tensor:
    """A constant as the kernel's arithmetic sees it: rounded to ``dtype`` (and flushed under FTZ)."""
    return _f(torch.tensor(value, dtype=dtype), ftz)


# ---- normalisation and softmax kernels ----------------------------------------

def rms_norm(x, weight=None, eps: float = 1e-6, *, stats_dtype=None, ftz: bool = False):
    """``x / sqrt(mean(x^2) + eps) * weight``; statistics in ``stats_dtype`` (default: x's)."""
    dt = x.dtype
    sd = stats_dtype or dt
    xs = _f(x.to(sd), ftz)
    ms = _f(_f(xs * xs, ftz).mean(-1, keepdim=True), ftz)
    inv = _f(torch.rsqrt(_f(ms + _scalar(eps, sd, ftz), ftz)), ftz)
    y = _f(_f(xs * inv, ftz).to(dt), ftz)
    if weight is not None:
        y = _f(y * weight.to(dt), ftz)
    return y


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5, *, stats_dtype=None,
               two_pass: bool = False, ftz: bool = False):
    """LayerNorm with the variance computed one-pass (E[x^2] - E[x]^2) or two-pass (E[(x - mean)^2])."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    dims = tuple(range(-len(normalized_shape), 0))
    dt = x.dtype
    sd = stats_dtype or dt
    xs = _f(x.to(sd), ftz)
    mean = _f(xs.mean(dims, keepdim=True), ftz)
    d = _f(xs - mean, ftz)
    if two_pass:
        var = _f(_f(d * d, ftz).mean(dims, keepdim=True), ftz)
    else:
        ex2 = _f(_f(xs * xs, ftz).mean(dims, keepdim=True), ftz)
        var = _f(ex2 - _f(mean * mean, ftz), ftz)
    inv = _f(torch.rsqrt(_f(var + _scalar(eps, sd, ftz), ftz)), ftz)
    y = _f(_f(d * inv, ftz).to(dt), ftz)
    if weight is not None:
        y = _f(y * weight.to(dt), ftz)
    if bias is not None:
        y = _f(y + bias.to(dt), ftz)
    return y


def l2_normalize(x, eps: float = 0.0, *, stats_dtype=None, ftz: bool = False):
    """``x / max(||x||, eps)`` along the last dim; with eps 0 an all-zero row is 0/0 = NaN."""
    dt = x.dtype
    sd = stats_dtype or dt
    xs = _f(x.to(sd), ftz)
    n = _f(torch.linalg.vector_norm(xs, dim=-1, keepdim=True), ftz)
    if eps > 0:
        n = torch.clamp(n, min=_scalar(eps, sd, ftz))
    return _f(_f(xs / n, ftz).to(dt), ftz)


def softmax(x, dim: int = -1, *, stable: bool = False, ftz: bool = False):
    """``exp(x) / sum(exp(x))`` in x's format; ``stable`` subtracts the row max first."""
    if stable:
        x = _f(x - x.amax(dim, keepdim=True), ftz)
    e = _f(torch.exp(x), ftz)
    s = _f(e.sum(dim, keepdim=True), ftz)
    return _f(e / s, ftz)


# ---- fake quantisation kernels -------------------------------------------------

def amax_dynamic(x, *, granularity: str = "tensor", floor: float = 0.0, dtype=None):
    """max |x| per tensor (0-d) or per row (last dim kept), in ``dtype``, clamped below at ``floor``.

    The floor is applied in ``dtype``: a floor the format cannot hold rounds
    first (``clamp(min=1e-12)`` on an fp16 tensor clamps at 0).
    """
    a = x.to(dtype or x.dtype).abs()
    a = a.amax() if granularity == "tensor" else a.amax(dim=-1, keepdim=True)
    if floor > 0:
        a = torch.clamp(a, min=floor)
    return a


def histogram_amax(x, *, bins: int = 2048, percentile: float = 100.0, finite_only: bool = False):
    """Static calibration: amax at ``percentile`` of a ``torch.histc`` histogram of |x|.

    Returns ``(amax as a 0-d float32 tensor, error message or None)``.  With
    non-finite values and ``finite_only`` off, ``torch.histc`` refuses the
    range (``range of [nan, nan] is not finite``); the error is returned and
    amax is NaN so the caller can record it and carry on.
    """
    v = x.detach().to(torch.float32).abs().reshape(-1)
    if finite_only:
        v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return torch.tensor(float("nan")), "no finite values to calibrate on"
    hi = v.max()
    try:
        hist = torch.histc(v, bins=bins, min=0.0, max=float(hi))
    except RuntimeError as e:
        return torch.tensor(float("nan")), str(e)
    if percentile >= 100.0:
        return hi.reshape(()), None
    cdf = torch.cumsum(hist, 0) / v.numel()
    idx = int(torch.searchsorted(cdf, torch.tensor(percentile / 100.0)))
    edge = float(hi) * (min(idx, bins - 1) + 1) / bins
    return torch.tensor(edge, dtype=torch.float32), None


def scale_from_amax(amax, fmt_name: str):
    """Dequantisation scale ``amax / fmt.max``, in amax's format."""
    return amax / FORMATS[fmt_name].max


def quant_dequant(x, scale, inv_scale, fmt_name: str):
    """Round ``x * inv_scale`` to the narrow format and back, times ``scale``; in the scale's format."""
    sd = scale.dtype
    q = (x.to(sd) * inv_scale).to(FORMATS[fmt_name].torch_dtype()).to(sd)
    return (q * scale).to(x.dtype)


def fake_quant(x, cfg, *, amax=None):
    """The whole quantise-dequantise of one tensor under a ``QuantConfig`` (for replay).

    ``amax`` replaces the computed one (e.g. a calibrated value).
    """
    sd = FORMATS[cfg.scale_format].torch_dtype()
    if amax is None:
        if cfg.calibration == "histogram":
            amax, _ = histogram_amax(x, bins=cfg.histogram_bins, percentile=cfg.percentile,
                                     finite_only=cfg.finite_only)
            amax = amax.to(sd)
            if cfg.amax_floor > 0:
                amax = torch.clamp(amax, min=cfg.amax_floor)
        else:
            amax = amax_dynamic(x, granularity=cfg.granularity, floor=cfg.amax_floor, dtype=sd)
    scale = scale_from_amax(amax.to(sd), cfg.format)
    return quant_dequant(x, scale, torch.reciprocal(scale), cfg.format)


# ---- modules -------------------------------------------------------------------

class PolicyModule(nn.Module):
    """A module whose compute format is the dtype of its marker buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("_format_marker", torch.empty(0), persistent=False)
        self.flush_to_zero = False
        self.sanitize_output = False

    @property
    def compute_dtype(self):
        return self._format_marker.dtype

    def set_compute_dtype(self, dtype) -> None:
        self._format_marker = self._format_marker.to(dtype)

    def configure(self, policy, name: str) -> None:
        """Read this module's options from a ``PrecisionPolicy`` (``name`` is its path)."""
        self.flush_to_zero = policy.flush_to_zero
        self.sanitize_output = policy.sanitizes(name) if name else False

    def cast_in(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return _f(x.to(self.compute_dtype), self.flush_to_zero)
        return x

    def finish(self, y):
        y = _f(y, self.flush_to_zero)
        return sanitize_nonfinite(y) if self.sanitize_output else y


def _normal(shape, gen, std):
    return torch.randn(*shape, generator=gen) * std


class Linear(PolicyModule):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 generator: Optional[torch.Generator] = None, std: Optional[float] = None):
        super().__init__()
        std = std if std is not None else 1.0 / math.sqrt(in_features)
        self.weight = nn.Parameter(_normal((out_features, in_features), generator, std))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x):
        x = self.cast_in(x)
        return self.finish(F.linear(x, self.weight, self.bias))


class Amax(PolicyModule):
    """amax of a tensor (dynamic) or from a calibration histogram; computes in the scale format."""

    def __init__(self):
        super().__init__()
        self.cfg = None
        self.calibration_error: Optional[str] = None

    def configure(self, policy, name: str) -> None:
        super().configure(policy, name)
        _scale_format(self, policy, name)
        self.cfg = policy.quant

    def forward(self, x):
        cfg = self.cfg
        sd = self.compute_dtype
        if cfg is not None and cfg.calibration == "histogram":
            amax, err = histogram_amax(x, bins=cfg.histogram_bins, percentile=cfg.percentile,
                                       finite_only=cfg.finite_only)
            self.calibration_error = err
            a = amax.to(sd)
            if cfg.amax_floor > 0:
                a = torch.clamp(a, min=cfg.amax_floor)
            return self.finish(a)
        gran = cfg.granularity if cfg is not None else "tensor"
        floor = cfg.amax_floor if cfg is not None else 0.0
        return self.finish(amax_dynamic(x, granularity=gran, floor=floor, dtype=sd))


class QuantScale(PolicyModule):
    """``scale = amax / fmt.max`` in the scale format."""

    def __init__(self):
        super().__init__()
        self.fmt_name = "fp8_e4m3fn"

    def configure(self, policy, name: str) -> None:
        super().configure(policy, name)
        _scale_format(self, policy, name)
        if policy.quant is not None:
            self.fmt_name = policy.quant.format

    def forward(self, amax):
        return self.finish(scale_from_amax(self.cast_in(amax), self.fmt_name))


class Reciprocal(PolicyModule):
    """``inv_scale = 1 / scale`` in the scale format (overflows where the scale is tiny)."""

    def configure(self, policy, name: str) -> None:
        super().configure(policy, name)
        _scale_format(self, policy, name)

    def forward(self, scale):
        return self.finish(torch.reciprocal(self.cast_in(scale)))


def _scale_format(mod: PolicyModule, policy, name: str) -> None:
    """Scale-path modules compute in the quant scale format unless an override names them."""
    fmt = policy.override_for(name) or (policy.quant.scale_format if policy.quant is not None else policy.dtype)
    mod.set_compute_dtype(FORMATS[fmt].torch_dtype())


class FakeQuant(PolicyModule):
    """Quantise-dequantise through a narrow format; identity when no quant config is set."""

    def __init__(self, role: str = "input"):
        super().__init__()
        self.role = role  # "input" (activation) or "weight"
        self.cfg = None
        self.amax = Amax()
        self.scale = QuantScale()
        self.inv_scale = Reciprocal()

    def configure(self, policy, name: str) -> None:
        super().configure(policy, name)
        cfg = policy.quant
        if cfg is not None and self.role == "weight" and not cfg.weights:
            cfg = None
        self.cfg = cfg

    @property
    def enabled(self) -> bool:
        return self.cfg is not None

    def forward(self, x):
        if self.cfg is None:
            return x
        amax = self.amax(x)  # per row of a weight = per output channel
        scale = self.scale(amax)
        inv = self.inv_scale(scale)
        return self.finish(quant_dequant(x, scale, inv, self.cfg.format))


class QuantLinear(Linear):
    """Linear whose input (and weight) go through fp8 fake quantisation when a policy sets it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kw):
        super().__init__(in_features, out_features, bias, **kw)
        self.act_quant = FakeQuant("input")
        self.weight_quant = FakeQuant("weight")

    def forward(self, x):
        x = self.cast_in(x)
        xq = self.act_quant(x)
        w = self.weight_quant(self.weight) if self.weight_quant.enabled else self.weight
        return self.finish(F.linear(xq, w, self.bias))


class _NormBase(PolicyModule):
    def __init__(self, dim: int, eps: float, affine: bool = True):
        super().__init__()
        self.dim = dim
        self.default_eps = eps
        self.eps = eps
        self.stats_fp32 = False
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def configure(self, policy, name: str) -> None:
        super().configure(policy, name)
        self.eps = policy.eps_for(self.default_eps)
        self.stats_fp32 = policy.stats_fp32

    @property
    def stats_dtype(self):
        return torch.float32 if self.stats_fp32 else self.compute_dtype


class RMSNorm(_NormBase):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)

    def forward(self, x):
        x = self.cast_in(x)
        return self.finish(rms_norm(x, self.weight, self.eps, stats_dtype=self.stats_dtype, ftz=self.flush_to_zero))


class LayerNorm(_NormBase):
    def __init__(self, dim: int, eps: float = 1e-5, two_pass: bool = False):
        super().__init__(dim, eps)
        self.bias = nn.Parameter(torch.zeros(dim))
        self.default_two_pass = two_pass
        self.two_pass = two_pass

    def configure(self, policy, name: str) -> None:
        super().configure(policy, name)
        self.two_pass = self.default_two_pass or policy.two_pass_variance

    def forward(self, x):
        x = self.cast_in(x)
        return self.finish(layer_norm(x, (self.dim,), self.weight, self.bias, self.eps, stats_dtype=self.stats_dtype,
                                      two_pass=self.two_pass, ftz=self.flush_to_zero))


class L2Normalize(_NormBase):
    """``x / ||x||`` per row (no eps by default: an all-zero row gives 0/0 = NaN)."""

    def __init__(self, dim: int, eps: float = 0.0):
        super().__init__(dim, eps, affine=False)

    def forward(self, x):
        x = self.cast_in(x)
        return self.finish(l2_normalize(x, self.eps, stats_dtype=self.stats_dtype, ftz=self.flush_to_zero))


class Softmax(PolicyModule):
    def __init__(self, dim: int = -1, stable: bool = False):
        super().__init__()
        self.dim = dim
        self.default_stable = stable
        self.stable = stable

    def configure(self, policy, name: str) -> None:
        super().configure(policy, name)
        self.stable = self.default_stable or policy.stable_softmax

    def forward(self, x):
        x = self.cast_in(x)
        return self.finish(softmax(x, self.dim, stable=self.stable, ftz=self.flush_to_zero))


class _Pointwise(PolicyModule):
    fn = staticmethod(lambda x: x)

    def forward(self, x):
        return self.finish(type(self).fn(self.cast_in(x)))


class SiLU(_Pointwise):
    fn = staticmethod(F.silu)


class GELU(_Pointwise):
    fn = staticmethod(F.gelu)


class ReLU(_Pointwise):
    fn = staticmethod(F.relu)


class Add(PolicyModule):
    def forward(self, a, b):
        return self.finish(self.cast_in(a) + self.cast_in(b))


class Mul(PolicyModule):
    def forward(self, a, b):
        return self.finish(self.cast_in(a) * self.cast_in(b))


class MatMul(PolicyModule):
    """``a @ b * scale`` (``b`` transposed on its last two dims when ``transpose_b``)."""

    def __init__(self, scale: float = 1.0, transpose_b: bool = False):
        super().__init__()
        self.scale = scale
        self.transpose_b = transpose_b

    def forward(self, a, b):
        a, b = self.cast_in(a), self.cast_in(b)
        if self.transpose_b:
            b = b.transpose(-2, -1)
        y = a @ b
        if self.scale != 1.0:
            y = y * self.scale
        return self.finish(y)


class SwiGLU(nn.Module):
    """Qwen2/LLaMA MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, dim: int, hidden: int, *, generator=None):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False, generator=generator)
        self.up_proj = Linear(dim, hidden, bias=False, generator=generator)
        self.act = SiLU()
        self.mul = Mul()
        self.down_proj = Linear(hidden, dim, bias=False, generator=generator)

    def forward(self, x):
        return self.down_proj(self.mul(self.act(self.gate_proj(x)), self.up_proj(x)))


class Attention(nn.Module):
    """Single-head-group attention: ``softmax(q k^T / sqrt(d)) v`` with an explicit softmax module."""

    def __init__(self, dim: int, heads: int, *, generator=None):
        super().__init__()
        if dim % heads:
            raise ValueError(f"attention width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.q_proj = Linear(dim, dim, generator=generator)
        self.k_proj = Linear(dim, dim, generator=generator)
        self.v_proj = Linear(dim, dim, generator=generator)
        self.scores = MatMul(scale=1.0 / math.sqrt(dim // heads), transpose_b=True)
        self.softmax = Softmax(-1)
        self.context = MatMul()
        self.o_proj = Linear(dim, dim, generator=generator)

    def _split(self, t):
        b, s, d = t.shape
        return t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x):
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
        p = self.softmax(self.scores(q, k))
        c = self.context(p, v)
        b, h, s, dh = c.shape
        return self.o_proj(c.transpose(1, 2).reshape(b, s, h * dh))
