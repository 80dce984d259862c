"""A fused statistics kernel for CUDA tensors, written in Triton: one read of the tensor gives everything the
device path's ``DevicePartial`` holds (the counts of NaN, +/-Inf and zeros, the finite count, min, max, absmax,
the smallest nonzero magnitude, float64 mean, M2 and sum of squares, and the magnitude histogram over
``HIST_EDGES``, from which every format's overflow/underflow/subnormal counts follow).

Definitions are those of ``tensor_stats`` (``precision_lab.stats``), and the result is the same
``DevicePartial`` (13 float64 totals in the torch path's order, N_BINS int64 counts), so
``finish_partials`` and the capture engine's one transfer per step take it unchanged.  Nothing here reads a
result back to the host: the launch allocates its buffers on the tensor's device and returns at once.

How: each program of a grid (a few per streaming multiprocessor) walks the tensor a block at a time and keeps
per-lane running values in registers: counts, min/max as monotone int32 keys of the float32 bit patterns, the
extremes of ``|x|`` as bit patterns, and float64 sums shifted by each lane's first finite value (Chan's merge
joins lanes, then programs).  Inputs are read as their bit patterns and widened to float32 bits in the kernel
(fp32, bf16, fp16, fp8 e4m3fn/e4m3fnuz/e5m2/e5m2fnuz, every one exact in float32), so NaN, Inf, ``-0.0`` and
subnormals are told apart by integer tests.  The histogram bin of a magnitude is read from a small table
indexed by its float32 binade (float32 subnormals by the binade of their integer pattern): the bin at the
binade's start plus one for each edge inside the binade at or below it; each program counts its bins with
``tl.histogram`` and adds them to the result with one atomic add per bin.  A second one-program kernel folds the
per-program partials into the totals.

Triton is optional: this module imports it on first use, ``takes(t)`` is False without it (and for CPU
tensors, other dtypes, sparse tensors), and the capture engine then uses the torch device path.  With
``TRITON_INTERPRET=1`` in the environment the kernels run on CPU tensors through Triton's interpreter (how
the tests check them without a GPU).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.util
import os
import threading
import types
from typing import Optional

import numpy as np

from ..formats import format_for_dtype
from .edges import N_BINS
from .chunks import _torch_dense_flat
from .float64 import DevicePartial
from .kernels import _CBITS
from .records import canonical_dtype

__all__ = ["takes", "device_partials", "available", "failure", "give_up", "BLOCK", "MAX_PROGRAMS"]

BLOCK = 1024  # elements per program and step
_NUM_WARPS = 8
MAX_PROGRAMS = 1024  # the finishing kernel folds at most this many partials (a power of two)
_PROGRAMS_PER_SM = 4
_INTERPRET_PROGRAMS = 4  # programs of an interpreted launch (each runs in turn)
_NB = 1 << int(N_BINS).bit_length()  # histogram slots, a power of two above N_BINS: the last one takes the rest
_INTS, _FLTS = 9, 3  # per-program partials: the row widths _stats_kernel stores and _finish_kernel reads
_TOTALS = 13  # DevicePartial.totals, in _torch_chunk_partial's order
_MAX_PER_PROGRAM = 1 << 30  # elements one program may count (its counters are int32)

tl = None  # the kernels' own globals bind it (_build): importing this module never imports triton


# ---------------------------------------------------------------------------
# the histogram's lookup table
# ---------------------------------------------------------------------------

_SUB_ROW = 256  # rows 256 + p: float32 subnormal patterns in [2^p, 2^(p+1)), compared as float32(pattern) bits
_PAD = 0x7FFFFFFF  # above every compared pattern


@functools.cache
def _bin_table() -> np.ndarray:
    """``[rows, W]`` int32: per binade, the bin of its first pattern, then the (compared) patterns of the edges
    inside it, padded; bin(a) = row[0] + #(row[1:] <= a).  ``_CBITS[i]`` is the smallest float32 pattern in bin
    i, so bin(a) = #(_CBITS <= a) - 1 (the CPU kernel's definition)."""
    c = _CBITS.astype(np.int64)
    rows = []
    for e in range(256):  # normal binades by exponent field (0 and 255 are never looked up)
        lo, hi = e << 23, (e + 1) << 23
        rows.append((int(np.searchsorted(c, lo, side="right")) - 1, c[(c > lo) & (c < hi)]))
    for p in range(23):  # float32 subnormals: binades of the integer pattern, compared through float32(pattern)
        lo, hi = 1 << p, 1 << (p + 1)
        inner = c[(c > lo) & (c < hi)].astype(np.float32).view(np.int32).astype(np.int64)
        rows.append((int(np.searchsorted(c, lo, side="right")) - 1, inner))
    width = 1 << int(max(len(inner) for _, inner in rows)).bit_length()  # one column for the bin, a power of two
    table = np.full((len(rows), width), _PAD, dtype=np.int64)
    for i, (first, inner) in enumerate(rows):
        table[i, 0] = first
        table[i, 1:1 + len(inner)] = inner
    return table.astype(np.int32)



# ---------------------------------------------------------------------------
# input dtypes: how the kernel widens each to float32 bits
# ---------------------------------------------------------------------------

_SPECIAL = {"ieee": 0, "fn": 1, "fnuz": 2}


def _decode(dtype: str) -> Optional[tuple]:
    """``(view dtype name, kind, exp bits, mantissa bits, bias, special, subnormal step)`` for a dtype the kernel reads, else
    None.  kind 0: float32 bits; 1: bfloat16 (the top half of float32); 2: a narrower float, decoded by its
    layout (formats.py)."""
    fmt = format_for_dtype(dtype)
    if fmt is None or fmt.kind != "float" or fmt.special not in _SPECIAL or fmt.bits not in (8, 16, 32):
        return None
    kind = 0 if dtype == "float32" else 1 if dtype == "bfloat16" else 2
    view = {8: "uint8", 16: "int16", 32: "int32"}[fmt.bits]
    sub_scale = float(np.ldexp(1.0, 1 - fmt.bias - fmt.man_bits))  # a subnormal's mantissa step
    return view, kind, fmt.exp_bits, fmt.man_bits, fmt.bias, _SPECIAL[fmt.special], sub_scale


_DECODE = {d: _decode(d) for d in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz",
                                     "float8_e5m2", "float8_e5m2fnuz")}


# ---------------------------------------------------------------------------
# the kernels (plain functions, made Triton kernels by _build)
# ---------------------------------------------------------------------------

def _add(a, b):
    return a + b


def _lo(a, b):
    return tl.minimum(a, b)


def _hi(a, b):
    return tl.maximum(a, b)


def _sum(x):
    return tl.reduce(x, 0, _add)


def _min_of(x):
    return tl.reduce(x, 0, _lo)


def _max_of(x):
    return tl.reduce(x, 0, _hi)


_HELPERS = (_add, _lo, _hi, _sum, _min_of, _max_of)


def _stats_kernel(x_ptr, n, ints_ptr, flts_ptr, hist_ptr, table_ptr,
                  KIND: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
                  SPECIAL: tl.constexpr, SUB_SCALE: tl.constexpr, HIST: tl.constexpr, BLOCK: tl.constexpr,
                  NB: tl.constexpr, W: tl.constexpr, LOGW: tl.constexpr, SUB_ROW: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    big = 0x7FFFFFFF
    nan_c = tl.full([BLOCK], 0, tl.int32)
    inf_c = tl.full([BLOCK], 0, tl.int32)
    ninf_c = tl.full([BLOCK], 0, tl.int32)
    zero_c = tl.full([BLOCK], 0, tl.int32)
    fin_c = tl.full([BLOCK], 0, tl.int32)
    kmin = tl.full([BLOCK], big, tl.int32)
    kmax = tl.full([BLOCK], -big - 1, tl.int32)
    amax = tl.full([BLOCK], 0, tl.int32)
    amin = tl.full([BLOCK], big, tl.int32)
    shift = tl.full([BLOCK], 0, tl.float64)
    s1 = tl.full([BLOCK], 0, tl.float64)
    s2 = tl.full([BLOCK], 0, tl.float64)
    sq = tl.full([BLOCK], 0, tl.float64)
    hacc = tl.full([NB], 0, tl.int32)
    n64 = n.to(tl.int64)
    for start in range(pid.to(tl.int64) * BLOCK, n64, nprog.to(tl.int64) * BLOCK):
        offs = start + lanes
        inb = offs < n64
        raw = tl.load(x_ptr + offs, mask=inb, other=0)
        # ---- the float32 bit pattern w of each element (exact for every input dtype) ----
        if KIND == 0:
            w = raw
        elif KIND == 1:
            w = raw.to(tl.int32) << 16
        else:
            h = raw.to(tl.int32) & ((1 << (1 + EXP + MAN)) - 1)
            sign = (h >> (EXP + MAN)) << 31
            e = (h >> MAN) & ((1 << EXP) - 1)
            m = h & ((1 << MAN) - 1)
            normal = ((e - BIAS + 127) << 23) | (m << (23 - MAN))
            sub = (m.to(tl.float32) * SUB_SCALE).to(tl.int32, bitcast=True)  # m * 2^(emin - MAN), exact
            w = tl.where(e == 0, sub, normal)
            if SPECIAL == 0:  # ieee: the all-ones exponent is Inf (mantissa 0) or NaN
                w = tl.where(e == (1 << EXP) - 1, tl.where(m == 0, 0x7F800000, 0x7FC00000), w)
            elif SPECIAL == 1:  # fn: the all-ones code is NaN, no Inf
                w = tl.where((e == (1 << EXP) - 1) & (m == (1 << MAN) - 1), 0x7FC00000, w)
            w = w | sign
            if SPECIAL == 2:  # fnuz: the negative-zero code is NaN, no Inf
                w = tl.where(h == (1 << (EXP + MAN)), 0x7FC00000, w)
        a = w & big
        fin = inb & (a < 0x7F800000)
        isnan = inb & (a > 0x7F800000)
        isinf = inb & (a == 0x7F800000)
        nan_c += isnan.to(tl.int32)
        inf_c += isinf.to(tl.int32)
        ninf_c += (isinf & (w < 0)).to(tl.int32)
        zero_c += (inb & (a == 0)).to(tl.int32)
        # ---- extremes over the finite values ----
        key = w ^ ((w >> 31) & big)  # monotone: the order of keys is the order of the values
        kmin = tl.where(fin, tl.minimum(kmin, key), kmin)
        kmax = tl.where(fin, tl.maximum(kmax, key), kmax)
        amax = tl.where(fin, tl.maximum(amax, a), amax)
        nz = fin & (a != 0)
        amin = tl.where(nz, tl.minimum(amin, a), amin)
        # ---- float64 moments, shifted by the lane's first finite value ----
        x = w.to(tl.float32, bitcast=True).to(tl.float64)
        shift = tl.where(fin & (fin_c == 0), x, shift)
        d = tl.where(fin, x - shift, 0.0)
        s1 += d
        s2 += d * d
        sq += tl.where(fin, x * x, 0.0)
        fin_c += fin.to(tl.int32)
        # ---- histogram of the nonzero finite magnitudes ----
        if HIST:
            is_sub = a < 0x00800000
            pat = a.to(tl.float32).to(tl.int32, bitcast=True)  # float32 subnormals: their pattern as a float
            row = tl.where(is_sub, SUB_ROW + (pat >> 23) - 127, a >> 23)
            row = tl.where(nz, row, 1)
            val = tl.where(is_sub, pat, a)
            # bin = row[0] + the number of the row's W - 1 sorted edges at or below val: a binary search of
            # LOGW dependent loads (a linear scan of W - 1 loads took 2.2x as long on an H200)
            rp = table_ptr + row * W
            pos = tl.full([BLOCK], 0, tl.int32)
            for k in tl.static_range(0, LOGW):
                step = (W // 2) >> k
                pos += (val >= tl.load(rp + pos + step)).to(tl.int32) * step
            b = tl.load(rp) + pos
            hacc += tl.histogram(tl.where(nz, b, NB - 1), NB)
    # ---- this program's partials: lanes merged (Chan), then stored ----
    nl = fin_c.to(tl.float64)
    nl1 = tl.maximum(nl, 1.0)
    mean_l = shift + s1 / nl1
    m2_l = tl.maximum(s2 - s1 * (s1 / nl1), 0.0)
    nsum = _sum(nl)
    mean = _sum(nl * mean_l) / tl.maximum(nsum, 1.0)
    dm = tl.where(fin_c > 0, mean_l - mean, 0.0)
    m2 = _sum(m2_l + nl * dm * dm)
    ip = ints_ptr + pid * 9
    tl.store(ip + 0, _sum(nan_c.to(tl.int64)))
    tl.store(ip + 1, _sum(inf_c.to(tl.int64)))
    tl.store(ip + 2, _sum(ninf_c.to(tl.int64)))
    tl.store(ip + 3, _sum(zero_c.to(tl.int64)))
    tl.store(ip + 4, _sum(fin_c.to(tl.int64)))
    tl.store(ip + 5, _min_of(kmin).to(tl.int64))
    tl.store(ip + 6, _max_of(kmax).to(tl.int64))
    tl.store(ip + 7, _max_of(amax).to(tl.int64))
    tl.store(ip + 8, _min_of(amin).to(tl.int64))
    fp = flts_ptr + pid * 3
    tl.store(fp + 0, mean)
    tl.store(fp + 1, m2)
    tl.store(fp + 2, _sum(sq))
    if HIST:
        tl.atomic_add(hist_ptr + tl.arange(0, NB), hacc.to(tl.int64))


def _finish_kernel(ints_ptr, flts_ptr, nprog, out_ptr, P: tl.constexpr):
    """Fold ``nprog`` programs' partials into DevicePartial.totals: nan, inf, zero, finite, min, max, absmax,
    min |x| > 0, mean, M2, sum of squares, k (0: float32 squares cannot overflow float64), -inf."""
    big = 0x7FFFFFFF
    i = tl.arange(0, P)
    on = i < nprog
    ip = ints_ptr + i * 9
    nan_c = _sum(tl.load(ip + 0, mask=on, other=0))
    inf_c = _sum(tl.load(ip + 1, mask=on, other=0))
    ninf_c = _sum(tl.load(ip + 2, mask=on, other=0))
    zero_c = _sum(tl.load(ip + 3, mask=on, other=0))
    nf = tl.load(ip + 4, mask=on, other=0)
    has = nf > 0
    kmin = _min_of(tl.where(has, tl.load(ip + 5, mask=on, other=big), big)).to(tl.int32)
    kmax = _max_of(tl.where(has, tl.load(ip + 6, mask=on, other=0), -big - 1)).to(tl.int32)
    amax = _max_of(tl.where(has, tl.load(ip + 7, mask=on, other=0), 0)).to(tl.int32)
    amin = _min_of(tl.where(has, tl.load(ip + 8, mask=on, other=big), big)).to(tl.int32)
    vmin = (kmin ^ ((kmin >> 31) & big)).to(tl.float32, bitcast=True).to(tl.float64)
    vmax = (kmax ^ ((kmax >> 31) & big)).to(tl.float32, bitcast=True).to(tl.float64)
    absmax = amax.to(tl.float32, bitcast=True).to(tl.float64)
    minabs = tl.where(amin == big, float("inf"), amin.to(tl.float32, bitcast=True).to(tl.float64))
    fp = flts_ptr + i * 3
    n_p = nf.to(tl.float64)
    mean_p = tl.load(fp + 0, mask=on, other=0.0)
    nsum = _sum(n_p)
    mean = _sum(n_p * mean_p) / tl.maximum(nsum, 1.0)
    dm = tl.where(has, mean_p - mean, 0.0)
    m2 = _sum(tl.load(fp + 1, mask=on, other=0.0) + n_p * dm * dm)
    sq = _sum(tl.load(fp + 2, mask=on, other=0.0))
    j = tl.arange(0, 16)
    out = tl.where(j == 0, nan_c.to(tl.float64), 0.0)
    out = tl.where(j == 1, inf_c.to(tl.float64), out)
    out = tl.where(j == 2, zero_c.to(tl.float64), out)
    out = tl.where(j == 3, nsum, out)
    out = tl.where(j == 4, vmin, out)
    out = tl.where(j == 5, vmax, out)
    out = tl.where(j == 6, absmax, out)
    out = tl.where(j == 7, minabs, out)
    out = tl.where(j == 8, mean, out)
    out = tl.where(j == 9, m2, out)
    out = tl.where(j == 10, sq, out)
    out = tl.where(j == 12, ninf_c.to(tl.float64), out)
    tl.store(out_ptr + j, out, mask=j < 13)


# ---------------------------------------------------------------------------
# building and launching
# ---------------------------------------------------------------------------

_LOCK = threading.Lock()
_BUILT: dict = {}  # interpret (bool) -> (stats kernel, finish kernel)
_TABLES: dict = {}  # device -> the lookup table there
_SMS: dict = {}  # device index -> streaming multiprocessors
# "failed": why the kernel was given up in this process (the torch path then serves); "installed": triton found
_state = {"failed": None, "installed": None}


def available() -> bool:
    """Whether triton is installed (looked up once, nothing imported) and the kernel has not failed in this
    process."""
    if _state["installed"] is None:
        try:
            _state["installed"] = importlib.util.find_spec("triton") is not None
        except (ImportError, ValueError):
            _state["installed"] = False
    return _state["failed"] is None and _state["installed"]


def failure() -> Optional[str]:
    """Why the kernel was given up in this process, or None."""
    return _state["failed"]


def give_up(reason: BaseException) -> None:
    """Stop using the kernel in this process (it failed to compile or launch here): ``takes`` is False from now."""
    _state["failed"] = f"{type(reason).__name__}: {reason}"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _interpreted_range(*bounds):
    """``range`` over the interpreter's scalar tensors (the kernels' loop bounds are tensors there).

    Triton's interpreter takes a bound's ``int()`` from its one-element array, which numpy >= 2.4 refuses
    (triton 3.6, the version torch 2.11 ships, does so); each bound's one value is read here instead."""
    return range(*(int(b.handle.data.reshape(-1)[0]) if hasattr(b, "handle") else int(b) for b in bounds))


def _build():
    """The two kernels for the current mode (compiled, or interpreted under TRITON_INTERPRET=1).

    Each build gets its own globals: Triton's interpreter writes its names into the globals of what it runs,
    and a process may build both modes.  The kernels call no ``@triton.jit`` function of triton.language
    (``tl.sum``, ``tl.zeros``...), only builtins and the helpers above: those library functions are made for
    the mode in force when triton was first imported, so a kernel built in the other mode could not call them
    (the tests interpret the kernels in a process that may have imported triton before)."""
    interp = _interpreting()
    k = _BUILT.get(interp)
    if k is not None:
        return k
    with _LOCK:
        k = _BUILT.get(interp)
        if k is None:
            import triton as _triton  # deferred: an optional dependency, and a second's import
            import triton.language as _tl

            g = {"tl": _tl, "triton": _triton, "__builtins__": builtins}
            if interp:
                g["range"] = _interpreted_range

            def jit(fn, **kw):
                f = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
                f.__annotations__, f.__module__, f.__qualname__ = fn.__annotations__, fn.__module__, fn.__qualname__
                f.__doc__ = fn.__doc__
                return _triton.jit(f, **kw)

            for h in _HELPERS:
                g[h.__name__] = jit(h)
            stats = jit(_stats_kernel, do_not_specialize=["n"])
            finish = jit(_finish_kernel, do_not_specialize=["nprog"])
            k = _BUILT[interp] = (stats, finish)
    return k


def takes(t) -> bool:
    """Whether the capture engine hands ``t`` to this kernel: a strided CUDA tensor of a dtype it reads, with
    triton installed (never a CPU tensor)."""
    return (t.is_cuda and str(t.layout) == "torch.strided" and canonical_dtype(t.dtype) in _DECODE
            and available())


def _table(torch, device):
    key = str(device)
    tab = _TABLES.get(key)
    if tab is None:
        host = torch.from_numpy(_bin_table())
        if device.type == "cuda":  # pinned and asynchronous: a pageable copy would wait for the device
            tab = host.pin_memory().to(device, non_blocking=True)
        else:
            tab = host.clone()
        _TABLES[key] = tab
    return tab


def _programs(torch, device, n: int, block: int) -> int:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        sms = _SMS.get(idx)
        if sms is None:
            sms = _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        cap = min(MAX_PROGRAMS, _PROGRAMS_PER_SM * sms)
    else:
        cap = _INTERPRET_PROGRAMS
    p = min(-(-n // block), cap)
    return max(1, min(MAX_PROGRAMS, max(p, -(-n // _MAX_PER_PROGRAM))))


def device_partials(t, *, histogram: bool, block: int = BLOCK, programs: Optional[int] = None) -> list:
    """``[DevicePartial]`` of a strided tensor (``[]`` when it is empty), computed on its device by the Triton
    kernel with nothing copied to the host; ``finish_partials`` turns it into a ``TensorStats``.  CPU tensors
    only under ``TRITON_INTERPRET=1``.  ``block`` (a power of two) and ``programs`` set the launch (tests)."""
    import torch  # deferred: importing the stats package must not pay for torch

    dtype = canonical_dtype(t.dtype)
    spec = _DECODE.get(dtype)
    if spec is None:
        raise ValueError(f"the Triton statistics kernel does not read {dtype} tensors")
    if t.layout != torch.strided:
        raise ValueError(f"the Triton statistics kernel reads strided tensors, not {t.layout}")
    if not t.is_cuda and not _interpreting():
        raise ValueError("the Triton statistics kernel runs on CUDA tensors (CPU ones only with TRITON_INTERPRET=1)")
    t = t.detach()
    if t.is_neg():
        t = t.resolve_neg()  # the kernel reads bit patterns: a lazy negation must be applied first
    n = t.numel()
    if n == 0:
        return []
    flat = _torch_dense_flat(t.reshape(1) if t.dim() == 0 else t)
    if flat is None:
        flat = t.contiguous().view(-1)
    view, kind, exp, man, bias, special, sub_scale = spec
    bits = flat.view(getattr(torch, view))
    stats_k, finish_k = _build()
    dev = t.device
    nprog = programs if programs is not None else _programs(torch, dev, n, block)
    if not 1 <= nprog <= MAX_PROGRAMS:
        raise ValueError(f"programs must be in [1, {MAX_PROGRAMS}], got {nprog}")
    ints = torch.empty((nprog, _INTS), dtype=torch.int64, device=dev)
    flts = torch.empty((nprog, _FLTS), dtype=torch.float64, device=dev)
    totals = torch.empty(16, dtype=torch.float64, device=dev)
    hist = torch.zeros(_NB if histogram else 1, dtype=torch.int64, device=dev)
    table = _table(torch, dev) if histogram else ints
    width = _bin_table().shape[1]
    # Triton launches on the current device: switched only for a tensor elsewhere (the switch costs a launch's time)
    other = dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device()
    with torch.cuda.device(dev) if other else contextlib.nullcontext():
        stats_k[(nprog,)](bits, n, ints, flts, hist, table, KIND=kind, EXP=exp, MAN=man, BIAS=bias, SPECIAL=special,
                          SUB_SCALE=sub_scale, HIST=bool(histogram), BLOCK=block, NB=_NB, W=width,
                          LOGW=width.bit_length() - 1, SUB_ROW=_SUB_ROW, num_warps=_NUM_WARPS, enable_fp_fusion=False)
        finish_k[(1,)](ints, flts, nprog, totals, P=MAX_PROGRAMS, enable_fp_fusion=False)
    return [DevicePartial(totals[:_TOTALS], hist[:N_BINS] if histogram else None)]

