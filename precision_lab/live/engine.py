"""Statistics of captured tensors, on the tensor's own device.

Definitions are those of :func:`precision_lab.stats.tensor_stats`; this
module only decides *when* they are computed and how results reach the host:

- CPU tensors: ``tensor_stats`` at once (the compiled one-pass kernel).
- CUDA tensors: the stats module's device kernel (the fused Triton kernel
  where triton is installed, else the torch one) runs at once on the
  current stream and leaves its small per-tensor results on the device;
  :meth:`StatsEngine.resolve` stacks every pending result of the step and
  copies them to the host in one transfer.  No host synchronisation per op.

A tensor object seen twice within a step with the same version counter
(an op's output that is the next op's input) is measured once, and so is a
CPU view that covers exactly the memory of a tensor measured before (a
reshape, a transpose, ``.view(...)`` of an op's output): the same elements
have the same statistics, whatever their shape.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import weakref
from collections import deque
from typing import Callable, Optional

import torch

from .. import stats as _stats  # module attributes, so tests can patch them
from ..stats import triton_stats as _triton_stats
from ..numba_loader import limit_threads, restore_threads

__all__ = ["StatsEngine", "Handle", "skip_reason", "stats_threads_default"]

_RECENT = 16

# gradients kept alive by deferred statistics (``StatsEngine.measure(defer=True)``) beyond which the statistics
# of the next one are computed at once
DEFER_BYTES = 256 << 20


_DEFERRED = ()  # a handle's ``parts`` while its CPU statistics wait for the step's end


class Handle:
    """Statistics of one tensor: ``stats`` is set at once (CPU) or on resolve (CUDA); ``above``, where the engine
    counts edges instead of the histogram (``above_edges``), the counts at or above them."""

    __slots__ = ("stats", "above", "dtype", "shape", "numel", "parts", "__weakref__")

    def __init__(self, dtype: str, shape: tuple, numel: int):
        self.stats = None
        self.above = None
        self.dtype, self.shape, self.numel = dtype, shape, numel
        self.parts = None


def dense_region(t: torch.Tensor) -> Optional[tuple]:
    """``(address, numel, dtype)`` of the memory a CPU tensor covers when it covers it exactly (contiguous in
    some order of its dimensions, no gaps, no element twice), else None: two such tensors with the same region
    hold the same elements."""
    if t.is_contiguous():
        return t.data_ptr(), t.numel(), t.dtype
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return None
        expect *= sz
    return t.data_ptr(), t.numel(), t.dtype


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was made from (itself when it is none)."""
    return t._base if t._base is not None else t


def skip_reason(t: torch.Tensor) -> Optional[str]:
    """Why a tensor cannot be summarised (None when it can)."""
    if t.is_complex():
        return f"complex tensor ({_stats.canonical_dtype(t.dtype)}) skipped: statistics need real values"
    if t.is_meta:
        return "meta tensor skipped: it has no values"
    if t.is_quantized:
        return "quantized tensor skipped: summarise its dequantized values instead"
    if t.is_nested:
        return "nested tensor skipped"
    if type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and _freed(t):
        return "tensor skipped: its memory was freed (its storage resized below it, as FSDP frees unsharded tensors)"
    return None


def _is_dtensor(t) -> bool:
    dt = sys.modules.get("torch.distributed.tensor")  # loaded by whoever made a DTensor
    return dt is not None and isinstance(t, getattr(dt, "DTensor", ()))


def _freed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage no longer covers its elements: reading them would read freed memory."""
    if t.numel() == 0:
        return False
    last = t.storage_offset() + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    try:
        return t.untyped_storage().nbytes() < (last + 1) * t.element_size()
    except (RuntimeError, NotImplementedError):  # no storage to look at (a functional or wrapper tensor)
        return False


def running_elsewhere() -> int:
    """Threads other than this one that the kernel has runnable right now, from Linux's ``/proc/loadavg``
    (its fourth field, ``running/total``; torch's own spinning workers count); 0 where it cannot tell."""
    try:
        with open("/proc/loadavg") as f:
            return max(0, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        return 0


def stats_threads_default() -> int:
    """Threads for the CPU statistics kernel inside a step: the cores left free, at least one.  Taken are the
    cores torch's intra-op threads use, or, when more is runnable on the machine right now (the other ranks
    of a job on this host, data-loader workers, another job), that many: between two ops of a step torch's
    OpenMP threads keep spinning on their cores for a while, and a second statistics thread on a taken core
    waits for whoever holds it.  On 2 cores with torch's 2 threads one statistics thread made a full capture
    of the benchmark transformer 1.68x the plain step against 1.79x with two (``bench/capture_overhead.py
    --stats-threads 1``, one run each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    taken = max(torch.get_num_threads(), 1 + running_elsewhere())
    return max(1, cores - taken + 1)


class StatsEngine:
    def __init__(self, options, warn: Callable[[str, str], None], *, deferred_cpu: bool = False,
                 histogram: Optional[bool] = None, device_histogram: Optional[bool] = None,
                 above_edges=None):
        """``histogram``/``device_histogram`` override the options for CPU/device tensors; ``above_edges``
        (histogram edge indices): CPU tensors take ``summary_stats`` instead, the counts at or above those
        edges without the histogram (``Handle.above``, keyed by edge)."""
        self.histogram = bool(options.histogram and not options.moments_only) if histogram is None else histogram
        self.device_histogram = self.histogram if device_histogram is None else device_histogram
        self.above_edges = None if above_edges is None else sorted(above_edges)
        # run the device path (deferred, one transfer per step) for CPU tensors too:
        # how the CUDA bookkeeping is exercised on machines without a GPU
        self.deferred_cpu = deferred_cpu
        self._warn = warn
        self._lock = threading.Lock()
        self._cache: dict = {}
        self._regions: dict = {}  # dense_region -> (weakref to the tensor measured, its version, handle)
        self._pending: list = []
        # Autograd hands a gradient to the next hook as a fresh Python object
        # unless one is alive, so the object seen by the consumer's hook and
        # the producer's hook only match while someone holds it: keep the last
        # few gradients alive (bounded memory: _RECENT tensors).
        self._recent: deque = deque(maxlen=_RECENT)
        # CPU statistics deferred to the step's end: (handle, tensor, histogram, its version when measured), and
        # handles of views that take a deferred handle's statistics (view handle, handle)
        self.defer_bytes = DEFER_BYTES
        self._deferred: list = []
        self._deferred_bytes = 0
        self._derived: list = []

    def enter(self, threads: Optional[int]) -> None:
        """Limit the CPU kernel to ``threads`` in this thread while the capture runs (None: the cores torch's
        intra-op threads leave free, at least one; see ``stats_threads_default``)."""
        self._limited = False
        if not _stats.numba_available():
            return
        self._saved_threads = limit_threads(stats_threads_default() if threads is None else threads)
        self._limited = True

    def exit(self) -> None:
        if getattr(self, "_limited", False):
            restore_threads(self._saved_threads)
            self._limited = False

    def new_step(self) -> None:
        with self._lock:
            self._cache.clear()
            self._regions.clear()
            self._recent.clear()
            self._deferred.clear()
            self._derived.clear()
            self._deferred_bytes = 0

    def measure(self, t, where: str, *, hold: bool = False, histogram: Optional[bool] = None,
                defer: bool = False) -> Optional[Handle]:
        """A handle to the statistics of ``t``, or None (skipped, with a warning).

        ``hold``: keep ``t`` alive for a few more measurements (gradients), so
        the same gradient seen by the next hook is recognised.  ``histogram``:
        for a CPU tensor, take the histogram (True) or not (False) whatever the
        engine's setting.  ``defer``: a CPU tensor nothing writes before the step
        ends (a gradient autograd handed over) is kept and its statistics computed
        by ``resolve``, the same numbers later, while the tensors kept stay within
        ``defer_bytes`` (beyond, at once).

        Torch-function handling is off meanwhile: the statistics' own tensor calls (``detach``, ``view``,
        ``numpy``...) would each go through every active torch-function mode -- the capture's own, which
        returns at once, cost some 100 us per measured tensor.
        """
        with torch._C.DisableTorchFunction():
            return self._measure(t, where, hold, histogram, defer)

    def _measure(self, t, where: str, hold: bool, histogram: Optional[bool], defer: bool = False) -> Optional[Handle]:
        if not isinstance(t, torch.Tensor):
            return None
        if _is_dtensor(t):
            # a sharded (FSDP, tensor-parallel) tensor: this rank's own shard, with no collective
            t = t.to_local()
        key = id(t)
        try:
            version = t._version
        except Exception:  # inference tensors have no version counter
            version = None
        if version is not None:
            hit = self._cache.get(key)
            if hit is not None and hit[1] == version and hit[0]() is t:
                if hold:
                    self._recent.append(t)
                return hit[2]
        reason = skip_reason(t)
        if reason is not None:
            self._warn(where, reason)
            return None
        dtype = _stats.canonical_dtype(t.dtype)
        shape = tuple(t.shape)
        region = None
        try:
            d = t.detach()  # statistics never join the autograd graph
            if (not d.is_cuda and not self.deferred_cpu) or d.layout != torch.strided:
                want = self.histogram if histogram is None else histogram
                region = dense_region(d) if version is not None and d.layout == torch.strided and not d.is_cuda \
                    else None
                h = self._same_region(t, region, version, shape, histogram)
                if h is not None:
                    self._cache[key] = (weakref.ref(t), version, h)
                    if hold:
                        self._recent.append(t)
                    return h
                h = Handle(dtype, shape, d.numel())
                if self.above_edges is not None and histogram is None and d.layout == torch.strided:
                    h.stats, above = _stats.summary_stats(d, self.above_edges)
                    h.above = dict(zip(self.above_edges, above.tolist()))
                elif not (defer and version is not None and self._defer(h, d, want, version)):
                    h.stats = _stats.tensor_stats(d, histogram=want)
            else:
                h = self._device_measure(d, dtype, shape)
        except Exception as e:
            self._warn(where, f"{dtype} tensor of shape {list(shape)} skipped: {e}")
            return None
        if version is not None:
            try:
                self._cache[key] = (weakref.ref(t), version, h)
                if region is not None and (h.stats is not None or h.parts is _DEFERRED):
                    self._regions[region] = (weakref.ref(t), version, h, histogram)
            except TypeError:
                pass
            if hold:
                self._recent.append(t)
        return h

    def forget(self, t) -> None:
        """Drop what is known of ``t`` and of the memory it covers: it was written without its version changing
        (a collective's output), so earlier statistics of it no longer hold."""
        self._cache.pop(id(t), None)
        if isinstance(t, torch.Tensor) and not t.is_cuda and t.layout == torch.strided and type(t) is torch.Tensor:
            region = dense_region(t.detach())
            if region is not None:
                self._regions.pop(region, None)

    def _same_region(self, t, region, version, shape, histogram) -> Optional[Handle]:
        """The handle of a live tensor measured before over exactly ``region``, unchanged since, re-shaped to
        ``shape``; None when there is none.  Only views of one tensor qualify: they share its version counter,
        so equal versions mean no write in between (an alias made otherwise, ``.data`` or ``from_numpy``, has
        a counter of its own), and the earlier tensor must still cover the region (``x.data = ...`` swaps its
        memory and keeps its version)."""
        if region is None or t.is_neg() or t.is_conj():
            return None
        hit = self._regions.get(region)
        if hit is None:
            return None
        ref, seen_version, h, seen_hist = hit
        other = ref()
        if other is None or seen_version != version or other._version != version or seen_hist != histogram:
            return None
        if _root(other) is not _root(t) or dense_region(other.detach()) != region:
            return None
        if h.shape == shape:
            return h
        out = Handle(h.dtype, shape, h.numel)
        if h.parts is _DEFERRED:  # its statistics arrive with the step's end
            out.parts = _DEFERRED
            with self._lock:
                self._derived.append((out, h))
            return out
        out.stats = dataclasses.replace(h.stats, shape=shape)
        out.above = h.above
        return out

    def _defer(self, h: Handle, d: torch.Tensor, histogram: bool, version: int) -> bool:
        """Keep ``d`` for ``resolve`` to take its statistics, within ``defer_bytes``; whether it was kept."""
        nbytes = d.numel() * d.element_size()
        with self._lock:
            if self._deferred_bytes + nbytes > self.defer_bytes:
                return False
            self._deferred_bytes += nbytes
            h.parts = _DEFERRED
            self._deferred.append((h, d, histogram, version))
        return True

    def resolve_deferred(self) -> None:
        """The CPU statistics deferred so far, as ``measure`` would have taken them (``resolve`` at the step's end;
        earlier where the step waits anyway: DDP's gradient all-reduce in flight)."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
            derived, self._derived = self._derived, []
            self._deferred_bytes = 0
        with torch._C.DisableTorchFunction():
            for h, d, histogram, version in deferred:
                h.parts = None
                if d._version != version:
                    self._warn("statistics", f"a {h.dtype} gradient of shape {list(h.shape)} was written in place "
                                             "before its statistics were taken; its record holds none")
                    continue
                try:
                    h.stats = _stats.tensor_stats(d, histogram=histogram)
                except Exception as e:
                    self._warn("statistics", f"{h.dtype} tensor of shape {list(h.shape)} skipped: {e}")
        for out, h in derived:
            out.parts = None
            if h.stats is not None:
                out.stats = dataclasses.replace(h.stats, shape=out.shape)
                out.above = h.above

    # ---- device path -----------------------------------------------------------
    def _device_measure(self, d: torch.Tensor, dtype: str, shape: tuple) -> Handle:
        numel = d.numel()
        packed_fp4 = dtype == "float4_e2m1fn_x2"
        if packed_fp4:
            numel *= 2
        if not (d.dtype.is_floating_point or packed_fp4 or dtype.startswith(("int", "uint")) or dtype == "bool"):
            raise ValueError(f"cannot compute numeric statistics of a {dtype} tensor")
        h = Handle(dtype, shape, numel)
        h.parts = self._device_parts(d)
        with self._lock:
            self._pending.append(h)
        return h

    def _device_parts(self, d: torch.Tensor) -> list:
        """The fused Triton kernel's partials where it takes ``d`` (a CUDA tensor, triton installed), else the
        torch device path's; a kernel that fails here (no compiler for this GPU) leaves the torch path in use."""
        if _triton_stats.takes(d):
            try:
                return _triton_stats.device_partials(d, histogram=self.device_histogram)
            except Exception as e:
                _triton_stats.give_up(e)
                self._warn("statistics", f"the Triton statistics kernel failed ({e}); using the torch device path")
        return _stats.device_partials(d, histogram=self.device_histogram)

    def resolve(self) -> None:
        """Take the statistics deferred to the step's end; bring every pending device result to the host in one
        transfer."""
        self.resolve_deferred()
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        by_device: dict = {}
        for h in pending:
            if h.parts:
                by_device.setdefault(h.parts[0].totals.device, []).append(h)
            else:  # an empty tensor
                h.stats = _stats.finish_partials([], histogram=self.device_histogram, numel=h.numel, dtype=h.dtype,
                                                 shape=h.shape)
        for dev, hs in by_device.items():
            host_v = torch.stack([p.totals for h in hs for p in h.parts]).cpu()
            host_h = None
            if self.device_histogram:
                host_h = torch.stack([p.hist for h in hs for p in h.parts]).cpu()
            i = 0
            for h in hs:
                n = len(h.parts)
                cpu_parts = [_stats.DevicePartial(host_v[i + j], None if host_h is None else host_h[i + j])
                             for j in range(n)]
                i += n
                h.parts = None
                h.stats = _stats.finish_partials(cpu_parts, histogram=self.device_histogram, numel=h.numel,
                                                 dtype=h.dtype, shape=h.shape)
