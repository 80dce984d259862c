"""Throughput of tensor_stats (full stats + histogram) against tensor.clone().

Both are timed in the same run, interleaved, on the same float32 CPU tensor;
the ratio (clone time / stats time) is what to compare across machines:
1.0 means computing every statistic and the histogram costs as much as one
copy of the tensor.  Issue 2's target is >= 0.5.

    python bench/stats_throughput.py                 # 16M and 64M elements
    python bench/stats_throughput.py --sizes 16 --repeats 15 --backend torch
    python bench/stats_throughput.py --threads 1      # one core each: less noise from other load

Not part of CI's pass/fail: wall-clock numbers depend on the machine and on
whatever else it is running (the load average is printed with the results).
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


def _median_pair(fa, fb, repeats: int) -> tuple[float, float, float, float]:
    """Median wall time and median process CPU time of fa and fb, interleaved."""
    ta, tb, ca, cb = [], [], [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fa()
        ta.append(time.perf_counter() - t0)
        ca.append(time.process_time() - c0)
        c0, t0 = time.process_time(), time.perf_counter()
        fb()
        tb.append(time.perf_counter() - t0)
        cb.append(time.process_time() - c0)
    med = statistics.median
    return med(ta), med(tb), med(ca), med(cb)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64], help="tensor sizes in Mi elements")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--backend", default="auto", choices=["auto", "numba", "torch"])
    ap.add_argument("--no-histogram", action="store_true", help="also time histogram=False")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="element type of the tensor (the clone baseline copies the same tensor)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for both torch (clone) and numba (stats); default: all cores")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        if S.numba_available():
            import numba

            numba.set_num_threads(args.threads)

    threads = torch.get_num_threads()
    numba_threads = None
    if S.numba_available():
        import numba

        numba_threads = numba.get_num_threads()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"python {platform.python_version()}  torch {torch.__version__}  cpus {os.cpu_count()}  "
          f"torch threads {threads}  numba threads {numba_threads}  backend {args.backend}")
    if load:
        print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")

    # compile / load the kernel outside the timings
    S.tensor_stats(torch.randn(1 << 20), backend=args.backend)

    print(f"{'elements':>10} {'stats ms':>9} {'clone ms':>9} {'stats GB/s':>10} {'clone GB/s':>10} "
          f"{'ratio':>6} {'cpu ratio':>9}")
    for m in args.sizes:
        n = m << 20
        x = torch.randn(n, generator=torch.Generator().manual_seed(m)).to(getattr(torch, args.dtype))
        gb = n * x.element_size() / 1e9

        def run_stats():
            S.tensor_stats(x, backend=args.backend)

        def run_clone():
            y = x.clone()
            del y

        run_stats()
        run_clone()
        t_stats, t_clone, c_stats, c_clone = _median_pair(run_stats, run_clone, args.repeats)
        print(f"{m:>9}M {t_stats * 1e3:9.1f} {t_clone * 1e3:9.1f} {gb / t_stats:10.2f} {gb / t_clone:10.2f} "
              f"{t_clone / t_stats:6.2f} {c_clone / c_stats:9.2f}")
        if args.no_histogram:
            t_nh, t_clone2, c_nh, c_clone2 = _median_pair(
                lambda: S.tensor_stats(x, histogram=False, backend=args.backend), run_clone, args.repeats)
            print(f"{'':>10} {t_nh * 1e3:9.1f} {t_clone2 * 1e3:9.1f} {gb / t_nh:10.2f} {gb / t_clone2:10.2f} "
                  f"{t_clone2 / t_nh:6.2f} {c_clone2 / c_nh:9.2f}  (histogram=False)")
        del x
    print("ratio = clone wall time / stats wall time (issue 2's target: >= 0.5); cpu ratio = the same with\n"
          "process CPU time, less sensitive to other processes competing for the cores")
    if load:
        la = os.getloadavg()
        print(f"load average after: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
