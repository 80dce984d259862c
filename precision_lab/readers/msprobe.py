"""Ascend msprobe dumps (PyTorch; statistics and tensor modes).

Layout: ``<dump>/step<N>/<rank<R>|proc<PID>>/dump.json`` (a folder holding
``dump.json`` directly, or ``<rank>/dump.json``, is read too), plus
``dump_tensor_data/*.pt`` beside ``dump.json`` in tensor mode.  One dump
folder is one run; steps and ranks become record fields.  ``proc<PID>``
folders carry no rank: a single one is rank 0, several are numbered 0, 1,
... in PID order (with a warning, since the true rank is unknown).

Entries of ``dump.json``'s ``data`` map become records, in the file's order
(msprobe writes them in execution order; ``seq`` is the entry's position):

- ``Functional.linear.3.forward`` -> op the key, op_type ``linear``;
  ``Tensor.__add__.1.backward`` -> op_type ``add``;
  ``Module.blocks.0.fc1.Linear.forward.0`` -> op_type ``Linear``.
- forward: ``input_args[i]`` -> role ``input`` index ``i`` (nested lists
  give ``i.j``), ``input_kwargs[k]`` -> ``kwarg`` ``k``, ``output[i]`` ->
  ``output`` ``i``, a Module's ``parameters[p]`` -> ``param`` ``p``.
- backward: msprobe's ``input`` is the gradient flowing into the backward
  op, i.e. the gradient of the forward op's output: role ``grad_output``;
  its ``output`` is the gradient of the forward op's inputs: role
  ``grad_input``.  ``Module.<path>.<Class>.parameters_grad.<n>`` entries give
  role ``param_grad`` with the parameter name as index.

Statistics-only entries keep the Max/Min/Mean/Norm msprobe computed (in the
tensor's own dtype, so an fp16 Norm can be Infinity while every value is
finite) and have no histogram.  Tensor-mode entries get full statistics from
the tensor, read by ``tensorfile`` (the loader every path uses).  A tensor file
named by ``data_name`` but missing falls back to the entry's statistics with
a warning; an unreadable one fails the read.

``construct.json`` beside a ``dump.json`` maps each entry to the module call
it ran in (``Functional.linear.3.forward`` ->
``Module.blocks.0.fc1.Linear.forward.0``); it becomes the records'
``parent``, so a functional op is known to run inside its module (and the
module's parameters are its inputs).  Without it, nesting comes from names.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Iterator, Optional

from ..ops import parse_op
from ..records import TensorRecord, code_location
from .base import RANK_RE, STEP_RE, ReadError, RunSource, Tick, dominant_dtype, natural_key
from .safeio import check_regular, contained, limits, read_json, reading, relname
from .tensorfile import load_source, read_tensors
from ..stats import TensorStats, canonical_dtype, tensor_stats

__all__ = ["MsprobeReader", "dump_files"]

_PROC_RE = re.compile(r"^proc(\d+)$")


def dump_files(root: Path) -> list[tuple[int, str, Path]]:
    """``(step, rank_folder_name, dump.json path)`` for every dump.json up to two levels down.

    A dump.json that is a link, or sits in a linked folder, or is not a
    regular file, is refused (ReadError): links are never followed.
    """
    found = []
    for pattern in ("dump.json", "*/dump.json", "*/*/dump.json"):
        for p in root.glob(pattern):
            rel = relname(root, p)
            linked = next((q for q in [p, *p.parents] if q != root and root in q.parents and q.is_symlink()), None)
            if linked is not None:
                raise ReadError(f"{relname(root, linked)}: is a symbolic link; dumps are read without following "
                                "links")
            check_regular(p, rel)
            step = 0
            for part in p.relative_to(root).parts[:-1]:
                m = STEP_RE.match(part)
                if m:
                    step = int(m.group(1))
            rank_dir = p.parent.name if p.parent != root else ""
            found.append((step, rank_dir, p))
    found.sort(key=lambda t: (t[0], natural_key(t[1]), str(t[2])))
    return found


def _ranks(files: list[tuple[int, str, Path]]) -> tuple[dict[Path, int], list[str]]:
    """Rank of each dump.json, and warnings where it had to be guessed."""
    ranks, warnings = {}, []
    by_step: dict[int, list[tuple[str, Path]]] = {}
    for step, rdir, p in files:
        by_step.setdefault(step, []).append((rdir, p))
    for step, entries in by_step.items():
        procs = sorted((int(_PROC_RE.match(r).group(1)), p) for r, p in entries if _PROC_RE.match(r))
        for i, (_pid, p) in enumerate(procs):
            ranks[p] = i
        if len(procs) > 1:
            warnings.append(f"step {step}: {len(procs)} proc<PID> folders carry no rank; numbered 0..{len(procs) - 1} "
                            "in PID order")
        for r, p in entries:
            m = RANK_RE.match(r)
            if m:
                ranks[p] = int(m.group(1))
            ranks.setdefault(p, 0)
    return ranks, warnings


def _dtype(s) -> str:
    return canonical_dtype(s) if s else ""


def _num(v) -> Optional[float]:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:  # an integer beyond any float: not a statistic we can hold
            return None
    return None


def _is_tensor_entry(d) -> bool:
    return isinstance(d, dict) and "shape" in d and "dtype" in d and (
        "Tensor" in str(d.get("type", "")) or "ndarray" in str(d.get("type", "")))


def _flatten(items, prefix: str = "") -> Iterator[tuple[str, dict]]:
    """(index, stat dict) of every tensor in a (possibly nested) list of items."""
    if isinstance(items, dict):
        items = [items]
    elif items is not None and not isinstance(items, (list, tuple)):
        raise ReadError(f"holds {type(items).__name__} {_short(items)} where a list of arguments belongs")
    for i, it in enumerate(items or ()):
        idx = f"{prefix}{i}"
        if isinstance(it, (list, tuple)):
            yield from _flatten(it, idx + ".")
        elif _is_tensor_entry(it):
            yield idx, it


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _mapping(v, field: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ReadError(f"{field} is {type(v).__name__} {_short(v)}, not an object of named arguments")
    return v


def _slots(key: str, entry: dict, direction: str) -> Iterator[tuple[str, str, dict]]:
    """(role, index, stat dict) of every tensor of one data entry; a field of the wrong type is a ReadError
    (a tensor silently dropped could misplace the first non-finite op)."""
    if ".parameters_grad." in key or key.endswith(".parameters_grad"):
        for pname, v in entry.items():
            for idx, d in _flatten(v):
                yield "param_grad", (pname if idx == "0" else f"{pname}.{idx}"), d
        return
    if direction == "backward":
        for role, field in (("grad_output", "input"), ("grad_output", "input_args"), ("grad_input", "output")):
            for idx, d in _flatten(entry.get(field)):
                yield role, idx, d
        return
    for idx, d in _flatten(entry.get("input_args")):
        yield "input", idx, d
    for k, v in _mapping(entry.get("input_kwargs"), "input_kwargs").items():
        for idx, d in _flatten(v):
            yield "kwarg", (k if idx == "0" else f"{k}.{idx}"), d
    for idx, d in _flatten(entry.get("output")):
        yield "output", idx, d
    for pname, v in _mapping(entry.get("parameters"), "parameters").items():
        for idx, d in _flatten(v):
            yield "param", (pname if idx == "0" else f"{pname}.{idx}"), d


def _shape(d: dict, where: str) -> tuple:
    """The entry's shape, checked: non-negative sizes whose product a tensor can hold."""
    shape = d.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ReadError(f"{where}: shape {shape!r} is not a list of sizes")
    numel = 1
    for s in shape:
        numel *= s
    if numel > (1 << 63) - 1:
        raise ReadError(f"{where}: shape {list(shape)} has more elements than any tensor can hold")
    if any(s > (1 << 63) - 1 for s in shape):  # a size too large, times an empty one
        raise ReadError(f"{where}: shape {list(shape)} has a size larger than any tensor can have")
    return tuple(shape)


def _summary(d: dict, rel: str, entry: str, warn: Callable[[str], None]):
    """Summary-only stats of tensor ``entry`` of dump file ``rel``.

    A statistic that is present but not a number is stored as missing and
    ``warn(message)`` is told which one, so the gap is visible.
    """
    where = f"{rel}: {entry}"

    shape = _shape(d, where)
    values = {}
    for key in ("Min", "Max", "Mean", "Norm"):
        raw = d.get(key)
        values[key] = _num(raw)
        if raw is not None and values[key] is None:
            warn(f"{entry}: statistic {key} is {raw!r}, not a number; stored as missing")
    return TensorStats.summary_only(
        dtype=_dtype(d.get("dtype")), shape=tuple(shape), min=values["Min"], max=values["Max"],
        mean=values["Mean"], l2norm=values["Norm"],
    )


def _entry_slots(rel: str, key: str, entry, direction: str) -> list:
    """The entry's tensors, or a ReadError naming the file and the entry."""
    where = f"{rel}: entry {key!r}"
    if not isinstance(entry, dict):
        raise ReadError(f"{where} is not an object")
    try:
        with reading(where):
            return list(_slots(key, entry, direction))
    except ReadError as e:
        msg = str(e)
        raise ReadError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _parse(root: Path, path: Path) -> dict:
    rel = relname(root, path)
    doc = read_json(path, rel, root, what="dump.json")  # accepts msprobe's bare NaN / Infinity tokens
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise ReadError(f"{rel}: not an msprobe dump (no \"data\" object at the top level)")
    n, cap = len(doc["data"]), limits().max_file_records
    if n > cap:
        raise ReadError(f"{rel}: {n} entries, more than the limit of {cap} per file (max_file_records)")
    return doc


def _doc_dtype(doc: dict, rel: str) -> str:
    """The compute dtype of a dump: the dtype most of its tensors have."""
    counts: dict[str, int] = {}
    for key, entry in doc["data"].items():
        if isinstance(entry, dict):
            for _role, _idx, d in _entry_slots(rel, key, entry, parse_op(key)[1]):
                dt = _dtype(d.get("dtype"))
                counts[dt] = counts.get(dt, 0) + 1
    return dominant_dtype(counts)



def _sidecar(root: Path, path: Path, src: RunSource, *, what: str, without: str):
    """A JSON object msprobe writes beside a dump.json (construct.json, stack.json), or None: missing is
    quiet; a file that cannot be used is a warning ending in ``without`` (what the records then go without),
    never a failure -- the records stand without it."""
    if not os.path.lexists(path):
        return None
    rel = relname(root, path)
    try:
        doc = read_json(path, rel, root, what=what)
    except ReadError as e:
        src.warnings.append((rel, f"{e}; {without}"))
        return None
    if not isinstance(doc, dict):
        src.warnings.append((rel, f"not a JSON object of entries; {without}"))
        return None
    return doc


def _parents(root: Path, path: Path, src: RunSource) -> dict[str, str]:
    """msprobe's ``construct.json``: each entry's enclosing module call (``{}`` without one)."""
    doc = _sidecar(root, path, src, what="construct.json", without="op nesting taken from names only") or {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str) and len(v) <= 4096}


_FRAME = re.compile(r"^File (.+?), line (\d+), in ([^,\n]+)")
# frames of these packages are the tools', not the user's code
_TOOL_DIRS = ("/torch/", "/msprobe/", "/torch_npu/", "\\torch\\", "\\msprobe\\")


def _locations(root: Path, path: Path, src: RunSource) -> dict[str, str]:
    """msprobe's ``stack.json``: each entry's calling line of user code (the first frame outside torch and
    msprobe)."""
    doc = _sidecar(root, path, src, what="stack.json", without="op locations not shown") or {}
    out: dict[str, str] = {}
    for entry in doc.values():
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, list) for x in entry)):
            continue
        keys, frames = entry
        where = None
        for fr in frames:
            m = _FRAME.match(fr) if isinstance(fr, str) else None
            if m and not any(d in m.group(1) for d in _TOOL_DIRS):
                where = code_location(m.group(1), int(m.group(2)), m.group(3).strip())
                break
        if where is not None:
            out.update((k, where) for k in keys if isinstance(k, str))
    return out


class MsprobeReader:
    name = "msprobe"
    priority = 80

    def detect(self, root: Path) -> bool:
        return root.is_dir() and bool(dump_files(root))

    def iter_runs(self, root: Path, tick: Tick) -> Iterator[RunSource]:
        files = dump_files(root)
        ranks, rank_warnings = _ranks(files)
        # the first dump.json is parsed up front: its dtypes give the run's
        # compute dtype before any tensor streams past (verdicts need it)
        first = _parse(root, files[0][2])
        src = RunSource(
            key=root.name or "msprobe", name=root.name or "msprobe", root=root, reader=self.name,
            records=iter(()), order="execution", order_note="dump.json entry order (msprobe writes in execution order)",
            dtype=_doc_dtype(first, relname(root, files[0][2])), loader=lambda source: self._load(root, source),
        )
        src.warnings.extend((str(root), w) for w in rank_warnings)
        src.records = self._records(root, files, ranks, src, tick, first)
        yield src

    def _load(self, root: Path, source: str):
        return load_source(root, source) if source.endswith(".pt") else None

    def _records(self, root: Path, files, ranks, src: RunSource, tick: Tick, first: dict) -> Iterator[TensorRecord]:
        for i, (step, _rdir, path) in enumerate(files):
            rel = relname(root, path)
            rank = ranks[path]
            doc = first if i == 0 else _parse(root, path)
            parents = _parents(root, path.parent / "construct.json", src)
            locations = _locations(root, path.parent / "stack.json", src)
            data_dir = path.parent / "dump_tensor_data"
            tick(os.lstat(path).st_size, rel)
            for seq, (key, entry) in enumerate(doc["data"].items()):
                if not isinstance(entry, dict):
                    raise ReadError(f"{rel}: entry {key!r} is not an object")
                op_type, direction = parse_op(key)
                slots = _entry_slots(rel, key, entry, direction)
                for role, index, d in slots:
                    tensor, stats, source = None, None, rel
                    data_name = d.get("data_name")
                    if data_name:
                        tpath = contained(root, data_dir, data_name, what=f"data_name of {key}", where=rel)
                        trel = relname(root, tpath)
                        if os.path.lexists(tpath):
                            tensors = list(read_tensors(tpath, trel, root))
                            if len(tensors) != 1 or tensors[0][0] != "":
                                raise ReadError(f"{trel}: holds {len(tensors)} tensors in a container, expected "
                                                "one tensor")
                            tensor = tensors[0][1]
                            shape = d.get("shape")
                            if isinstance(shape, list) and list(tensor.shape) != shape:
                                raise ReadError(f"{trel}: tensor shape {list(tensor.shape)} differs from the shape "
                                                f"{shape} that dump.json records for {key}")
                            try:
                                stats = tensor_stats(tensor)
                            except Exception as e:  # unusual dtypes (complex, sparse): say which file
                                raise ReadError(f"{trel}: cannot compute statistics of a {tensor.dtype} tensor "
                                                f"({e})") from None
                            source = trel
                            tick(os.lstat(tpath).st_size, trel)
                        else:
                            src.warnings.append((trel, f"file named by {key} is missing; used the statistics "
                                                       "recorded in dump.json instead"))
                    if stats is None:
                        stats = _summary(d, rel, f"{key} {role} {index}",
                                         lambda msg, rel=rel: src.warnings.append((rel, msg)))
                    yield TensorRecord(run_id="", seq=seq, op=key, op_type=op_type, role=role, index=index,
                                       stats=stats, step=step, rank=rank, direction=direction, source=source,
                                       parent=parents.get(key), location=locations.get(key), tensor=tensor)

