"""A ``.pt`` file that holds one plain tensor, read into numpy without importing torch.

``torch.save(tensor)`` writes a zip: ``data.pkl`` (a pickle that calls
``torch._utils._rebuild_tensor_v2`` on a storage, an offset, a size and a
stride) and each storage's bytes as a stored member ``data/<key>``.  msprobe's
tensor-mode dumps hold one such file per tensor, and importing torch and
running its unpickler cost more than the numbers themselves.  Here the pickle
is read by an unpickler that knows exactly five names (the rebuild function,
the storage classes of plain dtypes, and the empty ``OrderedDict`` of backward
hooks) and refuses every other one; the storage is read once, its CRC-32
checked by ``zipfile`` as it is read, and the array is a bounds-checked strided
view of it.  Anything else (a parameter, a container, a quantised or sparse
tensor, an fp8 storage, a big-endian file) is ``NotPlain``, and the caller
reads the file with torch's safe loader instead.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
import zlib
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..formats import numpy_dtype_named
from .safeio import RATIO_FREE_BYTES, ReadError, check_numel, first_line, limits

__all__ = ["NotPlain", "read_plain_tensor"]

# torch's legacy storage classes of the dtypes numpy (with ml_dtypes) holds
_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}


class NotPlain(Exception):
    """The file is not one plain tensor this reader maps (the caller falls back to torch's loader)."""


class _Frozen:
    """What the unpickler hands out: no pickle opcode (BUILD) may set its state."""

    __slots__ = ()

    def __setstate__(self, state):
        raise NotPlain("state set on a storage")


class _StorageType(_Frozen):
    __slots__ = ("dtype",)

    def __init__(self, name: str) -> None:
        self.dtype = numpy_dtype_named(_STORAGE_DTYPES[name])


class _Storage(_Frozen):
    __slots__ = ("data",)

    def __init__(self, data: np.ndarray) -> None:
        self.data = data


def _rebuild(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    return ("tensor", storage, offset, size, stride)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, load_storage) -> None:
        super().__init__(io.BytesIO(data))
        self._load_storage = load_storage

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise NotPlain(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise NotPlain("an unexpected storage reference")
        return self._load_storage(pid[2], pid[1].dtype, pid[4])


def _stored_member(f, info: zipfile.ZipInfo) -> Optional[bytes]:
    """A stored (uncompressed) member's bytes, read straight from the file at its local header; None when the
    member is compressed or its local header does not agree with the directory."""
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        return None
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return None
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    f.seek(start)
    data = f.read(info.file_size)
    return data if len(data) == info.file_size else None


def _ints(v, what: str) -> tuple[int, ...]:
    if not (isinstance(v, tuple) and all(type(i) is int and i >= 0 for i in v)):
        raise NotPlain(f"{what} is not a tuple of non-negative integers")
    return v


def read_plain_tensor(path: Path, rel: str, infos: list[zipfile.ZipInfo]) -> np.ndarray:
    """The one tensor of a torch zip file whose members ``infos`` passed ``check_member_zip`` (sizes and
    ratios), as a read-only numpy array; ``NotPlain`` when the file holds anything else.  CRC-32s are checked
    as the members are read; a damaged member is a ``ReadError`` naming it."""
    pkl = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(pkl) != 1:
        raise NotPlain("no single data.pkl")
    prefix = pkl[0].filename[: -len("data.pkl")]
    members = {i.filename: i for i in infos}
    order = members.get(prefix + "byteorder")
    with open(path, "rb") as f:
        member = _member_reader(f, path, rel)
        if order is not None and member(order).strip() != b"little":
            raise NotPlain("not little-endian")
        obj = _unpickle(member, pkl[0], _storage_loader(member, members, prefix, rel), rel)
    if not (isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "tensor" and isinstance(obj[1], _Storage)):
        raise NotPlain("not one tensor")
    _, storage, offset, size, stride = obj
    return _view(storage.data, offset, _ints(size, "size"), _ints(stride, "stride"), rel)


def _member_reader(f, path: Path, rel: str) -> Callable[[zipfile.ZipInfo], bytes]:
    """Reads a member of the open archive ``f`` with its CRC-32 checked; a damaged one is a ``ReadError``."""
    def member(info: zipfile.ZipInfo) -> bytes:
        data = _stored_member(f, info)
        if data is None:  # compressed, or headers that disagree: zipfile reads it (and checks its CRC-32)
            try:
                with zipfile.ZipFile(path) as zf:
                    return zf.read(info)
            except (zipfile.BadZipFile, zlib.error, NotImplementedError, EOFError, OSError) as e:
                raise ReadError(f"{rel}: damaged .pt archive: entry {info.filename!r} fails its check "
                                f"({first_line(e)}); refusing to read numbers from it") from None
        if zlib.crc32(data) != info.CRC:
            raise ReadError(f"{rel}: damaged .pt archive: entry {info.filename!r} fails its check (Bad CRC-32); "
                            "refusing to read numbers from it")
        return data

    return member


def _storage_loader(member, members: dict[str, zipfile.ZipInfo], prefix: str, rel: str):
    """What the unpickler calls for a storage: its member read once, with the size its pickle declares."""
    storages: dict[str, _Storage] = {}

    def load_storage(key: str, dtype: np.dtype, numel: int) -> _Storage:
        if key in storages:
            return storages[key]
        info = members.get(f"{prefix}data/{key}")
        if info is None:
            raise ReadError(f"{rel}: the tensor's storage {key!r} is missing from the archive")
        if info.file_size != numel * dtype.itemsize:
            raise ReadError(f"{rel}: storage {key!r} holds {info.file_size} bytes, not the {numel} elements "
                            f"of {dtype} its pickle declares")
        storages[key] = _Storage(np.frombuffer(member(info), dtype=dtype))
        return storages[key]

    return load_storage


def _unpickle(member, pkl: zipfile.ZipInfo, load_storage, rel: str):
    try:
        return _Unpickler(member(pkl), load_storage).load()
    except (NotPlain, ReadError):
        raise
    except Exception as e:  # a damaged pickle: any unpickling error means the same to a user
        raise ReadError(f"{rel}: not a readable torch file, truncated or corrupt ({first_line(e)})") from None


def _view(data: np.ndarray, offset, size: tuple[int, ...], stride: tuple[int, ...], rel: str) -> np.ndarray:
    """The read-only strided view of storage ``data`` the tensor is, after its layout is checked against it."""
    if type(offset) is not int or offset < 0 or len(size) != len(stride) or len(size) > 32:
        raise NotPlain("an unusual offset, stride or number of dimensions")
    item = data.dtype.itemsize
    numel = check_numel(size, item, rel)
    if any(s > 1 and st * item >= 1 << 62 for s, st in zip(size, stride)) or any(s >= 1 << 62 for s in size):
        raise ReadError(f"{rel}: a tensor of shape {list(size)} with strides {list(stride)} cannot be laid out")
    if numel == 0:
        empty = np.empty(size, dtype=data.dtype)
        empty.setflags(write=False)
        return empty
    last = offset + sum((s - 1) * st for s, st in zip(size, stride))
    if last >= data.size:
        raise ReadError(f"{rel}: the tensor reaches element {last} of a storage of {data.size} elements")
    nbytes, stored = numel * item, data.nbytes
    lim = limits()
    if nbytes > RATIO_FREE_BYTES and nbytes > lim.max_ratio * max(stored, 1):
        raise ReadError(f"{rel}: a tensor of shape {list(size)} views {stored} stored bytes as {nbytes} bytes, "
                        f"more than {lim.max_ratio:g}x (zip_max_ratio); refusing it")
    # strides of dimensions of size 1 are never stepped: 0 keeps them in bounds whatever the file says
    return np.lib.stride_tricks.as_strided(data[offset:], shape=size,
                                           strides=[st * item if s > 1 else 0 for s, st in zip(size, stride)],
                                           writeable=False)
