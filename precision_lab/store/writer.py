"""The store's writes: a transaction, a session written in one (staged in a private database first, so the
shared file is held only for the insert), extended, renamed or deleted, and the share links beside them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import uuid
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

from ..paths import replay_kit_path
from ..records import free_name
from ..scratch import scratch_dir, sweep
from ..tokens import TokenFileError
from .connect import connect_duckdb
from .files import rollback, writing
from .schema import schema_sql
from .session_writer import SessionWriter, now_text
from .transfer import AttachedTarget, clear_tables, insert_attached_session, insert_staged_session


class _Staging:
    """A database in memory of this process's own, for the sessions it writes to one file (``new_session``'s
    staging in memory), with the file readable by it; one thread stages in it at a time (``lock``), and its
    session's insert behind the caller (``pending``) holds it until the insert is done."""

    def __init__(self, store):
        path = store.path
        # one DuckDB thread: its insert may run beside the user's step, whose threads it should not contend with
        self.store = type(store)(":memory:", readable=(path, path + ".wal", path + ".wal.checkpoint"), threads=1)
        self.lock = threading.Lock()
        self.pending: Optional["PendingInsert"] = None

    def take(self) -> bool:
        """Take the staging for this thread's session: at once, or once this process's insert behind the caller
        is done; False while another thread stages in it."""
        if self.lock.acquire(blocking=False):
            return True
        pending = self.pending
        if pending is None:
            return False
        pending.wait()
        return self.lock.acquire(blocking=False)


_STAGINGS: dict = {}
_STAGINGS_LOCK = threading.Lock()
_RUNNING: "weakref.WeakSet[PendingInsert]" = weakref.WeakSet()


def _staging_for(store) -> _Staging:
    with _STAGINGS_LOCK:
        staging = _STAGINGS.get(store.path)
        if staging is None:
            staging = _STAGINGS[store.path] = _Staging(store)
        return staging


class PendingInsert:
    """A session staged in memory, inserted into its file on a thread of its own while the caller goes on (a
    capture's write behind the step after it).  The file is taken before the caller goes on: this process's
    operations on it wait for the insert (they see the session), and other processes' opens wait for DuckDB's
    lock on it (they see it too).  A failure is raised where the session's name is asked for, and said once
    on standard error."""

    def __init__(self, store, staging: _Staging, session_id: str, name: str, *, rename: bool):
        self.path, self.name = store.path, name
        self._done = threading.Event()
        self._got: Optional[tuple] = None
        self._error: Optional[BaseException] = None
        self._if_failed: list = []
        self._guard = threading.Lock()
        target = AttachedTarget(store, staging.store)  # the file taken now, in the caller's thread
        staging.pending = self
        _RUNNING.add(self)
        args = (target, staging, session_id, rename)
        try:
            threading.Thread(target=self._run, args=args, name="precision-lab-insert", daemon=False).start()
        except RuntimeError:  # no thread to be had (the interpreter is shutting down): the insert runs here
            self._run(*args)

    def _run(self, target: AttachedTarget, staging: _Staging, session_id: str, rename: bool) -> None:
        try:
            self._got = target.insert(session_id, self.name, rename=rename)
        except BaseException as e:
            self._failed(e)
        finally:
            try:
                clear_tables(staging.store)
            finally:
                staging.pending = None
                staging.lock.release()
                _RUNNING.discard(self)
                self._done.set()

    def _failed(self, e: BaseException) -> None:
        self._error = e
        with self._guard:
            undo, self._if_failed = self._if_failed, []
        for fn in undo:
            fn()
        sys.stderr.write(f"precision-lab: {self._message()}\n")

    def _message(self) -> str:
        e = self._error
        return f"session {self.name!r} could not be written to {self.path}: {type(e).__name__}: {e}"

    def if_failed(self, fn) -> None:
        """Run ``fn()`` if the insert fails (at once where it has)."""
        with self._guard:
            if self._error is None:
                self._if_failed.append(fn)
                return
        fn()

    def wait(self) -> None:
        self._done.wait()

    def result(self) -> tuple[str, str]:
        """(name, session id) the session got in the file, once inserted."""
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(self._message()) from self._error
        return self._got


def wait_for_inserts() -> None:
    """Wait until every session this process inserts behind its caller is in its file (before a fork: the
    child has no thread to finish one)."""
    for pending in list(_RUNNING):
        pending.wait()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=wait_for_inserts)

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection


def _default_session_name(source: str) -> str:
    base = Path(str(source)).name if source else "session"
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-") or "session"
    return base[:60]


class StoreWrites:
    """``Store``'s writes: each in one transaction, the file opened read-write for it only (see ``files``)."""

    @contextmanager
    def writing(self) -> Iterator["StoreWrites"]:
        """Keep the database open between the operations of this block, read-write from its first write on (a
        write and the reads and writes that follow it, such as a capture's session and its diagnosis): one
        open instead of one per operation.  Other processes wait while it lasts: keep it to one short stretch
        of work."""
        with writing(self.path):
            yield self

    @contextmanager
    def transaction(self) -> Iterator[DuckDBPyConnection]:
        """One atomic write: the file is opened read-write for it (waiting, within ``lock_wait``, for other
        processes to let go), writers of this process take turns, and the file is let go when it commits.
        A failure or a killed process leaves nothing of it."""
        tx = getattr(self._file.tx, "cur", None)
        if tx is not None:  # nested in this thread's transaction: part of it
            yield tx
            return
        with self._lock:
            con = self._file.acquire(True, self.lock_wait)
            cur = None
            try:  # the read-write connection is given back whatever fails, the cursor's creation included
                cur = con.cursor()
                self._file.tx.cur = cur
                cur.execute("BEGIN TRANSACTION")
                try:
                    yield cur
                except BaseException:
                    rollback(cur)  # the error that ended the work is the one raised, not the rollback's
                    raise
                else:
                    cur.execute("COMMIT")
                    self._file.commits += 1
            finally:
                self._file.tx.cur = None
                try:
                    if cur is not None:
                        cur.close()
                finally:
                    self._file.release()

    @contextmanager
    def new_session(self, name: Optional[str] = None, *, source: str = "", recipe: Optional[str] = None,
                    notes: Optional[dict] = None, exist_ok_rename: bool = True,
                    stage_in_memory: bool = False, before_insert=None,
                    behind: bool = False) -> Iterator["SessionWriter"]:
        """Write one session atomically: ``with store.new_session("x") as w: w.add_run(...)``; ``w.name`` after
        the block is the name it got (made unique unless ``exist_ok_rename`` is false: then a taken name is a
        ``ValueError``).

        A file database's session is first written to a private staging database in the scratch folder and then
        inserted into the shared file in one short transaction, so a long ingest or capture holds the file (and
        keeps other processes' writes, and dashboards' reads, waiting) only for that insert.  A failure or a
        killed process before it leaves the shared file as it was; the staging folder goes with the block (a
        killed process's is swept by the next writer).  ``stage_in_memory``: the staging database is kept in
        memory instead, for a writer whose rows are in memory already (a capture's records): no folder, no file
        made, written and closed for it, which is most of what the staging costs a small session.  The database
        in memory is this process's own for the file, kept from one such session to the next and emptied after
        each, and the file is attached to it for the insert (``transfer.insert_attached_session``): a DuckDB
        instance costs some 15 ms to start, an attach about one.  ``before_insert(staging, name)`` (a staging in
        memory only) runs on the staging ``Store`` once the block has written the session there: what it adds
        (a session's diagnoses) goes into the file with the session, in the same transaction.  ``behind`` (a
        staging in memory only): the insert runs on a thread of its own once the file is taken, and the block
        returns at once (a capture's next step runs beside it); ``w.name`` waits for it."""
        # inside a transaction of this thread on the file the session is part of it (the staged paths below)
        if self.staged and not self._file.memory and stage_in_memory and getattr(self._file.tx, "cur", None) is None:
            staging = _staging_for(self)
            if staging.take():  # else another thread of this process stages: one of its own
                with self._memory_staged(staging, name or _default_session_name(source), source=source,
                                         recipe=recipe, notes=notes, rename=exist_ok_rename,
                                         before_insert=before_insert, behind=behind) as w:
                    yield w
                return
        if self.staged and not self._file.memory:
            with self._staged_session(name or _default_session_name(source), source=source, recipe=recipe,
                                      notes=notes, rename=exist_ok_rename, in_memory=stage_in_memory) as w:
                yield w
            return
        with self.transaction() as cur:
            name = self._unique_name(cur, name or _default_session_name(source), rename=exist_ok_rename)
            sid = uuid.uuid4().hex[:12]
            cur.execute(
                "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?)",
                [sid, name, now_text(), source, recipe, json.dumps(notes or {})],
            )
            w = SessionWriter(self, cur, sid, name)
            yield w
            w.flush()

    @contextmanager
    def _memory_staged(self, staging: _Staging, name: str, *, source: str, recipe: Optional[str],
                       notes: Optional[dict], rename: bool, before_insert, behind: bool) -> Iterator["SessionWriter"]:
        """The session staged in ``staging`` (taken by this thread), then inserted into the file; ``behind``:
        the insert runs on a thread of its own (``PendingInsert``), which lets the staging go when it is done."""
        handed = False
        try:
            if not rename:  # a taken name fails before the work, not only at the insert
                with self.reading() as cur:
                    self._unique_name(cur, name, rename=False)
            with staging.store.new_session(name, source=source, recipe=recipe, notes=notes) as w:
                yield w
            if before_insert is not None:
                before_insert(staging.store, w.name)
            if behind:
                w._pending = PendingInsert(self, staging, w.session_id, name, rename=rename)
                handed = True
            else:
                w.name, w.session_id = insert_attached_session(self, staging.store, w.session_id, name,
                                                               rename=rename)
        finally:
            if not handed:
                try:
                    clear_tables(staging.store)
                finally:
                    staging.lock.release()

    @contextmanager
    def _staged_session(self, name: str, *, source: str, recipe: Optional[str], notes: Optional[dict],
                        rename: bool, in_memory: bool = False) -> Iterator["SessionWriter"]:
        if not rename:  # a taken name fails before the work, not only at the insert
            with self.reading() as cur:
                self._unique_name(cur, name, rename=False)
        if not in_memory:
            sweep()
        with (contextlib.nullcontext(None) if in_memory else scratch_dir("stage")) as folder:
            con = connect_duckdb() if folder is None else connect_duckdb(str(folder / "session.duckdb"))
            try:
                for stmt in schema_sql():
                    con.execute(stmt)
                cur = con.cursor()
                cur.execute("BEGIN TRANSACTION")
                sid = uuid.uuid4().hex[:12]
                cur.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?)",
                            [sid, name, now_text(), source, recipe, json.dumps(notes or {})])
                w = SessionWriter(self, cur, sid, name)
                yield w
                w.flush()
                cur.execute("COMMIT")
                w.name, w.session_id = insert_staged_session(self, con, sid, name, rename=rename)
            finally:
                con.close()

    @contextmanager
    def extend_session(self, session: str) -> Iterator["SessionWriter"]:
        """Add runs/records to an existing session atomically (re-runs)."""
        info = self.session(session)
        with self.transaction() as cur:
            w = SessionWriter(self, cur, info.session_id, info.name)
            yield w
            w.flush()

    def _unique_name(self, cur, name: str, rename: bool) -> str:
        existing = {r[0] for r in cur.execute("SELECT name FROM sessions").fetchall()}
        if name not in existing:
            return name
        if not rename:
            raise ValueError(f"a session named {name!r} already exists")
        return free_name(name, existing)

    def rename_session(self, session: str, new_name: str) -> None:
        new_name = new_name.strip()
        if not new_name:
            raise ValueError("a session name cannot be empty")
        info = self.session(session)
        with self.transaction() as cur:
            if cur.execute("SELECT 1 FROM sessions WHERE name = ? AND session_id <> ?",
                           [new_name, info.session_id]).fetchone():
                raise ValueError(f"a session named {new_name!r} already exists")
            cur.execute("UPDATE sessions SET name = ? WHERE session_id = ?", [new_name, info.session_id])
            self._rename_token(info.session_id, new_name)

    def delete_session(self, session: str) -> None:
        info = self.session(session)
        sid = info.session_id
        with self.transaction() as cur:
            run_ids = [r[0] for r in cur.execute("SELECT run_id FROM runs WHERE session_id = ?", [sid]).fetchall()]
            for t in ("tensors", "histograms", "tensor_data", "timeline", "timeline_formats", "step_scalars"):
                for rid in run_ids:
                    cur.execute(f"DELETE FROM {t} WHERE run_id = ?", [rid])
            for t in ("comparisons", "diagnoses", "warnings", "runs", "sessions"):
                cur.execute(f"DELETE FROM {t} WHERE session_id = ?", [sid])
            self._drop_token(sid)
        for rid in run_ids:  # a training capture's replay kit goes with its run
            try:
                kit = replay_kit_path(self.path, rid)
                if kit is not None:
                    kit.unlink(missing_ok=True)
            except (ValueError, OSError):
                pass

    def _drop_token(self, session_id: str) -> None:
        """A session deleted (or a new one given an id a deleted one had) has no link.  A token file that cannot
        be read or written does not stop that write: a token of a session that no longer exists opens nothing,
        and a damaged file opens nothing at all."""
        try:
            if session_id in (self._tokens.sessions() or {}):
                self._tokens.set(session_id, "", None)
        except (TokenFileError, OSError):
            pass

    def _rename_token(self, session_id: str, new_name: str) -> None:
        """Keep the name recorded beside a session's token current (revocation by name uses it)."""

        try:
            if session_id not in (self._tokens.sessions() or {}):
                return
        except TokenFileError:
            return

        def rename(s: dict) -> None:
            if session_id in s:
                s[session_id]["name"] = new_name

        self._tokens.update(rename)

    # -- share links: the token file beside the database is their one record (precision_lab.tokens)
    def set_share_token(self, session: str, token: Optional[str]) -> None:
        """Give ``session`` the share token ``token`` (None: revoke it)."""
        info = self.session(session)
        self._tokens.set(info.session_id, info.name, token)
