"""The scratch folder: private per-use folders under one root, swept of what killed processes left."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precision_lab.scratch import is_scratch_name, owner_alive, scratch_dir, scratch_root, sweep

ROOT = Path(__file__).resolve().parents[1]


def test_root_follows_the_setting_else_the_data_directory(tmp_path, monkeypatch):
    from precision_lab.config import ServerConfig

    assert scratch_root(ServerConfig(work_dir=str(tmp_path / "w"))) == tmp_path / "w"
    # conftest points XDG_DATA_HOME into the test's tmp folder
    assert scratch_root(ServerConfig()) == tmp_path / "xdg" / "precision-lab" / "scratch"
    monkeypatch.setenv("PRECISION_LAB_WORK_DIR", str(tmp_path / "env"))
    assert scratch_root() == tmp_path / "env"
    monkeypatch.setenv("PRECISION_LAB_MAX_UPLOAD_MB", "lots")  # an unreadable setting gives the default root
    assert scratch_root() == tmp_path / "xdg" / "precision-lab" / "scratch"


def test_scratch_dir_is_private_named_by_its_owner_and_removed(tmp_path):
    root = tmp_path / "root"
    with scratch_dir("upload", root=root) as d:
        assert d.parent == root and d.is_dir()
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        assert d.name.startswith(f"upload-{os.getpid()}-") and is_scratch_name(d.name)
        (d / "sub").mkdir()
        (d / "sub" / "f.npy").write_bytes(b"x")
        assert sweep(root) == []  # its owner runs: kept
    assert not d.exists()
    with pytest.raises(RuntimeError):
        with scratch_dir("extract", root=root) as d2:
            (d2 / "f").write_bytes(b"1")
            raise RuntimeError("ingest failed")
    assert not d2.exists() and list(root.iterdir()) == []
    with pytest.raises(ValueError, match="prefix"):
        with scratch_dir("../up", root=root):
            pass


def test_configured_root_is_used(tmp_path):
    from precision_lab.config import ServerConfig

    with scratch_dir("import", ServerConfig(work_dir=str(tmp_path / "work"))) as d:
        assert d.parent == tmp_path / "work"


_CHILD = """
import sys, time
from precision_lab.scratch import scratch_dir
with scratch_dir("upload", root=sys.argv[1]) as d:
    (d / "candidate").mkdir()
    (d / "candidate" / "dump.zip").write_bytes(b"x" * 4096)
    print(d, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_a_folder_left_by_a_killed_process_is_swept(tmp_path):
    root = tmp_path / "root"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root)], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
    try:
        left = Path(child.stdout.readline().strip())
        assert left.is_dir() and left.parent == root
        assert sweep(root) == [] and left.is_dir()  # while it runs, its folder stays
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    assert left.is_dir()  # kill -9 left it behind
    assert sweep(root) == [left]
    assert not left.exists() and list(root.iterdir()) == []


def test_old_folders_are_swept_by_age_live_ones_kept(tmp_path):
    root = tmp_path / "root"
    with scratch_dir("upload", root=root) as old, scratch_dir("upload", root=root) as fresh:
        day_ago = time.time() - 25 * 3600
        os.utime(old, (day_ago, day_ago))
        assert sweep(root) == [old]  # older than a day: removed although its owner runs
        assert fresh.is_dir()
        assert sweep(root, max_age_s=3600, now=time.time() + 7200) == [fresh]


def test_a_reused_process_id_is_not_taken_for_the_owner(tmp_path):
    root = tmp_path / "root"
    me = os.getpid()
    alive = root / f"upload-{me}-0-abcdefgh"  # start time unknown: the id alone decides
    reused = root / f"upload-{me}-1-abcdefgh"  # this process did not start at tick 1
    for p in (alive, reused):
        p.mkdir(parents=True)
    assert owner_alive(me) and not owner_alive(2 ** 22 + 12345)
    removed = sweep(root)
    if Path("/proc/self/stat").exists():
        assert removed == [reused]
    assert alive.is_dir()


def test_links_are_removed_as_links_and_nothing_outside_is_touched(tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "data.txt").write_text("precious")
    (outside / "file.txt").write_text("precious too")
    root.mkdir()
    gone = 2 ** 22 + 12345  # no such process
    link_dir = root / f"upload-{gone}-0-abcdefgh"
    link_dir.symlink_to(outside / "keep", target_is_directory=True)
    link_file = root / f"extract-{gone}-0-ijklmnop"
    link_file.symlink_to(outside / "file.txt")
    # a dead owner's folder holding a link out: the link goes, its target stays
    dead = root / f"upload-{gone}-0-qrstuvwx"
    dead.mkdir()
    (dead / "escape").symlink_to(outside, target_is_directory=True)
    # entries not named like scratch folders are not this sweep's to remove, however old
    foreign = root / "someone-elses"
    foreign.mkdir()
    os.utime(foreign, (0, 0))

    removed = sweep(root, max_age_s=0)
    assert sorted(removed) == sorted([link_dir, link_file, dead])
    assert not os.path.lexists(link_dir) and not os.path.lexists(link_file) and not dead.exists()
    assert (outside / "keep" / "data.txt").read_text() == "precious"
    assert (outside / "file.txt").read_text() == "precious too"
    assert foreign.is_dir()


def test_sweep_of_a_missing_root_is_empty(tmp_path):
    assert sweep(tmp_path / "nowhere") == []


def test_an_upload_sweeps_and_leaves_nothing(store, tmp_path, monkeypatch):
    from precision_lab.config import ServerConfig
    from precision_lab.ui.sessions import IngestFailed, ingest_upload

    cfg = ServerConfig(work_dir=str(tmp_path / "work"))
    leftover = tmp_path / "work" / f"upload-{2 ** 22 + 12345}-0-abcdefgh"
    (leftover / "candidate").mkdir(parents=True)
    with pytest.raises(IngestFailed):
        ingest_upload(store, [("junk/notes.txt", b"hello")], config=cfg)
    assert list((tmp_path / "work").iterdir()) == []  # the leftover swept, this upload's folder removed


def test_the_dashboard_sweeps_once_per_process(tmp_path, monkeypatch):
    import streamlit as st

    from precision_lab.store import close_all
    from ui_fixtures import app_test, assert_clean

    monkeypatch.setenv("PRECISION_LAB_DB", str(tmp_path / "app.duckdb"))
    root = scratch_root()
    leftover = root / f"upload-{2 ** 22 + 12345}-0-abcdefgh"
    (leftover / "candidate").mkdir(parents=True)
    st.cache_resource.clear()
    try:
        at = app_test()
        at.run()
        assert_clean(at)
        assert not leftover.exists()
        leftover.mkdir()  # the sweep is cached for the process: a second page run does not repeat it
        at.run()
        assert leftover.exists()
    finally:
        st.cache_resource.clear()
        close_all()
