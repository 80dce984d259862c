"""The capture's statistics engine: what measuring a tensor costs inside a capture."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from precision_lab.live.engine import StatsEngine
from precision_lab.live.options import CaptureOptions


class _Counting(TorchFunctionMode):
    """Counts the torch functions and tensor methods it sees (as the capture's own mode sees them)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measuring_makes_no_torch_function_calls_through_active_modes(dtype):
    """Inside a capture its torch-function mode is active while a hook measures a tensor: the statistics' own
    tensor calls (detach, view, numpy...) went through the mode one by one.  None reaches it now, and the
    statistics are those of a float64 computation."""
    x = (torch.randn(70_001, generator=torch.Generator().manual_seed(3)) * 30).to(dtype)
    x[::997] = float("nan")
    x[5::1009] = float("-inf")
    engine = StatsEngine(CaptureOptions(), warn=lambda where, msg: pytest.fail(msg))
    with _Counting() as mode:
        h = engine.measure(x, "op")
        seen_by_mode = mode.calls
        x.abs()  # the mode is live: a call made outside the engine reaches it
    assert seen_by_mode == 0 and mode.calls == 1
    v = x.double().numpy()
    fin = v[np.isfinite(v)]
    s = h.stats
    assert (s.nan_count, s.inf_count, s.neg_inf_count) == (int(np.isnan(v).sum()), int(np.isinf(v).sum()),
                                                           int((v == -np.inf).sum()))
    assert (s.min, s.max, s.absmax) == (fin.min(), fin.max(), np.abs(fin).max())
    assert s.mean == pytest.approx(fin.mean(), rel=1e-12)
    assert s.l2norm == pytest.approx(math.sqrt(math.fsum(fin * fin)), rel=1e-12)
    assert int(s.hist.sum()) == int(np.count_nonzero(fin))


@pytest.mark.parametrize("cores, torch_threads, elsewhere, want", [
    (2, 2, 0, 1),   # torch holds both cores: one statistics thread
    (2, 1, 0, 2),   # a quiet machine, torch on one core: both
    (2, 1, 1, 1),   # another rank (or a busy process) runs: one
    (2, 1, 5, 1),   # more runnable than cores: still one
    (8, 2, 3, 5),   # 8 cores, 4 taken (this thread and 3 others): the 4 free and this one
    (8, 4, 1, 5),   # torch's 4 threads are what is taken
])
def test_statistics_threads_leave_the_taken_cores_alone(monkeypatch, cores, torch_threads, elsewhere, want):
    from precision_lab.live import engine

    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(engine.torch, "get_num_threads", lambda: torch_threads)
    monkeypatch.setattr(engine, "running_elsewhere", lambda: elsewhere)
    assert engine.stats_threads_default() == want


def test_what_runs_elsewhere_is_read_from_the_kernel():
    """Two busy-looping processes are runnable whenever they are looked at (scheduled or waiting for a core)."""
    import subprocess
    import sys
    import time

    from precision_lab.live.engine import running_elsewhere

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        assert min(running_elsewhere() for _ in range(5)) >= 2
    finally:
        for p in procs:
            p.kill()
            p.wait()
