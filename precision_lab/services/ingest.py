"""Ingest dump folders (or ``.zip`` archives of them) into one session.

``ingest(paths, reference=..., store=...)`` reads every path with the reader
the registry picks for it (``precision_lab.readers``), writes one run per run
found (``kind="reference"`` for the reference paths, ``"candidate"`` for the
others, unless our own shard format says otherwise), pairs each candidate
with a reference and compares every pair (``services.pairing``), all inside
one transaction: any error leaves no session behind.

Memory stays bounded by the largest file plus ``cache_bytes``: each tensor
is dropped once its statistics are taken; reference tensors are kept in a
byte-bounded cache so that a candidate tensor can be compared with its exact
counterpart while it streams past; pairs found later (aligned names) re-read
their tensors from disk.  Tensors are stored in the database only with
``keep_tensors=True``.

What fails the whole ingest (``IngestError``, nothing written) and what is
skipped with a warning stored on the session:

- fails: a path that does not exist or is neither a folder nor a ``.zip``;
  an unsafe or corrupt zip (see ``precision_lab.safezip``); an empty folder
  or one no reader recognises; any data file that cannot be read (truncated,
  corrupt header, pickled objects refused by ``weights_only``, ``.bin``
  without sidecar or with a size that disagrees with it, invalid
  ``dump.json``) -- a silently missing tensor would misplace the first
  non-finite op, so a broken dump is not half-ingested.
- skipped with a warning: files of unsupported types in a tensor folder, a
  tensor file that msprobe's ``dump.json`` names but that is missing (the
  entry keeps the statistics ``dump.json`` recorded), tensors not listed in
  an order file (placed after the listed ones), ranks guessed from
  ``proc<PID>`` folders.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from ..readers import ReadError, RunSource, detect, dominant_dtype, ordered
from ..readers.dataorder import Hint, settle
from ..readers.safeio import ReadLimits, limits_in_force, plain_error
from ..readers.shardtimeline import RankTimeline
from ..records import INPUT_ROLES, free_name
from ..safezip import UnsafeZip, ZipLimits, safe_extract
from ..scratch import scratch_dir, sweep
from .pairing import Item, compare_pair, compare_runs, exact_key
from ..readers.generic import SUFFIXES
from .diagnose import diagnose_session

__all__ = ["ingest", "IngestError", "DEFAULT_CACHE_BYTES", "add_timelines"]

DEFAULT_CACHE_BYTES = 512 << 20

PathLike = Union[str, os.PathLike]
Progress = Callable[[int, int, str], None]


class IngestError(ValueError):
    """A dump cannot be ingested; the message names the file and the problem."""


class _TensorCache:
    """Reference tensors by (run_id, rid), least recently used dropped first."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self._d: collections.OrderedDict = collections.OrderedDict()

    @staticmethod
    def _nbytes(t) -> int:
        if hasattr(t, "nbytes"):
            return int(t.nbytes)
        return int(t.numel() * t.element_size())

    def put(self, key, t) -> None:
        n = self._nbytes(t)
        if n > self.budget:
            return
        while self.used + n > self.budget and self._d:
            _, old = self._d.popitem(last=False)
            self.used -= self._nbytes(old)
        self._d[key] = t
        self.used += n

    def get(self, key):
        t = self._d.get(key)
        if t is not None:
            self._d.move_to_end(key)
        return t


def _as_list(p) -> list:
    if p is None:
        return []
    if isinstance(p, (str, os.PathLike)):
        return [p]
    return list(p)


def _descend(root: Path) -> Path:
    """An archive of one folder: read the folder, not the wrapper."""
    while True:
        entries = [e for e in root.iterdir() if not e.name.startswith(".") and e.name != "__MACOSX"]
        # a layout reader (msprobe: step*/rank*) may need this very level
        wrapped = len(entries) == 1 and entries[0].is_dir()
        if wrapped and not any(r.detect(root) for r in ordered() if r.name != "generic"):
            root = entries[0]
        else:
            return root


def _folder_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            _check_utf8_name(root, dirpath, f)
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _check_utf8_name(root: Path, dirpath: str, name: str) -> None:
    """Names become op names and database text; bytes that are not UTF-8 cannot be stored."""
    path = os.path.join(dirpath, name)
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.path.relpath(path, root).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        raise IngestError(f"{shown}: the file name is not valid UTF-8; rename it (file names become op "
                          "names)") from None


def _unrecognised(root: Path, shown: str) -> str:
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    if not files:
        return f"{shown}: empty folder, nothing to ingest"
    kinds = collections.Counter(p.suffix.lower() or "(no extension)" for p in files)
    found = ", ".join(f"{k} ({n})" for k, n in kinds.most_common(6))
    return (f"{shown}: no tensor files found (found {found}); readable: msprobe dumps (dump.json), "
            f"precision-lab shards (manifest.json), or {', '.join(SUFFIXES)} files")


@dataclasses.dataclass
class _Source:
    path: Path  # as given
    root: Path  # folder to read
    reader: Any
    role: str  # reference | candidate
    label: str = ""  # how messages and the run's source name it


def ingest(
    paths: Union[PathLike, Sequence[PathLike]],
    *,
    reference: Union[PathLike, Sequence[PathLike], None] = None,
    session: Optional[str] = None,
    store,
    progress: Optional[Progress] = None,
    keep_tensors: bool = False,
    zip_limits: ZipLimits = ZipLimits(),
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    read_limits: Optional[ReadLimits] = None,
    labels: Optional[dict] = None,
    recipe: Optional[str] = None,
) -> str:
    """Read dump folders/zips into one new session; returns the session's name.

    ``paths``: the candidate dump(s); ``reference``: the fp32 reference
    dump(s) to compare against, or None (a folder of our own shards that
    holds both a reference and a candidate run is paired by itself).
    ``progress(done, total, label)`` is called as files are read (bytes) and
    then as the remaining pairs are compared (pairs); ``label`` says which.
    ``read_limits`` bound what any one dump file may make the reader hold
    (``precision_lab.readers.safeio``; default: its defaults).  ``labels``
    maps a given path to the name shown for it in messages and stored as the
    run's source (an upload's own name instead of the server folder it was
    written to).  Raises ``IngestError`` naming the file and the problem;
    whatever goes wrong while a file is read, the database is unchanged.  ``recipe``: the registered recipe
    the dump was made from (a sample's), recorded so the session can be re-run.
    """
    with limits_in_force(read_limits):
        return _ingest(paths, reference, session, store, progress, keep_tensors, zip_limits, cache_bytes,
                       {str(Path(k)): str(v) for k, v in (labels or {}).items()}, recipe)


def _ingest(paths, reference, session, store, progress, keep_tensors, zip_limits, cache_bytes, labels,
            recipe=None) -> str:
    cand_paths = [Path(p) for p in _as_list(paths)]
    ref_paths = [Path(p) for p in _as_list(reference)]
    if not cand_paths:
        raise IngestError("nothing to ingest: give at least one dump folder or .zip")
    tick_cb = progress or (lambda done, total, label: None)

    with contextlib.ExitStack() as stack:
        sources: list[_Source] = []
        for role, group in (("reference", ref_paths), ("candidate", cand_paths)):
            for p in group:
                sources.append(_open_source(p, role, stack, zip_limits, labels.get(str(p), str(p))))
        total = sum(_folder_bytes(s.root) for s in sources) or 1
        done = 0

        def tick(nbytes: Optional[int], label: str) -> None:
            """Advance by ``nbytes``; None: reading is over (files no reader needed count as read)."""
            nonlocal done
            done = total if nbytes is None else min(total, done + int(nbytes))
            tick_cb(done, total, label)

        name = session or _session_name(sources)
        source_text = "; ".join(f"{s.role}: {s.label}" for s in sources)
        with store.new_session(name, source=source_text, recipe=recipe) as w:
            try:
                notes = _Ingestion(w, sources, tick, keep_tensors, cache_bytes, progress).run()
            except ReadError as e:  # re-reading a tensor to compare it
                raise IngestError(str(e)) from None
            except (IngestError, KeyboardInterrupt, SystemExit):
                raise
            except (RecursionError, MemoryError, OverflowError) as e:
                shown = ", ".join(s.label for s in sources)
                raise IngestError(f"{shown}: {plain_error(e)}") from None
            w.set_notes(notes)
        name = w.name  # the name it got: made unique as the session is inserted
        try:
            diagnose_session(store, name)
        except Exception as e:  # the ingested session stands; say why it has no diagnoses
            with store.extend_session(name) as w:
                w.add_warning("diagnose", f"diagnosis rules failed: {type(e).__name__}: {e}")
        return name


def _open_source(p: Path, role: str, stack: contextlib.ExitStack, limits: ZipLimits, label: str) -> _Source:
    if not p.exists():
        raise IngestError(f"{label}: no such file or folder")
    if p.is_file():
        if p.suffix.lower() != ".zip":
            raise IngestError(f"{label}: a single file; give the folder that holds the dump, or a .zip of it")
        # extracted under the scratch folder, whose leftovers (of ingests killed mid-way) are swept first
        sweep()
        tmp = stack.enter_context(scratch_dir("extract"))
        try:
            # the folder takes the archive's name: it names the run
            root = safe_extract(p, Path(tmp) / (p.stem or "dump"), limits)
        except UnsafeZip as e:
            raise IngestError(str(e).replace(str(p), label, 1)) from None
        except OSError as e:
            raise IngestError(f"{label}: cannot be extracted ({e.strerror or e})") from None
        root = _descend(root)
    elif p.is_dir():
        root = p
    else:
        raise IngestError(f"{label}: neither a folder nor a .zip file")
    try:
        reader = detect(root)
    except (ReadError, OSError, ValueError, RecursionError) as e:
        raise IngestError(f"{label}: cannot be read ({plain_error(e)})") from None
    if reader is None:
        raise IngestError(_unrecognised(root, label))
    return _Source(p, root, reader, role, label)


def _check_text(rec) -> None:
    """Names become database text: a lone surrogate (valid JSON, invalid UTF-8) is refused, naming the file."""
    for field in ("op", "op_type", "role", "index", "source"):
        v = getattr(rec, field)
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ReadError(f"{ascii(rec.source or '?')[1:-1]}: {field} {v!a} is not valid UTF-8 text "
                                "(it holds a lone surrogate); refusing the dump") from None


def _session_name(sources: list[_Source]) -> str:
    def stem(s: _Source) -> str:
        n = Path(s.label).name or s.path.name
        return n[:-4] if n.lower().endswith(".zip") else n

    cands = [stem(s) for s in sources if s.role == "candidate"]
    refs = [stem(s) for s in sources if s.role == "reference"]
    name = "+".join(cands)
    if refs:
        name += "-vs-" + "+".join(refs)
    return name


@dataclasses.dataclass
class _Run:
    run_id: str
    name: str
    src: RunSource
    source: _Source
    kind: str
    items: list = dataclasses.field(default_factory=list)
    dtypes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_key: dict = dataclasses.field(default_factory=dict)  # exact_key -> Item (reference runs)


class _Ingestion:
    """One ingest inside one open session transaction."""

    def __init__(self, w, sources, tick, keep_tensors: bool, cache_bytes: int, progress):
        self.w, self.sources, self.tick = w, sources, tick
        self.keep_tensors = keep_tensors
        self.cache = _TensorCache(cache_bytes)
        self.progress = progress
        self.runs: dict[tuple[int, str], _Run] = {}
        self.order: list[_Run] = []
        self.precomputed: dict[tuple[str, str], dict] = collections.defaultdict(dict)

    # -- reading
    def run(self) -> dict:
        for si, s in enumerate(self.sources):
            try:
                for src in s.reader.iter_runs(s.root, self.tick):
                    self._read(si, s, src)
                if hasattr(s.reader, "local_comparisons"):
                    self._local(si, s.reader.local_comparisons(s.root))
                if hasattr(s.reader, "timeline"):
                    self._timeline(si, s.reader.timeline(s.root))
            except ReadError as e:
                where = "archive" if s.path.is_file() else "dump"
                raise IngestError(f"{e} (in {where} {s.label})") from None
            except IngestError:
                raise
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - the boundary: a reader's bug or an exotic file
                where = "archive" if s.path.is_file() else "dump"
                raise IngestError(f"{s.label}: the {where} cannot be read ({plain_error(e)})") from None
        self.tick(None, "read")
        for (si, _key), r in self.runs.items():
            self._order_from_data(r)
            if not r.src.dtype:
                r.src.dtype = dominant_dtype(r.dtypes)
                self.w.set_run_dtype(r.run_id, r.src.dtype)
            parent = self.runs.get((si, r.src.parent_key)) if r.src.parent_key else None
            if parent is not None:  # a re-run captured under a fix names the run it was made from
                self.w.set_run_parent(r.run_id, parent.run_id)
        pairs = self._pairs()
        summaries = {}
        for ref, cand in pairs:
            summ = compare_runs(
                self.w, ref.items, cand.items, ref_run_id=ref.run_id, cand_run_id=cand.run_id,
                load=self._load, precomputed=self.precomputed[(ref.run_id, cand.run_id)], progress=self.progress,
                run_dtype=cand.src.dtype,
            )
            summaries[f"{cand.name} vs {ref.name}"] = {
                "matches": summ.matches, "verdicts": summ.verdicts, "kinds": summ.kinds}
        return {
            "ingest": {
                "runs": {r.name: {"run_id": r.run_id, "kind": r.kind, "reader": r.src.reader,
                                      "source": r.source.label, "records": len(r.items),
                                      "order": r.src.order, "order_from": r.src.order_note}
                         for r in self.order},
                "pairs": [{"reference": a.name, "candidate": b.name} for a, b in pairs],
                "comparisons": summaries,
            }
        }

    def _read(self, si: int, s: _Source, src: RunSource) -> None:
        key = (si, src.key)
        run = self.runs.get(key)
        if run is None:
            kind = "reference" if s.role == "reference" else (src.kind or "candidate")
            name = self._run_name(src.name)
            run_id = self.w.add_run(name=name, dtype=src.dtype or "", kind=kind, parent_run_id=None, fix=src.fix,
                                    policy=src.policy, source=s.label, order=src.order)
            run = _Run(run_id, name, src, s, kind)
            self.runs[key] = run
            self.order.append(run)
        partner = self._partner_for(run) if run.kind != "reference" else None
        pre = self.precomputed[(partner.run_id, run.run_id)] if partner is not None else None
        for rec in src.records:
            _check_text(rec)
            tensor = rec.tensor
            rec.run_id = run.run_id
            if not self.keep_tensors:
                rec.tensor = None
            rid = self.w.add_record(rec)
            rec.tensor = None
            if rec.stats.hist is not None:
                rec.stats = dataclasses.replace(rec.stats, hist=None)  # pairing needs the summary only
            item = Item(rid, rec, has_data=tensor is not None)
            run.items.append(item)
            run.dtypes[rec.stats.dtype or ""] += 1
            if tensor is None:
                continue
            if run.kind == "reference":
                run.by_key.setdefault(exact_key(rec), item)
                self.cache.put((run.run_id, rid), tensor)
            elif partner is not None:
                ref_item = partner.by_key.get(exact_key(rec))
                if ref_item is not None and ref_item.has_data and ref_item.shape == item.shape:
                    ref_t = self._load(partner.run_id, ref_item)
                    if ref_t is not None:
                        pre[(ref_item.rid, rid)] = compare_pair(ref_item, item, ref_t, tensor,
                                                                run_dtype=src.dtype)
            del tensor
        for file, msg in src.warnings:
            self.w.add_warning(file, msg, run_id=run.run_id)
        src.warnings.clear()

    def _order_from_data(self, r: "_Run") -> None:
        """A dump whose reader left the order to the data (``RunSource.digests`` and ``hints``): put its order
        list, file times, output -> input links and containers together (``readers.dataorder.settle``);
        renumber the run's records so, record the containers found, and say which order was used."""
        if not r.src.digests:
            return
        digests, hints = r.src.digests, r.src.hints
        listed_from = r.src.order_note.removeprefix("execution order from ") if r.src.order == "execution" else ""
        keys = collections.defaultdict(list)  # (step, rank) -> items in their current order
        for it in sorted(r.items, key=lambda it: it.record.seq):
            keys[(it.record.step, it.record.rank)].append(it)
        found, parents, said = {}, {}, None
        for group, items in keys.items():
            entries = []
            for it in items:
                rec = it.record
                k = group + (rec.op, rec.role, rec.index)
                listed, tick = hints.get(k, (None, None))
                st = rec.stats
                n = st.numel or 1
                entries.append(Hint(rec.op, rec.role, digests.get(k), tick, listed,
                                    ((st.nan_count or 0) + (st.inf_count or 0)) / n, (st.nan_count or 0) / n))
            got = settle(entries, listed_from=listed_from)
            found[group] = got.rank
            parents.update(got.parents)
            said = said or got
        r.src.digests, r.src.hints = {}, {}
        if said is None:
            return
        seqs: dict[int, int] = {}
        ranked = sorted(r.items, key=lambda it: (it.record.step, it.record.rank,
                                                 found.get((it.record.step, it.record.rank), {}).get(it.record.op, 0),
                                                 it.record.role not in INPUT_ROLES, it.record.seq))
        i, group = 0, None
        for it in ranked:  # numbered from 0 in each step and rank, as the dump's own order list numbers them
            if (it.record.step, it.record.rank) != group:
                i, group = 0, (it.record.step, it.record.rank)
            if it.record.seq != i:
                seqs[it.rid] = i
            it.record.seq = i
            i += 1
        r.src.order, r.src.order_note = said.kind, said.note
        self.w.set_run_order(r.run_id, said.kind, seqs)
        if parents:
            self.w.set_op_parents(r.run_id, parents)

    def _local(self, si: int, comparisons) -> None:
        """Store the local (own fp32 re-run) comparisons a dump carries, on the records they belong to."""
        index: dict[str, dict] = {}
        for key, rec, cmp in comparisons:
            run = self.runs.get((si, key))
            if run is None:
                continue
            by_name = index.get(run.run_id)
            if by_name is None:
                by_name = index[run.run_id] = {exact_key(it.record): it for it in run.items}
            item = by_name.get(exact_key(rec))
            if item is None:
                continue
            r = item.record
            self.w.add_comparison(kind="local", ref_run_id=run.run_id, ref_rid=None, cand_run_id=run.run_id,
                                  cand_rid=item.rid, step=r.step, rank=r.rank, seq=r.seq, op=r.op, role=r.role,
                                  index=r.index, match="exact", comparison=cmp)

    def _timeline(self, si: int, parts) -> None:
        """Store a long run's per-step summaries (``add_timelines``) on the runs stored for them."""
        add_timelines(self.w, parts, lambda key: getattr(self.runs.get((si, key)), "run_id", None))

    def _run_name(self, name: str) -> str:
        return free_name(name, {r.name for r in self.order})

    def _load(self, run_id: str, item: Item):
        t = self.cache.get((run_id, item.rid))
        if t is not None:
            return t
        run = next(r for r in self.order if r.run_id == run_id)
        return run.src.load(item.record.source)

    # -- pairing runs
    def _refs(self) -> list[_Run]:
        return [r for r in self.order if r.kind == "reference"]

    def _partner_for(self, cand: _Run) -> Optional[_Run]:
        """The reference run a candidate is compared with (see ``_pairs``)."""
        refs = self._refs()
        if not refs:
            return None
        if len(refs) == 1:
            return refs[0]
        for r in refs:
            if r.src.name == cand.src.name:  # same run name in both dumps
                return r
        cands = [r for r in self.order if r.kind != "reference"]
        pos = cands.index(cand) if cand in cands else len(cands)
        return refs[pos] if pos < len(refs) else refs[0]

    def _pairs(self) -> list[tuple[_Run, _Run]]:
        """One reference: every other run against it.  Several: by run name,
        else by position (k-th candidate with k-th reference), else the first."""
        return [(p, c) for c in self.order if c.kind != "reference" for p in [self._partner_for(c)] if p]


def add_timelines(w, parts: Iterable[RankTimeline], run_id_of) -> None:
    """Store a long run's per-step summaries (each rank's, its Arrow tables as read, ``run_id`` the run's key in
    the source) with writer ``w``: each rank's ``tid`` numbers moved past the run's others and every row given
    the stored run's id (``run_id_of(key)``; None: not stored)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def moved(t, rid: str, base: Optional[int]):
        t = t.set_column(t.column_names.index("run_id"), "run_id", pa.array([rid] * t.num_rows, pa.string()))
        if base is not None:
            t = t.set_column(t.column_names.index("tid"), "tid", pc.add(t.column("tid"), base))
        return t

    next_tid: dict[str, int] = {}
    for part in parts:
        rid = run_id_of(part.run_id)
        if rid is None:
            continue
        base = next_tid.get(rid, 0)
        w.add_timeline_tables(timeline=moved(part.rows, rid, base), timeline_formats=moved(part.shares, rid, base),
                              step_scalars=moved(part.scalars, rid, None))
        top = pc.max(part.rows.column("tid")).as_py() if part.rows.num_rows else None
        next_tid[rid] = base + (-1 if top is None else top) + 1
