"""How ``readers.dataorder._toposort`` (the order of a dump's ops from its data links) grows with the dump.

Synthetic orders of N ops, in three shapes: ``chain`` (each op feeds the next: one op ready at a time),
``layers`` (N/50 independent chains of 50, as many parallel branches or ranks), ``loose`` (no strong links, a
weak one every tenth op: every op ready at once, the worst case for choosing the next one).  Baseline in the
same run: the same shape at N/10 ops; a sort that grows linearly takes about 10x as long at N, a quadratic one
about 100x.  Medians of ``--repeat`` runs.

    python bench/toposort.py [--n 50000] [--repeat 3] [--shapes chain,layers,loose]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from precision_lab.readers.dataorder import _toposort  # noqa: E402


def shape(kind: str, n: int):
    ops = [f"op{i}" for i in range(n)]
    succ: dict = {o: set() for o in ops}
    weak: dict = {o: set() for o in ops}
    if kind == "chain":
        for a, b in zip(ops, ops[1:]):
            succ[a].add(b)
    elif kind == "layers":
        width = 50
        for i in range(n):
            if i % width != width - 1 and i + 1 < n:
                succ[ops[i]].add(ops[i + 1])
        ops = sorted(ops, key=lambda o: (int(o[2:]) % width, int(o[2:])))  # the dump lists them branch-interleaved
    else:  # loose
        for i in range(0, n - 1, 10):
            weak[ops[i + 1]].add(ops[i])
    return ops, succ, weak


def timed(kind: str, n: int, repeat: int) -> float:
    ops, succ, weak = shape(kind, n)
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        rank = _toposort(ops, succ, weak)
        out.append(time.perf_counter() - t)
        assert len(rank) == n
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shapes", default="chain,layers,loose", help="comma-separated: chain, layers, loose")
    args = ap.parse_args(argv)
    print(f"{'shape':<8}{'N/10 s':>10}{'N s':>10}{'N / (N/10)':>12}   (N = {args.n}; linear ~10x, quadratic ~100x)")
    for kind in args.shapes.split(","):
        small, big = timed(kind, args.n // 10, args.repeat), timed(kind, args.n, args.repeat)
        print(f"{kind:<8}{small:>10.3f}{big:>10.3f}{big / small:>11.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
