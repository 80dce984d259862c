"""A distributed job's shards at scale: 64 ranks of a 32-layer model over 100 summarised steps, ingested and
answered.

Two real runs of a 32-block model (Linear + GELU per block) train 100 steps under fp16 autocast, captured with
``CaptureOptions(every=50, keep_last=2)`` into Parquet shards: a summary of every module output and parameter
gradient on every step, full records on steps 0 and 50, and the two steps before a failure.  In the second run
one block's input is scaled at step ``--fail-step`` so it overflows fp16.  The healthy run's shards stand for
63 ranks and the failing run's for rank ``--bad-rank`` (each file copied with its ``rank`` column rewritten),
then, in a fresh process, ``ingest`` reads the 64 ranks into a database and the report answers where the
failure started.  Prints the shard folder's size, the time to ingest, the time to answer, the answer, and that
process's peak memory (target: ingest and answer within 60 s on this machine).  Then, in another fresh process,
the same answer straight from the shards with nothing ingested (``report --shards``: DuckDB reads the Parquet
files in place) and its time and peak memory.

    python bench/scale_ranks.py [--ranks 64] [--layers 32] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def real_run(root: Path, layers: int, steps: int, fail_step) -> None:
    """One rank's capture of a ``layers``-block model trained ``steps`` steps (rank 0's shards in ``root``)."""
    import torch

    import precision_lab
    from precision_lab.live import CaptureOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                  for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    opts = CaptureOptions(every=50, keep_last=2)
    with precision_lab.capture(model, run="train", shard_dir=root, options=opts) as cap:
        for step in range(steps):
            x = torch.randn(8, 64, generator=g)
            if fail_step is not None and step == fail_step:
                x = x * 1e6  # the first block's output passes fp16's 65,504
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.step(loss=loss)


def as_rank(src_root: Path, dst_root: Path, rank: int) -> None:
    """``src_root``'s rank-0 files as rank ``rank`` of ``dst_root`` (the ``rank`` column rewritten)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in (src_root / "train" / "rank0").iterdir():
        t = pq.read_table(f)
        if "rank" in t.column_names:
            i = t.column_names.index("rank")
            t = t.set_column(i, t.schema.field(i), pa.array([rank] * t.num_rows, t.schema.field(i).type))
        out = dst_root / "train" / f"rank{rank}" / f.name
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t, out, compression="zstd")


def measure(shards: str, db: str) -> None:
    """In its own process: ingest the shards and answer; one JSON line."""
    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import first_nonfinite
    from precision_lab.store import Store
    from precision_lab.store import queries as q

    store = Store(db)
    t0 = time.perf_counter()
    name = ingest(Path(shards), store=store)
    t1 = time.perf_counter()
    run = q.session_runs(store, store.session(name).session_id)[0]
    first = first_nonfinite(store, run.run_id)
    t2 = time.perf_counter()
    records = store.sql("SELECT count(*) FROM tensors").fetchone()[0]
    rows = store.sql("SELECT count(*) FROM timeline").fetchone()[0]
    print(json.dumps({"ingest_s": t1 - t0, "answer_s": t2 - t1, "records": records, "timeline_rows": rows,
                      "answer": None if first is None else {"rank": first.rank, "step": first.step, "op": first.op},
                      "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def measure_in_place(shards: str) -> None:
    """In its own process: answer straight from the shards (``report --shards``'s path, nothing ingested)."""
    from precision_lab.services.report import first_nonfinite
    from precision_lab.services.shards import open_shards
    from precision_lab.store import queries as q

    t0 = time.perf_counter()
    store, name = open_shards(Path(shards))
    t1 = time.perf_counter()
    run = q.session_runs(store, store.session(name).session_id)[0]
    first = first_nonfinite(store, run.run_id)
    t2 = time.perf_counter()
    print(json.dumps({"open_s": t1 - t0, "answer_s": t2 - t1,
                      "answer": None if first is None else {"rank": first.rank, "step": first.step, "op": first.op},
                      "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _fresh(*args) -> dict:
    """The JSON line a fresh process of this script prints for ``args``."""
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ))
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _said(a, args) -> str:
    right = a is not None and a["rank"] == args.bad_rank and a["step"] == args.fail_step
    return (f"{a['op'] if a else 'none'} at rank {a['rank'] if a else '-'}, step {a['step'] if a else '-'} "
            f"({'right' if right else 'WRONG'}: the overflow was injected on rank {args.bad_rank} at step "
            f"{args.fail_step})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--fail-step", type=int, default=73)
    ap.add_argument("--bad-rank", type=int, default=37)
    ap.add_argument("--measure", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--measure-in-place", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        measure(*args.measure)
        return
    if args.measure_in_place:
        measure_in_place(args.measure_in_place)
        return
    with tempfile.TemporaryDirectory(prefix="pl-scale-") as tmp:
        tmp = Path(tmp)
        os.environ["XDG_DATA_HOME"] = str(tmp / "xdg")
        t0 = time.perf_counter()
        real_run(tmp / "healthy", args.layers, args.steps, None)
        real_run(tmp / "failing", args.layers, args.steps, args.fail_step)
        t_runs = time.perf_counter() - t0
        shards = tmp / "shards"
        for r in range(args.ranks):
            as_rank(tmp / ("failing" if r == args.bad_rank else "healthy"), shards, r)
        shutil.copy(tmp / "healthy" / "manifest.json", shards / "manifest.json")
        from precision_lab.readers.shards import write_manifest

        meta = json.loads((shards / "manifest.json").read_text())["runs"][0]
        write_manifest(shards, [meta])  # every rank's files listed
        size = sum(f.stat().st_size for f in shards.rglob("*") if f.is_file())
        got = _fresh("--measure", str(shards), str(tmp / "scale.duckdb"))
        direct = _fresh("--measure-in-place", str(shards))
    print(f"{args.ranks} ranks x {args.layers}-layer model x {args.steps} summarised steps (full records on steps 0 "
          f"and 50 and the 2 before the failure); shards {size / 1e6:.1f} MB from two real runs ({t_runs:.0f} s); "
          f"{os.cpu_count()} CPUs")
    print(f"ingest {got['ingest_s']:.1f} s ({got['records']} records, {got['timeline_rows']} timeline rows), "
          f"answer {got['answer_s']:.2f} s, total {got['ingest_s'] + got['answer_s']:.1f} s (target <= 60 s); "
          f"peak memory {got['peak_mib']:.0f} MiB")
    print(f"answer: {_said(got['answer'], args)}")
    print(f"straight from the shards, nothing ingested (report --shards): open {direct['open_s']:.1f} s, answer "
          f"{direct['answer_s']:.2f} s, total {direct['open_s'] + direct['answer_s']:.1f} s; peak memory "
          f"{direct['peak_mib']:.0f} MiB; answer: {_said(direct['answer'], args)}")


if __name__ == "__main__":
    main()
