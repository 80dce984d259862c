"""Cost of live capture on a training step, as ratios against the plain step timed in the same run.

Model: a 4-block pre-LN transformer (d=256, 4 heads, MLP 1024), batch 8,
sequence 128, one forward + backward on CPU.  Variants, interleaved (one step
of each per round, the order rotating every round), medians over rounds:

- plain: no hooks;
- full: ``precision_lab.capture`` with default options -- every module and
  functional op, forward and backward, parameters, statistics and the
  magnitude histogram;
- moments-only: the same ops with ``CaptureOptions(moments_only=True)``;
- diy-numpy-hist: forward hooks that copy each module output to numpy and
  ``np.histogram`` it with TensorBoard's default exponential bins -- the
  numerical core of ``SummaryWriter.add_histogram``, without its protobuf and
  file writing (a lower bound on that approach);
- tensorboard: ``SummaryWriter.add_histogram`` from forward hooks, when
  ``tensorboard`` is installed;
- msprobe: Ascend msprobe statistics mode (level "mix"), when
  ``mindstudio-probe`` is installed.

Each capture is entered and left around its one timed step; writing its
records to an in-memory DuckDB on exit is timed separately and not part of
the ratio.  Two ratios are printed: wall-clock time, and the process's CPU
time (all threads), which moves less when other jobs share the machine.

    python bench/capture_overhead.py                  # 15 rounds
    python bench/capture_overhead.py --rounds 30 --threads 2
    python bench/capture_overhead.py --more            # + forward-only, modules-only

Not part of CI's pass/fail: wall-clock ratios depend on the machine and on
whatever else runs on it (the load average is printed with the results).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import precision_lab  # noqa: E402
from precision_lab.live import CaptureOptions  # noqa: E402
from precision_lab.store import Store  # noqa: E402

D, HEADS, HIDDEN, BLOCKS, BATCH, SEQ = 256, 4, 1024, 4, 8, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        att = F.softmax((q @ k.transpose(-2, -1)) / math.sqrt(d // HEADS), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.ln(x)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _step(model, x):
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()


# TensorBoard's default histogram bins (bins="tensorflow" in add_histogram)
def _tf_bins() -> np.ndarray:
    v = 1e-12
    buckets = []
    while v < 1e20:
        buckets.append(v)
        v *= 1.1
    neg = [-b for b in buckets[::-1]]
    return np.array(neg + [0] + buckets)


def _step_with_forward_hooks(model, x, hook):
    """Time one step with ``hook`` as a forward hook on every module."""
    hs = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        t = _Timer()
        _step(model, x)
        return t.stop()
    finally:
        for h in hs:
            h.remove()


class Variant:
    name = ""
    note = ""

    def available(self) -> bool:
        return True

    def run(self, model, x) -> float:
        raise NotImplementedError


class Plain(Variant):
    name = "plain"

    def run(self, model, x):
        t = _Timer()
        _step(model, x)
        return t.stop()


class _Timer:
    """Wall-clock and process CPU time (all threads) of one step."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


class Ours(Variant):
    def __init__(self, name, options):
        self.name, self.options = name, options
        self.exit_times, self.records = [], 0
        self.store = Store(":memory:")

    def run(self, model, x):
        cap = precision_lab.capture(model, run=self.name, store=self.store, options=self.options)
        with cap:
            t = _Timer()
            _step(model, x)
            dt = t.stop()
            t1 = time.perf_counter()
        self.exit_times.append(time.perf_counter() - t1)
        self.records = len(cap.records)
        if cap.warnings:
            raise RuntimeError(f"capture warned: {cap.warnings[:3]}")
        return dt


class DiyHist(Variant):
    name = "diy-numpy-hist"

    def __init__(self):
        self.bins = _tf_bins()

    def run(self, model, x):
        def hook(m, i, o):
            if isinstance(o, torch.Tensor):
                np.histogram(o.detach().cpu().numpy().astype(float), bins=self.bins)

        return _step_with_forward_hooks(model, x, hook)


class TensorBoard(Variant):
    name = "tensorboard"

    def __init__(self):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tempfile.mkdtemp(prefix="pl-bench-tb-"))
        except Exception as e:  # tensorboard not installed
            self.note = f"skipped: tensorboard not installed ({type(e).__name__})"

    def available(self):
        return self.writer is not None

    def run(self, model, x):
        names = {m: n or "root" for n, m in model.named_modules()}

        def hook(m, i, o):
            if isinstance(o, torch.Tensor):
                self.writer.add_histogram(names[m], o.detach(), 0)

        return _step_with_forward_hooks(model, x, hook)


class Msprobe(Variant):
    name = "msprobe-stats"

    def __init__(self):
        self.debugger = None
        try:
            from msprobe.pytorch import PrecisionDebugger  # noqa: F401

            self.cls = PrecisionDebugger
        except Exception as e:
            self.cls = None
            self.note = f"skipped: mindstudio-probe not installed ({type(e).__name__})"

    def available(self):
        return self.cls is not None

    def run(self, model, x):
        import json

        if self.debugger is None:
            d = tempfile.mkdtemp(prefix="pl-bench-msprobe-")
            cfg = Path(d) / "config.json"
            cfg.write_text(json.dumps({"task": "statistics", "dump_path": d, "rank": [], "step": [],
                                       "level": "mix", "statistics": {"scope": [], "list": [],
                                                                       "data_mode": ["all"]}}))
            self.debugger = self.cls(config_path=str(cfg))
        t = _Timer()
        self.debugger.start(model)
        _step(model, x)
        self.debugger.stop()
        self.debugger.step()
        return t.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--stats-threads", type=int, default=0,
                    help="CaptureOptions.stats_threads (default 0: numba's own setting, every core)")
    ap.add_argument("--more", action="store_true",
                    help="also time lighter capture settings (forward only; modules only)")
    args = ap.parse_args(argv)
    st = args.stats_threads or None
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer()
    x = torch.randn(BATCH, SEQ, D)
    variants = [Plain(), Ours("full", CaptureOptions(stats_threads=st)),
                Ours("moments-only", CaptureOptions(moments_only=True, stats_threads=st)),
                DiyHist(), TensorBoard(), Msprobe()]
    if args.more:
        variants[3:3] = [Ours("forward-only", CaptureOptions(backward=False, stats_threads=st)),
                         Ours("modules-only", CaptureOptions(functional=False, stats_threads=st))]
    active = [v for v in variants if v.available()]
    load0 = os.getloadavg()
    print(f"python {platform.python_version()}  torch {torch.__version__}  cpus {os.cpu_count()}  "
          f"torch threads {torch.get_num_threads()}  stats threads {st or 'numba default'}  "
          f"cpu {_cpu_name()}")
    print(f"model: {BLOCKS}-block pre-LN transformer d={D} heads={HEADS} mlp={HIDDEN}, batch {BATCH} x seq {SEQ}, "
          "forward+backward")
    for _ in range(args.warmup):
        for v in active:
            v.run(model, x)
    times = {v.name: [] for v in active}
    for r in range(args.rounds):
        order = active[r % len(active):] + active[:r % len(active)]
        for v in order:
            times[v.name].append(v.run(model, x))
    load1 = os.getloadavg()
    base = statistics.median(w for w, _ in times["plain"])
    base_cpu = statistics.median(c for _, c in times["plain"])
    print(f"\n{'variant':<16}{'wall ms':>9}{'ratio':>8}{'cpu ms':>9}{'ratio':>8}   notes")
    for v in variants:
        if v.name not in times:
            print(f"{v.name:<16}{'-':>9}{'-':>8}{'-':>9}{'-':>8}   {v.note}")
            continue
        m = statistics.median(w for w, _ in times[v.name])
        c = statistics.median(c for _, c in times[v.name])
        note = ""
        if isinstance(v, Ours):
            target = {"full": "; target <= 1.5x", "moments-only": "; target <= 1.2x"}.get(v.name, "")
            note = (f"{v.records} records/step{target}; writing them to DuckDB on exit "
                    f"{statistics.median(v.exit_times) * 1e3:.0f} ms (not in the ratio)")
        print(f"{v.name:<16}{m * 1e3:>9.1f}{m / base:>7.2f}x{c * 1e3:>9.1f}{c / base_cpu:>7.2f}x   {note}")
    print(f"\nrounds {args.rounds}, load average {load0[0]:.2f} at start, {load1[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
