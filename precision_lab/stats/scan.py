"""The compiled scan (``kernels``) compiled on first use, and run over a chunk: in parts on several threads when
that pays, its result rows taken into the running totals."""

from __future__ import annotations

import math
import struct
import threading
import time

import numpy as np

from ..numba_loader import CompiledOnce, ParallelChoice, kernel_threads, njit, prefetch_intrinsic, readonly, run_parts
from . import kernels
from .accumulate import _Acc
from .edges import N_BINS
from .kernels import _CBITS, _KEY_BIN, _N_KEYS, _SPLIT, _WAYS

_SCAN_KIND = {"bfloat16": 1, "float16": 2}  # 16-bit floats the scan widens itself (float32 is kind 0)


class _Kernels:
    def __init__(self, scan, num_threads, serial) -> None:
        self.scan = scan
        self.num_threads = num_threads
        self.serial = serial


def _build_kernels(numba) -> _Kernels:
    """Compile (or load from numba's cache) the float32 scan: each function of ``kernels`` is rebound there, where
    the functions that call it find it."""
    g = vars(kernels)
    # reassociation lets LLVM vectorise the float64 sums; only finite values reach them
    fm = {"reassoc", "contract", "nsz", "arcp", "nnan", "ninf"}
    g["_nb_block_moments"] = njit(numba, g["_nb_block_moments"], fastmath=fm)
    g["_nb_block_exact"] = njit(numba, g["_nb_block_exact"], inline="never")
    g["_nb_prefetch"] = prefetch_intrinsic(numba)
    for name in ("_nb_block_extrema", "_nb_block_keys", "_nb_block_count", "_nb_block_split", "_nb_block_above",
                 "_nb_above", "_nb_widen",
                 "_nb_bits16",
                 "_nb_key_total", "_nb_fold", "_nb_block_nonfinite", "_nb_merge_moments", "_nb_block_histogram",
                 "_nb_split_bins", "_nb_block_input", "_nb_put_row", "_nb_scan_range", "_nb_scan_serial"):
        g[name] = njit(numba, g[name])
    serial = g["_nb_scan_serial"]

    def scan(x, do_hist, kind=0, thr=None):
        """(histogram, integer row, float row, counts at or above ``thr``) of ``x``: kind 0, float32; 1: bf16
        and 2: fp16 bit patterns as uint16; ``thr``: read-only uint32 float32 patterns (edges' ``_CBITS``).
        In the calling thread (the GIL released), with this thread's scratch table."""
        xf, h16 = (readonly(x), _NO16) if kind == 0 else (_NO32, readonly(x))
        scratch = _scratch(1) if do_hist else _NO_SCRATCH
        try:
            return serial(xf, h16, kind, _KEY_BIN, _SPLIT, _CBITS, do_hist, 1, scratch, N_BINS,
                          _NO_THR if thr is None else thr)
        except BaseException:
            _SCRATCH.table = None  # perhaps left half-counted: the next call starts from a fresh one
            raise

    return _Kernels(scan, kernel_threads, serial)


def _warm_kernels(k: _Kernels) -> None:
    """Compile the scan's one signature (its inputs are always read-only views)."""
    k.scan(np.linspace(-3.0, 3.0, 4096, dtype=np.float32), True)


KERNELS: CompiledOnce[_Kernels] = CompiledOnce(_build_kernels, roots=lambda k: [(k.serial, 1)], warm=_warm_kernels)
_SCRATCH = threading.local()
_NO16, _NO32 = readonly(np.zeros(0, np.uint16)), readonly(np.zeros(0, np.float32))  # the unused input of a scan
_NO_SCRATCH = np.zeros((1, 0), np.int32)  # a scan without histogram counts nothing
_NO_THR = readonly(np.zeros(0, np.uint32))  # a scan that counts no thresholds


def _scratch(nparts: int) -> np.ndarray:
    """This thread's key counters, one row of 4 x 2^16 int32 per part; all zero between calls."""
    t = getattr(_SCRATCH, "table", None)
    if t is None or t.shape[0] < nparts:
        t = _SCRATCH.table = np.zeros((max(nparts, 1), _WAYS * _N_KEYS), np.int32)
    return t


# Below this many elements a second thread costs more than it saves, on a quiet machine too
# (``python bench/stats_throughput.py --crossover``: one thread against several by size, docs/benchmarks.md).
_PAR_MIN = 1 << 18
_PART_MIN = 1 << 17  # elements per part at least: a part's call and its fold cost some 20 us
_PARTS_PER_THREAD = 4  # parts are taken by whichever thread is free: a thread that waits for a core holds one
_MAX_SCAN = 1 << 30  # elements per scan: each int32 counter then stays below 2^31
# above _PAR_MIN, one thread or several by what each has cost lately (one estimate per histogram setting and
# input kind: their costs per element differ): the other threads take parts only when they have paid lately
_CHOICE = {(h, k): ParallelChoice() for h in (False, True) for k in (0, 1, 2)}


def _numba_chunk(acc: _Acc, xf: np.ndarray, histogram: bool, kind: int = 0) -> None:
    """Accumulate one contiguous chunk with the compiled kernel: float32, or (``kind`` 1: bf16, 2: fp16) the
    16-bit patterns as uint16, widened inside the scan.  A large chunk is scanned in parts (the same parts
    whatever the threads, so the same result), taken by the calling thread and helpers (``run_parts``)."""
    kern = KERNELS.get()
    for s in range(0, xf.size, _MAX_SCAN):
        part = xf[s:s + _MAX_SCAN]
        n = part.size
        threads = kern.num_threads() if n >= _PAR_MIN else 1
        if threads <= 1:
            _take_scan(acc, kern.scan(part, histogram, kind, acc.thr), histogram)
            continue
        nparts = max(2, min(threads * _PARTS_PER_THREAD, n // _PART_MIN))
        bounds = [(n * p) // nparts for p in range(nparts + 1)]
        choice = _CHOICE[histogram, kind]
        parallel = choice.pick()
        t0 = time.perf_counter()
        results = run_parts(lambda p: kern.scan(part[bounds[p]:bounds[p + 1]], histogram, kind, acc.thr), nparts,
                            threads if parallel else 1)
        choice.record(parallel, time.perf_counter() - t0, n)
        # the parts' rows in order, taken at once
        _take_scan(acc, (sum(r[0] for r in results), np.concatenate([r[1] for r in results]),
                         np.concatenate([r[2] for r in results]), sum(r[3] for r in results)), histogram)


def _take_scan(acc: _Acc, result, histogram: bool) -> None:
    hist, ri, rf, above = result
    if acc.above is not None:
        acc.above += above
    # per part: amax bits, (min |x| bits) - 1, min key, max key, n_finite, n_zero, n_nan, n_inf, n_-inf;
    # plain Python numbers from here (numpy's reductions cost more than the work on a few rows)
    rows, frows = ri.tolist(), rf.tolist()
    if len(rows) == 1:  # the usual case: one part, nothing to reduce over
        r = rows[0]
        acc.zero += r[5]
        acc.nan += r[6]
        acc.inf += r[7]
        acc.neginf += r[8]
        if r[4]:
            _take_finite(acc, r[0], r[1], r[2], r[3])
            acc.add_moments(r[4], *frows[0], 0)
    else:
        acc.zero += sum(r[5] for r in rows)
        acc.nan += sum(r[6] for r in rows)
        acc.inf += sum(r[7] for r in rows)
        acc.neginf += sum(r[8] for r in rows)
        fin = [(r, f) for r, f in zip(rows, frows) if r[4]]
        if fin:
            _take_finite(acc, max(r[0] for r, _ in fin), min(r[1] for r, _ in fin), min(r[2] for r, _ in fin),
                         max(r[3] for r, _ in fin))
            for r, f in fin:
                acc.add_moments(r[4], f[0], f[1], f[2], 0)
    if histogram:
        acc.hist += hist


_U4, _F4 = struct.Struct("<4I"), struct.Struct("<4f")


def _take_finite(acc: _Acc, amax: int, minabs_m1: int, kmin: int, kmax: int) -> None:
    """The extrema of a scan from its bit patterns: max |x|, (min nonzero |x|) - 1, and the min and max monotone
    keys ``b ^ ((b >> 31) & 0x7FFFFFFF)`` (their own inverse), converted in one pack and unpack."""
    vmin, vmax, absmax, minabs = _F4.unpack(_U4.pack((kmin ^ ((kmin >> 31) & 0x7FFFFFFF)) & 0xFFFFFFFF,
                                                     (kmax ^ ((kmax >> 31) & 0x7FFFFFFF)) & 0xFFFFFFFF,
                                                     amax, (minabs_m1 + 1) & 0xFFFFFFFF))
    acc.add_extrema(vmin, vmax, absmax, math.inf if minabs_m1 >= 0x7F7FFFFF else minabs)
