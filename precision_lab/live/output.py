"""Where a capture's records go: a store-like sink in one transaction, or Parquet shards per rank and step."""

from __future__ import annotations

import os
from typing import Optional

from ..readers.shards import write_manifest, write_shard, write_timeline
from ..records import RunInfo
from .policies import policy_description


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


class RunOutput:
    """Part of ``Capture``: see ``live.capture``."""

    # ---- output ----------------------------------------------------------------------------
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
        rids = [w.add_record(rec) for rec in self.records]
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

    def detached(self) -> "CapturedRun":
        """What this finished capture recorded, without its model, hooks or store: picklable, so a worker
        process can send it back to be written."""
        return CapturedRun({k: getattr(self, k) for k in CapturedRun.FIELDS})

    def _finish_output(self) -> None:
        if self.shard_dir is not None:
            meta = self.run_meta()
            meta["warnings"] = [{"where": a, "message": b} for a, b in self.warnings]
            if self.timeline_rows or self.step_scalars:
                write_timeline(self.shard_dir, meta, rank=self.rank, rows=self.timeline_rows,
                               shares=self.timeline_shares, scalars=self.step_scalars)
            write_manifest(self.shard_dir, [meta])
            self.session = None
            return
        store = self._store_arg  # a Store, or any sink with new_session/extend_session
        notes = {"capture": {"run": self.run, "steps": self.step_no + 1, "options": repr(self.options)}}
        if self.options.timeline:
            notes["capture"].update(frames=self.frames, first_nonfinite_step=self.first_nonfinite_step)
        if self.session_arg:
            with store.extend_session(self.session_arg) as w:
                self.write_run(w)
                self.session = w.name
        else:
            with store.new_session(self.run, source=self.source, notes=notes) as w:
                self.write_run(w)
            self.session = w.name  # the name it got: made unique as the session is inserted

    def _write_step_shard(self, step_records, base, step=None) -> None:
        local = {}
        for pos, cmp in self.local_comparisons:
            if base <= pos < base + len(step_records):
                local[pos - base] = cmp
        meta = self.run_meta()
        path = write_shard(self.shard_dir, meta, step_records, rank=self.rank,
                           step=self.step_no if step is None else step,
                           local_comparisons=local)
        self.shard_files.append(path)


class CapturedRun(RunOutput):
    """A finished capture's records, comparisons, warnings and timeline (``Capture.detached()``), written
    with the same ``write_run`` as the capture itself."""

    FIELDS = ("run_id", "run", "kind", "source", "policy", "records", "local_comparisons", "warnings",
              "timeline_rows", "timeline_shares", "step_scalars")

    def __init__(self, fields: dict):
        for k in self.FIELDS:
            setattr(self, k, fields[k])
