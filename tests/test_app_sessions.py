"""AppTest: the Sessions page -- empty start, uploads, samples, rename and delete."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from precision_lab.records import RunInfo
from precision_lab.ui.common import escape_md

from ui_fixtures import (STAT_CAND, STAT_FIRST_NONFINITE, STAT_REF, STAT_SESSION, TENSOR_SESSION,  # noqa: F401
                         TIMELINE_SESSION,
                         app_test, assert_clean, empty_db, frames, texts, ui_db, ui_template)


def _dir_files(folder: Path) -> list[tuple[str, bytes, str]]:
    return [(f"{folder.name}/{p.relative_to(folder).as_posix()}", p.read_bytes(), "application/octet-stream")
            for p in sorted(folder.rglob("*")) if p.is_file()]


def _store(db):
    from precision_lab.store import Store

    return Store(db)


def test_empty_database_invites_upload_and_samples(empty_db):
    at = app_test()
    at.run()
    assert_clean(at)
    assert "No sessions yet" in at.info[0].value
    ups = {u.key: u for u in at.file_uploader}
    assert ups["up_cand_dir"].accept_directory and ups["up_ref_dir"].accept_directory
    assert at.button(key="ingest").disabled  # nothing chosen yet
    assert any(b.label.startswith(f"Open sample: {STAT_CAND.name}") for b in at.button)


def test_a_read_only_server_visited_without_a_token_never_invites_an_upload(empty_db, monkeypatch):
    from precision_lab.ui.page import page_script

    monkeypatch.setenv("PRECISION_LAB_READ_ONLY", "1")
    for listing in ("0", "1"):  # sessions hidden (the default), or listed on an empty database
        monkeypatch.setenv("PRECISION_LAB_LIST_SESSIONS", listing)
        at = app_test()
        at.run()
        assert_clean(at)
        for page in ("sessions", "overview", "op_detail", "ops", "diff", "timeline"):
            if page != "sessions":
                at.switch_page(page_script(page)).run()
                assert_clean(at)
            said = " ".join(i.value for i in at.info)
            assert "read-only" in said and "upload" not in said.lower() and "sample" not in said.lower(), (page, said)
            assert not at.file_uploader and not [b for b in at.button if (b.key or "").startswith("sample_")]


@pytest.mark.slow
def test_open_sample_in_one_click_lands_on_its_overview(empty_db):
    at = app_test()
    at.run()
    at.button(key=f"sample_{STAT_CAND.name}").click().run()
    assert_clean(at)
    assert at.title[0].value.startswith("Overview")
    assert escape_md(STAT_FIRST_NONFINITE) in texts(at)
    sessions = _store(empty_db).sessions()
    assert list(sessions["runs"]) == [2]


@pytest.mark.slow
def test_directory_upload_with_reference(empty_db):
    at = app_test()
    at.run()
    at.file_uploader(key="up_cand_dir").set_value(_dir_files(STAT_CAND))
    at.file_uploader(key="up_ref_dir").set_value(_dir_files(STAT_REF))
    at.run()
    at.button(key="ingest").click().run()
    assert_clean(at)
    name = f"{STAT_CAND.name}-vs-{STAT_REF.name}"
    assert at.query_params["session"] == name
    assert escape_md(STAT_FIRST_NONFINITE) in texts(at)
    runs = _store(empty_db).runs(_store(empty_db).session(name).session_id)
    assert sorted(runs["kind"]) == ["candidate", "reference"]


@pytest.mark.slow
def test_zip_upload(empty_db):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data, _ in _dir_files(STAT_CAND):
            zf.writestr(name, data)
    at = app_test()
    at.run()
    at.button_group(key="up_cand_kind").set_value(".zip").run()
    at.file_uploader(key="up_cand_zip").set_value(("cand.zip", buf.getvalue(), "application/zip"))
    at.text_input(key="new_session_name").input("zipped")
    at.run()
    at.button(key="ingest").click().run()
    assert_clean(at)
    assert at.query_params["session"] == "zipped"
    assert escape_md(STAT_FIRST_NONFINITE) in texts(at)


def test_bad_uploads_give_a_sentence_and_no_session(empty_db):
    at = app_test()
    at.run()
    at.file_uploader(key="up_cand_dir").set_value([("../escape/dump.json", b"{}", "application/json")])
    at.run()
    at.button(key="ingest").click().run()
    assert_clean(at)
    assert "leaves the upload folder" in at.error[0].value and "../escape/dump.json" in at.error[0].value
    at.file_uploader(key="up_cand_dir").set_value([("junk/readme.txt", b"hello", "text/plain")])
    at.run()
    at.button(key="ingest").click().run()
    assert_clean(at)
    assert "no tensor files" in at.error[0].value and "junk" in at.error[0].value
    assert _store(empty_db).sessions().empty


@pytest.mark.slow
def test_list_select_rename_and_delete_with_confirmation(ui_db):
    at = app_test()
    at.run()
    table = frames(at)[0]
    assert set(table["session"]) == {STAT_SESSION, TENSOR_SESSION, TIMELINE_SESSION}
    row = table.set_index("session").loc[STAT_SESSION]
    assert STAT_FIRST_NONFINITE in row["first non-finite"]

    at.selectbox(key="manage_session").set_value(TENSOR_SESSION)
    at.text_input(key="rename_to").input("renamed")
    at.run()
    at.button(key="rename").click().run()
    assert_clean(at)
    assert set(_store(ui_db).sessions()["name"]) == {STAT_SESSION, TIMELINE_SESSION, "renamed"}

    at.selectbox(key="manage_session").set_value("renamed")
    at.button(key="delete").click().run()
    assert "cannot be undone" in at.warning[0].value
    assert set(_store(ui_db).sessions()["name"]) == {STAT_SESSION, TIMELINE_SESSION, "renamed"}  # not yet
    at.button(key="delete_no").click().run()
    assert not at.warning and len(_store(ui_db).sessions()) == 3
    at.button(key="delete").click().run()
    at.button(key="delete_yes").click().run()
    assert_clean(at)
    assert set(_store(ui_db).sessions()["name"]) == {STAT_SESSION, TIMELINE_SESSION}

    # selecting a row opens the session's overview
    row = list(frames(at)[0]["session"]).index(STAT_SESSION)
    at.session_state["sessions_table"] = {"selection": {"rows": [row], "columns": [], "cells": []}}
    at.run()
    assert at.title[0].value.startswith("Overview") and at.query_params["session"] == STAT_SESSION


def test_rename_to_an_existing_name_is_refused(ui_db):
    at = app_test()
    at.run()
    at.selectbox(key="manage_session").set_value(TENSOR_SESSION)
    at.text_input(key="rename_to").input(STAT_SESSION)
    at.run()
    at.button(key="rename").click().run()
    assert_clean(at)
    assert "already exists" in at.error[0].value


def test_bad_server_setting_is_a_sentence(empty_db, monkeypatch):
    monkeypatch.setenv("PRECISION_LAB_MAX_UPLOAD_MB", "lots")
    at = app_test()
    at.run()
    assert_clean(at)
    assert escape_md("PRECISION_LAB_MAX_UPLOAD_MB") in at.error[0].value and "integer" in at.error[0].value


def test_unexpected_library_error_is_a_sentence_not_a_traceback(empty_db, monkeypatch):
    import precision_lab.ui.sessions as sessions_vm

    def broken(store, **kw):
        raise RuntimeError("database is locked by another process")

    monkeypatch.setattr(sessions_vm, "sessions_table", broken)
    at = app_test()
    at.run()
    assert_clean(at)
    assert at.error[0].value == escape_md("This page could not be shown: database is locked by another process")


@pytest.mark.slow
def test_the_dashboard_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, runpy\n"
            "import precision_lab.ui.page, precision_lab.ui.overview, precision_lab.ui.ops, precision_lab.ui.detail\n"
            "import precision_lab.ui.diff, precision_lab.ui.sessions, precision_lab.services.report\n"
            "from precision_lab.store import Store\n"
            "Store(':memory:')\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.slow
def test_session_headlines_are_cached_until_a_run_is_added(ui_db):
    """The Sessions list caches each session's headline on its runs: a second render reuses it, and a run added
    to the session (a re-run) shows at once."""
    import numpy as np

    from precision_lab.records import TensorRecord
    from precision_lab.stats import tensor_stats
    from precision_lab.ui import sessions as sv

    store = _store(ui_db)
    calls = []

    def counting(sid, version):
        calls.append(sid)
        return {"first_nonfinite": f"v{version[0]}", "worst": "-"}

    first = sv.sessions_table(store, headline=counting)
    assert len(calls) == len(first)
    at = app_test()
    at.run()
    before = frames(at)[0].set_index("session").loc[TENSOR_SESSION, "first non-finite"]
    with store.extend_session(TENSOR_SESSION) as w:
        run = w.add_run(name="fp16-again", dtype="float16", kind="candidate")
        w.add_record(TensorRecord(run_id=run, seq=0, op="blocks.9.late", op_type="Linear", role="output",
                                  index="0", stats=tensor_stats(np.array([np.inf, 1.0], np.float32))))
    at.run()
    after = frames(at)[0].set_index("session").loc[TENSOR_SESSION, "first non-finite"]
    assert "fp16-again: blocks.9.late" in after and "fp16-again" not in before
    versions = [sv.session_version(rs) for rs in ([], [RunInfo(run_id="a", session_id="s", name="a", created="1")])]
    assert versions[0] != versions[1]


def test_the_page_icon_is_served_by_this_server_so_it_shows_offline(empty_db, monkeypatch):
    """A material icon as the page icon is fetched by the browser from a font CDN; the icon is a file the server
    itself serves (Streamlit's media files), so an offline or air-gapped server shows it."""
    from streamlit.commands import page_config

    sent = []
    real = page_config._get_favicon_string

    def recording(icon):
        sent.append(real(icon))
        return sent[-1]

    monkeypatch.setattr(page_config, "_get_favicon_string", recording)
    at = app_test()
    at.run()
    assert_clean(at)
    assert sent, "the app sets no page icon"
    # this server's media endpoint (a path, no host), never a material icon the browser fetches elsewhere
    assert all("/media/" in s and s.startswith("/") and not s.startswith("//") for s in sent), sent


def test_a_session_stored_without_its_diagnoses_is_flagged_and_diagnosed_in_one_click(empty_db):
    """A writer killed between a session's insert and its diagnosis leaves it unmarked: the list says so, and
    the button does what ``precision-lab check`` does."""
    from test_share import make_session

    store = _store(empty_db)
    make_session(store, "cut")  # written, never diagnosed
    make_session(store, "whole")
    from precision_lab.services.diagnose import diagnose_session

    diagnose_session(store, "whole")
    at = app_test()
    at.run()
    assert_clean(at)
    (table,) = frames(at)
    assert dict(zip(table["session"], table["diagnosed"])) == {"cut": False, "whole": True}
    said = " ".join(w.value for w in at.warning)
    assert "1 session(s) were stored without their diagnoses" in said and "cut" in said and "whole" not in said
    at.button(key="check_sessions").click().run()
    assert_clean(at)
    assert not [w for w in at.warning if "without their diagnoses" in w.value]
    shown = " ".join(s.value for s in at.success).replace("\\", "")  # markdown-escaped
    assert store.undiagnosed_sessions() == [] and "cut: diagnosed: " in shown
