"""The float64 accumulators: a pure-torch kernel (any device; its partial results stay there until finished on
the host, so the capture engine can batch the transfer) and its numpy mirror, which never imports torch."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .accumulate import _Acc
from .chunks import _fp4x2_to_f32, _iter_torch_chunks
from .edges import HIST_EDGES, N_BINS, histogram_counts
from .records import TensorStats, canonical_dtype


class DevicePartial(NamedTuple):
    """One chunk's totals as torch tensors on one device (the tensor's own, or the host once copied):
    ``totals``, 13 float64 values; ``hist``, N_BINS int64 counts or None.  Partials of many tensors can be
    stacked and copied together, then rebuilt with ``DevicePartial(totals_row, hist_row)``."""

    totals: Any
    hist: Any


_edges_cache: dict = {}


def _torch_edges(torch, device):
    key = str(device)
    e = _edges_cache.get(key)
    if e is None:
        e = torch.tensor(HIST_EDGES.tolist(), dtype=torch.float64, device=device)
        _edges_cache[key] = e
    return e


def _torch_chunk_partial(torch, x, histogram: bool) -> DevicePartial:
    """Device tensors for one chunk; nothing is copied to the host here."""
    x64 = x.to(torch.float64)
    a = x64.abs()
    isnan = torch.isnan(x64)
    fin = torch.isfinite(x64)
    nz = fin & (a > 0)
    # torch.full is a device fill; torch.tensor(scalar, device=cuda) is a blocking host copy
    inf = torch.full((), math.inf, dtype=torch.float64, device=x64.device)
    nfin = fin.sum()
    absmax = torch.where(fin, a, 0.0).amax()
    minabs = torch.where(nz, a, inf).amin()
    vmin = torch.where(fin, x64, inf).amin()
    vmax = torch.where(fin, x64, -inf).amax()
    # scale by 2**-k (exact; in two halves so the power itself cannot overflow) so the
    # squares of float64 values near 1e308 stay finite and those near 1e-308 do not vanish
    k = torch.frexp(absmax).exponent.to(torch.float64)
    k1 = torch.floor(k / 2)
    y = torch.where(fin, torch.ldexp(torch.ldexp(x64, -k1), k1 - k), 0.0)
    nf = nfin.to(torch.float64).clamp(min=1.0)
    mean_y = y.sum() / nf
    d = torch.where(fin, y - mean_y, 0.0)
    vec = torch.stack([
        isnan.sum().to(torch.float64),
        (~fin & ~isnan).sum().to(torch.float64),
        (x64 == 0).sum().to(torch.float64),
        nfin.to(torch.float64),
        vmin, vmax, absmax, minabs,
        mean_y, (d * d).sum(), (y * y).sum(), k,
        (x64 == -inf).sum().to(torch.float64),
    ])
    hist = None
    if histogram:
        idx = torch.bucketize(a, _torch_edges(torch, x64.device), right=True) - 1
        idx = torch.where(nz, idx, N_BINS)
        if x64.is_cuda:  # bincount reads max(idx) back to the host; index_add_ does not
            hist = torch.zeros(N_BINS + 1, dtype=torch.int64, device=x64.device).index_add_(
                0, idx, torch.ones_like(idx))[:N_BINS]
        else:
            hist = torch.bincount(idx, minlength=N_BINS + 1)[:N_BINS]
    return DevicePartial(vec, hist)


def _torch_finish(torch, acc: _Acc, parts) -> None:
    if not parts:
        return
    vecs = torch.stack([v for v, _ in parts]).cpu().numpy()
    if acc.hist is not None:
        acc.hist += torch.stack([h for _, h in parts]).sum(0).cpu().numpy().astype(np.int64)
    for row in vecs:
        nan_c, inf_c, zero_c, nfin = (int(v) for v in row[:4])
        acc.nan += nan_c
        acc.inf += inf_c
        acc.neginf += int(row[12])
        acc.zero += zero_c
        if nfin:
            acc.add_extrema(float(row[4]), float(row[5]), float(row[6]), float(row[7]))
            k = int(row[11])
            # mean, M2 and the sum of squares were computed on y = x * 2**-k
            acc.add_moments(nfin, math.ldexp(float(row[8]), k), float(row[9]), float(row[10]), k)


def device_partials(t, *, histogram: bool, chunk_elems: int = 1 << 26) -> list[DevicePartial]:
    """The per-chunk totals of a floating, integer or bool torch tensor (packed fp4 included), computed on its
    own device with nothing copied to the host; ``finish_partials`` turns them into a ``TensorStats``."""
    import torch  # deferred: importing stats must not pay for torch

    packed_fp4 = canonical_dtype(t.dtype) == "float4_e2m1fn_x2"
    parts = []
    for c in _iter_torch_chunks(t, chunk_elems if not packed_fp4 else chunk_elems // 2):
        if packed_fp4:
            c = _fp4x2_to_f32(torch, c)
        parts.append(_torch_chunk_partial(torch, c, histogram))
    return parts


def finish_partials(parts: list[DevicePartial], *, histogram: bool, numel: int, dtype: str, shape) -> TensorStats:
    """The ``TensorStats`` of one tensor from its ``device_partials`` (on the host or on a device)."""
    import torch  # deferred: importing stats must not pay for torch

    acc = _Acc(histogram)
    _torch_finish(torch, acc, parts)
    return acc.result(numel=numel, dtype=dtype, shape=shape)


def _numpy_chunk(acc: _Acc, c: np.ndarray, histogram: bool) -> None:
    """One chunk in float64 numpy, as the torch path computes it (``_torch_chunk_partial``): numpy inputs take
    it when the compiled kernel is not there yet, and never import torch."""
    x = np.asarray(c).astype(np.float64, copy=False).reshape(-1)
    fin = np.isfinite(x)
    nfin = int(np.count_nonzero(fin))
    nnan = int(np.count_nonzero(np.isnan(x)))
    acc.nan += nnan
    acc.inf += x.size - nfin - nnan
    acc.neginf += int(np.count_nonzero(x == -math.inf))
    acc.zero += int(np.count_nonzero(x == 0))
    if not nfin:
        return
    f = x if nfin == x.size else x[fin]
    a = np.abs(f)
    nz = a[a > 0]
    absmax = float(a.max())
    acc.add_extrema(float(f.min()), float(f.max()), absmax, float(nz.min()) if nz.size else math.inf)
    # scaled by 2**-k (exact, in two halves) so squares near float64's limits neither overflow nor vanish
    k = math.frexp(absmax)[1]
    k1 = k // 2
    y = np.ldexp(np.ldexp(f, -k1), k1 - k)
    mean_y = float(y.sum()) / nfin
    d = y - mean_y
    # sums of products, not np.dot: BLAS threads spin-wait, and stall when another process holds a core
    acc.add_moments(nfin, math.ldexp(mean_y, k), float(np.sum(d * d)), float(np.sum(y * y)), k)
    if histogram:
        acc.hist += histogram_counts(nz)
