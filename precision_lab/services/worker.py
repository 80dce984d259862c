"""Model runs in worker processes, for re-runs started from the dashboard.

A re-run runs the user's model, which is the user's code: it may crash the
interpreter, exhaust memory or hold the GIL for seconds.  ``run_in_worker``
runs a picklable module-level function in a small pool of spawned worker
processes (``MAX_PROCESSES``) and returns its result; the server's process
only writes what comes back.  A worker that dies fails only the runs it held:
the caller gets ``WorkerCrashed`` (a sentence), the broken pool is dropped,
and the next run starts a fresh one.  Workers are spawned, never forked: the
server is multithreaded (Streamlit, DuckDB, torch's pools) and a fork would
copy their locks in whatever state they were in.

The environment a function needs (which recipes and model entry points this
server allows) is passed with each call, not inherited once, so a worker
started before a setting changed still obeys the current one.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Mapping, Optional

__all__ = ["run_in_worker", "WorkerCrashed", "MAX_PROCESSES", "shutdown"]

MAX_PROCESSES = 2  # as many as the job pool runs at once: each holds a model and its activations

_POOL: Optional[ProcessPoolExecutor] = None
_LOCK = threading.Lock()


class WorkerCrashed(RuntimeError):
    """The worker process running a function ended without returning (a crash, a kill, out of memory)."""


def _pool() -> ProcessPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ProcessPoolExecutor(max_workers=MAX_PROCESSES, mp_context=multiprocessing.get_context("spawn"))
        return _POOL


def _drop(pool: ProcessPoolExecutor) -> None:
    global _POOL
    with _LOCK:
        if _POOL is pool:
            _POOL = None
    pool.shutdown(wait=False, cancel_futures=True)


def _call(fn: Callable, env: Mapping[str, Optional[str]], args: tuple, kwargs: dict) -> Any:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return fn(*args, **kwargs)


def run_in_worker(fn: Callable, *args: Any, env: Optional[Mapping[str, Optional[str]]] = None, what: str = "the run",
                  **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a worker process, with the variables of ``env`` set there (None: unset).

    ``fn``, its arguments and its result must pickle.  An exception raised by ``fn`` is raised here;
    a worker that dies raises ``WorkerCrashed`` naming ``what``."""
    pool = _pool()
    try:
        return pool.submit(_call, fn, dict(env or {}), args, kwargs).result()
    except BrokenProcessPool:
        _drop(pool)
        raise WorkerCrashed(f"the worker process running {what} ended abruptly (it crashed, was killed or ran out "
                            "of memory); nothing of it was stored") from None


def shutdown() -> None:
    """Stop the worker processes (they are started again when needed)."""
    with _LOCK:
        pool = _POOL
    if pool is not None:
        _drop(pool)
