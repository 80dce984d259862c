"""Fill numba's cache with every compiled kernel: ``python -m precision_lab.compile_kernels [LOCK]``.

Started in the background, at the lowest priority, by the first process that finds the cache empty
(``numba_loader.CompiledOnce.ready``); ``LOCK`` is the lock file it removes when done.  Run it by hand after
an install to have the kernels from the first command on.
"""

from __future__ import annotations

import os
import sys

from . import metrics
from .stats import kernels


def main(argv: list[str]) -> int:
    try:
        if hasattr(os, "nice"):
            os.nice(19)  # the command that started it runs on its own path meanwhile: leave it the cores
        for kernel_set in (kernels.KERNELS, metrics.KERNEL):
            kernel_set.warm()
    finally:
        for lock in argv[:1]:
            try:
                os.unlink(lock)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
