"""Number formats as data.

Every numeric limit Precision Lab uses (fp16's 65504, e4m3fn's 448, ...) is
*derived* here from a format's bit layout, in one place, and checked in tests
against ``ml_dtypes.finfo`` / ``torch.finfo`` and against real casts.

Nothing in this module imports torch; ``torch_dtype`` resolves lazily.

Rounding model: every float format is round-to-nearest-even (RNE), the
behaviour of IEEE casts, ``ml_dtypes`` and torch.  ``int8`` is the symmetric
quantisation grid ``[-127, 127]`` with unit scale (``torch.round`` then
clamp), the form used for int8 weight/activation quantisation; its magnitude
thresholds therefore apply to both signs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import numpy as np

__all__ = ["Format", "FORMATS", "format_for_dtype", "get_format", "FORMAT_NAMES", "canonical_dtype", "numpy_dtype_named"]


@dataclass(frozen=True)
class Format:
    """One number format.

    ``kind``: ``"float"`` (sign/exponent/mantissa), ``"e8m0"`` (unsigned
    exponent-only scale format, no zero) or ``"int"`` (integer grid).
    ``special``: how non-finite values are encoded:
      ``"ieee"``  all-ones exponent is inf/NaN (fp32, fp16, bf16, e5m2),
      ``"fn"``    finite only, the all-ones code is NaN (e4m3fn),
      ``"fnuz"``  finite only, NaN is the negative-zero code (e4m3fnuz, e5m2fnuz),
      ``"none"``  every code is finite (fp6, fp4, int8),
      ``"nan_top"`` (e8m0) only the all-ones code is NaN.
    ``saturating``: whether the common cast (``tensor.to(dtype)`` in torch,
    else ``ml_dtypes``) clamps an overflowing value to +/-max instead of
    producing inf/NaN.  For e4m3fn torch saturates while ml_dtypes gives NaN;
    we record torch's behaviour because that is what a model run sees.
    """

    name: str
    bits: int
    exp_bits: int
    man_bits: int
    bias: int
    special: str
    saturating: bool
    kind: str = "float"
    ml_dtypes_name: Optional[str] = None
    torch_name: Optional[str] = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("float", "int", "e8m0"):
            raise ValueError(f"format {self.name}: unknown kind {self.kind!r}")
        if self.special not in ("ieee", "fn", "fnuz", "none", "nan_top"):
            raise ValueError(f"format {self.name}: unknown special encoding {self.special!r}")
        sign = 0 if self.kind == "e8m0" else 1
        if self.kind != "int" and sign + self.exp_bits + self.man_bits != self.bits:
            raise ValueError(f"format {self.name}: 1+{self.exp_bits}+{self.man_bits} != {self.bits} bits")

    # ---- derived limits (the only place they are computed) -----------------
    @cached_property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite binade."""
        if self.kind == "int":
            return self.bits - 2  # 127 = (2 - 2^-6) * 2^6
        top_field = 2**self.exp_bits - 1
        if self.special == "ieee":
            top_field -= 1  # all-ones exponent is inf/NaN
        return top_field - self.bias

    @cached_property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal binade."""
        if self.kind == "int":
            return 0
        if self.kind == "e8m0":
            return -self.bias
        return 1 - self.bias

    @cached_property
    def max(self) -> float:
        """Largest finite value."""
        if self.kind == "int":
            return float(2 ** (self.bits - 1) - 1)
        if self.kind == "e8m0":
            # code 0xFF is NaN, 0xFE is the largest finite value
            return math.ldexp(1.0, 2**self.exp_bits - 2 - self.bias)
        mant_max = 2.0 - 2.0 ** (-self.man_bits)
        if self.special == "fn":
            # the all-ones code (exp all ones, mantissa all ones) is NaN
            mant_max = 2.0 - 2.0 ** (1 - self.man_bits)
        return math.ldexp(mant_max, self.emax)

    @cached_property
    def smallest_normal(self) -> float:
        if self.kind == "int":
            return 1.0
        return math.ldexp(1.0, self.emin)

    @cached_property
    def smallest_subnormal(self) -> Optional[float]:
        """Smallest positive subnormal, or None where the format has none."""
        if self.kind in ("int", "e8m0") or self.man_bits == 0:
            return None
        return math.ldexp(1.0, self.emin - self.man_bits)

    @cached_property
    def smallest_positive(self) -> float:
        return self.smallest_subnormal if self.smallest_subnormal is not None else self.smallest_normal

    @cached_property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value: 2^-man_bits.

        torch.finfo(float8_e5m2fnuz).eps reports 0.125, but e5m2fnuz has two
        mantissa bits, so the value after 1.0 is 1.25 and eps is 0.25 (as
        ml_dtypes says); torch derives it from the shifted bias.  We follow
        the bit layout.
        """
        if self.kind == "int":
            return 1.0
        return math.ldexp(1.0, -self.man_bits)

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.special != "none"

    @property
    def has_subnormals(self) -> bool:
        return self.smallest_subnormal is not None

    @cached_property
    def integer_limit(self) -> int:
        """The largest N such that every integer 0..N is exactly representable: 2^(man_bits + 1) for a float
        format (fp16 2048, bf16 256); above it only every 2nd (then 4th, ...) integer exists, so adding 1 is
        lost.  The largest value for the integer grid and e8m0."""
        if self.kind == "int":
            return int(self.max)
        if self.kind == "e8m0":
            return 2
        return 2 ** (self.man_bits + 1)

    def spacing_at(self, x: float) -> float:
        """Distance between neighbouring values of this format around magnitude ``x`` (its ulp there)."""
        a = abs(float(x))
        if self.kind == "int" or not math.isfinite(a):
            return 1.0
        e = max(math.floor(math.log2(a)) if a > 0 else self.emin, self.emin)
        return math.ldexp(1.0, e - self.man_bits)

    def cannot_hold(self, *, absmax: Optional[float] = None, smallest: Optional[float] = None,
                    integers_to: Optional[float] = None) -> Optional[str]:
        """Why values of these magnitudes are lost in this format, or None where it holds them: ``absmax`` at
        or beyond its overflow threshold, ``smallest`` (nonzero) rounding to 0, integers counted up to
        ``integers_to`` past ``integer_limit``."""
        if absmax is not None and math.isfinite(absmax) and absmax >= self.overflow_threshold:
            return (f"{absmax:.4g} is beyond {self.name}'s range (max {self.max:.4g}): "
                    f"{'it saturates' if self.saturating else 'it becomes inf'} there too")
        if smallest is not None and 0 < smallest < self.underflow_threshold:
            return (f"{smallest:.2g} is below half {self.name}'s smallest value {self.smallest_positive:.2g}: "
                    "it rounds to 0 there too")
        if integers_to is not None and math.isfinite(integers_to) and abs(integers_to) > self.integer_limit:
            return (f"integers above {self.integer_limit} are not representable in {self.name} "
                    f"(counting to {abs(integers_to):.0f} loses increments there too)")
        return None

    # ---- rounding thresholds on |x| (float64, exact) ----------------------
    # Bins are half-open [lo, hi): each threshold is the *smallest* float64
    # magnitude that lands in the next class, so a tie that rounds down moves
    # the edge one float64 ulp up.

    @cached_property
    def overflow_threshold(self) -> float:
        """Smallest |x| whose round-to-nearest-even result exceeds ``max``."""
        if self.kind == "int":
            half = 0.5
            tie_rounds_up = int(self.max) % 2 == 1  # 127.5 -> 128 (even)
        elif self.kind == "e8m0":
            # exponent-only: the next value after max would be 2*max; ml_dtypes
            # rounds the halfway point up (it rounds like a mantissa carry).
            half = self.max / 2
            tie_rounds_up = True
        else:
            ulp_top = math.ldexp(1.0, self.emax - self.man_bits)
            half = ulp_top / 2
            # max's last mantissa bit: odd for ieee/none/fnuz layouts (all
            # ones), even for fn (1.10 for e4m3fn), so a tie at max+ulp/2
            # rounds up (overflow) or down (to max) accordingly.
            tie_rounds_up = self.special != "fn"
        mid = self.max + half
        return mid if tie_rounds_up else float(np.nextafter(mid, np.inf))

    @cached_property
    def underflow_threshold(self) -> float:
        """Smallest nonzero |x| that does *not* round to zero (0 if none does)."""
        if self.kind == "e8m0":
            return 0.0  # no zero code: tiny values clamp to the smallest value
        step = self.smallest_positive
        # the tie step/2 rounds to zero (even), so the edge is just above it
        return float(np.nextafter(step / 2, np.inf))

    @cached_property
    def normal_threshold(self) -> float:
        """Smallest |x| that rounds to a normal value (above all subnormals)."""
        if not self.has_subnormals:
            return self.underflow_threshold if self.kind != "e8m0" else 0.0
        # halfway between the largest subnormal (odd, all-ones mantissa) and
        # smallest_normal (even): the tie rounds up to the normal value.
        return self.smallest_normal - self.smallest_subnormal / 2

    def thresholds(self) -> tuple[float, ...]:
        """Every magnitude at which this format's behaviour changes."""
        vals = {self.max, self.smallest_normal, self.overflow_threshold, self.normal_threshold}
        if self.smallest_subnormal is not None:
            vals.add(self.smallest_subnormal)
        if self.underflow_threshold > 0:
            vals.add(self.underflow_threshold)
        return tuple(sorted(v for v in vals if v > 0))

    # ---- backends -----------------------------------------------------------
    def numpy_dtype(self):
        """The ml_dtypes/numpy dtype for real casts, or None."""
        if self.ml_dtypes_name is None:
            return None
        if self.ml_dtypes_name in ("float32", "float16", "int8"):
            return np.dtype(self.ml_dtypes_name)
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, self.ml_dtypes_name))

    def torch_dtype(self):
        if self.torch_name is None:
            return None
        import torch

        return getattr(torch, self.torch_name, None)


# The table.  One line per format; everything else is derived.
_TABLE = [
    Format("fp32", 32, 8, 23, 127, "ieee", False, ml_dtypes_name="float32", torch_name="float32",
           description="IEEE binary32"),
    Format("tf32", 19, 8, 10, 127, "ieee", False,
           description="TensorFloat-32: fp32 range, 10-bit mantissa (NVIDIA matmul inputs)"),
    Format("fp16", 16, 5, 10, 15, "ieee", False, ml_dtypes_name="float16", torch_name="float16",
           description="IEEE binary16"),
    Format("bf16", 16, 8, 7, 127, "ieee", False, ml_dtypes_name="bfloat16", torch_name="bfloat16",
           description="bfloat16: fp32 range, 7-bit mantissa"),
    Format("fp8_e4m3fn", 8, 4, 3, 7, "fn", True, ml_dtypes_name="float8_e4m3fn",
           torch_name="float8_e4m3fn", description="OCP FP8 E4M3 (no inf)"),
    # fnuz casts do not saturate: torch and ml_dtypes both give NaN above max.
    Format("fp8_e4m3fnuz", 8, 4, 3, 8, "fnuz", False, ml_dtypes_name="float8_e4m3fnuz",
           torch_name="float8_e4m3fnuz", description="FP8 E4M3, no inf, no -0 (AMD/Graphcore)"),
    Format("fp8_e5m2", 8, 5, 2, 15, "ieee", False, ml_dtypes_name="float8_e5m2",
           torch_name="float8_e5m2", description="OCP FP8 E5M2 (IEEE-like)"),
    Format("fp8_e5m2fnuz", 8, 5, 2, 16, "fnuz", False, ml_dtypes_name="float8_e5m2fnuz",
           torch_name="float8_e5m2fnuz", description="FP8 E5M2, no inf, no -0 (AMD/Graphcore)"),
    Format("fp6_e2m3", 6, 2, 3, 1, "none", True, ml_dtypes_name="float6_e2m3fn",
           description="OCP MX FP6 E2M3"),
    Format("fp6_e3m2", 6, 3, 2, 3, "none", True, ml_dtypes_name="float6_e3m2fn",
           description="OCP MX FP6 E3M2"),
    Format("fp4_e2m1", 4, 2, 1, 1, "none", True, ml_dtypes_name="float4_e2m1fn",
           description="OCP MX FP4 E2M1"),
    Format("e8m0", 8, 8, 0, 127, "nan_top", False, kind="e8m0", ml_dtypes_name="float8_e8m0fnu",
           torch_name="float8_e8m0fnu", description="OCP MX shared scale: powers of two only"),
    Format("int8", 8, 0, 7, 0, "none", True, kind="int", ml_dtypes_name="int8", torch_name="int8",
           description="symmetric int8 grid [-127, 127], unit scale, round-half-even"),
]

FORMATS: dict[str, Format] = {f.name: f for f in _TABLE}
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)

# dtype spellings (torch, numpy/ml_dtypes, msprobe strings) -> format name
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "fp32": "fp32",
    "float16": "fp16", "half": "fp16", "fp16": "fp16",
    "bfloat16": "bf16", "bf16": "bf16",
    "float8_e4m3fn": "fp8_e4m3fn", "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2", "float8_e5m2fnuz": "fp8_e5m2fnuz",
    "float6_e2m3fn": "fp6_e2m3", "float6_e3m2fn": "fp6_e3m2",
    "float4_e2m1fn": "fp4_e2m1", "float4_e2m1fn_x2": "fp4_e2m1",
    "float8_e8m0fnu": "e8m0", "int8": "int8",
}


def canonical_dtype(dtype) -> str:
    """'torch.float16' / np.dtype('float16') / torch.float16 -> 'float16'."""
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        return np.dtype(dtype).name
    s = str(dtype)
    return s[len("torch."):] if s.startswith("torch.") else s


def format_for_dtype(dtype) -> Optional[Format]:
    """The format a torch/numpy dtype (or its string) stores values in, if registered.

    float64 and integer types other than int8 have no entry (None): they are
    wider than every format we analyse.
    """
    name = _DTYPE_ALIASES.get(canonical_dtype(dtype).lower())
    return FORMATS.get(name) if name else None


def get_format(name: str) -> Format:
    """Look a format up by name or dtype spelling, with a helpful error."""
    if name in FORMATS:
        return FORMATS[name]
    fmt = format_for_dtype(name)
    if fmt is None:
        raise KeyError(f"unknown number format {name!r}; known formats: {', '.join(FORMAT_NAMES)}")
    return fmt


def numpy_dtype_named(name) -> np.dtype:
    """The numpy (or ml_dtypes) dtype of any spelling a dump may use: numpy's (``float16``, ``bfloat16``,
    ``float64``, ``int32``), torch's (``torch.float16``) or a format's name (``fp16``, ``bf16``,
    ``fp8_e4m3fn``). ``ValueError`` names an unknown one."""
    s = str(name).strip()
    s = s[len("torch."):] if s.startswith("torch.") else s
    fmt = FORMATS.get(s) or format_for_dtype(s)
    if fmt is not None and fmt.numpy_dtype() is not None:
        return fmt.numpy_dtype()
    import ml_dtypes  # deferred: numpy's own names need no ml_dtypes

    try:
        return np.dtype(getattr(ml_dtypes, s)) if hasattr(ml_dtypes, s) else np.dtype(s)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None
