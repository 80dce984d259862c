"""How the store takes and lets go of its database file within one process: unread results, threads that
wait while another opens the file, and ``close_all`` while an operation runs."""

from __future__ import annotations

import gc
import sys
import threading

import pytest

from precision_lab import store as store_mod
from precision_lab.store import DatabaseLocked, Store, close_all, is_open
from precision_lab.store import files as store_files
from test_share_revoke import _raw_holder, _session


def test_an_unread_result_kept_by_a_traceback_lets_a_writer_in(tmp_path):
    """A read that fails before its result is read, handled in an ``except``: the traceback keeps the frame
    and its result alive, and a write of this process still gets the file at once."""
    s = Store(tmp_path / "tb.duckdb", lock_wait=0.5)
    _session(s, "demo")

    def read_then_fail():
        names = s.sql("SELECT name FROM sessions")  # noqa: F841 (kept alive by the traceback)
        raise ValueError("the caller failed before reading")

    try:
        read_then_fail()
    except ValueError:
        assert sys.exc_info()[2] is not None  # the traceback, and the frame holding the result, are alive
        assert not is_open(s.path)
        _session(Store(s.path, lock_wait=0.5), "written-meanwhile")  # waited 0.5 s and refused on the old code
    assert sorted(s.sessions()["name"]) == ["demo", "written-meanwhile"]


def test_an_unread_result_is_read_when_read():
    """It runs its query when read: what was committed before that counts, and the connection goes with it."""
    s = Store(":memory:")  # the process's database in memory: earlier tests of this process may have written to it
    (before,) = s.sql("SELECT count(*) FROM sessions").fetchone()
    res = s.sql("SELECT count(*) FROM sessions")
    _session(s, "read-when-read")
    assert res.description[0][0] == "count_star()" and res.fetchone() == (before + 1,) and res.fetchone() is None


def test_dropping_an_unread_result_takes_no_lock(tmp_path):
    """A finaliser runs wherever the collector does, also inside ``acquire`` with the file's lock held; dropping
    an unread result there must not wait for that lock (it deadlocked on the old code)."""
    s = Store(tmp_path / "gc.duckdb")
    _session(s, "demo")
    done = threading.Event()

    def drop_inside_the_lock():
        res = s.sql("SELECT name FROM sessions")
        with s._file.cond:  # as acquire holds it when a collection runs on its thread
            del res
            gc.collect()
        done.set()

    t = threading.Thread(target=drop_inside_the_lock, daemon=True)
    t.start()
    assert done.wait(20), "dropping an unread result waited for the file's lock"
    assert list(s.sessions()["name"]) == ["demo"]


def test_an_open_that_waits_for_another_process_does_not_stop_this_ones_threads(tmp_path, monkeypatch):
    """While one thread retries the open of a file another process holds, other threads of this process
    still use the file's bookkeeping (the old code retried with its lock held, so they waited the whole wait)."""
    db = tmp_path / "held.duckdb"
    s = Store(db)
    _session(s, "demo")
    s.close()
    assert not is_open(db)
    retrying, gave_up_or_opened = threading.Event(), threading.Event()
    real = store_files._connect

    def connect(*a, **kw):
        retrying.set()
        try:
            return real(*a, **kw)
        finally:
            gave_up_or_opened.set()

    monkeypatch.setattr(store_files, "_connect", connect)
    holder = _raw_holder(db)
    outcome: list = []
    try:
        reader = threading.Thread(target=lambda: outcome.append(_try_read(Store(db, lock_wait=8))), daemon=True)
        reader.start()
        assert retrying.wait(20)
        with s.held():  # takes the file's lock: at once, while the reader is still retrying
            assert not gave_up_or_opened.is_set()
        s.close()
        assert not gave_up_or_opened.is_set()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    reader.join(30)
    assert outcome == [["demo"]]  # the holder went: the waiting read went through


def _try_read(s):
    try:
        return [r[0] for r in s.sql("SELECT name FROM sessions").fetchall()]
    except DatabaseLocked as e:
        return str(e)


def test_close_all_while_a_read_runs_keeps_one_connection_per_file(tmp_path):
    """``close_all`` during an operation closes what is idle and forgets nothing: a ``Store`` made meanwhile
    shares the file's connection and locks, and a write from another thread waits for the read, then goes."""
    s = Store(tmp_path / "busy.duckdb", lock_wait=10)
    _session(s, "demo")
    errors: list = []
    with s.reading() as cur:
        close_all()
        again = Store(s.path, lock_wait=10)
        assert again._file is s._file
        assert is_open(s.path)  # the read's connection was in use: kept

        def write():
            try:
                _session(again, "second")
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        t = threading.Thread(target=write)
        t.start()
        assert cur.execute("SELECT count(*) FROM sessions").fetchone() == (1,)
    t.join(30)
    assert errors == [] and sorted(s.sessions()["name"]) == ["demo", "second"]
    assert not is_open(s.path)


def test_close_all_closes_what_is_idle(tmp_path):
    s = Store(tmp_path / "idle.duckdb")
    with s.held():
        s.sessions()
        assert is_open(s.path)
    with s.held():
        s.sessions()
        close_all()
        assert not is_open(s.path)
    with pytest.raises(Exception):
        s.sql("SELECT * FROM no_such_table").fetchall()
    assert not is_open(s.path)


def test_a_capture_writes_and_diagnoses_its_session_through_few_opens(tmp_path, monkeypatch):
    """A capture's exit writes the session and diagnoses it inside one ``Store.writing()`` block: the file is
    opened once, read-write, not once per operation (five times on a new database before, nine on one in
    use), and the session is whole and diagnosed."""
    import torch
    import torch.nn as nn

    import precision_lab

    opened = []
    real = store_files._connect
    monkeypatch.setattr(store_files, "_connect", lambda path, ro, *a, **k: opened.append(ro) or real(path, ro, *a, **k))
    db = tmp_path / "cap.duckdb"
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with precision_lab.capture(model, run="r", store=str(db)):
        model(torch.randn(3, 4))
        opened.clear()  # what the exit opens
    assert opened == [False], opened  # one read-write open
    store_mod.close_all()
    s = store_mod.Store(db)
    assert s.undiagnosed_sessions() == [] and len(s.sessions()) == 1
