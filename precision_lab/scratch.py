"""One folder the server owns for uploads and extracted zips, swept of leftovers.

Every temporary folder an ingest, upload, import or export needs is made by
``scratch_dir(prefix)`` under one root: the ``work_dir`` setting
(``PRECISION_LAB_WORK_DIR``) or, when unset, ``scratch/`` in the per-user
data directory (``$XDG_DATA_HOME/precision-lab/scratch``).  Each folder is
private (mode 0700) and named ``<prefix>-<pid>-<start>-<random>``: the id of
the process that owns it and that process's start time (clock ticks since
boot from ``/proc``, 0 where unknown), so a reused process id is not
mistaken for the owner.  The folder is removed when the ``with`` block ends,
whatever happens inside it.

A process killed with ``kill -9`` cannot remove its folder; ``sweep()``
does, the next time a server starts or an upload begins.  It removes the
entries of the root named like scratch folders whose owner is no longer
running, or that are older than a day, and nothing else: entries with other
names are left alone (the root may be a folder other programs use), links
are removed as links and never followed, and nothing outside the root is
touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

from .config import ConfigError, load_config
from .paths import default_data_dir

__all__ = ["scratch_root", "scratch_dir", "sweep", "owner_alive", "is_scratch_name", "MAX_AGE_S"]

MAX_AGE_S = 24 * 3600

_PREFIX = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")
# <prefix>-<pid>-<start ticks>-<random>; tempfile's random part is 8 of [a-z0-9_]
_NAME = re.compile(r"(?P<prefix>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*?)-(?P<pid>\d{1,10})-(?P<start>\d{1,20})"
                   r"-(?P<rand>[a-z0-9_]{8})")


def scratch_root(config=None) -> Path:
    """The folder scratch folders live in: ``config.work_dir``, else ``<data dir>/scratch``.

    ``config``: a ``ServerConfig``; None reads the server settings (a
    setting that cannot be read gives the default folder).
    """
    if config is None:
        try:
            config = load_config()
        except ConfigError:
            config = None
    work = getattr(config, "work_dir", None)
    if work:
        return Path(work).expanduser().absolute()
    return (default_data_dir() / "scratch").absolute()


def _proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks) of a process from /proc, or None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _start_ticks(pid: int) -> int:
    st = _proc_stat(pid)
    return st[1] if st else 0


def owner_alive(pid: int, start: int = 0) -> bool:
    """Whether process ``pid`` runs, and (when ``start`` is known) is the one that started then."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    except OSError:
        return True  # cannot tell: keep its folder (the age rule still applies)
    st = _proc_stat(pid)
    if st is not None:
        state, ticks = st
        if state in ("Z", "X"):  # killed, not yet reaped
            return False
        if start and ticks != start:  # the id now belongs to another process
            return False
    return True


def is_scratch_name(name: str) -> bool:
    """Whether ``name`` is the name of a folder ``scratch_dir`` makes."""
    return _NAME.fullmatch(name) is not None


def _ensure_root(root: Path) -> None:
    if not root.is_dir():
        root.mkdir(mode=0o700, parents=True, exist_ok=True)


@contextlib.contextmanager
def scratch_dir(prefix: str, config=None, *, root: Optional[os.PathLike | str] = None) -> Iterator[Path]:
    """A fresh private folder ``<root>/<prefix>-<pid>-<start>-<random>``, removed when the block ends.

    ``prefix``: letters, digits, ``_``, ``.`` and ``-`` (it names what the
    folder is for: ``upload``, ``extract``, ``import``...).  ``root``
    overrides the configured root (tests).
    """
    if not _PREFIX.fullmatch(prefix or ""):
        raise ValueError(f"scratch folder prefix {prefix!r}: use letters, digits, '_', '.' and '-'")
    base = Path(root) if root is not None else scratch_root(config)
    _ensure_root(base)
    pid = os.getpid()
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-{pid}-{_start_ticks(pid)}-", dir=base))  # mode 0700
    try:
        yield path
    finally:
        _remove(path)


def _remove(path: Path) -> bool:
    """Remove ``path`` without following links: a folder with its contents, anything else as itself."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return False
    try:
        if stat.S_ISDIR(st.st_mode):
            # rmtree works through directory descriptors here: a link inside is unlinked, not followed
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass
    return not os.path.lexists(path)


def _stale(name: str, st: os.stat_result, now: float, max_age_s: float) -> bool:
    if not stat.S_ISDIR(st.st_mode):
        return True  # scratch_dir only makes folders: a link, file or pipe under such a name is not ours to keep
    m = _NAME.fullmatch(name)
    if not owner_alive(int(m["pid"]), int(m["start"])):
        return True
    return now - st.st_mtime > max_age_s


def sweep(root: Optional[os.PathLike | str] = None, max_age_s: float = MAX_AGE_S, *,
          now: Optional[float] = None) -> list[Path]:
    """Remove leftover scratch folders under ``root`` (default ``scratch_root()``); returns what was removed.

    Removed: entries named like scratch folders whose owning process is gone,
    or older than ``max_age_s`` (by modification time), and links, files or
    pipes carrying such a name.  Never raises: what cannot be removed now is
    tried again by the next sweep.
    """
    base = Path(root) if root is not None else scratch_root()
    now = time.time() if now is None else now
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        if not is_scratch_name(name):
            continue
        p = base / name
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if _stale(name, st, now, max_age_s) and _remove(p):
            removed.append(p)
    return removed
