"""``precision-lab compare`` against ``msprobe compare`` on the same tensor-mode dump pair, end to end.

The pair is written in this run by msprobe itself (``PrecisionDebugger``,
task "tensor", level "mix": every module and API call, forward and backward)
from one training step of the 4-block pre-LN transformer of
``capture_overhead.py`` in fp32 and in fp16 (same weights and input), each in
its own process (the debugger is a singleton).  Then, interleaved over
``--rounds`` rounds, each tool compares fp16 against fp32 in a fresh process,
as a user runs it:

- ``msprobe compare -tp <fp16>/step0 -gp <fp32>/step0 -o <dir>``;
- ``precision-lab compare <fp32> <fp16>`` (ingest both, pair, element-wise
  metrics, first non-finite producer, report).

Target: precision-lab >= 3x faster.  Needs ``pip install mindstudio-probe``.

    python bench/compare_vs_msprobe.py [--rounds 3] [--batch 8]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_DUMP = r"""
import json, sys, torch
sys.path.insert(0, {bench!r})
from capture_overhead import Transformer, SEQ, D
from msprobe.pytorch import PrecisionDebugger
root, dtype, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = root + "/config.json"
json.dump({{"task": "tensor", "dump_path": root, "rank": [], "step": [], "level": "mix",
           "tensor": {{"scope": [], "list": [], "data_mode": ["all"]}}}}, open(cfg, "w"))
torch.manual_seed(0)
model = Transformer()
x = torch.randn(batch, SEQ, D)
if dtype == "fp16":
    model, x = model.half(), x.half()
dbg = PrecisionDebugger(config_path=cfg)
dbg.start(model)
model(x).float().pow(2).mean().backward()
dbg.stop()
dbg.step()
"""


def dump(root: Path, dtype: str, batch: int) -> Path:
    root.mkdir(parents=True)
    code = _DUMP.format(bench=str(Path(__file__).resolve().parent))
    subprocess.run([sys.executable, "-c", code, str(root), dtype, str(batch)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (root / "config.json").unlink()
    return root


def timed(argv, cwd) -> float:
    t = time.perf_counter()
    got = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t
    if got.returncode not in (0, 1):
        raise RuntimeError(f"{argv[:3]} failed ({got.returncode}): {got.stderr[-2000:]}")
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    if shutil.which("msprobe") is None:
        print("msprobe is not installed (pip install mindstudio-probe); nothing to compare against")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ref, cand = dump(tmp / "fp32", "fp32", args.batch), dump(tmp / "fp16", "fp16", args.batch)
        files = [p for d in (ref, cand) for p in d.rglob("*") if p.is_file()]
        mb = sum(p.stat().st_size for p in files) / 1e6
        print(f"pair: {len(files)} files, {mb:.0f} MB (msprobe tensor mode, level mix, fwd+bwd, batch {args.batch})")
        ms = [shutil.which("msprobe"), "compare", "-tp", str(cand / "step0"), "-gp", str(ref / "step0")]
        ours = [sys.executable, "-c", "from precision_lab.cli import main; main()", "compare", str(ref), str(cand)]
        env_cwd = tmp
        times = {"msprobe compare": [], "precision-lab compare": []}
        for r in range(args.rounds):
            order = list(times) if r % 2 == 0 else list(times)[::-1]
            for name in order:
                out = tmp / f"out{r}"
                argv = ms + ["-o", str(out)] if name == "msprobe compare" else ours
                times[name].append(timed(argv, env_cwd))
        t_ms = statistics.median(times["msprobe compare"])
        t_pl = statistics.median(times["precision-lab compare"])
        print(f"\n{'tool':<24}{'median s':>9}   runs")
        for name, ts in times.items():
            print(f"{name:<24}{statistics.median(ts):>9.2f}   {', '.join(f'{t:.2f}' for t in ts)}")
        print(f"\nprecision-lab is {t_ms / t_pl:.2f}x faster than msprobe compare "
              f"(target >= 3x: {'met' if t_ms / t_pl >= 3 else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
