"""A parameter gradient that fp16 rounds to 0 in every value, in a run with no fp32 reference: told from a
gradient that is zero because nothing arrived, named, and offered fixes that lift it."""

from __future__ import annotations

import numpy as np
import torch

import precision_lab
from precision_lab.services.report import build_report


def _run(store, x_scale: float, loss_scale: float, name: str):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    w1 = m[1].weight.detach().double().numpy().copy()
    with precision_lab.capture(m, run=name, store=store, dtype_policy=torch.float16) as cap:
        x = cap.prepare_inputs(torch.rand(2, 8) * x_scale)
        (cap.model(x).sum() * loss_scale).backward()
    return build_report(store, cap.session), w1


def test_an_all_zero_weight_gradient_fed_by_a_subnormal_gradient_is_an_underflow(store):
    rep, w1 = _run(store, 1e-3, 1e-5, "tiny")
    found = [d for d in rep.diagnoses if d.rule == "gradient-underflow"]
    assert len(found) == 1 and found[0].op == "0.backward.0" and found[0].severity == "warn", rep.diagnoses
    # the gradient arriving at layer 0 is 1e-5 * W1 (float64, then fp16's rounding): the message quotes its max
    arriving = float(np.abs(np.float16(1e-5) * w1.astype(np.float16)).max())
    assert arriving < 2.0 ** -14 and f"reached only {arriving:.2g}" in found[0].message
    assert "0 in all 64 values in fp16" in found[0].message
    assert found[0].fixes[:2] == ("dynamic-loss-scale", "use-bf16")


def test_a_healthy_fp16_gradient_and_one_nothing_reached_are_no_finding(store):
    rep, _ = _run(store, 1.0, 1.0, "healthy")
    assert not [d for d in rep.diagnoses if d.rule == "gradient-underflow"]
    rep, _ = _run(store, 1e-3, 0.0, "nothing")  # a zero loss: every gradient 0 because nothing arrived
    assert not [d for d in rep.diagnoses if d.rule == "gradient-underflow"]
