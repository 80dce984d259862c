"""A small fp16 training loop recorded as a long run (the timeline's tests and the dashboard's fixtures)."""

from __future__ import annotations

import torch

from precision_lab import capture
from precision_lab.live.options import CaptureOptions

GROWTH_RUN = "fp16-growth"


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def train(store, *, lr: float, steps: int, grow: bool, run: str = GROWTH_RUN, options=None, hook=None):
    """SGD in fp16, recorded with ``options`` (default: a summary every step, full records every 10th, the last
    4 steps kept at a failure).  ``grow``: the loss rewards large outputs, so weights and activations grow step
    by step until fp16 overflows (first at step 20 with lr 0.2); otherwise a plain regression that stays
    healthy.  Returns the capture."""
    model = mlp()
    opts = options or CaptureOptions(every=10, keep_last=4)
    with capture(model, run=run, store=store, dtype_policy=torch.float16, options=opts) as cap:
        if hook is not None:
            hook(cap)
        opt = torch.optim.SGD(cap.model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x = cap.prepare_inputs(torch.randn(64, 16, generator=g))
            out = cap.model(x).float()
            loss = -(out ** 2).mean() if grow else ((out - 1.0) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            cap.step(loss=loss)
    return cap
