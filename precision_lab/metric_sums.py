"""The sums one pass over a reference and a candidate gathers, from which ``metrics`` computes every metric: a
compiled numba kernel for CPU arrays (in parts, on several threads when that pays), a torch path for any device
(its sums left there until asked for) and its float64 numpy mirror, which never imports torch."""

from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np

from .hostview import host_view
from .numba_loader import CompiledOnce, ParallelChoice, kernel_threads, njit, readonly, run_parts

# One pass gathers these sums; metrics._finish() turns them into the metrics.  Two
# accumulators exist (compiled numba for CPU arrays, torch for other devices
# or when numba is unavailable); tests check they agree.
_SUMS = ("count", "nf_intro", "nf_ref", "s_rr", "s_cc", "s_rd", "s_dd", "s_ad", "max_ad", "max_rel", "max_ulp",
         "masked")


def _new_acc() -> dict:
    return dict.fromkeys(_SUMS, 0.0)


def _merge_acc(acc: dict, part) -> None:
    for k, v in zip(_SUMS, part):
        if k.startswith("max_"):
            acc[k] = max(acc[k], float(v))
        else:
            acc[k] += float(v)


def _nb_compare_range(r, c, rb, shift, mask, ulp_tbl, lo, hi, rel_floor, ref_mask, cand_mask, out, p):
    count = 0
    masked = 0
    nf_intro = 0
    nf_ref = 0
    s_rr = 0.0
    s_cc = 0.0
    s_rd = 0.0
    s_dd = 0.0
    s_ad = 0.0
    max_ad = 0.0
    max_rel = 0.0
    max_ulp = 0.0
    for i in range(lo, hi):
        a = np.float64(r[i])
        b = np.float64(c[i])
        if not np.isfinite(a):
            nf_ref += 1
            continue
        if a <= ref_mask and b <= cand_mask:  # masked in both runs (b may be -inf)
            masked += 1
            continue
        if not np.isfinite(b):
            nf_intro += 1
            continue
        count += 1
        d = b - a
        ad = abs(d)
        s_rr += a * a
        s_cc += b * b
        s_rd += a * d
        s_dd += d * d
        s_ad += ad
        if ad > max_ad:
            max_ad = ad
        aa = abs(a)
        q = ad / (aa if aa > rel_floor else rel_floor)
        if q > max_rel:
            max_rel = q
        # the format's spacing at |a|, looked up by a's exponent field
        u = ad / ulp_tbl[(rb[i] >> shift) & mask]
        if u > max_ulp:
            max_ulp = u
    out[p, 0] = count
    out[p, 1] = nf_intro
    out[p, 2] = nf_ref
    out[p, 3] = s_rr
    out[p, 4] = s_cc
    out[p, 5] = s_rd
    out[p, 6] = s_dd
    out[p, 7] = s_ad
    out[p, 8] = max_ad
    out[p, 9] = max_rel
    out[p, 10] = max_ulp
    out[p, 11] = masked


def _nb_compare_serial(r, c, rb, shift, mask, ulp_tbl, rel_floor, ref_mask, cand_mask, nparts):
    """``nparts`` equal parts of the inputs one after another, each with its own row of sums."""
    out = np.zeros((nparts, 12), np.float64)
    n = r.size
    for p in range(nparts):
        _nb_compare_range(r, c, rb, shift, mask, ulp_tbl, (n * p) // nparts, (n * (p + 1)) // nparts, rel_floor,
                          ref_mask, cand_mask, out, p)
    return out


def _ulp_table(dtype, emin: int, man_bits: int):
    """ulp of the format for each exponent field of ``dtype`` (float32 or float64) values."""
    fi = np.finfo(dtype)
    nfield = 2 ** (fi.bits - fi.nmant - 1)
    bias = nfield // 2 - 1
    e = np.maximum(np.arange(nfield) - bias, emin)  # field 0 (zero/subnormal) -> the format's emin
    if man_bits == 0 and emin == 0:  # int grid: spacing 1 everywhere
        return np.ones(nfield), fi.nmant, nfield - 1
    return np.ldexp(1.0, e - man_bits), fi.nmant, nfield - 1


_PAR_MIN = 1 << 16  # elements per part at least (a part's call costs some 10 us)
_PARTS_PER_THREAD = 4  # parts are taken by whichever thread is free: a thread that waits for a core holds one
# serial or parallel by what each has cost lately, per input dtype: a float64 element costs about twice a float32
# one, so one estimate for both would compare a path's float32 calls with the other's float64 calls
_CHOICE = {4: ParallelChoice(), 8: ParallelChoice()}  # by the inputs' itemsize: float32, float64


def _build_kernel(numba):
    """Compile (or load from numba's cache) the one-pass comparison."""
    g = globals()
    g["_nb_compare_range"] = njit(numba, _nb_compare_range)
    serial = njit(numba, _nb_compare_serial)

    def run(r, c, rel_floor, emin, man_bits, ref_mask, cand_mask):
        if r.dtype != c.dtype:  # float32 against float64: both exactly in float64 (two signatures in all)
            r, c = r.astype(np.float64), c.astype(np.float64)
        r, c = readonly(r), readonly(c)
        threads = kernel_threads()
        nparts = max(1, min(threads * _PARTS_PER_THREAD, r.size // _PAR_MIN))
        tbl, shift, mask = _ulp_table(r.dtype, emin, man_bits)
        rb = r.view(np.int32 if r.dtype == np.float32 else np.int64)
        if nparts == 1 or threads <= 1:
            return serial(r, c, rb, shift, mask, tbl, rel_floor, ref_mask, cand_mask, nparts)
        choice = _CHOICE[r.dtype.itemsize]
        parallel = choice.pick()  # one thread when the others have not paid lately (numba_loader.ParallelChoice)
        b = [(r.size * p) // nparts for p in range(nparts + 1)]
        t0 = time.perf_counter()
        # the same parts whoever takes them (numba_loader.run_parts): the same result
        rows = run_parts(lambda p: serial(r[b[p]:b[p + 1]], c[b[p]:b[p + 1]], rb[b[p]:b[p + 1]], shift, mask, tbl,
                                          rel_floor, ref_mask, cand_mask, 1), nparts, threads if parallel else 1)
        choice.record(parallel, time.perf_counter() - t0, r.size)
        return np.concatenate(rows)

    run.dispatchers = (serial,)
    return run


def _warm_kernel(run) -> None:
    """Compile the comparison's two signatures (float32 and float64 inputs)."""
    (serial,) = run.dispatchers
    for dt in (np.float32, np.float64):
        x = readonly(np.linspace(-2.0, 2.0, 256, dtype=dt))
        tbl, shift, mask = _ulp_table(x.dtype, -14, 10)
        rb = x.view(np.int32 if dt == np.float32 else np.int64)
        serial(x, x, rb, shift, mask, tbl, 1e-6, -math.inf, -math.inf, 2)


KERNEL = CompiledOnce(_build_kernel, roots=lambda run: [(d, 2) for d in run.dispatchers], warm=_warm_kernel)


def _numba_kernel(wait: bool = False):
    """The compiled one-pass comparison, None without numba; without ``wait``, None also while it is not
    compiled or cached yet (``numba_loader``)."""
    return KERNEL.get() if wait else KERNEL.ready()


def _np_flat(x) -> Optional[np.ndarray]:
    """A flat float32/float64 numpy view of a CPU input, or None (use torch)."""
    if isinstance(x, np.ndarray):
        a = x
    else:
        if x.device.type != "cpu" or x.is_sparse:
            return None
        import torch

        t = x.detach()
        if t.dtype not in (torch.float32, torch.float64):
            t = t.to(torch.float32) if t.dtype != torch.complex64 else t
        a = host_view(t.reshape(-1))
    if a.dtype.kind == "c":
        raise ValueError(f"cannot compare complex tensors (dtype {a.dtype})")
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float64 if a.dtype.itemsize > 4 else np.float32)
    return np.ascontiguousarray(a.reshape(-1))


def _torch_chunks(x, chunk: int):
    import torch

    if isinstance(x, np.ndarray):
        flat = x.reshape(-1)
        for i in range(0, flat.size, chunk):
            yield torch.from_numpy(np.asarray(flat[i : i + chunk]).astype(np.float64))
    else:
        flat = x.detach().reshape(-1)
        for i in range(0, flat.numel(), chunk):
            yield flat[i : i + chunk].to(torch.float64)


def _torch_rows(reference, candidate, rel_floor, emin, man_bits, chunk, ref_mask=-math.inf, cand_mask=-math.inf):
    """The sums of ``_SUMS`` on the tensors' own device, one row per chunk (None for no elements): no
    ``int()``/``float()`` of a device scalar and no boolean-mask indexing (each a host sync on a GPU).
    Positions not finite on both sides count as zero difference, which leaves every sum and maximum as it is
    over the positions finite on both."""
    import torch

    rows = []
    for r, c in zip(_torch_chunks(reference, chunk), _torch_chunks(candidate, chunk)):
        fr, fc = torch.isfinite(r), torch.isfinite(c)
        masked = fr & (r <= ref_mask) & (c <= cand_mask)
        fc = fc | masked  # a masked position is neither compared nor introduced
        both = fr & fc & ~masked
        r = torch.where(both, r, 0.0)
        c = torch.where(both, c, 0.0)
        d = c - r
        ad = d.abs()
        absr = r.abs()
        # exact floor(log2|r|) via frexp; frexp(0) says 0, so zeros take emin explicitly
        e = torch.where(absr > 0, torch.clamp(torch.frexp(absr).exponent - 1, min=emin), emin)
        ulp = torch.exp2((e - man_bits).to(torch.float64))
        rows.append(torch.stack([
            both.sum().to(torch.float64), (fr & ~fc).sum().to(torch.float64), (~fr).sum().to(torch.float64),
            (r * r).sum(), (c * c).sum(), (r * d).sum(), (d * d).sum(), ad.sum(),
            ad.max(), (ad / torch.clamp(absr, min=rel_floor)).max(), (ad / ulp).max(),
            masked.sum().to(torch.float64),
        ]))
    return torch.stack(rows) if rows else None


def _acc_of_rows(rows) -> dict:
    acc = _new_acc()
    for part in rows:
        _merge_acc(acc, part)
    return acc


def _numpy_accumulate(reference, candidate, rel_floor, emin, man_bits, chunk, ref_mask, cand_mask) -> dict:
    """``_torch_rows`` in float64 numpy, for numpy arrays while the compiled kernel is not there yet: no torch
    import."""
    rows = []
    ref, cand = _np_flat(reference), _np_flat(candidate)
    for i in range(0, ref.size, chunk):
        r, c = ref[i:i + chunk].astype(np.float64), cand[i:i + chunk].astype(np.float64)
        fr, fc = np.isfinite(r), np.isfinite(c)
        masked = fr & (r <= ref_mask) & (c <= cand_mask)
        fc |= masked  # a masked position is neither compared nor introduced
        both = fr & fc & ~masked
        r = np.where(both, r, 0.0)
        c = np.where(both, c, 0.0)
        d = c - r
        ad = np.abs(d)
        absr = np.abs(r)
        e = np.where(absr > 0, np.maximum(np.frexp(absr)[1] - 1, emin), emin)
        ulp = np.exp2((e - man_bits).astype(np.float64))
        # sums of products, not np.dot: BLAS threads spin-wait, and stall when another process holds a core
        rows.append([np.count_nonzero(both), np.count_nonzero(fr & ~fc), np.count_nonzero(~fr), np.sum(r * r),
                     np.sum(c * c), np.sum(r * d), np.sum(d * d), ad.sum(), ad.max(),
                     (ad / np.maximum(absr, rel_floor)).max(), (ad / ulp).max(), np.count_nonzero(masked)])
    return _acc_of_rows(rows)


def _torch_accumulate(reference, candidate, rel_floor, emin, man_bits, chunk, ref_mask, cand_mask) -> dict:
    rows = _torch_rows(reference, candidate, rel_floor, emin, man_bits, chunk, ref_mask, cand_mask)
    return _acc_of_rows([] if rows is None else rows.cpu().tolist())  # the one transfer


def _numba_accumulate(r: np.ndarray, c: np.ndarray, rel_floor, emin, man_bits, chunk, ref_mask, cand_mask) -> dict:
    kern = _numba_kernel(wait=True)
    acc = _new_acc()
    for i in range(0, r.size, chunk):
        for part in kern(r[i : i + chunk], c[i : i + chunk], float(rel_floor), int(emin), int(man_bits),
                         float(ref_mask), float(cand_mask)):
            _merge_acc(acc, part)
    return acc
