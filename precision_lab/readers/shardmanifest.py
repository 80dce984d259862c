"""The manifest of a shard folder: merged by each rank under a file lock as it writes, read and validated
(or rebuilt from the shards where a capture was cut off before writing it), and the files each run lists."""

from __future__ import annotations

import contextlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from .base import ReadError
from .safeio import check_regular, contained, read_json, relname
from .shardformat import (_NAME_OK, _ORDERS, _RUN_KEYS, _SHARD_RE, MANIFEST, SHARD_FORMAT, SHARD_VERSION, ShardError,
                          _check_run_name)
from ..display import visible
from ..stats import HIST_EDGES_ID


@contextlib.contextmanager
def _locked(root: Path):
    """An exclusive lock on ``<root>/.manifest.lock`` (ranks merge the manifest one at a time)."""
    lock = root / ".manifest.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - non-POSIX: best effort
            pass
        yield
    finally:
        os.close(fd)


def _scan_run(root: Path, name: str) -> tuple[list[int], list[int], list[str]]:
    ranks, steps, files = set(), set(), []
    run_dir = root / name
    for d in (run_dir, *(sorted(run_dir.iterdir()) if run_dir.is_dir() and not run_dir.is_symlink() else ())):
        if d.is_symlink():  # linked folders are never followed
            raise ShardError(f"{d.relative_to(root).as_posix()}: is a symbolic link; dumps are read without "
                             "following links")
    if run_dir.is_dir():
        for rdir in sorted(run_dir.iterdir()):
            m = _SHARD_RE[0].match(rdir.name)
            if not m or not rdir.is_dir():
                continue
            for f in sorted(rdir.iterdir()):
                ms = _SHARD_RE[1].match(f.name)
                if ms:
                    ranks.add(int(m.group(1)))
                    steps.add(int(ms.group(1)))
                    files.append(f.relative_to(root).as_posix())
    return sorted(ranks), sorted(steps), files


def write_manifest(root, runs, *, running_rank: Optional[int] = None, finished_rank: Optional[int] = None) -> Path:
    """Merge ``runs`` (run-meta dicts) into ``<root>/manifest.json``; returns its path.

    Runs are keyed by name: an entry already there (another rank's) keeps
    its fields and gains this call's ranks, steps and files, which are read
    from the folder itself.  A capture writes it as each step's shard is
    written (``running_rank``: listed in ``running_ranks``) and once more as
    it ends (``finished_rank``: taken off that list); a rank still listed
    when the folder is read was cut off.
    """

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / MANIFEST
    with _locked(root):
        if path.exists():
            doc = read_manifest(root)
        else:
            doc = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "runs": []}
        by_name = {r["name"]: r for r in doc["runs"]}
        for meta in runs:
            name = _check_run_name(meta.get("name"))
            entry = by_name.get(name)
            if entry is None:
                entry = {k: meta.get(k) for k in _RUN_KEYS}
                entry["warnings"] = []
                doc["runs"].append(entry)
                by_name[name] = entry
            else:
                for k in _RUN_KEYS:
                    if entry.get(k) in (None, "") and meta.get(k) not in (None, ""):
                        entry[k] = meta[k]
            for w in meta.get("warnings") or []:
                if w not in entry["warnings"]:
                    entry["warnings"].append(w)
            entry["ranks"], entry["steps"], entry["files"] = _scan_run(root, name)
            entry["hist_edges_id"] = HIST_EDGES_ID
            running = set(entry.get("running_ranks") or [])
            if running_rank is not None:
                running.add(int(running_rank))
            if finished_rank is not None:
                running.discard(int(finished_rank))
            entry["running_ranks"] = sorted(running)
        doc["created"] = doc.get("created") or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        tmp = path.with_name(f"{MANIFEST}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
    return path


def read_manifest(root) -> dict:
    """The validated manifest of a shard folder.

    Messages name files relative to ``root``; every file the manifest lists
    must stay inside ``root`` (see ``precision_lab.readers.safeio``).
    """
    root = Path(root)
    path = Path(MANIFEST)  # as named in messages
    if not os.path.lexists(root / MANIFEST):
        doc = _rebuilt_manifest(root)
        if doc is None:
            raise ShardError(f"{root / MANIFEST}: no manifest.json; not a Precision Lab shard folder")
    else:
        try:
            doc = read_json(root / MANIFEST, MANIFEST, root, what="manifest")
        except ReadError as e:
            raise ShardError(str(e)) from None
    if not isinstance(doc, dict) or doc.get("format") != SHARD_FORMAT:
        raise ShardError(f"{path}: \"format\" is {doc.get('format') if isinstance(doc, dict) else doc!r}, "
                         f"expected {SHARD_FORMAT!r}")
    v = doc.get("version")
    if not isinstance(v, int) or v < 1:
        raise ShardError(f"{path}: \"version\" must be a positive integer, got {v!r}")
    if v > SHARD_VERSION:
        raise ShardError(f"{path}: shard format version {v} is newer than this Precision Lab reads "
                         f"({SHARD_VERSION}); upgrade precision-lab")
    runs = doc.get("runs")
    if not isinstance(runs, list):
        raise ShardError(f"{path}: \"runs\" must be a list")
    seen = set()
    for i, r in enumerate(runs):
        _check_run_entry(path, i, r, seen)
    return doc


def _check_run_entry(path: Path, i: int, r, seen: set) -> None:
    """Refuse ``runs[i]`` of the manifest unless it is a run entry of a new, valid name whose listed files
    stay inside the shard folder; its name joins ``seen``."""
    if not isinstance(r, dict) or not isinstance(r.get("name"), str):
        raise ShardError(f"{path}: runs[{i}] must be an object with a \"name\"")
    try:
        _check_run_name(r["name"])
    except ShardError as e:
        raise ShardError(f"{path}: runs[{i}]: {e}") from None
    if r["name"] in seen:
        raise ShardError(f"{path}: run {r['name']!r} is listed twice")
    seen.add(r["name"])
    for key in _RUN_KEYS:  # what is stored as text is text (a policy may be an object)
        if key != "policy" and r.get(key) is not None and not isinstance(r[key], str):
            raise ShardError(f"{path}: runs[{i}] \"{key}\" must be a string, got {type(r[key]).__name__}")
    if r.get("order") and r["order"] not in _ORDERS:
        raise ShardError(f"{path}: runs[{i}] \"order\" is {visible(r['order'])[:40]!r}, not one of "
                         f"{', '.join(_ORDERS)}")
    files = r.get("files") or []
    if not isinstance(files, list):
        raise ShardError(f"{path}: runs[{i}] \"files\" must be a list")
    for f in files:
        if not isinstance(f, str) or f.startswith(("/", "\\")) or ".." in Path(f).parts:
            raise ShardError(f"{path}: runs[{i}] lists file {f!r} outside the shard folder")


def _rebuilt_manifest(root: Path) -> Optional[dict]:
    """A manifest for a shard folder that has none (its capture was killed before a step's manifest was
    written, or by a version that wrote it only at the end): each folder holding ``rank<R>/step<S>.parquet`` is
    a run of that name, none of its ranks finished.  None where no folder holds shards."""
    runs = []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if d.is_dir() and not d.is_symlink() and _NAME_OK.match(d.name) and any(d.glob("rank*/step*.parquet")):
            runs.append({"name": d.name, "warnings": [
                ["manifest.json", "the folder had no manifest.json (its capture was cut off): rebuilt from the "
                                  "shards, with the run's name from its folder and no kind, policy or order"]]})
    if not runs:
        return None
    return {"format": SHARD_FORMAT, "version": SHARD_VERSION, "runs": runs}


def _run_meta(entry: dict) -> dict:
    meta = {k: entry.get(k) for k in _RUN_KEYS}
    meta["run_id"] = meta["run_id"] or entry["name"]
    meta["kind"] = meta["kind"] or "candidate"
    meta["order"] = meta["order"] or "execution"
    meta["source"] = meta["source"] or "capture"
    meta["dtype"] = meta["dtype"] or ""
    meta["warnings"] = list(entry.get("warnings") or [])
    running = entry.get("running_ranks")
    if isinstance(running, list):  # a rank whose capture wrote steps and never ended was cut off
        for r in sorted({x for x in running if isinstance(x, int) and not isinstance(x, bool)}):
            meta["warnings"].append(["manifest.json", f"rank {r} of run {entry['name']!r} did not finish (its "
                                     "capture was cut off): the steps it wrote are read; its timeline, warnings "
                                     "and any later step are missing"])
    return meta


def _run_files(root: Path, entry: dict) -> list[Path]:

    try:
        listed = [contained(root, root, f, what="shard file", where=MANIFEST) for f in entry.get("files") or []]
    except ReadError as e:
        raise ShardError(str(e)) from None
    for p in listed:
        if not os.path.lexists(p):
            raise ShardError(f"{relname(root, p)}: listed in {MANIFEST} but missing")
    found = [root / f for f in _scan_run(root, entry["name"])[2]]
    files = {os.path.normpath(p): p for p in listed + found}
    for p in files.values():
        try:
            check_regular(p, relname(root, p))
        except ReadError as e:
            raise ShardError(str(e)) from None
    return sorted(files.values(), key=_file_order)


def _file_order(p: Path):
    r = _SHARD_RE[0].match(p.parent.name)
    s = _SHARD_RE[1].match(p.name)
    return (int(r.group(1)) if r else 0, int(s.group(1)) if s else 0, str(p))
