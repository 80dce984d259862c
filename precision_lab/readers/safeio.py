"""Reading files from a dump that anyone may have written.

Every reader opens dump files through these helpers, so one set of rules
holds everywhere:

- **Containment.** A path named *inside* a dump (msprobe ``data_name``, a
  manifest's file list, an order file, a sidecar) is resolved with
  :func:`contained` and must stay inside the dump's root folder; otherwise
  the read is refused with the same sentence whether or not the outside path
  exists.  Only regular files are opened (:func:`open_regular`): symbolic
  links, FIFOs, devices and sockets are refused without being followed or
  opened.
- **Declared sizes first.** :class:`ReadLimits` bounds what one file may
  make us hold: a tensor's ``elements x item size`` from its header, the
  zip inside ``.npz`` and ``.pt`` files (checked by ``safezip.check_zip``,
  the validator uploads pass too: entry paths, declared sizes, ratios, and
  CRCs verified before the data is trusted), the number of tensors one file
  describes, and the size of JSON files.  The limits in force are set by ingest for the duration of
  a read (:func:`limits_in_force`); readers ask :func:`limits`.
- **One error boundary.** :func:`reading` turns any exception raised while a
  file is read into ``ReadError("<file>: <problem in plain words>")``.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import os
import pickle
import re
import stat
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from .base import ReadError, first_line
from ..safezip import UnsafeZip, ZipLimits, check_zip


__all__ = ["ReadLimits", "limits", "limits_in_force", "contained", "open_regular", "check_regular",
           "read_json", "check_member_zip", "check_numel", "check_tensor", "reading", "plain_error",
           "relname", "npy_header", "NPY_MAX_HEADER", "parse_json"]

_MB = 1 << 20
# Entries this small may compress arbitrarily well (a few KiB of zeros); the
# archive-wide ratio and size bounds still apply to them.
RATIO_FREE_BYTES = 64 << 10
# the settings that raise the bounds on the zip inside a .npz/.pt (safezip.ZipLimits.settings)
_MEMBER_SETTINGS = ("max_tensor_mb", "max_file_records", "zip_max_ratio", "max_path_depth", "max_tensor_mb")


@dataclass(frozen=True)
class ReadLimits:
    """Bounds on what one dump file may make a reader hold (defaults match ``precision_lab.config``)."""

    max_tensor_bytes: int = 512 * _MB
    max_file_records: int = 100_000
    max_json_bytes: int = 64 * _MB
    max_ratio: float = 200.0

    @classmethod
    def from_config(cls, config) -> "ReadLimits":
        return cls(max_tensor_bytes=config.max_tensor_mb * _MB, max_file_records=config.max_file_records,
                   max_json_bytes=config.max_json_mb * _MB, max_ratio=float(config.zip_max_ratio))

    def member_zip_limits(self, loaded_whole: bool) -> ZipLimits:
        """What the zip inside one ``.npz``/``.pt`` may expand to: each member within the tensor limit, and all
        of them too when the file is read whole (``.pt``); a few members beyond the record limit (a ``.pt``
        holds its pickle and byte order besides the tensors)."""
        files = self.max_file_records + 16
        return ZipLimits(max_total_bytes=self.max_tensor_bytes * (1 if loaded_whole else files), max_files=files,
                         max_ratio=self.max_ratio, ratio_min_entry_bytes=RATIO_FREE_BYTES,
                         max_entry_bytes=self.max_tensor_bytes, settings=_MEMBER_SETTINGS)


_LIMITS: contextvars.ContextVar[ReadLimits] = contextvars.ContextVar("precision_lab_read_limits",
                                                                      default=ReadLimits())


def limits() -> ReadLimits:
    """The limits in force for the read under way."""
    return _LIMITS.get()


@contextlib.contextmanager
def limits_in_force(lim: Optional[ReadLimits]) -> Iterator[ReadLimits]:
    """Make ``lim`` the limits readers see until the block ends (None: keep the current ones)."""
    if lim is None:
        yield limits()
        return
    token = _LIMITS.set(lim)
    try:
        yield lim
    finally:
        _LIMITS.reset(token)


def relname(root: Path, path: Path) -> str:
    """``path`` relative to ``root`` as text, for messages (never an absolute server path)."""
    try:
        return Path(os.path.relpath(path, root)).as_posix()
    except ValueError:
        return Path(path).name


# ---- containment ----------------------------------------------------------------

def contained(root: Path, base: Path, name: Any, *, what: str, where: str) -> Path:
    """``base / name`` when it stays inside ``root``; else a ReadError.

    ``name`` comes from inside the dump.  It must be a relative path that,
    with ``..`` resolved lexically, stays under ``root``; it is not resolved
    on disk, so whether an outside path exists never changes the answer.
    ``what`` names the entry for the message (``'data_name of X'``),
    ``where`` the file that holds it.
    """
    if not isinstance(name, str) or not name or "\x00" in name or not _utf8(name):
        raise ReadError(f"{where}: {what} {name!a} is not a file name inside the dump")
    norm = name.replace("\\", "/")
    if norm.startswith("/") or re.match(r"^[A-Za-z]:", norm):
        raise ReadError(f"{where}: {what} {name!r} is an absolute path; only files inside the dump are read")
    target = Path(os.path.normpath(os.path.join(os.path.abspath(base), norm)))
    top = Path(os.path.abspath(root))
    if target != top and top not in target.parents:
        raise ReadError(f"{where}: {what} {name!r} points outside the dump; only files inside the dump are read")
    return target


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: valid JSON, not a storable name
        return False
    return True


def check_regular(path: Path, rel: str) -> os.stat_result:
    """``lstat`` of ``path``; a ReadError unless it is a regular file (links are not followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ReadError(f"{rel}: file not found") from None
    except OSError as e:
        raise ReadError(f"{rel}: cannot be read ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ReadError(f"{rel}: is a symbolic link; dumps are read without following links")
    if not stat.S_ISREG(st.st_mode):
        raise ReadError(f"{rel}: is not a regular file (a pipe, device or socket); refusing to open it")
    return st


def _dir_links(root: Path, path: Path, rel: str) -> None:
    """No folder between ``root`` and ``path`` may be a symbolic link."""
    top = Path(os.path.abspath(root))
    p = Path(os.path.abspath(path)).parent
    while p != top and top in p.parents:
        if p.is_symlink():
            raise ReadError(f"{rel}: a folder on its path is a symbolic link; dumps are read without "
                            "following links")
        p = p.parent


@contextlib.contextmanager
def open_regular(path: Path, rel: str, root: Optional[Path] = None):
    """Open ``path`` for reading only if it is a regular file reached without symbolic links.

    ``O_NOFOLLOW`` refuses a link in the last component and ``O_NONBLOCK``
    keeps a FIFO from hanging the open; the opened descriptor is checked
    with ``fstat`` (no race between check and use).
    """
    if root is not None:
        _dir_links(root, path, rel)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ReadError(f"{rel}: file not found") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ReadError(f"{rel}: is a symbolic link; dumps are read without following links") from None
        raise ReadError(f"{rel}: cannot be read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReadError(f"{rel}: is not a regular file (a pipe, device or socket); refusing to open it")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


# Objects and arrays a JSON text may open, per tensor record it may describe: a parsed container costs
# 60-200 bytes however little text it takes ("{}" is two bytes), so size alone does not bound memory.
JSON_CONTAINERS_PER_RECORD = 32


def parse_json(raw: bytes, rel: str, *, what: str = "JSON file") -> object:
    """Parse JSON bytes from a dump, its container count bounded first; bare NaN/Infinity are accepted."""
    cap = JSON_CONTAINERS_PER_RECORD * limits().max_file_records
    opened = raw.count(b"{") + raw.count(b"[")  # an over-count (brackets inside strings) only errs on the safe side
    if opened > cap:
        raise ReadError(f"{rel}: {what} opens {opened} objects and arrays, more than the limit of {cap} "
                        f"({JSON_CONTAINERS_PER_RECORD} per record of max_file_records)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReadError(f"{rel}: not UTF-8 text ({e.reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ReadError(f"{rel}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg})") from None
    except RecursionError:
        raise ReadError(f"{rel}: JSON nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise ReadError(f"{rel}: holds a value that cannot be read ({first_line(e)})") from None


def read_json(path: Path, rel: str, root: Optional[Path] = None, *, what: str = "JSON file") -> object:
    """Parse a JSON file from a dump within the size and container limits (see ``parse_json``)."""
    lim = limits()
    with open_regular(path, rel, root) as f:
        size = os.fstat(f.fileno()).st_size
        if size > lim.max_json_bytes:
            raise ReadError(f"{rel}: {what} of {size} bytes is larger than the limit of {lim.max_json_bytes} "
                            "bytes (max_json_mb)")
        raw = f.read(lim.max_json_bytes + 1)
    return parse_json(raw, rel, what=what)


# ---- declared sizes -------------------------------------------------------------

_INT64_MAX = (1 << 63) - 1


def check_numel(shape, itemsize: int, where: str) -> int:
    """Element count of ``shape`` (Python ints, no overflow) within the tensor size limit."""
    numel = 1
    for s in shape:
        numel *= int(s)
    if numel > _INT64_MAX:
        raise ReadError(f"{where}: shape {list(shape)} has more elements than any tensor can hold")
    nbytes = numel * max(int(itemsize), 1)
    lim = limits().max_tensor_bytes
    if nbytes > lim:
        raise ReadError(f"{where}: a tensor of shape {list(shape)} needs {nbytes} bytes, more than the limit "
                        f"of {lim} bytes (max_tensor_mb)")
    return numel


def check_tensor(t, where: str) -> None:
    """A loaded torch tensor: within the size limit, and not a view far larger than its storage."""
    numel = int(t.numel())
    nbytes = numel * int(t.element_size())
    lim = limits()
    if nbytes > lim.max_tensor_bytes:
        raise ReadError(f"{where}: a tensor of shape {list(t.shape)} needs {nbytes} bytes, more than the "
                        f"limit of {lim.max_tensor_bytes} bytes (max_tensor_mb)")
    try:
        stored = int(t.untyped_storage().nbytes())
    except Exception:  # tensors without storage (meta, sparse) are refused by statistics later
        return
    if nbytes > RATIO_FREE_BYTES and nbytes > lim.max_ratio * max(stored, 1):
        raise ReadError(f"{where}: a tensor of shape {list(t.shape)} views {stored} stored bytes as {nbytes} "
                        f"bytes, more than {lim.max_ratio:g}x (zip_max_ratio); refusing it")


def check_member_zip(path: Path, rel: str, *, kind: str, root: Optional[Path] = None,
                     loaded_whole: bool = False, crcs: bool = True) -> list[zipfile.ZipInfo]:
    """Check the zip inside a ``.npz``/``.pt`` with ``safezip.check_zip`` before any member is trusted.

    The file must be a regular file reached without links; each member's declared size is bounded by the
    tensor limit, the member count by the record limit, ratios by ``zip_max_ratio``, and every member's
    CRC-32 is verified (torch does not verify them).  ``loaded_whole``: the file is read into memory at once
    (``.pt``), so its members together must fit the tensor limit too.  ``crcs=False`` leaves the CRC-32s to a
    caller that checks the members it reads (``ptfile``).  Returns the members; a ``ReadError`` naming
    ``rel`` otherwise.
    """
    check_regular(path, rel)
    if root is not None:
        _dir_links(root, path, rel)
    try:
        return check_zip(path, limits().member_zip_limits(loaded_whole), shown=rel, what=f"{kind} archive",
                         crcs=crcs)
    except UnsafeZip as e:
        raise ReadError(str(e)) from None


NPY_MAX_HEADER = 10_000  # numpy's own bound for headers it parses safely


def npy_header(fp, rel: str) -> tuple[tuple, bool, Any, int]:
    """``(shape, fortran_order, dtype, header bytes)`` of the .npy stream ``fp``, checked before any data."""
    import tokenize

    import numpy as np

    fmt = np.lib.format
    try:
        major, minor = fmt.read_magic(fp)
        if (major, minor) in ((1, 0), (2, 0)):  # the header's declared length, before numpy reads that many bytes
            width = 2 if major == 1 else 4
            pos = fp.tell()
            hlen = int.from_bytes(fp.read(width), "little")
            fp.seek(pos)
            if hlen > NPY_MAX_HEADER:
                raise ReadError(f"{rel}: the .npy header declares {hlen} bytes, longer than the {NPY_MAX_HEADER} "
                                "bytes numpy parses safely; refusing it")
        if (major, minor) == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fp, max_header_size=NPY_MAX_HEADER)
        elif (major, minor) == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(fp, max_header_size=NPY_MAX_HEADER)
        else:
            raise ReadError(f"{rel}: .npy format version {major}.{minor} is not supported (1.0 and 2.0 are)")
    except ReadError:
        raise
    except ValueError as e:
        msg = str(e)
        if "max_header_size" in msg or "large" in msg:
            raise ReadError(f"{rel}: the .npy header is longer than the {NPY_MAX_HEADER} bytes numpy parses "
                            "safely; refusing it") from None
        raise ReadError(f"{rel}: corrupt .npy header ({first_line(e)})") from None
    except (OSError, EOFError, SyntaxError, tokenize.TokenError, TypeError, RecursionError, MemoryError) as e:
        raise ReadError(f"{rel}: corrupt .npy header ({first_line(e)})") from None
    if dtype.hasobject:
        raise ReadError(f"{rel}: refused: the array holds Python objects (pickled data)")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ReadError(f"{rel}: the .npy header's shape {shape!r} is not a list of non-negative sizes")
    check_numel(shape, dtype.itemsize, rel)
    return tuple(shape), bool(fortran), dtype, fp.tell()


# ---- the error boundary ---------------------------------------------------------

def plain_error(e: BaseException) -> str:
    """What went wrong, in plain words, for an exception raised while reading a file."""
    if isinstance(e, RecursionError):
        return "nested too deeply to read"
    if isinstance(e, MemoryError):
        return "needs more memory than this server has; it is too large or corrupt"
    if isinstance(e, OverflowError):
        return f"holds a number or size too large to represent ({first_line(e)})"
    if isinstance(e, pickle.UnpicklingError):
        return ("refused: holds Python objects that safe loading (weights_only=True) does not allow, "
                f"possibly code ({first_line(e)})")
    if isinstance(e, (zipfile.BadZipFile, zlib.error, EOFError)):
        return f"truncated or corrupt ({first_line(e)})"
    if isinstance(e, OSError):
        return f"cannot be read ({e.strerror or first_line(e)})"
    if isinstance(e, UnicodeError):
        return "holds text that is not valid UTF-8"
    return first_line(e)


@contextlib.contextmanager
def reading(rel: str) -> Iterator[None]:
    """Turn any failure while ``rel`` is read into ``ReadError("<rel>: <problem>")``."""
    try:
        yield
    except ReadError:
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - this is the boundary: nothing else reaches a user
        raise ReadError(f"{rel}: {plain_error(e)}") from None
