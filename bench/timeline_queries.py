"""The Timeline page's reads on a long run: thousands of steps x hundreds of ops, against a plain scan.

Builds (once, in a temporary database) one run of ``--steps`` steps x ``--ops``
module outputs whose magnitudes grow slowly, with their fp16 counts and two
scalars per step, then times each read the page makes and prints it as a ratio
of one plain scan of the run's timeline rows into numpy (the floor of any
read that looks at every row), medians over ``--repeat`` runs.

    python bench/timeline_queries.py                     # 2000 steps x 200 ops = 400k summaries
    python bench/timeline_queries.py --steps 5000 --ops 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from precision_lab.records import StepScalar, TimelineRow, TimelineShare  # noqa: E402
from precision_lab.services import timeline as svc  # noqa: E402
from precision_lab.store import timeline as tl  # noqa: E402
from precision_lab.store import Store  # noqa: E402
from precision_lab.ui import timeline as tv  # noqa: E402


def build(store, steps: int, ops: int) -> str:
    rng = np.random.default_rng(0)
    with store.new_session("long") as w:
        run = w.add_run(name="long", dtype="float16", kind="candidate")
        rows, shares, scalars, tid = [], [], [], 0
        for s in range(steps):
            for o in range(ops):
                a = float(2.0 ** (s / steps * 14 + rng.normal(0, 0.2)) * (1 + o % 7))
                rows.append(TimelineRow(run, tid, s, 0, o, f"blocks.{o // 8}.m{o % 8}.forward.0", "Linear", "output",
                                        "0", "forward", "float16", 4096, 0, 0, 0, 0, a, 1e-3, 10 * a))
                shares.append(TimelineShare(run, tid, "fp16", 4096, 0, 3, 5))
                tid += 1
            scalars += [StepScalar(run, s, 0, "loss", 1.0), StepScalar(run, s, 0, "nonfinite_values", 0.0)]
            if len(rows) >= 100_000:
                w.add_timeline(rows, shares, scalars)
                rows, shares, scalars = [], [], []
        w.add_timeline(rows, shares, scalars)
    return run


def timed(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "tl.duckdb")
        run = build(store, args.steps, args.ops)
        n = args.steps * args.ops
        base = timed(lambda: store.sql("SELECT * FROM timeline WHERE run_id = ?", [run]).fetchnumpy(), args.repeat)
        print(f"{args.steps} steps x {args.ops} ops = {n} summaries; plain scan of the run's rows into numpy: "
              f"{base * 1e3:.0f} ms")
        print(f"\n{'read':<34}{'ms':>8}{'x scan':>9}")
        fig_json = tv.heatmap_figure(svc.heatmap(store, run, metric="headroom", fmt="fp16"), metric="headroom",
                                     fmt="fp16").to_json()
        reads = [
            ("alerts (every rule, every op)", lambda: svc.run_alerts(store, run)),
            ("heatmap, headroom (400 columns)", lambda: svc.heatmap(store, run, metric="headroom", fmt="fp16")),
            ("heatmap, low end (400 columns)", lambda: svc.heatmap(store, run, metric="low", fmt="fp16")),
            ("one op's series", lambda: svc.op_series(store, run, "blocks.0.m1.forward.0", fmt="fp16")),
            ("module tree", lambda: svc.module_tree(store, run, fmt="fp16")),
            ("heatmap figure, built and JSON", lambda: tv.heatmap_figure(
                svc.heatmap(store, run, metric="headroom", fmt="fp16"), metric="headroom", fmt="fp16").to_json()),
            ("step table", lambda: tl.step_rows(store, run)),
        ]
        for name, fn in reads:
            t = timed(fn, args.repeat)
            print(f"{name:<34}{t * 1e3:>8.0f}{t / base:>8.2f}x")
        print(f"\nheatmap figure sent to the browser: {len(fig_json) / 1e6:.1f} MB")
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
