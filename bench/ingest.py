"""Ingest + compare throughput on two tensor-mode dumps, against a plain read.

Writes msprobe-style tensor-mode dumps (``step0/rank0/dump.json`` +
``dump_tensor_data/*.pt``) of one forward+backward of a 4-block pre-LN
transformer (d=256, 4 heads, MLP 1024, batch 8, seq 128) in fp32 and fp16,
with the same weights and input, using module hooks of its own.  Then, in
the same run and interleaved, measures:

- ``read``: every file of both dumps read in 1 MiB chunks and discarded
  (what ``cat`` does), from the page cache, like the ingest after it;
- ``ingest``: ``ingest(fp16, reference=fp32)`` into a fresh database file:
  load every tensor (``weights_only``), full statistics and histogram,
  pairing, element-wise comparison of every matched pair, one transaction;
- ``ingest (no reference)``: the fp16 dump alone, to separate the
  comparison's cost from the reading's;
- the parts alone: ``torch.load`` of every file, ``tensor_stats`` of every
  tensor, ``metrics.compare`` of every pair, so the remainder is what the
  readers, pairing and database add.

Throughput is bytes of tensor files per second; the ratio ingest/read is the
number to watch (target >= 0.3).  Against msprobe's own compare, on dumps
msprobe writes, see ``compare_vs_msprobe.py`` (measured there, in one run).

With ``--generic``: the fp16 dump's tensors rewritten as a generic folder
(one ``.npy`` per tensor and a ``manifest.json`` listing every one in
execution order), ingested as is and with the per-tensor hashing the order
settling uses turned off; the ratio is what hashing costs when the order is
fully given.

    python bench/ingest.py [--reps 3] [--keep DIR] [--generic]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))



class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.softmax = nn.Softmax(dim=-1)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = self.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads))
        return self.proj((att @ v).transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, mlp: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, mlp), nn.GELU(), nn.Linear(mlp, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, d=256, heads=4, mlp=1024, blocks=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads, mlp) for _ in range(blocks))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _stat(t: torch.Tensor, data_name: str) -> dict:
    f = t.detach().double()
    return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape),
            "Max": f.max().item(), "Min": f.min().item(), "Mean": f.mean().item(), "Norm": f.norm().item(),
            "requires_grad": bool(t.requires_grad), "data_name": data_name}


class DumpWriter:
    """Module hooks writing an msprobe-style tensor-mode dump of one step."""

    def __init__(self, model: nn.Module, out: Path):
        self.model, self.out = model, out
        self.data_dir = out / "step0" / "rank0" / "dump_tensor_data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, dict] = {}
        self.calls: dict[str, int] = {}
        self.handles = []
        for name, m in model.named_modules():
            if name and not list(m.children()):
                self.handles.append(m.register_forward_hook(self._fwd(name)))
                self.handles.append(m.register_full_backward_hook(self._bwd(name)))

    def _save(self, t: torch.Tensor, data_name: str) -> dict:
        torch.save(t.detach().clone(), self.data_dir / data_name)
        return _stat(t, data_name)

    def _key(self, name: str, m: nn.Module, direction: str) -> str:
        base = f"Module.{name}.{type(m).__name__}.{direction}"
        n = self.calls.get(base, 0)
        self.calls[base] = n + 1
        return f"{base}.{n}"

    def _fwd(self, name):
        def hook(m, args, out):
            key = self._key(name, m, "forward")
            outs = out if isinstance(out, tuple) else (out,)
            self.entries[key] = {
                "input_args": [self._save(a, f"{key}.input.{i}.pt") for i, a in enumerate(args)
                               if isinstance(a, torch.Tensor)],
                "input_kwargs": {},
                "output": [self._save(o, f"{key}.output.{i}.pt") for i, o in enumerate(outs)],
                "parameters": {p: self._save(v, f"{key}.parameters.{p}.pt")
                               for p, v in m.named_parameters(recurse=False)},
            }
        return hook

    def _bwd(self, name):
        def hook(m, grad_input, grad_output):
            key = self._key(name, m, "backward")
            self.entries[key] = {
                "input": [self._save(g, f"{key}.input.{i}.pt") for i, g in enumerate(grad_output) if g is not None],
                "output": [self._save(g, f"{key}.output.{i}.pt") for i, g in enumerate(grad_input) if g is not None],
            }
        return hook

    def finish(self) -> None:
        for name, m in self.model.named_modules():
            params = {p: v.grad for p, v in m.named_parameters(recurse=False) if v.grad is not None}
            if params:
                key = f"Module.{name}.{type(m).__name__}.parameters_grad.0"
                self.entries[key] = {p: [self._save(g, f"{key}.{p}.pt")] for p, g in params.items()}
        for h in self.handles:
            h.remove()
        doc = {"task": "tensor", "level": "L0", "framework": "pytorch", "dump_data_dir": None, "data": self.entries}
        (self.out / "step0" / "rank0" / "dump.json").write_text(json.dumps(doc, indent=1))


def write_dumps(root: Path) -> tuple[Path, Path]:
    paths = []
    for dtype, name in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        torch.manual_seed(0)
        model = Model().to(dtype)
        x = torch.randn(8, 128, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
        out = root / name
        w = DumpWriter(model, out)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        w.finish()
        paths.append(out)
    return paths[0], paths[1]


def tensor_bytes(*roots: Path) -> int:
    return sum(p.stat().st_size for r in roots for p in r.rglob("*.pt"))


def cat_read(*roots: Path) -> None:
    buf = bytearray(1 << 20)
    for r in roots:
        for p in sorted(r.rglob("*")):
            if p.is_file():
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


def timed_ingest(cand: Path, ref: Path | None, work: Path) -> float:
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    db = work / f"bench-{time.monotonic_ns()}.duckdb"
    store = Store(db)
    t0 = time.perf_counter()
    ingest(cand, reference=ref, store=store)
    dt = time.perf_counter() - t0
    close_all()
    db.unlink()
    return dt


def components(ref: Path, cand: Path) -> dict[str, float]:
    """Seconds for the three things ingest does per tensor, each alone over all files:
    ``torch.load(weights_only=True)``, ``tensor_stats`` and ``metrics.compare`` of every pair."""
    from precision_lab.metrics import compare
    from precision_lab.stats import tensor_stats

    out = {}
    t = time.perf_counter()
    loaded = {r: {p.name: torch.load(p, map_location="cpu", weights_only=True)
                  for p in sorted(r.rglob("*.pt"))} for r in (ref, cand)}
    out["load"] = time.perf_counter() - t
    t = time.perf_counter()
    for d in loaded.values():
        for x in d.values():
            tensor_stats(x)
    out["stats"] = time.perf_counter() - t
    t = time.perf_counter()
    for name, x in loaded[ref].items():
        compare(x, loaded[cand][name])
    out["compare"] = time.perf_counter() - t
    return out


def write_generic(cand: Path, out: Path) -> Path:
    """The msprobe dump ``cand`` as a generic folder: every tensor one ``.npy``, a full ``execution_order``."""
    import numpy as np

    out.mkdir()
    names = []
    for p in sorted((cand / "step0" / "rank0" / "dump_tensor_data").glob("*.pt")):
        np.save(out / (p.stem + ".npy"), torch.load(p, weights_only=True).numpy())
        names.append(p.stem)
    (out / "manifest.json").write_text(json.dumps({"execution_order": names}))
    return out


def generic_hashing(cand: Path, work: Path, reps: int) -> None:
    from precision_lab.readers import generic

    folder = write_generic(cand, work / "generic")
    mb = sum(p.stat().st_size for p in folder.glob("*.npy")) / 1e6
    real = generic.digest
    timed_ingest(folder, None, work)
    withs, withouts = [], []
    for _ in range(reps):
        generic.digest = real
        withs.append(timed_ingest(folder, None, work))
        generic.digest = lambda t: None
        try:
            withouts.append(timed_ingest(folder, None, work))
        finally:
            generic.digest = real
    w, wo = statistics.median(withs), statistics.median(withouts)
    print(f"generic fp16 folder, full order list: {mb:.1f} MB, {sum(1 for _ in folder.glob('*.npy'))} files")
    print(f"ingest with hashing:       {w:7.3f} s  {mb / w:8.1f} MB/s")
    print(f"ingest without hashing:    {wo:7.3f} s  {mb / wo:8.1f} MB/s   ratio with/without {w / wo:.3f}")
    print(f"medians of {reps} interleaved repetitions; torch threads {torch.get_num_threads()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="write the dumps here and keep them")
    ap.add_argument("--generic", action="store_true", help="only the generic folder, with and without hashing")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        t0 = time.perf_counter()
        ref, cand = write_dumps(root)
        gen = time.perf_counter() - t0
        nbytes = tensor_bytes(ref, cand)
        nfiles = sum(1 for r in (ref, cand) for _ in r.rglob("*.pt"))
        mb = nbytes / 1e6
        cand_mb = tensor_bytes(cand) / 1e6
        if args.generic:
            generic_hashing(cand, Path(tmp), args.reps)
            return
        print(f"dumps: {mb:.1f} MB of tensor files ({nfiles} files; fp32 {tensor_bytes(ref) / 1e6:.1f} MB, "
              f"fp16 {cand_mb:.1f} MB), written in {gen:.1f} s")
        cat_read(ref, cand)  # warm the page cache for both measurements
        timed_ingest(cand, None, Path(tmp))  # compile numba kernels and import lazily-loaded modules once
        reads, ingests, singles, parts = [], [], [], []
        for _ in range(args.reps):
            t = time.perf_counter()
            cat_read(ref, cand)
            reads.append(time.perf_counter() - t)
            ingests.append(timed_ingest(cand, ref, Path(tmp)))
            singles.append(timed_ingest(cand, None, Path(tmp)))
            parts.append(components(ref, cand))
        r, i, s = statistics.median(reads), statistics.median(ingests), statistics.median(singles)
        part = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        print(f"read (cat-style):          {r:7.3f} s  {mb / r:8.1f} MB/s")
        print(f"ingest + compare:          {i:7.3f} s  {mb / i:8.1f} MB/s   ratio to read {r / i:.3f} (target >= 0.3)")
        print(f"ingest fp16 alone:         {s:7.3f} s  {cand_mb / s:8.1f} MB/s")
        print("where ingest + compare spends its time (each part alone, same files):")
        for k, v in part.items():
            print(f"  {k:<8} {v:7.3f} s  {mb / v:8.1f} MB/s  ({100 * v / i:.0f}% of ingest + compare)")
        print(f"  rest     {max(0.0, i - sum(part.values())):7.3f} s  (readers, pairing, database)")
        print(f"medians of {args.reps} interleaved repetitions; torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
