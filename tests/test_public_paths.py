"""No server path reaches a browser: sources and upload errors name files relative to the upload."""

from __future__ import annotations

import io
import tempfile
import zipfile
from pathlib import Path

import pytest

from precision_lab.public import public_source, public_text
from precision_lab.ui.common import escape_md

from ui_fixtures import app_test, assert_clean, empty_db, texts  # noqa: F401  (empty_db: a fixture)

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened


@pytest.mark.parametrize("stored, shown", [
    ("candidate: /home/u/.local/share/precision-lab/scratch/upload-4242-998-abcdefgh/candidate/my_dump.zip",
     "candidate: my_dump.zip"),
    ("candidate: /tmp/precision-lab-upload-x1y2z3ab/candidate/dump; "
     "reference: /tmp/precision-lab-upload-x1y2z3ab/reference/dump_fp32",
     "candidate: dump; reference: dump_fp32"),
    ("candidate: /tmp/precision-lab-upload-x1y2z3ab/candidate/candidate", "candidate: candidate"),
    ("/srv/work/extract-77-0-abc_efgh/my_dump", "my_dump"),
    ("candidate: /home/alice/dumps/run1", "candidate: run1"),
    ("C:\\Users\\alice\\dumps\\run1", "run1"),
    ("../../etc/x", "x"),
    ("dumps/run1", "dumps/run1"),
    ("capture", "capture"),
    ("candidate: my_dump.zip", "candidate: my_dump.zip"),
    (None, ""),
])
def test_public_source(stored, shown):
    assert public_source(stored) == shown


def test_public_text_takes_server_folders_out_of_messages():
    root = "/srv/my data/scratch"  # a configured root may hold spaces
    msg = (f"'{root}/upload-12-34-abcdefgh/candidate/dump.zip' cannot be read; "
           "/tmp/precision-lab-q1w2e3r4/dump/step0/a.npy: corrupt .npy header")
    out = public_text(msg, [root])
    assert out == "'dump.zip' cannot be read; dump/step0/a.npy: corrupt .npy header"
    assert public_text("error in /etc/passwd and a/b") == "error in /etc/passwd and a/b"


def _zip(entries: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _npy(arr) -> bytes:
    import numpy as np

    b = io.BytesIO()
    np.save(b, np.asarray(arr))
    return b.getvalue()


def _server_paths(text: str, store) -> list[str]:
    from precision_lab.scratch import scratch_root

    folders = (str(scratch_root()), tempfile.gettempdir(), "precision-lab-upload-", str(Path(store.path).parent))
    return [p for p in folders if p in text]


def test_upload_sources_name_the_upload(store):
    import numpy as np

    from precision_lab.ui.overview import runs_table
    from precision_lab.ui.sessions import ingest_upload, sessions_table

    name = ingest_upload(store, [("my_dump.zip", _zip({"dump/x.npy": _npy(np.ones(4, np.float16))}))])
    info = store.session(name)
    assert info.source == "candidate: my_dump.zip"  # stored as the visitor named it
    assert list(sessions_table(store)["source"]) == ["candidate: my_dump.zip"]
    assert list(runs_table(store, info.session_id)["source"]) == ["my_dump.zip"]


def test_upload_errors_are_one_sentence_naming_the_upload(store, monkeypatch):
    import precision_lab.services.ingest as ingest_mod
    from precision_lab.ui.sessions import IngestFailed, ingest_upload

    with pytest.raises(IngestFailed) as e:
        ingest_upload(store, [("broken.zip", _zip({"dump/a.npy": _npy([1.0, 2.0])[:-3]}))])
    assert "a.npy" in str(e.value) and "broken.zip" in str(e.value)
    assert not _server_paths(str(e.value), store)

    # whatever a library raises, the visitor reads the upload's name and the problem
    def boom(paths, **kw):
        raise RuntimeError(f"unexpected state of {paths[0]}")

    monkeypatch.setattr("precision_lab.ui.sessions.ingest", boom)
    with pytest.raises(IngestFailed) as e:
        ingest_upload(store, [("dump/x.npy", b"1")])
    msg = str(e.value)
    assert msg.startswith("dump: could not be ingested (unexpected state of dump)"), msg
    assert not _server_paths(msg, store)

    def no_memory(paths, **kw):
        raise MemoryError()

    monkeypatch.setattr("precision_lab.ui.sessions.ingest", no_memory)
    with pytest.raises(IngestFailed, match=r"^my\.zip: needs more memory"):
        ingest_upload(store, [("my.zip", b"PK")])
    assert store.sessions().empty


@pytest.mark.slow
def test_browser_sees_no_server_path(empty_db, monkeypatch):
    """Upload through the page: the Runs table and the Sessions table show the upload's name; an
    upload error is one sentence naming the file, never 'This page could not be shown'."""
    import numpy as np

    from precision_lab.store import Store

    at = app_test()
    at.run()
    at.button_group(key="up_cand_kind").set_value(".zip").run()
    at.file_uploader(key="up_cand_zip").set_value(
        ("my_dump.zip", _zip({"dump/x.npy": _npy(np.ones(4, np.float16))}), "application/zip"))
    at.run()
    at.button(key="ingest").click().run()
    assert_clean(at)
    runs = next(d.value for d in at.dataframe if "source" in d.value.columns)
    assert list(runs["source"]) == ["my_dump.zip"]
    assert not _server_paths(texts(at), Store(empty_db))

    at = app_test()
    at.run()
    sessions = next(d.value for d in at.dataframe if "source" in d.value.columns)
    assert list(sessions["source"]) == ["candidate: my_dump.zip"]

    import precision_lab.services.ingest as ingest_mod

    def boom(paths, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("precision_lab.ui.sessions.ingest", boom)
    at.button_group(key="up_cand_kind").set_value(".zip").run()
    at.file_uploader(key="up_cand_zip").set_value(("other.zip", b"PK\x05\x06" + b"\0" * 18, "application/zip"))
    at.run()
    at.button(key="ingest").click().run()
    assert_clean(at)
    err = at.error[0].value
    assert err == escape_md("The upload could not be ingested: other.zip: cannot be stored on the server for "
                            "reading (No space left on device)")
    assert "could not be shown" not in texts(at)


def test_legacy_sources_are_shown_without_the_server_folder(empty_db):
    """Sessions stored with a server path (before uploads were labelled) still show only the upload's name."""
    from precision_lab.store import Store, close_all

    with Store(empty_db).new_session("old", source="candidate: /tmp/precision-lab-upload-abcd1234/candidate/old_dump"):
        pass  # a session without runs is enough for the list
    close_all()
    at = app_test()
    at.run()
    assert_clean(at)
    sessions = next(d.value for d in at.dataframe if "source" in d.value.columns)
    assert list(sessions["source"]) == ["candidate: old_dump"]
    assert "precision-lab-upload" not in texts(at)


def test_import_failure_is_a_sentence_naming_the_file(empty_db, monkeypatch):
    import precision_lab.services.share as share

    def boom(store, source, **kw):
        raise RuntimeError("disk I/O error while writing /tmp/precision-lab-q1w2e3r4/session.zip")

    monkeypatch.setattr(share, "import_session", boom)
    at = app_test()
    at.run()
    at.file_uploader(key="import_zip").set_value(("team.zip", b"PK\x05\x06" + b"\0" * 18, "application/zip"))
    at.run()
    at.button(key="import_session").click().run()
    assert_clean(at)
    assert at.error[0].value == escape_md("The file could not be imported: team.zip: disk I/O error while "
                                          "writing session.zip")


def test_an_export_and_a_report_carry_no_path_of_the_sharers_machine(store):
    import io
    import zipfile

    import pyarrow.parquet as pq

    from precision_lab.services.share import export_bytes
    from precision_lab.ui.html_report import render_html
    from test_share import make_session

    make_session(store, "demo")
    home = "/home/zqxuser/secret-project"
    store.sql(f"UPDATE runs SET source = '{home}/dumps/fp16'").fetchall()
    store.sql(f"UPDATE sessions SET source = 'candidate: {home}/dumps/fp16; reference: {home}/dumps/fp32', "
              f"recipe = 'model:{home}/m.py:build,{home}/m.py:inputs'").fetchall()
    zf = zipfile.ZipFile(io.BytesIO(export_bytes(store, "demo")))
    texts = []
    for name in zf.namelist():
        if name.endswith(".parquet"):
            t = pq.read_table(io.BytesIO(zf.read(name)))
            texts += [str(v) for c in t.columns for v in c.to_pylist() if isinstance(v, str)]
    assert texts and not [t for t in texts if "zqxuser" in t]
    runs = pq.read_table(io.BytesIO(zf.read("runs.parquet"))).to_pylist()
    assert {r["source"] for r in runs} == {"fp16"}  # the folder by its name: enough to tell runs apart
    sessions = pq.read_table(io.BytesIO(zf.read("sessions.parquet"))).to_pylist()
    assert sessions[0]["recipe"] == "model:m.py:build,m.py:inputs"
    assert "zqxuser" not in render_html(store, "demo") and "secret-project" not in render_html(store, "demo")
