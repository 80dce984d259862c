"""The model entry points this user ran from the command line, which a dashboard this user serves on
localhost may run again.

``precision-lab capture --model FILE.py:FN --inputs FILE.py:FN`` records the
entry points it ran in ``<data dir>/allowed_models.json`` (mode 0600)::

    {"format": "precision-lab-allowed-models", "version": 1, "entry_points": ["/abs/train.py:build", ...]}

A dashboard started by the same user on localhost (not ``--read-only``) adds
them to the ``$PRECISION_LAB_MODELS`` its operator set, so the sessions this
user captured get Re-run buttons without any setting.  A server on another
address, or read-only, runs only what its operator listed.  A file that is not
a regular file owned by this user and private to them allows nothing.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Iterable, Optional

from .paths import default_data_dir
from .tokens import file_lock, write_private_json

__all__ = ["allow_list_path", "record_entry_points", "allowed_entry_points", "FORMAT"]

FORMAT = "precision-lab-allowed-models"
VERSION = 1
_MAX_BYTES = 1024 * 1024


def allow_list_path() -> Path:
    """``<data dir>/allowed_models.json`` of this user."""
    return default_data_dir() / "allowed_models.json"


def allowed_entry_points(path: Optional[Path] = None) -> set[str]:
    """The entry points recorded in the allow-list (none when there is none, or it is not this user's own
    private regular file, or it cannot be read)."""
    path = path or allow_list_path()
    try:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_BYTES or stat.S_IMODE(st.st_mode) & 0o077:
            return set()
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            return set()
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(_MAX_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return set()
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        return set()
    eps = doc.get("entry_points")
    return {e for e in eps if isinstance(e, str) and e} if isinstance(eps, list) else set()


def record_entry_points(entry_points: Iterable[str], path: Optional[Path] = None) -> None:
    """Add ``entry_points`` (as ``entry_point_recipe`` normalised them) to this user's allow-list."""
    path = path or allow_list_path()
    with file_lock(path.with_suffix(".lock")):
        have = allowed_entry_points(path)
        new = have | set(entry_points)
        if new != have or not path.exists():
            write_private_json(path, {"format": FORMAT, "version": VERSION, "entry_points": sorted(new)})
