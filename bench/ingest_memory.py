"""Peak memory of one ingest at the default limits: the largest inputs allowed, and bombs.

Each case runs ``precision-lab ingest`` in its own process (so its peak RSS
is its own, read from ``VmHWM`` in ``/proc/self/status``) on an input built here:

- ``baseline``: a folder with one 10-element ``.npy`` (imports and database);
- ``pt at limit``: one ``.pt`` holding a float32 tensor just under ``max_tensor_mb``;
- ``npy at limit``: the same as ``.npy`` (memory-mapped);
- ``dump.json at limit``: an msprobe statistics dump with ``max_file_records`` entries;
- bombs, refused from their declared sizes: a ``.pt`` whose tensor is a
  zero-stride view of a 4-byte storage (``2**40`` elements), an ``.npz`` whose
  member header claims 64 GiB, a zip of 600 well-compressed entries, a
  Parquet shard of a million rows, a safetensors file of 200,000 empty tensors.

Prints each case's exit status, peak RSS in MiB and its ratio to the
baseline's, and the worst case.  The target: every case under 1.5 GiB.

    python bench/ingest_memory.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

# VmHWM is this process's own high-water mark (ru_maxrss would carry over the parent's across exec)
_RUN = ("import sys; from precision_lab.cli import main; sys.argv = ['precision-lab'] + sys.argv[1:];\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print('PEAK_KB', hwm.split()[1], file=sys.stderr)\n"
        "sys.exit(code)")


def _limits():
    from precision_lab.config import ServerConfig

    c = ServerConfig()
    return c.max_tensor_mb << 20, c.max_file_records


def build(root: Path) -> dict[str, Path]:
    import torch

    max_bytes, max_records = _limits()
    cases = {}

    d = root / "baseline"
    d.mkdir()
    np.save(d / "a.output.0.npy", np.ones(10, np.float32))
    cases["baseline"] = d

    n = (max_bytes - (1 << 20)) // 4
    d = root / "pt_at_limit"
    d.mkdir()
    torch.save(torch.randn(n), d / "w.output.0.pt")
    cases["pt at limit"] = d

    d = root / "npy_at_limit"
    d.mkdir()
    np.save(d / "w.output.0.npy", np.random.default_rng(0).standard_normal(n, dtype=np.float32))
    cases["npy at limit"] = d

    d = root / "json_at_limit" / "step0" / "rank0"
    d.mkdir(parents=True)
    t = {"type": "torch.Tensor", "dtype": "torch.float16", "shape": [8, 128, 256], "Max": 3.0, "Min": -2.9,
         "Mean": -0.05, "Norm": 22.7, "requires_grad": False}
    data = {f"Functional.linear.{i}.forward": {"input_args": [t], "output": [t]} for i in range(max_records)}
    (d / "dump.json").write_text(json.dumps({"task": "statistics", "level": "mix", "data": data}))
    cases["dump.json at limit"] = root / "json_at_limit"

    d = root / "view_bomb"
    d.mkdir()
    torch.save(torch.zeros(1).expand(1 << 40), d / "v.output.0.pt")
    cases["bomb: zero-stride .pt view"] = d

    d = root / "npz_bomb"
    d.mkdir()
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (1 << 34,)})
    with zipfile.ZipFile(d / "x.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a.npy", buf.getvalue() + b"\0" * 64)
    cases["bomb: .npz header 64 GiB"] = d

    z = root / "zip_bomb.zip"
    with zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as zf:
        for i in range(600):
            zf.writestr(f"d/{i}.output.0.npy", b"\0" * (60 << 10))
    cases["bomb: zip of 600 small entries"] = z

    cases["bomb: Parquet 1M rows"] = _parquet_bomb(root / "parquet_bomb")

    d = root / "st_bomb"
    d.mkdir()
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_000)}
    h = json.dumps(header).encode()
    (d / "m.safetensors").write_bytes(len(h).to_bytes(8, "little") + h)
    cases["bomb: safetensors 200k tensors"] = d
    return cases


def _parquet_bomb(d: Path) -> Path:
    import pyarrow.parquet as pq

    from precision_lab.records import TensorRecord
    from precision_lab.readers.shards import write_manifest, write_shard
    from precision_lab.stats import tensor_stats

    meta = {"run_id": "r", "name": "r", "dtype": "float16", "kind": "candidate"}
    rec = TensorRecord(run_id="r", seq=0, op="a", op_type="a", role="output", index="0",
                       stats=tensor_stats(np.ones(4, np.float16)))
    path = write_shard(d, meta, [rec], rank=0, step=0)
    write_manifest(d, [meta])
    t = pq.read_table(path)
    big = t.take([0] * 1_000_000)
    pq.write_table(big, path, compression="zstd")
    return d


def run(path: Path, db: Path) -> tuple[int, float, str]:
    p = subprocess.run([sys.executable, "-c", _RUN, "ingest", str(path), "--db", str(db)], capture_output=True,
                       text=True, timeout=900)
    peak = next((int(ln.split()[1]) for ln in p.stderr.splitlines() if ln.startswith("PEAK_KB")), 0)
    err = next((ln for ln in p.stderr.splitlines() if ln.startswith("error:")), "")
    return p.returncode, peak / 1024, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="build the inputs in this folder and keep them")
    args = ap.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="pl-mem-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        cases = build(root)
        results = {}
        for i, (name, path) in enumerate(cases.items()):
            results[name] = run(path, root / f"db{i}.duckdb")
        base = results["baseline"][1]
        print(f"{'case':<34}{'exit':>5}{'peak MiB':>10}{'x baseline':>12}  message")
        for name, (code, mib, err) in results.items():
            print(f"{name:<34}{code:>5}{mib:>10.0f}{mib / base:>12.2f}  {err[:90]}")
        worst = max(results, key=lambda k: results[k][1])
        print(f"worst: {worst}, {results[worst][1]:.0f} MiB peak ({results[worst][1] / base:.2f}x baseline); "
              f"target: every case under 1536 MiB: {'met' if results[worst][1] < 1536 else 'NOT met'}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
