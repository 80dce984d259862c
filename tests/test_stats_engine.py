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
