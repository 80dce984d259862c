"""Dump readers: folders of tensors -> streams of TensorRecords.

One registry holds every reader; the built-ins (our own shard format,
msprobe, generic tensor files) register through ``register`` exactly as a
user plug-in would::

    from precision_lab.readers import register

    class MyReader:
        name = "mytool"
        priority = 60                     # higher is tried first
        def detect(self, root) -> bool: ...
        def iter_runs(self, root, tick): ...   # yields RunSource objects

    register(MyReader())

or, from a package of its own, an entry point naming the reader object
(``[project.entry-points."precision_lab.readers"]``), read the first time the
readers are listed; docs/architecture.md ("Adding a reader") has a worked
example.  A ``detect`` that fails otherwise than a file can make it fail
(``ReadError``, ``OSError``, ``ValueError``, ``RecursionError``), a plug-in's
bug, becomes a ``ReadError`` naming the reader.

``iter_runs(root, tick)`` yields one ``RunSource`` per run found under
``root``.  Its ``records`` is an iterator of ``TensorRecord``s with stats
filled in and, where the dump holds the data, ``record.tensor`` set; the
consumer drops each tensor when it is done with it, so memory stays bounded
by the largest file, not the folder.  ``RunSource.load(record.source)``
re-reads a tensor later (for comparisons) without keeping it around.
Readers call ``tick(nbytes, label)`` after each file they finish.  Tensor
files are opened through ``readers.tensorfile`` (``read_tensors``, and
``load_source`` to re-read one), the loader replay uses too, so every path
makes the same bounds and checksum checks.

A reader raises ``ReadError`` with a message naming the file and the
problem; warnings about files it skipped go to ``RunSource.warnings``.

Optionally a reader has ``local_comparisons(root)`` yielding ``(run key,
record, Comparison)`` for comparisons the dump itself carries (an op's
output against its own fp32 re-run, from live capture); ingest stores them
as ``kind="local"`` comparisons of the record with the same name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .base import RANK_RE, STEP_RE, ReadError, Reader, RunSource, Tick, dominant_dtype, first_line, natural_key
from .generic import GenericReader
from .msprobe import MsprobeReader
from .native import NativeReader
from ..registry import Registry

__all__ = ["Reader", "RunSource", "ReadError", "READERS", "register", "unregister", "ordered", "detect", "natural_key",
           "dominant_dtype", "first_line", "STEP_RE", "RANK_RE", "Tick"]

READERS = Registry("dump reader", group="precision_lab.readers", name_of=lambda r: r.name)


def _checked(reader):
    for attr in ("name", "detect", "iter_runs"):
        if not hasattr(reader, attr):
            raise TypeError(f"a reader needs a {attr!r} attribute; {reader!r} has none")
    if not hasattr(reader, "priority"):
        reader.priority = 50
    return reader


def register(reader, *, priority: Optional[int] = None, replace: bool = False):
    """Add a reader; readers with a higher ``priority`` (default 50) are tried first.

    A name is registered once (``replace=True`` replaces it).  Returns the reader.
    """
    _checked(reader)
    if priority is not None:
        reader.priority = priority
    return READERS.register(reader.name, reader, replace=replace)


def unregister(name: str) -> None:
    READERS.unregister(name)


def ordered() -> list:
    """The registered readers (entry-point plug-ins included), highest priority first."""
    # sorted() is stable: equal priorities keep registration order
    return sorted((_checked(r) for r in READERS.values()), key=lambda r: -r.priority)


def detect(path) -> Optional[Reader]:
    """The first registered reader that recognises ``path`` (a folder), or None."""
    root = Path(path)
    for reader in ordered():
        try:
            if reader.detect(root):
                return reader
        except (ReadError, OSError, ValueError, RecursionError):
            raise
        except Exception as e:  # a plug-in's bug: a sentence naming the reader, never a traceback
            raise ReadError(f"the {reader.name!r} reader failed on it: {type(e).__name__}: {first_line(e)}") from None
    return None


register(NativeReader(), priority=100)
register(MsprobeReader(), priority=80)
register(GenericReader(), priority=0)
