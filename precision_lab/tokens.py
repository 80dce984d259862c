"""Share tokens: the one record of which token opens which session, kept in a small file beside the
database and readable without its lock.

DuckDB lets one process hold a database file for writing, and while it does
no other process can even read it.  Share links must still be revocable then
(a server, a long job or a shared team server holding the file), by any
process, and a read-only server must notice at once.  So the tokens live in
``<database>.tokens.json`` (mode 0600), never in the database::

    {"format": "precision-lab-share-tokens", "version": 1,
     "sessions": {"<session_id>": {"name": "<session name>", "token": "<token>"}}}

Every write replaces the whole file atomically (a temporary file in the same
folder, then ``os.replace``) under an advisory lock on ``<database>.tokens.lock``,
so readers see the old or the new file, never half of one, and two writers
never lose each other's change.  Readers take no lock; a server re-reads the
file whenever its size, time or inode changed, i.e. on the next request after
a change.

No file: no links.  A file that exists but cannot be read or parsed opens no
session at all (share links fail closed).  A database ``:memory:`` keeps its
tokens in memory (``MemoryTokens``), as long as the database lasts.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["TokenFile", "MemoryTokens", "TokenFileError", "token_file_for", "SUFFIX", "file_lock", "write_private_json"]

SUFFIX = ".tokens.json"
_LOCK_SUFFIX = ".tokens.lock"
FORMAT = "precision-lab-share-tokens"
VERSION = 1
_MAX_BYTES = 16 * 1024 * 1024  # far above any real file; a bigger one is refused, not read


class TokenFileError(ValueError):
    """The token file exists but cannot be used; the message names it."""


def token_file_for(db_path) -> Optional["TokenFile"]:
    """The token file of the database at ``db_path`` (None for ``:memory:``)."""
    if db_path is None or str(db_path) == ":memory:":
        return None
    return TokenFile(Path(str(db_path) + SUFFIX))


class _Tokens:
    """Session id -> {name, token}: lookups and changes made of ``sessions`` and ``update``."""

    def sessions(self) -> Optional[dict]:
        raise NotImplementedError

    def update(self, change, *, fail_closed: bool = False) -> dict:
        raise NotImplementedError

    def lookup(self, token: str) -> Optional[str]:
        """The session id ``token`` opens, or None.  Raises ``TokenFileError`` (see ``sessions``)."""
        if not token:
            return None
        sessions = self.sessions() or {}
        found = None
        for sid, entry in sessions.items():
            # compare every entry in constant time: no early exit reveals a prefix
            if hmac.compare_digest(str(entry["token"]).encode(), str(token).encode()):
                found = sid
        return found

    def set(self, session_id: str, name: str, token: Optional[str]) -> None:
        """Give session ``session_id`` the token ``token`` (None: revoke it, failing closed)."""
        def change(sessions: dict) -> None:
            if token is None:
                sessions.pop(session_id, None)
            else:
                sessions[session_id] = {"name": name, "token": token}

        self.update(change, fail_closed=token is None)

    def revoke(self, session: str) -> list[dict]:
        """Revoke the links of the sessions recorded under name or id ``session``; returns what was removed."""
        removed: list[dict] = []

        def change(sessions: dict) -> None:
            for sid in [s for s, e in sessions.items() if s == session or e.get("name") == session]:
                removed.append({"session_id": sid, **sessions.pop(sid)})

        self.update(change, fail_closed=True)
        return removed


class MemoryTokens(_Tokens):
    """The tokens of a database ``:memory:``, which lasts as long as its process: a dict."""

    def __init__(self):
        self._sessions: dict = {}
        self._mutex = threading.Lock()

    def exists(self) -> bool:
        return True

    def sessions(self) -> dict:
        with self._mutex:
            return _copy(self._sessions)

    def update(self, change, *, fail_closed: bool = False) -> dict:  # nothing to fail writing in memory
        with self._mutex:
            sessions = _copy(self._sessions)
            change(sessions)
            self._sessions = sessions
            return _copy(sessions)


class TokenFile(_Tokens):
    """``<database>.tokens.json``: session id -> {name, token}."""

    def __init__(self, path: os.PathLike | str):
        self.path = Path(path)
        self._lock_path = Path(str(self.path)[: -len(SUFFIX)] + _LOCK_SUFFIX) if str(self.path).endswith(SUFFIX) \
            else Path(str(self.path) + ".lock")
        self._cache: tuple[Optional[tuple], Optional[dict]] = (None, None)
        self._mutex = threading.Lock()

    # ---- reading -----------------------------------------------------------------

    def exists(self) -> bool:
        return os.path.lexists(self.path)

    def sessions(self) -> Optional[dict]:
        """``{session_id: {"name", "token"}}``, or None when there is no file.

        Raises ``TokenFileError`` when the file exists but is unusable.
        """
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TokenFileError(f"{self.path}: cannot be read ({e.strerror or e})") from None
        key = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)
        with self._mutex:
            if self._cache[0] == key:
                return _copy(self._cache[1])
        data = self._load(st)
        with self._mutex:
            self._cache = (key, data)
        return _copy(data)

    def _load(self, st: os.stat_result) -> dict:
        import stat as stat_mod

        if not stat_mod.S_ISREG(st.st_mode):
            raise TokenFileError(f"{self.path}: not a regular file")
        if st.st_size > _MAX_BYTES:
            raise TokenFileError(f"{self.path}: larger than {_MAX_BYTES // (1024 * 1024)} MiB")
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                raw = f.read(_MAX_BYTES + 1)
        except OSError as e:
            raise TokenFileError(f"{self.path}: cannot be read ({e.strerror or e})") from None
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise TokenFileError(f"{self.path}: not valid JSON ({type(e).__name__})") from None
        return _validate(doc, self.path)

    # ---- writing -------------------------------------------------------------------

    def _locked(self):
        return file_lock(self._lock_path)

    def update(self, change, *, fail_closed: bool = False) -> dict:
        """Apply ``change(sessions) -> None`` (it edits the dict) and write the result atomically.

        A file that exists but cannot be parsed is refused (``TokenFileError``)
        rather than replaced: replacing it would silently bring back or drop
        links.  Returns the sessions written.  ``fail_closed`` (a revocation):
        when the new file cannot be written (a full disk), the file is removed
        instead -- which needs no space -- so no link of the database opens
        anything, and ``TokenFileError`` says so.
        """
        with self._locked():
            with self._mutex:
                self._cache = (None, None)
            sessions = self.sessions()
            sessions = {} if sessions is None else sessions
            change(sessions)
            try:
                self._write(sessions)
            except OSError as e:
                if not fail_closed:
                    raise
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                with self._mutex:
                    self._cache = (None, None)
                raise TokenFileError(f"{self.path} could not be rewritten ({e.strerror or e}), so it was removed: "
                                     "every share link of this database is revoked, not only this one; make "
                                     "new links once the disk has room") from None
            return sessions

    def _write(self, sessions: dict) -> None:
        doc = {"format": FORMAT, "version": VERSION,
               "sessions": {sid: {"name": e["name"], "token": e["token"]} for sid, e in sorted(sessions.items())}}
        write_private_json(self.path, doc)
        with self._mutex:
            self._cache = (None, None)


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """An advisory lock on ``lock_path`` (mode 0600) for a read-change-write of a small file."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        try:
            import fcntl
        except ImportError:  # no advisory locks here; writers are rare and short
            fcntl = None
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_private_json(path: Path, doc: dict) -> None:
    """Replace ``path`` with ``doc`` atomically (a temporary file in the same folder, then ``os.replace``),
    readable by its owner only (mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _copy(sessions: dict) -> dict:
    """A copy a caller may change without changing the cached file contents."""
    return {sid: dict(e) for sid, e in sessions.items()}


def _validate(doc, path: Path) -> dict:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TokenFileError(f"{path}: not a Precision Lab token file")
    if doc.get("version") != VERSION:
        raise TokenFileError(f"{path}: token file version {doc.get('version')!r}, this Precision Lab reads {VERSION}")
    sessions = doc.get("sessions")
    if not isinstance(sessions, dict):
        raise TokenFileError(f"{path}: 'sessions' must be an object")
    out = {}
    for sid, e in sessions.items():
        if not (isinstance(e, dict) and isinstance(e.get("token"), str) and e["token"]
                and isinstance(e.get("name"), str)):
            raise TokenFileError(f"{path}: the entry of session {sid!r} needs a name and a token")
        out[str(sid)] = {"name": e["name"], "token": e["token"]}
    return out
