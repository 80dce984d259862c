"""Seeded generator of ``sample_dumps/<recipe>/``: one shard folder per built-in recipe.

Each folder is in Precision Lab's own dump format (``precision_lab.readers.shards``:
Parquet shards + ``manifest.json``) and holds two runs of the recipe's
model on its fixed inputs: ``reference`` (fp32) and ``candidate`` (the
recipe's failing low-precision policy), with the candidate's local-error
comparisons and the op tensors of both runs (inputs and outputs, not
parameters) kept, so ingest compares them element by element and single ops
can be replayed.  ``manifest.json`` also names the recipe, so a session
ingested from the folder can be re-run under a fix.  Everything is seeded: running it again writes
the same records.

    precision-lab samples [--out sample_dumps] [RECIPE ...]
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional
from .rerun import _forward
from ..paths import samples_dir
from ..records import STATE_ROLES
from ..readers.shards import write_manifest, write_shard
from ..fixes.recipes import BUILTIN_RECIPES, get_recipe

__all__ = ["generate", "generate_recipe", "DEFAULT_ROOT", "RUN_NAMES", "Sample", "list_samples"]

DEFAULT_ROOT = samples_dir()
RUN_NAMES = ("reference", "candidate")


def generate_recipe(recipe, out_dir) -> Path:
    """Write one recipe's reference and candidate runs to ``out_dir`` (replacing what is there)."""
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    metas = []
    for name, policy in (("reference", None), ("candidate", recipe.default_policy)):
        run = _forward(recipe, policy, run_name=name, kind=name, local_error=policy is not None)
        cap = run.cap
        # fixed ids: regenerating the folder gives the same manifest
        cap.run_id = f"{recipe.name}-{name}"
        records = []
        for rec in cap.records:
            rec.run_id = cap.run_id
            key = (rec.step, rec.rank, rec.name)
            # op inputs and outputs are kept for replay; parameters and buffers are
            # reproducible from the recipe and would dominate the size
            rec.tensor = run.tensors.get(key) if rec.role not in STATE_ROLES else None
            records.append(rec)
        local = {pos: cmp for pos, cmp in cap.local_comparisons}
        meta = cap.run_meta()
        meta["source"] = f"recipe:{recipe.name}"
        meta["warnings"] = [{"where": a, "message": b} for a, b in cap.warnings]
        write_shard(out, meta, records, rank=0, step=0, local_comparisons=local)
        for rec in records:
            rec.tensor = None
        metas.append(meta)
    path = write_manifest(out, metas)
    # the recipe that made the folder, so a session ingested from it can be re-run
    doc = json.loads(path.read_text())
    doc["recipe"] = recipe.name
    path.write_text(json.dumps(doc, indent=1))
    lock = out / ".manifest.lock"  # left by the manifest writer; nothing to share
    if lock.exists():
        lock.unlink()
    return out


def generate(root=DEFAULT_ROOT, recipes: Optional[Iterable[str]] = None) -> list[Path]:
    """Write ``<root>/<recipe>/`` for the named recipes (default: every built-in one)."""

    names = list(recipes) if recipes else list(BUILTIN_RECIPES)
    return [generate_recipe(get_recipe(n), Path(root) / n) for n in names]


# ---- listing the samples ------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """A dump under ``sample_dumps/`` and, when a sibling holds it, its fp32 reference."""

    name: str
    candidate: Path
    reference: Optional[Path] = None

    @property
    def recipe(self) -> Optional[str]:
        """The built-in recipe the dump was generated from (its ``manifest.json`` names it), so the session
        opened from it can be re-run; None for a dump of anything else (a manifest never names code to run:
        only a built-in recipe's name is taken)."""
        try:
            doc = json.loads((self.candidate / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        name = doc.get("recipe") if isinstance(doc, dict) else None
        return name if isinstance(name, str) and name in BUILTIN_RECIPES else None

    @property
    def label(self) -> str:
        if self.reference is None:
            return self.name
        return f"{self.name} (reference: {self.reference.name})"


_LOW = re.compile(r"(fp16|bf16|float16|bfloat16|half|fp8[a-z0-9_]*?(?=_|$)|fp4|fp6)")


def list_samples(root: os.PathLike | str = DEFAULT_ROOT) -> list[Sample]:
    """Sample dumps, each low-precision folder paired with the folder whose
    name has ``fp32`` in place of its dtype (``x_fp16_y`` -> ``x_fp32_y``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    names = {p.name for p in folders}
    refs_used: set[str] = set()
    out = []
    for p in folders:
        m = _LOW.search(p.name)
        ref_name = (p.name[:m.start()] + "fp32" + p.name[m.end():]) if m else None
        if ref_name and ref_name in names and ref_name != p.name:
            out.append(Sample(p.name, p, root / ref_name))
            refs_used.add(ref_name)
    for p in folders:
        if p.name not in refs_used and not any(s.name == p.name for s in out):
            out.append(Sample(p.name, p))
    return sorted(out, key=lambda s: s.name)
