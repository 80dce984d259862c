"""Generic tensor folders: ``.npy``, ``.npz``, ``.pt``/``.pth``, ``.safetensors``,
and raw ``.bin`` files with a JSON sidecar.

Names.  A tensor's name is its file's path relative to the folder without
the extension, ``/`` written as ``.``, followed by ``.<key>`` for each entry
of a container file (``.npz``, ``.safetensors``, a ``.pt`` holding a dict or
list; nested keys are joined with ``.``).  A folder whose only data file is
one container contributes just the keys.  Folders named ``step<N>`` and
``rank<R>`` (also ``step_000``, ``step-3``, ``rank_1``) set the record's step and rank and are left out of the
name.
Names of the form ``<op>.<role>.<index>`` (role ``input``, ``output``,
``kwarg``, ``param``, ``buffer`` (a module's floating buffer, e.g.
BatchNorm's ``running_mean``, read like a parameter), ``grad_input``,
``grad_output``, ``param_grad``) fill op, role and index; any other name
becomes op ``<name>`` with role ``tensor``.

Layouts of one file per module call: a container whose keys are all role names as hook writers spell them
(``CALL_KEYS``: ``input``/``inputs``/``args``/``x``, ``output``/``outputs``/``out``/``y``, ``grad_input``,
``grad_output``; a position after ``_`` or ``.``: ``input_0``, ``args.1``), one of them not an input:
``np.savez(f, input=x, output=y)``, ``torch.save({"input": x, "output": y})``, a ``.safetensors``; and
``torch.save((args, out))`` give ``<module>.input.<i>`` and ``<module>.output.<j>``; so do the calls one level
down in one file (``torch.save({name: {"input": x, "output": y}})``: ``nested_calls``) and a folder per call
whose files are named as roles (``fc/input.pt``, ``fc/output.pt``: ``call_folders``).  A key that is no role
name keeps every key of its file a tensor name.  A root saved as ``input.0``/``output.0`` (no module
name) is op ``""``, which holds every other op.

Order.  Every source the dump has, put together by
``dataorder.settle`` when the run is ingested:  1. An explicit list: ``manifest.json``
or ``order.json`` holding a list, or an object with the list under the first
present key of ``order``, ``execution_order``, ``module_order`` or
``call_order``; or ``order.txt`` (one name per line).  Entries name tensors
(with or without their file extension) or ops/modules (an entry covers every
tensor of that op, inputs before outputs); a list of modules in call order
(pre-order) or completion order (post-order) is recognised and said; ops it
leaves out are placed by the sources below, not by name.  A list that is not a
list of names, names nothing in the dump, or names an entry twice gets one
warning; the run then uses the rest.  Without a list, call numbers that begin the file names
(``000-fc.npz``, ``001_act.npy``, ``12.head.npy``: a hook counting its calls) are the order when every data
file of their folder (all but one in ten) carries one and each number names one op (``call_numbers``).
2. File modification times: files
oldest first; files sharing a time are ordered by the data.  3. The data:
an output bit-identical to a later input (``dataorder``), and containers (an
output bit-identical to another op's output).  What stays tied goes by the
fewest non-finite values, then by name.  ``RunSource.order`` says which was
used (``execution``, ``mtime``, ``data``, or ``name`` when none says
anything: order unknown) and ``order_note`` which parts are certain.

Original dtypes.  bf16/fp8 tensors saved as float32 (numpy has no bf16;
``t.float().numpy()``) are read in their original format when
``manifest.json`` holds ``{"dtypes": {"<tensor, module or file name>":
"bfloat16"}}``, or a file has a JSON sidecar of its own (``x.json`` or
``x.npy.json`` beside ``x.npy``) holding ``{"dtype": "bfloat16"}`` (it wins
over the manifest for that file): the record's dtype, statistics and format
overlays are then the original's.  Every value must be exactly representable in that dtype;
where one is not, the sidecar is wrong and the tensor is kept as saved, with
one warning naming it.  With no dtype given, float32 tensors whose values are all fp16 (or bf16) values, with
enough of them that it is not by chance (``_Evidence``), are read as fp16 (bf16) the same way, and one warning
says the values look like fp16 saved as float32.

Raw ``.bin``: ``x.bin`` needs ``x.json`` or ``x.bin.json`` holding
``{"dtype": "float16", "shape": [4, 8]}`` (optional ``"byteorder"``:
``"little"``/``"big"``, ``"offset"``: bytes to skip).  The file size must
match exactly.  dtype names are numpy's or ml_dtypes' (``bfloat16``,
``float8_e4m3fn``, ...).

Failures.  A data file that cannot be read (truncated, corrupt header,
pickled Python objects, a ``.bin`` without sidecar or with a size that
disagrees with it) fails the read with a message naming the file: a dump
with a silently missing tensor would misplace the first non-finite op.
Files of other types are skipped with a warning.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from ..display import num_text
from ..formats import canonical_dtype, numpy_dtype_named
from ..records import TensorRecord
from .calllayout import _file_calls, _record_fields, _tensor_name, call_folders, call_numbers
from .dataorder import digest
from .base import RANK_RE, STEP_RE, ReadError, RunSource, Tick, first_line, natural_key
from .safeio import limits, open_regular, read_json, relname
from .saveddtype import SAVED_FROM, TELLING_VALUES, _as_dtype, _Evidence, _float32, _native, _read_back
from .tensorfile import CONTAINERS, SUFFIXES, bin_sidecars, load_source, read_tensors
from ..stats import tensor_stats

__all__ = ["GenericReader", "SUFFIXES", "ORDER_FILES", "ORDER_KEYS", "scan"]

ORDER_FILES = ("manifest.json", "order.json", "order.txt")
ORDER_KEYS = ("order", "execution_order", "module_order", "call_order")  # in a manifest object, first present wins
DTYPES_KEY = "dtypes"  # in a manifest object: {name: original dtype} of tensors saved wider
_KEYS_TEXT = " or ".join(f'"{k}"' for k in ORDER_KEYS)
_UNREADABLE = object()  # an order file that is not text


@dataclasses.dataclass
class Scan:
    data: list[Path]
    sidecars: dict[Path, Path]  # .bin -> its JSON sidecar
    order_file: Optional[Path]
    other: list[Path]  # files we do not read
    special: list[Path] = dataclasses.field(default_factory=list)  # links, pipes, devices: refused
    dtype_sidecars: dict[Path, Path] = dataclasses.field(default_factory=dict)  # other data file -> its sidecar
    folders: dict[Path, str] = dataclasses.field(default_factory=dict)  # a file of a folder per call -> its role


def _hidden(name: str) -> bool:
    return name.startswith(".") or name == "__MACOSX"


def scan(root: Path) -> Scan:
    """Classify every entry under ``root`` (hidden files and folders ignored).

    Only regular files are read; symbolic links (to files or folders) and
    pipes, devices or sockets are collected in ``special`` and refused by
    the reader, never followed or opened.
    """
    files, special = [], []
    for dirpath, dirnames, filenames in os.walk(root):  # os.walk lists linked folders but does not enter them
        kept = []
        for d in dirnames:
            if not _hidden(d):
                (special if os.path.islink(os.path.join(dirpath, d)) else kept).append(Path(dirpath) / d)
        dirnames[:] = sorted((p.name for p in kept), key=natural_key)
        for fn in filenames:
            if not _hidden(fn):
                p = Path(dirpath) / fn
                (files if stat.S_ISREG(os.lstat(p).st_mode) else special).append(p)
    files.sort(key=lambda p: natural_key(str(p.relative_to(root))))
    special.sort(key=lambda p: natural_key(str(p.relative_to(root))))
    data = [p for p in files if p.suffix.lower() in SUFFIXES]
    names = set(files)
    order_file = next((root / n for n in ORDER_FILES if (root / n) in names), None)
    sidecars, dtype_sidecars = {}, {}
    for p in data:
        cand = next((c for c in bin_sidecars(p) if c in names and c != order_file), None)
        if cand is not None:
            (sidecars if p.suffix.lower() == ".bin" else dtype_sidecars)[p] = cand
    used = set(data) | set(sidecars.values()) | set(dtype_sidecars.values()) | ({order_file} if order_file else set())
    other = [p for p in files if p not in used]
    return Scan(data, sidecars, order_file, other, special, dtype_sidecars, call_folders(data))



class GenericReader:
    name = "generic"
    priority = 0

    def detect(self, root: Path) -> bool:
        if not root.is_dir():
            return False
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not _hidden(d)]
            if any(Path(f).suffix.lower() in SUFFIXES and not _hidden(f) for f in filenames):
                return True
        return False

    def iter_runs(self, root: Path, tick: Tick) -> Iterator[RunSource]:
        sc = scan(root)
        doc, warnings = self._read_order_file(root, sc)  # read once: the order and the original dtypes
        order, kind, note, warnings, data, ticks, numbers = self._order(root, sc, doc, warnings)
        originals, dt_warnings = self._original_dtypes(root, sc, doc)
        sc = dataclasses.replace(sc, data=data)
        cast: dict[str, np.dtype] = {}  # source -> the original dtype its values were read back in
        src = RunSource(key=root.name or "dump", name=root.name or "dump", root=root, reader=self.name,
                        records=iter(()), order=kind, order_note=note,
                        loader=lambda source: _as_dtype(_native(load_source(root, source)), cast.get(source)))
        src.warnings.extend(warnings + dt_warnings)
        if sc.special:
            rel = relname(root, sc.special[0])
            kind = "a symbolic link" if os.path.islink(sc.special[0]) else "not a regular file (a pipe, device or socket)"
            raise ReadError(f"{rel}: is {kind}; dumps are read without following links or opening special files")
        for p in sc.other:
            rel = relname(root, p)
            if p.suffix.lower() == ".json":
                why = "JSON file that is neither a .bin sidecar nor an order file"
            else:
                why = f"unsupported file type {p.suffix or '(no extension)'!r}"
            src.warnings.append((rel, f"{why}; skipped (readable types: {', '.join(SUFFIXES)})"))
        saved_from = None
        if not originals and not dt_warnings:  # no dtype given: the values may say
            saved_from, said = self._saved_from(root, sc)
            src.warnings.extend(said)
        src.records = self._records(root, sc, order, ticks, src, tick, originals, cast, numbers, saved_from)
        yield src

    def _original_dtypes(self, root: Path, sc: Scan, doc) -> tuple[dict[str, np.dtype], list]:
        """``({name or file: original dtype}, warnings)`` from the manifest's ``"dtypes"`` object (``doc``, the
        order file as read; keyed by name) and the data files' own sidecars (keyed by the file's path)."""
        out, warnings = {}, []
        got = doc.get(DTYPES_KEY) if isinstance(doc, dict) else None
        if got is not None:
            rel = relname(root, sc.order_file)
            if not isinstance(got, dict) or not all(isinstance(v, str) for v in got.values()):
                warnings.append((rel, f'"{DTYPES_KEY}" is not an object of name: dtype; tensors are read as saved'))
            else:
                bad = []
                for n, d in got.items():
                    try:
                        out[n.replace("/", ".")] = numpy_dtype_named(d)
                    except (ValueError, KeyError, TypeError):
                        bad.append(f"{n}: {d}")
                if bad:
                    warnings.append((rel, f'"{DTYPES_KEY}" names unknown dtypes ({", ".join(bad[:3])}); those '
                                          "tensors are read as saved"))
        for p, side in sc.dtype_sidecars.items():
            srel = relname(root, side)
            meta = read_json(side, srel, root, what=f"sidecar of {relname(root, p)}")
            d = meta.get("dtype") if isinstance(meta, dict) else None
            try:
                out[p] = numpy_dtype_named(d)
            except (ValueError, KeyError, TypeError):
                shown = repr(d) if isinstance(d, str) and len(d) <= 40 else type(d).__name__
                warnings.append((srel, f'sidecar of {relname(root, p)} needs "dtype": the name of a dtype '
                                       f"({shown} is not one); the file is read as saved"))
        return out, warnings

    def _saved_from(self, root: Path, sc: Scan) -> tuple[Optional[np.dtype], list]:
        """``(dtype, warnings)``: the narrower dtype (``SAVED_FROM``) every float32 tensor of the dump holds the
        values of, with enough of them that it is not by chance (``_Evidence``), and one warning saying so; None
        when one value is not, the evidence is thin, or the dump keeps floats in another dtype (float16,
        float64: saved as computed).  Reading stops at the first tensor that rules every dtype out: a float32
        run reads its first float32 tensor twice, a dump of float16 files its first one; a dump that does hold
        fp16 values saved as float32 is read twice."""
        alive = [_Evidence(numpy_dtype_named(n)) for n in SAVED_FROM]
        for p in sc.data:
            for _key, t in self._load(root, sc, p):
                a = _float32(_native(t))
                if a is None:
                    if "float" in canonical_dtype(getattr(t, "dtype", "")):
                        return None, []
                    continue
                alive = [e for e in alive if e.add(a)]
                if not alive:
                    return None, []
        e = next((e for e in alive if e.holds()), None)
        if e is None:
            return None, []
        f = e.fmt
        return e.dtype, [(".", f"the values look like {f.name} saved as float32: every finite value of the "
                               f"{e.tensors} float32 tensors is exactly representable in {f.name}, and at least "
                               f"{TELLING_VALUES} distinct ones need the last bits of {f.name}'s mantissa, as float32 "
                               f"data would not by chance; they are "
                               f"read as {f.name} (largest finite value {num_text(f.max, 4, grouped=True)}). "
                               f'manifest.json {{"{DTYPES_KEY}": {{...}}}} says otherwise if they are not')]

    # -- order
    def _order(self, root: Path, sc: Scan, doc, warnings: list) -> tuple[Optional[dict[str, int]], str, str, list,
                                                                         list[Path], dict, dict[Path, int]]:
        """``(listed, kind, note, warnings, data files in reading order, file -> time rank, file -> call
        number)``; ``listed`` maps the names of an order list to their place (None without a usable one; call
        numbers in the file names, ``call_numbers``, are the order only without one), ``kind`` is
        RunSource.order until ingest settles it.  ``doc``: the order file as ``_read_order_file`` read it."""
        names, where, more = self._order_list(root, sc, doc)
        warnings = warnings + more
        times = {p: os.lstat(p).st_mtime_ns for p in sc.data}
        distinct = {t: i for i, t in enumerate(sorted(set(times.values())))}
        ticks = {p: distinct[t] for p, t in times.items()} if len(distinct) > 1 else {}
        data = sorted(sc.data, key=lambda p: ticks.get(p, 0))  # stable: by name within one time
        if names is not None:
            listed: dict[str, int] = {}
            dups = []
            for i, n in enumerate(names):
                n = n.replace("\\", "/")
                for suf in SUFFIXES:
                    if n.lower().endswith(suf):
                        n = n[: -len(suf)]
                        break
                n = n.replace("/", ".")
                if n in listed:
                    dups.append(n)
                listed.setdefault(n, i)
            if dups:
                warnings.append((relname(root, sc.order_file),
                                 f"names {len(dups)} entr{'y' if len(dups) == 1 else 'ies'} more than once "
                                 f"({', '.join(dups[:3])}{', ...' if len(dups) > 3 else ''}); the first place is used"))
            return listed, "execution", f"execution order from {where}", warnings, data, ticks, {}
        numbers = call_numbers(sc.data, sc.folders)
        if numbers:
            first = sorted(numbers, key=numbers.__getitem__)[:2]
            said = ", ".join(relname(root, p) for p in first)
            return None, "execution", (f"execution order from the call numbers the file (or folder) names begin with ({said}, "
                                       "...)"), warnings, data, ticks, numbers
        if ticks:
            return None, "mtime", f"order from file modification times ({where})", warnings, data, ticks, {}
        return None, "name", f"order unknown: by name ({where}; file modification times not distinct)", warnings, \
            data, ticks, {}

    def _read_order_file(self, root: Path, sc: Scan) -> tuple[Any, list]:
        """``(doc, warnings)``: the order file, read once: parsed JSON, the lines of ``order.txt`` (a list of
        names), None without a file, or ``_UNREADABLE`` (text that is not UTF-8: one warning says so)."""
        if sc.order_file is None:
            return None, []
        rel = relname(root, sc.order_file)
        if sc.order_file.suffix != ".txt":
            return read_json(sc.order_file, rel, root, what="order file"), []
        with open_regular(sc.order_file, rel, root) as f:
            raw = f.read(limits().max_json_bytes + 1)
        if len(raw) > limits().max_json_bytes:
            raise ReadError(f"{rel}: larger than the limit of {limits().max_json_bytes} bytes (max_json_mb)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return _UNREADABLE, [(rel, f"not UTF-8 text ({e.reason}); its order is not used")]
        return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")], []

    def _order_list(self, root: Path, sc: Scan, doc) -> tuple[Optional[list[str]], str, list]:
        """``(names, where they came from, warnings)`` from the order file as read (``doc``); names None when
        there is no usable list (the warning says why in one sentence)."""
        if sc.order_file is None:
            return None, f"no {', '.join(ORDER_FILES)}", []
        rel = relname(root, sc.order_file)
        if doc is _UNREADABLE:  # _read_order_file said why
            return None, rel, []
        if isinstance(doc, dict):
            key = next((k for k in ORDER_KEYS if doc.get(k) is not None), None)
            if key is None:
                return None, f"{rel} has no {_KEYS_TEXT} list", [] if DTYPES_KEY in doc else [
                    (rel, f"has no {_KEYS_TEXT} list; its order is not used")]
            names, where = doc[key], f'{rel} ("{key}")'
        else:
            names, where = doc, rel
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return None, f"{where} is not a list of names", [
                (rel, f"the order in {where} is not a list of tensor or module names; its order is not used")]
        return names, where, []

    # -- names
    def _prefix(self, root: Path, p: Path) -> tuple[str, int, int]:
        step = rank = 0
        parts = []
        for part in p.relative_to(root).parts[:-1]:
            m, r = STEP_RE.match(part), RANK_RE.match(part)
            if m:
                step = int(m.group(1))
            elif r:
                rank = int(r.group(1))
            else:
                parts.append(part)
        stem = p.name[: -len(p.suffix)] if p.suffix else p.name
        parts.append(stem)
        return ".".join(parts), step, rank

    def _load(self, root: Path, sc: Scan, p: Path, want=None):
        """``(key, tensor)`` pairs of data file ``p``; any failure is a ReadError naming the file."""
        return read_tensors(p, relname(root, p), root, want, sc.sidecars.get(p))

    def _records(self, root: Path, sc: Scan, order, ticks, src: RunSource, tick: Tick, originals=None,
                 cast=None, numbers=None, saved_from=None) -> Iterator[TensorRecord]:
        """The records in reading order (``seq``), with a ``Hint`` each for ``dataorder.settle`` (an order list's
        place, else the file's call number, and its time rank)."""
        lone_container = len(sc.data) == 1 and sc.data[0].suffix.lower() in CONTAINERS
        seen: dict[tuple, str] = {}
        used: set[str] = set()
        seen_names: list[str] = []
        hints_seen: list[tuple] = []
        emitted = 0
        for p in sc.data:
            rel = relname(root, p)
            prefix, step, rank = self._prefix(root, p)
            items, layout, nested = _file_calls(p, list(self._load(root, sc, p)), lone_container)
            for key, t in items:
                t = _native(t)
                name = _tensor_name(p, key, prefix, sc.folders, layout, nested, lone_container)
                dup = seen.get((step, rank, name))
                if dup is not None:
                    raise ReadError(f"{rel}: tensor name {name!r} is also given by {dup}; rename one of them")
                seen[(step, rank, name)] = rel
                source = rel if key == "" else f"{rel}#{key}"
                t = _read_back(t, name, prefix, p, rel, src, originals, saved_from, cast, source)
                try:
                    stats = tensor_stats(t)
                except Exception as e:  # an unusual dtype: say which tensor
                    raise ReadError(f"{rel}: cannot compute statistics of {name!r} "
                                    f"(dtype {getattr(t, 'dtype', '?')}): {first_line(e)}") from None
                f = _record_fields(name)
                listed = (numbers or {}).get(p)
                if order is not None:
                    hit = name if name in order else f["op"] if f["op"] in order else None
                    if hit is not None:
                        listed = order[hit]
                        used.add(hit)
                k = (step, rank, f["op"], f["role"], f["index"])
                src.digests[k] = digest(t)
                src.hints[k] = (listed, ticks.get(p))
                seen_names.append(name)
                hints_seen.append(src.hints[k])
                yield TensorRecord(run_id="", seq=emitted, op=f["op"], op_type=f["op_type"], role=f["role"],
                                   index=f["index"], stats=stats, step=step, rank=rank, direction=f["direction"],
                                   source=source, tensor=t)
                emitted += 1
            tick(os.lstat(p).st_size, rel)
        _order_warnings(root, sc, order, used, seen_names, hints_seen, src)


def _order_warnings(root: Path, sc: Scan, order, used: set, seen_names: list, hints_seen: list,
                    src: RunSource) -> None:
    """Warnings of an order list once every record is read: the tensors it left out (placed by file times and
    the data), and the entries that match nothing (no entry matching: the list is not used at all)."""
    if order is not None and used:
        left = [n for n, (listed, _t) in zip(seen_names, hints_seen) if listed is None]
        if left:
            shown = ", ".join(left[:5]) + (", ..." if len(left) > 5 else "")
            src.warnings.append((relname(root, sc.order_file),
                                 f"{len(left)} tensor(s) not listed in the order file were placed by file "
                                 f"times and the data, not by name: {shown}"))
    if order is not None:
        unknown = [n for n in order if n not in used]
        if unknown:
            shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            what = ("names no tensor or module of the dump; its order is not used" if not used else
                    f"names {len(unknown)} entr{'y' if len(unknown) == 1 else 'ies'} that match no tensor or "
                    "module of the dump (left out)")
            src.warnings.append((relname(root, sc.order_file), f"{what}: {shown}"))
            if not used:
                src.hints.update({k: (None, t) for k, (_l, t) in src.hints.items()})
