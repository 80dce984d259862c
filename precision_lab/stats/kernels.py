"""The two accumulators: a compiled numba scan of float32 bit patterns (CPU) and a torch kernel (any device),
and the chunking that feeds them."""

from __future__ import annotations

import functools
import math
import struct
import sys
import threading
import time
from dataclasses import fields, replace
from typing import Any, Iterator, NamedTuple, Optional

import numpy as np

from ..formats import FORMATS
from ..numba_loader import (SMALL_NUMPY, CompiledOnce, ParallelChoice, load_numba, njit, note_fallback, over_budget,
                            prefetch_intrinsic, readonly, run_parts)
from ..hostview import host_view
from .accumulate import _Acc, merge_stats
from .edges import HIST_EDGES, N_BINS, histogram_counts
from .records import TensorStats, canonical_dtype


# ---------------------------------------------------------------------------
# numba kernel (float32 bit patterns)
# ---------------------------------------------------------------------------
#
# Bin i of the histogram holds the magnitudes whose float32 bit pattern ``a`` has C[i] <= a < C[i+1], C[i]
# being the pattern of the smallest float32 >= HIST_EDGES[i].  The scan never looks a bin up: it counts
# every element under a 17-bit key, its 2^16-pattern range ``a >> 16`` and whether the low 16 bits are zero.
# That is all a power-of-two edge (a range's start) and a "just above a power of two" edge (start + 1: the
# round-to-zero thresholds, where a tie rounds to even) need, and the fold turns key counts into bins with one
# table.  The few ranges with another edge inside (fp16's max and overflow threshold, bf16's overflow ones...)
# are counted against their inner edges by a branch-free pass over the blocks that hold such values (a masked
# attention score holds float32's most negative value in every block), float32 subnormals by a search, and
# only in those blocks.  Each key has four counters used in turn, so a run of equal values does not wait on one
# counter; the counters live in a per-thread scratch table that is zero between calls (the fold clears what
# a call touched), so a small tensor pays for the keys it hit, not for the table.

_KEY_SHIFT = 15
_AHEAD = 1  # blocks between the one scanned and the one whose lines are asked for meanwhile
_PF_SUB = 256  # elements between a no-histogram scan's prefetch bursts
_LINE = 64  # bytes per cache line
_N_KEYS = 1 << 16
_WAYS = 4
_SUB_END = 1 << 23  # patterns below this (nonzero) are float32 subnormals
_NONFINITE = 0x7F800000
_MAX_INNER = 5  # edges inside one split range (bf16 has five near float32's max)
_NO_AHEAD = np.zeros(0, np.uint8)  # no lines to ask for


def _ceil_f32_bits(v: float) -> int:
    if v > float(np.finfo(np.float32).max):
        return 0x7F800000
    f = np.float32(v)
    if float(f) < v:
        f = np.nextafter(f, np.float32(np.inf))
    return int(np.array(f, dtype=np.float32).view(np.uint32))


def _build_tables():
    """(bin of each key or -1, the split ranges, C): -1 marks zero, subnormals, Inf/NaN and split ranges."""
    cbits = np.array([_ceil_f32_bits(v) for v in HIST_EDGES], dtype=np.int64)
    ranges = np.arange(_SUB_END >> 16, _NONFINITE >> 16, dtype=np.int64)
    start = ranges << 16

    def bin_of(a):
        return np.searchsorted(cbits, a, side="right") - 1

    at_start, after, at_end = bin_of(start), bin_of(start + 1), bin_of(start + 0xFFFF)
    split = at_end != after  # an edge inside the range other than start + 1
    key_bin = np.full(_N_KEYS, -1, dtype=np.int16)
    ok = ranges[~split]
    key_bin[(ok << 1) | 1] = at_start[~split]  # low 16 bits zero: the range's first pattern only
    key_bin[ok << 1] = after[~split]
    # one row per split range: the range, the bin just below it, how many edges lie inside it, those edges
    rows = []
    for r in ranges[split]:
        inner = cbits[(cbits >> 16) == r]
        rows.append([r, bin_of(r << 16) - np.count_nonzero(inner == r << 16), inner.size, *inner])
    assert all(x[2] <= _MAX_INNER for x in rows), "a split range with more inner edges than _nb_block_split takes"
    table = np.full((len(rows), 3 + _MAX_INNER), 0xFFFFFFFF, dtype=np.int64)
    for i, x in enumerate(rows):
        table[i, :len(x)] = x
    return key_bin, table.astype(np.uint32), cbits.astype(np.uint32)


_KEY_BIN, _SPLIT, _CBITS = _build_tables()


def numba_available() -> bool:
    """Whether the compiled CPU kernel can be used (numba importable and not disabled); compiles nothing."""
    return load_numba() is not None


class _Kernels:
    def __init__(self, scan, num_threads, serial) -> None:
        self.scan = scan
        self.num_threads = num_threads
        self.serial = serial


# The kernels are plain module-level functions (so numba's on-disk cache works)
# that _build_kernels() compiles and rebinds on first use; numba is imported
# only then.


# Per-block helpers loop over a block *slice* from 0: LLVM vectorises and interleaves those loops, not the
# same loops over range(lo, hi).  numba widens int32 arithmetic to int64; the explicit casts keep the
# vector lanes 32 bits wide (twice the elements per instruction).

def _nb_block_extrema(sb, ahead):
    """Max |bits|, min (|bits| - 1) over nonzero, min/max order keys, zero count; and every cache line of
    ``ahead`` (the bytes of a later block, or nothing) asked for on the way, a few after each sub-block."""
    m = np.int32(0x7FFFFFFF)
    one = np.int32(1)
    bam = np.int32(0)
    bmin1 = m
    bkmin = m
    bkmax = np.int32(-0x80000000)
    bz = np.int32(0)
    na = ahead.size
    per_sub = (na + _LINE - 1) // _LINE * _PF_SUB // max(sb.size, 1) + 1  # lines asked for after each sub-block
    line = 0
    for c0 in range(0, sb.size, _PF_SUB):
        sub = sb[c0:c0 + _PF_SUB]
        for i in range(sub.size):
            w = sub[i]
            a = np.int32(w & m)
            bam = np.int32(max(bam, a))
            bmin1 = np.int32(min(bmin1, np.int32(np.int32(a - one) & m)))  # a == 0 wraps to the top
            # monotone int32 key of the float: order of keys == order of values
            k = np.int32(w ^ np.int32(np.int32(w >> np.int32(31)) & m))
            bkmin = np.int32(min(bkmin, k))
            bkmax = np.int32(max(bkmax, k))
            bz = np.int32(bz + np.int32(a == np.int32(0)))
        for _ in range(per_sub):
            if line < na:
                _nb_prefetch(ahead, line)
            line += _LINE
    while line < na:
        _nb_prefetch(ahead, line)
        line += _LINE
    return bam, bmin1, bkmin, bkmax, bz


def _nb_block_keys(sb, keys):
    """Each element's histogram counter: its key * 4 + a way that cycles with the position."""
    m = np.int32(0x7FFFFFFF)
    for i in range(sb.size):
        a = np.int32(sb[i] & m)
        key = np.int32(np.int32(np.int32(a >> np.int32(_KEY_SHIFT)) & np.int32(0xFFFE))
                       | np.int32(np.int32(a & np.int32(0xFFFF)) == np.int32(0)))
        keys[i] = np.uint32(np.int32(key << np.int32(2)) | np.int32(i & 3))


def _nb_block_moments(xb, shift):
    s1 = 0.0
    s2 = 0.0
    q = 0.0
    for i in range(xb.size):
        x = np.float64(xb[i])
        d = x - shift
        s1 += d
        s2 += d * d
        q += x * x
    return s1, s2, q


def _nb_block_count(keys, m, h, ahead):
    """Count ``keys[:m]`` into ``h``; and every cache line of ``ahead`` (the bytes of the next block) asked for
    on the way, one per 16 counts: the next block arrives while this one is counted, and no load waits for
    it.  (A read of each line at once, or all prefetches in one burst, held the counting up: 40 ms against
    26 ms for 64M float32 on one thread.)"""
    na = ahead.size
    for j in range(m):
        h[keys[j]] += 1
        if (j & 15) == 0:
            off = (j >> 4) * _LINE
            if off < na:
                _nb_prefetch(ahead, off)
    for off in range(((m + 15) >> 4) * _LINE, na, _LINE):
        _nb_prefetch(ahead, off)


def _nb_block_exact(ub, r_lo, r_hi, cbits, hrow):
    """Bin exactly, by search, the elements whose range ``a >> 16`` lies in [r_lo, r_hi]."""
    n = 0
    for j in range(ub.size):
        a = ub[j] & np.uint32(0x7FFFFFFF)
        r = a >> np.uint32(16)
        if a != 0 and r >= r_lo and r <= r_hi:
            lo = 0
            hi = cbits.size
            while lo < hi:  # the last edge <= a
                mid = (lo + hi) >> 1
                if cbits[mid] <= a:
                    lo = mid + 1
                else:
                    hi = mid
            hrow[lo - 1] += 1
            n += 1
    return n


def _nb_block_split(ub, row, counts):
    """Count the elements of one split range (``row``: the range, the bin below it, the number of edges inside
    it, up to five edges, padded with 0xFFFFFFFF): ``counts[0]`` those in the range, ``counts[1 + i]`` those
    at or above inner edge i.  One branch-free pass of reductions: it vectorises, a search per element does not."""
    m = np.uint32(0x7FFFFFFF)
    r = row[0]
    e0, e1, e2, e3, e4 = row[3], row[4], row[5], row[6], row[7]
    n = np.int32(0)
    c0 = np.int32(0)
    c1 = np.int32(0)
    c2 = np.int32(0)
    c3 = np.int32(0)
    c4 = np.int32(0)
    for j in range(ub.size):
        a = ub[j] & m
        inr = ((a >> np.uint32(16)) == r)
        n += np.int32(inr)
        c0 += np.int32(inr & (a >= e0))
        c1 += np.int32(inr & (a >= e1))
        c2 += np.int32(inr & (a >= e2))
        c3 += np.int32(inr & (a >= e3))
        c4 += np.int32(inr & (a >= e4))
    counts[0] += n
    counts[1] += c0
    counts[2] += c1
    counts[3] += c2
    counts[4] += c3
    counts[5] += c4


def _nb_block_above(ub, t, finite_only):
    """How many elements of the block have ``t <= |bits|`` (and, unless the block is known finite, are finite):
    one vectorised pass of compares."""
    m = np.uint32(0x7FFFFFFF)
    inf = np.uint32(_NONFINITE)
    c = np.int32(0)
    if finite_only:
        for j in range(ub.size):
            c += np.int32((ub[j] & m) >= t)
    else:
        for j in range(ub.size):
            a = ub[j] & m
            c += np.int32((a >= t) & (a < inf))
    return c


def _nb_above(ub, thr, nzf, amin, amax, finite_only, out):
    """``out[k] +=`` the block's finite elements with ``thr[k] <= |bits|``; ``nzf`` of them are nonzero, with
    |bits| from ``amin`` to ``amax``: a threshold outside that range needs no pass."""
    for k in range(thr.size):
        t = thr[k]
        if t > amax:
            continue
        if t <= amin and t > 0:
            out[k] += nzf
        else:
            out[k] += _nb_block_above(ub, t, finite_only)


_F16_MAGIC = np.float32(2.0 ** -14)  # fp16 subnormals: (2^-14 + m * 2^-24) - 2^-14, exact in float32


def _nb_widen(src, kind, out_i, out_f):
    """16-bit floats (kind 1: bf16, 2: fp16) into float32 in ``out`` (an int32 and a float32 view of one
    L1-sized buffer), exactly; two vectorised passes, no float16 arithmetic (numba has none)."""
    m = src.size
    if kind == 1:
        for i in range(m):
            out_i[i] = np.int32(np.int32(src[i]) << np.int32(16))
        return
    inf_exp = np.int32(0x7C00 << 13)
    for i in range(m):
        o = np.int32(np.int32(np.int32(src[i]) & np.int32(0x7FFF)) << np.int32(13))
        e = np.int32(o & inf_exp)
        o = np.int32(o + np.int32(112 << 23))
        o = np.int32(o + (np.int32(112 << 23) if e == inf_exp else np.int32(0)))  # Inf/NaN: exponent 255
        o = np.int32(o + (np.int32(1 << 23) if e == np.int32(0) else np.int32(0)))  # subnormal: renormalised below
        out_i[i] = o
    for i in range(m):  # the sign of normals, Inf and NaN by integer: no float arithmetic touches a NaN
        h = np.int32(src[i])
        if np.int32(h & np.int32(0x7C00)) != np.int32(0):
            out_i[i] = np.int32(out_i[i] | np.int32(np.int32(h & np.int32(0x8000)) << np.int32(16)))
    for i in range(m):  # subnormals and zeros: renormalised in float32 (exact), then signed
        h = np.int32(src[i])
        if np.int32(h & np.int32(0x7C00)) == np.int32(0):
            x = out_f[i] - _F16_MAGIC
            out_f[i] = -x if np.int32(h & np.int32(0x8000)) != np.int32(0) else x


def _nb_bits16(h, kind):
    """The float32 bit pattern of one 16-bit float (kind 1: bf16, 2: fp16), as an int32."""
    h = np.int32(h) & np.int32(0xFFFF)
    if kind == 1:
        return np.int32(h << 16)
    sign = np.int32(np.int32(h & 0x8000) << 16)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        return np.int32(sign | 0x7F800000 | (m << 13))
    if e != 0:
        return np.int32(sign | ((e + 112) << 23) | (m << 13))
    if m == 0:
        return sign
    p = 9
    while (m >> p) == 0:
        p -= 1
    return np.int32(sign | ((p + 103) << 23) | ((m << (23 - p)) & 0x7FFFFF))


def _nb_key_total(h, key):
    b = key * 4
    return h[b] + h[b + 1] + h[b + 2] + h[b + 3]


def _nb_fold(u, h16, kind, lo, hi, h, key_bin, hrow, amax, aminm1, nonfinite):
    """Key counts into bins; every counter the scan touched is zero again afterwards.  (Written out in one
    function: a call per key that passes arrays costs two atomic reference counts, more than the work.)"""
    k_lo = ((aminm1 + 1) >> _KEY_SHIFT) & 0xFFFE if aminm1 < 0x7FFFFFFF else 0
    k_hi = (amax >> _KEY_SHIFT) | 1
    by_elements = nonfinite > 0 or (k_hi - k_lo) > (hi - lo)  # fewer elements than keys in their span
    n = hi - lo if by_elements else k_hi - k_lo + 2
    cleared = 0
    for j in range(n):
        if by_elements:
            bits = u[lo + j] if kind == 0 else np.uint32(_nb_bits16(h16[lo + j], kind))
            a = bits & np.uint32(0x7FFFFFFF)
            key = np.int64(((a >> np.uint32(_KEY_SHIFT)) & np.uint32(0xFFFE)) | np.uint32((a & np.uint32(0xFFFF)) == 0))
        else:
            key = np.int64(k_lo + j if j <= k_hi - k_lo else 1)  # the span, then the zeros' key
        b = key * 4
        c = h[b] + h[b + 1] + h[b + 2] + h[b + 3]
        if c:
            kb = key_bin[key]
            if kb >= 0:
                hrow[kb] += c
            cleared += c
            h[b] = 0
            h[b + 1] = 0
            h[b + 2] = 0
            h[b + 3] = 0
    if cleared != hi - lo:  # the values changed under the scan (memory written meanwhile): start clean
        h[:] = 0


def _nb_scan_range(xf, s, h16, kind, lo, hi, key_bin, split, cbits, do_hist, h, hrow, ri, rf, row, thr, above):
    """Elements [lo, hi) of ``xf`` (float32; ``s`` its int32 view) or, kind 1/2, of ``h16`` (bf16/fp16 bits,
    widened block by block into an L1-sized buffer: no float32 copy of the tensor).  ``above[k]``: the finite
    elements with ``thr[k] <= |bits|`` (float32 patterns of histogram edges), counted without the histogram."""
    blk = 4096
    u = s.view(np.uint32)
    keys = np.empty(blk, np.uint32)
    wide = np.empty(blk if kind != 0 else 0, np.float32)
    wide_i = wide.view(np.int32)
    done = np.zeros(split.shape[0], np.int64)  # elements of each split range counted by the fix-up so far
    split_counts = np.zeros((split.shape[0], split.shape[1] - 2), np.int64)
    amax = np.int32(0)
    aminm1 = np.int32(0x7FFFFFFF)
    kmin = np.int32(0x7FFFFFFF)
    kmax = np.int32(-0x80000000)
    nzero = 0
    nnan = 0
    ninf = 0
    nneg = 0
    nf = 0
    mean = 0.0
    m2 = 0.0
    ssq = 0.0
    for b0 in range(lo, hi, blk):
        b1 = min(b0 + blk, hi)
        a0, a1 = min(b0 + _AHEAD * blk, hi), min(b0 + (_AHEAD + 1) * blk, hi)
        if kind == 0:
            ahead = s[a0:a1].view(np.uint8)
            sb = s[b0:b1]
            xb = xf[b0:b1]
        else:
            ahead = h16[a0:a1].view(np.uint8)
            _nb_widen(h16[b0:b1], kind, wide_i, wide)
            sb = wide_i[:b1 - b0]
            xb = wide[:b1 - b0]
        # the next block's lines are asked for by the longest pass: the counting, else the extrema
        bam, bmin1, bkmin, bkmax, bz = _nb_block_extrema(sb, _NO_AHEAD if do_hist else ahead)
        nzero += bz
        if thr.size:
            # finite blocks: every element counted is finite, and the extrema bound which thresholds need a pass
            fin = bam < np.int32(0x7F800000)
            _nb_above(sb.view(np.uint32), thr, np.int64(b1 - b0 - bz), np.uint32(bmin1 + 1) if fin else np.uint32(0),
                      np.uint32(bam) if fin else np.uint32(_NONFINITE - 1), fin, above)
        if bam < np.int32(0x7F800000):
            # all finite: vectorised float64 moments, shifted by the block's first value
            amax = max(amax, bam)
            aminm1 = min(aminm1, bmin1)
            kmin = min(kmin, bkmin)
            kmax = max(kmax, bkmax)
            shift = np.float64(xb[0])
            s1, s2, q = _nb_block_moments(xb, shift)
            nb = b1 - b0
        else:
            s1 = 0.0
            s2 = 0.0
            q = 0.0
            nb = 0
            shift = 0.0
            for i in range(b1 - b0):
                w = sb[i]
                a = w & np.int32(0x7FFFFFFF)
                if a >= np.int32(0x7F800000):
                    if a == np.int32(0x7F800000):
                        ninf += 1
                        nneg += np.int32(w < 0)
                    else:
                        nnan += 1
                    continue
                amax = max(amax, a)
                m1 = a - np.int32(1)
                if m1 >= 0 and m1 < aminm1:
                    aminm1 = m1
                k = w ^ ((w >> np.int32(31)) & np.int32(0x7FFFFFFF))
                kmin = min(kmin, k)
                kmax = max(kmax, k)
                x = np.float64(xb[i])
                if nb == 0:
                    shift = x
                d = x - shift
                s1 += d
                s2 += d * d
                q += x * x
                nb += 1
        if nb > 0:
            bmean = shift + s1 / nb
            bm2 = s2 - s1 * (s1 / nb)
            if bm2 < 0.0:
                bm2 = 0.0
            if nf == 0:
                mean = bmean
                m2 = bm2
            else:
                tot = nf + nb
                delta = bmean - mean
                mean += delta * (nb / tot)
                m2 += bm2 + delta * delta * (nf * (nb / tot))
            nf += nb
            ssq += q
        if do_hist:
            _nb_block_keys(sb, keys)
            _nb_block_count(keys, b1 - b0, h, ahead)
            if bmin1 < np.int32(_SUB_END - 1):  # a float32 subnormal in this block
                _nb_block_exact(sb.view(np.uint32), 0, (_SUB_END >> 16) - 1, cbits, hrow)
            r_lo = (bmin1 + 1) >> 16
            r_hi = bam >> 16
            for t in range(split.shape[0]):
                r = np.int64(split[t, 0])
                if r >= r_lo and r <= r_hi:
                    c = _nb_key_total(h, r << 1) + _nb_key_total(h, (r << 1) | 1)
                    if c != done[t]:
                        _nb_block_split(sb.view(np.uint32), split[t], split_counts[t])
                        done[t] = c
    if do_hist:
        for t in range(split.shape[0]):  # counts at or above each inner edge -> bins
            below = np.int64(split[t, 1])
            k = np.int64(split[t, 2])
            for i in range(k + 1):
                nxt = split_counts[t, i + 1] if i < k else 0
                hrow[below + i] += split_counts[t, i] - nxt
    if do_hist and hi > lo:
        _nb_fold(u, h16, kind, lo, hi, h, key_bin, hrow, amax, aminm1, nnan + ninf)
    ri[row, 0] = amax
    ri[row, 1] = aminm1
    ri[row, 2] = kmin
    ri[row, 3] = kmax
    ri[row, 4] = nf
    ri[row, 5] = nzero
    ri[row, 6] = nnan
    ri[row, 7] = ninf
    ri[row, 8] = nneg
    rf[row, 0] = mean
    rf[row, 1] = m2
    rf[row, 2] = ssq


def _nb_scan_serial(xf, h16, kind, key_bin, split, cbits, do_hist, nparts, scratch, nbins, thr):
    """``nparts`` equal parts of the input one after another, each with its own row of results."""
    s = xf.view(np.int32)
    n = s.size if kind == 0 else h16.size
    hs = np.zeros((nparts, nbins), np.int64)
    ri = np.zeros((nparts, 9), np.int64)
    rf = np.zeros((nparts, 3), np.float64)
    ra = np.zeros((nparts, thr.size), np.int64)
    for p in range(nparts):
        _nb_scan_range(xf, s, h16, kind, (n * p) // nparts, (n * (p + 1)) // nparts, key_bin, split, cbits,
                       do_hist, scratch[p], hs[p], ri, rf, p, thr, ra[p])
    return hs.sum(axis=0), ri, rf, ra.sum(axis=0)


def _build_kernels(numba) -> _Kernels:
    """Compile (or load from numba's cache) the float32 scan."""
    g = globals()
    # reassociation lets LLVM vectorise the float64 sums; only finite values reach them
    fm = {"reassoc", "contract", "nsz", "arcp", "nnan", "ninf"}
    g["_nb_block_moments"] = njit(numba, _nb_block_moments, fastmath=fm)
    g["_nb_block_exact"] = njit(numba, _nb_block_exact, inline="never")
    g["_nb_prefetch"] = prefetch_intrinsic(numba)
    for name in ("_nb_block_extrema", "_nb_block_keys", "_nb_block_count", "_nb_block_split", "_nb_block_above",
                 "_nb_above", "_nb_widen",
                 "_nb_bits16",
                 "_nb_key_total", "_nb_fold", "_nb_scan_range", "_nb_scan_serial"):
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

    return _Kernels(scan, numba.get_num_threads, serial)


def _warm_kernels(k: _Kernels) -> None:
    """Compile the scan's one signature (its inputs are always read-only views)."""
    k.scan(np.linspace(-3.0, 3.0, 4096, dtype=np.float32), True)


KERNELS: CompiledOnce[_Kernels] = CompiledOnce(_build_kernels, roots=lambda k: [(k.serial, 1)], warm=_warm_kernels)
_SCRATCH = threading.local()
_NO16, _NO32 = readonly(np.zeros(0, np.uint16)), readonly(np.zeros(0, np.float32))  # the unused input of a scan
_NO_SCRATCH = np.zeros((1, 0), np.int32)  # a scan without histogram counts nothing
_NO_THR = readonly(np.zeros(0, np.uint32))  # a scan that counts no thresholds
_SCAN_KIND = {"bfloat16": 1, "float16": 2}  # 16-bit floats the scan widens itself (float32 is kind 0)


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
DEFAULT_CHUNK = 1 << 24  # elements converted or held at a time by default (tensor_stats' chunk_elems)
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


# ---------------------------------------------------------------------------
# pure-torch kernel (any device; float64)
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# partial results on a device, finished on the host (the capture engine batches the transfer)
# ---------------------------------------------------------------------------

class DevicePartial(NamedTuple):
    """One chunk's totals as torch tensors on one device (the tensor's own, or the host once copied):
    ``totals``, 13 float64 values; ``hist``, N_BINS int64 counts or None.  Partials of many tensors can be
    stacked and copied together, then rebuilt with ``DevicePartial(totals_row, hist_row)``."""

    totals: Any
    hist: Any


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


# ---------------------------------------------------------------------------
# input normalisation and chunking
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------

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
    t0 = time.thread_time()
    out = _tensor_stats(x, histogram, chunk_elems, use_numba, backend)
    if backend == "auto" and not use_numba:
        note_fallback(time.thread_time() - t0)  # counted against numba_loader.FALLBACK_BUDGET_S
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
    elif cpu and use_numba and dtype.startswith(("int", "uint")):
        # int32/int64 (token ids, indices): chunks within +/-2^24 are exact in float32
        parts = []
        for c in _iter_torch_chunks(t, min(chunk, 1 << 22)):
            lo, hi = torch.aminmax(c)
            if max(abs(int(lo)), abs(int(hi))) <= _F32_EXACT_INT:
                _numba_chunk(acc, host_view(c.to(torch.float32)), histogram)
            else:
                parts.append(_torch_chunk_partial(torch, c, histogram))
        _torch_finish(torch, acc, parts)
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
