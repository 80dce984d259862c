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
import shutil
from pathlib import Path
from typing import Iterable, Optional
from .rerun import _forward
from ..paths import samples_dir
from ..readers.shards import write_manifest, write_shard
from ..fixes.recipes import BUILTIN_RECIPES, get_recipe

__all__ = ["generate", "generate_recipe", "DEFAULT_ROOT", "RUN_NAMES"]

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
            # op inputs and outputs are kept for replay; parameters are
            # reproducible from the recipe and would dominate the size
            rec.tensor = run.tensors.get(key) if rec.role != "param" else None
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
