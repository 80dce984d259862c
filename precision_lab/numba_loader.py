"""numba, when it can be used: one switch and one lock for every compiled kernel in the project.

``PRECISION_LAB_NO_NUMBA=1`` turns the compiled kernels off (the torch
paths run instead).  numba's default "workqueue" threading layer must not run
two parallel regions at once in one process, whichever module compiled them,
so every parallel call takes ``PARALLEL_LOCK``.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

__all__ = ["DISABLE_ENV", "PARALLEL_LOCK", "load_numba"]

DISABLE_ENV = "PRECISION_LAB_NO_NUMBA"
PARALLEL_LOCK = threading.Lock()


def load_numba() -> Optional[Any]:
    """The ``numba`` module, or None when it is switched off or not installed."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    try:
        import numba  # deferred: compiling is paid only by the first kernel call
    except ImportError:
        return None
    return numba
