"""Writers that meet each other: two re-runs of one fix at once get two names, and a verify that meets another
process's lock says so (exit 2) instead of passing it off as a verdict on the fix."""

from __future__ import annotations

import threading

import pytest
from typer.testing import CliRunner

from precision_lab.cli import app
from precision_lab.services.rerun import capture_recipe, rerun_session
from precision_lab.store import DatabaseLocked
from precision_lab.store import queries as q


@pytest.fixture
def recipe_session(store):
    return capture_recipe(store, "softmax-fp16-overflow")


def test_two_reruns_of_one_fix_at_once_get_two_names(store, recipe_session):
    got, errors = [], []
    go = threading.Barrier(2)

    def one():
        try:
            go.wait()
            got.append(rerun_session(store, recipe_session, "stable-softmax"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(got) == 2
    runs = q.session_runs(store, store.session(recipe_session).session_id)
    names = sorted(r.name for r in runs if r.kind == "rerun")
    assert names == ["fix: stable-softmax", "fix: stable-softmax (2)"]


def test_verify_that_meets_a_lock_exits_2_with_the_lock_sentence(store, recipe_session, monkeypatch):
    from precision_lab.services import verify

    def locked(*a, **k):
        raise DatabaseLocked(f"database {store.path} is locked by another process (pid 4242: precision-lab "
                             "ingest a/b); waited 5 s")

    monkeypatch.setattr(verify, "rerun_session", locked)
    res = CliRunner().invoke(app, ["verify", "--session", recipe_session, "--db", store.path])
    assert res.exit_code == 2, res.output
    assert "locked by another process" in res.output and "works" not in res.output and "cannot" not in res.output


# ---- a full disk: one sentence, exit 2, nothing half-stored; a revocation still takes effect ---------------

def test_a_full_disk_during_ingest_is_one_sentence_and_stores_nothing(tmp_path, monkeypatch):
    import duckdb

    from precision_lab import store as store_mod
    from precision_lab.paths import samples_dir

    dump = next(p for p in sorted(samples_dir().iterdir()) if p.is_dir())

    def full(self):
        raise duckdb.IOException(f'IO Error: Could not write file "{tmp_path}/x.wal": No space left on device')

    monkeypatch.setattr(store_mod.SessionWriter, "flush", full)
    db = tmp_path / "full.duckdb"
    res = CliRunner().invoke(app, ["ingest", str(dump), "--db", str(db)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: the disk is full, so nothing of this command was stored")
    monkeypatch.undo()
    assert store_mod.Store(db).df("SELECT * FROM sessions").empty


def test_a_revocation_that_cannot_be_written_still_takes_effect(store, monkeypatch):
    import errno

    from precision_lab import tokens
    from precision_lab.services.share import create_share_token
    from test_share import make_session

    make_session(store, "a")
    make_session(store, "b")
    ta, tb = create_share_token(store, "a"), create_share_token(store, "b")
    assert store.session_by_token(ta).name == "a"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tokens, "write_private_json", full)
    res = CliRunner().invoke(app, ["share-link", "--session", "a", "--revoke", "--db", store.path])
    assert res.exit_code == 2, res.output
    assert "every share link of this database is revoked" in res.output
    assert store.session_by_token(ta) is None and store.session_by_token(tb) is None  # closed, not left open


def test_a_session_cut_off_before_its_diagnosis_is_found_and_repaired_by_check(store):
    from precision_lab.services.report import build_report
    from test_share import make_session

    make_session(store, "cut")  # written, never diagnosed: what a writer killed after its insert leaves
    assert store.undiagnosed_sessions() == ["cut"]
    res = CliRunner().invoke(app, ["check", "--db", store.path])
    assert res.exit_code == 0 and "cut: diagnosed: " in res.output, res.output
    assert store.undiagnosed_sessions() == [] and build_report(store, "cut").diagnoses
    res = CliRunner().invoke(app, ["check", "--db", store.path])
    assert "nothing to repair" in res.output


def test_the_lock_sentence_keeps_a_holder_command_holding_slashes(tmp_path):
    import subprocess
    import sys

    from precision_lab.store import Store, close_all

    db = tmp_path / "h.duckdb"
    Store(db)
    close_all()
    script = tmp_path / "holder.py"
    script.write_text("import sys, duckdb\ncon = duckdb.connect(sys.argv[-1])\nprint('ready', flush=True)\n"
                      "sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, str(script), "--db=/srv/x/given.duckdb", "1/2\x1b[2J", str(db)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(DatabaseLocked) as e:
            Store(db, lock_wait=0.2)
        msg = str(e.value)
        assert "\x1b" not in msg and "\n" not in msg
        # the command's own words, an absolute path by its last name, a slash inside a word kept
        assert f"process {holder.pid} (python" in msg and "holder.py --db=given.duckdb 1/2\\x1b[2J)" in msg, msg
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
