"""Answers straight from a capture's shard folder, without ingesting it.

``open_shards`` checks the folder as ingest does (the manifest, or one rebuilt from the shards of a capture
that was cut off; every file from its metadata: inside the folder, within the limits, each column of its type)
and gives a ``Store`` in memory of its own whose records are the Parquet files themselves
(``store.parquet.over_shards``): the report, the origin analysis across ranks and the diagnoses then read
the columns and row groups they need where they lie.  A long run's timeline, small beside the records, is
read into the store as ingest reads it.  Nothing is written to any database.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..readers.shards import TEXT_MAX, ShardError, checked_runs, read_timeline
from ..records import RunInfo
from ..store import Store
from ..store.parquet import ShardRun, over_shards
from .diagnose import diagnose_session
from .ingest import add_timelines

__all__ = ["open_shards", "ShardError"]


def _run_info(meta: dict, root: Path) -> RunInfo:
    policy = meta.get("policy")
    return RunInfo(run_id=meta["run_id"], session_id="", name=meta["name"], dtype=meta.get("dtype") or "",
                   kind=meta.get("kind") or "candidate", parent_run_id=meta.get("parent_run_id"),
                   fix=meta.get("fix"), order=meta.get("order") or "execution", source=str(root),
                   policy=policy if policy is None or isinstance(policy, str) else json.dumps(policy))


def open_shards(root, *, diagnose: bool = True) -> tuple[Store, str]:
    """``(store, session name)``: the shard folder ``root`` as one session of a ``Store`` in memory that reads
    its records from the files in place.  ``diagnose``: run the diagnosis rules over it, as ingest does.
    Raises ``ShardError`` naming the file and the problem."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise ShardError(f"{root}: not a folder of shards")
    runs = checked_runs(root)
    if not any(run.files for run in runs):
        raise ShardError(f"{root}: no shard files (<run>/rank<R>/step<S>.parquet) to read")
    timeline = list(read_timeline(root))
    ids = {run.meta["run_id"] for run in runs}
    name = root.name or "shards"

    def write(store) -> None:
        nonlocal name
        with store.new_session(name, source=f"shards read in place: {root}") as w:
            for run in runs:
                w.add_run(_run_info(run.meta, root))
                for where, message in run.meta.get("warnings") or []:
                    w.add_warning(str(where), str(message), run_id=run.meta["run_id"])
            add_timelines(w, timeline, lambda key: key if key in ids else None)
        name = w.name

    try:
        parts = [ShardRun(run.meta["run_id"], run.files, run.columns) for run in runs]
        store = over_shards(root, parts, write, text_max=TEXT_MAX)
    except ValueError as e:
        raise ShardError(str(e)) from None
    if diagnose:
        try:
            diagnose_session(store, name)
        except Exception as e:  # the answers stand; say why there are no diagnoses
            with store.extend_session(name) as w:
                w.add_warning("diagnose", f"diagnosis rules failed: {type(e).__name__}: {e}")
    return store, name
