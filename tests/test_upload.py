"""Uploads are written safely and turned into sessions; samples pair with their reference."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from precision_lab.ui.sessions import IngestFailed, ingest_upload, open_sample, sample_session_name
from precision_lab.services.samples import list_samples
from precision_lab.services.upload import UploadedItem, UploadError, upload_key, write_upload

from ui_fixtures import STAT_CAND, STAT_REF, msprobe_tensor_entries


def _folder_items(folder: Path) -> list[tuple[str, bytes]]:
    # a browser directory upload names each file by its path inside the chosen folder
    return [(f"{folder.name}/{p.relative_to(folder).as_posix()}", p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()]


def test_directory_upload_keeps_relative_paths(tmp_path):
    items = _folder_items(STAT_CAND)
    root = write_upload(items, tmp_path / "up")
    assert root == (tmp_path / "up" / STAT_CAND.name).resolve()
    for name, data in items:
        assert (tmp_path / "up" / name).read_bytes() == data


def test_files_without_a_shared_folder_go_under_default_name(tmp_path):
    root = write_upload([("a.npy", b"1"), ("b/c.npy", b"2")], tmp_path / "up", default_name="candidate")
    assert root == (tmp_path / "up" / "candidate").resolve()
    assert (root / "a.npy").read_bytes() == b"1" and (root / "b" / "c.npy").read_bytes() == b"2"


def test_single_zip_is_written_as_is(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("d/x.npy", b"abc")
    out = write_upload([UploadedItem("dump.zip", buf.getvalue())], tmp_path / "up")
    assert out.name == "dump.zip" and out.read_bytes() == buf.getvalue()


@pytest.mark.parametrize("name, words", [
    ("../evil.npy", "leaves the upload folder"),
    ("d/../../evil.npy", "leaves the upload folder"),
    ("/etc/passwd", "absolute path"),
    ("C:/windows/x.npy", "absolute path"),
    ("d\\..\\..\\x.npy", "leaves the upload folder"),
    ("d/x\x00.npy", "NUL"),
])
def test_unsafe_names_are_refused_before_anything_is_written(tmp_path, name, words):
    with pytest.raises(UploadError) as e:
        write_upload([("d/ok.npy", b"1"), (name, b"2")], tmp_path / "up")
    assert words in str(e.value)
    assert repr(name) in str(e.value)  # the message names the file
    assert not (tmp_path / "up").exists()


def test_duplicates_depth_and_file_folder_clash_are_refused(tmp_path):
    with pytest.raises(UploadError, match="more than once"):
        write_upload([("d/a.npy", b"1"), ("d/./a.npy", b"2")], tmp_path / "u1")
    with pytest.raises(UploadError, match="nested 4 folders deep"):
        write_upload([("a/b/c/d/e.npy", b"1")], tmp_path / "u2", max_depth=3)
    with pytest.raises(UploadError, match="also used as a folder"):
        write_upload([("d/a", b"1"), ("d/a/b.npy", b"2")], tmp_path / "u3")
    with pytest.raises(UploadError, match="nothing was uploaded"):
        write_upload([], tmp_path / "u4")


def test_upload_key_is_stable_and_order_free():
    class F:
        def __init__(self, fid):
            self.file_id, self.name, self.size = fid, "x", 1

    assert upload_key([F("b"), F("a")]) == upload_key([F("a"), F("b")]) == ("a", "b")


def test_samples_pair_low_precision_with_fp32_reference(tmp_path):
    for n in ("m_fp16_x", "m_fp32_x", "bf16_only", "recipe_dump"):
        (tmp_path / n).mkdir()
    got = {s.name: s for s in list_samples(tmp_path)}
    assert set(got) == {"m_fp16_x", "bf16_only", "recipe_dump"}  # the reference is not listed alone
    assert got["m_fp16_x"].reference == tmp_path / "m_fp32_x"
    assert got["bf16_only"].reference is None and got["recipe_dump"].reference is None
    real = {s.name: s for s in list_samples()}
    assert real[STAT_CAND.name].reference == STAT_REF


def test_ingest_upload_builds_the_pair_session(store, tmp_path):
    name = ingest_upload(store, _folder_items(STAT_CAND), _folder_items(STAT_REF), session="up")
    assert name == "up"
    sid = store.session("up").session_id
    runs = store.runs(sid)
    assert sorted(runs["kind"]) == ["candidate", "reference"]
    # one record per tensor entry in each dump.json, counted independently of the reader
    n_cand = len(msprobe_tensor_entries(next(STAT_CAND.rglob("dump.json"))))
    counts = store.df("SELECT r.kind, count(*) AS n FROM tensors t JOIN runs r USING (run_id) "
                      "WHERE r.session_id = ? GROUP BY r.kind", [sid])
    assert int(counts.set_index("kind").loc["candidate", "n"]) == n_cand


def test_ingest_upload_failure_is_a_sentence_and_writes_nothing(store):
    with pytest.raises(IngestFailed) as e:
        ingest_upload(store, [("junk/notes.txt", b"hello")])
    assert "junk" in str(e.value) and "no tensor files" in str(e.value)
    with pytest.raises(IngestFailed, match="leaves the upload folder"):
        ingest_upload(store, [("../x/dump.json", b"{}")])
    assert store.sessions().empty


@pytest.mark.slow
def test_open_sample_reuses_its_session(store):
    sample = next(s for s in list_samples() if s.name == STAT_CAND.name)
    first = open_sample(store, sample)
    assert first == sample_session_name(sample)
    assert open_sample(store, sample) == first
    assert len(store.sessions()) == 1
