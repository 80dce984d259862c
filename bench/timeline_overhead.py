"""Cost of recording a long run, per training step, as ratios against the plain step timed in the same run.

Model: the 4-block pre-LN transformer of ``capture_overhead.py`` (d=256, 4
heads, MLP 1024), batch 8 x sequence 128, forward + backward on CPU.
Variants, interleaved in blocks of ``--block`` steps (the order rotating every
round), medians of the per-step times over every timed step:

- plain: no hooks;
- summary: ``CaptureOptions(every=N)`` on a step between full ones -- each
  module's output and each parameter's gradient summarised (absmax, smallest
  nonzero, NaN/inf counts, norm, overflow/underflow/subnormal counts in fp16,
  bf16, fp8 e4m3 and e5m2); target <= 1.1x;
- summary+frames: ``every=N, keep_last=4`` -- full records every step, the last
  four kept in memory (what a run that may fail pays);
- full: full records every step (``every=1``).

A capture is opened per block and its first (full) step is not timed; the
records are not written anywhere (``write=False``), so only the step's own cost
is measured, ``cap.step()`` included.

    python bench/timeline_overhead.py                 # 6 rounds of 5 steps
    python bench/timeline_overhead.py --rounds 10 --threads 2

Not part of CI's pass/fail: wall-clock ratios depend on the machine and its load (printed with the results).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from capture_overhead import BATCH, BLOCKS, D, HEADS, HIDDEN, SEQ, Transformer, _cpu_name  # noqa: E402
from precision_lab.live.recorder import Capture  # noqa: E402
from precision_lab.live.options import CaptureOptions  # noqa: E402

EVERY = 1_000_000  # "every N-th step in full": only the untimed first step of a block


def _step(model, x) -> None:
    model.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


class Plain:
    name, options = "plain", None

    def block(self, model, x, n):
        return [_timed(lambda: _step(model, x)) for _ in range(n)]


class Recorded:
    def __init__(self, name, options):
        self.name, self.options = name, options
        self.rows = []

    def block(self, model, x, n):
        out = []
        with Capture(model, run=self.name, options=self.options, write=False) as cap:
            _step(cap.model, x)  # step 0 is a full one: not timed
            cap.step()
            for _ in range(n):
                def one():
                    _step(cap.model, x)
                    cap.step()
                out.append(_timed(one))
        self.rows.append(len(cap.timeline_rows) / (n + 1))
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the model's and input's dtype (an fp16 or bf16 training step)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = Transformer().to(dtype)
    x = torch.randn(BATCH, SEQ, D).to(dtype)
    variants = [Plain(), Recorded("summary", CaptureOptions(every=EVERY)),
                Recorded("summary+frames", CaptureOptions(every=EVERY, keep_last=4)),
                Recorded("full", CaptureOptions(every=1))]
    load0 = os.getloadavg()
    print(f"python {platform.python_version()}  torch {torch.__version__}  cpus {os.cpu_count()}  "
          f"torch threads {torch.get_num_threads()}  cpu {_cpu_name()}")
    print(f"model: {BLOCKS}-block pre-LN transformer d={D} heads={HEADS} mlp={HIDDEN}, batch {BATCH} x seq {SEQ}, "
          f"forward+backward, {args.dtype}")
    for v in variants:  # warm-up: compile the kernels, fill the caches
        v.block(model, x, 1)
    times = {v.name: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            times[v.name].extend(v.block(model, x, args.block))
    load1 = os.getloadavg()
    base = statistics.median(w for w, _ in times["plain"])
    base_cpu = statistics.median(c for _, c in times["plain"])
    print(f"\n{'variant':<16}{'wall ms':>9}{'ratio':>8}{'cpu ms':>9}{'ratio':>8}   notes")
    for v in variants:
        m = statistics.median(w for w, _ in times[v.name])
        c = statistics.median(c for _, c in times[v.name])
        note = ""
        if isinstance(v, Recorded):
            note = f"{statistics.median(v.rows):.0f} timeline rows/step"
            if v.name == "summary":
                note += f"; target <= 1.1x: {'met' if m / base <= 1.1 else 'not met'}"
        print(f"{v.name:<16}{m * 1e3:>9.1f}{m / base:>7.2f}x{c * 1e3:>9.1f}{c / base_cpu:>7.2f}x   {note}")
    print(f"\nrounds {args.rounds} x {args.block} steps, load average {load0[0]:.2f} at start, {load1[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
