"""numba, when it can be used: one switch, one way to compile, one lock and the thread limit for every kernel.

``PRECISION_LAB_NO_NUMBA=1`` turns the compiled kernels off (the torch
paths run instead).  Kernels are compiled on first use (``CompiledOnce``),
cached on disk by numba (``njit``) and release the GIL.  numba's default
"workqueue" threading layer must not run two parallel regions at once in one
process, whichever module compiled them, so every parallel call takes
``PARALLEL_LOCK``.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Generic, Optional, TypeVar

__all__ = ["DISABLE_ENV", "PARALLEL_LOCK", "CompiledOnce", "load_numba", "njit", "limit_threads", "restore_threads"]

DISABLE_ENV = "PRECISION_LAB_NO_NUMBA"
PARALLEL_LOCK = threading.Lock()

K = TypeVar("K")


def load_numba() -> Optional[Any]:
    """The ``numba`` module, or None when it is switched off or not installed."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    try:
        import numba  # deferred: compiling is paid only by the first kernel call
    except ImportError:
        return None
    return numba


def njit(numba: Any, fn: Callable, **options: Any) -> Callable:
    """``fn`` compiled by ``numba.njit`` with the project's defaults: cached on disk, GIL released."""
    return numba.njit(cache=True, nogil=True, **options)(fn)


class CompiledOnce(Generic[K]):
    """``build(numba)``'s result, built on the first ``get()``; ``get()`` is None without numba."""

    def __init__(self, build: Callable[[Any], K]) -> None:
        self._build = build
        self._value: Any = None  # None: not tried yet; False: numba unavailable
        self._lock = threading.Lock()

    def get(self) -> Optional[K]:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    numba = load_numba()
                    self._value = self._build(numba) if numba is not None else False
        return self._value or None


def limit_threads(n: int) -> Optional[int]:
    """Run numba's parallel regions started from this thread on at most ``n`` threads (and at most
    ``NUMBA_NUM_THREADS``); the previous count for ``restore_threads``, None without numba.  Raises what numba
    raises when its threading layer cannot start."""
    numba = load_numba()
    if numba is None:
        return None
    previous = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return previous


def restore_threads(previous: int) -> None:
    """Undo ``limit_threads``: ``previous`` is what it returned."""
    numba = load_numba()
    if numba is not None:
        numba.set_num_threads(previous)
