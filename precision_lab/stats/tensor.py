"""The entry points, ``tensor_stats`` and ``summary_stats``: which accumulator takes an input, chunk by chunk."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import fields, replace
from typing import Optional

import numpy as np

from ..hostview import host_view
from ..numba_loader import SMALL_NUMPY, note_fallback, over_budget, readonly
from .accumulate import _Acc, merge_stats
from .chunks import (_F32_EXACT_INT, _NP_F32_EXACT, _TORCH_F32_EXACT, _fp4x2_to_f32, _iter_np_chunks,
                     _iter_torch_chunks, _np_dense_flat, _torch_dense_flat, _widen_buffer)
from .edges import N_BINS
from .float64 import _numpy_chunk, _torch_chunk_partial, _torch_finish
from .kernels import _CBITS
from .records import TensorStats, canonical_dtype
from .scan import _MAX_SCAN, _SCAN_KIND, KERNELS, _numba_chunk

DEFAULT_CHUNK = 1 << 24  # elements converted or held at a time by default (tensor_stats' chunk_elems)


def tensor_stats(x, *, histogram: bool = True, chunk_elems: Optional[int] = None, backend: str = "auto") -> TensorStats:
    """Statistics (and magnitude histogram) of a torch tensor or numpy array.

    Torch tensors are processed on their own device (CUDA tensors stay on
    the GPU; only the small per-chunk results are copied back, once).
    Accepted: float (incl. fp16/bf16/fp8/e8m0; ``float4_e2m1fn_x2`` is
    unpacked, so ``numel`` is twice the packed element count), integer and
    bool dtypes, numpy arrays incl. ``ml_dtypes`` dtypes and ``np.memmap``.
    Sparse torch tensors are summarised from their stored values plus the
    implicit zeros (nothing is densified).  Complex and meta tensors raise
    ValueError.  Integers wider than 2^53 are rounded to float64 first.

    ``chunk_elems`` bounds the elements converted/held at a time; by default ``DEFAULT_CHUNK``, and a dense
    float32/bf16/fp16 input the compiled kernel reads as it is is scanned in one call (no conversion, nothing
    held: the parts of one call share the threads best).
    ``backend``: "auto" (the compiled kernel on CPU where possible, once it is compiled or cached; numpy
    arrays otherwise take the float64 numpy path, torch tensors the torch one), "numba", "torch" or "numpy"
    (numpy arrays only).
    """
    if backend not in ("auto", "numba", "torch", "numpy"):
        raise ValueError(f"backend must be 'auto', 'numba', 'torch' or 'numpy', not {backend!r}")
    if chunk_elems is not None and chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    # "auto" takes the kernel only once it is compiled or cached: the first command after an install runs the
    # numpy/torch path while the kernel compiles in the background (numba_loader); a small numpy array takes the
    # numpy path until the kernel is loaded (loading numba and its cache costs more than many such arrays)
    if backend == "numba":
        use_numba = KERNELS.get() is not None
    elif (backend == "auto" and isinstance(x, np.ndarray) and x.size < SMALL_NUMPY and not KERNELS.loaded()
          and not over_budget()):
        use_numba = False
    else:
        use_numba = backend == "auto" and KERNELS.ready() is not None
    if backend == "numba" and not use_numba:
        raise ValueError("backend='numba' requested but numba is not available (or PRECISION_LAB_NO_NUMBA is set)")
    if use_numba or backend != "auto":
        return _tensor_stats(x, histogram, chunk_elems, use_numba, backend)
    # the fallback's time, counted against numba_loader.FALLBACK_BUDGET_S (read only here: a thread's CPU clock
    # is a system call, some 0.2 ms in a process whose other threads run, such as a rank's gloo threads)
    t0 = time.thread_time()
    out = _tensor_stats(x, histogram, chunk_elems, use_numba, backend)
    note_fallback(time.thread_time() - t0)
    return out


def summary_stats(x, edges) -> tuple[TensorStats, np.ndarray]:
    """``tensor_stats(x, histogram=False)`` and ``above``: how many nonzero finite magnitudes of ``x`` lie at or
    above each edge ``HIST_EDGES[edges[k]]`` (the counts ``format_counts_above`` turns into a format's overflow,
    underflow and subnormal counts), exactly as the histogram would give them.  A CPU tensor or array of
    float32, bf16 or fp16 takes one pass of the compiled kernel that compares its elements with those edges
    instead of counting them into the histogram (only where a block's extremes straddle an edge: 0.6x the time of
    the scan with the histogram on 0.26-16M-element tensors); anything else takes the histogram."""
    thr = _edge_bits(tuple(int(e) for e in edges))
    torch = sys.modules.get("torch")
    flat, dtype = None, None
    if torch is not None and isinstance(x, torch.Tensor):
        if (x.device.type == "cpu" and x.layout == torch.strided and not x.is_complex()
                and x.dtype in (torch.float32, torch.float16, torch.bfloat16)):
            d = _torch_dense_flat(x.detach())
            if d is not None:
                dtype = canonical_dtype(x.dtype)
                flat = host_view(d) if dtype == "float32" else host_view(d.view(torch.int16)).view(np.uint16)
    elif isinstance(x, np.ndarray) and x.dtype.name in ("float32", "float16", "bfloat16"):
        d = _np_dense_flat(x)
        if d is not None:
            dtype = x.dtype.name
            flat = d if dtype == "float32" else d.view(np.uint16)
    if flat is not None and KERNELS.ready() is not None:
        acc = _Acc(False, thr)
        if flat.size:
            _numba_chunk(acc, np.ascontiguousarray(flat), False, _SCAN_KIND.get(dtype, 0))
        return acc.result(numel=flat.size, dtype=dtype, shape=tuple(x.shape)), acc.above
    s = tensor_stats(x, histogram=True)
    tail = np.concatenate([np.cumsum(s.hist[::-1])[::-1], [0]])  # tail[i]: the magnitudes in bins i and above
    return replace(s, hist=None), tail[np.asarray(edges, dtype=np.int64)]


@functools.lru_cache(maxsize=64)
def _edge_bits(edges: tuple) -> np.ndarray:
    """The float32 patterns the scan compares with for ``HIST_EDGES[edges]`` (read-only; the same edges are asked
    for on every summarised tensor)."""
    if edges and (min(edges) < 1 or max(edges) > N_BINS):
        raise ValueError(f"summary_stats: edges must be histogram edge indices 1..{N_BINS}")
    return readonly(_CBITS[list(edges)].astype(np.uint32))


def _tensor_stats(x, histogram: bool, chunk_elems: int, use_numba: bool, backend: str) -> TensorStats:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if backend == "numpy":
            raise ValueError("backend='numpy' takes numpy arrays, not torch tensors")
        return _stats_torch(torch, x, histogram, chunk_elems, use_numba, backend)
    if isinstance(x, (np.ndarray, np.generic, int, float, list, tuple)):
        return _stats_numpy(np.asarray(x), histogram, chunk_elems, use_numba, backend)
    raise TypeError(f"tensor_stats expects a torch.Tensor or numpy array, not {type(x).__name__}")


def _check_kind_np(arr: np.ndarray) -> None:
    k = arr.dtype.kind
    if k == "c":
        raise ValueError(
            f"complex arrays are not supported (dtype {arr.dtype.name}): "
            "pass x.real and x.imag (or abs(x)) separately"
        )
    if k not in "biuf" and arr.dtype.name not in _NP_F32_EXACT:
        raise ValueError(f"cannot compute numeric statistics of a {arr.dtype.name} array")


def _stats_numpy(arr: np.ndarray, histogram: bool, chunk: int, use_numba: bool, backend: str) -> TensorStats:
    _check_kind_np(arr)
    # casting a signalling NaN raises "invalid"; NaNs are counted, not an error
    with np.errstate(invalid="ignore", over="ignore"):
        return _stats_numpy_inner(arr, histogram, chunk, use_numba, backend)


def _stats_numpy_inner(arr: np.ndarray, histogram: bool, chunk: Optional[int], use_numba: bool,
                       backend: str) -> TensorStats:
    whole, chunk = chunk is None, chunk or DEFAULT_CHUNK
    name = arr.dtype.name
    acc = _Acc(histogram)
    if use_numba and (name == "float32" or name in _NP_F32_EXACT):
        kind = _SCAN_KIND.get(name, 0)
        # a dense array the scan reads as it is is scanned in place, in one call: nothing is converted or held
        as_is = whole and (name == "float32" or kind) and _np_dense_flat(arr) is not None
        for c in _iter_np_chunks(arr, _MAX_SCAN if as_is else chunk):
            if kind:  # 16-bit floats: their bits, widened inside the scan
                _numba_chunk(acc, np.ascontiguousarray(c).view(np.uint16), histogram, kind)
                continue
            xf = c if c.dtype == np.float32 else c.astype(np.float32)
            _numba_chunk(acc, np.ascontiguousarray(xf), histogram)
    elif use_numba and arr.dtype.kind in "iu":
        # wide integers: chunks whose values fit in +/-2^24 are exact in float32
        import torch  # deferred: float32-exact numpy inputs never need it

        parts = []
        for c in _iter_np_chunks(arr, min(chunk, 1 << 22)):
            if c.size and max(abs(int(c.min())), abs(int(c.max()))) <= _F32_EXACT_INT:
                _numba_chunk(acc, np.ascontiguousarray(c.astype(np.float32)), histogram)
            else:
                parts.append(_torch_chunk_partial(torch, torch.from_numpy(c.astype(np.float64)), histogram))
        _torch_finish(torch, acc, parts)
    elif backend != "torch":
        if backend == "numba":
            raise ValueError(f"backend='numba' handles only dtypes exact in float32, not {name}")
        for c in _iter_np_chunks(arr, min(chunk, 1 << 22)):
            _numpy_chunk(acc, c, histogram)
    else:
        import torch  # deferred: see above

        parts = []
        sub = min(chunk, 1 << 22)
        for c in _iter_np_chunks(arr, sub):
            c64 = np.ascontiguousarray(c.astype(np.float64, copy=False))
            parts.append(_torch_chunk_partial(torch, torch.from_numpy(c64), histogram))
            if len(parts) >= 64:
                _torch_finish(torch, acc, parts)
                parts = []
        _torch_finish(torch, acc, parts)
    return acc.result(numel=arr.size, dtype=name, shape=arr.shape)


def _stats_torch(torch, t, histogram: bool, chunk: Optional[int], use_numba: bool, backend: str) -> TensorStats:
    whole, chunk = chunk is None, chunk or DEFAULT_CHUNK
    dtype = canonical_dtype(t.dtype)
    if t.is_complex():
        raise ValueError(
            f"complex tensors are not supported (dtype {dtype}): "
            "pass x.real and x.imag (or x.abs()) separately"
        )
    if t.device.type == "meta":
        raise ValueError("meta tensors have no values: materialise the tensor before computing statistics")
    t = t.detach()
    shape = tuple(t.shape)
    if t.layout != torch.strided:
        return _stats_torch_sparse(torch, t, histogram, chunk, use_numba, backend, dtype, shape)
    numel = t.numel()
    packed_fp4 = dtype == "float4_e2m1fn_x2"
    if packed_fp4:
        numel *= 2
    if not (t.dtype.is_floating_point or packed_fp4 or dtype in _TORCH_F32_EXACT
            or dtype.startswith(("int", "uint"))):
        raise ValueError(f"cannot compute numeric statistics of a {dtype} tensor")
    acc = _Acc(histogram)
    cpu = t.device.type == "cpu"
    if cpu and use_numba and (dtype == "float32" or dtype in _TORCH_F32_EXACT or packed_fp4):
        _scan_torch_floats(torch, acc, t, dtype, histogram, chunk, whole)
    elif cpu and use_numba and dtype.startswith(("int", "uint")):
        _scan_torch_ints(torch, acc, t, histogram, chunk)
    else:
        if backend == "numba":
            raise ValueError(f"backend='numba' handles only CPU tensors with dtypes exact in float32, not {dtype} "
                             f"on {t.device}")
        sub = chunk if not cpu else min(chunk, 1 << 22)
        parts = []
        for c in _iter_torch_chunks(t, sub if not packed_fp4 else max(1, sub // 2)):
            if packed_fp4:
                c = _fp4x2_to_f32(torch, c)
            parts.append(_torch_chunk_partial(torch, c, histogram))
            if len(parts) >= 64:  # keep the pending per-chunk results small
                _torch_finish(torch, acc, parts)
                parts = []
        _torch_finish(torch, acc, parts)
    return acc.result(numel=numel, dtype=dtype, shape=shape)


def _scan_torch_floats(torch, acc: _Acc, t, dtype: str, histogram: bool, chunk: int, whole: bool) -> None:
    """A CPU tensor of float32 or of a dtype exact in float32, through the compiled scan."""
    packed_fp4 = dtype == "float4_e2m1fn_x2"
    # a dense float32/bf16/fp16 tensor is scanned in place, in one call (see _stats_numpy_inner)
    as_is = whole and t.dtype in (torch.float32, torch.float16, torch.bfloat16) and _torch_dense_flat(t) is not None
    for c in _iter_torch_chunks(t, _MAX_SCAN if as_is else chunk if not packed_fp4 else max(1, chunk // 2)):
        if packed_fp4:
            c = _fp4x2_to_f32(torch, c)
        elif c.dtype in (torch.float16, torch.bfloat16):
            # bf16 / fp16 bits go to the scan as they are and are widened there, block by block
            _numba_chunk(acc, host_view(c.contiguous().view(torch.int16)).view(np.uint16), histogram,
                         _SCAN_KIND[dtype])
            continue
        elif c.dtype != torch.float32:
            # other narrow floats (fp8, e8m0) are widened a cache-sized piece at a time into one reused
            # buffer: no float32 copy of the whole chunk is allocated and faulted in
            buf = _widen_buffer(torch)
            for s0 in range(0, c.numel(), buf.numel()):
                piece = c[s0:s0 + buf.numel()]
                out = buf[:piece.numel()]
                out.copy_(piece)
                _numba_chunk(acc, out.numpy(), histogram)
            continue
        _numba_chunk(acc, host_view(c.contiguous()), histogram)


def _scan_torch_ints(torch, acc: _Acc, t, histogram: bool, chunk: int) -> None:
    """A CPU integer tensor (int32/int64: token ids, indices): chunks within +/-2^24 are exact in float32 and take
    the compiled scan, the others the float64 kernel."""
    parts = []
    for c in _iter_torch_chunks(t, min(chunk, 1 << 22)):
        lo, hi = torch.aminmax(c)
        if max(abs(int(lo)), abs(int(hi))) <= _F32_EXACT_INT:
            _numba_chunk(acc, host_view(c.to(torch.float32)), histogram)
        else:
            parts.append(_torch_chunk_partial(torch, c, histogram))
    _torch_finish(torch, acc, parts)


def _stats_torch_sparse(torch, t, histogram, chunk, use_numba, backend, dtype, shape) -> TensorStats:
    """Stored values plus (numel - nnz) implicit zeros; no densifying."""
    if t.layout == torch.sparse_coo:
        vals = t.coalesce().values()
    elif t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        vals = t.values()
    else:
        raise ValueError(f"unsupported tensor layout {t.layout}: convert with .to_dense() first")
    s = tensor_stats(vals, histogram=histogram, chunk_elems=chunk, backend=backend)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    n_implicit = numel - vals.numel()
    if n_implicit:
        z = TensorStats(
            numel=n_implicit, dtype=dtype, shape=(n_implicit,), nan_count=0, inf_count=0, zero_count=n_implicit,
            min=0.0, max=0.0, absmax=0.0, min_abs_nonzero=float("nan"), mean=0.0, std=0.0, l2norm=0.0,
            hist=np.zeros(N_BINS, np.int64) if histogram else None, neg_inf_count=0,
        )
        s = merge_stats(s, z)
    return TensorStats(**{**{f.name: getattr(s, f.name) for f in fields(s)}, "numel": numel,
                          "dtype": dtype, "shape": shape})
