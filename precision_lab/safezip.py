"""The one zip validator: every archive is checked here before a byte of it is trusted.

Uploaded ``.zip`` dumps (``safe_extract``), exported sessions and the zips
inside ``.npz`` and ``.pt`` files (``readers.safeio.check_member_zip``) all
pass ``check_zip``.  An archive is refused as a whole when any entry has an
absolute path or a drive letter, climbs out of the target with ``..``, is a
symbolic link or another special file, is encrypted, uses a compression
method that cannot be read, appears twice, or is both a file and a folder;
or when its entry count, an entry's declared size, the declared total, an
entry's compression ratio, the whole archive's compression ratio or a folder
depth exceeds ``ZipLimits`` (zip bombs).  With ``crcs=True`` every entry's
CRC-32 is verified by streaming it before its contents are trusted (torch
does not verify them, so a damaged ``.pt`` would otherwise read as wrong
numbers).  During extraction the bytes actually inflated are counted too, so
an entry whose header understates its size is stopped at the declared size,
and zipfile verifies every entry's CRC-32.

So what one archive may write to disk is bounded before extraction starts:
at most ``max_total_bytes``, and at most ``max_ratio`` times the archive's
own size once it expands past ``ratio_free_total_bytes``.
"""

from __future__ import annotations

import mmap
import os
import stat
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

__all__ = ["ZipLimits", "UnsafeZip", "check_zip", "safe_extract", "entry_parts"]

_MB = 1 << 20
_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA)
_COPY_CHUNK = _MB
# the settings that set each bound, named in messages: total, files, ratio, depth, one entry's size
UPLOAD_SETTINGS = ("zip_max_total_mb", "zip_max_files", "zip_max_ratio", "max_path_depth", "zip_max_total_mb")


@dataclass(frozen=True)
class ZipLimits:
    """What an archive may expand to (defaults match ``precision_lab.config``).

    ``max_ratio`` applies to each entry larger than ``ratio_min_entry_bytes``
    (a few kilobytes of zeros legitimately compress a thousandfold) and to the
    archive as a whole once it expands past ``ratio_free_total_bytes``, so
    many small, well-compressed entries cannot add up to a bomb either.
    ``max_depth`` bounds folder nesting; ``max_entry_bytes`` one entry's
    declared size (None: only the total bounds it).  ``settings`` names the
    settings that raise each bound, for messages (see ``UPLOAD_SETTINGS``).
    """

    max_total_bytes: int = 8192 * _MB
    max_files: int = 20_000
    max_ratio: float = 200.0
    ratio_min_entry_bytes: int = 64 << 10
    max_depth: int = 32
    ratio_free_total_bytes: int = 16 * _MB
    max_entry_bytes: Optional[int] = None
    settings: tuple[str, str, str, str, str] = UPLOAD_SETTINGS

    def __post_init__(self) -> None:
        if (self.max_total_bytes <= 0 or self.max_files <= 0 or not self.max_ratio > 1
                or self.ratio_min_entry_bytes < 0 or self.max_depth <= 0 or self.ratio_free_total_bytes < 0
                or (self.max_entry_bytes is not None and self.max_entry_bytes <= 0) or len(self.settings) != 5):
            raise ValueError(f"invalid zip limits: {self}")

    @classmethod
    def from_config(cls, config) -> "ZipLimits":
        """Limits from a ``precision_lab.config.ServerConfig``."""
        return cls(max_total_bytes=config.zip_max_total_bytes, max_files=config.zip_max_files,
                   max_ratio=float(config.zip_max_ratio), max_depth=config.max_path_depth)


class UnsafeZip(ValueError):
    """The archive breaks a safety rule; nothing was extracted."""


def _special(info: zipfile.ZipInfo) -> str:
    """'a symbolic link' / 'a special file' when the entry's Unix mode says so, else ''."""
    # Unix mode bits live in the high 16 bits of external_attr when the
    # archive was made on a Unix-like system (create_system 3).
    mode = info.external_attr >> 16
    if not mode or stat.S_ISREG(mode) or stat.S_ISDIR(mode) or not stat.S_IFMT(mode):
        return ""
    return "a symbolic link" if stat.S_ISLNK(mode) else "a special file (pipe, device or socket)"


def entry_parts(name: str) -> tuple[str, ...] | None:
    """The path components of an entry (or an uploaded file's name), or None if it is absolute or escapes."""
    norm = name.replace("\\", "/")
    if norm.startswith("/") or (len(norm) >= 2 and norm[1] == ":" and norm[0].isalpha()):
        return None  # absolute, or a Windows drive letter
    parts = []
    for p in PurePosixPath(norm).parts:
        if p in ("", "."):
            continue
        if p == ".." or "\x00" in p:
            return None
        parts.append(p)
    return tuple(parts)


def check_zip(path: os.PathLike | str, limits: ZipLimits = ZipLimits(), *, shown: Optional[str] = None,
              what: str = "zip archive", crcs: bool = False) -> list[zipfile.ZipInfo]:
    """Validate every entry of ``path`` (see the module doc); returns the entries or raises UnsafeZip.

    ``shown``: how messages name the archive (default: its path); ``what``: what it is (``".pt archive"``);
    ``crcs``: also verify every entry's CRC-32 before returning.
    """
    path = Path(path)
    shown = str(path) if shown is None else shown
    total_s, files_s = limits.settings[:2]
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise UnsafeZip(f"{shown}: not a readable {what}, truncated or corrupt ({e})") from None
    except OSError as e:
        raise UnsafeZip(f"{shown}: cannot open ({e.strerror or e})") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > limits.max_files:
            raise UnsafeZip(
                f"{shown}: {len(infos)} entries exceed the limit of {limits.max_files} files "
                f"(zip bomb protection; raise {files_s} if the archive is trusted)"
            )
        seen: set[tuple[str, ...]] = set()
        total = 0
        for info in infos:
            parts = _checked_entry(info, limits, shown)
            if parts and not info.is_dir():
                if parts in seen:
                    raise UnsafeZip(f"{shown}: entry {info.filename!r} appears more than once")
                seen.add(parts)
            total += info.file_size
            if total > limits.max_total_bytes:
                raise UnsafeZip(
                    f"{shown}: uncompressed size exceeds the limit of {limits.max_total_bytes} bytes "
                    f"(zip bomb protection; raise {total_s} if the archive is trusted)"
                )
        _check_whole(path, len(infos), total, seen, limits, shown)
        if crcs:
            _check_crcs(zf, path, infos, shown, what)
    return infos


def _checked_entry(info: zipfile.ZipInfo, limits: ZipLimits, shown: str) -> tuple[str, ...]:
    """One entry's path components, once its name, kind, encryption, method, depth, size and ratio pass."""
    ratio_s, depth_s, entry_s = limits.settings[2:]
    parts = entry_parts(info.filename)
    if parts is None:
        kind = "an absolute path" if info.filename.replace("\\", "/").startswith("/") or \
            info.filename[1:2] == ":" else "a path that leaves the extraction folder"
        raise UnsafeZip(f"{shown}: entry {info.filename!r} has {kind}; refusing the archive")
    special = _special(info)
    if special:
        raise UnsafeZip(f"{shown}: entry {info.filename!r} is {special}; refusing the archive")
    if info.flag_bits & 0x1:
        raise UnsafeZip(f"{shown}: entry {info.filename!r} is encrypted; cannot read it")
    if info.compress_type not in _METHODS:
        raise UnsafeZip(f"{shown}: entry {info.filename!r} uses compression method {info.compress_type}, "
                        "which cannot be read (stored, deflate, bzip2 and lzma can)")
    depth = len(parts) - (0 if info.is_dir() else 1)
    if depth > limits.max_depth:
        raise UnsafeZip(f"{shown}: entry {info.filename!r} is nested {depth} folders deep, more than "
                        f"the limit of {limits.max_depth} ({depth_s})")
    if limits.max_entry_bytes is not None and info.file_size > limits.max_entry_bytes:
        raise UnsafeZip(f"{shown}: entry {info.filename!r} expands to {info.file_size} bytes, more than "
                        f"the limit of {limits.max_entry_bytes} bytes ({entry_s})")
    if (info.file_size > limits.ratio_min_entry_bytes
            and info.file_size > limits.max_ratio * max(info.compress_size, 1)):
        raise UnsafeZip(
            f"{shown}: entry {info.filename!r} expands {info.file_size / max(info.compress_size, 1):.0f}x "
            f"({info.compress_size} -> {info.file_size} bytes), more than the limit of "
            f"{limits.max_ratio:g}x (zip bomb protection; raise {ratio_s} if the archive is trusted)"
        )
    return parts


def _check_whole(path: Path, count: int, total: int, seen: set, limits: ZipLimits, shown: str) -> None:
    """The archive as a whole: its expansion ratio, and no path both a file and a folder."""
    size = path.stat().st_size
    if total > limits.ratio_free_total_bytes and total > limits.max_ratio * max(size, 1):
        raise UnsafeZip(
            f"{shown}: {count} entries expand {total / max(size, 1):.0f}x in all ({size} -> {total} "
            f"bytes), more than the limit of {limits.max_ratio:g}x (zip bomb protection; raise {limits.settings[2]} "
            "if the archive is trusted)"
        )
    dirs = {parts[:i] for parts in seen for i in range(1, len(parts))}
    clash = next((p for p in sorted(seen) if p in dirs), None)
    if clash is not None:
        raise UnsafeZip(f"{shown}: entry {'/'.join(clash)!r} is both a file and a folder; refusing the archive")


def _check_crcs(zf: zipfile.ZipFile, path: Path, infos: list[zipfile.ZipInfo], shown: str, what: str) -> None:
    """Every entry's CRC-32 against its bytes: stored entries over the file mapped in memory (one pass at
    zlib's speed), the others streamed through ``zipfile``, which checks each one as it ends."""
    info = None
    try:
        stored = _stored_crcs(path, infos)
        for info in infos:
            if info.filename in stored:
                if stored[info.filename] != info.CRC:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")
                continue
            with zf.open(info) as m:
                while m.read(_COPY_CHUNK):
                    pass
    except zipfile.BadZipFile as e:
        raise UnsafeZip(f"{shown}: damaged {what}: entry {info.filename!r} fails its check ({_first(e)}); "
                        "refusing to read numbers from it") from None
    except (zlib.error, EOFError, OSError, NotImplementedError) as e:
        raise UnsafeZip(f"{shown}: damaged {what}: entry {info.filename!r} cannot be inflated ({_first(e)})") from None


def _first(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _stored_crcs(path: Path, infos: list) -> dict[str, int]:
    """CRC-32 of each uncompressed entry (torch writes ``.pt`` entries stored), computed over the file mapped
    in memory, without copying the data through ``zipfile``.  Entries whose local header does not agree
    with the directory are left out (``zipfile`` then checks them the slow way)."""
    out: dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return out
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    for info in infos:
                        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                            continue
                        h = info.header_offset
                        if h < 0 or h + 30 > size or bytes(view[h:h + 4]) != b"PK\x03\x04":
                            continue
                        name_len = int.from_bytes(view[h + 26:h + 28], "little")
                        extra_len = int.from_bytes(view[h + 28:h + 30], "little")
                        start = h + 30 + name_len + extra_len
                        if start + info.file_size > size:
                            continue
                        out[info.filename] = zlib.crc32(view[start:start + info.file_size])
                finally:
                    view.release()
    except (OSError, ValueError):
        return {}
    return out


def _keep_time(target: Path, info: zipfile.ZipInfo) -> None:
    """Give an extracted file the time its archive records (2-second resolution), not the extraction's:
    a reader that orders files by modification time must not take extraction order for execution order."""
    import time

    try:
        t = time.mktime(info.date_time + (0, 0, -1))
        os.utime(target, (t, t))
    except (OverflowError, ValueError, OSError):
        pass


def safe_extract(path: os.PathLike | str, dest: os.PathLike | str, limits: ZipLimits = ZipLimits()) -> Path:
    """Check the whole archive, then extract it under ``dest``; returns ``dest``.

    On a failure part-way (a corrupt entry) files already written stay in
    ``dest``: pass a temporary folder and discard it.
    """
    path, dest = Path(path), Path(dest)
    infos = check_zip(path, limits)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    with zipfile.ZipFile(path) as zf:
        for info in infos:
            parts = entry_parts(info.filename)
            if not parts:
                continue
            target = root.joinpath(*parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            written = 0
            try:
                with zf.open(info) as src, open(target, "wb") as out:
                    while True:
                        chunk = src.read(_COPY_CHUNK)
                        if not chunk:
                            break
                        written += len(chunk)
                        # the header's size is what the limits checked; more is a lie
                        if written > info.file_size:
                            raise UnsafeZip(f"{path}: entry {info.filename!r} inflates past its declared size")
                        out.write(chunk)
                _keep_time(target, info)
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as e:
                raise UnsafeZip(f"{path}: entry {info.filename!r} is corrupt ({e})") from None
            except NotImplementedError as e:
                raise UnsafeZip(f"{path}: entry {info.filename!r} cannot be read ({e})") from None
            except OSError as e:  # the message alone: its file name would be this server's path
                raise UnsafeZip(f"{path}: entry {info.filename!r} cannot be extracted ({e.strerror or 'I/O error'})"
                                ) from None
    return root
