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

``iter_runs(root, tick)`` yields one ``RunSource`` per run found under
``root``.  Its ``records`` is an iterator of ``TensorRecord``s with stats
filled in and, where the dump holds the data, ``record.tensor`` set; the
consumer drops each tensor when it is done with it, so memory stays bounded
by the largest file, not the folder.  ``RunSource.load(record.source)``
re-reads a tensor later (for comparisons) without keeping it around.
Readers call ``tick(nbytes, label)`` after each file they finish.

A reader raises ``ReadError`` with a message naming the file and the
problem; warnings about files it skipped go to ``RunSource.warnings``.

Optionally a reader has ``local_comparisons(root)`` yielding ``(run key,
record, Comparison)`` for comparisons the dump itself carries (an op's
output against its own fp32 re-run, from live capture); ingest stores them
as ``kind="local"`` comparisons of the record with the same name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .base import RANK_RE, STEP_RE, ReadError, Reader, RunSource, Tick, dominant_dtype, first_line, natural_key
from .generic import GenericReader
from .msprobe import MsprobeReader
from .native import NativeReader

__all__ = ["Reader", "RunSource", "ReadError", "READERS", "register", "unregister", "detect", "natural_key",
           "dominant_dtype", "first_line", "STEP_RE", "RANK_RE", "Tick"]

READERS: list = []


def register(reader, *, priority: Optional[int] = None):
    """Add a reader; readers with a higher ``priority`` (default 50) are tried first.

    Returns the reader, so it can decorate a class instance assignment.
    """
    for attr in ("name", "detect", "iter_runs"):
        if not hasattr(reader, attr):
            raise TypeError(f"a reader needs a {attr!r} attribute; {reader!r} has none")
    if priority is not None:
        reader.priority = priority
    elif not hasattr(reader, "priority"):
        reader.priority = 50
    unregister(reader.name)
    READERS.append(reader)
    READERS.sort(key=lambda r: -r.priority)  # stable: equal priorities keep registration order
    return reader


def unregister(name: str) -> None:
    READERS[:] = [r for r in READERS if r.name != name]


def detect(path) -> Optional[Any]:
    """The first registered reader that recognises ``path`` (a folder), or None."""
    root = Path(path)
    for reader in READERS:
        if reader.detect(root):
            return reader
    return None


register(NativeReader(), priority=100)
register(MsprobeReader(), priority=80)
register(GenericReader(), priority=0)
