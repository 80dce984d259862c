"""Quiet precision loss named where the error is amplified (fixes.rules ``error-amplified``): a one-pass
variance in bf16 cancels in its subtraction, which has no local error of its own."""

from __future__ import annotations

import torch
from torch import nn

from precision_lab import capture_pair
from precision_lab.services.diagnose import diagnose
from precision_lab.services.report import build_report, render_text
from precision_lab.store.dashboard import ACCUMULATED_KINDS, LOCAL_KINDS, top_offenders


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


def test_the_cancelling_subtraction_is_named_with_the_bits_it_loses(store):
    ref, low = _variance_terms(torch.float32), _variance_terms(torch.bfloat16)
    rel_in = max(_rel(ref[0], low[0]), _rel(ref[1], low[1]))
    rel_out = _rel(ref[2], low[2])
    assert rel_in < 2 ** -7 and rel_out / rel_in > 16  # independently: the subtraction amplifies the error
    name = capture_pair(_build, _x(), torch.bfloat16, store=store)
    d = next(d for d in diagnose(store, name) if d.rule == "error-amplified")
    assert d.op == "sub.0" and "of the 8 significant bits bf16 holds" in d.message and "cancellation" in d.message


def test_no_amplification_named_in_a_healthy_run(store):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    name = capture_pair(lambda: (torch.manual_seed(0), Plain())[1], _x(), torch.bfloat16, store=store)
    assert not [d for d in diagnose(store, name) if d.rule == "error-amplified"]


def test_the_amplifying_op_ranks_ahead_of_its_consumers(store):
    name = capture_pair(_build, _x(), torch.bfloat16, store=store)
    # Top offenders (both tabs) and the worst-comparison table: the subtraction that cancels first, not the ops
    # after it, though its own local error is nil (it rounds nothing: its inputs' rounding is what it amplifies)
    sid = store.session(name)["session_id"]
    for kinds in (ACCUMULATED_KINDS, LOCAL_KINDS):
        assert top_offenders(store, sid, kinds=kinds, n=1).iloc[0]["op"] == "sub.0", kinds
    worst = render_text(build_report(store, name)).split("Worst")[1].splitlines()[3]
    assert worst.split()[1] == "sub.0"
