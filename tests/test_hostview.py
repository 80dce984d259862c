"""Reading a tensor leaves it as it was: statistics, comparisons and kept tensors read CPU memory without marking
the storage non-resizable (what ``Tensor.numpy()`` does, and what stopped every FSDP model under a capture), and a
tensor whose storage was freed under it is skipped with a warning instead of read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import precision_lab
from precision_lab.hostview import host_view
from precision_lab.live import CaptureOptions
from precision_lab.live.engine import StatsEngine, skip_reason
from precision_lab.metrics import compare
from precision_lab.records import to_numpy
from precision_lab.stats import tensor_stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_statistics_comparisons_and_kept_tensors_leave_the_storage_resizable(dtype):
    t = (torch.randn(4096) * 100).to(dtype)
    ref = t.double().numpy()
    s = tensor_stats(t)
    assert s.absmax == np.abs(ref).max() and s.numel == 4096
    if dtype.is_floating_point:
        c = compare(t.float(), t)
        assert c.max_abs_err == 0
    kept = to_numpy(t)
    np.testing.assert_array_equal(kept.astype(np.float64), ref)
    assert t.untyped_storage().resizable()
    t.untyped_storage().resize_(0)  # what FSDP does to an unsharded parameter after the forward


def test_host_view_shares_memory_and_refuses_what_numpy_refuses():
    t = torch.arange(6.0).reshape(2, 3).t()  # a strided view
    a = host_view(t)
    np.testing.assert_array_equal(a, t.numpy())
    t[0, 0] = 42.0
    assert a[0, 0] == 42.0  # the same memory, not a copy
    np.testing.assert_array_equal(host_view(torch._neg_view(t)), -t.numpy())  # the values, not the memory
    with pytest.raises(RuntimeError):
        host_view(torch.ones(2, requires_grad=True))  # like .numpy(): the caller detaches

    class Sub(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    w = torch.Tensor._make_wrapper_subclass(Sub, (3,), dtype=torch.float32)
    with pytest.raises(Exception):  # a wrapper's own memory is not its values
        host_view(w)


def test_a_tensor_whose_storage_was_freed_is_skipped_not_read():
    base = torch.randn(64)
    view = base[8:40]
    base.untyped_storage().resize_(0)
    assert "freed" in skip_reason(view)
    warned = []
    eng = StatsEngine(CaptureOptions(), warn=lambda where, msg: warned.append(msg))
    assert eng.measure(view, "op") is None
    assert warned and "freed" in warned[0]
    ok = torch.randn(64)
    assert skip_reason(ok[8:40]) is None and skip_reason(ok.reshape(8, 8).t()) is None


def test_a_capture_does_not_record_what_an_out_argument_held():
    """``torch.add(a, b, out=buf)``: buf's earlier contents (NaN here, as uninitialised memory may be) are no
    input of the op; its result is the op's output."""
    class M(nn.Module):
        def forward(self, a):
            buf = torch.full_like(a, float("nan"))
            return torch.add(a, 1.0, out=buf)

    model = M()
    with precision_lab.capture(model, run="out", store=":memory:") as cap:
        model(torch.ones(4))
    recs = [r for r in cap.records if r.op.startswith("add.")]
    assert recs, [r.op for r in cap.records]
    assert {r.role for r in recs} == {"input", "output"}
    assert all(r.stats.nan_count == 0 for r in recs), [(r.role, r.index, r.stats.nan_count) for r in recs]
