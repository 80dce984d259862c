"""Fill numba's cache with every compiled kernel: ``python -m precision_lab.compile_kernels``.

Started in the background, at the lowest priority, by the first process that finds the cache empty
(``numba_loader.start_compiler``), with ``--lock-fd N``: the inherited descriptor that holds the compiler lock
for as long as this process lives (the operating system releases it when the process ends, however it ends).
Run it by hand after an install to have the kernels from the first command on: it then takes the same lock
itself, waiting for a background compiler to finish first, so two compilers never write one cache.
"""

from __future__ import annotations

import os
import sys

from . import metric_sums, numba_loader
from .stats import scan


def main(argv: list[str]) -> int:
    held = None
    if argv[:1] != [numba_loader.LOCK_FD_FLAG]:  # by hand: take the lock a background compiler would hold
        held = numba_loader.take_compiler_lock(numba_loader.compiler_lock_path(), wait=True)
    try:
        if hasattr(os, "nice"):
            os.nice(19)  # the command that started it runs on its own path meanwhile: leave it the cores
        for kernel_set in (scan.KERNELS, metric_sums.KERNEL):
            kernel_set.warm()
    finally:
        if held is not None:
            os.close(held)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
