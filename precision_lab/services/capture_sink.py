"""Where a capture writes when it is given a database: the sink that opens the file only when the capture writes,
diagnoses a new session where it is staged, and decides whether its insert runs behind the user's next step."""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..live.recorder import Capture
from ..store import Store, writing as store_writing
from .diagnose import diagnose_session

__all__ = ["StoreSink", "spare_core", "diagnose_written", "diagnose_captured"]


def spare_core() -> bool:
    """Whether the user's step leaves a core to a capture's insert: torch runs on fewer threads than this process
    may use, or the process drives a GPU (its CPU threads mostly wait for the device).  Then a capture into a
    database file inserts its session behind the next step (``Store.new_session``'s ``behind``); where torch's
    threads take every core, an insert beside them would slow every parallel region of the step more than it
    saves, and it runs before the block returns."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores or (torch.cuda.is_available() and torch.cuda.is_initialized())


class StoreSink:
    """A database as a capture sink (a path, or a ``Store`` of it): the database is opened when the capture
    writes, not before (a store holds its file only while it writes, so a notebook that captured leaves it free
    for ``precision-lab report`` in a terminal and for a dashboard).  A new session is diagnosed where it is
    staged, before it is inserted (``Store.new_session``'s ``before_insert``), so it goes into the file with its
    diagnoses."""

    def __init__(self, path, store: Optional[Store] = None):
        self.path = store.path if store is not None else path
        self._store = store
        self.diagnosed = False  # the last new session was diagnosed in its staging

    def _open(self) -> Store:
        return self._store if self._store is not None else Store(self.path, known=True)

    def new_session(self, *args, **kwargs):
        self.diagnosed = False
        return self._open().new_session(*args, before_insert=self._diagnose_staged, behind=spare_core(), **kwargs)

    def extend_session(self, *args, **kwargs):
        return self._open().extend_session(*args, **kwargs)

    def _diagnose_staged(self, staging: Store, name: str) -> None:
        diagnose_captured(staging, name)
        self.diagnosed = True

    def writing(self):
        """``Store.writing()`` of the database, begun before it is opened."""
        return store_writing(self.path)


def diagnose_written(sink: StoreSink, cap: Capture) -> None:
    """A captured session, diagnosed as it is written (where its staging has not diagnosed it already)."""
    if not sink.diagnosed:
        diagnose_captured(sink._open(), cap.session)


def diagnose_captured(store, name: str) -> None:
    """Run the diagnosis rules over the new session; if they fail, the session says why it has none."""
    try:
        diagnose_session(store, name)
    except Exception as e:  # the captured session stands; say why it has no diagnoses
        with store.extend_session(name) as w:
            w.add_warning("diagnose", f"diagnosis rules failed: {type(e).__name__}: {e}")
