"""Quiet precision loss named where the error is amplified (fixes.rules ``error-amplified``): a one-pass
variance in bf16 cancels in its subtraction, which has no local error of its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from precision_lab import capture_pair
from precision_lab.services.diagnose import diagnose
from precision_lab.services.report import build_report, render_text
from precision_lab.store.views import ACCUMULATED_KINDS, LOCAL_KINDS, top_offenders


class OnePassVar(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)

    def forward(self, x):
        x = self.inp(x) * 0.1 + 300.0  # a large common mean
        m = x.mean(-1, keepdim=True)
        v = ((x * x).mean(-1, keepdim=True) - m * m).clamp_min(0)
        return (x - m) / torch.sqrt(v + 1e-3)


def _build():
    torch.manual_seed(0)
    return OnePassVar()


def _x():
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(0))


def _variance_terms(dtype):
    """E[x^2], E[x]^2 and their difference, computed by hand in ``dtype`` from the model's own weights."""
    m = _build().to(dtype)
    with torch.no_grad():
        x = m.inp(_x().to(dtype)) * 0.1 + 300.0
        mean = x.mean(-1, keepdim=True)
        a, b = (x * x).mean(-1, keepdim=True), mean * mean
        return a.double(), b.double(), (a - b).double()


def _rel(ref, got):
    return float(((got - ref).norm() / ref.norm()))


@pytest.mark.slow
def test_the_cancelling_subtraction_is_named_with_the_bits_it_loses(store):
    ref, low = _variance_terms(torch.float32), _variance_terms(torch.bfloat16)
    rel_in = max(_rel(ref[0], low[0]), _rel(ref[1], low[1]))
    rel_out = _rel(ref[2], low[2])
    assert rel_in < 2 ** -7 and rel_out / rel_in > 16  # independently: the subtraction amplifies the error
    name = capture_pair(_build, _x(), torch.bfloat16, store=store)
    d = next(d for d in diagnose(store, name) if d.rule == "error-amplified")
    assert d.op == "sub.0" and "of the 8 significant bits bf16 holds" in d.message and "cancellation" in d.message


@pytest.mark.slow
def test_no_amplification_named_in_a_healthy_run(store):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    name = capture_pair(lambda: (torch.manual_seed(0), Plain())[1], _x(), torch.bfloat16, store=store)
    assert not [d for d in diagnose(store, name) if d.rule == "error-amplified"]


@pytest.mark.slow
def test_the_amplifying_op_ranks_ahead_of_its_consumers(store):
    name = capture_pair(_build, _x(), torch.bfloat16, store=store)
    # Top offenders (both tabs) and the worst-comparison table: the subtraction that cancels first, not the ops
    # after it, though its own local error is nil (it rounds nothing: its inputs' rounding is what it amplifies)
    sid = store.session(name).session_id
    for kinds in (ACCUMULATED_KINDS, LOCAL_KINDS):
        assert top_offenders(store, sid, kinds=kinds, n=1).iloc[0]["op"] == "sub.0", kinds
    worst = render_text(build_report(store, name)).split("Worst")[1].splitlines()[3]
    assert worst.split()[1] == "sub.0"


class Absorb(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 32)

    def forward(self, x):
        h = self.inp(x)
        return (h + 2048.0) - 2048.0


@pytest.mark.slow
def test_absorption_is_named_at_the_add_not_at_the_exact_subtraction(store):
    torch.manual_seed(0)
    with torch.no_grad():
        h = Absorb().half().inp(_x().half()).double().numpy()
    a = (h + 2048.0).astype(np.float16).astype(np.float64)  # the add, rounded to fp16
    assert np.array_equal((a - 2048.0).astype(np.float16), a - 2048.0)  # the subtraction is exact (Sterbenz)
    assert np.abs(a - 2048.0 - h).max() > 0.5  # the add lost up to 1 of each h (spacing 2 at 2048)
    name = capture_pair(lambda: (torch.manual_seed(0), Absorb())[1], _x(), torch.float16, store=store)
    diags = diagnose(store, name)
    d = next(d for d in diags if d.rule == "absorption")
    lost = min(11.0, np.log2(np.abs(a).max() / np.abs(h).max()))
    assert d.op == "add.0" and f"loses {lost:.1f} of the 11 significant bits of its smaller operand" in d.message
    assert "`sub.0` after it rounds nothing" in d.message
    assert not [d for d in diags if d.rule == "error-amplified"]
    sid = store.session(name).session_id
    for kinds in (ACCUMULATED_KINDS, LOCAL_KINDS):
        assert top_offenders(store, sid, kinds=kinds, n=1).iloc[0]["op"] == "add.0", kinds


class OnePassLN(nn.Module):
    def forward(self, x):
        x = x * 3.0 + 130.0
        m = x.mean(-1, keepdim=True)
        v = (x * x).mean(-1, keepdim=True) - m * m
        return (x - m) * torch.rsqrt(v + 1e-5)


@pytest.mark.slow
def test_a_nan_written_by_rsqrt_is_traced_to_the_subtraction_that_cancelled(store):
    x = _x()
    with torch.no_grad():
        xb = x.bfloat16() * 3.0 + 130.0
        v = ((xb * xb).mean(-1, keepdim=True) - xb.mean(-1, keepdim=True) ** 2).double()
    assert float(v.min()) < 0  # independently: the bf16 one-pass variance cancels below zero
    name = capture_pair(OnePassLN, x, torch.bfloat16, store=store)
    diags = diagnose(store, name)
    assert diags[0].op == "rsqrt.0" and diags[0].rule == "division"
    d = next(d for d in diags if d.rule == "error-amplified")
    assert d.op == "sub.0" and "of the 8 significant bits bf16 holds" in d.message
