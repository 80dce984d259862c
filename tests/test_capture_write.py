"""A capture written to a database file: staged in this process's own database in memory, diagnosed there and
inserted with the file attached to it -- whole or not at all, the file free for other processes between
captures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import precision_lab
from precision_lab.services import capture_sink as capture_service
from precision_lab.store import Store, close_all, files, transfer
from precision_lab.store.transfer import TABLES

ROOT = Path(__file__).resolve().parents[1]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _step(model):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()


def _captured(db, run="r"):
    model = _model()
    with precision_lab.capture(model, run=run, store=str(db)) as cap:
        _step(cap.model)
    return cap


def _rows(db) -> dict:
    s = Store(db)
    return {t: s.sql(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}


def test_a_capture_into_a_file_is_stored_whole_with_its_diagnosis_and_opens_no_instance_for_the_file(
        tmp_path, monkeypatch):
    db = tmp_path / "c.duckdb"
    first = _captured(db, "one")
    opened = []
    real = files._connect
    monkeypatch.setattr(files, "_connect", lambda path, *a, **k: opened.append(path) or real(path, *a, **k))
    second = _captured(db, "two")
    assert opened == []  # the file attached to the staging database, unchanged since the first write checked it
    monkeypatch.setattr(files, "_connect", real)
    s = Store(db)
    assert sorted(s.sessions()["name"]) == ["one", "two"]
    assert s.undiagnosed_sessions() == []  # each went in with its diagnosis, in the same transaction
    for cap in (first, second):
        sid = s.session(cap.session).session_id
        run = s.runs(sid).iloc[0]
        got = s.sql("SELECT seq, op, role, \"index\", max FROM tensors WHERE run_id = ? ORDER BY rid",
                    [run.run_id]).fetchall()
        assert got == [(r.seq, r.op, r.role, r.index, r.stats.max) for r in cap.records]
        assert s.sql("SELECT count(*) FROM histograms WHERE run_id = ?", [run.run_id]).fetchone()[0] == \
            sum(r.stats.hist is not None for r in cap.records)
    # the same records as a capture kept in memory (one with no staging at all)
    mem = Store(":memory:")
    model = _model()
    with precision_lab.capture(model, run="mem", store=mem) as cap:
        _step(cap.model)
    assert [(r.seq, r.op, r.role, r.index, r.stats.max) for r in cap.records] == \
        [(r.seq, r.op, r.role, r.index, r.stats.max) for r in second.records]


@pytest.mark.parametrize("spare", [True, False], ids=["behind", "before-return"])
def test_a_write_that_fails_midway_leaves_nothing_in_the_file_and_an_empty_staging(tmp_path, monkeypatch, capsys,
                                                                                    spare):
    monkeypatch.setattr(capture_service, "spare_core", lambda: spare)
    db = tmp_path / "f.duckdb"
    _captured(db, "kept")
    before = _rows(db)
    close_all()
    real = transfer._select_list

    def failing(table, *a, **k):
        if table == "histograms":  # after sessions, runs and tensors went in
            raise OSError("disk full")
        return real(table, *a, **k)

    monkeypatch.setattr(transfer, "_select_list", failing)
    if spare:  # the insert runs behind the code after the block: its failure comes later
        lost = _captured(db, "lost")
        with pytest.raises(RuntimeError, match=r"session 'lost' could not be written to .*f\.duckdb: OSError: disk full"):
            lost.session
        assert "session 'lost' could not be written" in capsys.readouterr().err  # said once, unasked
    else:
        with pytest.raises(OSError, match="disk full"):
            _captured(db, "lost")
    monkeypatch.setattr(transfer, "_select_list", real)
    assert _rows(db) == before
    assert list(Store(db).sessions()["name"]) == ["kept"]
    after = _captured(db, "next")  # the staging was emptied: the next session holds its own rows only
    s = Store(db)
    run_id = s.runs(s.session(after.session).session_id).iloc[0]["run_id"]
    assert s.sql("SELECT count(*) FROM tensors WHERE run_id = ?", [run_id]).fetchone()[0] == len(after.records)
    assert _rows(db)["tensors"] == before["tensors"] + len(after.records)
    assert _rows(db)["runs"] == 2


@pytest.mark.slow  # a process of its own
def test_a_process_killed_in_the_middle_of_the_insert_leaves_the_file_as_it_was(tmp_path):
    db = tmp_path / "k.duckdb"
    _captured(db, "kept")
    before = _rows(db)
    close_all()
    code = textwrap.dedent(f"""
        import time, torch, torch.nn as nn
        import precision_lab
        from precision_lab.store import transfer
        real = transfer._select_list
        def stall(table, *a, **k):
            if table == "histograms":
                print("READY", flush=True)
                time.sleep(600)
            return real(table, *a, **k)
        transfer._select_list = stall
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        with precision_lab.capture(model, run="victim", store={str(db)!r}) as cap:
            cap.model(torch.randn(4, 8)).square().mean().backward()
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=str(ROOT))
    try:
        line = child.stdout.readline()
        assert line.strip() == "READY", child.stderr.read()[-2000:]
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()
        child.stderr.close()
    assert _rows(db) == before
    assert list(Store(db).sessions()["name"]) == ["kept"]


@pytest.mark.slow  # a process of its own
def test_another_process_writes_and_reads_the_file_between_two_captures(tmp_path):
    db = tmp_path / "m.duckdb"
    assert _captured(db, "first").session == "first"  # the name is there once the session is
    other = textwrap.dedent(f"""
        from precision_lab.store import Store
        s = Store({str(db)!r}, lock_wait=0)  # refused at once were the file held
        with s.new_session("from-another-process") as w:
            w.add_run(name="r")
        print(sorted(s.sessions()["name"]))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    got = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, env=env, cwd=str(ROOT),
                         timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip().splitlines()[-1] == "['first', 'from-another-process']"
    assert not files.is_open(str(db))
    # the other process's write changed the file: it is checked again, and written
    assert _captured(db, "second").session == "second"
    got = subprocess.run([sys.executable, "-c", other.replace("from-another-process", "again")],
                         capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip().splitlines()[-1] == "['again', 'first', 'from-another-process', 'second']"



def test_a_capture_written_inside_a_transaction_of_its_thread_on_the_file_is_part_of_it(tmp_path):
    db = tmp_path / "t.duckdb"
    s = Store(db, lock_wait=5)
    with s.transaction():
        cap = _captured(db, "inner")
        assert s.sql("SELECT name FROM sessions").fetchall() == [("inner",)]
    assert list(Store(db).sessions()["name"]) == ["inner"] and cap.session == "inner"


def _gated_insert(monkeypatch, spare: bool = True):
    """The next insert into a file waits at a gate once its sessions, runs and tensors rows are in; (gate, the
    event that it is waiting, the threads it ran on).  ``spare``: whether the capture finds a core its step leaves
    free (then it inserts behind the code after its block)."""
    monkeypatch.setattr(capture_service, "spare_core", lambda: spare)
    gate, waiting, threads = threading.Event(), threading.Event(), []
    real = transfer._select_list

    def held(table, *a, **k):
        if table == "histograms":
            threads.append(threading.get_ident())
            waiting.set()
            assert gate.wait(60)
        return real(table, *a, **k)

    monkeypatch.setattr(transfer, "_select_list", held)
    return gate, waiting, threads


def test_a_capture_inserts_its_session_behind_the_code_after_it_and_every_reader_sees_it_whole(tmp_path, monkeypatch):
    db = tmp_path / "b.duckdb"
    assert _captured(db, "first").session == "first"
    gate, waiting, threads = _gated_insert(monkeypatch)
    second = _captured(db, "second")  # the block has ended while its insert waits at the gate
    assert waiting.wait(30) and threads and threads[0] != threading.get_ident()
    # the file was taken before the block ended: another process cannot open it until the insert is done
    other = f"from precision_lab.store import Store; Store({str(db)!r}, lock_wait=0)"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    got = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, env=env, cwd=str(ROOT),
                         timeout=120)
    assert got.returncode != 0 and "is in use by process" in got.stderr
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    # this process's reads and its next capture wait for the insert, then see the session whole
    third = _captured(db, "third")
    assert time.monotonic() - t0 >= 0.25
    s = Store(db)
    assert sorted(s.sessions()["name"]) == ["first", "second", "third"]
    assert (second.session, third.session) == ("second", "third")
    for cap in (second, third):  # each session holds its own rows only: the staging was emptied between them
        run_id = s.runs(s.session(cap.session).session_id).iloc[0]["run_id"]
        assert s.sql("SELECT count(*) FROM tensors WHERE run_id = ?", [run_id]).fetchone()[0] == len(cap.records)
    assert s.undiagnosed_sessions() == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_fork_waits_for_an_insert_still_running(tmp_path, monkeypatch):
    db = tmp_path / "f.duckdb"
    assert _captured(db, "first").session == "first"
    gate, waiting, _ = _gated_insert(monkeypatch)
    _captured(db, "second")
    assert waiting.wait(30)
    threading.Timer(0.3, gate.set).start()
    pid = os.fork()
    if pid == 0:  # the child: the insert was done before the fork, and its file is free
        code = 1
        try:
            code = 0 if sorted(Store(db, lock_wait=5).sessions()["name"]) == ["first", "second"] else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_where_torch_takes_every_core_the_insert_runs_before_the_block_returns(tmp_path, monkeypatch):
    db = tmp_path / "s.duckdb"
    assert _captured(db, "first").session == "first"
    gate, waiting, threads = _gated_insert(monkeypatch, spare=False)
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    cap = _captured(db, "second")
    assert time.monotonic() - t0 >= 0.25 and threads == [threading.get_ident()]  # here, and waited for
    assert cap.session == "second" and sorted(Store(db).sessions()["name"]) == ["first", "second"]


def test_a_spare_core_is_one_torch_leaves(monkeypatch):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        assert capture_service.spare_core() is False
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert capture_service.spare_core() is True
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    torch.set_num_threads(cores)
    try:
        assert capture_service.spare_core() is True  # a GPU job: its CPU threads mostly wait for the device
    finally:
        torch.set_num_threads(before)
