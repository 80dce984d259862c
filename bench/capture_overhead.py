"""Cost of live capture on a training step against its peers, as ratios to the plain step of the same run.

Models: a 4-block pre-LN transformer (d=256, 4 heads, MLP 1024), batch 8 x
sequence 128, and a Hugging Face ``transformers`` Qwen2 built from config with
random weights (4 layers, hidden 256, batch 8 x sequence 128); one forward +
backward on CPU.  Every variant runs in its own process (msprobe's debugger is
a singleton, and no variant's hooks or caches can leak into another's), the
processes take turns step by step, the order rotating every round, and the
medians over rounds are compared with the plain step's:

- plain: no hooks;
- full: ``precision_lab.capture`` with default options -- every module and
  functional op, forward and backward, parameters, statistics and the exact
  magnitude histogram -- into a Store;
- full, store=None: the same, with the default database (the README's example);
- moments-only: the same ops with ``CaptureOptions(moments_only=True)``;
- diy-numpy-hist: forward hooks that copy each module output to numpy and
  ``np.histogram`` it with TensorBoard's default exponential bins (the
  numerical core of ``add_histogram``);
- tensorboard: ``SummaryWriter.add_histogram`` from forward hooks on every
  module output, when ``tensorboard`` is installed;
- msprobe: Ascend msprobe statistics mode, level "mix", started and stopped
  around each step, when ``mindstudio-probe`` is installed.

Each turn runs two steps back to back and times the second, as one step of a
training loop: where torch leaves a core free (``--threads 1`` here, or a GPU
job) a capture into a database file inserts its session on a thread of its own
behind the step after it, so the timed step runs beside the previous step's
insert (its own insert is waited for after the window, before the next
variant's turn); where torch's threads take every core it inserts before its
block returns.  Like for like: every variant's timed window holds all it does for a step.
Precision Lab: entering the capture, the step, and leaving it (which writes
the step's records to the store); msprobe: ``start``, the step, ``stop`` and
``step`` (its dump is written there); TensorBoard: the step with its hooks and
the writer's ``flush``.  The split (enter / step / exit and write) is printed
beside each.  Two ratios are printed: wall-clock time, and the process's CPU
time (all threads).  ``--busy N`` runs N busy-looping processes beside every
variant for the whole measurement (a machine shared with data-loader workers or
other jobs).  ``--omp-passive`` runs everything with ``OMP_WAIT_POLICY=PASSIVE``:
torch's OpenMP threads then sleep between ops instead of spinning, which is what
decides a step's time when other processes hold the cores (the plain step
itself, beside 2 busy processes on 2 cores: 537 ms spinning, 362 ms passive).

    python bench/capture_overhead.py                  # both models, 9 rounds
    python bench/capture_overhead.py --busy 1         # the same with one core taken
    python bench/capture_overhead.py --busy 2 --omp-passive
    python bench/capture_overhead.py --models transformer --rounds 15
    python bench/capture_overhead.py --more            # + forward-only, modules-only
    python bench/capture_overhead.py --breakdown       # hooks vs statistics, in one process

Not part of CI's pass/fail: wall-clock ratios depend on the machine and on
whatever else runs on it (the load average is printed with the results).
"""

from __future__ import annotations

import argparse
import contextlib
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

from _busy import busy, describe  # noqa: E402  (bench/ is on the path when a bench runs)

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


AUTOCAST_ENV = "PRECISION_LAB_BENCH_AUTOCAST"  # --autocast, for the variants' processes too


def _step(model, x):
    model.zero_grad(set_to_none=True)
    fmt = os.environ.get(AUTOCAST_ENV)
    # --autocast: the forward and loss inside torch.autocast, as a mixed-precision job runs them, in every variant
    ctx = (torch.autocast("cpu", dtype={"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]) if fmt
           else contextlib.nullcontext())
    with ctx:
        out = model(**x).logits if isinstance(x, dict) else model(x)
        loss = (out.float() if fmt else out).pow(2).mean()
    loss.backward()


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=1000, hidden_size=D, intermediate_size=HIDDEN, num_hidden_layers=BLOCKS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                      attn_implementation="eager")
    model = Qwen2ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids}


MODELS = {
    "transformer": (f"{BLOCKS}-block pre-LN transformer d={D} heads={HEADS} mlp={HIDDEN}, batch {BATCH} x seq {SEQ}",
                    lambda: (Transformer(), torch.randn(BATCH, SEQ, D))),
    "qwen2": (f"transformers Qwen2 from config: {BLOCKS} layers, hidden {D}, mlp {HIDDEN}, batch {BATCH} x seq {SEQ}",
              _qwen2),
}
TARGETS = {"transformer": {"full": 1.3, "moments-only": 1.1}, "qwen2": {"full": 1.5}}


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

    def settle(self) -> None:
        """Wait for what the last step left running behind it (a capture's insert into its database)."""


class Plain(Variant):
    name = "plain"

    def run(self, model, x):
        t = _Timer()
        _step(model, x)
        return t.stop()


class _Timer:
    """Wall-clock and process CPU time (all threads) of one step; ``lap()`` marks the split points."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.laps = []

    def lap(self) -> None:
        self.laps.append(time.perf_counter())

    def stop(self) -> tuple[float, float, tuple]:
        end = time.perf_counter()
        marks = [self.wall, *self.laps, end]
        return end - self.wall, time.process_time() - self.cpu, tuple(b - a for a, b in zip(marks, marks[1:]))


OMP_ENV = "OMP_WAIT_POLICY"
SPLIT = ("enter", "step", "exit")  # the three parts of a capture's window (msprobe: start / step / stop+step)


class Ours(Variant):
    def __init__(self, name, options, default_store=False):
        self.name, self.options = name, options
        self.records = 0
        self.shard_dir = None  # under torch.distributed (--ranks)
        # store=None: the default database, here a file in a temporary folder
        self.store = None if default_store else Store(":memory:")
        self.cap = None

    def settle(self):
        if self.cap is not None:
            self.cap.session  # a session inserted behind the step: there once its name is

    def run(self, model, x):
        t = _Timer()  # the whole capture: enter, step, exit (which writes the records)
        if torch.distributed.is_initialized():  # every rank writes its own Parquet shards, as a DDP job's capture does
            if self.shard_dir is None:
                self.shard_dir = tempfile.mkdtemp(prefix="pl-bench-shards-")
            cap = precision_lab.capture(model, run=self.name.replace(",", "").replace("=", "-"), shard_dir=self.shard_dir,
                                        options=self.options)
        else:
            cap = precision_lab.capture(model, run=self.name, store=self.store, options=self.options)
        with cap:
            t.lap()
            _step(model, x)
            t.lap()
        dt = t.stop()
        self.records = len(cap.records)
        self.cap = cap
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

        wall, cpu, (step,) = _step_with_forward_hooks(model, x, hook)
        t = _Timer()
        self.writer.flush()  # its histograms reach the event file
        w2, c2, _ = t.stop()
        return wall + w2, cpu + c2, (0.0, step, w2)


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
        t.lap()
        _step(model, x)
        t.lap()
        self.debugger.stop()
        self.debugger.step()
        return t.stop()


def _variants(more: bool, stats_threads) -> list:
    """(name, factory) of every variant: each process builds only its own (a TensorBoard writer, msprobe)."""
    def ours(name, default_store=False, **opts):
        return name, lambda: Ours(name, CaptureOptions(stats_threads=stats_threads, **opts), default_store)

    out = [("plain", Plain), ours("full"), ours("full, store=None", default_store=True),
           ours("moments-only", moments_only=True), (DiyHist.name, DiyHist), (TensorBoard.name, TensorBoard),
           (Msprobe.name, Msprobe)]
    if more:
        out[4:4] = [ours("forward-only", backward=False), ours("modules-only", functional=False)]
    return out


def _worker(conn, model_kind: str, index: int, more: bool, threads, stats_threads, warmup: int,
            rank: int = 0, ranks: int = 1, rendezvous: str = "") -> None:
    """One variant in its own process (with ``ranks`` > 1: one rank of it, in a gloo process group with the
    variant's other ranks, the model wrapped in DDP): build the model, warm up, then time a step whenever
    asked."""
    os.environ["PRECISION_LAB_DB"] = str(Path(tempfile.mkdtemp(prefix="pl-bench-db-")) / "default.duckdb")
    if ranks > 1:
        import torch.distributed as dist

        # as torchrun does: the cores shared out between the ranks
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // ranks))
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=ranks)
    elif threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, x = MODELS[model_kind][1]()
    if ranks > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    v = _variants(more, stats_threads)[index][1]()
    if not v.available():
        conn.send(("skipped", v.note))
        return
    try:
        for _ in range(warmup):
            v.run(model, x)
        v.settle()
    except Exception as e:  # a peer that cannot run this model is reported, not fatal
        conn.send(("skipped", f"failed: {type(e).__name__}: {str(e)[:120]}"))
        return
    conn.send(("ready", ""))
    while conn.recv() == "step":
        v.run(model, x)  # the step before, untimed: the timed one runs beside what it left running
        got = v.run(model, x)
        v.settle()  # outside the window, and before the next variant's turn
        conn.send(got)
    conn.send(f"{v.records} records/step" if isinstance(v, Ours) else "")


def _start(ctx, model_kind: str, index: int, args) -> list:
    """The processes of one variant (one per rank); their pipes."""
    ranks = max(1, args.ranks)
    rendezvous = str(Path(tempfile.mkdtemp(prefix="pl-bench-pg-")) / "store") if ranks > 1 else ""
    conns = []
    for rank in range(ranks):
        parent, child = ctx.Pipe()
        ctx.Process(target=_worker, args=(child, model_kind, index, args.more, args.threads, args.stats_threads or None,
                                          args.warmup, rank, ranks, rendezvous), daemon=True).start()
        conns.append(parent)
    return conns


def _step_all(conns) -> tuple:
    """One step on every rank of a variant at once: the slowest rank's wall time, the CPU time of all of them,
    rank 0's split."""
    for c in conns:
        c.send("step")
    got = [c.recv() for c in conns]
    return max(w for w, _, _ in got), sum(c for _, c, _ in got), got[0][2]


def _run_model(model_kind: str, args) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    names = [name for name, _ in _variants(args.more, args.stats_threads or None)]
    conns, notes = {}, {}
    for i, name in enumerate(names):
        conns[name] = _start(ctx, model_kind, i, args)
    active = []
    for name in names:
        said = [c.recv() for c in conns[name]]
        if all(status == "ready" for status, _ in said):
            active.append(name)
        else:
            notes[name] = next(note for status, note in said if status != "ready")
            for c, (status, _) in zip(conns[name], said):
                if status == "ready":
                    c.send("stop")
    times = {n: [] for n in active}
    with busy(args.busy):
        time.sleep(1.0 if args.busy else 0.0)
        load0 = os.getloadavg()
        for r in range(args.rounds):
            for name in active[r % len(active):] + active[:r % len(active)]:
                time.sleep(0.05)  # the previous process's thread pool stops spinning before the next step
                times[name].append(_step_all(conns[name]))
        load1 = os.getloadavg()
    for name in active:
        for c in conns[name]:
            c.send("stop")
        notes[name] = [c.recv() for c in conns[name]][0]
    for p in mp.active_children():
        p.join(timeout=60)
    spread = (f"each variant {args.ranks} gloo ranks in DDP, a process each (the slowest rank's time; CPU time "
              f"of all ranks)" if args.ranks > 1 else "each variant in its own process")
    print(f"\nmodel: {MODELS[model_kind][0]}, forward+backward, {spread}; {describe(args.busy)}")
    base = statistics.median(w for w, _, _ in times["plain"])
    base_cpu = statistics.median(c for _, c, _ in times["plain"])
    print(f"{'variant':<18}{'wall ms':>9}{'ratio':>8}{'cpu ms':>9}{'ratio':>8}   {' / '.join(SPLIT)} ms (medians)   notes")
    ratios = {}
    for name in names:
        if name not in times:
            print(f"{name:<18}{'-':>9}{'-':>8}{'-':>9}{'-':>8}   {notes.get(name, '')}")
            continue
        m = statistics.median(w for w, _, _ in times[name])
        c = statistics.median(c for _, c, _ in times[name])
        parts = [p for _, _, p in times[name]]
        split = " / ".join(f"{statistics.median(p[i] for p in parts) * 1e3:.1f}" for i in range(len(parts[0])))
        ratios[name] = m / base
        print(f"{name:<18}{m * 1e3:>9.1f}{m / base:>7.2f}x{c * 1e3:>9.1f}{c / base_cpu:>7.2f}x   "
              f"{split if name != 'plain' else '-':<28}{notes.get(name, '')}")
    peers = [ratios[p] for p in ("tensorboard", "msprobe-stats") if p in ratios]
    for name, target in TARGETS[model_kind].items():
        if name in ratios:
            r = ratios[name]
            below = (f"; below every peer run ({', '.join(f'{p:.2f}x' for p in peers)}): "
                     f"{'yes' if all(r < p for p in peers) else 'no'}") if peers and name == "full" else ""
            print(f"{name}: {r:.2f}x (target <= {target}x: {'met' if r <= target else 'not met'}){below}")
    if "full" in ratios and "full, store=None" in ratios:
        print(f"store=None vs an explicit store: {ratios['full, store=None'] / ratios['full']:.2f}x")
    print(f"rounds {args.rounds}, load average {load0[0]:.2f} at start, {load1[0]:.2f} at end")


def _breakdown(model_kind: str, args) -> None:
    """Where a full capture's time goes, in one process (variants interleaved step by step): the plain step; a
    capture whose statistics are a constant (the hooks, naming and records); a full capture with every
    statistics call timed; and the same tensors' statistics again, back to back after the step."""
    from precision_lab import stats as S

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, x = MODELS[model_kind][1]()
    store = Store(":memory:")
    real = S.tensor_stats
    const = real(torch.ones(4))
    spent, seen = [0.0], []

    def timed_stats(t, **kw):
        t0 = time.perf_counter()
        out = real(t, **kw)
        spent[0] += time.perf_counter() - t0
        seen.append((t, kw))
        return out

    def step(stats_fn=None):
        if stats_fn is None:
            t0 = time.perf_counter()
            _step(model, x)
            return time.perf_counter() - t0
        S.tensor_stats = stats_fn
        try:
            with precision_lab.capture(model, run="b", store=store):
                t0 = time.perf_counter()
                _step(model, x)
                return time.perf_counter() - t0
        finally:
            S.tensor_stats = real

    rows = {"plain": [], "hooks (statistics a constant)": [], "full": [], "  its statistics calls": [],
            "  same tensors, replayed after the step": []}
    with busy(args.busy):
        for r in range(args.warmup + args.rounds):
            plain = step()
            hooks = step(lambda t, **kw: const)
            spent[0] = 0.0
            seen.clear()
            full = step(timed_stats)
            t0 = time.perf_counter()
            for t, kw in seen:
                real(t, **kw)
            replay = time.perf_counter() - t0
            if r >= args.warmup:
                for k, v in zip(rows, (plain, hooks, full, spent[0], replay)):
                    rows[k].append(v)
    base = statistics.median(rows["plain"])
    n_el = sum(t.numel() for t, _ in seen)
    print(f"\nmodel: {MODELS[model_kind][0]}: where a full capture's time goes (one process, interleaved); "
          f"{describe(args.busy)}")
    for k, v in rows.items():
        m = statistics.median(v)
        extra = f"   +{(m - base) * 1e3:.1f} ms" if k in ("hooks (statistics a constant)", "full") else ""
        print(f"{k:<42}{m * 1e3:>8.1f} ms{m / base:>7.2f}x of plain{extra}")
    print(f"statistics calls per step: {len(seen)} over {n_el / 1e6:.1f}M elements "
          f"({statistics.median(rows['  its statistics calls']) / n_el * 1e9:.2f} ns per element in the step)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--stats-threads", type=int, default=0,
                    help="CaptureOptions.stats_threads (default 0: the capture's default, the cores torch's "
                         "threads leave free, at least one)")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes beside every variant (default 0)")
    ap.add_argument("--ranks", type=int, default=1,
                    help="run every variant as this many gloo ranks of a DDP job, a process each, taking their "
                         "steps together (0: as many as the machine has cores); torch threads shared out as "
                         "torchrun does")
    ap.add_argument("--omp-passive", action="store_true",
                    help="run with OMP_WAIT_POLICY=PASSIVE (torch's threads sleep between ops, no spinning)")
    ap.add_argument("--more", action="store_true",
                    help="also time lighter capture settings (forward only; modules only)")
    ap.add_argument("--autocast", choices=("fp16", "bf16"),
                    help="every variant's step under torch.autocast in this format (the plain step too)")
    ap.add_argument("--breakdown", action="store_true",
                    help="instead: where a full capture's time goes (hooks, statistics in the step, replayed)")
    args = ap.parse_args(argv)
    if args.ranks == 0:
        args.ranks = os.cpu_count() or 1
    if args.omp_passive and os.environ.get(OMP_ENV) != "PASSIVE":
        # OpenMP reads the policy when it starts: this process again, with it set (the variants' processes
        # inherit it)
        os.environ[OMP_ENV] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if args.autocast:
        os.environ[AUTOCAST_ENV] = args.autocast
    os.environ.setdefault("PRECISION_LAB_COMPILE", "now")  # the kernels compile in the warm-up, not in the rounds
    print(f"python {platform.python_version()}  torch {torch.__version__}  cpus {os.cpu_count()}  "
          f"torch threads {args.threads or torch.get_num_threads()}  stats threads "
          f"{args.stats_threads or 'default'}  cpu {_cpu_name()}  "
          f"{OMP_ENV} {os.environ.get(OMP_ENV, '(not set: spinning)')}"
          + (f"  autocast {args.autocast}" if args.autocast else ""))
    for kind in args.models:
        (_breakdown if args.breakdown else _run_model)(kind, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
