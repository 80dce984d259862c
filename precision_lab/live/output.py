"""Where a capture's records go: a store-like sink in one transaction, or Parquet shards per rank and step.

``CapturedRun`` is what a capture recorded (records, local comparisons, warnings, timeline), written by its
``write_run``; ``RunOutput`` is the destination a capture was given, written when it ends (or, for shards, as
each step ends).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Protocol

from ..readers.shards import write_manifest, write_shard, write_timeline
from ..records import RunInfo
from .policies import policy_description

__all__ = ["CapturedRun", "RunOutput"]


def _dist(getter: str) -> Optional[int]:
    """``torch.distributed.<getter>()`` when a process group is up, else None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(getattr(dist, getter)())
    except Exception:
        pass
    return None


def _rank() -> int:
    r = _dist("get_rank")
    return r if r is not None else int(os.environ.get("RANK", "0") or 0)


def _world_size() -> int:
    n = _dist("get_world_size")
    return n if n is not None else 1


@dataclasses.dataclass
class CapturedRun:
    """What a capture recorded, without its model, hooks or store (``Capture.detached()``): picklable, so a
    worker process can send it back to be written.  The lists are the capture's own, not copies."""

    run_id: str
    run: str
    kind: Optional[str]
    source: str
    policy: Any
    records: list
    local_comparisons: list  # (record position, Comparison)
    warnings: list  # (where, message)
    timeline_rows: list
    timeline_shares: list
    step_scalars: list

    def run_meta(self) -> dict:
        return {
            "run_id": self.run_id, "name": self.run, "dtype": self.dominant_dtype(), "kind": self.run_kind(),
            "parent_run_id": None, "fix": None, "policy": policy_description(self.policy),
            "source": self.source, "order": "execution",
        }

    def dominant_dtype(self) -> str:
        counts: dict = {}
        for r in self.records:
            if r.role == "output" and r.direction == "forward" and r.stats is not None:
                counts[r.stats.dtype] = counts.get(r.stats.dtype, 0) + 1
        floats = {k: v for k, v in counts.items() if "float" in k}
        pick = floats or counts
        return max(pick, key=pick.get) if pick else ""

    def run_kind(self) -> str:
        if self.kind:
            return self.kind
        return "reference" if self.policy is None and self.dominant_dtype() in ("float32", "float64") else "candidate"

    def write_run(self, w) -> list[int]:
        """Add this run, its records, local comparisons and warnings to a session writer; returns the rids."""
        meta = self.run_meta()
        w.add_run(RunInfo(session_id=w.session_id, **meta))
        rids = w.add_records(self.records)
        for pos, cmp in self.local_comparisons:
            if pos >= len(rids):
                continue
            rec = self.records[pos]
            w.add_comparison(kind="local", ref_run_id=self.run_id, ref_rid=None, cand_run_id=self.run_id,
                             cand_rid=rids[pos], step=rec.step, rank=rec.rank, seq=rec.seq, op=rec.op,
                             role=rec.role, index=rec.index, match="exact", comparison=cmp)
        for where, msg in self.warnings:
            w.add_warning(where, msg, run_id=self.run_id)
        self.write_timeline(w)
        return rids

    def write_timeline(self, w) -> None:
        if self.timeline_rows or self.step_scalars:
            w.add_timeline(self.timeline_rows, self.timeline_shares, self.step_scalars)


class WrittenSession(Protocol):
    """A sink's session writer once its block has ended: ``name`` is the session the run went to (a write still
    running behind the caller is waited for)."""

    name: str


class RunOutput:
    """A capture's destination: ``store`` (a Store, or any sink with ``new_session``/``extend_session``),
    written in one transaction when the capture ends -- a new session, or a new run in ``session`` -- or
    ``shard_dir``, one Parquet shard per step as each step ends and the run's timeline and manifest entry
    at the end."""

    def __init__(self, *, store=None, session: Optional[str] = None, shard_dir=None, rank: int = 0):
        self.store = store
        self.session = session
        self.shard_dir = shard_dir
        self.rank = rank
        self.shard_files: list = []  # Parquet files written (shard mode)

    @property
    def sharded(self) -> bool:
        return self.shard_dir is not None

    def write_step(self, run: CapturedRun, step_records: list, local: dict, step: int) -> None:
        """One step's records as a shard; ``local``: its local comparisons by position in ``step_records``."""
        meta = run.run_meta()
        path = write_shard(self.shard_dir, meta, step_records, rank=self.rank, step=step, local_comparisons=local)
        self.shard_files.append(path)
        if len(self.shard_files) == 1:
            # the manifest is there from the first step, this rank listed as running until it ends: a capture
            # killed mid-run leaves a folder that ingests (the reader finds the later steps' files itself)
            write_manifest(self.shard_dir, [meta], running_rank=self.rank)

    def finish(self, run: CapturedRun, notes: dict) -> Optional[WrittenSession]:
        """Write the run; the writer of the session it went to, whose ``name`` is that session's (None for
        shards).  A sink may still be inserting a new session when this returns (``Store.new_session``'s
        ``behind``): its ``name`` waits for it.  ``notes``: a new session's notes."""
        if self.shard_dir is not None:
            meta = run.run_meta()
            meta["warnings"] = [{"where": a, "message": b} for a, b in run.warnings]
            if run.timeline_rows or run.step_scalars:
                write_timeline(self.shard_dir, meta, rank=self.rank, rows=run.timeline_rows,
                               shares=run.timeline_shares, scalars=run.step_scalars)
            write_manifest(self.shard_dir, [meta], finished_rank=self.rank)
            return None
        if self.session:
            with self.store.extend_session(self.session) as w:
                run.write_run(w)
            return w
        # the records are in memory already: so is the staging of their session
        with self.store.new_session(run.run, source=run.source, notes=notes, stage_in_memory=True) as w:
            run.write_run(w)
        return w
