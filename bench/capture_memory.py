"""Peak memory of a captured training step, against a plain step, each in its own process.

Models: the 4-block pre-LN transformer of ``bench/capture_overhead.py`` (d=256, MLP 1024, batch 8 x sequence
128: activations dominate), and 4 pre-LN MLP blocks of width 1024 on 64 tokens (parameters dominate); one
forward + backward on CPU, in fp32 and under ``dtype_policy=torch.float16``.  Modes: plain (no hooks);
capture without local error; capture with local error (every op and module re-run in fp32 on its own inputs).
Each mode runs in a fresh process that imports and warms the same libraries (DuckDB, the statistics kernel) and
reports its peak resident set (``ru_maxrss``); the table gives the peak above the plain step's and that excess in
units of the model's fp32 parameter bytes.

    python bench/capture_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, resource, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
import torch
from torch import nn
from capture_overhead import BATCH, D, SEQ, Transformer, _step
import precision_lab
from precision_lab.live import CaptureOptions
from precision_lab.store import Store

mode, dtype, which = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
torch.set_num_threads(1)
if which == "transformer":
    model = Transformer()
    x = torch.randn(BATCH, SEQ, D)
else:  # parameters dominate: 4 pre-LN MLP blocks of width 1024, 64 tokens
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.up, self.act, self.down = nn.LayerNorm(1024), nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)
        def forward(self, h):
            return h + self.down(self.act(self.up(self.ln(h))))
    model = nn.Sequential(*[Block() for _ in range(4)])
    x = torch.randn(1, 64, 1024)
params = sum(p.numel() * 4 for p in model.parameters())
policy = torch.float16 if dtype == "fp16" else None
store = Store(":memory:")  # every mode loads the same libraries: the difference is the capture's own memory
precision_lab.stats.tensor_stats(torch.ones(4))
if mode == "plain":
    if policy is not None:
        model = model.to(policy); x = x.to(policy)
    _step(model, x)
else:
    opts = CaptureOptions(local_error=mode == "local")
    with precision_lab.capture(model, store=store, dtype_policy=policy, options=opts) as cap:
        _step(cap.model, cap.prepare_inputs(x))
print(json.dumps({{"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "param_bytes": params}}))
"""


def _run(mode: str, dtype: str, which: str) -> dict:
    code = CHILD.format(root=str(HERE.parent), here=str(HERE))
    out = subprocess.run([sys.executable, "-c", code, mode, dtype, which], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    print("| model | dtype | mode | peak RSS | above plain | in fp32 parameter bytes |")
    print("|---|---|---|---|---|---|")
    for which in ("transformer", "wide-mlp"):
        for dtype in ("fp32", "fp16"):
            base = _run("plain", dtype, which)
            for mode in ("plain", "capture", "local"):
                r = base if mode == "plain" else _run(mode, dtype, which)
                extra = (r["peak_kib"] - base["peak_kib"]) * 1024
                label = {"plain": "plain step", "capture": "capture, no local error",
                         "local": "capture with local error"}[mode]
                print(f"| {which} ({r['param_bytes'] / 2**20:.0f} MiB fp32) | {dtype} | {label} | "
                      f"{r['peak_kib'] / 1024:.0f} MiB | {extra / 2**20:+.0f} MiB | {extra / r['param_bytes']:+.2f}x |")


if __name__ == "__main__":
    main()
