"""The dtype a generic folder's tensor was saved from: given by the manifest or a sidecar, or told from the
values of float32 tensors that hold only fp16 or bf16 values (``_Evidence``), and the tensor read back in it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np

from .calllayout import _record_fields
from ..formats import canonical_dtype, format_for_dtype



def _native(x):
    """Arrays in foreign byte order cannot be viewed by torch; swap them once."""
    if isinstance(x, np.ndarray) and not x.dtype.isnative:
        return x.astype(x.dtype.newbyteorder("="))
    return x


def _original_for(originals: dict, name: str, prefix: str, path: Path):
    """The original dtype a tensor was saved from: its file's own sidecar says (``originals[path]``), else the
    manifest, by the tensor's name, its op/module, or its file's name."""
    if not originals:
        return None
    for n in (path, name, _record_fields(name)["op"], prefix):
        if n in originals:
            return originals[n]
    return None


_CHUNK = 1 << 18  # elements looked at a time: a check holds some tens of bytes per element of one chunk, not copies of the tensor


def _chunks(a: np.ndarray):
    flat = a.reshape(-1)
    for i in range(0, flat.size, _CHUNK):
        yield flat[i:i + _CHUNK]


def _representable(a: np.ndarray, dt) -> bool:
    """Whether every value of ``a`` is exactly a value of dtype ``dt`` (NaN counts as one), looked at a chunk
    at a time, stopping at the first chunk that holds one that is not (float32 data fails in its first)."""
    with np.errstate(over="ignore", invalid="ignore"):  # a value past the dtype's range is simply not one of its
        for c in _chunks(a):
            back = c.astype(dt).astype(c.dtype)
            if not ((back == c) | (np.isnan(back) & np.isnan(c))).all():
                return False
    return True


def _as_dtype(t, dt):
    """``t`` read back in dtype ``dt`` (a numpy/ml_dtypes dtype) when every value is exactly representable in
    it; None when one is not; ``t`` itself for ``dt`` None."""
    if dt is None or t is None:
        return t
    a = t.detach().cpu().float().numpy() if hasattr(t, "detach") else np.asarray(t)
    if not _representable(a, dt):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        return a.astype(dt)


# fp16/bf16 tensors saved as float32 with no dtype given, told from their values (``_Evidence``); tried in this
# order: a bf16 value within fp16's range is often an fp16 value too, an fp16 value seldom a bf16 one
SAVED_FROM = ("bfloat16", "float16")
TELLING_VALUES = 32  # distinct values, across the dump, that float32 data would not give by chance


@dataclasses.dataclass
class _Evidence:
    """What a dump's float32 tensors say about a narrower dtype they may have been saved from.  Every finite
    value must be one of its values (``_as_dtype``), and that must not be by chance: ``TELLING_VALUES``
    distinct values that are no integers and need one of the last three bits of the format's mantissa (a
    format three bits coarser holds none of them), spread over more binades than the format has digits (a fixed-point grid,
    ``arange(n) / 256``, is exact in every format that holds its digits).  Genuine float32 values fill all
    23 bits: each one is a value of fp16 with a chance of about 2^-13."""

    dtype: np.dtype
    telling: set = dataclasses.field(default_factory=set)
    low: int = 1 << 30  # exponent of the finest bit any value uses
    high: int = -(1 << 30)  # exponent of the largest magnitude
    tensors: int = 0

    @property
    def fmt(self):
        return format_for_dtype(self.dtype)

    def add(self, a: np.ndarray) -> bool:
        """Read one float32 array; False when one of its finite values is not a value of ``dtype``."""
        if not _representable(a, self.dtype):
            return False
        self.tensors += 1
        for c in _chunks(a):
            self._add_values(c)
        return True

    def _add_values(self, c: np.ndarray) -> None:
        """The evidence of one chunk of an array every value of which is one of ``dtype``'s."""
        v = c[np.isfinite(c)]
        bits = v.view(np.uint32)
        expo = ((bits >> 23) & 0xFF).astype(np.int64)
        v, bits, expo = v[expo > 0], bits[expo > 0], expo[expo > 0]  # zeros and float32's subnormals tell nothing
        if not v.size:
            return
        sig = (bits & 0x7FFFFF) | 0x800000
        zeros = np.log2((sig & (~sig + np.uint32(1))).astype(np.float64)).astype(np.int64)  # trailing zero bits
        self.low = min(self.low, int((expo - 150 + zeros).min()))
        self.high = max(self.high, int(expo.max()) - 127)
        if len(self.telling) < TELLING_VALUES:
            tell = v[(23 - zeros >= self.fmt.man_bits - 2) & (v != np.trunc(v))]
            self.telling.update(np.unique(tell[: 4 * TELLING_VALUES]).tolist())
        return True

    def holds(self) -> bool:
        return len(self.telling) >= TELLING_VALUES and self.high - self.low + 1 > self.fmt.man_bits + 1


def _float32(t) -> Optional[np.ndarray]:
    """A float32 tensor as a numpy array; None for any other dtype."""
    if canonical_dtype(getattr(t, "dtype", "")) != "float32":
        return None
    return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


def _read_back(t, name: str, prefix: str, p: Path, rel: str, src, originals, saved_from, cast: dict, source: str):
    """Tensor ``t`` read back in the dtype it was saved from (``originals`` by file, name or module, else
    ``saved_from``), noting it in ``cast`` under ``source``; ``t`` as saved when none is given, or when one of
    its values is not a value of that dtype (one warning in ``src`` names it)."""
    want = _original_for(originals or {}, name, prefix, p)
    if want is None and saved_from is not None and _float32(t) is not None:
        want = saved_from  # every value is one of its values (_saved_from read them all)
    if want is not None:
        back = _as_dtype(t, want)
        if back is None:
            said = "its sidecar" if p in originals else "the manifest"
            src.warnings.append((rel, f"{name!r} holds values that are not {want.name} values, so it was "
                                      f"not saved from {want.name} as {said} says; it is read as saved "
                                      f"({getattr(t, 'dtype', '?')})"))
        else:
            t = back
            cast[source] = want
    return t
