"""What every dump reader shares: the run source it yields, its error, and small naming helpers."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

from ..records import TensorRecord

__all__ = ["Reader", "RunSource", "ReadError", "Tick", "natural_key", "dominant_dtype", "first_line", "STEP_RE",
           "RANK_RE"]

# folder names that carry a step / rank (msprobe and generic layouts): step3, step_000, step-3, rank0, rank_1
STEP_RE = re.compile(r"^step[_-]?(\d+)$")
RANK_RE = re.compile(r"^rank[_-]?(\d+)$")


class ReadError(ValueError):
    """A dump file cannot be read; the message names the file and the problem."""


Tick = Callable[[int, str], None]


@dataclass
class RunSource:
    """One run found in a dump, with its record stream.

    ``key`` identifies the run within one reader's output (a run that shows
    up again later in the stream has the same key).  ``order`` is
    ``"execution"`` when ``seq`` follows execution order, ``"mtime"`` when it
    follows file modification times, ``"data"`` when it was recovered from the
    data (``digests``), ``"name"`` when the dump carries no order and records
    were numbered by name (see ``dataorder.settle`` for the ties it breaks first); ``order_note``
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
    # (step, rank, op, role, index) -> readers.dataorder.digest of the tensor, filled while the records stream by
    # when the dump gives no order list, so ingest can recover the order from the data
    digests: dict[tuple, Optional[bytes]] = field(default_factory=dict, repr=False)
    # the same keys -> (place in the dump's order list or None, rank of the file's modification time or None):
    # what readers.dataorder.settle reads besides the digests
    hints: dict[tuple, tuple[Optional[int], Optional[int]]] = field(default_factory=dict, repr=False)

    def load(self, source: str):
        """Re-read the tensor a record came from, or None if the dump has no data for it."""
        return self.loader(source) if self.loader is not None and source else None


class Reader(Protocol):
    name: str
    priority: int

    def detect(self, root: Path) -> bool: ...

    def iter_runs(self, root: Path, tick: Tick) -> Iterator[RunSource]: ...


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
