"""fp8 quantisation judged against its own input (precision_lab.quantisation), checked against a real cast
through torch's float8 types, and the diagnosis a capture under an fp8 policy gets from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from precision_lab import capture_pair
from precision_lab.fixes.catalogue import apply_fixes
from precision_lab.fixes.policy import get_policy
from precision_lab.quantisation import percentile_of, quant_facts
from precision_lab.services.report import build_report
from precision_lab.stats import tensor_stats


def _fake_quant(x: torch.Tensor, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Per-tensor quantise-dequantise, written out independently: scale = amax / max."""
    scale = x.abs().max() / torch.finfo(dtype).max
    return (x / scale).to(dtype).to(torch.float32) * scale


def _x(outlier: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g) * 0.05
    x[3, 5] = outlier
    return x


@pytest.mark.parametrize("outlier,verdict", [(1e4, "error"), (0.3, "expected")])
def test_flushed_values_match_a_real_fp8_cast(outlier, verdict):
    x = _x(outlier)
    y = _fake_quant(x)
    want = int(((x != 0) & (y == 0)).sum())
    qf = quant_facts("fc.act_quant.forward.0", "fp8_e4m3fn", tensor_stats(x), tensor_stats(y))
    assert qf.flushed == want and qf.numel == x.numel() and qf.verdict == verdict
    assert qf.amax == pytest.approx(float(x.abs().max()))
    # the 99.9th percentile is the upper edge of its power-of-two bin: within 2x above the exact one
    exact = float(np.percentile(x.abs().numpy().astype(np.float64), 99.9))
    assert exact <= qf.p999 <= 2 * exact + 1e-12
    if verdict == "error":
        assert qf.outlier_ratio > 1e4 and "one outlier sets the fp8_e4m3fn scale" in qf.message
        assert f"({want:,} of {x.numel():,}) round to 0" in qf.message


def test_saturation_from_a_clipped_amax():
    x = _x(1e4)
    st = tensor_stats(x)
    qf = quant_facts("q", "fp8_e4m3fn", st, st, amax=1.0)  # an amax clipped below the outlier
    assert qf.saturated is not None and 1 <= qf.saturated <= int((x.abs() > 1.0).sum())
    assert percentile_of(None, 99.9) is None and percentile_of(st.hist, 0.0) == 0.0


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _build():
    torch.manual_seed(0)
    return TwoLayers()


@pytest.mark.slow
def test_an_outlier_under_fp8_tensor_scaling_is_diagnosed_and_row_scaling_clears_it(store):
    x = _x(1e4)
    name = capture_pair(_build, x, get_policy("fp8-e4m3-tensor"), store=store)
    rep = build_report(store, name)
    assert all(f is None for f in rep.first_nonfinite.values())  # no NaN/Inf: a quiet failure
    d = next(d for d in rep.diagnoses if d.rule == "fp8-quantisation")
    assert d.op == "fc1.act_quant" and d.severity == "error"
    # one ranking: the quantiser the diagnosis names is the first row of Top offenders and of the report's table
    from precision_lab.store.views import top_offenders
    first = top_offenders(store, store.session(name).session_id, n=1).iloc[0]
    assert first["op"].startswith("fc1.act_quant.") and first["seq"] == d.seq
    assert rep.worst_comparisons[0].op == first["op"]
    assert "scaling:row" in d.fixes and "amax-percentile:99.9" in d.fixes
    want = int(((x != 0) & (_fake_quant(x) == 0)).sum())
    assert f"({want:,} of {x.numel():,}) round to 0 in fp8_e4m3fn" in d.message
    # the proposed fix, applied: one scale per row leaves the other rows their own resolution
    row = capture_pair(_build, x, apply_fixes(get_policy("fp8-e4m3-tensor"), "scaling:row"), store=store,
                       name="row")
    after = build_report(store, row)
    assert not [d for d in after.diagnoses if d.rule == "fp8-quantisation" and d.severity == "error"]
