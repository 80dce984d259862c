"""Input normalisation and chunking: which dtypes convert exactly to float32, 1-D chunks of an array or tensor
in memory order, and the conversions of narrow floats before a scan."""

from __future__ import annotations

import threading
from typing import Iterator, Optional

import numpy as np

from ..formats import FORMATS

# numpy dtypes that convert exactly to float32 (numba path)
_NP_F32_EXACT = {"float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                 "float8_e4m3", "float8_e3m4", "float8_e4m3b11fnuz", "float8_e8m0fnu", "float6_e2m3fn",
                 "float6_e3m2fn", "float4_e2m1fn", "int8", "uint8", "int16", "uint16", "bool", "int4", "uint4",
                 "int2", "uint2"}
_F32_EXACT_INT = 1 << 24  # every integer of magnitude <= 2^24 is a float32
_TORCH_F32_EXACT = {"float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                    "float8_e8m0fnu", "int8", "uint8", "int16", "uint16", "bool"}


def _iter_np_chunks(arr: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
    """1-D chunks of ``arr`` (views where possible), in memory order."""
    if arr.ndim == 0:
        yield arr.reshape(1)
        return
    if arr.size == 0:
        return
    flat = _np_dense_flat(arr)
    if flat is not None:
        for s in range(0, flat.size, chunk):
            yield flat[s:s + chunk]
        return
    row = arr[0].size
    if row <= chunk:
        step = max(1, chunk // max(row, 1))
        for s in range(0, arr.shape[0], step):
            yield np.ascontiguousarray(arr[s:s + step]).reshape(-1)
    else:
        for i in range(arr.shape[0]):
            yield from _iter_np_chunks(arr[i], chunk)


def _np_dense_flat(arr: np.ndarray) -> Optional[np.ndarray]:
    if arr.flags.c_contiguous:
        return arr.reshape(-1)
    order = sorted(range(arr.ndim), key=lambda d: -abs(arr.strides[d]))
    t = arr.transpose(order)
    if t.flags.c_contiguous:
        return t.reshape(-1)
    return None


def _iter_torch_chunks(t, chunk: int):
    if t.dim() == 0:
        yield t.reshape(1)
        return
    if t.numel() == 0:
        return
    flat = _torch_dense_flat(t)
    if flat is not None:
        for s in range(0, flat.numel(), chunk):
            yield flat[s:s + chunk]
        return
    row = t[0].numel()
    if row <= chunk:
        step = max(1, chunk // max(row, 1))
        for s in range(0, t.shape[0], step):
            yield t[s:s + step].reshape(-1)
    else:
        for i in range(t.shape[0]):
            yield from _iter_torch_chunks(t[i], chunk)


def _torch_dense_flat(t):
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: -abs(t.stride(d)))
    p = t.permute(order)
    if p.is_contiguous():
        return p.view(-1)
    return None


_WIDEN = threading.local()
_WIDEN_ELEMS = 1 << 20  # 4 MiB of float32: stays in cache between the widening copy and the scan


def _widen_buffer(torch):
    """This thread's float32 buffer for widening narrow floats before the scan."""
    buf = getattr(_WIDEN, "buf", None)
    if buf is None:
        buf = _WIDEN.buf = torch.empty(_WIDEN_ELEMS, dtype=torch.float32)
    return buf


def _fp4x2_to_f32(torch, chunk):
    """Unpack torch.float4_e2m1fn_x2 bytes (two e2m1 values each) to float32."""
    fmt = FORMATS["fp4_e2m1"]
    codes = torch.arange(16, dtype=torch.float64)
    sign = torch.where(codes >= 8, -1.0, 1.0)
    e = (codes.long() >> fmt.man_bits) & ((1 << fmt.exp_bits) - 1)
    m = codes.long() & ((1 << fmt.man_bits) - 1)
    mag = torch.where(e == 0, torch.ldexp(m.double(), torch.tensor(fmt.emin - fmt.man_bits)),
                      torch.ldexp(1.0 + m.double() / (1 << fmt.man_bits), e.double() - fmt.bias))
    table = (sign * mag).to(torch.float32).to(chunk.device)
    b = chunk.view(torch.uint8).long()
    return torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).reshape(-1)
