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

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

from ..records import TensorRecord

__all__ = ["Reader", "RunSource", "ReadError", "READERS", "register", "unregister", "detect", "natural_key",
           "dominant_dtype", "first_line", "STEP_RE", "RANK_RE"]

# folder names that carry a step / rank (msprobe and generic layouts)
STEP_RE = re.compile(r"^step(\d+)$")
RANK_RE = re.compile(r"^rank(\d+)$")


class ReadError(ValueError):
    """A dump file cannot be read; the message names the file and the problem."""


Tick = Callable[[int, str], None]


@dataclass
class RunSource:
    """One run found in a dump, with its record stream.

    ``key`` identifies the run within one reader's output (a run that shows
    up again later in the stream has the same key).  ``order`` is
    ``"execution"`` when ``seq`` follows execution order, ``"name"`` when the
    dump carries no order and records were numbered by name; ``order_note``
    says where the order came from, in words.  ``kind``, ``parent_key``,
    ``fix`` and ``policy`` are set when the dump itself says (our own shard
    format); ingest decides otherwise.
    """

    key: str
    name: str
    root: Path
    reader: str
    records: Iterator[TensorRecord]
    order: str = "execution"
    order_note: str = ""
    kind: Optional[str] = None
    parent_key: Optional[str] = None
    fix: Optional[str] = None
    policy: Optional[str] = None
    dtype: Optional[str] = None
    loader: Optional[Callable[[str], Any]] = field(default=None, repr=False)
    warnings: list[tuple[str, str]] = field(default_factory=list)

    def load(self, source: str):
        """Re-read the tensor a record came from, or None if the dump has no data for it."""
        return self.loader(source) if self.loader is not None and source else None


class Reader(Protocol):
    name: str
    priority: int

    def detect(self, root: Path) -> bool: ...

    def iter_runs(self, root: Path, tick: Tick) -> Iterator[RunSource]: ...


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


def natural_key(s: str) -> tuple:
    """Sort key that orders ``layer10`` after ``layer9``."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s) if t)


def dominant_dtype(counts: dict[str, int]) -> str:
    """The dtype most tensors have, floating dtypes first: a run's compute dtype."""
    floats = {k: v for k, v in counts.items() if "float" in k}
    pool = floats or {k: v for k, v in counts.items() if k}
    return max(pool, key=pool.get) if pool else ""


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def first_line(e: BaseException) -> str:
    """An exception's message, first line only (library messages can run on), without terminal colours."""
    s = _ANSI.sub("", str(e)).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _register_builtins() -> None:
    from .generic import GenericReader
    from .msprobe import MsprobeReader
    from .native import NativeReader

    register(NativeReader(), priority=100)
    register(MsprobeReader(), priority=80)
    register(GenericReader(), priority=0)


_register_builtins()
