"""Hostile dump inputs for ``precision-lab ingest``, built on demand.

Each entry of ``SPECS`` describes one malformed or malicious input: a folder
or ``.zip`` that someone could upload.  ``build(case_id, root)`` writes it
under ``root/<case_id>/`` and returns a :class:`Case` saying

- ``paths``: what to pass to ``precision-lab ingest``;
- ``name``: the file or entry the error message must name (relative to the
  dump for files inside it), plus ``also`` (more exact substrings, e.g. a zip
  entry or an msprobe key) and ``words`` (phrases, case-insensitive); in
  both, a tuple item means "one of these";
- ``category``; ``bomb`` (peak memory must be measured: run it in a separate
  process); ``isolate`` (may hang or crash the process: run it in a separate
  process with a time limit); ``payload`` (a marker file that appears only if
  a pickle payload is executed);
- ``expect``: ``"refuse"`` (exit status 2, one ``error:`` line, database
  unchanged) or ``"accept"`` (exit 0, a warning naming ``name``);
- ``twin``/``vary``: cases of one twin group differ only in a name written
  inside the dump (an outside path that exists, one that does not, ...); their
  messages must be identical once that name is taken out.

Nothing here imports the other test modules.  ``prepare(root)`` writes the
shared pieces (``root/_outside``: files outside every dump that hostile names
point at; ``root/_good``: a valid dump for a baseline session).

Run as ``python tests/hostile_inputs.py --worker JOB.json`` it builds and
ingests the cases named in the job one after another in one process (through
the CLI app, in-process), writing one JSON line per event to the job's
results file, with each case's peak RSS (``VmHWM``, reset before each case)
and bytes written.  tests/test_hostile_inputs.py drives it for bombs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shlex
import shutil
import socket
import stat
import struct
import sys
import time
import traceback
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

MiB = 1 << 20
DEEP = 50_000  # nesting depth of the "deep JSON" inputs
TABLES = ("sessions", "runs", "tensors", "histograms", "tensor_data", "comparisons", "diagnoses", "warnings")

KEY = "Functional.linear.0.forward"  # the msprobe entry whose data_name the containment cases rewrite
IN0 = f"{KEY}.input.0.pt"
MS_JSON = "step0/rank0/dump.json"
MS_DATA = "step0/rank0/dump_tensor_data"
SHARD = "r/rank0/step0.parquet"


# ---- cases ------------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    category: str
    paths: list
    name: object  # str, or a tuple: one of them
    also: tuple = ()
    words: tuple = ()
    not_words: tuple = ()
    vary: str = ""
    twin: str = ""
    expect: str = "refuse"
    bomb: bool = False
    isolate: bool = False
    payload: str = ""
    max_seconds: float = 30.0

    @property
    def subprocess(self) -> bool:
        return self.bomb or self.isolate

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Case":
        d = dict(d)
        d["not_words"] = tuple(d.get("not_words") or ())
        if isinstance(d.get("name"), list):
            d["name"] = tuple(d["name"])
        for k in ("also", "words"):
            d[k] = tuple(tuple(w) if isinstance(w, list) else w for w in d.get(k) or ())
        return cls(**d)


@dataclass(frozen=True)
class Spec:
    id: str
    category: str
    fn: Callable = field(repr=False, compare=False)
    bomb: bool = False
    isolate: bool = False
    payload: bool = False
    expect: str = "refuse"
    twin: str = ""
    max_seconds: float = 30.0

    @property
    def subprocess(self) -> bool:
        return self.bomb or self.isolate


SPECS: dict[str, Spec] = {}


def _reg(id: str, category: str, fn: Callable, **kw) -> None:
    assert id not in SPECS, id
    if "max_seconds" not in kw:
        kw["max_seconds"] = 15.0 if kw.get("isolate") else 30.0
    SPECS[id] = Spec(id, category, fn, **kw)


def case(id: str, category: str, **kw):
    def deco(fn):
        _reg(id, category, fn, **kw)
        return fn
    return deco


# what the message must also say, by category (a case may say otherwise)
_CATEGORY_WORDS = {
    "symlink": ("link",),
    "special-file": (("pipe", "regular file", "special file", "fifo", "socket", "device"),),
}


class Ctx:
    """Where one case is built: ``dir`` is its own folder, ``outside`` the shared outside folder."""

    def __init__(self, spec: Spec, root: Path):
        self.spec, self.root = spec, Path(root)
        self.dir = self.root / spec.id
        if os.path.lexists(self.dir):
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.outside = self.root / "_outside"

    def marker(self) -> Path:
        m = self.root / "_markers" / self.spec.id
        m.parent.mkdir(exist_ok=True)
        if os.path.lexists(m):
            m.unlink()
        return m

    def done(self, paths, name, **kw) -> Case:
        s = self.spec
        if "words" not in kw and s.category in _CATEGORY_WORDS:
            kw["words"] = _CATEGORY_WORDS[s.category]
        return Case(id=s.id, category=s.category, paths=[str(p) for p in paths], name=name, bomb=s.bomb,
                    isolate=s.isolate, expect=s.expect, twin=s.twin, max_seconds=s.max_seconds, **kw)


def build(case_id: str, root) -> Case:
    """Write case ``case_id`` under ``root/<case_id>`` (``prepare(root)`` first); return its Case."""
    spec = SPECS[case_id]
    c = spec.fn(Ctx(spec, Path(root)))
    if spec.payload:
        assert c.payload, f"{case_id}: a payload case must name its marker file"
    return c


# ---- small writers ----------------------------------------------------------------------------

def npy_bytes(arr, allow_pickle: bool = False) -> bytes:
    import numpy as np

    b = io.BytesIO()
    np.save(b, arr, allow_pickle=allow_pickle)
    return b.getvalue()


def npy_raw(header: str, data: bytes = b"", version: int = 1) -> bytes:
    """A .npy file with exactly this header text (padded to 64 bytes, as numpy does)."""
    pre = 10 if version == 1 else 12
    h = header.encode("latin1")
    h += b" " * ((-(pre + len(h) + 1)) % 64) + b"\n"
    length = struct.pack("<H", len(h)) if version == 1 else struct.pack("<I", len(h))
    return b"\x93NUMPY" + bytes([version, 0]) + length + h + data


def npy_header_text(shape, descr: str = "<f4", fortran="False") -> str:
    dims = "".join(f"{d}, " for d in shape) if len(shape) == 1 else ", ".join(str(d) for d in shape)
    return f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': ({dims}), }}"


def good(d: Path) -> Path:
    """A valid tensor sorted before the bad file: without the transaction a half session would exist."""
    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    np.save(d / "a.output.0.npy", np.arange(6, dtype=np.float32))
    return d


def raw_zip(path: Path, entries: list[dict]) -> Path:
    """A zip written byte by byte, so headers can say anything.

    Each entry: ``name`` (str, or bytes written as is), ``data`` (the bytes as
    stored), ``method`` (0 stored, 8 deflated), ``crc`` and ``size`` (of the
    uncompressed data; computed for stored entries), ``declared`` (the
    uncompressed size the headers claim, default ``size``), ``flags``, and
    ``mode`` (Unix st_mode, default a regular file).
    """
    out, central = bytearray(), bytearray()
    for e in entries:
        name, flags = e["name"], e.get("flags", 0)
        if isinstance(name, str):
            name, flags = name.encode("utf-8"), flags | 0x800
        data, method = e["data"], e.get("method", 0)
        crc = e.get("crc", zlib.crc32(data))
        usize = e.get("declared", e.get("size", len(data)))
        off = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, flags, method, 0, 0x21, crc, len(data), usize,
                           len(name), 0) + name + data
        mode = e.get("mode", 0o100644)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, (3 << 8) | 20, 20, flags, method, 0, 0x21, crc,
                               len(data), usize, len(name), 0, 0, 0, 0, (mode << 16) & 0xFFFFFFFF, off) + name
    cd, n = len(out), len(entries)
    out += central
    if n > 0xFFFF:  # zip64 end records carry the entry count
        z64 = len(out)
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(central), cd)
        out += struct.pack("<IIQI", 0x07064B50, 0, z64, 1)
        n = 0xFFFF
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central), cd, 0)
    Path(path).write_bytes(bytes(out))
    return Path(path)


def zip_files(path: Path, entries, method=zipfile.ZIP_DEFLATED) -> Path:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names on purpose
        with zipfile.ZipFile(path, "w", method) as z:
            for name, data in entries:
                z.writestr(name, data)
    return Path(path)


def zip_folder(path: Path, folder: Path, arc_prefix: str) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                z.write(p, f"{arc_prefix}/{p.relative_to(folder).as_posix()}")
    return Path(path)


_ZERO_BLOCK: list = []


def deflated_zeros(n_mib: int, prefix: bytes = b"") -> dict:
    """Raw deflate data for ``prefix`` + ``n_mib`` MiB of zeros, made without compressing them.

    One MiB of zeros is deflated once and ended with a full flush, so the
    block can be repeated; a final empty block closes the stream.  Returns
    the ``raw_zip`` fields ``data``, ``crc``, ``size``, ``method``.
    """
    if not _ZERO_BLOCK:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        _ZERO_BLOCK.append(c.compress(bytes(MiB)) + c.flush(zlib.Z_FULL_FLUSH))
    head = b""
    if prefix:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    end = zlib.compressobj(9, zlib.DEFLATED, -15).flush()
    crc, z = zlib.crc32(prefix), bytes(MiB)
    for _ in range(n_mib):
        crc = zlib.crc32(z, crc)
    return {"data": head + _ZERO_BLOCK[0] * n_mib + end, "crc": crc, "size": len(prefix) + n_mib * MiB,
            "method": 8}


# pickles, written opcode by opcode (protocol 2)

def _pint(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -(2 ** 31) <= n < 2 ** 31:
        return b"J" + struct.pack("<i", n)
    b = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(b)]) + b


def _pstr(s: str) -> bytes:
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def _tuple(items) -> bytes:
    return b"(" + b"".join(_pint(i) for i in items) + b"t"


def tensor_pickle(numel: int, size=None, stride=None, offset: int = 0, key: str = "0",
                  storage: str = "FloatStorage") -> bytes:
    """``data.pkl`` of a torch file holding one tensor over storage ``key`` of ``numel`` elements."""
    size = tuple(size) if size is not None else (numel,)
    if stride is None:
        stride, acc = [], 1
        for s in reversed(size):
            stride.insert(0, acc)
            acc *= s
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((" + _pstr("storage") + b"ctorch\n" + storage.encode()
            + b"\n" + _pstr(key) + _pstr("cpu") + _pint(numel) + b"tQ" + _pint(offset) + _tuple(size)
            + _tuple(stride) + b"\x89ccollections\nOrderedDict\n)RtR.")


def many_views_pickle(n: int) -> bytes:
    """A list of ``n`` one-element tensors viewing one 4-element storage (memoised, so the pickle stays small)."""
    first = (b"ctorch._utils\n_rebuild_tensor_v2\nq\x01((" + _pstr("storage") + b"ctorch\nFloatStorage\n"
             + _pstr("0") + _pstr("cpu") + _pint(4) + b"tQq\x02" + _pint(0) + _tuple((1,)) + _tuple((1,))
             + b"\x89ccollections\nOrderedDict\nq\x03)RtR")
    rest = b"".join(b"h\x01(h\x02" + _pint(i % 4) + _tuple((1,)) + _tuple((1,)) + b"\x89h\x03)RtR"
                    for i in range(1, n))
    return b"\x80\x02]q\x00(" + first + rest + b"e."


def pt_zip(path: Path, pkl: bytes, storages: Optional[dict] = None) -> Path:
    """A torch zip file (the layout torch.save writes) with this ``data.pkl`` and these storage records."""
    entries = [{"name": "archive/data.pkl", "data": pkl}, {"name": "archive/byteorder", "data": b"little"}]
    for k, e in (storages or {}).items():
        entries.append(dict(e, name=f"archive/data/{k}"))
    entries.append({"name": "archive/version", "data": b"3\n"})
    return raw_zip(path, entries)


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


class OpenPayload:
    """Unpickling this creates ``marker`` with ``open(marker, 'w')``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def system_pickle(marker: Path) -> bytes:
    return b"\x80\x02cos\nsystem\n" + _pstr(f"touch {shlex.quote(str(marker))}") + b"\x85R."


def flip_in_member(raw: bytes, member_suffix: str, at: int = 10) -> bytes:
    """Flip one byte inside the stored data of the first zip member whose name ends with ``member_suffix``."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(member_suffix))
    h = info.header_offset
    start = h + 30 + int.from_bytes(raw[h + 26:h + 28], "little") + int.from_bytes(raw[h + 28:h + 30], "little")
    b = bytearray(raw)
    b[start + min(at, info.compress_size - 1)] ^= 0x5A
    return bytes(b)


def sparse_file(path: Path, head: bytes, size: int) -> Path:
    """``head`` followed by a hole: a file of ``size`` bytes that takes no disk space."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def safetensors_raw(header, data: bytes = b"", length: Optional[int] = None) -> bytes:
    h = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    n = len(h) if length is None else length
    return n.to_bytes(8, "little") + h + data


# ---- msprobe and shard dumps --------------------------------------------------------------

def msprobe_dump(d: Path, *, tensor: bool = True, rank: str = "rank0", step: str = "step0"):
    """A small msprobe dump (``<d>/<step>/<rank>/dump.json``); returns (dump.json path, its document)."""
    import torch

    rd = d / step / rank
    dd = rd / "dump_tensor_data"
    dd.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g).half()
    y = (x.float() @ torch.randn(8, 4, generator=g)).half()
    z = torch.relu(y)

    def entry(t, name):
        f = t.float()
        e = {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "Max": f.max().item(),
             "Min": f.min().item(), "Mean": f.mean().item(), "Norm": f.norm().item(), "requires_grad": False}
        if tensor:
            e["data_name"] = name
            torch.save(t.clone(), dd / name)
        return e

    data = {
        KEY: {"input_args": [entry(x, IN0)], "input_kwargs": {}, "output": [entry(y, f"{KEY}.output.0.pt")]},
        "Functional.relu.1.forward": {"input_args": [entry(y, "Functional.relu.1.forward.input.0.pt")],
                                      "input_kwargs": {}, "output": [entry(z, "Functional.relu.1.forward.output.0.pt")]},
    }
    doc = {"task": "tensor" if tensor else "statistics", "level": "L1", "framework": "pytorch", "data": data}
    (rd / "dump.json").write_text(json.dumps(doc))
    if not tensor:
        shutil.rmtree(dd)
    return rd / "dump.json", doc


def ms_case(c: Ctx, mutate=None, *, tensor: bool = True) -> tuple[Path, Path]:
    """``c.dir/ms``: an msprobe dump whose document ``mutate(doc)`` edited (or replaced, by returning text)."""
    d = c.dir / "ms"
    p, doc = msprobe_dump(d, tensor=tensor)
    if mutate is not None:
        out = mutate(doc)
        p.write_text(out if isinstance(out, str) else json.dumps(doc))
    return d, p


def set_data_name(doc: dict, name) -> None:
    doc["data"][KEY]["input_args"][0]["data_name"] = name


def first_stat(doc: dict) -> dict:
    return doc["data"][KEY]["input_args"][0]


def shard_folder(d: Path, rows: int = 1, kept: bool = False) -> Path:
    """A valid Precision Lab shard folder of one run ``r``; returns the shard file."""
    import numpy as np

    from precision_lab.records import TensorRecord
    from precision_lab.readers.shards import write_manifest, write_shard
    from precision_lab.stats import tensor_stats

    meta = {"run_id": "r", "name": "r", "dtype": "float16", "kind": "candidate"}
    t = np.ones(4, np.float16)
    recs = [TensorRecord(run_id="r", seq=i, op=f"op{i}", op_type="op", role="output", index="0",
                         stats=tensor_stats(t), tensor=t if kept else None) for i in range(rows)]
    path = write_shard(d, meta, recs, rank=0, step=0)
    write_manifest(d, [meta])
    return path


def shard_table(path: Path):
    import pyarrow.parquet as pq

    return pq.read_table(path)


def write_shard_table(path: Path, table, **kw) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table, path, compression="zstd", **kw)


def set_column(table, name: str, array):
    import pyarrow as pa

    i = table.column_names.index(name)
    return table.set_column(i, pa.field(name, array.type), array)


def edit_manifest(d: Path, fn) -> None:
    p = d / "manifest.json"
    doc = json.loads(p.read_text())
    out = fn(doc)
    p.write_text(out if isinstance(out, str) else json.dumps(doc))


# ---- shared pieces --------------------------------------------------------------------------

def prepare(root) -> None:
    """Write ``root/_outside`` (targets outside every dump) and ``root/_good`` (a valid dump)."""
    import numpy as np
    import torch

    root = Path(root)
    out = root / "_outside"
    if not (out / ".ready").exists():
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        torch.save(torch.full((4, 8), 7.0, dtype=torch.float16), out / "secret.pt")
        (out / "secret.txt").write_text("top secret\n")
        np.save(out / "secret.npy", np.full(6, 7.0, np.float32))
        good(out / "tensors")
        msprobe_dump(out / "ms", tensor=False)
        shutil.copy(out / "ms" / MS_JSON, out / "dump.json")
        (out / "sidecar.json").write_text(json.dumps({"dtype": "float32", "shape": [4]}))
        (out / "order.json").write_text(json.dumps(["a.output.0"]))
        shard_folder(out / "shards")
        (out / ".ready").write_text("")
    g = root / "_good"
    if not (g / "b.output.0.npy").exists():
        good(g)
        np.save(g / "b.output.0.npy", np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))


def rel_to(target: Path, start: Path) -> str:
    return os.path.relpath(target, start)


# ============================================================================================
# containment: names written inside a dump that lead outside it
# ============================================================================================

def _dataname_case(target: Callable[[Ctx, Path], str]):
    def fn(c: Ctx) -> Case:
        d = c.dir / "ms"
        holder = {}

        def mutate(doc):
            holder["name"] = target(c, d / MS_DATA)
            set_data_name(doc, holder["name"])

        ms_case(c, mutate)
        name = holder["name"]
        return c.done([d], MS_JSON, also=(KEY,), vary=name if isinstance(name, str) else "")
    return fn


for _id, _twin, _target, _kw in [
    ("dataname-rel-existing-pt", "dataname-rel", lambda c, dd: rel_to(c.outside / "secret.pt", dd), {}),
    ("dataname-rel-missing", "dataname-rel", lambda c, dd: rel_to(c.outside / "missing.pt", dd), {}),
    ("dataname-rel-existing-text", "dataname-rel", lambda c, dd: rel_to(c.outside / "secret.txt", dd), {}),
    ("dataname-rel-existing-dir", "dataname-rel", lambda c, dd: rel_to(c.outside / "tensors", dd), {}),
    ("dataname-rel-etc-passwd", "dataname-rel", lambda c, dd: rel_to(Path("/etc/passwd"), dd), {}),
    ("dataname-abs-existing-pt", "dataname-abs", lambda c, dd: str(c.outside / "secret.pt"), {}),
    ("dataname-abs-missing", "dataname-abs", lambda c, dd: str(c.outside / "missing.pt"), {}),
    ("dataname-abs-existing-dir", "dataname-abs", lambda c, dd: str(c.outside / "tensors"), {}),
    ("dataname-abs-etc-passwd", "dataname-abs", lambda c, dd: "/etc/passwd", {}),
    ("dataname-abs-dev-zero", "dataname-abs", lambda c, dd: "/dev/zero", {"isolate": True}),
    ("dataname-backslash-climb", "", lambda c, dd: rel_to(c.outside / "secret.pt", dd).replace("/", "\\"), {}),
    ("dataname-drive-letter", "", lambda c, dd: "C:\\Windows\\secret.pt", {}),
    ("dataname-drive-letter-slash", "", lambda c, dd: "C:/secret.pt", {}),
    ("dataname-nul-byte", "", lambda c, dd: "x\x00.pt", {}),
    ("dataname-integer", "", lambda c, dd: 12345, {}),
    ("dataname-list", "", lambda c, dd: ["x.pt"], {}),
    ("dataname-object", "", lambda c, dd: {"path": "x.pt"}, {}),
    ("dataname-lone-surrogate", "", lambda c, dd: "\udcff\ud800.pt", {}),
]:
    _reg(_id, "containment", _dataname_case(_target), twin=_twin, **_kw)


@case("dataname-folder-itself", "containment")
def _(c):
    d, _p = ms_case(c, lambda doc: set_data_name(doc, "."))
    return c.done([d], "dump_tensor_data")


@case("dataname-subfolder", "containment")
def _(c):
    d, _p = ms_case(c, lambda doc: set_data_name(doc, "sub.pt"))
    (d / MS_DATA / "sub.pt").mkdir()
    return c.done([d], "dump_tensor_data/sub.pt")


@case("dataname-dump-json-itself", "containment")
def _(c):
    d, _p = ms_case(c, lambda doc: set_data_name(doc, "../dump.json"))
    return c.done([d], MS_JSON)


@case("dataname-fifo", "special-file", isolate=True)
def _(c):
    d, _p = ms_case(c)
    (d / MS_DATA / IN0).unlink()
    fifo(d / MS_DATA / IN0)
    return c.done([d], f"{MS_DATA}/{IN0}")


@case("dataname-link-to-outside", "symlink", twin="pt-link")
def _(c):
    d, _p = ms_case(c)
    (d / MS_DATA / IN0).unlink()
    os.symlink(c.outside / "secret.pt", d / MS_DATA / IN0)
    return c.done([d], f"{MS_DATA}/{IN0}")


@case("dataname-link-dangling", "symlink", twin="pt-link")
def _(c):
    d, _p = ms_case(c)
    (d / MS_DATA / IN0).unlink()
    os.symlink(c.outside / "missing.pt", d / MS_DATA / IN0)
    return c.done([d], f"{MS_DATA}/{IN0}")


@case("dataname-link-inside", "symlink")
def _(c):
    d, _p = ms_case(c)
    (d / MS_DATA / IN0).unlink()
    os.symlink(f"{KEY}.output.0.pt", d / MS_DATA / IN0)
    return c.done([d], f"{MS_DATA}/{IN0}")


@case("ms-data-folder-link", "symlink")
def _(c):
    d, _p = ms_case(c)
    elsewhere = c.dir / "elsewhere_data"
    shutil.move(str(d / MS_DATA), elsewhere)
    os.symlink(elsewhere, d / MS_DATA)
    return c.done([d], "dump_tensor_data")


@case("ms-rank-folder-link", "symlink")
def _(c):
    d = c.dir / "ms"
    msprobe_dump(d, tensor=False, rank="rank1")
    other = c.dir / "elsewhere"
    msprobe_dump(other, tensor=False)
    os.symlink(other / "step0" / "rank0", d / "step0" / "rank0")
    return c.done([d], "rank0")


@case("ms-step-folder-link", "symlink")
def _(c):
    d = c.dir / "ms"
    msprobe_dump(d, tensor=False, step="step1")
    other = c.dir / "elsewhere"
    msprobe_dump(other, tensor=False)
    os.symlink(other / "step0", d / "step0")
    return c.done([d], "step0")


@case("ms-dump-json-link", "symlink")
def _(c):
    d = c.dir / "ms"
    msprobe_dump(d, tensor=False)
    (d / "step0" / "rank1").mkdir()
    os.symlink(c.outside / "dump.json", d / "step0" / "rank1" / "dump.json")
    return c.done([d], "step0/rank1/dump.json")


@case("ms-dump-json-fifo", "special-file", isolate=True)
def _(c):
    d = c.dir / "ms"
    msprobe_dump(d, tensor=False)
    (d / "step0" / "rank1").mkdir()
    fifo(d / "step0" / "rank1" / "dump.json")
    return c.done([d], "step0/rank1/dump.json")


def _zip_ms_dataname(target: str, twin: str):
    def fn(c: Ctx) -> Case:
        src = c.dir / "src"
        ms_case_dir = src / "ms"
        p, doc = msprobe_dump(ms_case_dir)
        set_data_name(doc, target)
        p.write_text(json.dumps(doc))
        z = zip_folder(c.dir / "upload.zip", ms_case_dir, "ms")
        shutil.rmtree(src)
        return c.done([z], MS_JSON, also=(KEY,), vary=target)
    return fn


_reg("zip-dataname-climb-existing", "containment", _zip_ms_dataname("../" * 24 + "etc/passwd", "zip-dataname"),
     twin="zip-dataname")
_reg("zip-dataname-climb-missing", "containment",
     _zip_ms_dataname("../" * 24 + "etc/no-such-file.pt", "zip-dataname"), twin="zip-dataname")
_reg("zip-dataname-absolute", "containment", _zip_ms_dataname("/etc/passwd", ""))


# ============================================================================================
# symbolic links in generic folders, shard folders and zips
# ============================================================================================

def _link_case(make):
    def fn(c: Ctx) -> Case:
        d = good(c.dir / "dump")
        name = make(c, d)
        return c.done([d], name)
    return fn


def _ln(src, dst: Path) -> None:
    os.symlink(src, dst)


for _id, _twin, _make in [
    ("link-npy-to-outside", "npy-link",
     lambda c, d: (_ln(c.outside / "secret.npy", d / "z.output.0.npy"), "z.output.0.npy")[1]),
    ("link-npy-dangling", "npy-link",
     lambda c, d: (_ln(c.outside / "missing.npy", d / "z.output.0.npy"), "z.output.0.npy")[1]),
    ("link-npy-to-inside", "",
     lambda c, d: (_ln("a.output.0.npy", d / "z.output.0.npy"), "z.output.0.npy")[1]),
    ("link-pt-to-outside", "",
     lambda c, d: (_ln(c.outside / "secret.pt", d / "z.output.0.pt"), "z.output.0.pt")[1]),
    ("link-folder-to-outside", "", lambda c, d: (_ln(c.outside / "tensors", d / "sub"), "sub")[1]),
    ("link-folder-loop", "", lambda c, d: (_ln(".", d / "loop"), "loop")[1]),
    ("link-folder-to-root", "", lambda c, d: (_ln("/", d / "rootfs"), "rootfs")[1]),
    ("link-order-json", "", lambda c, d: (_ln(c.outside / "order.json", d / "order.json"), "order.json")[1]),
]:
    _reg(_id, "symlink", _link_case(_make), twin=_twin)


@case("link-sidecar", "symlink")
def _(c):
    import numpy as np

    d = good(c.dir / "dump")
    np.zeros(4, np.float32).tofile(d / "z.bin")
    os.symlink(c.outside / "sidecar.json", d / "z.json")
    return c.done([d], "z.json")


@case("link-shard-manifest", "symlink")
def _(c):
    d = c.dir / "shards"
    shard_folder(d)
    (d / "manifest.json").unlink()
    os.symlink(c.outside / "shards" / "manifest.json", d / "manifest.json")
    return c.done([d], "manifest.json")


@case("link-shard-file", "symlink")
def _(c):
    d = c.dir / "shards"
    p = shard_folder(d)
    p.unlink()
    os.symlink(c.outside / "shards" / SHARD, p)
    return c.done([d], SHARD)


@case("link-shard-run-folder", "symlink")
def _(c):
    d = c.dir / "shards"
    shard_folder(d)
    elsewhere = c.dir / "elsewhere_r"
    shutil.move(str(d / "r"), elsewhere)
    os.symlink(elsewhere, d / "r")
    return c.done([d], "r")


def _zip_link(entry: str, target: str, mode=stat.S_IFLNK | 0o777):
    def fn(c: Ctx) -> Case:
        z = raw_zip(c.dir / "links.zip", [
            {"name": "dump/a.output.0.npy", "data": npy_bytes(__import__("numpy").ones(3, "float32"))},
            {"name": entry, "data": target.encode(), "mode": mode},
        ])
        return c.done([z], "links.zip", also=(entry,))
    return fn


_reg("zip-link-to-etc-passwd", "symlink", _zip_link("dump/z.output.0.npy", "/etc/passwd"))
_reg("zip-link-inside", "symlink", _zip_link("dump/z.output.0.npy", "a.output.0.npy"))
_reg("zip-link-folder-to-root", "symlink", _zip_link("dump/rootfs", "/"))
_reg("zip-fifo-entry", "special-file", _zip_link("dump/f.output.0.npy", "", mode=stat.S_IFIFO | 0o644))
_reg("zip-device-entry", "special-file", _zip_link("dump/d.output.0.npy", "", mode=stat.S_IFCHR | 0o644))


# ============================================================================================
# special files: pipes, sockets, devices (each may hang a reader: run apart, with a time limit)
# ============================================================================================

def _special(fname: str, make, extra=None):
    def fn(c: Ctx) -> Case:
        d = good(c.dir / "dump")
        if extra:
            extra(d)
        make(d / fname)
        return c.done([d], fname)
    return fn


def _bin_with_sidecar(d: Path) -> None:
    import numpy as np

    np.zeros(4, np.float32).tofile(d / "z.bin")
    (d / "z.json").write_text(json.dumps({"dtype": "float32", "shape": [4]}))


def _mksock(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(p))
    finally:
        s.close()


for _suffix in ("npy", "pt", "npz", "safetensors"):
    _reg(f"fifo-{_suffix}", "special-file", _special(f"z.output.0.{_suffix}", fifo), isolate=True)
_reg("fifo-bin", "special-file", _special("y.bin", fifo,
                                          lambda d: (d / "y.json").write_text('{"dtype": "float32", "shape": [4]}')),
     isolate=True)
_reg("fifo-sidecar", "special-file",
     _special("y.json", fifo, lambda d: __import__("numpy").zeros(4, "float32").tofile(d / "y.bin")), isolate=True)
_reg("fifo-order-json", "special-file", _special("order.json", fifo), isolate=True)
_reg("fifo-manifest-json", "special-file", _special("manifest.json", fifo), isolate=True)
_reg("fifo-in-subfolder", "special-file",
     _special("sub/z.output.0.npy", fifo, lambda d: (d / "sub").mkdir()), isolate=True)
_reg("socket-npy", "special-file", _special("z.output.0.npy", _mksock), isolate=True)

if hasattr(os, "geteuid") and os.geteuid() == 0:  # device nodes need root; /dev/zero never ends
    def _zero_dev(p: Path) -> None:
        os.mknod(p, stat.S_IFCHR | 0o644, os.makedev(1, 5))

    _reg("device-zero-npy", "special-file", _special("z.output.0.npy", _zero_dev), isolate=True)
    _reg("device-zero-pt", "special-file", _special("z.output.0.pt", _zero_dev), isolate=True)


@case("fifo-shard-file", "special-file", isolate=True)
def _(c):
    d = c.dir / "shards"
    p = shard_folder(d)
    p.unlink()
    fifo(p)
    return c.done([d], SHARD)


@case("fifo-shard-manifest", "special-file", isolate=True)
def _(c):
    d = c.dir / "shards"
    shard_folder(d)
    (d / "manifest.json").unlink()
    fifo(d / "manifest.json")
    return c.done([d], "manifest.json")


@case("fifo-named-zip-argument", "special-file", isolate=True)
def _(c):
    p = fifo(c.dir / "upload.zip")
    return c.done([p], "upload.zip", words=())  # the argument itself: saying what it is not is enough


if hasattr(os, "geteuid") and os.geteuid() != 0:  # root reads everything: only meaningful for other users
    @case("unreadable-npy", "permissions")
    def _(c):
        d = good(c.dir / "dump")
        p = d / "z.output.0.npy"
        p.write_bytes(npy_bytes(__import__("numpy").ones(3, "float32")))
        p.chmod(0)
        return c.done([d], "z.output.0.npy")

    @case("unreadable-folder", "permissions")
    def _(c):
        d = good(c.dir / "dump")
        (d / "sub").mkdir()
        (d / "sub" / "z.output.0.npy").write_bytes(npy_bytes(__import__("numpy").ones(3, "float32")))
        (d / "sub").chmod(0)
        return c.done([d], "sub")


# ============================================================================================
# zip archives (uploads)
# ============================================================================================

def _npy1() -> bytes:
    import numpy as np

    return npy_bytes(np.ones(3, np.float32))


@case("zip-ratio-small-entry", "zip")
def _(c):
    import numpy as np

    z = zip_files(c.dir / "bomb.zip", [("dump/a.output.0.npy", _npy1()),
                                        ("dump/zeros.output.0.npy", npy_bytes(np.zeros(50_000, np.float32)))])
    return c.done([z], "bomb.zip", also=("zeros.output.0.npy",))


@case("zip-1024-entries-of-1mib", "zip", bomb=True)
def _(c):
    e = deflated_zeros(1)
    z = raw_zip(c.dir / "bomb.zip", [dict(e, name=f"dump/f{i:04d}.bin") for i in range(1024)])
    return c.done([z], "bomb.zip")


@case("zip-600-entries-of-60kib", "zip", bomb=True)
def _(c):
    z = zip_files(c.dir / "bomb.zip", [(f"dump/{i}.output.0.npy", bytes(60 << 10)) for i in range(600)])
    return c.done([z], "bomb.zip")


@case("zip-declared-12gib", "zip")
def _(c):
    z = raw_zip(c.dir / "bomb.zip", [{"name": f"dump/{i}.output.0.npy", "data": b"\0" * 100, "declared": 0xFFFFFFF0}
                                     for i in range(3)])
    return c.done([z], "bomb.zip")


@case("zip-understated-size", "zip")
def _(c):
    e = deflated_zeros(4)
    z = raw_zip(c.dir / "liar.zip", [{"name": "dump/a.output.0.npy", "data": _npy1()},
                                     dict(e, name="dump/z.output.0.npy", declared=100)])
    return c.done([z], "liar.zip", also=("z.output.0.npy",))


@case("zip-nested-zips", "zip")
def _(c):
    inner = zip_files(c.dir / "l5.zip", [("a.output.0.npy", _npy1())])
    for level in range(4, 0, -1):
        inner = zip_files(c.dir / f"l{level}.zip", [(f"l{level + 1}.zip", inner.read_bytes())])
    z = zip_files(c.dir / "nest.zip", [("l1.zip", inner.read_bytes())])
    return c.done([z], "nest.zip")


@case("zip-deep-folders", "zip")
def _(c):
    z = zip_files(c.dir / "deep.zip", [("d/" * 40 + "x.output.0.npy", _npy1())])
    return c.done([z], "deep.zip", also=("x.output.0.npy",))


@case("zip-duplicate-names", "zip")
def _(c):
    z = zip_files(c.dir / "dup.zip", [("dump/a.output.0.npy", _npy1()), ("dump/a.output.0.npy", b"other")])
    return c.done([z], "dup.zip", also=("a.output.0.npy",))


@case("zip-file-and-folder", "zip")
def _(c):
    z = zip_files(c.dir / "clash.zip", [("dump/a", b"1"), ("dump/a/b.output.0.npy", _npy1())])
    return c.done([z], "clash.zip", also=("dump/a",))


@case("zip-folder-then-file", "zip")
def _(c):
    z = zip_files(c.dir / "clash.zip", [("dump/a/b.output.0.npy", _npy1()), ("dump/a", b"1")])
    return c.done([z], "clash.zip", also=("dump/a",))


for _id, _entry in [("zip-traversal", "../../evil.output.0.npy"),
                    ("zip-traversal-inner", "dump/../../evil.output.0.npy"),
                    ("zip-absolute", "/etc/evil.output.0.npy"),
                    ("zip-drive-letter", "C:\\evil.output.0.npy"),
                    ("zip-backslash-traversal", "..\\..\\evil.output.0.npy")]:
    def _fn(c, _entry=_entry):
        z = raw_zip(c.dir / "slip.zip", [{"name": "dump/a.output.0.npy", "data": _npy1()},
                                         {"name": _entry, "data": _npy1()}])
        return c.done([z], "slip.zip", also=((_entry, _entry.replace("\\", "\\\\")),))
    _reg(_id, "zip", _fn)


@case("zip-encrypted-flag", "zip")
def _(c):
    z = raw_zip(c.dir / "enc.zip", [{"name": "dump/a.output.0.npy", "data": _npy1(), "flags": 1}])
    return c.done([z], "enc.zip", also=("a.output.0.npy",))


@case("zip-20001-entries", "zip")
def _(c):
    z = raw_zip(c.dir / "many.zip", [{"name": f"dump/f{i}.txt", "data": b""} for i in range(20_001)])
    return c.done([z], "many.zip")


@case("zip-truncated", "zip")
def _(c):
    z = zip_files(c.dir / "half.zip", [("dump/a.output.0.npy", _npy1()), ("dump/b.output.0.npy", _npy1())])
    z.write_bytes(z.read_bytes()[: z.stat().st_size // 2])
    return c.done([z], "half.zip")


@case("zip-not-a-zip", "zip")
def _(c):
    p = c.dir / "notes.zip"
    p.write_text("this is a text file, not an archive\n")
    return c.done([p], "notes.zip")


@case("zip-empty-file", "zip")
def _(c):
    p = c.dir / "empty.zip"
    p.write_bytes(b"")
    return c.done([p], "empty.zip")


@case("zip-crc-mismatch", "zip")
def _(c):
    z = zip_files(c.dir / "crc.zip", [("dump/a.output.0.npy", _npy1()), ("dump/z.output.0.npy", _npy1())],
                  method=zipfile.ZIP_STORED)
    z.write_bytes(flip_in_member(z.read_bytes(), "z.output.0.npy", at=130))
    return c.done([z], "crc.zip", also=("z.output.0.npy",))


@case("zip-unknown-method", "zip")
def _(c):
    z = raw_zip(c.dir / "method.zip", [{"name": "dump/a.output.0.npy", "data": _npy1()},
                                       {"name": "dump/z.output.0.npy", "data": b"\x01\x02\x03" * 10, "method": 99,
                                        "crc": 0, "size": 500}])
    return c.done([z], "method.zip", also=("z.output.0.npy",))


@case("zip-garbage-deflate", "zip")
def _(c):
    z = raw_zip(c.dir / "garbage.zip", [{"name": "dump/a.output.0.npy", "data": _npy1()},
                                        {"name": "dump/z.output.0.npy", "data": b"\xff" * 64, "method": 8,
                                         "crc": 0, "size": 500}])
    return c.done([z], "garbage.zip", also=("z.output.0.npy",))


@case("zip-name-too-long", "zip")
def _(c):
    z = zip_files(c.dir / "long.zip", [("dump/" + "n" * 300 + ".output.0.npy", _npy1())])
    return c.done([z], "long.zip", also=("n" * 40,))


@case("zip-containing-pt-bomb", "zip", bomb=True)
def _(c):
    e = deflated_zeros(256)
    src = c.dir / "inner.pt"
    pt_zip(src, tensor_pickle(64 * MiB), {"0": e})
    z = zip_files(c.dir / "upload.zip", [("dump/a.output.0.npy", _npy1()), ("dump/bomb.output.0.pt", src.read_bytes())],
                  method=zipfile.ZIP_STORED)
    src.unlink()
    return c.done([z], "bomb.output.0.pt")


@case("zip-pt-payload", "pickle", payload=True)
def _(c):
    import torch

    m = c.marker()
    b = io.BytesIO()
    torch.save({"w": torch.ones(2), "x": Payload(m)}, b)
    z = zip_files(c.dir / "upload.zip", [("dump/a.output.0.npy", _npy1()), ("dump/evil.pt", b.getvalue())])
    return c.done([z], "evil.pt", payload=str(m))


# ============================================================================================
# .npz
# ============================================================================================

def _npz_case(members: Callable[[Ctx], list], name: str = "z.npz", also=(), **kw):
    def fn(c: Ctx) -> Case:
        d = good(c.dir / "dump")
        raw_zip(d / "z.npz", members(c))
        return c.done([d], name, also=also, **kw)
    return fn


_reg("npz-member-ratio-256mib", "npz", _npz_case(
    lambda c: [dict(deflated_zeros(256, npy_raw(npy_header_text((64 * MiB,)))), name="w.npy")], also=("w.npy",)),
    bomb=True)
_reg("npz-member-1gib", "npz", _npz_case(
    lambda c: [dict(deflated_zeros(1024, npy_raw(npy_header_text((256 * MiB,)))), name="w.npy")], also=("w.npy",)),
    bomb=True)
_reg("npz-header-huge-shape", "npz", _npz_case(
    lambda c: [{"name": "w.npy", "data": npy_raw(npy_header_text((1 << 40,), "<f8"), bytes(64))}], also=("w.npy",)))
_reg("npz-header-bigint-shape", "npz", _npz_case(
    lambda c: [{"name": "w.npy", "data": npy_raw(npy_header_text((10 ** 30,)), bytes(64))}], also=("w.npy",)))
_reg("npz-header-int64-overflow", "npz", _npz_case(
    lambda c: [{"name": "w.npy", "data": npy_raw(npy_header_text((2 ** 62, 4)), bytes(64))}], also=("w.npy",)))
_reg("npz-header-over-10kb", "npz", _npz_case(
    lambda c: [{"name": "w.npy", "data": npy_raw(npy_header_text((2,)) + " " * 12_000, bytes(8))}], also=("w.npy",),
    not_words=("python objects",)))
_reg("npz-member-not-npy", "npz", _npz_case(lambda c: [{"name": "w.npy", "data": b"hello, not an array"}],
                                             also=("w.npy",)))
_reg("npz-encrypted-member", "npz", _npz_case(
    lambda c: [{"name": "w.npy", "data": npy_bytes(__import__("numpy").ones(3, "float32")), "flags": 1}]))
_reg("npz-garbage-deflate", "npz", _npz_case(
    lambda c: [{"name": "w.npy", "data": b"\xff" * 64, "method": 8, "crc": 0, "size": 200}]))


@case("npz-many-members", "npz", bomb=True)
def _(c):
    d = good(c.dir / "dump")
    member = npy_raw(npy_header_text((1,)), bytes(4))
    raw_zip(d / "z.npz", [{"name": f"m{i}.npy", "data": member} for i in range(100_017)])
    return c.done([d], "z.npz")


@case("npz-truncated", "npz")
def _(c):
    import numpy as np

    d = good(c.dir / "dump")
    np.savez(d / "z.npz", w=np.ones(100, np.float32))
    (d / "z.npz").write_bytes((d / "z.npz").read_bytes()[:400])
    return c.done([d], "z.npz")


@case("npz-crc-flipped", "npz")
def _(c):
    import numpy as np

    d = good(c.dir / "dump")
    np.savez(d / "z.npz", w=np.linspace(0, 1, 256, dtype=np.float32))
    (d / "z.npz").write_bytes(flip_in_member((d / "z.npz").read_bytes(), "w.npy", at=300))
    return c.done([d], "z.npz", words=(("crc", "damaged", "checksum", "corrupt"),))


@case("npz-payload", "pickle", payload=True)
def _(c):
    import numpy as np

    d = good(c.dir / "dump")
    m = c.marker()
    np.savez(d / "z.npz", w=np.array([Payload(m)], dtype=object))
    return c.done([d], "z.npz", payload=str(m))


# ============================================================================================
# .pt
# ============================================================================================

def _pt_case(make: Callable[[Ctx, Path], Optional[dict]], **kw):
    def fn(c: Ctx) -> Case:
        d = good(c.dir / "dump")
        more = make(c, d / "z.output.0.pt") or {}
        return c.done([d], "z.output.0.pt", **{**kw, **more})
    return fn


def _torch_save(obj, p: Path, **kw) -> None:
    import torch

    torch.save(obj, p, **kw)


_reg("pt-ratio-256mib", "pt", _pt_case(lambda c, p: pt_zip(p, tensor_pickle(64 * MiB), {"0": deflated_zeros(256)})
                                       and None), bomb=True)
_reg("pt-entry-1gib", "pt", _pt_case(lambda c, p: pt_zip(p, tensor_pickle(256 * MiB), {"0": deflated_zeros(1024)})
                                     and None), bomb=True)
_reg("pt-zero-stride-256mib", "pt", _pt_case(
    lambda c, p: _torch_save(__import__("torch").zeros(1).expand(64 * MiB), p)), bomb=True)
_reg("pt-zero-stride-4gib", "pt", _pt_case(
    lambda c, p: _torch_save(__import__("torch").zeros(1).expand(1 << 30), p)), bomb=True)
_reg("pt-zero-stride-2d-16gib", "pt", _pt_case(
    lambda c, p: _torch_save(__import__("torch").zeros(1, 1).expand(1 << 16, 1 << 16), p)), bomb=True)
def _sparse_huge(c, p):
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(torch.sparse_coo_tensor([[0]], [1.0], (1 << 40,)), p)


_reg("pt-sparse-huge", "pt", _pt_case(_sparse_huge), bomb=True)
_reg("pt-many-tensors", "pt", _pt_case(
    lambda c, p: pt_zip(p, many_views_pickle(100_001), {"0": {"data": bytes(16)}}) and None), bomb=True)
_reg("pt-text-file", "pt", _pt_case(lambda c, p: p.write_text("hello, this is not a tensor\n") and None))
_reg("pt-empty-file", "pt", _pt_case(lambda c, p: p.write_bytes(b"") and None))
_reg("pt-zip-magic-only", "pt", _pt_case(lambda c, p: p.write_bytes(b"PK\x03\x04") and None))
_reg("pt-legacy-format", "pt", _pt_case(
    lambda c, p: _torch_save(__import__("torch").ones(3), p, _use_new_zipfile_serialization=False)))
_reg("pt-nested-list-100k", "pt", _pt_case(
    lambda c, p: pt_zip(p, b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b".") and None))
_reg("pt-nested-dict-20k", "pt", _pt_case(
    lambda c, p: pt_zip(p, b"\x80\x02}" + (_pstr("k") + b"}") * 19_999 + b"s" * 19_999 + b".") and None))
_reg("pt-not-a-tensor", "pt", _pt_case(lambda c, p: _torch_save(42, p)))
_reg("pt-complex", "pt", _pt_case(lambda c, p: _torch_save(__import__("torch").ones(3, dtype=__import__("torch").complex64), p)))
_reg("pt-storage-shorter-than-declared", "pt", _pt_case(
    lambda c, p: pt_zip(p, tensor_pickle(MiB), {"0": {"data": bytes(16)}}) and None))
_reg("pt-offset-out-of-bounds", "pt", _pt_case(
    lambda c, p: pt_zip(p, tensor_pickle(4, size=(4,), offset=1 << 40), {"0": {"data": bytes(16)}}) and None))
_reg("pt-stride-out-of-bounds", "pt", _pt_case(
    lambda c, p: pt_zip(p, tensor_pickle(4, size=(4, 4), stride=(1 << 30, 1)), {"0": {"data": bytes(16)}}) and None))
_reg("pt-missing-record", "pt", _pt_case(
    lambda c, p: pt_zip(p, tensor_pickle(4, key="7"), {"0": {"data": bytes(16)}}) and None))
_reg("pt-bigint-size", "pt", _pt_case(
    lambda c, p: pt_zip(p, tensor_pickle(4, size=(10 ** 30,), stride=(0,)), {"0": {"data": bytes(16)}}) and None))


@case("pt-truncated", "pt")
def _(c):
    import torch

    d = good(c.dir / "dump")
    b = io.BytesIO()
    torch.save(torch.randn(100), b)
    (d / "z.output.0.pt").write_bytes(b.getvalue()[: len(b.getvalue()) // 3])
    return c.done([d], "z.output.0.pt")


def _flipped_pt(member: str, at: int):
    def make(c, p):
        import torch

        b = io.BytesIO()
        torch.save(torch.linspace(0, 1, 64), b)
        p.write_bytes(flip_in_member(b.getvalue(), member, at))
        return {"words": (("crc", "damaged", "checksum", "corrupt"),)}
    return make


_reg("pt-crc-data-byte", "pt", _pt_case(_flipped_pt("/data/0", 100)))
_reg("pt-crc-pickle-byte", "pt", _pt_case(_flipped_pt("data.pkl", 60)))


@case("pt-crc-in-msprobe", "pt")
def _(c):
    d, _p = ms_case(c)
    p = d / MS_DATA / IN0
    p.write_bytes(flip_in_member(p.read_bytes(), "/data/0", 20))
    return c.done([d], f"{MS_DATA}/{IN0}", words=(("crc", "damaged", "checksum", "corrupt"),))


# pickle payloads: each would create its marker file if unpickled unsafely

def _payload_pt(make_pkl):
    def make(c, p):
        m = c.marker()
        make_pkl(p, m)
        return {"payload": str(m)}
    return make


_reg("pt-payload-os-system", "pickle", _pt_case(_payload_pt(lambda p, m: pt_zip(p, system_pickle(m)))),
     payload=True)
_reg("pt-payload-torch-save", "pickle", _pt_case(_payload_pt(
    lambda p, m: _torch_save({"w": __import__("torch").ones(2), "x": Payload(m)}, p))), payload=True)
_reg("pt-payload-open", "pickle", _pt_case(_payload_pt(lambda p, m: _torch_save(OpenPayload(m), p))), payload=True)
_reg("pt-payload-exec", "pickle", _pt_case(_payload_pt(lambda p, m: pt_zip(
    p, b"\x80\x02cbuiltins\nexec\n" + _pstr(f"open({str(m)!r}, 'w').close()") + b"\x85R."))), payload=True)
def _load_from_bytes_pickle(marker: Path) -> bytes:
    """``torch.storage._load_from_bytes(b)`` runs ``torch.load(b)`` without weights_only: ``b`` is a plain pickle."""
    import pickle

    inner = pickle.dumps(Payload(marker), protocol=2)
    return b"\x80\x03ctorch.storage\n_load_from_bytes\nB" + struct.pack("<I", len(inner)) + inner + b"\x85R."


_reg("pt-payload-load-from-bytes", "pickle", _pt_case(_payload_pt(lambda p, m: pt_zip(p, _load_from_bytes_pickle(m)))),
     payload=True)
_reg("pt-payload-legacy-format", "pickle", _pt_case(_payload_pt(
    lambda p, m: _torch_save(Payload(m), p, _use_new_zipfile_serialization=False))), payload=True)
_reg("pt-payload-inside-tensor-list", "pickle", _pt_case(_payload_pt(
    lambda p, m: _torch_save([__import__("torch").ones(2), [__import__("torch").ones(1), OpenPayload(m)]], p))),
    payload=True)


@case("pt-payload-in-msprobe", "pickle", payload=True)
def _(c):
    import torch

    d, _p = ms_case(c)
    m = c.marker()
    torch.save(Payload(m), d / MS_DATA / IN0)
    return c.done([d], f"{MS_DATA}/{IN0}", payload=str(m))


# ============================================================================================
# deeply nested JSON
# ============================================================================================

_DEEP_LIST = "[" * DEEP + "]" * DEEP


@case("deep-dump-json-lists", "deep-json")
def _(c):
    d, p = ms_case(c, tensor=False)
    p.write_text('{"data": {"' + KEY + '": ' + _DEEP_LIST + "}}")
    return c.done([d], MS_JSON)


@case("deep-dump-json-unclosed", "deep-json")
def _(c):
    d, p = ms_case(c, tensor=False)
    p.write_text('{"data": ' + "[" * DEEP)
    return c.done([d], MS_JSON)


@case("deep-dump-json-objects", "deep-json")
def _(c):
    d, p = ms_case(c, tensor=False)
    p.write_text('{"a": ' * DEEP + "1" + "}" * DEEP)
    return c.done([d], MS_JSON)


@case("deep-shard-manifest", "deep-json")
def _(c):
    d = c.dir / "shards"
    shard_folder(d)
    (d / "manifest.json").write_text('{"format": "precision-lab-shards", "version": 1, "runs": ' + _DEEP_LIST + "}")
    return c.done([d], "manifest.json")


@case("deep-order-json", "deep-json")
def _(c):
    d = good(c.dir / "dump")
    (d / "order.json").write_text(_DEEP_LIST)
    return c.done([d], "order.json")


@case("deep-manifest-order", "deep-json")
def _(c):
    d = good(c.dir / "dump")
    (d / "manifest.json").write_text('{"order": ' + _DEEP_LIST + "}")
    return c.done([d], "manifest.json")


@case("deep-sidecar", "deep-json")
def _(c):
    import numpy as np

    d = good(c.dir / "dump")
    np.zeros(4, np.float32).tofile(d / "z.bin")
    (d / "z.json").write_text(_DEEP_LIST)
    return c.done([d], "z.json")


@case("deep-sidecar-bin-json-name", "deep-json")
def _(c):
    import numpy as np

    d = good(c.dir / "dump")
    np.zeros(4, np.float32).tofile(d / "z.bin")
    (d / "z.bin.json").write_text('{"dtype": ' + _DEEP_LIST + "}")
    return c.done([d], "z.bin.json")


@case("deep-safetensors-header", "deep-json")
def _(c):
    d = good(c.dir / "dump")
    (d / "z.safetensors").write_bytes(safetensors_raw(_DEEP_LIST))
    return c.done([d], "z.safetensors")


@case("deep-shard-shape-column", "deep-json")
def _(c):
    import pyarrow as pa

    d = c.dir / "shards"
    p = shard_folder(d)
    t = shard_table(p)
    write_shard_table(p, set_column(t, "shape", pa.array([_DEEP_LIST], pa.string())))
    return c.done([d], SHARD)


# ============================================================================================
# shapes: products beyond int64, Python bigints, negative and non-integer sizes
# ============================================================================================

def _ms_shape(shape):
    def fn(c: Ctx) -> Case:
        d, _p = ms_case(c, lambda doc: first_stat(doc).__setitem__("shape", shape), tensor=False)
        return c.done([d], MS_JSON)
    return fn


for _id, _shape in [("ms-shape-int64-overflow", [2 ** 62, 4]), ("ms-shape-bigint", [10 ** 30]),
                    ("ms-shape-2-to-64", [2 ** 64]), ("ms-shape-negative", [-1, 4]), ("ms-shape-float", [1.5]),
                    ("ms-shape-string", "abc"), ("ms-shape-nested", [[4, 8]]), ("ms-shape-bool", [True, 8])]:
    _reg(_id, "shape", _ms_shape(_shape))


# entries whose fields have the wrong type (msprobe writes lists and objects there)
for _id, _key, _field, _value in [
    ("ms-input-args-is-a-number", KEY, "input_args", 5),
    ("ms-input-kwargs-is-a-number", KEY, "input_kwargs", 1),
    ("ms-output-is-a-string", KEY, "output", "tensor"),
    ("ms-parameters-is-a-list", KEY, "parameters", [1, 2]),
    ("ms-parameters-grad-value-is-a-number", "Module.head.Linear.parameters_grad.0", "", 1),
]:
    def _fn(c, _key=_key, _field=_field, _value=_value):
        def mutate(doc):
            if _key == KEY:
                doc["data"][KEY][_field] = _value
            else:
                doc["data"][_key] = {_field: _value}
        d, _p = ms_case(c, mutate, tensor=False)
        return c.done([d], MS_JSON)
    _reg(_id, "msprobe-structure", _fn)


@case("ms-shape-disagrees-with-tensor", "shape")
def _(c):
    d, _p = ms_case(c, lambda doc: first_stat(doc).__setitem__("shape", [9, 9]))
    return c.done([d], f"{MS_DATA}/{IN0}")


def _bin_case(sidecar, data: bytes = bytes(16), name="z.json", sidecar_name: str = "z.json", **kw):
    def fn(c: Ctx) -> Case:
        d = good(c.dir / "dump")
        (d / "z.bin").write_bytes(data)
        sc = d / sidecar_name
        if isinstance(sidecar, bytes):
            sc.write_bytes(sidecar)
        else:
            sc.write_text(sidecar if isinstance(sidecar, str) else json.dumps(sidecar))
        return c.done([d], name, **kw)
    return fn


for _id, _sc in [("bin-shape-int64-overflow", {"dtype": "float32", "shape": [2 ** 62, 4]}),
                 ("bin-shape-bigint", {"dtype": "float32", "shape": [10 ** 30]}),
                 ("bin-shape-negative", {"dtype": "float32", "shape": [-4]}),
                 ("bin-shape-infinite-float", '{"dtype": "float32", "shape": [1e400]}'),
                 ("bin-offset-bigint", {"dtype": "float32", "shape": [4], "offset": 10 ** 30}),
                 ("bin-offset-negative", {"dtype": "float32", "shape": [4], "offset": -16})]:
    _reg(_id, "shape", _bin_case(_sc))


def _npy_case(data: bytes, name: str = "z.output.0.npy", **kw):
    def fn(c: Ctx) -> Case:
        d = good(c.dir / "dump")
        (d / name).write_bytes(data)
        return c.done([d], name, **kw)
    return fn


for _id, _shape in [("npy-shape-int64-overflow", (2 ** 62, 4)), ("npy-shape-bigint", (10 ** 30,)),
                    ("npy-shape-negative", (-1,)), ("npy-shape-1tib", (1 << 40,))]:
    _reg(_id, "shape", _npy_case(npy_raw(npy_header_text(_shape), bytes(16))))
for _id, _shape in [("npy-shape-negative-no-data", (-1,)), ("npy-shape-negative-pair-no-data", (-2, -2)),
                    ("npy-shape-zero-and-negative", (0, -5))]:
    _reg(_id, "shape", _npy_case(npy_raw(npy_header_text(_shape))))


def _st_case(header, data: bytes = b"", length=None, **kw):
    def fn(c: Ctx) -> Case:
        d = good(c.dir / "dump")
        (d / "z.safetensors").write_bytes(safetensors_raw(header, data, length))
        return c.done([d], "z.safetensors", **kw)
    return fn


for _id, _hdr in [("st-shape-int64-overflow", {"w": {"dtype": "F32", "shape": [2 ** 62, 4], "data_offsets": [0, 16]}}),
                  ("st-shape-bigint", {"w": {"dtype": "F32", "shape": [10 ** 30], "data_offsets": [0, 16]}}),
                  ("st-shape-negative", {"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}),
                  ("st-offsets-bigint", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 10 ** 30]}}),
                  ("st-offsets-negative", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}})]:
    _reg(_id, "shape", _st_case(_hdr, bytes(16)))


# ============================================================================================
# msprobe statistics
# ============================================================================================

_reg("ms-stat-huge-int-max", "statistic",
     lambda c: c.done([ms_case(c, lambda doc: first_stat(doc).__setitem__("Max", 10 ** 400), tensor=False)[0]],
                      MS_JSON, words=("Max",)), expect="accept")
_reg("ms-stat-huge-int-min", "statistic",
     lambda c: c.done([ms_case(c, lambda doc: first_stat(doc).__setitem__("Min", -(10 ** 400)), tensor=False)[0]],
                      MS_JSON, words=("Min",)), expect="accept")


@case("ms-stat-5000-digit-int", "json-limits")
def _(c):
    def mutate(doc):
        first_stat(doc)["Max"] = "@@BIG@@"
        return json.dumps(doc).replace('"@@BIG@@"', "9" * 5000)
    d, _p = ms_case(c, mutate, tensor=False)
    return c.done([d], MS_JSON)


# ============================================================================================
# .npy
# ============================================================================================

_NPY_OK_HEADER = npy_header_text((2,))

for _id, _data, _kw in [
    ("npy-header-over-10kb", npy_raw(_NPY_OK_HEADER + " " * 12_000, bytes(8)), {"not_words": ("python objects",)}),
    ("npy-header-over-10kb-v2", npy_raw(_NPY_OK_HEADER + " " * 20_000, bytes(8), version=2),
     {"not_words": ("python objects",)}),
    ("npy-v2-header-length-4gib", b"\x93NUMPY\x02\x00" + struct.pack("<I", 0xFFFFFFF0) + b"{'descr'", {}),
    ("npy-truncated-header", npy_raw(_NPY_OK_HEADER, bytes(8))[:20], {}),
    ("npy-magic-only", b"\x93NUMPY", {}),
    ("npy-version-9", b"\x93NUMPY\x09\x09" + npy_raw(_NPY_OK_HEADER, bytes(8))[8:], {}),
    ("npy-header-not-dict", npy_raw("[1, 2, 3]", bytes(8)), {}),
    ("npy-header-missing-keys", npy_raw("{'descr': '<f4'}", bytes(8)), {}),
    ("npy-descr-unknown", npy_raw(npy_header_text((2,), "<q99"), bytes(8)), {}),
    ("npy-fortran-order-junk", npy_raw(npy_header_text((2,), fortran="'yes'"), bytes(8)), {}),
    ("npy-shape-is-a-list", npy_raw("{'descr': '<f4', 'fortran_order': False, 'shape': [2], }", bytes(8)), {}),
    ("npy-shape-5000-digits", npy_raw("{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 5000 + ",), }",
                                      bytes(8)), {}),
    ("npy-void-itemsize-2gib", npy_raw(npy_header_text((1,), "|V2147483647"), bytes(8)), {}),
    ("npy-object-dtype-header", npy_raw(npy_header_text((1,), "|O"), bytes(8)), {}),
    ("npy-empty-file", b"", {}),
    ("npy-random-bytes", bytes(range(256)) * 4, {}),
]:
    _reg(_id, "npy", _npy_case(_data, **_kw))


@case("npy-trailing-bytes", "npy")
def _(c):
    import numpy as np

    return _npy_case(npy_bytes(np.ones(4, np.float32)) + b"junk")(c)


@case("npy-truncated-data", "npy")
def _(c):
    import numpy as np

    return _npy_case(npy_bytes(np.arange(1000, dtype=np.float32))[:300])(c)


@case("npy-object-array", "npy")
def _(c):
    import numpy as np

    return _npy_case(npy_bytes(np.array([1, "two", None], dtype=object), allow_pickle=True))(c)


@case("npy-structured-object-field", "npy")
def _(c):
    import numpy as np

    return _npy_case(npy_bytes(np.zeros(2, dtype=[("a", "f4"), ("b", "O")]), allow_pickle=True))(c)


@case("npy-payload-object-array", "pickle", payload=True)
def _(c):
    import numpy as np

    m = c.marker()
    out = _npy_case(npy_bytes(np.array([Payload(m)], dtype=object), allow_pickle=True))(c)
    out.payload = str(m)
    return out


@case("npy-payload-header-code", "pickle", payload=True)
def _(c):
    m = c.marker()
    hdr = ("{'descr': __import__('os').system('touch " + str(m) + "'), 'fortran_order': False, 'shape': (2,), }")
    out = _npy_case(npy_raw(hdr, bytes(8)))(c)
    out.payload = str(m)
    return out


# ============================================================================================
# .safetensors
# ============================================================================================

for _id, _args, _kw in [
    ("st-header-length-past-file", ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), 10_000), {}),
    ("st-header-length-2-to-64", ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), 2 ** 64 - 1), {}),
    ("st-offsets-past-file", ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 400]}}, bytes(16), None), {}),
    ("st-offsets-overlap", ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                             "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), None), {}),
    ("st-offsets-gap", ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}, bytes(32), None), {}),
    ("st-header-not-json", ("{this is not json", b"", None), {}),
    ("st-header-not-utf8", (b'{"w\xff\xfe": 1}', b"", None), {}),
    ("st-header-is-array", ("[1, 2, 3]", b"", None), {}),
    ("st-unknown-dtype", ({"w": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), None), {}),
    ("st-entry-not-object", ({"w": [1, 2]}, b"", None), {}),
    ("st-5000-digit-int", ('{"__metadata__": {"x": ' + "9" * 5000 + "}}", b"", None), {}),
]:
    _reg(_id, "safetensors", _st_case(*_args, **_kw))


@case("st-truncated", "safetensors")
def _(c):
    import numpy as np
    from safetensors.numpy import save

    d = good(c.dir / "dump")
    (d / "z.safetensors").write_bytes(save({"w": np.ones(100, np.float32)})[:-50])
    return c.done([d], "z.safetensors")


@case("st-shorter-than-length-field", "safetensors")
def _(c):
    return _npy_case(b"\x10\x00\x00", name="z.safetensors")(c)


@case("st-empty-file", "safetensors")
def _(c):
    return _npy_case(b"", name="z.safetensors")(c)


@case("st-200k-empty-tensors", "safetensors", bomb=True, max_seconds=20.0)
def _(c):
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_000)}
    return _st_case(header)(c)


# ============================================================================================
# raw .bin with a JSON sidecar
# ============================================================================================

for _id, _sc, _kw in [
    ("bin-sidecar-not-json", "{dtype: float32", {}),
    ("bin-sidecar-is-a-list", "[1, 2]", {}),
    ("bin-sidecar-unknown-dtype", {"dtype": "float13", "shape": [4]}, {}),
    ("bin-sidecar-void-dtype", {"dtype": "V4", "shape": [4]}, {"name": ("z.json", "z.bin")}),
    ("bin-sidecar-structured-dtype", {"dtype": "[('a', '<f4')]", "shape": [4]}, {}),
    ("bin-sidecar-dtype-is-object", {"dtype": {"kind": "f"}, "shape": [4]}, {}),
    ("bin-sidecar-byteorder", {"dtype": "float32", "shape": [4], "byteorder": "middle"}, {}),
    ("bin-sidecar-not-utf8", b'{"dtype": "float32\xff", "shape": [4]}', {}),
    ("bin-sidecar-5000-digit-int", '{"dtype": "float32", "shape": [4], "offset": ' + "9" * 5000 + "}", {}),
    ("bin-size-mismatch", {"dtype": "float32", "shape": [3, 3]}, {}),
]:
    _reg(_id, "bin-sidecar", _bin_case(_sc, **_kw))


# object pointers read from the file: touching them would crash the process, so it runs apart
_reg("bin-sidecar-object-dtype", "bin-sidecar", _bin_case({"dtype": "object", "shape": [2]}, b"\x41" * 16,
                                                          name=("z.json", "z.bin")), isolate=True)


@case("bin-without-sidecar", "bin-sidecar")
def _(c):
    d = good(c.dir / "dump")
    (d / "z.bin").write_bytes(bytes(16))
    return c.done([d], "z.bin")


# ============================================================================================
# Parquet shard folders (our own format)
# ============================================================================================

@case("shard-million-rows", "shards", bomb=True, max_seconds=20.0)
def _(c):
    import numpy as np

    d = c.dir / "shards"
    p = shard_folder(d)
    t = shard_table(p)
    write_shard_table(p, t.take(np.zeros(1_000_000, np.int64)))
    return c.done([d], SHARD)


@case("shard-dictionary-string-bomb", "shards", bomb=True, max_seconds=20.0)
def _(c):
    """512 rows whose op name is one 4 MiB string, stored once in a dictionary page (2 GiB as Python strings)."""
    import numpy as np
    import pyarrow as pa

    d = c.dir / "shards"
    p = shard_folder(d)
    t = shard_table(p).take(np.zeros(512, np.int64))
    op = pa.DictionaryArray.from_arrays(pa.array(np.zeros(512, np.int32)), pa.array(["x" * (4 * MiB)]))
    write_shard_table(p, set_column(t, "op", op), dictionary_pagesize_limit=1 << 30)
    return c.done([d], SHARD)


@case("shard-histogram-list-bomb", "shards", bomb=True, max_seconds=20.0)
def _(c):
    """One row whose histogram lists hold 32 million zeros (run-length encoded: a few kB on disk)."""
    import numpy as np
    import pyarrow as pa

    d = c.dir / "shards"
    p = shard_folder(d)
    t = shard_table(p)
    n = 32 * MiB
    off = pa.array(np.array([0, n], np.int32))
    bins = pa.ListArray.from_arrays(off, pa.array(np.zeros(n, np.int32)))
    counts = pa.ListArray.from_arrays(off, pa.array(np.zeros(n, np.int64)))
    t = set_column(set_column(t, "hist_bins", bins), "hist_counts", counts)
    write_shard_table(p, t)
    return c.done([d], SHARD)


@case("shard-kept-tensor-bomb", "shards", bomb=True, max_seconds=20.0)
def _(c):
    """6 rows keeping one 256 MiB tensor of zeros, stored once in a dictionary page (1.5 GiB when read)."""
    import numpy as np
    import pyarrow as pa

    d = c.dir / "shards"
    p = shard_folder(d)
    t = shard_table(p).take(np.zeros(6, np.int64))
    blob = npy_raw(npy_header_text((64 * MiB,)), bytes(256 * MiB))
    kept = pa.DictionaryArray.from_arrays(pa.array(np.zeros(6, np.int32)), pa.array([blob], pa.binary()))
    del blob
    write_shard_table(p, set_column(t, "tensor_npy", kept), dictionary_pagesize_limit=1 << 30)
    return c.done([d], SHARD)


def _shard_listed(target: Callable[[Ctx, Path], str]):
    def fn(c: Ctx) -> Case:
        d = c.dir / "shards"
        shard_folder(d)
        name = target(c, d)
        edit_manifest(d, lambda doc: doc["runs"][0]["files"].append(name))
        return c.done([d], "manifest.json", vary=name)
    return fn


for _id, _twin, _target in [
    ("shard-lists-outside-rel-existing", "shard-rel", lambda c, d: rel_to(c.outside / "shards" / SHARD, d)),
    ("shard-lists-outside-rel-missing", "shard-rel", lambda c, d: rel_to(c.outside / "shards" / "r/rank0/step9.parquet", d)),
    ("shard-lists-outside-abs-existing", "shard-abs", lambda c, d: str(c.outside / "shards" / SHARD)),
    ("shard-lists-outside-abs-missing", "shard-abs", lambda c, d: str(c.outside / "shards" / "r/rank0/step9.parquet")),
    ("shard-lists-etc-passwd", "shard-abs", lambda c, d: "/etc/passwd"),
]:
    _reg(_id, "containment", _shard_listed(_target), twin=_twin)


def _shard_edit(edit: Callable, name: str = SHARD, **kw):
    def fn(c: Ctx) -> Case:
        d = c.dir / "shards"
        p = shard_folder(d)
        more = edit(c, d, p) or {}
        return c.done([d], name, **{**kw, **more})
    return fn


def _col(name, values, typ=None):
    import pyarrow as pa

    def edit(c, d, p):
        t = shard_table(p)
        write_shard_table(p, set_column(t, name, pa.array(values, typ or t.schema.field(name).type)))
    return edit


_reg("shard-run-name-traversal", "shards",
     _shard_edit(lambda c, d, p: edit_manifest(d, lambda doc: doc["runs"][0].__setitem__("name", "../escape")),
                 name="manifest.json"))
_reg("shard-manifest-version-99", "shards",
     _shard_edit(lambda c, d, p: edit_manifest(d, lambda doc: doc.__setitem__("version", 99)), name="manifest.json"))
_reg("shard-manifest-not-utf8", "shards",
     _shard_edit(lambda c, d, p: (d / "manifest.json").write_bytes(
         (d / "manifest.json").read_bytes().replace(b'"r"', b'"r\xff"', 1)) and None, name="manifest.json"))
_reg("shard-listed-file-missing", "shards", _shard_edit(
    lambda c, d, p: edit_manifest(d, lambda doc: doc["runs"][0]["files"].append("r/rank0/step5.parquet")),
    name="r/rank0/step5.parquet"))
_reg("shard-not-parquet", "shards", _shard_edit(lambda c, d, p: p.write_bytes(b"PAR1 not really PAR1") and None))
_reg("shard-truncated", "shards", _shard_edit(lambda c, d, p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
                                              and None))
_reg("shard-shape-bigint", "shards", _shard_edit(_col("shape", ["[1000000000000000000000000000000]"])))
_reg("shard-shape-not-json", "shards", _shard_edit(_col("shape", ["[4, 8"])))
_reg("shard-histogram-bin-out-of-range", "shards", _shard_edit(_col("hist_bins", [[99_999]])))
_reg("shard-op-missing", "shards", _shard_edit(_col("op", [None])))
_reg("shard-kept-tensor-huge-header", "shards", _shard_edit(
    _col("tensor_npy", [npy_raw(npy_header_text((1 << 40,), "<f8"), bytes(16))])))
_reg("shard-kept-tensor-object-dtype", "shards", _shard_edit(
    _col("tensor_npy", [npy_bytes(__import__("numpy").array([1, "x"], dtype=object), allow_pickle=True)])))


@case("shard-missing-columns", "shards")
def _(c):
    d = c.dir / "shards"
    p = shard_folder(d)
    write_shard_table(p, shard_table(p).drop_columns(["op", "role"]))
    return c.done([d], SHARD)


@case("shard-kept-tensor-payload", "pickle", payload=True)
def _(c):
    import numpy as np

    m = c.marker()
    out = _shard_edit(_col("tensor_npy", [npy_bytes(np.array([Payload(m)], dtype=object), allow_pickle=True)]))(c)
    out.payload = str(m)
    return out


# ============================================================================================
# JSON files past the size limit (sparse: no disk used), counts past the record limit
# ============================================================================================

_OVER = 65 * MiB  # max_json_mb defaults to 64


@case("dump-json-over-size-limit", "json-limits")
def _(c):
    d, p = ms_case(c, tensor=False)
    sparse_file(p, b'{"data": {', _OVER)
    return c.done([d], MS_JSON)


@case("order-json-over-size-limit", "json-limits")
def _(c):
    d = good(c.dir / "dump")
    sparse_file(d / "order.json", b'["a.output.0", ', _OVER)
    return c.done([d], "order.json")


@case("order-txt-over-size-limit", "json-limits")
def _(c):
    d = good(c.dir / "dump")
    sparse_file(d / "order.txt", b"a.output.0\n", _OVER)
    return c.done([d], "order.txt")


@case("sidecar-over-size-limit", "json-limits")
def _(c):
    d = good(c.dir / "dump")
    (d / "z.bin").write_bytes(bytes(16))
    sparse_file(d / "z.json", b'{"dtype": "float32", "shape": [4], "pad": "', _OVER)
    return c.done([d], "z.json")


@case("shard-manifest-over-size-limit", "json-limits")
def _(c):
    d = c.dir / "shards"
    shard_folder(d)
    sparse_file(d / "manifest.json", b'{"format": "precision-lab-shards", "version": 1, "pad": "', _OVER)
    return c.done([d], "manifest.json")


@case("safetensors-header-over-size-limit", "json-limits")
def _(c):
    d = good(c.dir / "dump")
    p = d / "z.safetensors"
    sparse_file(p, (_OVER - 8).to_bytes(8, "little") + b'{"w": "', _OVER)
    return c.done([d], "z.safetensors")


@case("dump-json-100001-entries", "json-limits", bomb=True)
def _(c):
    def mutate(doc):
        e = doc["data"][KEY]
        doc["data"] = {f"Functional.linear.{i}.forward": e for i in range(100_001)}
    d, _p = ms_case(c, mutate, tensor=False)
    return c.done([d], MS_JSON)


_EMPTY_OBJECTS = (64 * MiB - 64) // 3  # "{}," each: ~80 bytes apiece once parsed


@case("dump-json-64mib-of-empty-objects", "json-limits", bomb=True)
def _(c):
    """Within the 64 MiB JSON limit, 22 million empty objects: about 1.8 GB as Python dicts."""
    d, p = ms_case(c, tensor=False)
    with open(p, "w") as f:
        f.write('{"data": {}, "pad": [')
        f.write("{}," * (_EMPTY_OBJECTS - 1))
        f.write("{}]}")
    return c.done([d], MS_JSON)


@case("st-header-64mib-of-empty-lists", "json-limits", bomb=True)
def _(c):
    """A safetensors header within the JSON limit whose metadata is 22 million empty lists."""
    d = good(c.dir / "dump")
    body = b'{"__metadata__": [' + b"[]," * (_EMPTY_OBJECTS - 1) + b"[]]}"
    (d / "z.safetensors").write_bytes(safetensors_raw(body))
    return c.done([d], "z.safetensors")


@case("npy-v2-header-1gib-sparse", "npy", bomb=True)
def _(c):
    """A .npy whose version 2 header claims 1 GiB, in a sparse file that holds it (no disk used)."""
    d = good(c.dir / "dump")
    n = 1 << 30
    sparse_file(d / "z.output.0.npy", b"\x93NUMPY\x02\x00" + struct.pack("<I", n) + b"{'descr': '<f4', ", 12 + n + 64)
    return c.done([d], "z.output.0.npy")


@case("dump-json-utf16", "json-limits")
def _(c):
    d, p = ms_case(c, tensor=False)
    p.write_bytes(p.read_text().encode("utf-16"))
    return c.done([d], MS_JSON)


@case("dump-json-data-is-a-list", "json-limits")
def _(c):
    d, _p = ms_case(c, lambda doc: doc.__setitem__("data", []), tensor=False)
    return c.done([d], MS_JSON)


@case("dump-json-entry-is-null", "json-limits")
def _(c):
    d, _p = ms_case(c, lambda doc: doc["data"].__setitem__(KEY, None), tensor=False)
    return c.done([d], MS_JSON)


@case("dump-json-truncated", "json-limits")
def _(c):
    d, p = ms_case(c, tensor=False)
    p.write_text(p.read_text()[:200])
    return c.done([d], MS_JSON)


# ============================================================================================
# names
# ============================================================================================

@case("name-not-utf8-file", "names")
def _(c):
    d = good(c.dir / "dump")
    with open(os.fsencode(d) + b"/zz\xff\xfe.output.0.npy", "wb") as f:
        f.write(_npy1())
    return c.done([d], "zz")


@case("name-not-utf8-folder", "names")
def _(c):
    d = good(c.dir / "dump")
    sub = os.fsencode(d) + b"/sub\xff"
    os.mkdir(sub)
    with open(sub + b"/x.output.0.npy", "wb") as f:
        f.write(_npy1())
    return c.done([d], "x.output.0.npy")


@case("name-newline-injection", "names")
def _(c):
    d = good(c.dir / "dump")
    (d / "z\nerror: all good.output.0.npy").write_bytes(b"not numpy")
    return c.done([d], "all good.output.0.npy")


@case("name-terminal-escape", "names")
def _(c):
    d = good(c.dir / "dump")
    (d / "\x1b[2J\x1b[31mred.output.0.npy").write_bytes(b"not numpy")
    return c.done([d], "red.output.0.npy", not_words=("\x1b",))


@case("ms-key-lone-surrogate", "names")
def _(c):
    def mutate(doc):
        doc["data"]["Functional.\ud800evil.0.forward"] = doc["data"].pop(KEY)
    d, _p = ms_case(c, mutate, tensor=False)
    return c.done([d], MS_JSON)


# ============================================================================================
# empty and unusable arguments
# ============================================================================================

@case("empty-folder", "empty")
def _(c):
    d = c.dir / "dump"
    d.mkdir()
    return c.done([d], "dump")


@case("empty-nested-folders", "empty")
def _(c):
    d = c.dir / "dump"
    (d / "a" / "b" / "c").mkdir(parents=True)
    return c.done([d], "dump")


@case("empty-hidden-files-only", "empty")
def _(c):
    d = c.dir / "dump"
    d.mkdir()
    (d / ".a.output.0.npy").write_bytes(_npy1())
    (d / ".DS_Store").write_bytes(b"\0" * 8)
    return c.done([d], "dump")


@case("empty-unsupported-files-only", "empty")
def _(c):
    d = c.dir / "dump"
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    (d / "model.onnx").write_bytes(b"\0" * 10)
    return c.done([d], "dump")


@case("empty-zip-archive", "empty")
def _(c):
    z = zip_files(c.dir / "nothing.zip", [])
    return c.done([z], "nothing.zip")


@case("empty-zip-only-folders", "empty")
def _(c):
    z = raw_zip(c.dir / "dirs.zip", [{"name": "dump/", "data": b"", "mode": stat.S_IFDIR | 0o755},
                                     {"name": "dump/sub/", "data": b"", "mode": stat.S_IFDIR | 0o755}])
    return c.done([z], "dirs.zip")


@case("empty-zip-macos-junk", "empty")
def _(c):
    z = zip_files(c.dir / "mac.zip", [("__MACOSX/dump/._a.output.0.npy", b"\0\x05\x16\x07"),
                                       ("dump/.DS_Store", b"\0" * 8)])
    return c.done([z], "mac.zip")


@case("missing-path", "empty")
def _(c):
    return c.done([c.dir / "no-such-dump"], "no-such-dump")


@case("single-file-argument", "empty")
def _(c):
    p = c.dir / "x.output.0.npy"
    p.write_bytes(_npy1())
    return c.done([p], "x.output.0.npy")


# ============================================================================================
# the worker: runs cases in this process, one after another, measuring each
# ============================================================================================

def db_counts(db) -> dict:
    from precision_lab.store import Store

    s = Store(db)
    return {t: s.sql(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}


def session_warnings(db, session: str) -> list[str]:
    from precision_lab.store import Store

    s = Store(db)
    rows = s.sql("SELECT w.file, w.message FROM warnings w JOIN sessions s USING (session_id) WHERE s.name = ?",
                 [session]).fetchall()
    return [f"{f}: {m}" for f, m in rows]


def _status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_kib() -> int:
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _written() -> Optional[int]:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def run_case(case: Case, db, *, measure: bool = False) -> dict:
    """``precision-lab ingest <case.paths> --db <db>`` in this process; what it printed, did and cost."""
    from typer.testing import CliRunner

    from precision_lab.cli import app

    before = db_counts(db)
    res: dict = {"id": case.id}
    if measure:  # in a fresh child (see _worker) there is nothing to collect or trim first
        res["peak_reset"] = _reset_peak()
        res["rss_before_kib"] = _status_kib("VmRSS")
        w0 = _written()
    t0 = time.monotonic()
    r = CliRunner().invoke(app, ["ingest", *case.paths, "--db", str(db)])
    res["seconds"] = round(time.monotonic() - t0, 3)
    if measure:
        res["peak_kib"] = _peak_kib()
        w1 = _written()
        res["written"] = (w1 - w0) if w0 is not None and w1 is not None else None
    res.update(exit=r.exit_code, stdout=r.stdout, stderr=r.stderr, exception=None, traceback="")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        res["exception"] = f"{type(r.exception).__name__}: {str(r.exception)[:1000]}"
        res["traceback"] = "".join(traceback.format_exception(*r.exc_info))[-3000:]
    res["before"], res["after"] = before, db_counts(db)
    res["warnings"] = session_warnings(db, r.stdout.strip()) if r.exit_code == 0 and r.stdout.strip() else []
    return res


BUILD_LIMIT_S = 180


def _in_child(fn, limit: float) -> tuple[str, object]:
    """Run ``fn()`` in a forked child and return ``("ok", value)``, ``("error", text)``, ``("timeout", limit)``
    or ``("crashed", how)``.

    The child starts from this process as it is (modules imported, nothing
    else), so its peak RSS is the case's own and a hang or a crash ends only
    the child.  Without ``fork`` the function runs here.
    """
    if not hasattr(os, "fork"):
        try:
            return "ok", fn()
        except Exception:
            return "error", traceback.format_exc()[-3000:]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into the caller's code
        os.close(r)
        code = 0
        try:
            try:
                payload = json.dumps(["ok", fn()])
            except BaseException:
                payload = json.dumps(["error", traceback.format_exc()[-3000:]])
            with os.fdopen(w, "w") as f:
                f.write(payload)
            try:
                from precision_lab.store import close_all

                close_all()
            except Exception:
                pass
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + limit
    os.set_blocking(r, False)
    status = None
    while True:
        try:
            b = os.read(r, 1 << 16)
            if b:
                chunks.append(b)
        except BlockingIOError:
            b = None
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(r)
            return "timeout", limit
        if b is None:
            time.sleep(0.02)
    os.set_blocking(r, True)
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    data = b"".join(chunks)
    if not data:
        how = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        return "crashed", how
    kind, value = json.loads(data)
    return kind, value


def _worker(job_path: str) -> None:
    """Build and run the job's cases one at a time, each in its own forked child of this process."""
    job = json.loads(Path(job_path).read_text())
    root, db = Path(job["root"]), job["db"]
    out = open(job["results"], "a", buffering=1)

    def emit(**kw) -> None:
        out.write(json.dumps(kw) + "\n")

    # warm this process once (imports, compiled kernels, the baseline session), then hold no database
    # open: every child starts from here
    from typer.testing import CliRunner

    from precision_lab.cli import app
    from precision_lab.store import close_all

    if db_counts(db)["sessions"] == 0:  # the session every case must leave alone
        r = CliRunner().invoke(app, ["ingest", job["good"], "--db", db])
        if r.exit_code != 0:
            emit(event="fatal", message=f"baseline ingest failed: {r.output}")
            return
    shutil.rmtree(root / "_warm", ignore_errors=True)
    shard_folder(root / "_warm" / "shards")
    msprobe_dump(root / "_warm" / "ms")  # torch initialises itself on first use: once, here
    import torch

    torch.load(root / "_warm" / "ms" / MS_DATA / IN0, weights_only=True)
    close_all()
    import gc

    gc.collect()
    gc.freeze()  # children's collections must not touch (and so copy) every page inherited from here
    parent = os.getppid()
    for cid in job["cases"]:
        if os.getppid() != parent:  # the test run that started this worker is gone
            return
        emit(event="build", id=cid, t=time.time())
        kind, value = _in_child(lambda: build(cid, root).to_json(), BUILD_LIMIT_S)
        if kind != "ok":
            emit(event="done", id=cid, result={"id": cid, "build_error": f"{kind}: {value}"})
            continue
        case_json = value
        c = Case.from_json(case_json)
        emit(event="run", id=cid, t=time.time(), case=case_json)
        kind, value = _in_child(lambda: run_case(c, db, measure=True), c.max_seconds + 2)
        if kind == "ok":
            res = value
        elif kind == "timeout":
            res = {"id": cid, "timeout": True, "phase": "run", "limit": value}
        elif kind == "crashed":
            res = {"id": cid, "crashed": value, "phase": "run", "tail": ""}
        else:
            res = {"id": cid, "crashed": "an error in the harness", "phase": "run", "tail": value}
        emit(event="done", id=cid, result=res, case=case_json)
    emit(event="finished")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        print(f"usage: {sys.argv[0]} --worker JOB.json", file=sys.stderr)
        sys.exit(2)
