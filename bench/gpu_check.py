"""The GPU path in one command (under 5 minutes on one GPU): capture overhead, statistics throughput, host syncs.

On one CUDA device, in one process, ratios against baselines measured in the
same run:

- capture overhead on a ``transformers`` Qwen2 built from config (random
  weights; forward + backward): the plain step, a full capture (every module
  and op, statistics and histogram), the long-run summary mode
  (``CaptureOptions(every=...)``: summary steps after a full step 0) and
  ``capture_pair`` (an fp32 reference and an fp16 candidate, compared op by
  op; against two plain steps).  Variants interleaved step by step, medians;
  each timed window holds the whole capture (enter, step, exit and write).
  Targets: full <= 1.10x, summary mode <= 1.03x;
- the fused Triton statistics kernel (``precision_lab/stats/triton_stats.py``,
  what the capture runs on CUDA tensors; results left on the device) against
  ``torch.sum`` of the same tensor (bandwidth, GB/s; target >= 0.8x of
  ``torch.sum``'s), with its host syncs per launch (target 0), and
  ``tensor_stats`` (the torch device path, results brought to the host) beside
  it;
- host synchronisations while a step runs, counted with
  ``torch.cuda.set_sync_debug_mode("warn")`` (each sync warns once), per
  recorded op (target 0; the one transfer at the end of a step is counted
  apart).

    python bench/gpu_check.py [--rounds 7] [--layers 4] [--hidden 512]

Without a CUDA device it says so in one sentence and exits with status 1.
``--device cpu`` runs the same script on the CPU (a dry run of the script;
its numbers say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import precision_lab  # noqa: E402
from precision_lab.live import CaptureOptions, PairOptions  # noqa: E402
from precision_lab.stats import tensor_stats, triton_stats  # noqa: E402
from precision_lab.store import Store  # noqa: E402

TARGETS = {"full": 1.10, "summary mode": 1.03}
STATS_TARGET = 0.8  # of torch.sum's bandwidth
NO_CUDA = "No CUDA device is available: bench/gpu_check.py measures the GPU path and needs one GPU."


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_qwen2(layers: int, hidden: int, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      max_position_embeddings=1024, attn_implementation="eager")
    return Qwen2ForCausalLM(cfg).to(device)


def _loss(out):
    return out.logits.float().pow(2).mean()


def _step(model, inputs) -> None:
    model.zero_grad(set_to_none=True)
    _loss(model(**inputs)).backward()


class SyncCounter:
    """Host synchronisations inside the block: ``set_sync_debug_mode("warn")`` warns once per sync."""

    def __init__(self, device: str, on: bool = True):
        self.device, self.on, self.count = device, on, 0

    def __enter__(self):
        if not self.on:
            return self
        self._cm = warnings.catch_warnings(record=True)
        self._seen = self._cm.__enter__()
        warnings.simplefilter("always")
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if not self.on:
            return False
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        # torch's own note on entering the mode ("Synchronization debug mode is a prototype feature") is no sync
        self.count = sum(1 for w in self._seen if "called a synchronizing" in str(w.message).lower())
        self._cm.__exit__(*exc)
        return False


def _timed(fn, device: str) -> float:
    t0 = _start(device)
    fn()
    return _stop(device, t0)


def capture_overhead(args, device: str) -> None:
    torch.manual_seed(0)
    model = build_qwen2(args.layers, args.hidden, device)
    ids = torch.randint(0, 4096, (args.batch, args.seq), device=device)
    inputs = {"input_ids": ids}
    store = Store(":memory:")
    syncs: dict = {}
    records: dict = {}

    def full(count=False):
        t0 = _start(device)
        with precision_lab.capture(model, run="full", store=store) as cap:  # enter, step, exit and write
            with SyncCounter(device, count) as sc:
                _step(model, inputs)
        took = _stop(device, t0)
        syncs["full"], records["full"] = sc.count, len(cap.records)
        return took

    def summary(count=False):
        # a long run's summary step: its per-step cost, the step and cap.step() (enter and exit, once per run,
        # are left out); step 0 of a run takes full records, so each call starts a run and ends an empty step 0
        with precision_lab.capture(model, run="summary", store=store, options=CaptureOptions(every=1 << 30)) as cap:
            cap.step()
            t0 = _start(device)
            with SyncCounter(device, count) as sc:
                _step(model, inputs)
            with SyncCounter(device, count) as end:
                cap.step()  # the step's one transfer
            took = _stop(device, t0)
        syncs["summary mode"], syncs["summary mode, end of step"] = sc.count, end.count
        records["summary mode"] = sum(1 for r in cap.timeline_rows if r.step == 1)
        return took

    def pair(count=False):
        t0 = _start(device)
        with SyncCounter(device, count) as sc:
            precision_lab.capture_pair(lambda: build_qwen2(args.layers, args.hidden, device), inputs, torch.float16,
                                       store=store, pair=PairOptions(loss_fn=_loss, local_error=False))
        took = _stop(device, t0)
        syncs["capture_pair (whole call)"] = sc.count
        return took

    def plain(count=False):
        t0 = _start(device)
        _step(model, inputs)
        return _stop(device, t0)

    variants = {"plain": plain, "full": full, "summary mode": summary, "capture_pair": pair}
    for f in variants.values():  # warm-up: kernels, allocator, numba's cache
        f()
    times = {k: [] for k in variants}
    for r in range(args.rounds):
        names = list(variants)
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(variants[name]())
    for name in ("full", "summary mode", "capture_pair"):  # syncs counted apart from the timed rounds
        variants[name](count=True)
    base = statistics.median(times["plain"])
    print(f"\nmodel: transformers Qwen2 from config, {args.layers} layers, hidden {args.hidden}, batch {args.batch} x "
          f"seq {args.seq}, forward+backward on {device}; rounds {args.rounds}, medians, interleaved")
    print(f"{'variant':<16}{'ms':>9}{'ratio':>8}   target")
    for name, ts in times.items():
        m = statistics.median(ts)
        denom = 2 * base if name == "capture_pair" else base
        tgt = TARGETS.get(name)
        verdict = f"<= {tgt:.2f}x: {'met' if m / denom <= tgt else 'not met'}" if tgt else (
            "(against two plain steps; both runs, comparisons and the write)" if name == "capture_pair" else "")
        print(f"{name:<16}{m * 1e3:>9.1f}{m / denom:>7.2f}x   {verdict}")
    print("\nhost syncs while the step runs (set_sync_debug_mode('warn')):")
    for name in ("full", "summary mode"):
        n = records.get(name) or 1
        print(f"  {name:<14} {syncs.get(name, 0):>5} syncs over {records.get(name, 0)} recorded tensors: "
              f"{syncs.get(name, 0) / n:.3f} per op (target 0)")
    print(f"  summary mode, the step's end (one transfer): {syncs.get('summary mode, end of step', 0)} syncs")
    print(f"  capture_pair, whole call (two runs, comparisons, write): {syncs.get('capture_pair (whole call)', 0)} "
          f"syncs")


def _start(device: str) -> float:
    _sync(device)
    return time.perf_counter()


def _stop(device: str, t0: float) -> float:
    _sync(device)
    return time.perf_counter() - t0


def _kernel_path(device: str) -> str:
    """Which statistics path the capture takes for this device's tensors."""
    if device != "cuda":
        return "the CPU kernel (dry run: the Triton kernel runs on CUDA tensors only)"
    if triton_stats.available():
        import triton  # the optional GPU dependency, present when available() says so

        return f"the fused Triton kernel (triton {triton.__version__})"
    why = triton_stats.failure() or "triton is not installed: pip install -e '.[gpu]'"
    return f"the torch device path ({why})"


def stats_vs_sum(args, device: str) -> None:
    print(f"\nstatistics against torch.sum on {device} (same tensor; rounds {args.rounds}, medians; GB/s of the "
          f"tensor's bytes)")
    print(f"{'dtype':<10}{'elements':>10}  {'path':<14}{'stats ms':>9}{'sum ms':>9}{'stats GB/s':>12}{'sum GB/s':>10}"
          f"{'x sum':>7}")
    use_triton = device == "cuda" and triton_stats.available()
    plain_path = "the torch device path, results brought to the host" if device == "cuda" else "the CPU kernel"
    syncs = None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        n = args.stats_elems
        x = torch.randn(n, device=device).to(dtype)
        gb = n * x.element_size() / 1e9
        name = str(dtype).replace("torch.", "")
        paths = {"tensor_stats": lambda: tensor_stats(x)}
        if use_triton:  # the capture's path: results stay on the device
            paths = {"triton kernel": lambda: triton_stats.device_partials(x, histogram=True), **paths}
        for fn in paths.values():  # warm-up: compilation, the lookup table, the allocator
            fn()
        x.sum()
        if use_triton and syncs is None:
            with SyncCounter(device) as sc:
                triton_stats.device_partials(x, histogram=True)
            syncs = sc.count
        for path, fn in paths.items():
            ts = {"stats": [], "sum": []}
            for _ in range(args.rounds):
                ts["stats"].append(_timed(fn, device))
                ts["sum"].append(_timed(lambda: x.sum(), device))
            st, m = statistics.median(ts["stats"]), statistics.median(ts["sum"])
            verdict = (f"   target >= {STATS_TARGET}x: {'met' if m / st >= STATS_TARGET else 'not met'}"
                       if path == "triton kernel" else f"   ({plain_path})")
            print(f"{name:<10}{n:>10}  {path:<14}{st * 1e3:>9.2f}{m * 1e3:>9.2f}{gb / st:>12.1f}{gb / m:>10.1f}"
                  f"{m / st:>6.2f}x{verdict}")
    print(f"capture's statistics path on {device}: {_kernel_path(device)}")
    if syncs is not None:
        print(f"host syncs in one launch of the Triton kernel: {syncs} (target 0)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--stats-elems", type=int, default=1 << 26, help="elements of the statistics tensor")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a dry run of the script (its numbers say nothing about a GPU)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA)
        return 1
    os.environ.setdefault("PRECISION_LAB_COMPILE", "now")
    os.environ["PRECISION_LAB_DB"] = str(Path(tempfile.mkdtemp(prefix="pl-gpu-check-")) / "default.duckdb")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    print(f"torch {torch.__version__}  device {name}")
    t0 = time.perf_counter()
    stats_vs_sum(args, args.device)
    capture_overhead(args, args.device)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
