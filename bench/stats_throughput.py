"""Throughput of tensor_stats (full statistics + exact histogram) against the one-read floor.

Timed in the same run, rounds interleaved, on the same CPU tensor with the same threads:
``torch.sum`` (reads every element once: the floor of any statistic), ``copy_`` into a
preallocated buffer (one read and one write) and ``clone`` (which also allocates and faults in
a new buffer each time).  The ratios are baseline time / stats time, so 1.0 would mean all the
statistics and the histogram cost one ``torch.sum``; the target is >= 0.3 of ``torch.sum`` for
64M float32 elements.

    python bench/stats_throughput.py                 # 16M and 64M float32 elements
    python bench/stats_throughput.py --dtype float16 --sizes 16
    python bench/stats_throughput.py --threads 1      # one core each
    python bench/stats_throughput.py --no-histogram   # also the statistics without the histogram
    python bench/stats_throughput.py --busy 0 1 2     # quiet, then beside 1 and 2 busy-looping processes
    python bench/stats_throughput.py --crossover      # the kernel serial vs parallel by size: where parallel pays

``--busy``: each load in turn, N processes spinning beside the measurement; the
line for 64M float32 says how far the ratio to ``torch.sum`` fell from the
quiet one (target: by at most half with one busy process).

Not part of CI's pass/fail: wall-clock numbers depend on the machine and on whatever else it is
running (the load average is printed with the results).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from precision_lab import stats as S  # noqa: E402
from precision_lab import numba_loader  # noqa: E402
from precision_lab.numba_loader import run_parts  # noqa: E402
from precision_lab.stats import scan  # noqa: E402

from _busy import busy, describe  # noqa: E402  (bench/ is on the path when a bench runs)

TARGET = 0.3  # of torch.sum, 64M float32, full statistics + histogram


def _medians(fns: dict, rounds: int) -> dict:
    """Median wall time of each function, the functions interleaved round by round."""
    times: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _scan_parts(x, threads: int):
    """``tensor_stats``' scan of float32 ``x`` with histogram, its parts taken by ``threads`` threads."""
    kern = scan.KERNELS.get()
    n = x.size
    nparts = max(2, min(threads * scan._PARTS_PER_THREAD, n // scan._PART_MIN))
    b = [(n * p) // nparts for p in range(nparts + 1)]
    return run_parts(lambda p: kern.scan(x[b[p]:b[p + 1]], True), nparts, threads)


def crossover(rounds: int, loads: list) -> None:
    """The compiled scan on one thread against all threads, by size, and what ``tensor_stats`` chose."""
    import numpy as np

    threads = scan.KERNELS.get().num_threads()
    for n_busy in loads:
        with busy(n_busy):
            time.sleep(1.0 if n_busy else 0.0)
            print(f"\none thread vs {threads} threads taking parts, float32 with histogram; {describe(n_busy)}")
            print(f"{'elements':>9} {'serial us':>10} {'parallel us':>11} {'par/serial':>10} {'auto us':>8} "
                  f"{'sum us':>8}")
            for log2 in range(14, 25, 2):
                n = 1 << log2
                x = np.random.default_rng(log2).standard_normal(n).astype(np.float32)
                xt = torch.from_numpy(x)
                fns = {"serial": lambda: _scan_parts(x, 1), "parallel": lambda: _scan_parts(x, threads),
                       "auto": lambda: S.tensor_stats(x), "sum": lambda: xt.sum()}
                t = _medians(fns, max(rounds, 5) * (4 if n < (1 << 20) else 1))
                print(f"{n:>9} {t['serial'] * 1e6:10.0f} {t['parallel'] * 1e6:11.0f} "
                      f"{t['parallel'] / t['serial']:10.2f} {t['auto'] * 1e6:8.0f} {t['sum'] * 1e6:8.0f}")
    print(f"tensor_stats goes parallel from {scan._PAR_MIN} elements, where it measured faster than serial"
          f" (then serial or parallel by what each cost lately)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64], help="tensor sizes in Mi elements")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--backend", default="auto", choices=["auto", "numba", "torch"])
    ap.add_argument("--no-histogram", action="store_true", help="also time histogram=False")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="element type of the tensor (every baseline reads the same tensor)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for both torch and the statistics kernel; default: all cores")
    ap.add_argument("--busy", type=int, nargs="+", default=[0],
                    help="busy-looping processes beside the measurement; several values: one run each (0 = quiet)")
    ap.add_argument("--crossover", action="store_true", help="instead: the kernel serial vs parallel by size")
    args = ap.parse_args(argv)
    os.environ.setdefault("PRECISION_LAB_COMPILE", "now")  # time the kernel, not the path that serves while it compiles
    kernels = S.numba_available()
    if args.threads:
        torch.set_num_threads(args.threads)
        numba_loader.limit_threads(args.threads)

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"python {platform.python_version()}  torch {torch.__version__}  cpus {os.cpu_count()}  "
          f"torch threads {torch.get_num_threads()}  kernel threads "
          f"{numba_loader.kernel_threads() if kernels else None}  backend {args.backend}  dtype {args.dtype}")
    if load:
        print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    S.tensor_stats(torch.randn(1 << 20), backend=args.backend)  # compile / load the kernel outside the timings
    if args.crossover:
        crossover(args.rounds, args.busy)
        return 0
    quiet_ratio = None
    for n_busy in args.busy:
        with busy(n_busy):
            time.sleep(1.0 if n_busy else 0.0)
            print(f"\n{describe(n_busy)}")
            r = _table(args, n_busy)
        if n_busy == 0:
            quiet_ratio = r
        elif quiet_ratio and r:
            print(f"64M float32 beside {n_busy} busy: {r:.2f}x of torch.sum against {quiet_ratio:.2f}x quiet "
                  f"(kept {r / quiet_ratio:.0%} of it; target with 1 busy: >= 50%"
                  + (f": {'met' if r / quiet_ratio >= 0.5 else 'not met'})" if n_busy == 1 else ")"))
    if load:
        la = os.getloadavg()
        print(f"load average after: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    return 0


def _table(args, n_busy: int):
    """One table at the current load; the 64M float32 ratio to torch.sum (None when not measured)."""
    ratio = None
    cols = ["stats"] + (["no hist"] if args.no_histogram else []) + ["sum", "copy_", "clone"]
    print(f"{'elements':>9} " + " ".join(f"{c + ' ms':>10}" for c in cols)
          + f" {'stats GB/s':>10} {'x sum':>6} {'x copy_':>7} {'x clone':>7}" + (" nohist x sum" if args.no_histogram else ""))
    verdicts = []
    for m in args.sizes:
        n = m << 20
        x = torch.randn(n, generator=torch.Generator().manual_seed(m)).to(getattr(torch, args.dtype))
        buf = torch.empty_like(x)
        fns = {"stats": lambda: S.tensor_stats(x, backend=args.backend)}
        if args.no_histogram:
            fns["no hist"] = lambda: S.tensor_stats(x, histogram=False, backend=args.backend)
        fns.update({"sum": lambda: x.sum(), "copy_": lambda: buf.copy_(x), "clone": lambda: x.clone()})
        for f in fns.values():
            f()
        t = _medians(fns, args.rounds)
        gb = n * x.element_size() / 1e9
        line = (f"{m:>8}M " + " ".join(f"{t[c] * 1e3:10.1f}" for c in cols)
                + f" {gb / t['stats']:10.2f} {t['sum'] / t['stats']:6.2f} {t['copy_'] / t['stats']:7.2f}"
                  f" {t['clone'] / t['stats']:7.2f}")
        if args.no_histogram:
            line += f" {t['sum'] / t['no hist']:12.2f}"
        print(line)
        if m == 64 and args.dtype == "float32":
            ratio = t["sum"] / t["stats"]
            verdicts.append(f"64M float32: stats at {ratio:.2f}x of torch.sum"
                            + (f" (target >= {TARGET}x quiet): " + ("met" if ratio >= TARGET else "not met")
                               if n_busy == 0 else ""))
    print("x sum / x copy_ / x clone = that baseline's time / stats time (same tensor, same threads)")
    for v in verdicts:
        print(v)
    return ratio


if __name__ == "__main__":
    raise SystemExit(main())
