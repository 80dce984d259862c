"""Reading the tensors of one dump file: the loader every path uses.

Ingest (every reader), comparison (a tensor re-read to compare it with its
counterpart) and replay (an op's inputs read back from the dump folder) open
tensor files only through :func:`read_tensors` (one file of any format this
package reads) or :func:`load_source` (the tensor a stored record's
``source`` names inside its dump folder).  So the same checks hold on every
path (``safeio``): only regular files inside the dump, reached without
symbolic links; declared sizes, shapes and element counts within
``ReadLimits`` before any data is held; the zip inside ``.npz`` and ``.pt``
files checked by ``safezip.check_zip`` and every member's CRC-32 verified
before its numbers are trusted; ``.pt`` files unpickled with torch's safe
loader (``weights_only=True``) or, for one plain tensor, by ``ptfile``'s
unpickler that knows five names and runs nothing; ``.npy`` headers without
Python objects.  A file that fails any check is a ``ReadError`` naming it.

Formats: ``.npy``, ``.npz``, ``.pt``/``.pth`` (a tensor or containers of
tensors), ``.safetensors`` and raw ``.bin`` with a JSON sidecar
(``x.json`` or ``x.bin.json``: ``{"dtype", "shape"}``, optional
``"byteorder"`` and ``"offset"``).  A container's tensors have keys (nested
keys joined with ``.``); a lone tensor's key is ``""``.  A file type of a
plug-in's is one more loader: ``@register_file_type(".ext")`` over a function
``(path, rel) -> (key, array or tensor) pairs``, found by the
``precision_lab.file_types`` entry point group; its files are opened after the
same regular-file checks and read on every path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ..formats import numpy_dtype_named
from ..registry import Registry
from .base import ReadError, first_line, natural_key
from .ptfile import NotPlain, read_plain_tensor
from .safeio import (NPY_MAX_HEADER, check_member_zip, check_numel, check_regular, check_tensor, contained, limits,
                     npy_header, open_regular, parse_json, plain_error, read_json, reading, relname)
from .shards import ShardError, kept_tensor

__all__ = ["SUFFIXES", "CONTAINERS", "FILE_TYPES", "register_file_type", "read_tensors", "load_source",
           "load_tensor_file", "bin_sidecars", "safetensors_header"]

SUFFIXES = (".npy", ".npz", ".pt", ".pth", ".safetensors", ".bin")
CONTAINERS = (".npz", ".pt", ".pth", ".safetensors")
_NPY_MAGIC = b"\x93NUMPY"

# a plug-in's file types: suffix -> loader ``(path, rel) -> (key, tensor) pairs``
FILE_TYPES = Registry("tensor file type", group="precision_lab.file_types")


def register_file_type(suffix: str, *, replace: bool = False):
    """Decorator: read files ending in ``suffix`` (``".tens"``) with the decorated loader, which yields ``(key,
    array or tensor)`` pairs (key ``""`` for a lone tensor) and raises on anything it cannot read."""
    suffix = suffix.lower()
    if not suffix.startswith(".") or suffix in SUFFIXES:
        raise ValueError(f"a file type is a suffix the package does not read yet (like '.tens'), not {suffix!r}")

    def add(loader):
        return FILE_TYPES.register(suffix, loader, replace=replace)

    return add


def bin_sidecars(path: Path) -> tuple[Path, Path]:
    """Where the JSON sidecar of a raw ``.bin`` may be, in the order looked at: ``x.json``, ``x.bin.json``."""
    return path.with_suffix(".json"), path.with_name(path.name + ".json")


def read_tensors(path: Path, rel: str, root: Optional[Path] = None, want: Optional[str] = None,
                 sidecar: Optional[Path] = None) -> Iterator[tuple[str, object]]:
    """``(key, array or tensor)`` of every tensor in dump file ``path`` (``rel``: its name in messages), or only
    the one with key ``want``.  Any failure, while opening or while reading, is a ``ReadError`` naming ``rel``.
    ``sidecar``: a ``.bin`` file's JSON sidecar (default: the first of ``bin_sidecars`` that exists)."""
    with reading(rel):  # opening may fail too (a zero-size .npy whose shape numpy cannot allocate)
        it = iter(_open(path, rel, root, want, sidecar))
    while True:
        with reading(rel):
            try:
                kv = next(it)
            except StopIteration:
                return
        yield kv


def _open(path: Path, rel: str, root: Optional[Path], want, sidecar):
    with open_regular(path, rel, root):  # a regular file, reached without links in ``root``: checked once here
        pass
    suf = path.suffix.lower()
    if suf == ".npy":
        return _load_npy(path, rel, root)
    if suf == ".npz":
        return _load_npz(path, rel, root, want)
    if suf in (".pt", ".pth"):
        return _load_pt(path, rel, root, want)
    if suf == ".safetensors":
        return _load_safetensors(path, rel, want)
    if suf == ".bin":
        if sidecar is None:
            sidecar = next((p for p in bin_sidecars(path) if os.path.lexists(p)), None)
        return _load_bin(path, rel, sidecar, root if root is not None else path.parent)
    loader = FILE_TYPES.get(suf)
    if loader is not None:
        return ((k, t) for k, t in loader(path, rel) if want is None or k == want)
    raise ReadError(f"{rel}: not a tensor file this reader knows (readable types: {', '.join(SUFFIXES)})")


def load_source(root: Path, source: str, *, name: str = "", step: int = 0, rank: int = 0) -> Optional[object]:
    """The tensor a stored record's ``source`` names inside dump folder ``root``, read as ingest read it.

    ``source`` is a file relative to ``root`` (``step0/rank0/dump_tensor_data/x.pt``), a container's file and
    key (``model.safetensors#layers.0.weight``), or one of our Parquet shards, whose kept tensor of record
    ``name`` at ``step`` and ``rank`` is read.  None when the file holds no such tensor; a ``ReadError``
    naming the file when it is missing, outside the dump or fails a check.
    """
    root = Path(root)
    rel, _, key = source.partition("#")
    path = contained(root, root, rel, what="tensor file", where=rel)
    if path.suffix.lower() == ".parquet":
        try:
            return kept_tensor(root, path, name, step, rank)
        except ShardError as e:
            raise ReadError(str(e)) from None
    for _k, t in read_tensors(path, rel, root, want=key):
        return t
    return None


# ---- one loader per format: each yields (key, array_or_tensor), key "" for a lone tensor;
# ``want`` restricts a container to one key (re-reading one tensor later)

def _load_npy(path: Path, rel: str, root: Optional[Path]):
    with open_regular(path, rel, root) as f:
        if f.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
            raise ReadError(f"{rel}: not a .npy file (bad magic bytes)")
        f.seek(0)
        shape, fortran, dtype, offset = npy_header(f, rel)
        size = os.fstat(f.fileno()).st_size
        nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize if shape else dtype.itemsize
        if size - offset < nbytes:
            raise ReadError(f"{rel}: truncated: the header promises more data than the file holds")
        if size - offset > nbytes:
            # bytes past the data mean the header's shape is not the data's
            raise ReadError(f"{rel}: the header says shape {list(shape)} of {dtype} ({nbytes} bytes) but "
                            f"the file holds {size - offset} bytes of data")
        if nbytes == 0:
            return [("", np.zeros(shape, dtype=dtype))]
        with reading(rel):  # mapped through the descriptor that was checked; the map outlives the file object
            arr = np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")
    return [("", arr)]


def _load_npz(path: Path, rel: str, root: Optional[Path], want=None):
    import zipfile

    # an .npz is a zip: sizes, ratios and CRCs are checked before numpy inflates a member
    infos = check_member_zip(path, rel, kind=".npz", root=root)
    members = sorted((i for i in infos if not i.is_dir()), key=lambda i: natural_key(i.filename))
    with zipfile.ZipFile(path) as z:
        for info in members:
            k = info.filename
            key = k[:-4] if k.endswith(".npy") else k
            if want is not None and key != want:
                continue
            where = f"{rel}: member {k!r}"
            with z.open(info) as fp:
                if fp.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
                    raise ReadError(f"{where} is not a .npy array")
            with z.open(info) as fp:
                shape, _fortran, dtype, offset = npy_header(fp, where)
            numel = int(np.prod(shape, dtype=object)) if shape else 1
            if info.file_size - offset != numel * dtype.itemsize:
                raise ReadError(f"{where}: the header says shape {list(shape)} of {dtype} ({numel * dtype.itemsize} "
                                f"bytes) but the member holds {info.file_size - offset} bytes of data")
            with reading(where), z.open(info) as fp:
                arr = np.lib.format.read_array(fp, allow_pickle=False, max_header_size=NPY_MAX_HEADER)
            yield key, arr


def _flatten_obj(obj, prefix: str = ""):
    if _is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten_obj(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flatten_obj(v, f"{prefix}.{i}" if prefix else str(i))


def _load_pt(path: Path, rel: str, root: Optional[Path], want=None):
    obj = load_tensor_file(path, rel, root)
    out = list(_flatten_obj(obj))
    if not out:
        raise ReadError(f"{rel}: holds a {type(obj).__name__} with no tensors in it")
    cap = limits().max_file_records
    if len(out) > cap:
        raise ReadError(f"{rel}: holds {len(out)} tensors, more than the limit of {cap} per file (max_file_records)")
    if want is not None:
        return [kv for kv in out if kv[0] == want]
    return sorted(out, key=lambda kv: natural_key(kv[0]))


_ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
              "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}
_ST_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own bound


def safetensors_header(path: Path, rel: str) -> dict:
    """The checked header of a ``.safetensors`` file: ``{name: {"dtype", "shape", "data_offsets"}}``.

    Declared before any data: the header length and tensor count against the
    limits, each tensor's size against ``max_tensor_mb`` and its byte range
    against the file.
    """
    with open_regular(path, rel) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            raise ReadError(f"{rel}: not a .safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(raw, "little")
        if n > min(size - 8, _ST_MAX_HEADER, limits().max_json_bytes):
            raise ReadError(f"{rel}: not a readable .safetensors file (header length {n} is larger than the file "
                            "or the format allows)")
        text = f.read(n)
    try:
        header = parse_json(text, rel, what="header")
    except ReadError as e:
        raise ReadError(f"{rel}: not a readable .safetensors file ({str(e)[len(rel) + 2:]})") from None
    if not isinstance(header, dict):
        raise ReadError(f"{rel}: not a readable .safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    cap = limits().max_file_records
    if len(header) > cap:
        raise ReadError(f"{rel}: holds {len(header)} tensors, more than the limit of {cap} per file "
                        "(max_file_records)")
    data_len = size - 8 - n
    for name, info in header.items():
        where = f"{rel}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ReadError(f"{where} has no dtype/shape/data_offsets")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in _ST_DTYPES:
            raise ReadError(f"{where} has unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise ReadError(f"{where}: shape {shape!r} is not a list of non-negative sizes")
        numel = check_numel(shape, _ST_DTYPES[dt], where)
        if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) and not isinstance(o, bool)
                                                                    for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data_len or offs[1] - offs[0] != numel * _ST_DTYPES[dt]):
            raise ReadError(f"{rel}: not a readable .safetensors file (tensor {name!r}: data_offsets {offs!r} "
                          "do not match its shape or lie outside the file)")
    return header


def _load_safetensors(path: Path, rel: str, want=None):
    from safetensors import SafetensorError, safe_open

    header = safetensors_header(path, rel)
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in sorted(header, key=natural_key):
                if want is None or k == want:
                    yield k, f.get_tensor(k)
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as e:
        raise ReadError(f"{rel}: not a readable .safetensors file ({first_line(e)})") from None


def _np_dtype(name, where: str):
    try:
        return numpy_dtype_named(name)
    except ValueError:
        raise ReadError(f"{where}: unknown dtype {name!r}") from None


def _load_bin(path: Path, rel: str, sidecar: Optional[Path], root: Path):
    if sidecar is None:
        raise ReadError(f"{rel}: raw .bin file without a JSON sidecar: add {path.stem}.json with "
                        "{\"dtype\": ..., \"shape\": [...]} to say how to read it")
    srel = relname(root, sidecar)
    meta = read_json(sidecar, srel, root, what=f"sidecar of {rel}")
    if not isinstance(meta, dict) or "dtype" not in meta or "shape" not in meta:
        raise ReadError(f"{srel}: sidecar of {rel} needs \"dtype\" and \"shape\"")
    shape = meta["shape"]
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise ReadError(f"{srel}: shape {shape!r} is not a list of non-negative sizes")
    dt = _np_dtype(meta["dtype"], srel)
    order = meta.get("byteorder", "little")
    if order not in ("little", "big"):
        raise ReadError(f"{srel}: byteorder must be \"little\" or \"big\", not {order!r}")
    if dt.itemsize > 1:
        dt = dt.newbyteorder("<" if order == "little" else ">")
    offset = meta.get("offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ReadError(f"{srel}: offset must be a non-negative integer")
    numel = check_numel(shape, dt.itemsize, srel)
    expected = offset + numel * dt.itemsize
    actual = check_regular(path, rel).st_size
    if actual != expected:
        raise ReadError(
            f"{rel}: sidecar {srel} says shape {shape} of {dt.name} ({numel * dt.itemsize} bytes"
            f"{f' after {offset}' if offset else ''}) but the file holds {actual} bytes"
        )
    if numel == 0:
        return [("", np.zeros(shape, dtype=dt))]
    with open_regular(path, rel, root) as f:
        arr = np.memmap(f, dtype=dt, mode="r", offset=offset, shape=tuple(shape))
    return [("", arr)]



def _torch_load(path: Path, rel: str, root: Optional[Path] = None):
    """What a ``.pt`` file holds, never unpickling anything but tensors and plain containers.

    The file must be a regular file inside the dump whose zip passes
    ``check_member_zip`` (declared sizes, ratios, CRCs); every tensor in it
    must pass ``check_tensor``.  Legacy (non-zip) ``.pt`` files are refused:
    they carry no sizes to check before unpickling.
    """
    import pickle

    import torch

    check_regular(path, rel)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        raise ReadError(f"{rel}: not a torch file saved by torch.save (zip format); refusing to read it")
    check_member_zip(path, rel, kind=".pt", root=root, loaded_whole=True)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except pickle.UnpicklingError as e:
        raise ReadError(f"{rel}: refused: the file holds Python objects that safe loading "
                        f"(weights_only=True) does not allow, possibly code ({first_line(e)})") from None
    except (RecursionError, MemoryError, OverflowError) as e:
        raise ReadError(f"{rel}: {plain_error(e)}") from None
    except Exception as e:  # torch raises many types for a damaged archive; all mean the same to a user
        raise ReadError(f"{rel}: not a readable torch file, truncated or corrupt ({first_line(e)})") from None
    _check_loaded(obj, rel)
    return obj


def _is_tensor(obj) -> bool:
    """A numpy array or a torch tensor (told apart without importing torch)."""
    return isinstance(obj, np.ndarray) or type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def load_tensor_file(path: Path, rel: str, root: Optional[Path] = None):
    """What a dump's ``.pt`` file holds: a numpy array when it is one plain tensor (read without torch,
    ``ptfile.read_plain_tensor``), else what torch's safe loader returns (tensors in plain containers)."""
    check_regular(path, rel)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PK\x03\x04":
        infos = check_member_zip(path, rel, kind=".pt", root=root, loaded_whole=True, crcs=False)
        try:
            return read_plain_tensor(path, rel, infos)
        except NotPlain:
            pass
    return _torch_load(path, rel, root)


def _check_loaded(obj, rel: str, depth: int = 0) -> None:
    """Every tensor in what ``torch.load`` returned is within the limits; containers are shallow."""
    import torch

    if depth > 64:
        raise ReadError(f"{rel}: containers nested more than 64 deep; refusing to read them")
    if isinstance(obj, torch.Tensor):
        check_tensor(obj, rel)
    elif isinstance(obj, dict):
        for v in obj.values():
            _check_loaded(v, rel, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _check_loaded(v, rel, depth + 1)

