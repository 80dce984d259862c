"""The numba scan of float32 bit patterns (CPU): its tables and its block passes, compiled by ``scan``.

Every compiled function lives in this one file: numba's on-disk cache checks the source file of the function it
compiled, not the files of the functions compiled into it, so a kernel split over files could load stale code."""

from __future__ import annotations

import numpy as np

from ..numba_loader import load_numba
from .edges import HIST_EDGES


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


# The kernels are plain module-level functions (so numba's on-disk cache works)
# that scan._build_kernels() compiles and rebinds here on first use; numba is
# imported only then.


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


def _nb_block_nonfinite(sb, xb):
    """A block that holds Inf or NaN, element by element: the extrema of its finite values as the scan keeps
    them, its Inf, -Inf and NaN counts, and the sums of its finite values shifted by the first one."""
    amax = np.int32(0)
    aminm1 = np.int32(0x7FFFFFFF)
    kmin = np.int32(0x7FFFFFFF)
    kmax = np.int32(-0x80000000)
    nnan = 0
    ninf = 0
    nneg = 0
    s1 = 0.0
    s2 = 0.0
    q = 0.0
    nb = 0
    shift = 0.0
    for i in range(sb.size):
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
    return amax, aminm1, kmin, kmax, nnan, ninf, nneg, s1, s2, q, nb, shift


def _nb_merge_moments(nf, mean, m2, nb, shift, s1, s2):
    """The mean and M2 of ``nf`` values merged with a block's ``nb`` (their sums shifted by ``shift``)."""
    bmean = shift + s1 / nb
    bm2 = s2 - s1 * (s1 / nb)
    if bm2 < 0.0:
        bm2 = 0.0
    if nf == 0:
        return bmean, bm2
    tot = nf + nb
    delta = bmean - mean
    mean += delta * (nb / tot)
    m2 += bm2 + delta * delta * (nf * (nb / tot))
    return mean, m2


def _nb_block_histogram(sb, keys, h, ahead, bam, bmin1, cbits, hrow, split, done, split_counts):
    """Count one block's keys (asking for ``ahead``'s lines meanwhile); bin its float32 subnormals exactly, and
    count the elements of each split range that it holds against that range's inner edges."""
    _nb_block_keys(sb, keys)
    _nb_block_count(keys, sb.size, h, ahead)
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


def _nb_split_bins(split, split_counts, hrow):
    """Each split range's counts at or above its inner edges, into bins."""
    for t in range(split.shape[0]):
        below = np.int64(split[t, 1])
        k = np.int64(split[t, 2])
        for i in range(k + 1):
            nxt = split_counts[t, i + 1] if i < k else 0
            hrow[below + i] += split_counts[t, i] - nxt


def _nb_block_input(xf, s, h16, kind, b0, b1, a0, a1, wide_i, wide):
    """The bytes of block [a0, a1) to ask for meanwhile, and block [b0, b1) as int32 patterns and as float32:
    views of the float32 input, or (kind 1/2) its 16-bit floats widened into ``wide`` (``wide_i`` its int32 view)."""
    if kind == 0:
        return s[a0:a1].view(np.uint8), s[b0:b1], xf[b0:b1]
    _nb_widen(h16[b0:b1], kind, wide_i, wide)
    return h16[a0:a1].view(np.uint8), wide_i[:b1 - b0], wide[:b1 - b0]


def _nb_put_row(ri, rf, amax, aminm1, kmin, kmax, nf, nzero, nnan, ninf, nneg, mean, m2, ssq):
    """One part's results: its integer row (extrema bits and counts) and its float row (mean, M2, sum of squares)."""
    ri[0] = amax
    ri[1] = aminm1
    ri[2] = kmin
    ri[3] = kmax
    ri[4] = nf
    ri[5] = nzero
    ri[6] = nnan
    ri[7] = ninf
    ri[8] = nneg
    rf[0] = mean
    rf[1] = m2
    rf[2] = ssq


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
    nzero = nnan = ninf = nneg = nf = 0
    mean = m2 = ssq = 0.0
    for b0 in range(lo, hi, blk):
        b1 = min(b0 + blk, hi)
        a0, a1 = min(b0 + _AHEAD * blk, hi), min(b0 + (_AHEAD + 1) * blk, hi)
        ahead, sb, xb = _nb_block_input(xf, s, h16, kind, b0, b1, a0, a1, wide_i, wide)
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
            fam, fmin1, fkmin, fkmax = bam, bmin1, bkmin, bkmax
            shift = np.float64(xb[0])
            s1, s2, q = _nb_block_moments(xb, shift)
            nb = b1 - b0
        else:
            fam, fmin1, fkmin, fkmax, bnan, binf, bneg, s1, s2, q, nb, shift = _nb_block_nonfinite(sb, xb)
            nnan += bnan
            ninf += binf
            nneg += bneg
        amax = max(amax, fam)
        aminm1 = min(aminm1, fmin1)
        kmin = min(kmin, fkmin)
        kmax = max(kmax, fkmax)
        if nb > 0:
            mean, m2 = _nb_merge_moments(nf, mean, m2, nb, shift, s1, s2)
            nf += nb
            ssq += q
        if do_hist:
            _nb_block_histogram(sb, keys, h, ahead, bam, bmin1, cbits, hrow, split, done, split_counts)
    if do_hist:
        _nb_split_bins(split, split_counts, hrow)
    if do_hist and hi > lo:
        _nb_fold(u, h16, kind, lo, hi, h, key_bin, hrow, amax, aminm1, nnan + ninf)
    _nb_put_row(ri[row], rf[row], amax, aminm1, kmin, kmax, nf, nzero, nnan, ninf, nneg, mean, m2, ssq)


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
