"""The store's writes: a transaction, a session written in one (staged in a private database first, so the
shared file is held only for the insert), extended, renamed or deleted, and the share links beside them."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import uuid
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
from .transfer import clear_tables, insert_attached_session, insert_staged_session


class _Staging:
    """A database in memory of this process's own, for the sessions it writes to one file (``new_session``'s
    staging in memory), with the file readable by it; one thread stages in it at a time."""

    def __init__(self, store):
        path = store.path
        self.store = type(store)(":memory:", readable=(path, path + ".wal", path + ".wal.checkpoint"))
        self.lock = threading.Lock()


_STAGINGS: dict = {}
_STAGINGS_LOCK = threading.Lock()


def _staging_for(store) -> _Staging:
    with _STAGINGS_LOCK:
        staging = _STAGINGS.get(store.path)
        if staging is None:
            staging = _STAGINGS[store.path] = _Staging(store)
        return staging

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
                    stage_in_memory: bool = False, before_insert=None) -> Iterator["SessionWriter"]:
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
        (a session's diagnoses) goes into the file with the session, in the same transaction."""
        # inside a transaction of this thread on the file the session is part of it (the staged paths below)
        if self.staged and not self._file.memory and stage_in_memory and getattr(self._file.tx, "cur", None) is None:
            staging = _staging_for(self)
            if staging.lock.acquire(blocking=False):  # else another thread of this process stages: one of its own
                try:
                    with self._memory_staged(staging.store, name or _default_session_name(source), source=source,
                                             recipe=recipe, notes=notes, rename=exist_ok_rename,
                                             before_insert=before_insert) as w:
                        yield w
                finally:
                    staging.lock.release()
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
    def _memory_staged(self, staging, name: str, *, source: str, recipe: Optional[str], notes: Optional[dict],
                       rename: bool, before_insert) -> Iterator["SessionWriter"]:
        if not rename:  # a taken name fails before the work, not only at the insert
            with self.reading() as cur:
                self._unique_name(cur, name, rename=False)
        try:
            with staging.new_session(name, source=source, recipe=recipe, notes=notes) as w:
                yield w
            if before_insert is not None:
                before_insert(staging, w.name)
            w.name, w.session_id = insert_attached_session(self, staging, w.session_id, name, rename=rename)
        finally:
            clear_tables(staging)

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
