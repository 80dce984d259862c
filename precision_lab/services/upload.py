"""Browser uploads -> a folder or ``.zip`` on disk that ingest can read.

A directory upload arrives as a list of files whose names are paths inside
the chosen folder (``"dump/step0/rank0/dump.json"``).  Those names come from
the visitor, so each is checked before anything is written: absolute paths,
drive letters and ``..`` are refused (the rule ``precision_lab.safezip``
applies to zip entries), as are duplicates and folders nested deeper than the
server allows.  A single ``.zip`` is written as is; ingest checks and extracts
it with ``safezip``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..safezip import entry_parts

__all__ = ["UploadError", "UploadedItem", "write_upload", "upload_key"]


class UploadError(ValueError):
    """An upload cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class UploadedItem:
    """One uploaded file: its name (a relative path for folder uploads) and bytes."""

    name: str
    data: bytes
    file_id: str = ""


def _items(files: Iterable[Any]) -> list[UploadedItem]:
    out = []
    for f in files:
        if isinstance(f, UploadedItem):
            out.append(f)
        elif isinstance(f, tuple):
            out.append(UploadedItem(str(f[0]), bytes(f[1])))
        else:  # streamlit's UploadedFile: .name, .getvalue(), .file_id
            out.append(UploadedItem(str(f.name), f.getvalue(), str(getattr(f, "file_id", ""))))
    return out


def upload_key(files: Iterable[Any]) -> tuple:
    """Identity of an upload: the uploader returns the same files on every
    rerun, so a page ingests once per key."""
    keys = []
    for f in files:
        fid = getattr(f, "file_id", "") or ""
        keys.append(fid or f"{getattr(f, 'name', '')}:{getattr(f, 'size', '')}")
    return tuple(sorted(keys))


def _parts(name: str, max_depth: int) -> tuple[str, ...]:
    if "\x00" in name:
        raise UploadError(f"uploaded file {name!r}: the name contains a NUL character; refusing the upload")
    parts = entry_parts(name)
    if parts is None:
        norm = name.replace("\\", "/")
        kind = ("an absolute path" if norm.startswith("/") or name[1:2] == ":"
                else "a path that leaves the upload folder ('..')")
        raise UploadError(f"uploaded file {name!r} has {kind}; refusing the upload")
    if not parts:
        raise UploadError(f"uploaded file {name!r} has an empty name; refusing the upload")
    if len(parts) - 1 > max_depth:
        raise UploadError(f"uploaded file {name!r} is nested {len(parts) - 1} folders deep, more than the "
                          f"limit of {max_depth}; refusing the upload")
    return parts


def write_upload(files: Iterable[Any], dest: os.PathLike | str, *, max_depth: int = 32,
                 default_name: str = "upload") -> Path:
    """Write an upload under ``dest`` and return the path to give ``ingest``.

    ``files``: streamlit ``UploadedFile`` objects, ``UploadedItem`` s or
    ``(name, bytes)`` tuples.  One ``.zip`` -> the written zip.  A folder
    upload -> the folder it came from (its top-level name is kept: it names
    the run), or ``dest/default_name`` when the files share no top folder.
    Raises ``UploadError`` before writing anything if any name is unsafe.
    """
    items = _items(files)
    if not items:
        raise UploadError("nothing was uploaded: choose a dump folder or a .zip of one")
    dest = Path(dest)
    if len(items) == 1 and items[0].name.lower().endswith(".zip"):
        parts = _parts(items[0].name, max_depth)
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / parts[-1]
        target.write_bytes(items[0].data)
        return target
    planned: dict[tuple[str, ...], UploadedItem] = {}
    for it in items:
        parts = _parts(it.name, max_depth)
        if parts in planned:
            raise UploadError(f"uploaded file {it.name!r} appears more than once; refusing the upload")
        planned[parts] = it
    # a file and a folder of the same name cannot both exist
    dirs = {p[:i] for p in planned for i in range(1, len(p))}
    clash = next((p for p in planned if p in dirs), None)
    if clash is not None:
        raise UploadError(f"uploaded file {'/'.join(clash)!r} is also used as a folder name; refusing the upload")
    tops = {p[0] for p in planned}
    shared_top = len(tops) == 1 and all(len(p) > 1 for p in planned)
    base = dest if shared_top else dest / default_name
    root = base.resolve()
    for parts, it in planned.items():
        target = root.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(it.data)
        # one time for every file: a browser sends no modification times, and the order files arrive
        # in is not the order a model ran in (readers may order a dump by modification time)
        os.utime(target, (0, 0))
    return root / next(iter(tops)) if shared_top else root
